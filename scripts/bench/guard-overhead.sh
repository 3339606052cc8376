#!/usr/bin/env bash
# Guard overhead, measured: builds `airlock` once per run-time guard with that guard turned off
# (cargo features unguarded-*, never a default), then runs the normal build and each unguarded
# one alternately under the same load (`airlock bench --ab`, A B A B ..., PAIRS pairs) and
# prints the throughput and p99 inter-token latency cost with a 95% confidence interval.
#
# Usage: scripts/bench/guard-overhead.sh [PAIRS] [extra `airlock bench` flags...]
# Takes about (PAIRS x 30 s + one build) per guard on a 2-core machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

PAIRS="${1:-10}"
shift || true
cargo build --release -p airlock
GUARDED="$(pwd)/target/release/airlock"
for guard in owner-check checksum deferred-release; do
    dir="target/unguarded-$guard"
    echo "== building without the $guard guard ($dir)" >&2
    cargo build --release -p airlock --features "unguarded-$guard" --target-dir "$dir"
    echo "== $guard: guarded vs unguarded, $PAIRS pairs" >&2
    "$GUARDED" bench --ab "$GUARDED,$(pwd)/$dir/release/airlock" --pairs "$PAIRS" \
        --concurrency 8 --requests 16 --max-tokens 64 "$@"
done
