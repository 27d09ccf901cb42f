#!/usr/bin/env bash
# Create .venv in the repository root and install the workspace into it (editable), offline-safe.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt)
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e packages/interp-core -e packages/interp-eager -e ".[dev]" -e tests/toy_backend
