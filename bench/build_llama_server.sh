#!/bin/bash
# Builds llama.cpp's native `llama-server` for bench/serve_load.py from the
# llama.cpp source vendored in the llama-cpp-python sdist pinned in
# requirements.txt (the same llama.cpp the correctness tests compare
# against), CPU only, tuned for this machine (GGML_NATIVE). Nothing is
# installed; the binary is left at build/llama-server/bin/llama-server.
#
#   bench/build_llama_server.sh [--jobs N]
#
# Takes a while on 2 cores (ggml, libllama, common and the server are all
# compiled); re-running reuses the build directory.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
case "${1:-}" in
  --jobs) jobs=${2:?--jobs needs a number} ;;
  -h | --help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  "") ;;
  *) echo "build_llama_server.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
esac
pin=$(grep -E '^llama-cpp-python' requirements.txt | sed -E 's/.*==//')
[ -n "$pin" ] || { echo "build_llama_server.sh: no llama-cpp-python pin in requirements.txt" >&2; exit 1; }
py=.venv/bin/python
[ -x "$py" ] || py=python3
out=build/llama-server
src=$out/llama_cpp_python-$pin/vendor/llama.cpp
mkdir -p "$out"
if [ ! -d "$src" ]; then
  echo "build_llama_server.sh: fetching the llama-cpp-python $pin sdist" >&2
  "$py" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$pin" -d "$out" >&2
  tar xzf "$out/llama_cpp_python-$pin.tar.gz" -C "$out"
fi
cmake -S "$src" -B "$out/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
  -DBUILD_SHARED_LIBS=OFF >"$out/configure.log" 2>&1 ||
  { tail -20 "$out/configure.log" >&2; exit 1; }
echo "build_llama_server.sh: compiling llama-server with $jobs jobs (log: $out/build.log)" >&2
cmake --build "$out/build" --target llama-server -j "$jobs" >"$out/build.log" 2>&1 ||
  { tail -20 "$out/build.log" >&2; exit 1; }
mkdir -p "$out/bin"
cp "$out/build/bin/llama-server" "$out/bin/llama-server"
echo "$out/bin/llama-server"
