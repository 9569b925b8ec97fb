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

import torch

from ..._common import Sequences
from .. import chunked
from ..problem import ScanProblem
from .torch_kernel import run_torch
from .triton_kernel import run_triton

ALGORITHMS = chunked.ALGORITHMS
DEFAULT_CHUNK_SIZE = 64
MAX_CHUNK_SIZE = 256
# "auto" takes the chunked path on CUDA from this many tokens in the longest sequence: the
# recurrent kernel has one warp walk every token of a few channels; below one chunk the chunked
# kernel only adds work.
AUTO_CHUNKED_MIN_TOKENS = DEFAULT_CHUNK_SIZE


def check_chunk_size(chunk_size) -> int:
    """None -> DEFAULT_CHUNK_SIZE; otherwise a power of two in [16, MAX_CHUNK_SIZE] (the chunked
    Mamba-2 path's rule, with a smaller ceiling: a thread holds its chunk's tokens in registers)."""
    if chunk_size is None:
        return DEFAULT_CHUNK_SIZE
    size = chunked.check_chunk_size(chunk_size)
    if size > MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be a power of two from 16 to {MAX_CHUNK_SIZE}, got {size}")
    return size


def resolve_algorithm(algorithm, device: torch.device, seqs: Sequences) -> str:
    """Validate `algorithm` (as mamba2_scan's) and resolve "auto" (see the module doc)."""
    chunked.resolve_algorithm(algorithm, device, seqs)  # checks the name
    if algorithm != "auto":
        return algorithm
    longest = max(seqs.lengths, default=0)
    return "chunked" if device.type == "cuda" and longest >= AUTO_CHUNKED_MIN_TOKENS else "recurrent"


def run(problem: ScanProblem, backend: str, chunk_size: int, start_positions: list[int]) -> None:
    """Run a validated mamba1_scan problem with the chunked algorithm on a resolved backend."""
    (run_triton if backend == "triton" else run_torch)(problem, chunk_size, start_positions)


__all__ = ["ALGORITHMS", "DEFAULT_CHUNK_SIZE", "MAX_CHUNK_SIZE", "AUTO_CHUNKED_MIN_TOKENS", "check_chunk_size",
           "resolve_algorithm", "run"]
