"""The chunked Mamba-2 scan: the fast path of mamba2_scan for long passes (algorithm="chunked").

The SSD algorithm (matmuls inside chunks of `chunk_size` tokens, states passed between chunks), as
in mamba_ssm's mamba_chunk_scan_combined, but it also returns the state at any offset, not just at
chunk boundaries: a capture costs O(chunk) work. The chunk grid is fixed by absolute positions:
boundaries at the multiples of chunk_size, each sequence's first token at `start_positions[s]`
(default 0); tables.py (ChunkTables) cuts sequences into chunks and places the captures, the same
for both backends. backend="triton" runs the kernels of triton_kernel.py (their docstring: the
pipeline, the matmul dtypes, how captures are formed); backend="torch" runs the same algorithm in
PyTorch (torch_kernel.py; float32 matmuls whatever the input dtype); reference.py states each
of the five stages in float64.

What this path guarantees, bit for bit and to rounding, and its accuracy: README.md, section
"Semantics and exactness". The algorithms' names and the "auto" rule: ssm_kernels.scan.algorithm.
Design and cost: docs/chunked.md.
"""
from __future__ import annotations

from ... import _replay
from ..algorithm import ALGORITHMS, ChunkedRules, check_start_positions
from . import triton_kernel
from .tables import ChunkTables, make_chunk_tables, recent_pass
from .torch_kernel import run_chunked_torch
from .triton_kernel import run_chunked_triton

DEFAULT_CHUNK_SIZE = 256
MAX_CHUNK_SIZE = 1024
# "auto" picks the chunked path on CUDA from this many tokens in the longest sequence of the pass.
# Modelled for sm_90a (H200), not measured: both kernels compiled as a launch specialises them,
# bfloat16, the Mamba-2 2.7B layer (80 heads x 64, dstate 128):
# - recurrent: its token loop takes two tokens an iteration in 669 cycles of one warp's in-order
#   chain (661 SASS instructions; a program is one warp of 16 state rows, and the 320 programs of
#   the layer fit one wave, at most one on each scheduler), about 335 cycles a token, 0.18 us at
#   1.9 GHz: about 23 us for 128 tokens, 45 us for 256;
# - chunked: six kernel launches whatever the length up to one chunk, with or without captures
#   (five stages and the output kernel's fix-up), each a short wave; at about 4 us per launch
#   (launch latency plus one wave, assumed) that is about 24 us.
# They cross near 24 / 0.18 = 133 tokens; the threshold stays at 128 (113 tokens with five
# launches, before the fix-up): the H200 ran the recurrent pass at 3x this model's time, so the
# real crossover is lower. The GPU suite's crossover section (bench/scan.py) measures it; replace
# this value with the measured one.
AUTO_CHUNKED_MIN_TOKENS = 128

RULES = ChunkedRules(DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE, AUTO_CHUNKED_MIN_TOKENS, min_reason="the smallest tl.dot tile")
check_chunk_size = RULES.check_chunk_size
resolve_algorithm = RULES.resolve_algorithm


def run(problem, backend: str, chunk_size: int, start_positions: list[int]) -> None:
    """Run a validated mamba2_scan problem with the chunked algorithm on a resolved backend.

    The pass's tables come from a recent pass like it where there is one (tables.recent_pass), and
    on Triton so do its launches: from a layout's fourth call on (a model's fourth layer over one
    batch), the kernels are launched as the second and third calls launched them, with this
    call's tensors and new scratch (_replay.py), without the stages' host work."""
    p = problem
    recent = recent_pass(p.seqs, p.captures, chunk_size, start_positions, p.x.device)
    if backend != "triton":
        run_chunked_torch(p, recent.tables)
        return
    # The tables and the chunk grid are the recent pass's.
    op, tensors = p.replay_key()
    _replay.run(recent.launches, op + (triton_kernel.fused_pass_enabled(),), tensors,
                lambda: run_chunked_triton(p, recent.tables), fresh=True)


__all__ = ["ALGORITHMS", "DEFAULT_CHUNK_SIZE", "MAX_CHUNK_SIZE", "AUTO_CHUNKED_MIN_TOKENS", "ChunkTables",
           "make_chunk_tables", "check_chunk_size", "check_start_positions", "resolve_algorithm", "run"]
