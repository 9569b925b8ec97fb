#!/usr/bin/env bash
# The GPU suite: one device call on an H200, within about 7 minutes (SUITE_BUDGET_S, default 400).
#   1. nvidia-smi and the Python/torch/triton/peer versions;
#   2. tests: every test file that runs a kernel (python -m bench.gpu_tests: all of tests/ but the
#      pure-Python ones; kernels, layers, engine, adapters, exactness, and the gpu-marked
#      model-size tests) on CUDA, in SHARDS parallel pytest processes (default 8: compiling each
#      file's kernel specialisations takes the time, on one CPU core per process), each cut at
#      TESTS_S seconds (default 200); logs/tests-<k>.log (pytest -v, so a cut shard still names each
#      test it finished);
#   3. python -m bench.accuracy (every mamba2_scan path against float64), then python -m bench.host
#      --device cuda (the engine ops' host time per layer call, replays included), then
#      python -m bench.chain (a state handed from program to program inside a kernel: us a hop);
#   4. the headline: python -m bench.scan --seqlens 8192 32768 --no-varlen (and --sections): recurrent and chunked
#      passes at batch 1 with the peers at the three Mamba-2 shapes and Mamba-1 (call, kernel and
#      host time per call; the chunked Mamba-2 pass also on its fused pass, where its layer-size
#      test passed in step 2), 8 captures spread and 8 at chunk starts, the grid split, the crossover,
#      decode at batch 1..256; a soft budget, and a hard timeout (SIGTERM: it writes what it measured);
#   5. python -m bench.sweep (SWEEP_S, default 60): the chunked Mamba-2 pass's kernels under other
#      launch configurations (warps, stages, tiles), each against the default, at the three shapes;
#      then python -m bench.ablate (ABLATE_S, default 30): the output kernel with each of its parts
#      taken out, at Mamba-2 2.7B (where its time goes);
#   6. python -m bench.serve in the time left (SERVE_S, default 35), then the short tables, last.
# Everything goes to $OUT (default bench/results/<UTC date>-gpu; a dry run: -gpu-reduced or
# -cpu-reduced): scan.json/.md, scan_*.png, serve.json/.md, serve_*.png, logs/*.log and
# sweep/sweep.json/.md, ablate/ablate.json/.md, logs/steps.tsv (step, exit status, seconds).
#
# Peers: a folder $PEERS (default .peers) is put first on PYTHONPATH (pure-Python mamba_ssm and fla,
# bench/README.md says how to make it). A copy of the tree without .git should pass BENCH_COMMIT=<sha>.
#
# Dry run (CI, any machine): bench/gpu_suite.sh --dry-run (or REDUCED=1): step 2 lists the tests it
# would run (pytest --collect-only into logs/tests.txt) without running them; the benchmarks run
# reduced (on CPU: small shapes, PyTorch path and Triton interpreter, labelled CPU).
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
BUDGET=${SUITE_BUDGET_S:-400}
SHARDS=${SHARDS:-8}
TESTS_S=${TESTS_S:-200}
SWEEP_S=${SWEEP_S:-60}
ABLATE_S=${ABLATE_S:-30}
SERVE_S=${SERVE_S:-35}
PEERS=${PEERS:-.peers}
# Shards balanced by each file's compile seconds, measured without a GPU (bench/README.md).
WEIGHTS=${WEIGHTS:-bench/results/2026-12-01-compile/compile.json}
[ -d "$PEERS" ] && export PYTHONPATH="$(realpath "$PEERS")${PYTHONPATH:+:$PYTHONPATH}"
# The static tool (bench.host records launches with it) lives in tools/, on the path of an installed tree only.
export PYTHONPATH="$PWD/tools${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DRY_RUN" = 1 ]; then REDUCED_FLAG="--reduced"; else REDUCED_FLAG=""; fi
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then KIND=gpu; else KIND=cpu; fi
[ "$DRY_RUN" = 1 ] && KIND=$KIND-reduced
OUT=${OUT:-bench/results/$(date -u +%Y-%m-%d)-$KIND}
mkdir -p "$OUT/logs"
STEPS="$OUT/logs/steps.tsv"
printf 'step\tstatus\tseconds\n' > "$STEPS"
# The benchmarks record `git rev-parse HEAD` (and whether the tree differs); BENCH_COMMIT overrides.
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
  "$PY" - <<'PYEOF'
import importlib.metadata as md, os, platform, torch, triton
print("python", platform.python_version(), "| torch", torch.__version__, "| triton", triton.__version__,
      "| cuda", torch.version.cuda, "| device", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
      "| cpus", os.cpu_count())
for dist in ("mamba-ssm", "fla-core", "flash-linear-attention", "transformers", "numpy", "matplotlib"):
    try:
        print(f"  {dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"  {dist} absent (a pure-Python copy may be on PYTHONPATH)")
PYEOF
} 2>&1 | tee "$OUT/logs/env.log"

# 2. The tests that run a kernel: listed (and, on a GPU, run in parallel shards).
mapfile -t SELECTED < <("$PY" -m bench.gpu_tests)
if [ "$DRY_RUN" = 1 ]; then
  step tests-listed tests.txt 300 "$PY" -m pytest --collect-only -q -p no:cacheprovider "${SELECTED[@]}"
else
  echo "=== tests: ${#SELECTED[@]} files in $SHARDS shards (limit ${TESTS_S}s each)"
  began=$SECONDS pids=() k=0
  while read -r files; do
    k=$((k + 1))
    # shellcheck disable=SC2086 # a shard is a list of paths
    timeout --signal=TERM --kill-after=15 "$TESTS_S" "$PY" -m pytest -v -rfE -p no:cacheprovider $files \
      > "$OUT/logs/tests-$k.log" 2>&1 &
    pids+=($!)
  done < <("$PY" -m bench.gpu_tests --shards "$SHARDS" ${WEIGHTS:+$([ -f "$WEIGHTS" ] && echo --weights "$WEIGHTS")})
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"
    rc=$?
    [ "$rc" = 0 ] || FAILED=1
    printf 'tests-%s\t%s\t%s\n' "$((i + 1))" "$rc" "$((SECONDS - began))" >> "$STEPS"
    echo "tests-$((i + 1)) (exit $rc): $(tail -n 1 "$OUT/logs/tests-$((i + 1)).log")"
  done
  grep -h -E "^(FAILED|ERROR) " "$OUT"/logs/tests-*.log || true
fi

# 3. Accuracy of every mamba2_scan path against float64 (the compiled kernels on a GPU), and the
# engine ops' host time per layer call (launched on the GPU; on CPU, stubbed).
step accuracy accuracy.log 300 "$PY" -m bench.accuracy
HOST_DEVICE=cpu
case "$KIND" in gpu*) HOST_DEVICE=cuda ;; esac
step host host.log 120 "$PY" -m bench.host --device "$HOST_DEVICE" --repeats 3 --out "$OUT/host"
# The cost of handing a state from program to program inside a kernel (what a one-pass chunked
# scan's chain of chunks pays a hop); reduced: the interpreter checks the values only.
step chain chain.log 60 "$PY" -m bench.chain $REDUCED_FLAG --out "$OUT/chain"

# 4. The headline rows, 5. the launch configurations and the output kernel's parts, then 6. serve
# in what is left. The fused chunked pass is timed only where its layer-size test passed on this
# GPU above: a pass that hung would stop every row after it.
FUSED_ARGS=(--no-fused)
if [ "$DRY_RUN" = 1 ] || grep -q "test_chunked_fused.py::test_at_a_layers_size_on_gpu PASSED" "$OUT"/logs/tests-*.log \
    2>/dev/null; then
  FUSED_ARGS=()
fi
limit=$(( $(left) - SWEEP_S - ABLATE_S - SERVE_S - 10 ))
[ "$limit" -lt 60 ] && limit=60
SCAN_ARGS=()
[ "$DRY_RUN" = 1 ] || SCAN_ARGS=(--seqlens 8192 32768 --no-varlen --sections scan,captures,grid_split,crossover,decode)
step scan scan.log "$limit" "$PY" -m bench.scan $REDUCED_FLAG $QUICK "${SCAN_ARGS[@]}" "${FUSED_ARGS[@]}" \
  --out "$OUT" --time-budget $((limit - 40))
step sweep sweep.log "$SWEEP_S" "$PY" -m bench.sweep $REDUCED_FLAG --out "$OUT/sweep" --time-budget $((SWEEP_S - 20))
step ablate ablate.log "$ABLATE_S" "$PY" -m bench.ablate $REDUCED_FLAG --out "$OUT/ablate" \
  --time-budget $((ABLATE_S - 15))
limit=$(( $(left) - 10 ))
[ "$limit" -lt 30 ] && limit=30
step serve serve.log "$limit" "$PY" -m bench.serve $REDUCED_FLAG $QUICK --out "$OUT" --time-budget $((limit * 2 / 3))

echo "=== summary (suite took ${SECONDS}s)"
"$PY" -m bench.summary "$OUT" || FAILED=1
exit $FAILED
