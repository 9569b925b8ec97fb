#!/usr/bin/env bash
# The GPU suite, one call on an H200, well inside 7 minutes. Steps, most wanted first, so that the
# time limit cuts the secondary ones:
#   1. nvidia-smi and the Python/torch/triton/peer versions;
#   2. the GPU-only tests and the bitwise tests on the compiled kernels (test_model_size_on_gpu,
#      tests/test_chunked_grid.py and tests/test_scan_exactness.py);
#   3. python -m bench.accuracy (every mamba2_scan path against float64), then python -m bench.scan
#      at the standard shapes, peers included where importable;
#   4. python -m bench.serve (simulator, one layer's plans, the hybrid model);
#   5. python -m bench.vllm on CUDA vLLM (plugin off and on, a Mamba-2 and a Mamba-1 hybrid) when
#      vLLM is importable, results in $OUT/vllm; skipped, saying so, when it is not (or in a dry run);
#   6. the other kernel tests on CUDA (KERNEL_TESTS), in the time left (pytest -v, as step 2, so that a
#      cut run still names each test it finished);
#   7. the short tables, last.
# Everything goes to $OUT (default bench/results/<UTC date>-gpu; a dry run: -gpu-reduced or
# -cpu-reduced): scan.json/.md, scan_*.png, serve.json/.md, serve_*.png, logs/*.log and
# logs/steps.tsv (step, exit status, seconds).
#
# Time: the whole suite gets SUITE_BUDGET_S seconds (default 390); the first tests are capped at
# PYTEST_TIMEOUT (default 60). The benchmarks get what is left but KERNEL_TESTS_S (default 40),
# with a soft budget (measurements not started in time are recorded as skipped) and a hard timeout
# (SIGTERM: they write what they measured, marked incomplete). Timing: do_bench medians, warmup
# 10 ms, rep 50 ms (5 x one call for slower calls, at most 1 s), and each pass's kernels alone
# (torch.profiler); transformers' Mamba-1 loop runs up to 8192 tokens only, its Mamba-2 path up
# to 2048.
#
# Dry run (CI, any machine): bench/gpu_suite.sh --dry-run (or REDUCED=1): no pytest, reduced
# benchmarks (on CPU: small shapes, PyTorch path and Triton interpreter, labelled CPU).
# Other flags: --quick (fewer shapes, shorter timing). Exit status: 0 only if every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=${REDUCED:-0}
QUICK=""
for arg in "$@"; do
  case "$arg" in
    --dry-run|--reduced) DRY_RUN=1 ;;
    --quick) QUICK="--quick" ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "gpu_suite.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done
[ "$DRY_RUN" = "0" ] || DRY_RUN=1

PY=${PYTHON:-python3}
BUDGET=${SUITE_BUDGET_S:-390}
PYTEST_TIMEOUT=${PYTEST_TIMEOUT:-60}
KERNEL_TESTS_S=${KERNEL_TESTS_S:-40}
# The kernel tests worth running on CUDA (the rest are pure Python, or count under the interpreter).
KERNEL_TESTS="tests/test_chunked.py tests/test_scan_accuracy.py tests/test_mamba1_chunked.py tests/test_conv.py
  tests/test_scan_inputs.py tests/test_mamba_ssm_compat.py tests/test_layers.py tests/test_model_chunked.py"
if [ "$DRY_RUN" = 1 ]; then REDUCED_FLAG="--reduced"; else REDUCED_FLAG=""; fi
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then KIND=gpu; else KIND=cpu; fi
[ "$DRY_RUN" = 1 ] && KIND=$KIND-reduced
OUT=${OUT:-bench/results/$(date -u +%Y-%m-%d)-$KIND}
mkdir -p "$OUT/logs"
STEPS="$OUT/logs/steps.tsv"
printf 'step\tstatus\tseconds\n' > "$STEPS"
# The benchmarks record `git rev-parse HEAD` (and whether the tree differs); a copy of the tree
# without .git (a device machine) should pass BENCH_COMMIT=<sha>.
COMMIT=${BENCH_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
FAILED=0

# step NAME LOG TIMEOUT_S CMD...: run with a hard timeout, tee the log, record status and time.
step() {
  local name=$1 log=$2 limit=$3
  shift 3
  local began=$SECONDS rc
  echo "=== $name (limit ${limit}s)"
  timeout --signal=TERM --kill-after=15 "$limit" "$@" 2>&1 | tee "$OUT/logs/$log"
  rc=$?
  [ "$rc" = 124 ] && echo "=== $name: timed out after ${limit}s"
  [ "$rc" = 0 ] || FAILED=1
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - began))" >> "$STEPS"
}
left() { echo $((BUDGET - SECONDS)); }

echo "=== gpu_suite: out=$OUT dry_run=$DRY_RUN budget=${BUDGET}s commit=$COMMIT"
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi; else echo "nvidia-smi: not found"; fi
  "$PY" - <<'EOF'
import importlib.metadata as md, platform, torch, triton
print("python", platform.python_version(), "| torch", torch.__version__, "| triton", triton.__version__,
      "| cuda", torch.version.cuda, "| device", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
for dist in ("mamba-ssm", "fla-core", "flash-linear-attention", "transformers", "numpy", "matplotlib"):
    try:
        print(f"  {dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"  {dist} absent")
EOF
} 2>&1 | tee "$OUT/logs/env.log"

PYTEST=("$PY" -m pytest -v -p no:cacheprovider)
if [ "$DRY_RUN" = 1 ]; then
  echo "=== pytest: skipped in a dry run (CI runs the tests itself)"
  printf 'pytest\tskipped\t0\n' >> "$STEPS"
else
  step pytest pytest.log "$PYTEST_TIMEOUT" "${PYTEST[@]}" tests/test_chunked.py::test_model_size_on_gpu \
    tests/test_chunked_grid.py tests/test_scan_exactness.py
fi

# Accuracy of every mamba2_scan path against float64 (the compiled kernels on a GPU).
step accuracy accuracy.log 120 "$PY" -m bench.accuracy

# vLLM (CUDA) with and without the plugin runs last, when it is installed and this is no dry run.
HAVE_VLLM=0
if [ "$DRY_RUN" = 0 ] && "$PY" -c 'import vllm' >/dev/null 2>&1; then HAVE_VLLM=1; fi
VLLM_RESERVE=0
[ "$HAVE_VLLM" = 1 ] && VLLM_RESERVE=${VLLM_RESERVE_S:-150}
TESTS_RESERVE=$KERNEL_TESTS_S
[ "$DRY_RUN" = 1 ] && TESTS_RESERVE=0

# The benchmarks share what is left: scan first, leaving SERVE_RESERVE for serve and the summary.
SERVE_RESERVE=${SERVE_RESERVE:-80}
limit=$(( $(left) - SERVE_RESERVE - VLLM_RESERVE - TESTS_RESERVE ))
[ "$limit" -lt 60 ] && limit=60
step scan scan.log "$limit" "$PY" -m bench.scan $REDUCED_FLAG $QUICK --out "$OUT" --time-budget $((limit - 40))
limit=$(( $(left) - 10 - VLLM_RESERVE - TESTS_RESERVE ))
[ "$limit" -lt 30 ] && limit=30
step serve serve.log "$limit" "$PY" -m bench.serve $REDUCED_FLAG $QUICK --out "$OUT" --time-budget $((limit * 2 / 3))

if [ "$HAVE_VLLM" = 1 ]; then
  limit=$(( $(left) - 10 - TESTS_RESERVE ))
  [ "$limit" -lt 60 ] && limit=60
  step vllm vllm.log "$limit" "$PY" -m bench.vllm --out "$OUT/vllm" --rounds 3 --models granite jamba \
    --configs vllm-align plugin-align
else
  why="vLLM is not installed for $PY"
  [ "$DRY_RUN" = 1 ] && why="dry run"
  echo "=== vllm: skipped ($why; pip install vllm next to this project to measure it)"
  printf 'vllm\tskipped\t0\n' >> "$STEPS"
fi

if [ "$DRY_RUN" = 0 ]; then
  limit=$(( $(left) - 5 ))
  [ "$limit" -lt 20 ] && limit=20
  # shellcheck disable=SC2086 # KERNEL_TESTS is a list of paths
  step kernel-tests kernel_tests.log "$limit" "${PYTEST[@]}" $KERNEL_TESTS
fi

echo "=== summary (suite took ${SECONDS}s)"
"$PY" -m bench.summary "$OUT" || FAILED=1
exit $FAILED
