#!/usr/bin/env bash
# Style and static checks, warnings as errors (run once per CI run):
#   1. clang-format (.clang-format) on every tracked .cpp/.h;
#   2. clang-tidy (.clang-tidy) on every tracked .cpp that is part of the
#      build, i.e. listed in BUILD_DIR/compile_commands.json (`make build`
#      writes it; the top-level CMakeLists sets CMAKE_EXPORT_COMPILE_COMMANDS).
#
# Usage: scripts/lint.sh [BUILD_DIR] [PATHSPEC...]
#   BUILD_DIR  build directory with compile_commands.json (default: build)
#   PATHSPEC   limit both checks to these tracked paths (git pathspecs,
#              relative to the repository root), e.g. src/kv src/cli/npy.cpp
# Environment: LINT_JOBS (default: nproc), CLANG_FORMAT, CLANG_TIDY.
#
# Prints one line per finding (header findings once, however many units
# include the header) and a summary; full clang-tidy output is kept in
# BUILD_DIR/lint/. Exit status: 0 clean, 1 findings, 2 cannot run.
set -uo pipefail
export LC_ALL=C

die() {
  echo "[lint] $*" >&2
  exit 2
}

build=${1:-build}
[ $# -gt 0 ] && shift
# Resolve BUILD_DIR against the caller's directory before moving to the root.
[ -d "$build" ] || die "build directory '$build' not found: run 'make build' first"
build=$(cd "$build" && pwd -P)
root=$(cd "$(dirname "$0")/.." && pwd -P)
cd "$root" || die "cannot enter $root"
pathspecs=("$@")
[ ${#pathspecs[@]} -gt 0 ] || pathspecs=(.)

clang_format=${CLANG_FORMAT:-clang-format}
clang_tidy=${CLANG_TIDY:-clang-tidy}
command -v "$clang_format" >/dev/null || die "$clang_format not found (Debian: apt-get install clang-format)"
command -v "$clang_tidy" >/dev/null || die "$clang_tidy not found (Debian: apt-get install clang-tidy)"
jobs=${LINT_JOBS:-$(nproc)}
db="$build/compile_commands.json"
[ -f "$db" ] || die "$db missing: configure and build first ('make build')"
logdir="$build/lint"
{ rm -rf "$logdir" && mkdir -p "$logdir/tidy"; } || die "cannot create $logdir"
start=$SECONDS

# Tracked files that exist in the working tree (a deleted, not yet
# committed file is not an error).
mapfile -t sources < <(git ls-files -- "${pathspecs[@]}" | grep -E '\.(cpp|h)$' |
  while read -r f; do [ -f "$f" ] && echo "$f"; done)
[ ${#sources[@]} -gt 0 ] || die "no tracked .cpp/.h files under: ${pathspecs[*]}"

# --- clang-format -----------------------------------------------------------
printf '%s\0' "${sources[@]}" |
  xargs -0 -P "$jobs" -n 32 "$clang_format" --dry-run -Werror >"$logdir/format.log" 2>&1
mapfile -t unformatted < <(grep -oE '^[^:]+:[0-9]+:[0-9]+: error:' "$logdir/format.log" |
  cut -d: -f1 | sed "s|^$root/||" | sort -u)
if [ ${#unformatted[@]} -gt 0 ]; then
  echo "[lint] clang-format: ${#unformatted[@]} of ${#sources[@]} files not formatted" \
    "(fix: make format, or clang-format -i FILE):"
  printf '  %s\n' "${unformatted[@]}"
elif [ -s "$logdir/format.log" ]; then
  # Output without a file:line finding: clang-format itself failed.
  head -20 "$logdir/format.log" >&2
  die "clang-format failed (full output: $logdir/format.log)"
else
  echo "[lint] clang-format: ${#sources[@]} files ok"
fi

# --- clang-tidy -------------------------------------------------------------
# Units: tracked .cpp files the build compiles (fuzz and benchmark targets
# may be absent from this configuration; they are listed, not failed).
grep -oE '"file": *"[^"]*"' "$db" | sed -E 's/^"file": *"(.*)"$/\1/' |
  sed "s|^$root/||" | sort -u >"$logdir/in_build.txt"
printf '%s\n' "${sources[@]}" | grep -E '\.cpp$' | sort -u >"$logdir/tracked_cpp.txt"
mapfile -t units < <(comm -12 "$logdir/tracked_cpp.txt" "$logdir/in_build.txt")
mapfile -t skipped < <(comm -23 "$logdir/tracked_cpp.txt" "$logdir/in_build.txt")
if [ ${#skipped[@]} -gt 0 ]; then
  echo "[lint] clang-tidy: ${#skipped[@]} tracked .cpp not in $db (not checked):" \
    "${skipped[*]}"
fi

# One clang-tidy process per unit, handed out one at a time so that all jobs
# stay busy. Per unit: its output in tidy/<unit>.log and, if clang-tidy
# exits non-zero, a marker tidy/<unit>.failed.
tidy_one() {
  local unit=$1 log
  log="$LINT_LOGDIR/tidy/${unit//\//__}.log"
  if ! "$LINT_CLANG_TIDY" -p "$LINT_BUILD" --quiet "$unit" >"$log" 2>&1; then
    touch "${log%.log}.failed"
  fi
}
export -f tidy_one
export LINT_LOGDIR="$logdir" LINT_CLANG_TIDY="$clang_tidy" LINT_BUILD="$build"
if [ ${#units[@]} -gt 0 ]; then
  echo "[lint] clang-tidy: ${#units[@]} translation units, $jobs jobs..."
  # shellcheck disable=SC2016  # $1 is expanded by the inner bash
  printf '%s\0' "${units[@]}" | xargs -0 -P "$jobs" -n 1 bash -c 'tidy_one "$1"' _
fi

# Findings: "path:line:col: warning|error: message [check]" lines, deduplicated
# across units (a header's finding is reported by every unit including it).
cat "$logdir"/tidy/*.log 2>/dev/null | grep -E '^[^ :]+:[0-9]+:[0-9]+: (warning|error): ' |
  sed -e "s|^$root/||" -e 's/,-warnings-as-errors\]$/]/' | sort -u |
  sort -t: -k1,1 -k2,2n -k3,3n >"$logdir/findings.txt"
n_findings=$(wc -l <"$logdir/findings.txt")
# Units where clang-tidy failed without reporting a finding (crash, bad
# compile command): an error of the tool, which must not pass silently.
failed_units=()
for f in "$logdir"/tidy/*.failed; do
  [ -e "$f" ] || continue
  log="${f%.failed}.log"
  grep -qE ': (warning|error): ' "$log" || failed_units+=("$log")
done
if [ "$n_findings" -gt 0 ]; then
  echo "[lint] clang-tidy: $n_findings findings:"
  sed 's/^/  /' "$logdir/findings.txt"
  echo "[lint] clang-tidy findings by check:"
  grep -oE '\[[a-z0-9.,-]+\]$' "$logdir/findings.txt" | sort | uniq -c | sort -rn |
    sed 's/^/  /'
  echo "[lint] details (code excerpts, notes): $logdir/tidy/"
elif [ ${#units[@]} -gt 0 ]; then
  echo "[lint] clang-tidy: ${#units[@]} translation units ok"
fi
for log in "${failed_units[@]}"; do
  echo "[lint] clang-tidy failed without a finding: $log (stack frames left out)"
  grep -v "^ *#[0-9]" "$log" | tail -5 | sed "s/^/  /"
done

elapsed=$((SECONDS - start))
if [ ${#unformatted[@]} -gt 0 ] || [ "$n_findings" -gt 0 ] || [ ${#failed_units[@]} -gt 0 ]; then
  echo "[lint] FAILED in ${elapsed}s: ${#unformatted[@]} files to format," \
    "$n_findings clang-tidy findings, ${#failed_units[@]} clang-tidy failures"
  exit 1
fi
echo "[lint] ok in ${elapsed}s"
