"""Later calls of a layout launch what earlier ones launched, with their own tensors.

Every layer of a serving step makes the same launches: the same kernels and grids over the
step's tables and workspace, at the same sizes; only the layer's own tensors (inputs, weights,
cache, output) differ, and where they are laid out alike (shapes, strides, dtypes, address modulo
16, on which Triton specializes) the launches differ in those pointers only. So an engine op on
Triton records its launches the first time it runs in a step with a layout, and again the next
time, watching that second call: where it ran nothing but launches, views and allocations (a
torch kernel's work, which a replay would skip, makes it void) and its launches agree with the
first call's (each argument the same, or the call's own tensor in the same place, or a tensor
the second call allocated, shaped as the first call's), the step's later calls with that layout
skip the op's host work (views, the problem, flags, strides, Triton's argument binding) and
launch the second call's kernels with their own tensors in place. A tensor the second call
allocated is reused: the call was done with it when it returned.

A recording is void where a tensor it passed a kernel is another view of a call's tensor (not
at its address), or two of the call's tensors share an address. After three recordings without
agreement the op runs as it is for the rest of the step.

The public calls replay too, with fresh scratch (fresh=True): the chunked Mamba-2 scan
(mamba2_chunked.run; its `launches` live with the pass's recent chunk tables), and the others,
prefill passes and decode steps: the recurrent, Mamba-1 chunked and conv kernels' (run_public).
Their scratch (the chunked workspaces, the recurrent kernel's dt table) is allocated anew for each
replay, as the call allocated it (sizes, dtypes, the offsets of its views), so nothing the cache
keeps holds device memory. There the first call of a layout runs without recording (a layout
called once pays nothing), the second is watched (only a watched call tells which tensors it
allocated) and the third, unwatched, is checked against it: where the watched call had scratch,
a tensor laid out as that scratch (dtype, storage size, offset).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.driver import driver

from . import _common, _triton

try:  # Triton 3.3 and later: a compiled kernel's launcher takes every parameter, constexprs too
    from triton import knobs
except ImportError:  # earlier: a replay launches through the kernel, binding its arguments
    knobs = None

RECORDINGS = 3  # per layout and step, at most
_aten = torch.ops.aten
# The allocating ops a watched call may make (whose tensors a replay allocates again).
ALLOCATIONS = {_aten.empty, _aten.empty_strided, _aten.empty_like, _aten.new_empty, _aten.new_empty_strided}


@dataclass(frozen=True)
class _Launch:
    """One recorded launch: every parameter's value in order, and the positions of the call's
    tensors among them ((position, index in the call's tensors)). compiled: the CompiledKernel the
    launch ran (None where none is returned: under the interpreter), launched directly by a replay."""

    kernel: object
    grid: tuple[int, int, int]
    values: tuple
    options: dict
    slots: tuple[tuple[int, int], ...]
    allocated: frozenset[int]  # positions of tensors the call allocated
    compiled: object | None
    made: tuple[tuple[int, int, int], ...] = ()  # fresh scratch: (position, scratch index, element offset)


@dataclass
class _Entry:
    recordings: int = 0
    launches: list[_Launch] | None = None  # the latest recording that counts
    agreed: bool = False  # two recordings in a row agree: later calls replay
    scratch: tuple[tuple[int, torch.dtype], ...] = ()  # fresh scratch: (elements, dtype) a storage


_DEFAULTS: dict = {}


class RecentLayouts(dict):
    """An op's `launches` kept for the `size` layouts called last (the least recent goes first)."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def get(self, key, default=None):
        entry = self.pop(key, None)
        if entry is None:
            return default
        super().__setitem__(key, entry)  # now the most recent
        return entry

    def __setitem__(self, key, entry) -> None:
        super().__setitem__(key, entry)
        if len(self) > self.size:
            del self[next(iter(self))]


RECENT_LAYOUTS = 32
_public = RecentLayouts(RECENT_LAYOUTS)  # the public calls' launches


def run_public(path: tuple, problem, call: Callable[[], None]) -> None:
    """run() for a public call's Triton path on `problem` (a ScanProblem or ConvProblem, whose
    replay_key says what decides its launches; `path` names the path, with any setting of its own):
    from a layout's fourth call (a model's fourth layer) its launches replayed with fresh scratch;
    those of the RECENT_LAYOUTS layouts called last kept (a stream's own), none while a CUDA graph
    is captured."""
    keep, stream = _common.cache_stream(problem.x.device)
    op, tensors = problem.replay_key()
    run(_public if keep else {}, path + op + (stream,), tensors, call, fresh=True)


def _defaults(kernel) -> dict:
    """Every parameter of the kernel by name, with its default (by id: hashing a JITFunction hashes
    its source)."""
    known = _DEFAULTS.get(id(kernel))
    if known is None or known[0] is not kernel:
        parameters = inspect.signature(kernel.fn).parameters
        known = _DEFAULTS[id(kernel)] = (kernel, {name: p.default for name, p in parameters.items()})
    return known[1]


class _Recorder(TorchDispatchMode):
    """Records the launches of a call (through _triton.launch); while entered as a dispatch mode
    (watching), the tensors it allocates and whether it ran anything but launches, views and
    allocations."""

    def __init__(self, tensors, fresh: bool = False):
        super().__init__()
        self.tensors, self.fresh = tensors, fresh
        self.scratch: dict[int, tuple[int, torch.dtype]] = {}  # fresh: storage address -> (index, dtype)
        self.addresses, self.storages = {}, set()
        self.counts = True
        for i, t in enumerate(tensors):
            if t is not None and t.numel():
                self.counts &= self.addresses.setdefault(t.data_ptr(), i) == i  # two of them at one address
                self.storages.add(t.untyped_storage().data_ptr())
        self.launches, self.launching = [], False
        self.allocated: dict[int, int] = {}  # storage address -> bytes, of what the call allocated

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.launching:  # an interpreted launch's own copies are not the call's
            if func.overloadpacket in ALLOCATIONS:
                storage = out.untyped_storage()
                self.allocated[storage.data_ptr()] = storage.nbytes()
            elif not func.is_view:
                self.counts = False
        return out

    def launch(self, kernel, grid, args, kwargs) -> None:
        self.launching = True
        try:
            compiled = kernel[grid](*args, **kwargs)
        finally:
            self.launching = False
        names = kernel.arg_names
        defaults = _defaults(kernel)
        values = [*args, *(kwargs[n] if n in kwargs else defaults[n] for n in names[len(args):])]
        slots, allocated, made = [], [], []
        for position, v in enumerate(values):
            if not isinstance(v, torch.Tensor):
                continue
            i = self.addresses.get(v.data_ptr()) if v.numel() else None
            if i is not None and v.dtype == self.tensors[i].dtype:
                slots.append((position, i))
                values[position] = None  # a replay puts its own tensor there; this one is not kept
                continue
            storage = v.untyped_storage().data_ptr()
            if storage in self.storages:
                self.counts = False  # another view of a call's tensor: not replaced by address
            elif storage in self.allocated:
                allocated.append(position)
                if self.fresh:
                    made.append((position, self._scratch(v), v.storage_offset()))
                    values[position] = None  # a replay allocates its own
        options = {k: v for k, v in kwargs.items() if k not in defaults}
        self.launches.append(_Launch(kernel, (*grid, 1, 1)[:3], tuple(values), options, tuple(slots),
                                     frozenset(allocated), compiled if knobs is not None else None, tuple(made)))

    def _scratch(self, t: torch.Tensor) -> int:
        """The index of t's storage among the call's scratch (by first use)."""
        address = t.untyped_storage().data_ptr()
        index, dtype = self.scratch.setdefault(address, (len(self.scratch), t.dtype))
        self.counts &= dtype == t.dtype  # a storage a replay allocates in one dtype
        return index

    def scratch_sizes(self) -> tuple[tuple[int, torch.dtype], ...]:
        """(elements, dtype) of each scratch storage, in index order."""
        sizes = {}
        for address, (index, dtype) in self.scratch.items():
            sizes[index] = (self.allocated[address] // dtype.itemsize, dtype)
        return tuple(sizes[i] for i in range(len(sizes)))


def _agree(a: list[_Launch], b: list[_Launch], scratch: tuple = ()) -> bool:
    """Whether two recordings are the same launches up to the calls' own tensors (and tensors
    the second call allocated, shaped as the first call's; or, where the first has fresh scratch
    of these sizes, a tensor of the second there laid out as that scratch)."""
    return len(a) == len(b) and all(_same_launch(x, y, scratch) for x, y in zip(a, b))


def _same_launch(x: _Launch, y: _Launch, scratch: tuple) -> bool:
    if (x.kernel is not y.kernel or x.compiled is not y.compiled or x.grid != y.grid or x.options != y.options
            or x.slots != y.slots or len(x.values) != len(y.values)):
        return False
    slotted = {position for position, _ in x.slots}
    made = {position: (scratch[k], offset) for position, k, offset in x.made}
    for position, (u, v) in enumerate(zip(x.values, y.values)):
        if position in slotted:
            continue
        if position in made:  # the first's scratch: the second's own there
            (elements, dtype), offset = made[position]
            if not (isinstance(v, torch.Tensor) and v.dtype == dtype and v.storage_offset() == offset
                    and v.untyped_storage().nbytes() == elements * dtype.itemsize):
                return False
            continue
        if type(u) is not type(v):
            return False
        if not isinstance(u, torch.Tensor):
            if _exact(u) != _exact(v):
                return False
        elif u.dtype != v.dtype:
            return False
        elif u.data_ptr() != v.data_ptr() and not (
                position in y.allocated and u.shape == v.shape and u.stride() == v.stride()):
            return False
    return True


def _exact(value):
    """`value` with each float as its bits (float.hex): 0.0 == -0.0, and a launch with one is not
    a launch with the other (a clamp to -0.0 gives -0.0)."""
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, tuple):
        return tuple(_exact(v) for v in value)
    return value


def _stream():
    """The current device's current stream, as Triton launches on it."""
    return driver.active.get_current_stream(driver.active.get_current_device())


def _replay(entry: _Entry, tensors) -> None:
    stream = None
    scratch = [torch.empty(n, dtype=dtype, device=tensors[0].device) for n, dtype in entry.scratch]
    for launch in entry.launches:
        values = list(launch.values)
        for position, i in launch.slots:
            values[position] = tensors[i]
        for position, k, offset in launch.made:
            values[position] = scratch[k][offset:] if offset else scratch[k]
        compiled = launch.compiled
        if compiled is None:
            launch.kernel[launch.grid](*values, **launch.options)
            continue
        if stream is None:
            stream = _stream()
        compiled.run(*launch.grid, stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(launch.grid, stream, *values), knobs.runtime.launch_enter_hook,
                     knobs.runtime.launch_exit_hook, *values)


def run(launches: dict, op: tuple, tensors: tuple, call: Callable[[], None], fresh: bool = False) -> None:
    """call(): an op's Triton path on `tensors` (its tensor arguments, None where absent; the first
    present), with `op` its name and every other argument; or, where `launches` (an engine step's,
    or a public pass's: module doc) holds two recordings alike for tensors laid out as these, its
    launches with these tensors (and, fresh, new scratch)."""
    key = (_exact(op), tensors[0].device,
           tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() & 15) for t in tensors))
    entry = launches.get(key)
    if entry is None:
        entry = launches[key] = _Entry()
        if fresh:  # a layout called once records nothing
            call()
            return
    if entry.agreed:
        _replay(entry, tensors)
        return
    if entry.recordings == RECORDINGS or _triton.recording.recorder is not None:
        call()
        return
    # Watched (a dispatch mode): the second recording of an engine step's op, the first of a
    # fresh one (whose scratch only a watched recording can tell), which the next one is checked
    # against, unwatched.
    watched = (entry.launches is None) == fresh
    recorder = _Recorder(tensors, fresh and watched)
    _triton.recording.recorder = recorder
    try:
        if watched:
            with recorder:
                call()
        else:
            call()
    finally:
        _triton.recording.recorder = None
    entry.recordings += 1
    if not fresh and recorder.counts:
        entry.agreed = entry.launches is not None and _agree(entry.launches, recorder.launches)
        entry.launches = recorder.launches
    elif fresh and watched:
        entry.launches, entry.scratch = (recorder.launches, recorder.scratch_sizes()) if recorder.counts else (None, ())
    elif fresh:  # kept: the watched recording, which holds no scratch
        entry.agreed = recorder.counts and _agree(entry.launches, recorder.launches, entry.scratch)
        if not entry.agreed:
            entry.launches = None
