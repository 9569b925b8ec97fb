"""Host-side tables of the chunked scan: the chunk grid of a pass and where each capture falls.

Both chunked backends (Triton and PyTorch) read the same tables, so they cut sequences into the
same chunks and serve captures the same way.

The grid is fixed by absolute positions: chunk boundaries sit at the multiples of chunk_size of
each sequence's absolute positions (its pass starts at `start_positions[s]`). A chunk is then the
same tokens, computed by the same operations from the same chunk-start state, whichever pass it
falls in, as long as the pass starts at a grid point: that is what makes a pass that resumes at a
multiple of chunk_size bit-identical to one longer pass.

Captures come in two kinds. A state the state-passing walk holds anyway (a chunk's start state,
or a sequence's final state) is stored straight from it into its capture row. A state inside a
chunk (offset j, 0 < j < the chunk's length) is computed apart, from the chunk's start state and
the contribution of its first j tokens (inner captures, listed chunk by chunk). Captures asked
for twice are computed once and copied.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..._common import CaptureTable, Sequences, int_tables


class Chunk(NamedTuple):
    """A row of ChunkTables.chunks: a chunk of a sequence."""

    batch_row: int
    start: int  # its first token on the time axis
    length: int


class InnerCapture(NamedTuple):
    """A row of ChunkTables.inner: a capture inside a chunk, the state after its first `offset`
    tokens (0 < offset < the chunk's length)."""

    row: int  # the capture row it is stored into
    chunk: int
    offset: int


class ChunkRow(NamedTuple):
    """A row of ChunkTables.chunks, the work of one chunk in the fused pass: a Chunk, where it sits
    in its sequence, and which captures it serves. An empty sequence has one row of length 0, so
    that its final state (its initial one) is written like any other."""

    batch_row: int
    start: int  # its first token on the time axis
    length: int
    seq: int
    index: int  # its place among its sequence's chunks: the walk hands chunk index-1's end state to it
    last: int  # 1 for its sequence's last chunk, which writes the final state
    start_row: int  # the capture row that takes its start state, -1 for none
    end_row: int  # the capture row that takes the final state (last chunks only), -1 for none
    inner_first: int  # its inner captures are ChunkTables.inner[inner_first:inner_end]
    inner_end: int


@dataclass(frozen=True)
class ChunkTables:
    """The chunk grid of one pass and the captures mapped onto it.

    Sequence s of length n starting at absolute position a owns the chunks that cover
    [a, a + n) cut at the multiples of chunk_size: a first chunk up to the next grid point (all of
    chunk_size when a is one), full chunks, and a last partial one; an empty sequence owns none.

    Device tensors (int64):
    chunks: (nrows, 10): a ChunkRow a row: the chunks in sequence order (chunk_list's), then one
        row of length 0 for each empty sequence.
    inner: (ninner, 3): an InnerCapture a row (capture row, chunk, offset j) for each capture
        inside a chunk (0 < j < the chunk's length): the state after the chunk's first j tokens;
        in chunk order.
    copy_rows, copy_from: (ncopy,): capture row copy_rows[i] repeats row copy_from[i] (the same
        sequence and offset asked for again).
    On the host: chunk_list, inner_list (the chunks and inner captures as Chunk and InnerCapture
    tuples), seq_chunk_list (sequence s owns chunks [seq_chunk_list[s], seq_chunk_list[s + 1])),
    start_row_list (the capture row that takes chunk c's start state, -1 for none), end_row_list
    (the capture row that takes sequence s's final state, offset == length, -1 for none).
    """

    chunk_size: int
    chunks: torch.Tensor
    inner: torch.Tensor
    copy_rows: torch.Tensor
    copy_from: torch.Tensor
    chunk_list: list[Chunk]
    seq_chunk_list: list[int]
    start_row_list: list[int]
    end_row_list: list[int]
    inner_list: list[InnerCapture]

    @property
    def nchunks(self) -> int:
        return len(self.chunk_list)

    @property
    def nrows(self) -> int:
        """Rows of `chunks`: the chunks and the empty sequences."""
        return self.chunks.shape[0]


def _chunk_of(k: int, first: int, chunk_size: int) -> tuple[int, int]:
    """(chunk index within the sequence, tokens of it consumed) of the state after k tokens, for a
    sequence whose first chunk holds `first` tokens."""
    if k < first:
        return 0, k
    return 1 + (k - first) // chunk_size, (k - first) % chunk_size


def make_chunk_tables(seqs: Sequences, captures: CaptureTable, chunk_size: int, start_positions: list[int],
                      device: torch.device) -> ChunkTables:
    chunk_list, seq_chunks, firsts = [], [0], []
    for (b, start, length), position in zip(seqs.spans(), start_positions):
        first = chunk_size - position % chunk_size  # tokens up to the next grid point
        firsts.append(first)
        bounds = [0] + list(range(first, length, chunk_size)) + [length]
        chunk_list += [Chunk(b, start + lo, hi - lo) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
        seq_chunks.append(len(chunk_list))
    start_rows, end_rows = [-1] * len(chunk_list), [-1] * seqs.count
    inner_list, copies, first_row = [], [], {}
    for s, k, row in captures.entries:
        if (s, k) in first_row:
            copies.append((row, first_row[s, k]))
            continue
        first_row[s, k] = row
        if k == seqs.lengths[s]:
            end_rows[s] = row
            continue
        c, j = _chunk_of(k, firsts[s], chunk_size)
        if j == 0:
            start_rows[seq_chunks[s] + c] = row
        else:
            inner_list.append(InnerCapture(row, seq_chunks[s] + c, j))
    inner_list.sort(key=lambda entry: entry.chunk)
    inner_bounds = [0] * (len(chunk_list) + 1)  # chunk c's inner captures: [inner_bounds[c], inner_bounds[c + 1])
    for entry in inner_list:
        inner_bounds[entry.chunk + 1] += 1
    for c in range(len(chunk_list)):
        inner_bounds[c + 1] += inner_bounds[c]
    rows, empty = [], []
    for s in range(seqs.count):
        first_chunk, end = seq_chunks[s], seq_chunks[s + 1]
        for c in range(first_chunk, end):
            last = c == end - 1
            rows.append(ChunkRow(*chunk_list[c], s, c - first_chunk, int(last), start_rows[c],
                                 end_rows[s] if last else -1, inner_bounds[c], inner_bounds[c + 1]))
        if first_chunk == end:
            empty.append(ChunkRow(0, 0, 0, s, 0, 1, -1, end_rows[s], 0, 0))
    chunks, inner, copy_rows, copy_from = int_tables(  # one copy
        device, rows + empty, inner_list, [r for r, _ in copies], [f for _, f in copies])
    return ChunkTables(chunk_size, chunks.view(-1, len(ChunkRow._fields)), inner.view(-1, len(InnerCapture._fields)),
                       copy_rows, copy_from, chunk_list, seq_chunks, start_rows, end_rows, inner_list)
