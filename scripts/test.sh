#!/usr/bin/env bash
# Set everything up, then lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check packages tests bench
.venv/bin/ruff format --check packages tests bench
.venv/bin/python -m mypy packages/interp-core/src packages/interp-eager/src packages/interp-vllm/src
# the dev-only tests/testkit by name: given as a path under tests/ (a package), mypy would name it
# tests.testkit.src.interp_testkit and miss its [tool.mypy] section
.venv/bin/python -m mypy -p interp_testkit
# the layering contracts under [tool.importlinter] in pyproject.toml
.venv/bin/lint-imports
# two processes (this machine has two cores): tests/conftest.py's scheduler sends a module, or the
# vllm-static folder, to one process whole, the groups with the most tests first
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 -n 2 --dist loadscope "$@"
