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
# three test processes on this two-core machine: tests/conftest.py's scheduler sends a module, or
# the vllm-static folder, to one process whole, the groups with the most tests first. A test waits
# on processes it started (engines, servers, scripts), so two processes left the cores idle ~22%
# of the time; a third fills it (vLLM tests and the CLI guide's examples: 217 s with two, 190 s
# with three). INTERP_TEST_WORKERS chooses otherwise.
# Each test process, and every process it starts, gets its share of the cores as OpenMP threads
# (at least one): torch's OpenMP threads spin while they wait for work, so test processes that
# each run as many threads as the machine has cores take CPU from each other's work (two vLLM
# modules in two processes: 157 s with the default threads, 119 s with one each)
workers="${INTERP_TEST_WORKERS:-3}"
threads=$(( $(nproc) / workers ))
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}"
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 -n "$workers" --dist loadscope "$@"
