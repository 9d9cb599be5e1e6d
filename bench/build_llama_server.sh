#!/bin/bash
# Builds llama.cpp's native `llama-server` for bench/serve_load.py (or, with
# --target, another of its programs, e.g. llama-bench) from the llama.cpp
# source vendored in the llama-cpp-python sdist pinned in requirements.txt
# (the same llama.cpp the correctness tests compare against), CPU only,
# tuned for this machine (GGML_NATIVE). On a CPU with AMX, GGML_NATIVE also
# compiles ggml's AMX matmul, which crashed on the first prompt on session
# 18's Intel Xeon (SIGSEGV in ggml_backend_amx_mul_mat); there the build
# names this CPU's AVX/AVX-512 features one by one, AMX off. Nothing is
# installed; the binary is left at build/llama-server/bin/<target>.
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
    -h | --help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build_llama_server.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
done
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || { echo "build_llama_server.sh: --jobs needs a positive number, not '$jobs'" >&2; exit 2; }
[[ "$target" =~ ^llama-[a-z0-9-]+$ ]] || { echo "build_llama_server.sh: --target names a llama.cpp program (llama-server, llama-bench, ...), not '$target'" >&2; exit 2; }
# The CPU flags: GGML_NATIVE, or without AMX the features named one by one.
isa_flags=(-DGGML_NATIVE=ON)
if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
  has() { grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }
  isa_flags=(-DGGML_NATIVE=OFF -DGGML_AVX="$(has avx)" -DGGML_AVX2="$(has avx2)"
    -DGGML_FMA="$(has fma)" -DGGML_F16C="$(has f16c)" -DGGML_BMI2="$(has bmi2)"
    -DGGML_AVX_VNNI="$(has avx_vnni)" -DGGML_AVX512="$(has avx512f)"
    -DGGML_AVX512_VBMI="$(has avx512vbmi)" -DGGML_AVX512_VNNI="$(has avx512_vnni)"
    -DGGML_AVX512_BF16="$(has avx512_bf16)" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
    -DGGML_AMX_BF16=OFF)
  echo "build_llama_server.sh: this CPU has AMX; building without ggml's AMX matmul (${isa_flags[*]})" >&2
fi
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
