#!/usr/bin/env bash
# Installs what the test suite needs beyond Rust and the model: the requantized test models
# (scripts/fetch-test-models.sh), the official `openai` Python
# client (the serving tests drive `airlock serve` with it), schemathesis (the OpenAPI fuzz
# test, TEST-MATRIX A16, runs it against the served /openapi.json), lm-evaluation-harness
# with its API extra (a log-likelihood task runs against `serve`; no torch),
# kubernetes-validate (checks deploy/kubernetes against the Kubernetes API schemas it
# bundles, offline), and a TrueType
# font for
# the chart test of `airlock bench --plot` (Debian's fonts-dejavu-core; plotters renders text
# with ab_glyph from a .ttf file, no fontconfig). Idempotent: nothing is downloaded when all are
# already there; pinned for reproducible CI.
set -euo pipefail

OPENAI_VERSION="3.57.0"
SCHEMATHESIS_VERSION="4.32.5"
LM_EVAL_VERSION="0.4.13"
KUBERNETES_VALIDATE_VERSION="1.37.0"
FONT="${AIRLOCK_PLOT_FONT:-/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf}"

if [ ! -f "$FONT" ]; then
    echo "installing fonts-dejavu-core (the font \`airlock bench --plot\` draws text with)" >&2
    if command -v apt-get >/dev/null 2>&1; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y --no-install-recommends fonts-dejavu-core >/dev/null 2>&1 || {
            apt-get update -qq && apt-get install -y --no-install-recommends fonts-dejavu-core
        }
    else
        echo "no apt-get: install DejaVu Sans, or set AIRLOCK_PLOT_FONT to any .ttf file" >&2
        exit 1
    fi
fi

# The tensor-format tests' models: SmolLM2 requantized by llama.cpp's llama-quantize.
"$(dirname "${BASH_SOURCE[0]}")/fetch-test-models.sh"

installed() {
    python3 - "$OPENAI_VERSION" "$SCHEMATHESIS_VERSION" "$LM_EVAL_VERSION" \
        "$KUBERNETES_VALIDATE_VERSION" 2>/dev/null <<'PY'
import sys
from importlib.metadata import version
import aiohttp, tenacity  # lm_eval[api]
names = ("openai", "schemathesis", "lm_eval", "kubernetes-validate")
sys.exit(tuple(version(name) for name in names) != tuple(sys.argv[1:]))
PY
}
if installed; then
    exit 0
fi
echo "installing openai==$OPENAI_VERSION, schemathesis==$SCHEMATHESIS_VERSION," \
    "lm_eval==$LM_EVAL_VERSION and kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" \
    "(Python tools the tests use)" >&2
pip_install() {
    python3 -m pip install --quiet --disable-pip-version-check "$@" \
        "openai==$OPENAI_VERSION" "schemathesis==$SCHEMATHESIS_VERSION" \
        "lm_eval[api]==$LM_EVAL_VERSION" \
        "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"
}
# Debian's system Python refuses plain installs (PEP 668); these are test-only dependencies.
pip_install || pip_install --break-system-packages
