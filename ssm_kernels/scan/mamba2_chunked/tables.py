"""Host-side tables of the chunked scan: the chunk grid of a pass and where each capture falls.

Both chunked backends (Triton and PyTorch) read the same tables, so they cut sequences into the
same chunks and serve captures the same way.

The grid is fixed by absolute positions: chunk boundaries sit at the multiples of chunk_size of
each sequence's absolute positions (its pass starts at `start_positions[s]`). A chunk is then the
same tokens, computed by the same operations from the same chunk-start state, whichever pass it
falls in, as long as the pass starts at a grid point: that is what makes a pass that resumes at a
multiple of chunk_size bit-identical to one longer pass.

Every capture belongs to one chunk: the state after k tokens of sequence s is the state after
j tokens of the chunk where it falls, with 0 <= j <= the chunk's length; on a grid point it is the
start of the chunk after it (j = 0), or the end of the sequence's last chunk (j = its length).
The walk holds those two anyway, so they are stored straight from it; a state inside a chunk
(0 < j < length) is computed apart, from the chunk's start state and the contribution of its
first j tokens. A capture names its entry in the pass's CaptureTable (sorted by sequence and
offset), whose `row` tensor holds the row (an engine's slot) it is stored into: the tables never
need the rows on the host.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..._common import CaptureTable, Sequences, cache_stream, int_tables


class Chunk(NamedTuple):
    """An item of ChunkTables.chunk_list: a chunk of a sequence (the span of a ChunkRow)."""

    batch_row: int
    start: int  # its first token on the time axis
    length: int


class ChunkCapture(NamedTuple):
    """An item of ChunkTables.capture_list (and a row of its `inner` table): the state after the
    first `offset` tokens of a chunk row (0 <= offset <= its length), for entry `entry` of the
    pass's CaptureTable."""

    entry: int
    chunk: int  # the row of ChunkTables.chunks
    offset: int


class ChunkRow(NamedTuple):
    """A row of ChunkTables.chunks: a Chunk and where it sits in its sequence. An empty sequence
    has one row of length 0 (after the chunks), so that its captures have a row like any other's."""

    batch_row: int
    start: int  # its first token on the time axis
    length: int
    seq: int
    index: int  # its place among its sequence's chunks (0: it starts from the initial state)
    last: int  # 1 for its sequence's last chunk, which ends at the final state


class Step(NamedTuple):
    """A row of ChunkTables.steps: one step of the state-passing walk (Triton's stage 4)."""

    chunk: int
    first: int  # 1 at the chunk's first step: its start state is stored for the output stage
    last: int  # 1 at the chunk's last step: the walk moves past the chunk
    start_entry: int  # a capture of the chunk's start state (its CaptureTable entry), -1 for none
    inner: int  # the inner capture this step computes (an index into inner_list), -1 for none
    inner_entry: int  # its CaptureTable entry, -1 for none
    inner_offset: int  # its offset in the chunk, 0 for none


# Columns of ChunkTables.steps: Step's 7 fields and a zero, which pads a row to a power-of-two width
# (64 bytes): a row's address is its index shifted.
STEP_WIDTH = 8
_STEP_PADDING = (0,) * (STEP_WIDTH - len(Step._fields))


@dataclass(frozen=True)
class ChunkTables:
    """The chunk grid of one pass and the captures mapped onto it.

    Sequence s of length n starting at absolute position a owns the chunks that cover
    [a, a + n) cut at the multiples of chunk_size: a first chunk up to the next grid point (all of
    chunk_size when a is one), full chunks, and a last partial one; an empty sequence owns none.

    Device tensors (int64):
    chunks: (nrows, 6): a ChunkRow a row: the chunks in sequence order (chunk_list's), then one
        row of length 0 for each empty sequence.
    The Triton stages' walk over the captures (stages 3 and 4; one asked for twice is computed
    twice, the same way):
    inner: (ninner, 3): inner_list's rows (entry, chunk, offset), in chunk order.
    steps: (nsteps, STEP_WIDTH): the state-passing walk, a Step a row (and a padding column),
        one step a chunk, or more where a chunk has several start or inner captures.
    seq_steps: (nseq + 1,): sequence s walks steps [seq_steps[s], seq_steps[s + 1]).
    chunk_steps: (nchunks + 1,): chunk c's steps are [chunk_steps[c], chunk_steps[c + 1]) (the fused
        pass walks a chunk at a time).
    end_bounds, end_entries: sequence s's final state goes to the captures
        end_entries[end_bounds[s]:end_bounds[s + 1]] (CaptureTable entries).
    On the host: row_list (chunks's rows), capture_list (every capture as a ChunkCapture, in row
    order), inner_list (those inside a chunk, 0 < offset < its length: inner's rows);
    chunk_list (the chunks, Chunk tuples: the first nchunks rows' spans); seq_chunk_list
    (sequence s owns chunks [seq_chunk_list[s], seq_chunk_list[s + 1])); row_chunks: where
    sequence s starts batch row s (a dense pass, or a varlen pass of one sequence), all of one
    length and cut on the grid from their first token, the chunks of each (chunk c is then chunk
    c % row_chunks of row c // row_chunks, from token (c % row_chunks) x chunk_size), else 0;
    plain_walk: whether step t is chunk t, one step a chunk, with no capture at a chunk's start or
    inside one (a final state's aside): the walk then needs no row of `steps`.
    """

    chunk_size: int
    chunks: torch.Tensor
    inner: torch.Tensor
    steps: torch.Tensor
    seq_steps: torch.Tensor
    chunk_steps: torch.Tensor
    end_bounds: torch.Tensor
    end_entries: torch.Tensor
    row_list: list[ChunkRow]
    capture_list: list[ChunkCapture]
    inner_list: list[ChunkCapture]
    chunk_list: list[Chunk]
    seq_chunk_list: list[int]
    row_chunks: int
    plain_walk: bool

    @property
    def nchunks(self) -> int:
        return len(self.chunk_list)

    @property
    def nrows(self) -> int:
        """Rows of `chunks`: the chunks and the empty sequences."""
        return len(self.row_list)


def _chunk_of(k: int, first: int, chunk_size: int) -> tuple[int, int]:
    """(chunk index within the sequence, tokens of it consumed) of the state after k tokens, for a
    sequence whose first chunk holds `first` tokens."""
    if k < first:
        return 0, k
    return 1 + (k - first) // chunk_size, (k - first) % chunk_size


def make_chunk_tables(seqs: Sequences, captures: CaptureTable, chunk_size: int, start_positions: list[int],
                      device: torch.device) -> ChunkTables:
    """The tables of a pass. captures.entries gives each capture's (sequence, offset) on the host;
    its rows are read by the kernels only."""
    plan = plan_chunks(seqs, captures.entries, chunk_size, start_positions)
    return plan.on_device(*int_tables(device, *plan.device_lists))  # one copy


# Passes whose tables were made lately, by what the tables depend on (and the stream whose copy
# filled them): the layers of a model run one pass after another on the same sequences.
RECENT_TABLES = 16


@dataclass(frozen=True)
class RecentPass:
    """A recent pass's tables, and the launches the public chunked path recorded over them, by
    the call's other arguments and its tensors' layout (_replay.run's `launches`)."""

    tables: ChunkTables
    launches: dict


def recent_pass(seqs: Sequences, captures: CaptureTable, chunk_size: int, start_positions: list[int],
                device: torch.device) -> RecentPass:
    """make_chunk_tables's tables, the same tensors (with the same recorded launches) for a pass
    like one of the last RECENT_TABLES (same grid and captures on the same device and stream;
    nothing writes them), so a model's later layers skip the planning and the copy, and replay
    their launches. A pass captured into a CUDA graph gets tables of its own: the graph would go
    on reading memory that this cache may free."""
    keep, stream = cache_stream(device)
    if not keep:
        return RecentPass(make_chunk_tables(seqs, captures, chunk_size, start_positions, device), {})
    return _recent_tables(chunk_size, seqs.varlen, tuple(seqs.lengths), tuple(start_positions),
                          tuple((s, k) for s, k, _ in captures.entries), device, stream)


@functools.lru_cache(maxsize=RECENT_TABLES)
def _recent_tables(chunk_size: int, varlen: bool, lengths: tuple, start_positions: tuple, captures: tuple,
                   device: torch.device, stream: int | None) -> RecentPass:
    entries = [(s, k, None) for s, k in captures]  # the rows stay the pass's own
    return RecentPass(make_chunk_tables(Sequences(None, list(lengths), varlen), CaptureTable(None, None, None, entries),
                                        chunk_size, list(start_positions), device), {})


@dataclass(frozen=True)
class ChunkPlan:
    """ChunkTables's host side, before its one copy to the device (which a caller may share with
    tables of its own: int_tables(device, *plan.device_lists, *its_own))."""

    chunk_size: int
    row_list: list[ChunkRow]
    capture_list: list[ChunkCapture]
    chunk_list: list[Chunk]
    seq_chunk_list: list[int]
    row_chunks: int  # ChunkTables's

    steps: list[tuple]
    seq_steps: list[int]
    chunk_steps: list[int]
    end_bounds: list[int]
    end_entries: list[int]
    inner_list: list[ChunkCapture]

    @property
    def plain_walk(self) -> bool:
        """ChunkTables's: no step with a start or an inner capture (then one step a chunk)."""
        start, inner = Step._fields.index("start_entry"), Step._fields.index("inner")
        return all(step[start] < 0 and step[inner] < 0 for step in self.steps)

    @property
    def device_lists(self) -> tuple[list, ...]:
        return (self.row_list, self.inner_list, self.steps, self.seq_steps, self.chunk_steps, self.end_bounds,
                self.end_entries)

    def on_device(self, chunks, inner, steps, seq_steps, chunk_steps, end_bounds, end_entries) -> ChunkTables:
        """The tables, given device_lists's tensors (int_tables')."""
        return ChunkTables(self.chunk_size, chunks.view(-1, len(ChunkRow._fields)),
                           inner.view(-1, len(ChunkCapture._fields)), steps.view(-1, STEP_WIDTH), seq_steps,
                           chunk_steps, end_bounds, end_entries, self.row_list, self.capture_list, self.inner_list,
                           self.chunk_list, self.seq_chunk_list, self.row_chunks, self.plain_walk)


def plan_chunks(seqs: Sequences, entries: list, chunk_size: int, start_positions: list[int]) -> ChunkPlan:
    """The chunk grid and the captures' places on it (entries: the capture table's sorted
    (sequence, offset, row) entries; rows unused)."""
    chunk_list, seq_chunks, firsts = [], [0], []
    for (b, start, length), position in zip(seqs.spans(), start_positions):
        first = chunk_size - position % chunk_size  # tokens up to the next grid point
        firsts.append(first)
        bounds = [0] + list(range(first, length, chunk_size)) + [length]
        chunk_list += [Chunk(b, start + lo, hi - lo) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
        seq_chunks.append(len(chunk_list))
    # Row of each sequence's last chunk, or of its empty row (those follow the chunks).
    empty = [s for s in range(seqs.count) if seq_chunks[s] == seq_chunks[s + 1]]
    last_row = {s: len(chunk_list) + i for i, s in enumerate(empty)}
    capture_list = []
    for entry, (s, k, _) in enumerate(entries):
        if k == seqs.lengths[s]:  # the final state: the end of the last row
            row = last_row.get(s, seq_chunks[s + 1] - 1)
            capture_list.append(ChunkCapture(entry, row, chunk_list[row].length if row < len(chunk_list) else 0))
        else:
            c, j = _chunk_of(k, firsts[s], chunk_size)
            capture_list.append(ChunkCapture(entry, seq_chunks[s] + c, j))
    capture_list.sort(key=lambda capture: capture.chunk)
    rows = [ChunkRow(*chunk_list[c], s, c - seq_chunks[s], int(c == seq_chunks[s + 1] - 1))
            for s in range(seqs.count) for c in range(seq_chunks[s], seq_chunks[s + 1])]
    rows += [ChunkRow(0, 0, 0, s, 0, 1) for s in empty]
    # Sequence s is batch row s (dense), or the one sequence of row 0 (varlen), and all start on the grid.
    on_grid = (not seqs.varlen or seqs.count == 1) and len(set(seqs.lengths)) == 1 \
        and all(a % chunk_size == 0 for a in start_positions)
    row_chunks = -(-seqs.lengths[0] // chunk_size) if on_grid else 0
    return ChunkPlan(chunk_size, rows, capture_list, chunk_list, seq_chunks, row_chunks,
                     *_walk(rows, capture_list, len(chunk_list), seq_chunks, seqs.count))


def _walk(rows: list[ChunkRow], capture_list: list[ChunkCapture], nchunks: int, seq_chunks: list[int],
          nseq: int) -> tuple:
    """The state-passing walk's tables: (steps, seq_steps, chunk_steps, end_bounds, end_entries, inner_list)."""
    starts, inners, ends = [[] for _ in range(nchunks)], [[] for _ in range(nchunks)], [[] for _ in range(nseq)]
    inner_list = []
    for capture in capture_list:
        entry, r, j = capture
        row = rows[r]
        if j == row.length and row.last:  # the sequence's final state (an empty sequence's too)
            ends[row.seq].append(entry)
        elif j == 0:
            starts[r].append(entry)
        else:
            inners[r].append((len(inner_list), entry, j))
            inner_list.append(capture)
    steps, seq_steps, chunk_steps = [], [0], [0]
    for s in range(nseq):
        for c in range(seq_chunks[s], seq_chunks[s + 1]):
            n = max(1, len(starts[c]), len(inners[c]))
            for k in range(n):
                i, entry, j = inners[c][k] if k < len(inners[c]) else (-1, -1, 0)
                step = Step(c, first=int(k == 0), last=int(k == n - 1),
                            start_entry=starts[c][k] if k < len(starts[c]) else -1, inner=i, inner_entry=entry,
                            inner_offset=j)
                steps.append((*step, *_STEP_PADDING))
            chunk_steps.append(len(steps))
        seq_steps.append(len(steps))
    end_bounds = [0]
    for entries in ends:
        end_bounds.append(end_bounds[-1] + len(entries))
    return steps, seq_steps, chunk_steps, end_bounds, [e for entries in ends for e in entries], inner_list
