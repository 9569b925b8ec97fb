"""The chunked scan's work, counted under the interpreter at a reduced layer shape (512 tokens,
8 heads x 64, dstate 128, 1 group, chunk 256, bfloat16), held to its goals:

- tl.dot FLOPs <= 1.25 x the SSD's useful FLOPs: per (chunk, group) one C B^T (2 L^2 N), per
  (chunk, head) the intra-chunk product (2 L^2 P), the chunk state (2 L N P) and the chunk-start
  state read out by C (2 L N P), L the chunk size;
- global bytes loaded + stored <= 6 x the bytes the pass must move (bench.workloads.pass_bytes:
  every input read once, y and the final states written once);
- captures: each costs O(chunk) work of its own, whatever the pass length. 8 of them, beyond
  writing the captured states, add at most 5% to the work of an 8192-token pass (the counted
  pass scaled linearly in tokens, as every kernel's work is).

Counted by triton_static.counts (the static report's counter) over every program of every launch.
"""
from typing import NamedTuple

import pytest
from triton_static.counts import counting, total

from bench.workloads import Mamba2Shape, mamba2_inputs, pass_bytes
from ssm_kernels import mamba2_scan
from ssm_kernels._triton import RUNS_ON_CPU

pytestmark = pytest.mark.skipif(not RUNS_ON_CPU, reason="counts through the Triton interpreter")

SHAPE = Mamba2Shape("reduced 2.7B layer", nheads=8, headdim=64, dstate=128, ngroups=1)
TOKENS, CHUNK = 512, 256
FLOP_GOAL, BYTES_GOAL, CAPTURE_GOAL, CAPTURE_PASS_TOKENS = 1.25, 6.0, 0.05, 8192


def useful_flops(shape, tokens, chunk):
    chunks = tokens // chunk
    L, N, P = chunk, shape.dstate, shape.headdim
    return chunks * (shape.ngroups * 2 * L * L * N + shape.nheads * (2 * L * L * P + 4 * L * N * P))


@pytest.fixture(scope="module")
def counted():
    i = mamba2_inputs(SHAPE, TOKENS, "cpu")  # bfloat16
    args = tuple(i[k] for k in ("x", "dt", "A", "B", "C"))
    kw = dict(D=i["D"], dt_bias=i["dt_bias"], dt_softplus=True)  # as a Mamba-2 layer calls it
    runs = {}
    for name, capture in (("bare", None), ("captures", [(0, k) for k in (1, 50, 100, 255, 256, 300, 411, 511)])):
        with counting(sample=False, lines=False) as launches:
            mamba2_scan(*args, **kw, capture=capture, algorithm="chunked", chunk_size=CHUNK, backend="triton")
        runs[name] = Work(total(launches, "dot_flops"),
                          total(launches, "bytes_loaded") + total(launches, "bytes_stored"))
    return runs


class Work(NamedTuple):
    dot_flops: float
    bytes_moved: float


def test_dot_flops_within_goal_of_useful_work(counted):
    ratio = counted["bare"].dot_flops / useful_flops(SHAPE, TOKENS, CHUNK)
    print(f"tl.dot FLOPs / useful SSD FLOPs = {ratio:.3f}")
    assert ratio <= FLOP_GOAL


def test_global_bytes_within_goal_of_the_pass_floor(counted):
    ratio = counted["bare"].bytes_moved / pass_bytes(SHAPE, TOKENS, 1, 2)
    print(f"global bytes / pass floor = {ratio:.3f}")
    assert ratio <= BYTES_GOAL


def test_eight_captures_add_little_work(counted):
    bare, more = counted["bare"], counted["captures"]
    scale = CAPTURE_PASS_TOKENS / TOKENS
    written = 8 * SHAPE.nheads * SHAPE.headdim * SHAPE.dstate * 4  # the captured states: the product
    extra_bytes = (more.bytes_moved - bare.bytes_moved - written) / (bare.bytes_moved * scale)
    extra_flops = (more.dot_flops - bare.dot_flops) / (bare.dot_flops * scale)
    print(f"8 captures in a {CAPTURE_PASS_TOKENS}-token pass: +{extra_bytes:.2%} bytes (beyond the captured "
          f"states), +{extra_flops:.2%} tl.dot FLOPs")
    assert extra_bytes <= CAPTURE_GOAL and extra_flops <= CAPTURE_GOAL
