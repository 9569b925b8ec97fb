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


class Step(NamedTuple):
    """A row of ChunkTables.steps: one step of the state-passing walk."""

    chunk: int
    first: int  # 1 at the chunk's first step: its start state is stored (and captured into start_row)
    last: int  # 1 at the chunk's last step: the walk moves past the chunk
    start_row: int  # the capture row that takes the chunk's start state (first steps only), -1 for none
    inner: int  # the inner capture this step computes (an index into ChunkTables.inner), -1 for none
    inner_row: int  # its capture row, -1 for none
    inner_offset: int  # its offset in the chunk, 0 for none


# Columns of ChunkTables.steps: Step's 7 fields and a zero, which pads a row to a power-of-two width
# (64 bytes): a row's address is its index shifted.
STEP_WIDTH = 8
_STEP_PADDING = (0,) * (STEP_WIDTH - len(Step._fields))
_LAST_ROW = (0,) * STEP_WIDTH  # read a step ahead by the walk's last step, never run


@dataclass(frozen=True)
class ChunkTables:
    """The chunk grid of one pass and the captures mapped onto it.

    Sequence s of length n starting at absolute position a owns the chunks that cover
    [a, a + n) cut at the multiples of chunk_size: a first chunk up to the next grid point (all of
    chunk_size when a is one), full chunks, and a last partial one; an empty sequence owns none.

    Device tensors (int64):
    chunks: (nchunks, 3): a Chunk a row (batch row, first token on the time axis, length).
    end_rows: (nseq,): the capture row that takes sequence s's final state (offset == length,
        which covers empty sequences), -1 for none.
    inner: (ninner, 3): an InnerCapture a row (capture row, chunk, offset j) for each capture
        inside a chunk (0 < j < the chunk's length): the state after the chunk's first j tokens;
        in chunk order.
    steps: (nsteps + 1, STEP_WIDTH): the state-passing walk, a Step a row (and a padding column),
        one step a chunk (or one per inner capture of a chunk that has several). At its first
        step a chunk's start state is stored, and captured into capture row `start_row` unless
        that is -1; at its last the walk moves past the chunk; a step whose `inner` is not -1
        computes that inner capture. A row of zeros follows the last step (the walk reads each
        row a step ahead).
    seq_steps: (nseq + 1,): sequence s walks steps [seq_steps[s], seq_steps[s + 1]).
    copy_rows, copy_from: (ncopy,): capture row copy_rows[i] repeats row copy_from[i] (the same
        sequence and offset asked for again).
    On the host: chunk_list, inner_list (the same as chunks, inner, as Chunk and InnerCapture
    tuples), seq_chunk_list (sequence s owns chunks [seq_chunk_list[s], seq_chunk_list[s + 1])),
    start_row_list (the capture row that takes chunk c's start state, -1 for none), end_row_list.
    """

    chunk_size: int
    chunks: torch.Tensor
    end_rows: torch.Tensor
    inner: torch.Tensor
    steps: torch.Tensor
    seq_steps: torch.Tensor
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
    by_chunk = [[] for _ in chunk_list]
    for i, (row, c, j) in enumerate(inner_list):
        by_chunk[c].append((i, row, j))
    steps, seq_steps = [], [0]
    for s in range(seqs.count):
        for c in range(seq_chunks[s], seq_chunks[s + 1]):
            inner = by_chunk[c] or [(-1, -1, 0)]
            for k, (i, row, j) in enumerate(inner):
                step = Step(c, first=int(k == 0), last=int(k == len(inner) - 1),
                            start_row=start_rows[c] if k == 0 else -1, inner=i, inner_row=row, inner_offset=j)
                steps.append((*step, *_STEP_PADDING))
        seq_steps.append(len(steps))
    steps.append(_LAST_ROW)

    chunks, end_t, inner, steps_t, seq_steps_t, copy_rows, copy_from = int_tables(
        device, chunk_list, end_rows, inner_list, steps, seq_steps,
        [r for r, _ in copies], [f for _, f in copies])
    return ChunkTables(chunk_size, chunks.view(-1, len(Chunk._fields)), end_t,
                       inner.view(-1, len(InnerCapture._fields)), steps_t.view(-1, STEP_WIDTH), seq_steps_t,
                       copy_rows, copy_from, chunk_list, seq_chunks, start_rows, end_rows, inner_list)
