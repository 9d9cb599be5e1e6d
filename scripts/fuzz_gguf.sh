#!/usr/bin/env bash
# Fuzzes GgufFile::parse with libFuzzer (+ASan/UBSan): configures a separate
# clang build dir, builds the gguf_fuzz target, seeds a corpus with small valid
# GGUF files (gguf_fuzz_seeds write-samples) and fuzzes for FUZZ_SECONDS.
# Exits non-zero on any crash, sanitizer report, leak, OOM (>2 GiB) or hang;
# the reproducer is left in BUILD_DIR/gguf-artifacts/.
#
# Usage: scripts/fuzz_gguf.sh [BUILD_DIR]        (default: <repo>/build-fuzz)
# Env:   FUZZ_SECONDS (default 60), FUZZ_JOBS (build parallelism, default 2),
#        FUZZ_CXX (default clang++; needs clang and libclang-rt-14-dev).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build-fuzz}
seconds=${FUZZ_SECONDS:-60}
jobs=${FUZZ_JOBS:-2}
cxx=${FUZZ_CXX:-clang++}

log() { printf '[fuzz_gguf] %s\n' "$*" >&2; }

if ! command -v "$cxx" >/dev/null; then
  log "$cxx not found: install clang and libclang-rt-14-dev (scripts/setup.sh deps)"
  exit 1
fi
# Always (re)configure: cheap, and picks up new targets before building them.
log "configuring $build with $cxx"
CXX=$cxx cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVSTACK_FUZZ=ON \
  -DKVSTACK_WERROR=OFF >/dev/null
log "building gguf_fuzz"
cmake --build "$build" -j "$jobs" --target gguf_fuzz gguf_fuzz_seeds >/dev/null

fuzzer=$build/src/model/gguf_fuzz
tool=$build/src/model/gguf_fuzz_seeds
seeds=$build/gguf-seeds
corpus=$build/gguf-corpus      # grows across runs
artifacts=$build/gguf-artifacts
mkdir -p "$seeds" "$corpus" "$artifacts"
"$tool" write-samples "$seeds"

log "fuzzing for ${seconds}s (corpus $corpus)"
status=0
"$fuzzer" -max_total_time="$seconds" -rss_limit_mb=2048 -malloc_limit_mb=2048 -timeout=10 \
  -max_len=16384 -print_final_stats=1 -artifact_prefix="$artifacts/" "$corpus" "$seeds" \
  >"$build/gguf-fuzz.log" 2>&1 || status=$?
tail -n 25 "$build/gguf-fuzz.log" >&2
if [ "$status" -ne 0 ]; then
  log "FAILED (exit $status); reproducers in $artifacts, full log $build/gguf-fuzz.log"
  exit 1
fi
log "ok: no crashes"
