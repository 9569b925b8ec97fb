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

import torch

from ..._common import CaptureTable, Sequences, int_tables


@dataclass(frozen=True)
class ChunkTables:
    """The chunk grid of one pass and the captures mapped onto it.

    Sequence s of length n starting at absolute position a owns the chunks that cover
    [a, a + n) cut at the multiples of chunk_size: a first chunk up to the next grid point (all of
    chunk_size when a is one), full chunks, and a last partial one; an empty sequence owns none.

    Device tensors (int64):
    chunks: (nchunks, 3): (batch row, first token on the time axis, length).
    end_rows: (nseq,): the capture row that takes sequence s's final state (offset == length,
        which covers empty sequences), -1 for none.
    inner: (ninner, 3): (capture row, chunk, offset j) of each capture inside a chunk
        (0 < j < the chunk's length): the state after the chunk's first j tokens; in chunk order.
    steps: (nsteps + 1, 8): the state-passing walk, one step a chunk (or one per inner capture
        of a chunk that has several): (chunk, first, last, start row, inner capture, its row,
        its offset j, 0 as padding). At its first step (first = 1) a chunk's start state is
        stored, and captured into capture row `start row` unless that is -1; at its last
        (last = 1) the walk moves past the chunk; a step whose `inner capture` (an index into
        inner) is not -1 computes it. A row of zeros follows the last step (the walk reads each
        row a step ahead).
    seq_steps: (nseq + 1,): sequence s walks steps [seq_steps[s], seq_steps[s + 1]).
    copy_rows, copy_from: (ncopy,): capture row copy_rows[i] repeats row copy_from[i] (the same
        sequence and offset asked for again).
    On the host: chunk_list, inner_list (the same as chunks, inner), seq_chunk_list (sequence s
    owns chunks [seq_chunk_list[s], seq_chunk_list[s + 1])), start_row_list (the capture row
    that takes chunk c's start state, -1 for none), end_row_list.
    """

    chunk_size: int
    chunks: torch.Tensor
    end_rows: torch.Tensor
    inner: torch.Tensor
    steps: torch.Tensor
    seq_steps: torch.Tensor
    copy_rows: torch.Tensor
    copy_from: torch.Tensor
    chunk_list: list[tuple[int, int, int]]
    seq_chunk_list: list[int]
    start_row_list: list[int]
    end_row_list: list[int]
    inner_list: list[tuple[int, int, int]]

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
        chunk_list += [(b, start + lo, hi - lo) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
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
            inner_list.append((row, seq_chunks[s] + c, j))
    inner_list.sort(key=lambda entry: entry[1])
    by_chunk = [[] for _ in chunk_list]
    for i, (row, c, j) in enumerate(inner_list):
        by_chunk[c].append((i, row, j))
    steps, seq_steps = [], [0]
    for s in range(seqs.count):
        for c in range(seq_chunks[s], seq_chunks[s + 1]):
            inner = by_chunk[c] or [(-1, -1, 0)]
            steps += [(c, int(k == 0), int(k == len(inner) - 1), start_rows[c] if k == 0 else -1,
                       *capture, 0) for k, capture in enumerate(inner)]
        seq_steps.append(len(steps))
    steps.append((0,) * 8)

    chunks, end_t, inner, steps_t, seq_steps_t, copy_rows, copy_from = int_tables(
        device, chunk_list, end_rows, inner_list, steps, seq_steps,
        [r for r, _ in copies], [f for _, f in copies])
    return ChunkTables(chunk_size, chunks.view(-1, 3), end_t, inner.view(-1, 3), steps_t.view(-1, 8),
                     seq_steps_t, copy_rows, copy_from, chunk_list, seq_chunks, start_rows, end_rows, inner_list)
