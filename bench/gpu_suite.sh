#!/usr/bin/env bash
# The GPU suite: one device call on an H200 or H100, within about 7 minutes (SUITE_BUDGET_S,
# default 380, for a call of 420 s). What only a GPU can tell the open work comes first, so that a
# short call still gives it; a later step runs only if the time left holds its share (else
# "skipped" in logs/steps.tsv):
#   1. nvidia-smi and the Python/torch/triton/peer versions;
#   2. the fused chunked pass's layer-size test alone (tests/test_chunked_fused.py::
#      test_at_a_layers_size_on_gpu, GATE_S, default 60): step 3 times the fused pass, and step 5
#      runs tests/test_chunked_fused.py, only where it passed, so that a fused pass that hung
#      cannot cost the rows after it;
#   3. the headline: python -m bench.scan --seqlens 8192 32768 --no-varlen (SCAN_S, default 120):
#      recurrent and chunked passes at batch 1 with the peers at the three Mamba-2 shapes and
#      Mamba-1 (call, kernel and host time per call, each kernel's GPU time; the chunked Mamba-2
#      pass also on its fused pass), then 8 captures spread and 8 at chunk starts and the grid
#      split, then the 32768-token passes, the crossover and decode at batch 1..256, as far as its
#      soft budget goes (a hard timeout: SIGTERM, it writes what it measured);
#   4. python -m bench.ablate (ABLATE_S, default 40): the output kernel at four programs an SM, with
#      L2 prefetch hints, and with each of its parts taken out, at Mamba-2 2.7B (where its time
#      goes); then python -m bench.sweep (SWEEP_S, default 50):
#      the chunked Mamba-2 pass's kernels under other launch configurations (warps, stages, tiles),
#      each against the default;
#   5. tests: every test file that runs a kernel (python -m bench.gpu_tests: all of tests/ but the
#      pure-Python ones; kernels, layers, engine, adapters, exactness, and the gpu-marked
#      model-size tests) on CUDA, in SHARDS parallel pytest processes (default 8: compiling each
#      file's kernel specialisations takes the time, on one CPU core per process), each cut at
#      TESTS_S seconds (default 120, less if less is left); logs/tests-<k>.log (pytest -v, so a cut
#      shard still names each test it finished);
#   6. python -m bench.accuracy (every mamba2_scan path against float64), python -m bench.host
#      --device cuda (the engine ops' host time per layer call, replays included), python -m
#      bench.chain (a state handed from program to program inside a kernel: us a hop), then
#      python -m bench.serve, each in the time left; the short tables last.
# Everything goes to $OUT (default bench/results/<UTC date>-gpu; a dry run: -gpu-reduced or
# -cpu-reduced): scan.json/.md, scan_*.png, serve.json/.md, serve_*.png, logs/*.log and
# sweep/sweep.json/.md, ablate/ablate.json/.md, logs/steps.tsv (step, exit status, seconds).
#
# Peers: a folder $PEERS (default .peers) is put first on PYTHONPATH (pure-Python mamba_ssm and fla,
# bench/README.md says how to make it). A copy of the tree without .git should pass BENCH_COMMIT=<sha>.
#
# Dry run (CI, any machine): bench/gpu_suite.sh --dry-run (or REDUCED=1): step 5 lists the tests it
# would run (pytest --collect-only into logs/tests.txt) without running them, step 2 is left out;
# the benchmarks run reduced (on CPU: small shapes, PyTorch path and Triton interpreter, labelled CPU).
# Other flags: --quick (fewer shapes, shorter timing); LIMIT_SCALE=K multiplies every step's limit.
# Exit status: 0 only if every step that ran passed.
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
BUDGET=${SUITE_BUDGET_S:-380}
SHARDS=${SHARDS:-8}
# Every step's limit times LIMIT_SCALE (default 1): a dry run on cores that other work shares
# (CI's test of it) would otherwise time out steps that take seconds alone.
SCALE=${LIMIT_SCALE:-1}
GATE_S=$(( ${GATE_S:-60} * SCALE ))
SCAN_S=$(( ${SCAN_S:-120} * SCALE ))
ABLATE_S=$(( ${ABLATE_S:-40} * SCALE ))
SWEEP_S=$(( ${SWEEP_S:-50} * SCALE ))
TESTS_S=$(( ${TESTS_S:-120} * SCALE ))
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
# within NAME LOG LIMIT CMD...: step, with its limit cut to the time left, or "skipped" where
# under 20 s are left for it.
within() {
  local name=$1 log=$2 limit=$3
  shift 3
  [ "$(left)" -lt "$limit" ] && limit=$(left)
  if [ "$limit" -lt 20 ]; then
    echo "=== $name: skipped ($(left)s left of the budget)"
    printf '%s\tskipped\t0\n' "$name" >> "$STEPS"
    return
  fi
  step "$name" "$log" "$limit" "$@"
}

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

# 2. The fused pass's layer-size test, its gate for the timed rows (a dry run times it reduced).
# Step 5 leaves out what the gate ran, and every fused test where the gate did not pass (a fused
# pass that hung would hold its shard to the limit).
FUSED_GATE=tests/test_chunked_fused.py::test_at_a_layers_size_on_gpu
FUSED_ARGS=()
DESELECT=()
if [ "$DRY_RUN" = 0 ]; then
  step fused-gate fused-gate.log "$GATE_S" "$PY" -m pytest -v -p no:cacheprovider "$FUSED_GATE"
  DESELECT=(--deselect "$FUSED_GATE")
  if ! grep -q "test_at_a_layers_size_on_gpu PASSED" "$OUT/logs/fused-gate.log" 2>/dev/null; then
    FUSED_ARGS=(--no-fused)
    DESELECT=(--deselect tests/test_chunked_fused.py)
  fi
fi

# 3. The headline rows, 4. the output kernel's parts and the launch configurations.
SCAN_ARGS=()
[ "$DRY_RUN" = 1 ] || SCAN_ARGS=(--seqlens 8192 32768 --no-varlen --sections scan,captures,grid_split,crossover,decode)
scan_limit=$SCAN_S
[ "$(left)" -lt "$scan_limit" ] && scan_limit=$(left)
within scan scan.log "$scan_limit" "$PY" -m bench.scan $REDUCED_FLAG $QUICK "${SCAN_ARGS[@]}" "${FUSED_ARGS[@]}" \
  --out "$OUT" --time-budget $((scan_limit * 3 / 4))
within ablate ablate.log "$ABLATE_S" "$PY" -m bench.ablate $REDUCED_FLAG --out "$OUT/ablate" \
  --time-budget $((ABLATE_S * 2 / 3))
within sweep sweep.log "$SWEEP_S" "$PY" -m bench.sweep $REDUCED_FLAG --out "$OUT/sweep" \
  --time-budget $((SWEEP_S * 2 / 3))

# 5. The tests that run a kernel: listed (and, on a GPU, run in parallel shards).
mapfile -t SELECTED < <("$PY" -m bench.gpu_tests)
if [ "$DRY_RUN" = 1 ]; then
  step tests-listed tests.txt $((300 * SCALE)) "$PY" -m pytest --collect-only -q -p no:cacheprovider "${SELECTED[@]}"
else
  tests_limit=$TESTS_S
  [ "$(left)" -lt "$tests_limit" ] && tests_limit=$(left)
  [ "$tests_limit" -lt 30 ] && tests_limit=30
  echo "=== tests: ${#SELECTED[@]} files in $SHARDS shards (limit ${tests_limit}s each)"
  began=$SECONDS pids=() k=0
  while read -r files; do
    k=$((k + 1))
    # shellcheck disable=SC2086 # a shard is a list of paths
    timeout --signal=TERM --kill-after=15 "$tests_limit" "$PY" -m pytest -v -rfE -p no:cacheprovider "${DESELECT[@]}" $files \
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

# 6. Accuracy of every mamba2_scan path against float64 (the compiled kernels on a GPU), the engine
# ops' host time per layer call (launched on the GPU; on CPU, stubbed), the cost of handing a state
# from program to program inside a kernel (reduced: the interpreter checks the values only), then
# serve, each in the time left.
within accuracy accuracy.log $((60 * SCALE)) "$PY" -m bench.accuracy
HOST_DEVICE=cpu
case "$KIND" in gpu*) HOST_DEVICE=cuda ;; esac
within host host.log $((60 * SCALE)) "$PY" -m bench.host --device "$HOST_DEVICE" --repeats 3 --out "$OUT/host"
within chain chain.log $((30 * SCALE)) "$PY" -m bench.chain $REDUCED_FLAG --out "$OUT/chain"
serve_limit=$(( $(left) - 10 ))
within serve serve.log "$serve_limit" "$PY" -m bench.serve $REDUCED_FLAG $QUICK --out "$OUT" \
  --time-budget $((serve_limit * 2 / 3))

echo "=== summary (suite took ${SECONDS}s)"
"$PY" -m bench.summary "$OUT" || FAILED=1
exit $FAILED
