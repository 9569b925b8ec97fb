"""The Mamba-1 scan parallel in time: mamba1_scan(..., algorithm="chunked").

Algorithms of mamba1_scan:
- "recurrent" (the default): one token at a time, exact at any split, batching and captures.
- "chunked": chunks of `chunk_size` tokens at the multiples of chunk_size of absolute positions
  (each sequence's first token at start_positions[s], default 0), a parallel (associative) scan
  inside each chunk, the state carried from chunk to chunk; the work of a sequence is spread
  over time as well as channels. A pass that starts at a grid point (from the state there: a
  captured or final state of an earlier pass) computes every chunk as one longer pass does, so
  its y, final and captured states are bit-identical to that pass's, on each backend; batching
  and captures at any offset never change a bit. A pass that starts off the grid agrees with the
  longer pass to rounding. Accuracy against float64 as the recurrent path's: the chunk's
  products are reassociated, not approximated.
- "auto": "recurrent" for CPU tensors; on CUDA "chunked" when the longest sequence of the pass
  has at least AUTO_CHUNKED_MIN_TOKENS tokens.
"""
from __future__ import annotations

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
    """Run a validated mamba1_scan problem with the chunked algorithm on a resolved backend."""
    (run_triton if backend == "triton" else run_torch)(problem, chunk_size, start_positions)


__all__ = ["ALGORITHMS", "DEFAULT_CHUNK_SIZE", "MAX_CHUNK_SIZE", "AUTO_CHUNKED_MIN_TOKENS", "check_chunk_size",
           "resolve_algorithm", "run"]
