#!/usr/bin/env bash
# Scaling curves and their charts (issue 7): serve, unified and llama.cpp's own llama-server
# (built by scripts/bench/build-llama-server.sh; a parallel slot per request in flight, same
# GGUF, same threads) started in turn, then the in-process KV transfer
# beside memcpy bandwidth; writes docs/bench/*.png, docs/bench/bench.json and the tables
# (docs/bench/report.md). BENCHMARKS.md shows the result.
#
# Usage: scripts/bench/scaling-curves.sh [OUT_DIR] [extra `airlock bench` flags...]
# Takes about 20 minutes on a quiet 2-core machine. Measures only when the 1-minute load
# average is under $MAX_LOAD (default 1.5), waiting up to $WAIT_S seconds (default 1800) for
# it; MAX_LOAD=none measures at once whatever the load (the report prints the load it saw).
# The load generator and the servers run on the same machine, never two servers at once.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

OUT="${1:-docs/bench}"
shift || true
MAX_LOAD="${MAX_LOAD:-1.5}"
WAIT_S="${WAIT_S:-1800}"

# A private copy: a rebuild of target/release during the run cannot change what is measured.
# AIRLOCK_BIN=path measures that binary instead (no build).
BIN="$(mktemp -d)/airlock"
if [ -n "${AIRLOCK_BIN:-}" ]; then
    cp "$AIRLOCK_BIN" "$BIN"
else
    cargo build --release -p airlock
    cp target/release/airlock "$BIN"
fi

waited=0
while [ "$MAX_LOAD" != none ] && awk -v max="$MAX_LOAD" '{ exit !($1 >= max) }' /proc/loadavg; do
    if [ "$waited" -ge "$WAIT_S" ]; then
        echo "load average still $(cut -d' ' -f1 /proc/loadavg) after ${WAIT_S}s; giving up" >&2
        exit 1
    fi
    echo "load average $(cut -d' ' -f1 /proc/loadavg) >= $MAX_LOAD; waiting" >&2
    sleep 30
    waited=$((waited + 30))
done

mkdir -p "$OUT"
"$BIN" bench \
    --sweep concurrency=1,2,4,8,16,32 --requests 16 --max-tokens 64 \
    --sweep prompt-tokens=128,256,512,1024,2048,4096,max --prompt-requests 2 \
    --sweep transfer-tokens=128,256,512,1024,2048,4096,8192 \
    --plot "$OUT" "$@" | tee "$OUT/report.md"
