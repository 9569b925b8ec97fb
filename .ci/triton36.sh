#!/usr/bin/env bash
# Every kernel variant compiled for sm_90a by the Triton the GPU machine runs (3.6.0), as
# bench/tests/test_compile_for_gpu.py compiles them with this one (3.9): no spills, and no scan or
# reduction computed twice (Triton 3.6 once did that to a kernel whose bitwise guarantee then broke
# on the GPU, with 3.9 compiling it once). Triton 3.6 goes into a folder of its own, first on the
# path, beside CPU torch 2.13; nothing is launched.
set -euo pipefail
cd "$(dirname "$0")/.."
TRITON_DIR=$(mktemp -d)
trap 'rm -rf "$TRITON_DIR"' EXIT
python3 -m pip install -q --no-deps --target "$TRITON_DIR" triton==3.6.0
env -u TRITON_INTERPRET TRITON_DEFAULT_FP_FUSION=1 PYTHONPATH="$TRITON_DIR${PYTHONPATH:+:$PYTHONPATH}" \
  python3 -m bench.tests.compile_for_gpu | grep -v '^ok '  # the summary and any failing variant
