"""The prefill algorithms of mamba2_scan and mamba1_scan: their names, and the rules each chunked
path sets (chunk sizes, the length from which "auto" takes it), in one place.

- "recurrent": one token at a time.
- "chunked": chunks at the multiples of chunk_size of absolute positions (each sequence's first
  token at start_positions[s], default 0).
- "auto", the scans' default: "recurrent" for CPU tensors; on CUDA "chunked" when the longest
  sequence of the pass has at least the path's auto_min_tokens tokens (a modelled crossover).

What each is exact at, "auto" included: README.md, section "Semantics and exactness".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .._common import Sequences, check_choice, check_int

ALGORITHMS = ("recurrent", "chunked", "auto")
MIN_CHUNK_SIZE = 16


@dataclass(frozen=True)
class ChunkedRules:
    """What one chunked path accepts: chunk sizes (powers of two) and the "auto" threshold;
    min_reason says why chunks are at least MIN_CHUNK_SIZE tokens on that path, if it is a reason."""

    default_chunk_size: int
    max_chunk_size: int
    auto_min_tokens: int
    min_reason: str = ""

    def check_chunk_size(self, chunk_size) -> int:
        """None -> the default; otherwise a power of two in [MIN_CHUNK_SIZE, max_chunk_size]."""
        if chunk_size is None:
            return self.default_chunk_size
        size = check_int("chunk_size", chunk_size)
        if size < MIN_CHUNK_SIZE or size > self.max_chunk_size or size & (size - 1):
            why = f" ({self.min_reason})" if self.min_reason else ""
            raise ValueError(f"chunk_size must be a power of two from {MIN_CHUNK_SIZE}{why} to {self.max_chunk_size}, "
                             f"got {size}")
        return size

    def resolve_algorithm(self, algorithm, device: torch.device, seqs: Sequences) -> str:
        """Validate `algorithm` and resolve "auto" to "recurrent" or "chunked" (see the module doc)."""
        if check_choice("algorithm", algorithm, ALGORITHMS) != "auto":
            return algorithm
        longest = max(seqs.lengths, default=0)
        return "chunked" if device.type == "cuda" and longest >= self.auto_min_tokens else "recurrent"


def check_start_positions(start_positions, seqs: Sequences) -> list[int]:
    """None -> zeros; otherwise one int >= 0 per sequence (a sequence of ints or a 1-D int tensor)."""
    if start_positions is None:
        return [0] * seqs.count
    if isinstance(start_positions, torch.Tensor):
        if start_positions.dtype.is_floating_point or start_positions.dtype.is_complex \
                or start_positions.dtype == torch.bool or start_positions.ndim != 1:
            raise TypeError(f"start_positions must be a 1-D integer tensor, got dtype {start_positions.dtype} "
                            f"and shape {tuple(start_positions.shape)}")
        values = start_positions.tolist()
    else:
        try:
            values = list(start_positions)
        except TypeError:
            raise TypeError(f"start_positions must be a sequence of ints, one per sequence, got "
                            f"{type(start_positions).__name__}") from None
    if len(values) != seqs.count:
        raise ValueError(f"start_positions must hold one position per sequence ({seqs.count}), got {len(values)}")
    positions = []
    for s, value in enumerate(values):
        position = check_int(f"start_positions[{s}]", value)
        if position < 0:
            raise ValueError(f"start_positions[{s}] must be >= 0, got {position}")
        positions.append(position)
    return positions
