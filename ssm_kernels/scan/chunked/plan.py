"""Host-side tables of the chunked scan: the chunk grid of a pass and where each capture falls.

Both chunked backends (Triton and PyTorch) read the same tables, so they cut sequences into the
same chunks and serve captures the same way.

The grid is fixed by absolute positions: chunk boundaries sit at the multiples of chunk_size of
each sequence's absolute positions (its pass starts at `start_positions[s]`). A chunk is then the
same tokens, computed by the same operations from the same chunk-start state, whichever pass it
falls in, as long as the pass starts at a grid point: that is what makes a pass that resumes at a
multiple of chunk_size bit-identical to one longer pass.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..._common import CaptureTable, Sequences


@dataclass(frozen=True)
class ChunkPlan:
    """The chunk grid of one pass and the captures mapped onto it.

    Sequence s of length n starting at absolute position a owns the chunks that cover
    [a, a + n) cut at the multiples of chunk_size: a first chunk up to the next grid point (all of
    chunk_size when a is one), full chunks, and a last partial one; an empty sequence owns none.

    chunks: (nchunks, 3) int64 on the device: (batch row, first token on the time axis, length).
    seq_chunks: (nseq + 1,) int64 on the device: sequence s owns chunks [seq_chunks[s], seq_chunks[s + 1]).
    inner: (ninner, 3) int64 on the device: (capture row, chunk, offset j inside the chunk) of each
        capture that is not at its sequence's end: the state after the chunk's first j tokens
        (j = 0 is the chunk-start state itself).
    slots: (nchunks,) int64 on the device: where the float32 start state of a chunk that serves
        inner captures is kept (0..nslots-1), -1 for other chunks. Only those chunks keep a
        float32 start state; the others keep it in the matmul dtype, all the output needs.
    final_rows, final_seqs: (nfinal,) int64 on the device: capture row final_rows[i] is the final
        state of sequence final_seqs[i] (offset == length, which covers empty sequences).
    chunk_list, inner_list: the same tables on the host.
    """

    chunk_size: int
    chunks: torch.Tensor
    seq_chunks: torch.Tensor
    inner: torch.Tensor
    slots: torch.Tensor
    nslots: int
    final_rows: torch.Tensor
    final_seqs: torch.Tensor
    chunk_list: list[tuple[int, int, int]]
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


def make_plan(seqs: Sequences, captures: CaptureTable, chunk_size: int, start_positions: list[int],
              device: torch.device) -> ChunkPlan:
    chunk_list, seq_chunks, firsts = [], [0], []
    for (b, start, length), position in zip(seqs.spans(), start_positions):
        first = chunk_size - position % chunk_size  # tokens up to the next grid point
        firsts.append(first)
        bounds = [0] + list(range(first, length, chunk_size)) + [length]
        chunk_list += [(b, start + lo, hi - lo) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
        seq_chunks.append(len(chunk_list))
    inner_list, final_rows, final_seqs = [], [], []
    for s, k, row in captures.entries:
        if k == seqs.lengths[s]:
            final_rows.append(row)
            final_seqs.append(s)
        else:
            c, j = _chunk_of(k, firsts[s], chunk_size)
            inner_list.append((row, seq_chunks[s] + c, j))
    slot_of = {}
    for _, c, _ in inner_list:
        slot_of.setdefault(c, len(slot_of))
    slots = [slot_of.get(c, -1) for c in range(len(chunk_list))]

    def table(values, width):
        return torch.tensor(values, dtype=torch.int64, device=device).view(-1, width)

    return ChunkPlan(chunk_size, table(chunk_list, 3), table(seq_chunks, 1).view(-1), table(inner_list, 3),
                     table(slots, 1).view(-1), len(slot_of), table(final_rows, 1).view(-1),
                     table(final_seqs, 1).view(-1), chunk_list, inner_list)
