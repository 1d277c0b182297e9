#!/usr/bin/env bash
# Build llama.cpp's llama-server for the side-by-side benchmarks, outside the repo:
#   benchmarks/peers/build_llama.sh        ->  $BUILD/bin/llama-server (what serve_llama.sh runs)
# The llama.cpp sources come from the llama-cpp-python sdist on PyPI (vendor/llama.cpp), because
# a package registry is reachable where GitHub may not be; the sdist pins a llama.cpp commit, so
# the build is reproducible. Idempotent: the sdist is downloaded and extracted once, and a rerun
# only rebuilds what changed (a build folder configured from another source tree is wiped).
# Env: LLAMA_CPP_PYTHON_VERSION (default 0.3.36; if PyPI no longer has it, the newest is used),
#      PEERS_DIR (default /opt/peers), LLAMA_BUILD (default $PEERS_DIR/llama-build), JOBS (2),
#      LLAMA_ISA=avx2: build for AVX2 + FMA + F16C, no AVX-512, whatever this CPU has (default
#      build folder $PEERS_DIR/llama-build-avx2), for side_by_side.py --cap-isa avx2 proxy runs.
set -euo pipefail
PEERS=${PEERS_DIR:-/opt/peers}
case "${LLAMA_ISA:-native}" in
  native) BUILD=${LLAMA_BUILD:-$PEERS/llama-build}; ISA_FLAGS=(-DGGML_NATIVE=ON) ;;
  avx2) BUILD=${LLAMA_BUILD:-$PEERS/llama-build-avx2}
        ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                   -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
                   -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
                   -DGGML_AMX_BF16=OFF) ;;
  *) echo "build_llama.sh: LLAMA_ISA must be native or avx2, not '$LLAMA_ISA'" >&2; exit 2 ;;
esac
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
mkdir -p "$PEERS"

sdist="$PEERS/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$sdist" ]; then
  if ! python3 -m pip download --no-deps --no-binary llama-cpp-python -d "$PEERS" "llama-cpp-python==$VERSION"; then
    echo "llama-cpp-python==$VERSION not available; downloading the newest" >&2
    python3 -m pip download --no-deps --no-binary llama-cpp-python -d "$PEERS" llama-cpp-python
    sdist=$(ls -t "$PEERS"/llama_cpp_python-*.tar.gz | head -1)
    VERSION=$(basename "$sdist" .tar.gz); VERSION=${VERSION#llama_cpp_python-}
  fi
fi
SRC="$PEERS/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -f "$SRC/CMakeLists.txt" ] || tar -xzf "$sdist" -C "$PEERS"

# a build folder configured from another source tree (another version) cannot be reused
if [ -f "$BUILD/CMakeCache.txt" ] && ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$SRC" "$BUILD/CMakeCache.txt"; then
  rm -rf "$BUILD"
fi
# Release, tuned for this CPU (GGML_NATIVE: -march=native, so AVX2/FMA or AVX-512 as present);
# no network at build or run time: no prebuilt web UI download, no CURL/OpenSSL model fetching.
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release "${ISA_FLAGS[@]}" \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
cmake --build "$BUILD" --target llama-server -j "${JOBS:-2}"

echo "built $BUILD/bin/llama-server from llama-cpp-python $VERSION (vendor/llama.cpp):"
"$BUILD/bin/llama-server" --version 2>&1 | grep -E '^(version|built)' || "$BUILD/bin/llama-server" --version
