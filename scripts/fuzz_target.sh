#!/usr/bin/env bash
# Fuzzes one libFuzzer target (kvstack_fuzz_target in CMake; +ASan/UBSan):
# configures a separate clang build dir, builds TARGET, and fuzzes it for
# FUZZ_SECONDS from the checked-in seeds (SEEDS_DIR) plus a corpus that
# grows across runs. Exits non-zero on any crash, sanitizer report, leak,
# OOM (>2 GiB) or hang; the reproducer is left in BUILD_DIR/TARGET-artifacts/.
#
# Usage: scripts/fuzz_target.sh TARGET [BUILD_DIR] [SEEDS_DIR]
#        (BUILD_DIR default <repo>/build-fuzz)
# Env:   FUZZ_SECONDS (default 20), FUZZ_JOBS (build parallelism, default 2),
#        FUZZ_CXX (default clang++; needs clang and libclang-rt-14-dev),
#        KVSTACK_MODEL (the GGUF whose tokenizer the text fuzzers load).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
target=${1:?usage: $0 TARGET [BUILD_DIR] [SEEDS_DIR]}
build=${2:-$root/build-fuzz}
seeds=${3:-}
seconds=${FUZZ_SECONDS:-20}
jobs=${FUZZ_JOBS:-2}
cxx=${FUZZ_CXX:-clang++}

log() { printf '[fuzz %s] %s\n' "$target" "$*" >&2; }

if ! command -v "$cxx" >/dev/null; then
  log "$cxx not found: install clang and libclang-rt-14-dev (scripts/setup.sh test-deps)"
  exit 1
fi
export KVSTACK_MODEL=${KVSTACK_MODEL:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}
if [ ! -f "$KVSTACK_MODEL" ]; then
  log "model $KVSTACK_MODEL missing (make model)"
  exit 1
fi
log "configuring $build with $cxx"
CXX=$cxx cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVSTACK_FUZZ=ON \
  -DKVSTACK_WERROR=OFF >/dev/null
log "building $target"
cmake --build "$build" -j "$jobs" --target "$target" >/dev/null

fuzzer=$(find "$build/src" -name "$target" -type f -perm -u+x | head -1)
[ -n "$fuzzer" ] || { log "built no $target under $build/src"; exit 1; }
corpus=$build/$target-corpus
artifacts=$build/$target-artifacts
mkdir -p "$corpus" "$artifacts"
dirs=("$corpus")
[ -n "$seeds" ] && [ -d "$seeds" ] && dirs+=("$seeds")

log "fuzzing for ${seconds}s (corpus $corpus)"
status=0
"$fuzzer" -max_total_time="$seconds" -rss_limit_mb=2048 -malloc_limit_mb=2048 -timeout=10 \
  -max_len=4096 -print_final_stats=1 -artifact_prefix="$artifacts/" "${dirs[@]}" \
  >"$build/$target.log" 2>&1 || status=$?
tail -n 25 "$build/$target.log" >&2
if [ "$status" -ne 0 ]; then
  log "FAILED (exit $status); reproducers in $artifacts, full log $build/$target.log"
  exit 1
fi
log "ok: no crashes"
