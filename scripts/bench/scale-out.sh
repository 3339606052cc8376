#!/usr/bin/env bash
# Does balancing cost anything? On the same two cores, compares
#   2x2: a router in front of 2 prefill + 2 decode workers of 1 thread each, each
#        prefill/decode pair pinned to its own core (taskset), pages over TCP;
#   1x1: a router in front of 1 prefill + 1 decode worker of 2 threads each, both cores;
# as `airlock bench` sees them at one concurrency level, alternating 2x2, 1x1, 2x2, 1x1...
# (issue 28: 2x2 should deliver at least 90 % of 1x1's output tokens per second).
#
# Usage: scripts/bench/scale-out.sh [ROUNDS=3] [CONCURRENCY=16] [REQUESTS=48]
# Needs: a release build (cargo build --release -p airlock), the model (scripts/fetch-model.sh),
# taskset (util-linux). Prints each round's output tok/s and the medians' ratio.
set -euo pipefail

ROUNDS="${1:-3}"
CONCURRENCY="${2:-16}"
REQUESTS="${3:-48}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
AIRLOCK="$ROOT/target/release/airlock"
[[ -x "$AIRLOCK" ]] || { echo "build first: cargo build --release -p airlock" >&2; exit 1; }
command -v taskset >/dev/null || { echo "needs taskset (util-linux)" >&2; exit 1; }
WORK="$(mktemp -d)"
SECRET="$WORK/cluster.secret"
head -c 32 /dev/urandom | base64 > "$SECRET"
PIDS=()
stop_all() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    PIDS=()
}
trap 'stop_all; rm -rf "$WORK"' EXIT

# start CPUS ROLE PORT THREADS: a worker pinned to CPUS.
start() {
    taskset -c "$1" "$AIRLOCK" "$2" --port "$3" --threads "$4" --kv-tokens 16384 \
        --context-length 2048 --cluster-secret-file "$SECRET" >"$WORK/$2-$3.log" 2>&1 &
    PIDS+=("$!")
}

# router PREFILLS DECODES: waits until it is ready.
router() {
    "$AIRLOCK" router --port 18600 --prefill "$1" --decode "$2" --context-length 2048 \
        --cluster-secret-file "$SECRET" >"$WORK/router.log" 2>&1 &
    PIDS+=("$!")
    for _ in $(seq 600); do
        if curl -sf http://127.0.0.1:18600/health/ready >/dev/null 2>&1; then return; fi
        sleep 0.1
    done
    echo "router never ready" >&2; cat "$WORK/router.log" >&2; exit 1
}

# measure NAME: output tok/s at $CONCURRENCY.
measure() {
    "$AIRLOCK" bench --spawn none --url "$1=http://127.0.0.1:18600" \
        --concurrency "$CONCURRENCY" --requests "$REQUESTS" 2>/dev/null |
        awk -F'|' -v name="$1" '$2 ~ name && $3+0 > 0 { gsub(/ /, "", $4); print $4; exit }'
}

two_by_two=(); one_by_one=()
for round in $(seq "$ROUNDS"); do
    start 0 prefill 18611 1; start 0 decode 18612 1
    start 1 prefill 18621 1; start 1 decode 18622 1
    router 127.0.0.1:18611,127.0.0.1:18621 127.0.0.1:18612,127.0.0.1:18622
    two_by_two+=("$(measure 2x2)"); stop_all
    start 0-1 prefill 18611 2; start 0-1 decode 18612 2
    router 127.0.0.1:18611 127.0.0.1:18612
    one_by_one+=("$(measure 1x1)"); stop_all
    echo "round $round: 2x2 ${two_by_two[-1]} tok/s, 1x1 ${one_by_one[-1]} tok/s"
done
python3 - "${two_by_two[*]}" "${one_by_one[*]}" <<'PY'
import statistics, sys
a = [float(x) for x in sys.argv[1].split()]
b = [float(x) for x in sys.argv[2].split()]
ma, mb = statistics.median(a), statistics.median(b)
print(f"median output tok/s: 2x2 {ma:.0f}, 1x1 {mb:.0f}; 2x2 / 1x1 = {ma / mb:.3f}")
PY
