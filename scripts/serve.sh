#!/usr/bin/env bash
# The engine's main job on a model: the OpenAI-compatible HTTP server
# (`kvstack serve`), which prints a ready-to-paste curl line once it is up.
set -euo pipefail
bin=$1
model=$2
exec "$bin" serve -m "$model" "${@:3}"
