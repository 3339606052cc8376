#!/usr/bin/env bash
# Installs what the test suite needs beyond Rust and the model: the official `openai` Python
# client (the serving tests drive `airlock serve` with it). Idempotent; pinned for
# reproducible CI.
set -euo pipefail

OPENAI_VERSION="3.57.0"

if python3 -c "import openai, sys; sys.exit(openai.__version__ != '$OPENAI_VERSION')" 2>/dev/null; then
    exit 0
fi
echo "installing openai==$OPENAI_VERSION (Python client used by the tests)" >&2
pip_install() {
    python3 -m pip install --quiet --disable-pip-version-check "$@" "openai==$OPENAI_VERSION"
}
# Debian's system Python refuses plain installs (PEP 668); this is a test-only dependency.
pip_install || pip_install --break-system-packages
