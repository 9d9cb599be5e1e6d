#!/usr/bin/env bash
# Style and static checks, warnings as errors: clang-format on every tracked
# C++ file, then clang-tidy (.clang-tidy) on every tracked .cpp that is part
# of the build (compile_commands.json of BUILD_DIR, default build/).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
mapfile -t files < <(git ls-files '*.cpp' '*.h')
echo "[lint] clang-format: ${#files[@]} files" >&2
clang-format --dry-run -Werror "${files[@]}"
[ -f "$build/compile_commands.json" ] || { echo "[lint] $build/compile_commands.json missing: build first" >&2; exit 2; }
# Translation units in the build (fuzz targets are built by clang separately).
mapfile -t units < <(git ls-files '*.cpp' | grep -v '/fuzz/' | while read -r f; do
  grep -q "\"file\": \"$PWD/$f\"" "$build/compile_commands.json" && echo "$f"; done)
echo "[lint] clang-tidy: ${#units[@]} translation units" >&2
printf '%s\n' "${units[@]}" | xargs -P "$(nproc)" -n 4 clang-tidy -p "$build" --quiet 2>/dev/null
echo "[lint] ok" >&2
