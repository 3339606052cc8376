#!/usr/bin/env bash
# Model-checks the `kernels` thread pool (`Workers`) with loom, then shows the check can fail:
# each mutant, a deliberately broken step of the pool's join/close protocol, must be reported.
#
#   scripts/loom-mutant.sh
#
# Builds with RUSTFLAGS="--cfg loom" into target/loom (its own dir: the flag changes every
# crate, and would otherwise rebuild the normal target), runs crates/kernels/tests/loom.rs as
# written (must pass), then once per mutant with AIRLOCK_LOOM_MUTANT=<name> (each must fail
# with loom's report, not just any failure). Mutants exist only in `--cfg loom` builds
# (crates/kernels/src/sync.rs). About 1.5 minutes on 2 cores from scratch, most of it the build.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}/loom"
export RUSTFLAGS="--cfg loom"

echo "+ RUSTFLAGS='$RUSTFLAGS' CARGO_TARGET_DIR=$CARGO_TARGET_DIR cargo test -p kernels --test loom"
cargo test -p kernels --test loom

# mutant, the test that must catch it, what loom reports.
mutants=(
    "open_before_active a_region_runs_each_task_once_and_returns_after_all_ran Causality violation"
    "acq_rel a_region_runs_each_task_once_and_returns_after_all_ran Causality violation"
    "shutdown_after_epoch drop_wakes_and_joins_every_worker deadlock"
    "unpark_before_epoch drop_wakes_and_joins_every_worker deadlock"
)
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
for entry in "${mutants[@]}"; do
    read -r mutant test report <<<"$entry"
    echo "+ AIRLOCK_LOOM_MUTANT=$mutant cargo test -p kernels --test loom -- --exact $test"
    # A deadlock report aborts the test process (loom panics again while unwinding).
    if AIRLOCK_LOOM_MUTANT="$mutant" cargo test -p kernels --test loom -- --exact "$test" \
        >"$log" 2>&1; then
        echo "FAIL: mutant $mutant survived: $test passed with it" >&2
        exit 1
    fi
    if ! grep -m1 -- "$report" "$log"; then
        tail -n 40 "$log" >&2
        echo "FAIL: mutant $mutant: $test failed, but without loom's '$report'" >&2
        exit 1
    fi
    echo "caught: $mutant"
done
echo "== loom: the pool passes, and all ${#mutants[@]} mutants were caught"
