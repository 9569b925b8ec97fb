"""The Mamba-1 scan parallel in time: mamba1_scan(..., algorithm="chunked").

Chunks of `chunk_size` tokens at the multiples of chunk_size of absolute positions (each
sequence's first token at start_positions[s], default 0), a parallel (associative) scan inside each
chunk, the state carried from chunk to chunk: the work of a sequence is spread over time as well as
channels (triton_kernel.py; torch_kernel.py is the same algorithm in PyTorch). The chunk's products
are reassociated, not approximated.

What this path guarantees, bit for bit and to rounding, and its accuracy: README.md, section
"Semantics and exactness". The algorithms' names and the "auto" rule: ssm_kernels.scan.algorithm.
Design and cost: docs/chunked.md.
"""
from __future__ import annotations

from ... import _replay
from ..algorithm import ALGORITHMS, ChunkedRules
from ..problem import ScanProblem
from .torch_kernel import run_torch
from .triton_kernel import run_triton

DEFAULT_CHUNK_SIZE = 64
# A thread holds its chunk's tokens in registers: a smaller ceiling than the Mamba-2 path's.
MAX_CHUNK_SIZE = 256
# "auto" takes the chunked path on CUDA from this many tokens in the longest sequence: the
# recurrent kernel has one warp walk every token of a few channels; below one chunk the chunked
# kernel only adds work.
AUTO_CHUNKED_MIN_TOKENS = DEFAULT_CHUNK_SIZE
RULES = ChunkedRules(DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE, AUTO_CHUNKED_MIN_TOKENS)
check_chunk_size = RULES.check_chunk_size
resolve_algorithm = RULES.resolve_algorithm


def run(problem: ScanProblem, backend: str, chunk_size: int, start_positions: list[int]) -> None:
    """Run a validated mamba1_scan problem with the chunked algorithm on a resolved backend; on
    Triton, from a layout's fourth call on, its launches replayed (_replay.run_public)."""
    if backend != "triton":
        run_torch(problem, chunk_size, start_positions)
        return
    _replay.run_public(("mamba1 chunked", chunk_size, tuple(start_positions)), problem,
                       lambda: run_triton(problem, chunk_size, start_positions))


__all__ = ["ALGORITHMS", "DEFAULT_CHUNK_SIZE", "MAX_CHUNK_SIZE", "AUTO_CHUNKED_MIN_TOKENS", "check_chunk_size",
           "resolve_algorithm", "run"]
