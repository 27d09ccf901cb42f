#!/usr/bin/env bash
# Set everything up, then lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# Python caches each module's bytecode beside it on first import (setup.sh installs with
# --no-compile and leaves that to the first import). An environment that sets
# PYTHONDONTWRITEBYTECODE turns the cache off, and then every process the suite starts (each
# engine core and worker, server, script and command) compiles torch's, transformers' and vLLM's
# modules again from source: ~12 s of CPU more per process that imports vLLM (measured here:
# `import interp_testkit.forked_engines`, 19 s of CPU without the cache, 7 s with it).
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup.sh
.venv/bin/ruff check packages tests bench
.venv/bin/ruff format --check packages tests bench
# the type checks and the layering contracts side by side (each mypy run keeps one core busy)
.venv/bin/python -m mypy packages/interp-core/src packages/interp-eager/src packages/interp-vllm/src &
packages_checked=$!
# the dev-only tests/testkit by name: given as a path under tests/ (a package), mypy would name it
# tests.testkit.src.interp_testkit and miss its [tool.mypy] section; a cache of its own beside
# the other run's
.venv/bin/python -m mypy --cache-dir .mypy_cache/testkit -p interp_testkit &
testkit_checked=$!
# the layering contracts under [tool.importlinter] in pyproject.toml
.venv/bin/lint-imports
wait "$packages_checked"
wait "$testkit_checked"
# two processes (this machine has two cores): tests/conftest.py's scheduler sends a module, or the
# vllm-static folder, to one process whole, the groups with the most tests first.
# Each test process, and every process it starts (engines, servers, scripts), gets its share of
# the cores as OpenMP threads: torch's OpenMP threads spin while they wait for work, so two test
# processes that each run as many threads as the machine has cores take CPU from each other's
# work (measured on two modules here: 157 s with the default threads, 119 s with one each)
workers=2
threads=$(( $(nproc) / workers ))
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}"
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 -n "$workers" --dist loadscope "$@"
