#!/usr/bin/env bash
# Set everything up, then lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check packages tests bench
.venv/bin/ruff format --check packages tests bench
# the layering contracts under [tool.importlinter] in pyproject.toml
.venv/bin/lint-imports
# the type check runs beside the tests (one process); its
# report follows theirs, and either failing fails the run
typecheck_log="$(mktemp)"
(
  .venv/bin/python -m mypy packages/interp-core/src packages/interp-eager/src packages/interp-vllm/src
  # the dev-only tests/testkit by name: given as a path under tests/ (a package), mypy would name it
  # tests.testkit.src.interp_testkit and miss its [tool.mypy] section
  .venv/bin/python -m mypy -p interp_testkit
) >"$typecheck_log" 2>&1 &
typecheck=$!
# two processes (this machine has two cores): tests/conftest.py's scheduler sends a module, or the
# vllm-static folder, to one process whole, the groups with the most tests first
tests=0
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 -n 2 --dist loadscope "$@" || tests=$?
types=0
wait "$typecheck" || types=$?
echo "== mypy"
cat "$typecheck_log"
rm -f "$typecheck_log"
if [ "$types" != 0 ]; then
  echo "mypy failed" >&2
fi
if [ "$tests" != 0 ] || [ "$types" != 0 ]; then
  exit 1
fi
