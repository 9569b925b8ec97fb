"""A serving engine's step, described once and shared by every layer of that step.

An engine builds one PrefillBatch (or DecodeBatch) per forward step from its own metadata: the
sequences of the pass, the cache slot each one reads and writes, whether it continues from a
cached state, and where captured states go. Every layer's call then takes the batch and writes
into the engine's cache tensors in place. Building the batch is where index tensors are prepared
(a few small ones, once per step); with validate=False (and no start_positions, or
host_cu_seqlens with them) it reads nothing back from the device, so it works under CUDA graphs
and asynchronous scheduling.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .._common import (INDEX_DTYPES, CaptureTable, Sequences, capture_lists, capture_table, check_bool,
                       check_decode_slot_lists, check_optional_int, check_tensor, host_ints,
                       int_tables, lengths_from_bounds, slot_error)
from ..scan import mamba2_chunked
from ..scan.algorithm import check_start_positions
from ..scan.mamba2_chunked.tables import make_chunk_tables, plan_chunks

CHUNK_TABLES = "mamba2 chunk tables"  # PrefillBatch.prepared's key (with the chunk size)

# vLLM's conventions: PAD_SLOT_ID marks a padded prefill row, NULL_BLOCK_ID a padded decode row.
PAD_SLOT_ID = -1
NULL_BLOCK_ID = 0


@dataclass(frozen=True)
class PrefillBatch:
    """The sequences of one prefill pass and where their states live.

    seqs: the varlen layout (tokens of sequence s are [cu_seqlens[s], cu_seqlens[s + 1])).
    state_indices: (nseq,) slot each sequence reads its initial state from and writes its final
        state to. has_initial: (nseq,) bool or None (all continue from their slot).
    captures: per-sequence tables of (offset, destination slot) sorted by offset.
    skip_slot: rows whose slot equals it are not computed (None: every row is).
    host: the step on the host, for the chunked algorithm (None without start_positions).
    extremes: (argument, index, slot) of the smallest and largest slot each index argument
        writes or reads, where the batch read them back (see slot_extremes); ntokens: the tokens
        the pass needs (cu_seqlens[-1]), likewise, else None. The ops check these against the
        tensors they are given.
    prepared: what the step's layers share, built by the first layer that needs it: tables derived
        from the batch and scratch tensors (see per_step).
    launches: the launches the step's layers recorded, replayed by its later layers (_replay.py).
    A batch made by dataclasses.replace starts without prepared and launches.
    """

    seqs: Sequences
    state_indices: torch.Tensor
    has_initial: torch.Tensor | None
    captures: CaptureTable
    skip_slot: int | None
    host: HostStep | None = None
    extremes: tuple = ()
    ntokens: int | None = None
    prepared: dict = field(init=False, default_factory=dict, compare=False, repr=False)
    launches: dict = field(init=False, default_factory=dict, compare=False, repr=False)

    @property
    def device_only(self) -> bool:
        """Whether the lengths and captures are on the device only (a CUDA batch built with
        validate=False and no start_positions): seqs.lengths are placeholders, and the PyTorch
        paths take host_view(batch)."""
        return self.host is None and self.ntokens is None


@dataclass(frozen=True)
class HostStep:
    """A prefill step's indices on the host: the chunked algorithm plans its chunks there.

    start_positions: (nseq,) absolute position of each sequence's first token (its computed-token
        count), which puts the chunk grid at multiples of chunk_size of absolute positions.
    slots, has_initial: per sequence, as state_indices and has_initial_state.
    captures: (sequence, offset, slot) of the captures that are written (not skipped), sorted.
    slots, has_initial and captures are None for a batch built from host lengths and captures
    (prefill_batch's host_cu_seqlens), which reads nothing back: the Triton chunked kernels need
    none of them; host_indices reads them back for the paths that do.
    """

    start_positions: list[int]
    slots: list[int] | None
    has_initial: list[bool] | None
    captures: list[tuple[int, int, int]] | None


@dataclass(frozen=True)
class DecodeBatch:
    """One token per row: row b reads slot state_indices[b] and writes dst_state_indices[b]."""

    seqs: Sequences
    state_indices: torch.Tensor
    dst_state_indices: torch.Tensor | None
    captures: CaptureTable  # always empty: the kernels' capture table for "none"
    skip_slot: int | None
    extremes: tuple = ()  # as in PrefillBatch
    launches: dict = field(init=False, default_factory=dict, compare=False, repr=False)  # as in PrefillBatch


def slot_extremes(name, slots, live=None):
    """(name, index, slot) of the smallest and largest of `slots` (host ints) where `live` (all
    by default): all an op needs to check them against its cache's size."""
    used = [(slot, i) for i, slot in enumerate(slots) if live is None or live[i]]
    return tuple((name, i, slot) for slot, i in (min(used), max(used))) if used else ()


def _device_captures(seq, offset, slot, nseq: int, skip_slot: int | None) -> CaptureTable:
    """Capture tables sorted on the device, for a batch that reads nothing back: (sequence,
    offset) order, per-sequence bounds by searchsorted; `entries` holds only the count.

    Declined captures (slot == skip_slot) may hold any placeholder sequence and offset: they sort
    past the last sequence's bounds, so no kernel reaches them, and the host tables leave them out."""
    device = seq.device
    seq, offset, slot = seq.long(), offset.long(), slot.long()
    if skip_slot is not None:
        declined = slot == skip_slot
        seq = torch.where(declined, nseq, seq)
        offset = torch.where(declined, 0, offset)
    order = torch.argsort(seq * ((1 << 40) + 1) + offset, stable=True)  # offsets below 2^40 tokens
    seq, offset, slot = seq[order], offset[order], slot[order]
    ptr = torch.searchsorted(seq, torch.arange(nseq + 1, device=device), right=False)
    return CaptureTable(ptr, offset, slot, [None] * seq.numel())  # declined ones counted too


def _read_back(*tensors) -> list[list[int] | None]:
    """Small int or bool tensors' values on the host, in one transfer (one sync on a GPU, however
    many tensors); None stays None."""
    present = [t.reshape(-1).long() for t in tensors if t is not None]
    flat = torch.cat(present).tolist() if present else []
    values, start = [], 0
    for t in tensors:
        if t is None:
            values.append(None)
            continue
        values.append(flat[start:start + t.numel()])
        start += t.numel()
    return values


def _no_captures(nseq: int, device) -> CaptureTable:
    return CaptureTable(torch.zeros(nseq + 1, dtype=torch.int64, device=device), None, None, [])


def _has_initial(has_initial_state, nseq: int, device) -> tuple[torch.Tensor | None, list[bool] | None]:
    """has_initial_state as a dense (nseq,) bool tensor on `device`, and as host bools where it
    came as a list or tuple of bools (an engine's host data: sent in one copy, never read back)."""
    if has_initial_state is None:
        return None, None
    if isinstance(has_initial_state, torch.Tensor):
        check_tensor("has_initial_state", has_initial_state, [("nseq", nseq)], (torch.bool,))
        if has_initial_state.device != device:
            raise ValueError(f"has_initial_state is on {has_initial_state.device} but cu_seqlens is on {device}")
        return has_initial_state.contiguous(), None
    if not isinstance(has_initial_state, (list, tuple)):
        raise TypeError(f"has_initial_state must be a (nseq,) bool tensor or a list of bools, got "
                        f"{type(has_initial_state).__name__}")
    if len(has_initial_state) != nseq:
        raise ValueError(f"has_initial_state must hold one bool per sequence ({nseq}), got {len(has_initial_state)}")
    values = [check_bool(f"has_initial_state[{s}]", v) for s, v in enumerate(has_initial_state)]
    return int_tables(device, values)[0].bool(), values


def prefill_batch(cu_seqlens, state_indices, *, has_initial_state=None, capture_seq=None,
                  capture_offset=None, capture_slot=None, skip_slot=PAD_SLOT_ID, nslots=None,
                  validate=True, start_positions=None, host_cu_seqlens=None, chunk_size=None) -> PrefillBatch:
    """Describe a prefill step once; pass the result to every layer's prefill calls.

    Args:
        cu_seqlens: (nseq + 1,) int32/int64, the tokens of each sequence in the packed pass.
        state_indices: (nseq,) int32/int64 cache slots: sequence s continues from the state in
            its slot (where has_initial_state[s], else from zeros) and leaves its final state there.
        has_initial_state: (nseq,) bool tensor or a list of nseq bools, optional (default: every
            sequence continues).
        capture_seq, capture_offset, capture_slot: (ncapture,) int32/int64 (capture_seq and
            capture_offset may also be host lists of ints), all or none: write the
            state of sequence capture_seq[i] after capture_offset[i] tokens of this pass into slot
            capture_slot[i] (0 <= offset <= the sequence's length), in the same pass. Any order.
            A capture whose slot is skip_slot is dropped: an engine can propose captures on the
            device and decline some without a host round trip.
        skip_slot: rows whose state_indices entry equals this are skipped (vLLM's PAD_SLOT_ID,
            -1, by default); None computes every row.
        nslots: the cache's slot count (an int >= 1), for validation (optional).
        validate: check values on the host (one read back, one device sync on CUDA): lengths, slot
            ranges, that live rows' slots are distinct and that no capture lands on a slot a row
            reads. With False (and no start_positions) nothing is read back; bad values are then
            undefined behaviour.
        start_positions: (nseq,) ints (a list or a 1-D int tensor), optional: the absolute position
            of each sequence's first token, i.e. the tokens it has already computed (vLLM's
            num_computed_tokens). Needed by the prefill ops' chunked algorithm, which puts its
            chunk grid there and plans chunks on the host: with start_positions the batch reads
            its lengths, slots, flags and captures back to the host in one transfer (one device
            sync on CUDA, even with validate=False), unless host_cu_seqlens is given.
        host_cu_seqlens: cu_seqlens's values on the host (a list of ints), optional. With it,
            start_positions, validate=False, and capture_seq and capture_offset (if any) as host
            lists of ints (capture_slot stays a device tensor), the batch reads nothing back: an
            engine hands over what it holds on the host. Those lists are checked on the host
            whatever validate says, a declined capture's too (its slot is on the device): a
            sequence of the pass and an offset within it. The Triton chunked kernels (both scans)
            then read slots, flags and capture slots on the device; the PyTorch chunked paths
            read them back once a step (host_indices).
        chunk_size: the chunk size of the step's Mamba-2 chunked layers, optional: with
            host_cu_seqlens, their chunk tables go to the device in the batch's one copy (else
            the step's first chunked layer sends them in one of their own).
    """
    check_tensor("cu_seqlens", cu_seqlens, [("nseq + 1", None)], INDEX_DTYPES)
    nseq = cu_seqlens.shape[0] - 1
    if nseq < 0:
        raise ValueError("cu_seqlens must hold at least one entry (0)")
    check_tensor("state_indices", state_indices, [("nseq", nseq)], INDEX_DTYPES)
    device = cu_seqlens.device
    if state_indices.device != device:
        raise ValueError(f"state_indices is on {state_indices.device} but cu_seqlens is on {device}")
    has_initial_state, has_initial_host = _has_initial(has_initial_state, nseq, device)
    given = [t is not None for t in (capture_seq, capture_offset, capture_slot)]
    if any(given) and not all(given):
        raise ValueError("capture_seq, capture_offset and capture_slot go together: give all three or none")
    host_bounds = None if host_cu_seqlens is None else host_ints("host_cu_seqlens", host_cu_seqlens, nseq + 1)
    ncap, host_captures = 0, False
    if all(given):
        host_captures = not isinstance(capture_seq, torch.Tensor) and not isinstance(capture_offset, torch.Tensor)
        if host_captures:
            check_tensor("capture_slot", capture_slot, [("ncapture", None)], INDEX_DTYPES)
            ncap = capture_slot.shape[0]
            capture_seq = host_ints("capture_seq", capture_seq, ncap)
            capture_offset = host_ints("capture_offset", capture_offset, ncap)
            tensors = (("capture_slot", capture_slot),)
        else:
            check_tensor("capture_seq", capture_seq, [("ncapture", None)], INDEX_DTYPES)
            ncap = capture_seq.shape[0]
            for name, t in (("capture_offset", capture_offset), ("capture_slot", capture_slot)):
                check_tensor(name, t, [("ncapture", ncap)], INDEX_DTYPES)
            tensors = (("capture_seq", capture_seq), ("capture_offset", capture_offset),
                       ("capture_slot", capture_slot))
        for name, t in tensors:
            if t.device != device:
                raise ValueError(f"{name} is on {t.device} but cu_seqlens is on {device}")
    skip_slot = check_optional_int("skip_slot", skip_slot)
    nslots = check_optional_int("nslots", nslots, 1)
    validate = check_bool("validate", validate)
    # The kernels index these by row: make them dense (a no-op for the usual contiguous tensors).
    state_indices = state_indices.contiguous()
    cu = (cu_seqlens if cu_seqlens.dtype == torch.int64 else cu_seqlens.long()).contiguous()
    if host_bounds is not None and start_positions is not None and not validate and (host_captures or not ncap):
        return _host_batch(cu, host_bounds, state_indices, has_initial_state, capture_seq, capture_offset,
                           capture_slot, skip_slot, start_positions,
                           None if chunk_size is None else mamba2_chunked.check_chunk_size(chunk_size))
    if host_captures:  # to the device in one copy, for the paths below
        capture_seq, capture_offset = int_tables(device, capture_seq, capture_offset)
    on_host = device.type == "cpu" or validate or start_positions is not None
    if not on_host:
        return _device_batch(cu, state_indices, has_initial_state, capture_seq, capture_offset, capture_slot,
                             skip_slot)
    want_flags = start_positions is not None and has_initial_host is None and has_initial_state is not None
    bounds, slots, flags, cap_seq, cap_offset, cap_slot = _read_back(
        cu_seqlens, state_indices, has_initial_state if want_flags else None,
        *((capture_seq, capture_offset, capture_slot) if ncap else (None,) * 3))
    if validate:
        _validate_prefill(bounds, slots, cap_seq, cap_offset, cap_slot, skip_slot, nslots)
        if host_bounds is not None and host_bounds != bounds:
            raise ValueError(f"host_cu_seqlens {host_bounds} differs from cu_seqlens {bounds}")
    seqs = Sequences(cu, [b - a for a, b in zip(bounds, bounds[1:])], varlen=True)
    # Declined captures dropped, the rest sorted by (sequence, offset), on the host.
    written = sorted((s, k, slot) for s, k, slot in zip(cap_seq, cap_offset, cap_slot) if slot != skip_slot) \
        if ncap else []
    captures = capture_table(written, nseq, device) if written else _no_captures(nseq, device)
    # What the ops check against their tensors (the cache's slots, the token axis): a slot past
    # the cache would be written out of bounds.
    extremes = slot_extremes("state_indices", slots, [slot != skip_slot for slot in slots])
    if ncap:
        extremes += slot_extremes("capture_slot", cap_slot, [slot != skip_slot for slot in cap_slot])
    host = None
    if start_positions is not None:
        positions = check_start_positions(start_positions, seqs)
        if has_initial_host is None:
            has_initial_host = [bool(f) for f in flags] if flags is not None else [True] * nseq
        host = HostStep(positions, slots, has_initial_host,
                        [(s, k, slot) for s, k, slot in written if slots[s] != skip_slot])
    return PrefillBatch(seqs, state_indices, has_initial_state, captures, skip_slot, host, extremes, bounds[-1])


def _device_batch(cu, state_indices, has_initial_state, capture_seq, capture_offset, capture_slot,
                  skip_slot) -> PrefillBatch:
    """prefill_batch with nothing read back: the kernels read lengths from cu_seqlens on the
    device, the host list only carries the count (placeholder lengths: device_only)."""
    nseq = cu.shape[0] - 1
    captures = _device_captures(capture_seq, capture_offset, capture_slot, nseq, skip_slot) \
        if capture_slot is not None and capture_slot.shape[0] else _no_captures(nseq, cu.device)
    return PrefillBatch(Sequences(cu, [0] * nseq, varlen=True), state_indices, has_initial_state, captures, skip_slot)


def host_view(batch: PrefillBatch) -> PrefillBatch:
    """The batch with its lengths and captures on the host, as the PyTorch paths walk them: the
    batch itself, or for a device_only one a copy read back once a step (one transfer)."""
    if not batch.device_only:
        return batch

    def read_back():
        cap = batch.captures
        bounds, ptr, offsets, rows = _read_back(batch.seqs.cu_seqlens, cap.ptr, cap.offset, cap.row)
        nseq = batch.seqs.count
        entries = [(s, offsets[i], rows[i]) for s in range(nseq) for i in range(ptr[s], ptr[s + 1])]
        seqs = Sequences(batch.seqs.cu_seqlens, lengths_from_bounds(bounds), varlen=True)
        return replace(batch, seqs=seqs, captures=CaptureTable(cap.ptr, cap.offset, cap.row, entries),
                       ntokens=bounds[-1])
    return per_step(batch, "host view", read_back)


def _host_batch(cu, bounds, state_indices, has_initial_state, capture_seq, capture_offset, capture_slot,
                skip_slot, start_positions, chunk_size) -> PrefillBatch:
    """prefill_batch from host lengths and captures: nothing read back, at most one host-to-device
    copy (the capture table, its slots gathered into (sequence, offset) order on the device, and
    the chunk tables for chunk_size). The ops check its token count against their inputs; its
    slots, on the device, are the caller's word (validate=False)."""
    device = cu.device
    seqs = Sequences(cu, lengths_from_bounds(bounds), varlen=True)
    positions = check_start_positions(start_positions, seqs)
    ncap = 0 if capture_slot is None else capture_slot.shape[0]
    for i in range(ncap):  # on the host, declined ones too: their slots are on the device
        _check_capture(i, capture_seq[i], capture_offset[i], seqs.lengths)
    order = sorted(range(ncap), key=lambda i: (capture_seq[i], capture_offset[i]))
    entries = [(capture_seq[i], capture_offset[i], None) for i in order]  # rows stay on the device
    capture_tables = capture_lists([(s, k, 0) for s, k, _ in entries], seqs.count)[1:3] + (order,) if ncap else ()
    plan = plan_chunks(seqs, entries, chunk_size, positions) if chunk_size else None
    tensors = int_tables(device, *capture_tables, *(plan.device_lists if plan else ()))
    captures = _no_captures(seqs.count, device)
    if ncap:
        ptr, offsets, order_t = tensors[:3]
        captures = CaptureTable(ptr, offsets, capture_slot.long()[order_t], entries)
    batch = PrefillBatch(seqs, state_indices, has_initial_state, captures, skip_slot,
                         HostStep(positions, None, None, None), ntokens=bounds[-1])
    if plan:
        batch.prepared[CHUNK_TABLES, chunk_size] = plan.on_device(*tensors[len(capture_tables):])
    return batch


def per_step(batch: PrefillBatch, key, build):
    """What `build()` makes, once a step: built by the first layer that asks for it, kept on the
    batch (PrefillBatch.prepared) and reused by the step's other layers (a layer's call is done
    with it when it returns)."""
    prepared = batch.prepared
    if key not in prepared:
        prepared[key] = build()
    return prepared[key]


def step_scratch(batch: PrefillBatch, name: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised tensor of the step, for one layer call at a time (per_step)."""
    return per_step(batch, (name, tuple(shape), dtype, device), lambda: torch.empty(shape, dtype=dtype, device=device))


def step_chunk_tables(batch: PrefillBatch, chunk_size: int):
    """The step's Mamba-2 chunk tables (ChunkTables) for chunk_size: sent in the batch's copy, or
    built by the first layer that asks and kept for the step's others."""
    return per_step(batch, (CHUNK_TABLES, chunk_size), lambda: make_chunk_tables(
        batch.seqs, batch.captures, chunk_size, batch.host.start_positions, batch.seqs.cu_seqlens.device))


def host_indices(batch: PrefillBatch) -> HostStep:
    """The batch's HostStep with its slots, flags and captures on the host: as built, or read back
    once a step (one transfer) for a batch built from host data."""
    host = batch.host
    if host.slots is not None:
        return host

    def read_back():
        cap = batch.captures
        slots, flags, cap_slots = _read_back(batch.state_indices, batch.has_initial, cap.row if cap.count else None)
        has_initial = [bool(f) for f in flags] if flags is not None else [True] * batch.seqs.count
        written = [(s, k, slot) for (s, k, _), slot in zip(cap.entries, cap_slots or [])
                   if slot != batch.skip_slot and slots[s] != batch.skip_slot]
        return HostStep(host.start_positions, slots, has_initial, written)
    return per_step(batch, "host indices", read_back)


def _validate_prefill(bounds, slots, capture_seq, capture_offset, capture_slot, skip_slot, nslots):
    """Checks on the host values of prefill_batch's arguments (capture_seq None: no captures)."""
    lengths = lengths_from_bounds(bounds)
    live = [s for s in slots if s != skip_slot]
    _check_slots("state_indices", slots, skip_slot, nslots)
    if len(set(live)) != len(live):
        raise ValueError("state_indices must be distinct (apart from skip_slot): two rows writing one slot would race")
    if capture_seq is None:
        return
    _check_slots("capture_slot", capture_slot, skip_slot, nslots)
    cap_slots = [s for s in capture_slot if s != skip_slot]
    if len(set(cap_slots)) != len(cap_slots):
        raise ValueError("capture_slot must be distinct: two captures writing one slot would race")
    if set(cap_slots) & set(live):
        raise ValueError(f"capture_slot {sorted(set(cap_slots) & set(live))} is also a row's state slot; "
                         "a capture must not overwrite a state the pass reads")
    for i, (s, k, slot) in enumerate(zip(capture_seq, capture_offset, capture_slot)):
        if slot == skip_slot:
            continue
        _check_capture(i, s, k, lengths)
        if slots[s] == skip_slot:
            raise ValueError(f"capture_seq[{i}] = {s} names a skipped row (slot {skip_slot})")


def _check_capture(i: int, s: int, k: int, lengths: list[int]) -> None:
    """Capture i's sequence and offset: a sequence of the pass, an offset within it."""
    if not 0 <= s < len(lengths):
        raise ValueError(f"capture_seq[{i}] = {s} names no sequence (the pass has {len(lengths)})")
    if not 0 <= k <= lengths[s]:
        raise ValueError(f"capture_offset[{i}] = {k} for sequence {s} is outside 0..{lengths[s]}")


def _check_slots(name, slots, skip_slot, nslots):
    for i, slot in enumerate(slots):
        if slot == skip_slot:
            continue
        if slot < 0 or (nslots is not None and slot >= nslots):
            raise slot_error(name, i, slot, nslots, "a cache")


def decode_batch(state_indices, *, dst_state_indices=None, skip_slot=PAD_SLOT_ID, nslots=None,
                 validate=True) -> DecodeBatch:
    """Describe a decode step (one token per row) once; pass it to every layer's decode calls.

    Args:
        state_indices: (batch,) int32/int64: row b continues from the state in this slot.
        dst_state_indices: (batch,) int32/int64, optional: where row b's new state goes
            (default: back into state_indices[b]).
        skip_slot: rows whose state_indices entry equals this are skipped (a padded decode batch:
            vLLM pads with PAD_SLOT_ID -1, or NULL_BLOCK_ID 0 in its prefix-caching mode);
            None computes every row.
        nslots, validate: as in prefill_batch.
    """
    check_tensor("state_indices", state_indices, [("batch", None)], INDEX_DTYPES)
    batch = state_indices.shape[0]
    device = state_indices.device
    if dst_state_indices is not None:
        check_tensor("dst_state_indices", dst_state_indices, [("batch", batch)], INDEX_DTYPES)
        if dst_state_indices.device != device:
            raise ValueError(f"dst_state_indices is on {dst_state_indices.device} but state_indices is on {device}")
    skip_slot = check_optional_int("skip_slot", skip_slot)
    nslots = check_optional_int("nslots", nslots, 1)
    validate = check_bool("validate", validate)
    extremes = ()
    if validate or device.type == "cpu":  # each index tensor read back once
        slots = state_indices.tolist()
        dst_slots = None if dst_state_indices is None else dst_state_indices.tolist()
        live = [slot != skip_slot for slot in slots]
        extremes = slot_extremes("state_indices", slots, live)
        if dst_slots is not None:
            extremes += slot_extremes("dst_state_indices", dst_slots, live)
        if validate:  # the rows run in parallel, as in selective_state_update
            check_decode_slot_lists(slots, dst_slots, skip_slot, nslots, pool="a cache", pad_name="skip_slot")
    cu = torch.arange(batch + 1, dtype=torch.int64, device=device)
    seqs = Sequences(cu, [1] * batch, varlen=False)
    dst = None if dst_state_indices is None else dst_state_indices.contiguous()
    return DecodeBatch(seqs, state_indices.contiguous(), dst, _no_captures(batch, device), skip_slot, extremes)
