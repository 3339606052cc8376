#!/usr/bin/env bash
# The auditor shown able to fail, on the real model: a deployment with the 2026 incident's bug
# planted (a prompt over the prefill pool swapped for a one-token placeholder, the transfer
# claimed complete) and the guards that stop it switched off, audited by `airlock canary`.
#
#   scripts/canary-red.sh            # guards off: expect the canary to report leaks, exit 1
#   scripts/canary-red.sh guarded    # the same bug with the guards on: expect a clean run
#
# Builds `airlock` with the test-only `fault-injection` feature into target/fault-injection
# (never the default build), then starts decode, prefill and router as three processes on
# loopback: prefill's pool (512 tokens) is smaller than the context (2048), as on the
# incident's node. Takes about 5 minutes on 2 cores, most of it the build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

MODE="${1:-unguarded}"
REQUESTS="${REQUESTS:-60}"
case "$MODE" in
    unguarded)
        PREFILL_FAULTS="incident;no-admission"
        DECODE_FAULTS="no-transfer-verify"
        ;;
    guarded)
        PREFILL_FAULTS="incident"
        DECODE_FAULTS=""
        ;;
    *) echo "usage: $0 [unguarded|guarded]" >&2; exit 2 ;;
esac

cargo build --release -p airlock --features fault-injection --target-dir target/fault-injection
AIRLOCK="$(pwd)/target/fault-injection/release/airlock"
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
"$AIRLOCK" canary --url http://127.0.0.1:38500 --keys "${keys[*]}" --requests "$REQUESTS" \
    --concurrency 4 --max-tokens 48 --long-fraction 0.4 --seed 2026
status=$?
unset IFS
echo "canary exit status: $status ($MODE: expected $([ "$MODE" = guarded ] && echo 0 || echo 1))"
exit "$status"
