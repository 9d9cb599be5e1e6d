#!/bin/bash
# Builds llama.cpp's native `llama-server` for bench/serve_load.py (or, with
# --target, another of its programs, e.g. llama-bench) from the llama.cpp
# source vendored in the llama-cpp-python sdist pinned in requirements.txt
# (the same llama.cpp the correctness tests compare against), CPU only,
# tuned for this machine (GGML_NATIVE; on a CPU with AMX, its AVX/AVX-512
# features named one by one and AMX off: scripts/ggml_cpu_flags.sh says
# why). Nothing is installed; the binary is left at
# build/llama-server/bin/<target>.
#
#   bench/build_llama_server.sh [--jobs N] [--target NAME]
#
# Takes a while on 2 cores (ggml, libllama, common and the server are all
# compiled); re-running reuses the build directory.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
target=llama-server
while [ $# -gt 0 ]; do
  case "$1" in
    --jobs) jobs=${2:?--jobs needs a number}; shift 2 ;;
    --target) target=${2:?--target needs a program name, e.g. llama-bench}; shift 2 ;;
    -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "build_llama_server.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
done
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || { echo "build_llama_server.sh: --jobs needs a positive number, not '$jobs'" >&2; exit 2; }
[[ "$target" =~ ^llama-[a-z0-9-]+$ ]] || { echo "build_llama_server.sh: --target names a llama.cpp program (llama-server, llama-bench, ...), not '$target'" >&2; exit 2; }
# GGML_NATIVE, or on a CPU with AMX its features named one by one.
read -r -a isa_flags <<<"$(scripts/ggml_cpu_flags.sh)"
[ "${isa_flags[0]}" = -DGGML_NATIVE=ON ] ||
  echo "build_llama_server.sh: this CPU has AMX; building without ggml's AMX matmul (${isa_flags[*]})" >&2
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
cmake -S "$src" -B "$out/build" -DCMAKE_BUILD_TYPE=Release "${isa_flags[@]}" \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
  -DBUILD_SHARED_LIBS=OFF >"$out/configure.log" 2>&1 ||
  { tail -20 "$out/configure.log" >&2; exit 1; }
echo "build_llama_server.sh: compiling $target with $jobs jobs (log: $out/build.log)" >&2
cmake --build "$out/build" --target "$target" -j "$jobs" >"$out/build.log" 2>&1 ||
  { tail -20 "$out/build.log" >&2; exit 1; }
mkdir -p "$out/bin"
cp "$out/build/bin/$target" "$out/bin/$target"
echo "$out/bin/$target"
