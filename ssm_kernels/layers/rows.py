"""Batch-invariant row ops: a token's row gets bit-identical results however many rows share its
call and wherever it sits among them.

Exactness at the layer level needs more than exact kernels. A Linear over a (T, d) matrix picks
its GEMM path (a GEMV for one row, blocked or split differently for 7 or 130) by T, so a row
rounds differently with different T; and on CPU an elementwise transcendental (silu, exp) is
computed in a vector body and a scalar tail whose extent depends on the element count, and
split between threads at offsets that depend on it too. Calling the op on one row at a time
fixes both but is a Python loop per token. Instead every call here sees fresh zero-padded tiles
of one fixed shape (rows, width): the op's path is the same for every tile, and within a tile
each row is computed by the same code as every other row:

- GEMMs (``exact_linear``): tiles of ``TILE_ROWS`` rows, the inner dimension zero-padded to a
  multiple of ``INNER_STEP``. A fixed-shape GEMM then reduces each output element over the inner
  dimension in one order, whichever row it is in. Not without the padding: on an AVX-512 CPU,
  float32, an inner dimension that is not a multiple of 4 (5, 6, 7, 9, ...) rounded a row by its
  place in the tile (1.5e-8 at width 6).
- Elementwise and per-row reductions (``exact_rowwise``): tiles whose element count is a multiple
  of 64 (no vector tail in ATen's CPU loops, which step 2 vectors of up to 32 elements) and at
  most ``SERIAL_ELEMENTS`` (ATen's grain size: one thread, no split), down to one row for very
  wide rows. Per-row reductions (a norm's mean) reduce each row alone in a fixed order.

Tiles are fresh allocations, so every tile has the same alignment too. tests/test_layers.py
checks the invariance bit for bit for 1 to 130 rows at every position.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

TILE_ROWS = 64  # rows per GEMM tile
INNER_STEP = 16  # a GEMM's inner dimension is padded to a multiple of this (see exact_linear's note)
SERIAL_ELEMENTS = 32768  # at::internal::GRAIN_SIZE: an elementwise op over fewer runs on one thread
VECTOR_STEP = 64  # ATen's CPU loops step 2 vectors; 32 elements per vector for 16-bit types on AVX-512


def tile_rows(width: int) -> int:
    """Rows per tile for elementwise work over rows of ``width`` elements: the most (up to
    TILE_ROWS, a power of two) whose tile is a whole number of vector steps and runs on one
    thread; 1 when none is (a one-row tile is the same for every row)."""
    rows = TILE_ROWS
    while rows > 1 and (rows * width > SERIAL_ELEMENTS or rows * width % VECTOR_STEP):
        rows //= 2
    return rows


def row_tiles(fn: Callable[..., torch.Tensor], *xs: torch.Tensor, rows: int, width: int | None = None) -> torch.Tensor:
    """``fn`` over the last-dimension rows of ``xs`` (same leading shape), in fresh zero-padded
    tiles of ``rows`` rows (and ``width`` columns where given, zeros past each x's own); the
    padding rows' results are dropped."""
    lead = xs[0].shape[:-1]
    flat = [x.reshape(-1, x.shape[-1]) for x in xs]
    count = flat[0].shape[0]
    tiles = []
    for start in range(0, max(count, 1), rows):
        stop = min(start + rows, count)
        args = []
        for f in flat:
            tile = f.new_zeros(rows if count else 0, width or f.shape[1])
            tile[:stop - start, :f.shape[1]] = f[start:stop]
            args.append(tile)
        tiles.append(fn(*args)[:stop - start])
    out = torch.cat(tiles)
    return out.reshape(*lead, *out.shape[1:])


def exact_linear(linear: torch.nn.Linear, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """A Linear (its weight and, where `bias`, its bias) over x (..., in), batch-invariant: the
    inner dimension zero-padded to a multiple of INNER_STEP, in tiles of TILE_ROWS rows."""
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        raise TypeError(f"linear must be an nn.Linear (a 2-D weight, a bias or None), got {type(linear).__name__}")
    b = linear.bias if bias else None
    width = weight.shape[1] + -weight.shape[1] % INNER_STEP
    if width != weight.shape[1]:
        weight = F.pad(weight, (0, width - weight.shape[1]))
    return row_tiles(lambda rows: F.linear(rows, weight, b), x, rows=TILE_ROWS, width=width)


def exact_rowwise(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
    """A function of each row alone (elementwise ops, per-row norms; output as wide as the widest
    input) over xs (..., width), batch-invariant."""
    return row_tiles(fn, *xs, rows=tile_rows(max(x.shape[-1] for x in xs)))
