#!/usr/bin/env bash
# The 2026 incident's bug planted in a real-model deployment, audited by `airlock canary`: a
# prompt over the prefill pool is swapped for a one-token placeholder and the transfer claimed
# complete, with or without the guards that stop it.
#
#   scripts/canary-red.sh            # guards off: over-pool prompts are answered 200 from
#                                    # stale KV (the guarded run answers them 400)
#   scripts/canary-red.sh verified   # admission off, transfer verification on: long prompts
#                                    # get 503 kv_transfer_failed
#   scripts/canary-red.sh guarded    # the same bug with the guards on: long prompts get 400
#
# What to read in the report: the `long` row and the leaks. Guarded, every long prompt gets 400
# (admission) and the run is clean; unguarded, every one gets 200, decoded from pages that held
# other tenants' prompts, and the model repeats their markers: the report names each leak with
# both request ids and the canary exits 1.
#
# Builds `airlock` with the test-only `fault-injection` feature into target/fault-injection
# (never the default build), then starts decode, prefill and router as three processes on
# loopback: prefill's pool (512 tokens) is smaller than the context (2048), as on the
# incident's node. About 5 minutes on 2 cores, most of it the build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

MODE="${1:-unguarded}"
REQUESTS="${REQUESTS:-40}"
CONCURRENCY="${CONCURRENCY:-4}"
case "$MODE" in
    unguarded)
        PREFILL_FAULTS="incident;no-admission"
        DECODE_FAULTS="no-transfer-verify"
        ;;
    verified)
        # Admission off as well: decode's transfer verification (I4) is what stops it.
        PREFILL_FAULTS="incident;no-admission"
        DECODE_FAULTS=""
        ;;
    guarded)
        # The incident's configuration (prefill's pool under the context, the start-up check
        # that would refuse it off) and its bug, with admission and verification on.
        PREFILL_FAULTS="incident;no-preflight"
        DECODE_FAULTS=""
        ;;
    *) echo "usage: $0 [unguarded|verified|guarded]" >&2; exit 2 ;;
esac

cargo build --release -p airlock --features fault-injection --target-dir target/fault-injection
AIRLOCK="$(pwd)/target/fault-injection/release/airlock-fault-injection"
MODEL="${AIRLOCK_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}"
DIR="$(mktemp -d)"
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    rm -rf "$DIR"
}
trap cleanup EXIT

head -c 32 /dev/urandom | base64 > "$DIR/secret"
keys=()
for t in 0 1 2 3; do
    key="sk-canary-$t-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
    keys+=("$key")
    printf '[tenants.t%s]\nkeys = ["%s"]\n' "$t" "$key" >> "$DIR/keys.toml"
done
common=(--model "$MODEL" --threads 1 --cluster-secret-file "$DIR/secret" --context-length 2048)

# start NAME FAULTS ARGS...: runs one process, waits for its "listening"/"serving" line.
start() {
    local name="$1" faults="$2"
    shift 2
    AIRLOCK_FAULTS="$faults" "$AIRLOCK" "$@" > "$DIR/$name.out" 2> "$DIR/$name.err" &
    PIDS+=($!)
    for _ in $(seq 1 120); do
        if grep -qE "listening on|is serving" "$DIR/$name.out"; then return; fi
        sleep 0.5
    done
    echo "$name did not start:" >&2
    cat "$DIR/$name.err" >&2
    exit 1
}
start decode "$DECODE_FAULTS" decode --port 38501 --kv-tokens 8192 "${common[@]}"
start prefill "$PREFILL_FAULTS" prefill --port 38502 --kv-tokens 512 "${common[@]}"
start router "" router --port 38500 --prefill 127.0.0.1:38502 --decode 127.0.0.1:38501 \
    --api-keys "$DIR/keys.toml" "${common[@]}"

IFS=,
set +e
# The mix that makes stale pages worth reading: "short" prompts of 100-150 words (about 300
# tokens, dense with markers) fit the prefill pool and are transferred whole, so decode's pages
# fill with tenants' prompts; "long" ones, sized for a 1,000-token context, are 600-700 tokens:
# past prefill's 512, so the planted bug swaps them for the placeholder. Freed pages are reused
# last-freed first and in order, so such a request's table starts with the pages of the prompt
# that just finished, usually another tenant's, at the positions it had.
"$AIRLOCK" canary --url http://127.0.0.1:38500 --keys "${keys[*]}" --requests "$REQUESTS" \
    --concurrency "$CONCURRENCY" --context-length 1000 --prompt-words 100..150 --max-tokens 48 \
    --long-fraction 0.4 --oversized-fraction 0.05 --seed "${SEED:-2026}"
status=$?
unset IFS
echo "canary exit status: $status ($MODE)"
exit "$status"
