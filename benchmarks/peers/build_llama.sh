#!/usr/bin/env bash
# Build llama.cpp's llama-server for the side-by-side benchmarks, outside the repo:
#   benchmarks/peers/build_llama.sh        ->  $BUILD/bin/llama-server (what serve_llama.sh runs)
# The llama.cpp sources come from the llama-cpp-python sdist on PyPI (vendor/llama.cpp), because
# a package registry is reachable where GitHub may not be; the sdist pins a llama.cpp commit, so
# the build is reproducible. Idempotent: the sdist is downloaded and extracted once, and a rerun
# only rebuilds what changed (a build folder configured from another source tree is wiped).
# Env: LLAMA_CPP_PYTHON_VERSION (default 0.3.36; if PyPI no longer has it, the newest is used),
#      PEERS_DIR (default /opt/peers), LLAMA_BUILD (default $PEERS_DIR/llama-build), JOBS (2).
set -euo pipefail
PEERS=${PEERS_DIR:-/opt/peers}
BUILD=${LLAMA_BUILD:-$PEERS/llama-build}
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
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
cmake --build "$BUILD" --target llama-server -j "${JOBS:-2}"

echo "built $BUILD/bin/llama-server from llama-cpp-python $VERSION (vendor/llama.cpp):"
"$BUILD/bin/llama-server" --version 2>&1 | grep -E '^(version|built)' || "$BUILD/bin/llama-server" --version
