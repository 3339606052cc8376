#!/usr/bin/env bash
# Builds llama.cpp's own llama-server and llama-bench, the peer `airlock bench --spawn llama-cpp`
# and `bench-model` compare against, from the llama.cpp sources vendored in llama-cpp-python's
# PyPI sdist (registry only: no git clone). AVX2/AVX-512 (VNNI, BF16) kernels, static, no UI, no
# curl/openssl. On a CPU without AVX-512 set GGML_AVX512 and its kin OFF below.
# Usage: scripts/bench/build-llama-server.sh [OUT_DIR]   (default /tmp/llamacpp; ~15 min on 2 cores)
# Then:  airlock bench --spawn serve,llama-cpp --llama-server OUT_DIR/build/bin/llama-server
set -euo pipefail
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
out=${1:-/tmp/llamacpp}
if [ -x "$out/build/bin/llama-server" ]; then
    echo "already built: $out/build/bin/llama-server"
    exit 0
fi
python3 -m pip install -q cmake ninja
mkdir -p "$out"
cd "$out"
python3 -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d .
tar xzf "llama_cpp_python-$version.tar.gz"
echo "building llama.cpp (vendored in llama-cpp-python $version) in $out/build ..."
# Not -march=native: where the CPU reports AMX but the kernel has not granted the process its
# tile state (VMs, sandboxes), ggml's AMX path dies with SIGILL at the first step. These are
# the x86 features llama.cpp uses on this project's machines, AMX left out.
cmake -S "$out/llama_cpp_python-$version/vendor/llama.cpp" -B "$out/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF \
    -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
    -DGGML_AVX_VNNI=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
cmake --build "$out/build" -j"$(nproc)" --target llama-server llama-bench
echo "built: $out/build/bin/llama-server and $out/build/bin/llama-bench"
