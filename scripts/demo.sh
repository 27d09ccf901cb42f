#!/usr/bin/env bash
# Set everything up and run the main job: a tour of capture, logit lens, attention and steering.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/interp demo "$@"
