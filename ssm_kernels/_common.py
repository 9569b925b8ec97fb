"""Pieces every op shares: argument checks, sequence spans, capture tables, backend choice.

Every public function validates all of its input with these before it allocates or writes
anything, so rejected input leaves outputs, states and caches untouched.
"""
from __future__ import annotations

import functools
import itertools
import math
import numbers
import operator
import os
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from . import _triton

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
BACKENDS = ("auto", "triton", "torch")
FLOAT32_MAX = torch.finfo(torch.float32).max

# Tests set this so that new outputs start as NaN and an element a kernel never writes fails.
POISON_OUTPUTS = False


def device_memory(device: torch.device) -> int | None:
    """The bytes of memory of `device` (a GPU's, or the host's physical memory for the CPU), or
    None where that is unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):
            return None
    return None


def check_fits(name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a tensor larger than its device's whole memory before allocating it: the
    allocator's own error for such a size (from shapes that ask for 2^40 tokens, say) names no
    argument."""
    nbytes = math.prod(shape) * dtype.itemsize
    memory = device_memory(device)
    if memory is not None and nbytes > memory:
        raise ValueError(f"{name} of shape {tuple(shape)} ({str(dtype).replace('torch.', '')}) would need "
                         f"{nbytes} bytes ({nbytes / 2**30:.1f} GiB), more than the {memory / 2**30:.1f} GiB of "
                         f"memory of {device}: pass fewer tokens, sequences or captures")


def new_output(*shape: int, dtype: torch.dtype, device: torch.device, name: str = "an output") -> torch.Tensor:
    """An uninitialised output tensor (NaN-filled while POISON_OUTPUTS is set), called `name` in
    the error for a size beyond the device's memory."""
    check_fits(name, shape, dtype, device)
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def int_tables(device: torch.device, *tables: list) -> list[torch.Tensor]:
    """Host lists of ints (or of tuples of ints, flattened) as 1-D int64 tensors on `device`, in
    one transfer. To a GPU the copy goes from pinned memory without blocking: a pageable copy
    would wait for the GPU to finish its queue, so every call would serialise the host with it.
    Each table starts 16-byte aligned, as a tensor of its own would (a kernel is specialised on
    its pointers' alignment)."""
    flat, spans = [], []
    for values in tables:
        flat.extend([0] * (len(flat) % 2))
        start = len(flat)
        for v in values:
            if isinstance(v, tuple):
                flat.extend(v)
            else:
                flat.append(v)
        spans.append((start, len(flat)))
    host = torch.tensor(flat, dtype=torch.int64, device="cpu")  # whatever torch's default device
    if device.type == "cuda":
        host = host.pin_memory().to(device, non_blocking=True)
    elif host.device != device:
        host = host.to(device)
    return [host[lo:hi] for lo, hi in spans]


class ScanResult(NamedTuple):
    """What a scan returns.

    y: the output, in the input's dtype and layout.
    final_states: the state after the last token of each sequence, float32.
    captured_states: one state per requested capture, in the order given, float32.
    """

    y: torch.Tensor
    final_states: torch.Tensor
    captured_states: torch.Tensor


# ---------------------------------------------------------------------------------------------
# Tensor checks
# ---------------------------------------------------------------------------------------------
def check_has_data(name: str, t: torch.Tensor) -> torch.Tensor:
    """Refuse a tensor on the meta device: it has a shape but no values to compute with."""
    if t.device.type == "meta":
        raise ValueError(f"{name} is on the meta device, which holds shapes but no data; move it to a real device "
                         "(e.g. .to('cpu') or .to('cuda')) before running a kernel on it")
    return t


def check_tensor_args(required: dict, optional: dict | None = None) -> None:
    """Every tensor argument of a public op, checked to be a tensor before anything reads its
    attributes: {name: value}, where an optional one may also be None; with grad mode on, none may
    require grad."""
    for name, t in required.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (optional or {}).items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if torch.is_grad_enabled():  # no op records a graph: its outputs would drop the gradient silently
        for name, t in {**required, **(optional or {})}.items():
            if t is not None and t.requires_grad:
                raise ValueError(f"{name} requires grad, but the kernels are forward only (no backward): call under "
                                 f"torch.no_grad() or torch.inference_mode(), or pass {name}.detach()")


def check_tensor(name: str, t, dims: Sequence[tuple[str, int | None]], dtypes=None) -> torch.Tensor:
    """Check that `t` is a tensor with data, of the named shape (None matches any size) and dtype.
    (Every public call runs it on each of its tensors: the messages are built only on failure.)"""
    if not isinstance(t, torch.Tensor):
        check_tensor_args({name: t})
    check_has_data(name, t)
    shape = t.shape
    if len(shape) != len(dims):
        names = ", ".join(n for n, _ in dims)
        raise ValueError(f"{name} must have {len(dims)} dimensions ({names}), got shape {tuple(shape)}")
    for axis, (dim_name, size) in enumerate(dims):
        if size is not None and shape[axis] != size:
            names = ", ".join(n for n, _ in dims)
            want = tuple("*" if s is None else s for _, s in dims)
            raise ValueError(
                f"{name} must have shape ({names}) = {want}, got {tuple(shape)} "
                f"({dim_name} is {shape[axis]}, expected {size})"
            )
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}; got {str(t.dtype).replace('torch.', '')}")
    return t


def check_same_device(**tensors) -> torch.device:
    """All given tensors must live on one device (non-tensors are checked elsewhere); return it."""
    present = {k: v for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    first_name, first = next(iter(present.items()))
    for name, t in present.items():
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; "
                             "all tensors must be on one device")
    return first.device


def check_bool(name: str, value) -> bool:
    """A flag must be True or False: a string such as "False" or a tensor would otherwise be taken
    for its truth value."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {value!r} ({type(value).__name__})")
    return value


def check_int(name: str, value, minimum: int | None = None) -> int:
    """`value` as an int (anything with __index__, not a bool: True is not a count or a
    position), else TypeError naming `name`; below `minimum` (where given), ValueError."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_choice(name: str, value, choices: tuple):
    """`value` if it is one of `choices`, else ValueError naming `name` and the choices."""
    if not any(value == c for c in choices if type(value) is type(c)):  # unhashable values and 1 == True alike
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_optional_int(name: str, value, minimum: int | None = None) -> int | None:
    """As check_int, None passing through (a slot id that may be absent, say)."""
    return None if value is None else check_int(name, value, minimum)


def check_dt_limit(dt_limit) -> tuple[float, float]:
    """(min, max) as floats: two real numbers (int or float, not bool, str or NaN) with min <= max."""
    try:
        pair = tuple(dt_limit)
    except TypeError:
        pair = None
    if pair is None or len(pair) != 2 or not all(
            isinstance(v, numbers.Real) and not isinstance(v, bool) and not math.isnan(v) for v in pair):
        raise TypeError(f"dt_limit must be a pair of real numbers (min, max), got {dt_limit!r}")
    # dt' is float32: a bound beyond float32's range clamps as an infinite one does (the kernels
    # take the bounds as float32 numbers, where such a bound is infinite).
    lo, hi = (math.copysign(math.inf, v) if abs(v) > FLOAT32_MAX else v for v in map(float, pair))
    if not lo <= hi:
        raise ValueError(f"dt_limit must satisfy min <= max, got {dt_limit!r}")
    return lo, hi


def _may_overlap(t: torch.Tensor) -> bool:
    """Whether two indices of t may address one element: with its dims of size > 1 sorted by
    stride, each stride must pass the farthest offset the smaller ones reach (a stride-0 expanded
    dim never does). Conservative: an interleaved but disjoint layout counts as overlapping."""
    if t.numel() == 0:
        return False
    reach = 0
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def check_inplace_target(name: str, t: torch.Tensor) -> torch.Tensor:
    """A tensor a kernel updates in place (a state pool): it must not require grad (the kernels
    have no backward, and an in-place write would bypass autograd), and no element may be
    reachable through two indices (an expanded or otherwise overlapping view: a write to one
    slot would change others). Any other strides are fine: the kernels take strides."""
    if t.requires_grad:
        raise ValueError(f"{name} requires grad, but the kernels update it in place and have no backward: "
                         f"pass a tensor that does not require grad (e.g. {name}.detach())")
    if _may_overlap(t):
        raise ValueError(f"{name} has overlapping memory (shape {tuple(t.shape)}, strides {t.stride()}, e.g. an "
                         f"expanded view): an in-place update would write one element through several indices; "
                         f"pass a tensor with its own memory per element (e.g. {name}.contiguous())")
    return t


def _byte_layout(t: torch.Tensor) -> tuple[int, list[tuple[int, int]], int]:
    """t's bytes: (address of its first element, [(stride, size)] in bytes of its dims that
    reach new bytes (size > 1, stride > 0) by decreasing stride, element size)."""
    size = t.element_size()
    dims = sorted(((st * size, n) for n, st in zip(t.shape, t.stride()) if n > 1 and st > 0), reverse=True)
    return t.data_ptr(), dims, size


def _last_byte(dims, size: int) -> int:
    return sum((n - 1) * st for st, n in dims) + size - 1


def _may_share_bytes(a_start, a_dims, a_size, b_start, b_dims, b_size) -> bool:
    """Whether two strided byte sets may share a byte. Exact where both step their outermost
    dim by the same stride with each step's bytes inside it (views of one buffer cut alike: row
    ranges, column slices, heads), recursively; elsewhere by their spans (conservative: an
    interleaved but disjoint pair counts as sharing)."""
    a_last, b_last = _last_byte(a_dims, a_size), _last_byte(b_dims, b_size)
    if a_start + a_last < b_start or b_start + b_last < a_start:
        return False
    if not a_dims or not b_dims or a_dims[0][0] != b_dims[0][0]:
        return True
    (stride, na), (_, nb) = a_dims[0], b_dims[0]
    a_inner, b_inner = a_dims[1:], b_dims[1:]
    a_reach, b_reach = _last_byte(a_inner, a_size), _last_byte(b_inner, b_size)
    if a_reach >= stride or b_reach >= stride:
        return True
    # Step i of a and step j of b start at a_start + i * stride and b_start + j * stride and stay
    # within `stride` bytes, so they can meet only for the one or two values of k = i - j below.
    d = b_start - a_start
    for k in range(-((a_reach - d) // stride), (d + b_reach) // stride + 1):
        if max(0, k) < min(na, nb + k) and _may_share_bytes(0, a_inner, a_size, d - k * stride, b_inner, b_size):
            return True
    return False


def check_written(written: dict, read: dict) -> None:
    """The tensors a call writes ({name: tensor}: outputs, caches updated in place) against
    every tensor it reads or writes ({name: tensor or None}): each written one a valid in-place
    target (check_inplace_target), and none sharing memory with another (the kernels would
    overwrite an input they still read, or one output with another: y with the final state)."""
    for name, t in written.items():
        check_inplace_target(name, t)
    present = [(n, t) for n, t in {**written, **read}.items() if isinstance(t, torch.Tensor) and t.numel()]
    # Tensors whose storages' bytes are apart cannot share memory (the usual case, checked cheaply
    # on every layer call); the strided check runs only for views of one buffer.
    spans = {n: (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for n, t in present}
    for i, (name, t) in enumerate(present):
        if name not in written:
            break  # two inputs may share memory: nothing writes them
        (start, nbytes) = spans[name]
        for other, u in present[i + 1:]:
            other_start, other_nbytes = spans[other]
            if t.device != u.device or start + nbytes <= other_start or other_start + other_nbytes <= start:
                continue
            if _may_share_bytes(*_byte_layout(t), *_byte_layout(u)):
                raise ValueError(f"{name} must not overlap {other} in memory (shape {tuple(t.shape)}, strides "
                                 f"{t.stride()} and {tuple(u.shape)}, {u.stride()}, from one buffer): the kernels "
                                 f"write {name}, which would change {other} while it is in use; pass tensors that "
                                 "do not share memory")


# ---------------------------------------------------------------------------------------------
# Sequences: a dense batch or a varlen batch packed along the time axis
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sequences:
    """The sequences of one pass.

    cu_seqlens: (nseq + 1,) int64 on the tensors' device in varlen mode: sequence s covers token
        offsets [cu_seqlens[s], cu_seqlens[s + 1]) of the time axis. None in dense mode, where
        sequence s is batch row s (no device tensor, so a dense call costs no transfer).
    lengths: the lengths on the host.
    varlen: whether sequences are packed along the time axis of batch row 0.
    """

    cu_seqlens: torch.Tensor | None
    lengths: list[int]
    varlen: bool

    @property
    def count(self) -> int:
        return len(self.lengths)

    def host_bounds(self) -> list[int] | None:
        """cu_seqlens's values on the host (varlen), or None (dense): what a call on the same
        sequences takes to read nothing back (make_sequences)."""
        return list(itertools.accumulate(self.lengths, initial=0)) if self.varlen else None

    def spans(self):
        """(batch row, first token, length) of each sequence."""
        start = 0
        for s, length in enumerate(self.lengths):
            yield (0, start, length) if self.varlen else (s, 0, length)
            start += length


def lengths_from_bounds(bounds: list[int]) -> list[int]:
    """Sequence lengths from cu_seqlens' values (host ints), which must start at 0 and not decrease."""
    if len(bounds) < 1:
        raise ValueError("cu_seqlens must hold at least one entry (0)")
    if bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {bounds[0]}")
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    for s, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"cu_seqlens must be non-decreasing, but cu_seqlens[{s + 1}] = {bounds[s + 1]} "
                             f"< cu_seqlens[{s}] = {bounds[s]}")
    return lengths


def host_ints(name: str, values, count: int | None = None) -> list[int]:
    """A host list (or tuple) of ints (`count` of them, where given), checked: no tensor, no bool."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{name} must be a list of ints, got {type(values).__name__}")
    if count is not None and len(values) != count:
        raise ValueError(f"{name} must hold {count} ints, got {len(values)}")
    return [check_int(f"{name}[{i}]", v) for i, v in enumerate(values)]


def make_sequences(batch: int, seqlen: int, cu_seqlens, device: torch.device) -> Sequences:
    """The checked sequences of a pass: batch rows of seqlen tokens (cu_seqlens None), or
    packed along the time axis of batch row 0. cu_seqlens is an int32/int64 tensor on `device`,
    whose values are read back (on a GPU the host waits for the device's queue: a sync), or host
    ints (a list or tuple), which read nothing back: their device copy is the one made for the
    same bounds by one of the last RECENT_TABLES calls, or goes without blocking."""
    if cu_seqlens is None:
        return Sequences(None, [seqlen] * batch, varlen=False)
    on_host = isinstance(cu_seqlens, (list, tuple))
    if not on_host:
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens must be an int tensor or a list of ints, got {type(cu_seqlens).__name__}")
        check_tensor("cu_seqlens", cu_seqlens, [("nseq + 1", None)], INDEX_DTYPES)
        if cu_seqlens.device != device:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but the inputs are on {device}; "
                             "pass it on their device, or as a list of ints")
    if batch != 1:
        raise ValueError(f"a varlen batch (cu_seqlens given) must have batch size 1, got {batch}")
    bounds = host_ints("cu_seqlens", cu_seqlens) if on_host else cu_seqlens.tolist()
    lengths = lengths_from_bounds(bounds)
    if bounds[-1] != seqlen:
        raise ValueError(f"cu_seqlens must end at seqlen = {seqlen}, got {bounds[-1]}")
    return Sequences(recent_ints(tuple(bounds), device) if on_host else cu_seqlens.to(torch.int64), lengths,
                     varlen=True)


# ---------------------------------------------------------------------------------------------
# Captures: (sequence index, offset) pairs -> per-sequence sorted tables
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CaptureTable:
    """Captures grouped by sequence, sorted by offset.

    Sequence s owns entries [ptr[s], ptr[s + 1]); entry i asks for the state after offset[i]
    tokens, written to row[i] of the capture buffer (its index in the caller's order).
    All three are int64 tensors on the tensors' device, or None when there is no capture (no
    transfer for a call without captures); `entries` holds the same on the host. An engine's
    batch (cache_ops.prefill_batch) also holds: ptr alone where nothing is captured; entries
    (sequence, offset, None) with the rows (cache slots) on the device only, for a batch built
    from host data (host_rows reads them back); entries [None] * n, declined captures counted,
    for a batch sorted on the device (PrefillBatch.device_only; host_view reads its tables back).
    """

    ptr: torch.Tensor | None
    offset: torch.Tensor | None
    row: torch.Tensor | None
    entries: list[tuple[int, int, int]]  # (sequence, offset, row), sorted

    @property
    def count(self) -> int:
        return len(self.entries)

    def host_rows(self) -> list[int]:
        """Each entry's row on the host: from `entries`, or read back from `row` (one transfer)
        where a batch built from an engine's host data left the rows on the device only."""
        if self.entries and self.entries[0][2] is None:
            return self.row.tolist()
        return [r for _, _, r in self.entries]


@dataclass(kw_only=True)
class CacheSlots:
    """The options of a scan or conv problem for an engine's cache (all off by default).

    state_index: (nseq,) int32/int64 or None: sequence s reads state_in[state_index[s]] and writes
        state_out[state_index[s]] (a pool of slots, possibly the same tensor: the kernels read a
        slot before they overwrite it); None means slot s.
    has_initial: (nseq,) bool or None: where False, sequence s starts from zeros instead of
        reading state_in.
    skip_slot: int or None: a sequence whose state_index is skip_slot (an engine's padding row)
        reads and writes nothing, its outputs and captures included; so does a capture whose row
        is skip_slot (an engine declining it).
    State tensors may then have another float dtype than the inputs: stored rounded to it.
    """

    state_index: torch.Tensor | None = None
    has_initial: torch.Tensor | None = None
    skip_slot: int | None = None

    @property
    def slot_flags(self) -> dict[str, bool]:
        """The kernels' constexpr flags for these options."""
        return dict(HAS_SLOT_IN=self.state_index is not None, HAS_INITIAL_FLAGS=self.has_initial is not None,
                    HAS_SKIP=self.skip_slot is not None)


def _capture_pairs(capture) -> list[tuple[int, int]]:
    if capture is None:
        return []
    if isinstance(capture, torch.Tensor):
        if capture.dtype.is_floating_point or capture.dtype.is_complex or capture.dtype == torch.bool:
            raise TypeError(f"capture must be an integer tensor, got dtype {capture.dtype}")
        if capture.ndim != 2 or capture.shape[1] != 2:
            raise ValueError(f"capture must have shape (ncapture, 2) (ncapture may be 0), got {tuple(capture.shape)}")
        check_has_data("capture", capture)
        return [(int(s), int(k)) for s, k in capture.tolist()]
    pairs = []
    try:
        items = list(capture)
    except TypeError:
        raise TypeError(f"capture must be an int tensor (ncapture, 2) or a sequence of "
                        f"(sequence index, offset) pairs, got {type(capture).__name__}") from None
    for i, item in enumerate(items):
        try:
            s, k = item
            if isinstance(s, bool) or isinstance(k, bool):
                raise TypeError
            pairs.append((operator.index(s), operator.index(k)))
        except (TypeError, ValueError):
            raise TypeError(f"capture[{i}] must be a pair of ints (sequence index, offset), got {item!r}") from None
    return pairs


NO_CAPTURES = CaptureTable(None, None, None, [])


def cache_stream(device: torch.device) -> tuple[bool, int | None]:
    """(whether device tables made now may be kept for later calls, the stream their copy runs on:
    None off CUDA). Not while a CUDA graph is being captured: the graph would go on reading memory
    that a cache may free."""
    if device.type != "cuda":
        return True, None
    if torch.cuda.is_current_stream_capturing():
        return False, None
    return True, torch.cuda.current_stream(device).cuda_stream


RECENT_TABLES = 16


def recent_ints(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Host ints as an int64 tensor on `device` that nothing writes: the one made for the same
    values by one of the last RECENT_TABLES calls (a model's layers pass the same cu_seqlens), or
    a new copy (int_tables: it does not block)."""
    keep, stream = cache_stream(device)
    if not keep:
        return int_tables(device, values)[0]
    return _recent_ints(values, device, stream)


@functools.lru_cache(maxsize=RECENT_TABLES)
def _recent_ints(values: tuple[int, ...], device: torch.device, stream: int | None) -> torch.Tensor:
    return int_tables(device, values)[0]


def make_capture_table(capture, seqs: Sequences, device: torch.device) -> CaptureTable:
    """The checked captures of a pass as a table; the same table (nothing writes it) for the same
    captures, in the same order, of a pass of as many sequences as one of the last
    RECENT_TABLES (a model's layers capture alike: one copy, and their launches agree for
    a replay, _replay.py)."""
    pairs = _capture_pairs(capture)
    for i, (s, k) in enumerate(pairs):
        if not 0 <= s < seqs.count:
            raise ValueError(f"capture[{i}] names sequence {s}, but the batch has {seqs.count} sequences")
        if k < 0:
            raise ValueError(f"capture offset {k} for sequence {s} is negative")
        if k > seqs.lengths[s]:
            raise ValueError(f"capture offset {k} for sequence {s} is past its length {seqs.lengths[s]}")
    keep, stream = cache_stream(device)
    if not keep:
        return _capture_table_of(tuple(pairs), seqs.count, device)
    return _recent_capture_table(tuple(pairs), seqs.count, device, stream)


def _capture_table_of(pairs: tuple, nseq: int, device: torch.device) -> CaptureTable:
    return capture_table([(s, k, row) for row, (s, k) in enumerate(pairs)], nseq, device)


@functools.lru_cache(maxsize=RECENT_TABLES)
def _recent_capture_table(pairs: tuple, nseq: int, device: torch.device, stream: int | None) -> CaptureTable:
    return _capture_table_of(pairs, nseq, device)


def capture_lists(entries, nseq: int) -> tuple[list, list[int], list[int], list[int]]:
    """The host side of a capture table: (sorted entries, ptr, offset, row), for int_tables."""
    entries = sorted(entries)
    counts = [0] * (nseq + 1)
    for s, _, _ in entries:
        counts[s + 1] += 1
    for s in range(nseq):
        counts[s + 1] += counts[s]
    return entries, counts, [k for _, k, _ in entries], [r for _, _, r in entries]


def capture_table(entries, nseq: int, device: torch.device) -> CaptureTable:
    """The table of checked (sequence, offset, row) captures of a pass of nseq sequences."""
    if not entries:
        return NO_CAPTURES
    entries, *lists = capture_lists(entries, nseq)
    return CaptureTable(*int_tables(device, *lists), entries)


def _first_out_of_range(slots: list[int], rows, nslots: int | None) -> int | None:
    """The first of `rows` whose slot (slots[row]) is below 0 or not below nslots (None: no upper
    bound), or None. A valid batch costs a min and a max (a decode step checks its slots on every
    call); the rows are walked only to name a wrong one."""
    used = slots if len(rows) == len(slots) else [slots[r] for r in rows]
    if not used or (min(used) >= 0 and (nslots is None or max(used) < nslots)):
        return None
    return next(r for r in rows if slots[r] < 0 or (nslots is not None and slots[r] >= nslots))


def slot_error(name: str, i: int, slot: int, nslots: int | None, pool: str = "a state") -> ValueError:
    """The error for entry i of the slot list `name` outside a pool of nslots (None: not known,
    so the entry is below 0)."""
    if nslots is None:
        return ValueError(f"{name}[{i}] = {slot} must be >= 0")
    return ValueError(f"{name}[{i}] = {slot} is out of range for {pool} with {nslots} slots")


def check_decode_slots(state_indices, dst_state_indices, pad_slot_id, batch: int, nslots: int | None,
                       state_name: str = "state", name: str = "state_indices") -> None:
    """The slots a decode batch reads (state_indices, default 0..batch-1) and writes
    (dst_state_indices, default the same) in a pool of nslots (None: not known, only >= 0 is
    checked): in range, or pad_slot_id in state_indices for a padded row; no two live rows writing
    one slot, and no row writing a slot that another live row reads (the rows run in parallel).
    `state_name` and `name` are the pool's and state_indices' names in errors.
    (A decode step runs it on every call: a valid batch's checks are set and min/max operations.)"""
    pad_slot_id = check_optional_int("pad_slot_id", pad_slot_id)
    if state_indices is None:
        if nslots is not None and batch > nslots:
            raise ValueError(f"without {name} the batch ({batch}) must not exceed {state_name}'s slots ({nslots})")
        sources = list(range(batch))
    else:
        check_tensor(name, state_indices, [("batch", batch)], INDEX_DTYPES)
        sources = state_indices.tolist()
    targets = None
    if dst_state_indices is not None:
        check_tensor("dst_state_indices", dst_state_indices, [("batch", batch)], INDEX_DTYPES)
        if state_indices is not None and dst_state_indices.device != state_indices.device:
            raise ValueError(f"dst_state_indices is on {dst_state_indices.device} but {name} is on "
                             f"{state_indices.device}")
        targets = dst_state_indices.tolist()
    check_decode_slot_lists(sources, targets, pad_slot_id, nslots, pool=f"a {state_name}", name=name)


def check_decode_slot_lists(sources: list[int], targets: list[int] | None, pad_slot_id: int | None,
                            nslots: int | None, pool: str = "a state", name: str = "state_indices",
                            pad_name: str = "pad_slot_id") -> None:
    """check_decode_slots on slots already read back to the host: sources (each row's `name`
    entry), targets (its dst_state_indices entry; None: the slot it reads); pad_slot_id is called
    `pad_name` in errors."""
    batch = len(sources)
    live = range(batch) if pad_slot_id is None else [b for b, slot in enumerate(sources) if slot != pad_slot_id]
    b = _first_out_of_range(sources, live, nslots)
    if b is not None:
        error = slot_error(name, b, sources[b], nslots, pool)
        raise error if pad_slot_id is None else ValueError(f"{error} (and is not {pad_name} {pad_slot_id})")
    if targets is None:
        targets, written_name = sources, name
    else:
        written_name = "dst_state_indices"
        b = _first_out_of_range(targets, live, nslots)
        if b is not None:
            raise slot_error("dst_state_indices", b, targets[b], nslots, pool)
    written, live_sources = ((targets, sources) if len(live) == batch else
                             ([targets[b] for b in live], [sources[b] for b in live]))
    if len(set(written)) != len(written):
        raise ValueError(f"{written_name} must be distinct over the rows that are not padding: two rows updating one "
                         "slot would race")
    # A row may write the slot it reads. Where each does (dst_state_indices None, or equal to
    # state_indices on the live rows), the written slots being distinct leaves no race.
    if written == live_sources:
        return
    shared = set(written) & set(live_sources)
    readers: dict[int, list[int]] = {}
    for a in live:
        if sources[a] in shared:
            readers.setdefault(sources[a], []).append(a)
    for b in live:
        other = [a for a in readers.get(targets[b], ()) if a != b]
        if other:
            raise ValueError(f"dst_state_indices[{b}] = {targets[b]} is the slot row {other[0]} reads: the rows run in "
                             "parallel, so the write would race with the read")


# ---------------------------------------------------------------------------------------------
# Backend choice
# ---------------------------------------------------------------------------------------------
def resolve_backend(backend: str, device: torch.device, triton_runs_on_cpu: bool | None = None) -> str:
    """Validate `backend` for tensors on `device`; 'auto' is Triton on CUDA, PyTorch elsewhere.

    triton_runs_on_cpu defaults to whether the kernels were defined under TRITON_INTERPRET=1."""
    if triton_runs_on_cpu is None:
        triton_runs_on_cpu = _triton.RUNS_ON_CPU
    check_choice("backend", backend, BACKENDS)
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and not (device.type == "cpu" and triton_runs_on_cpu):
        raise ValueError(f"backend='triton' needs CUDA tensors (got {device.type} tensors); CPU tensors "
                         "run through Triton only with TRITON_INTERPRET=1 set before triton is imported")
    return backend
