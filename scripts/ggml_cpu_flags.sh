#!/bin/bash
# Prints the CMake flags that pick ggml's CPU code for a llama.cpp built on
# this machine: -DGGML_NATIVE=ON, except on a CPU with AMX. There
# GGML_NATIVE also compiles ggml's AMX matmul, which crashed llama.cpp on
# its first batch on session 18's Intel Xeon (SIGSEGV in
# ggml_backend_amx_mul_mat, llama-cpp-python 0.3.36: the parity tests and
# llama-bench alike), so the flags name this CPU's AVX/AVX-512 features one
# by one, AMX off. Used by scripts/setup.sh (llama-cpp-python, the test
# reference) and bench/build_llama_server.sh.
#
#   scripts/ggml_cpu_flags.sh [--amx-only]
#
# --amx-only: print nothing on a CPU without AMX (the caller keeps its
# default build).
set -euo pipefail
case "${1:-}" in
  "" | --amx-only) ;;
  -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
  *) echo "ggml_cpu_flags.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
esac
if ! grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
  [ "${1:-}" = --amx-only ] || echo "-DGGML_NATIVE=ON"
  exit 0
fi
has() { grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }
echo "-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma)" \
  "-DGGML_F16C=$(has f16c) -DGGML_BMI2=$(has bmi2) -DGGML_AVX_VNNI=$(has avx_vnni)" \
  "-DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512vbmi)" \
  "-DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16)" \
  "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
