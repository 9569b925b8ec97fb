"""Host-side tables of the chunked scan: the chunk grid of a pass and where each capture falls.

Both chunked backends (Triton and PyTorch) read the same tables, so they cut sequences into the
same chunks and serve captures the same way.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..._common import CaptureTable, Sequences


@dataclass(frozen=True)
class ChunkPlan:
    """The chunk grid of one pass and the captures mapped onto it.

    The grid restarts at each sequence start: sequence s of length n owns ceil(n / chunk_size)
    chunks, all full but its last; an empty sequence owns none.

    chunks: (nchunks, 3) int64 on the device: (batch row, first token on the time axis, length).
    seq_chunks: (nseq + 1,) int64 on the device: sequence s owns chunks [seq_chunks[s], seq_chunks[s + 1]).
    inner: (ninner, 3) int64 on the device: (capture row, chunk, offset j inside the chunk) of each
        capture that is not at its sequence's end: the state after the chunk's first j tokens
        (j = 0 is the chunk-start state itself).
    final_rows, final_seqs: (nfinal,) int64 on the device: capture row final_rows[i] is the final
        state of sequence final_seqs[i] (offset == length, which covers empty sequences).
    chunk_list, inner_list: the same tables on the host.
    """

    chunk_size: int
    chunks: torch.Tensor
    seq_chunks: torch.Tensor
    inner: torch.Tensor
    final_rows: torch.Tensor
    final_seqs: torch.Tensor
    chunk_list: list[tuple[int, int, int]]
    inner_list: list[tuple[int, int, int]]

    @property
    def nchunks(self) -> int:
        return len(self.chunk_list)


def make_plan(seqs: Sequences, captures: CaptureTable, chunk_size: int, device: torch.device) -> ChunkPlan:
    chunk_list, seq_chunks = [], [0]
    for b, start, length in seqs.spans():
        chunk_list += [(b, start + lo, min(chunk_size, length - lo)) for lo in range(0, length, chunk_size)]
        seq_chunks.append(len(chunk_list))
    inner_list, final_rows, final_seqs = [], [], []
    for s, k, row in captures.entries:
        if k == seqs.lengths[s]:
            final_rows.append(row)
            final_seqs.append(s)
        else:
            inner_list.append((row, seq_chunks[s] + k // chunk_size, k % chunk_size))

    def table(values, width):
        return torch.tensor(values, dtype=torch.int64, device=device).view(-1, width)

    return ChunkPlan(chunk_size, table(chunk_list, 3), table(seq_chunks, 1).view(-1), table(inner_list, 3),
                     table(final_rows, 1).view(-1), table(final_seqs, 1).view(-1), chunk_list, inner_list)
