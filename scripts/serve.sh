#!/usr/bin/env bash
# The engine's main job on a model: for now, describe it (`kvstack inspect`).
set -euo pipefail
bin=$1
model=$2
exec "$bin" inspect -m "$model"
