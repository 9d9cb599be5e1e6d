#!/usr/bin/env bash
# ThreadSanitizer run of the serving path: builds kvstack and scheduler_test
# with -fsanitize=thread in build-tsan (RelWithDebInfo), then runs
#   1. scheduler_test's threaded and scheduling tests (the engine thread,
#      concurrent submitters, cancellation, inspect(), shutdown), and
#   2. a short `kvstack serve` run with concurrent streaming requests, a client
#      that drops mid-stream, malformed requests and a full queue
#      (tests/python/tsan_server_smoke.py),
# with TSAN_OPTIONS=halt_on_error=1: any data race fails the run.
#
# Usage: scripts/test_tsan.sh [BUILD_DIR]   (default: build-tsan; JOBS=2)
# Needs the default model and the project venv (make setup).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$root/build-tsan}"
jobs="${JOBS:-2}"
model="${KVSTACK_MODEL:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
python="${KVSTACK_PYTHON:-$root/.venv/bin/python}"

cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVSTACK_SANITIZE=thread \
  >/dev/null
cmake --build "$build" -j "$jobs" --target kvstack scheduler_test

# UCX (and libucm's mmap/madvise hooks, which TSan crashed in at thread
# exit) is dlopen'd only by --role prefill/decode (transfer/ucx_api.h): the
# smoke server (--role both) never loads it, so no UCX setting is needed.
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$root/scripts/tsan.supp ${TSAN_OPTIONS:-}"
export KVSTACK_MODEL="$model"

# The BatchInvariance diagnostics, the preemption test and the chunking test
# are single-threaded numerics (and slow under TSan); the Release suite runs them.
echo "== scheduler_test (TSan)"
"$build/src/engine/scheduler_test" \
  --gtest_filter='Scheduler.*:-Scheduler.PreemptionByRecomputeKeepsGreedyTokens:Scheduler.PrefillChunksDependOnThePromptOnly'

echo "== kvstack serve smoke (TSan)"
"$python" "$root/tests/python/tsan_server_smoke.py" "$build/src/cli/kvstack" "$model"
echo "TSan: no data race found"
