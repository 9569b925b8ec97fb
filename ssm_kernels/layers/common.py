"""What the Mamba mixer layers share: layer states, snapshots, the forward plumbing.

With ``exact=True`` the projections and norms around the scan and conv kernels run as
batch-invariant row ops (see :mod:`.rows`): a token's output then never depends on the pass it is
in, and a restored snapshot continues bit for bit. With ``exact=False`` (the default) they run
as plain batched ops: faster, and equal to the exact path to rounding only.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .._common import (BACKENDS, FLOAT_DTYPES, check_bool, check_choice, check_fits, check_int, check_tensor,
                       check_tensor_args, check_written, make_capture_table, make_sequences)
from ..scan import MAX_DSTATE
from .rows import exact_linear, exact_rowwise

HIDDEN_ACTS = ("silu", "swish")  # the conv kernel's activation, by either name


def check_mixer_args(sizes: dict, flags: dict, positive: dict, *, hidden_act, backend, dtype,
                     groups: tuple[str, str] | None = None) -> dict[str, int]:
    """A mixer's constructor arguments, checked before any parameter is built (torch's own
    errors for them name no argument, and some bad values would build a layer that fails later).

    sizes: {name: int >= 1} (state_size also within the kernels' MAX_DSTATE); flags: {name: bool};
    positive: {name: finite real > 0} (time_step_min <= time_step_max where both are given);
    hidden_act: the conv kernel's activation; backend: a kernel backend; dtype: a float dtype of
    the kernels, or None; groups: (rows, groups) names of two sizes where rows must split evenly
    into groups. Returns the sizes as ints.
    """
    ints = {name: check_int(name, value, 1) for name, value in sizes.items()}
    if ints.get("state_size", 0) > MAX_DSTATE:
        raise ValueError(f"state_size {ints['state_size']} is beyond the kernels' limit of {MAX_DSTATE}")
    if groups is not None and ints[groups[0]] % ints[groups[1]]:
        raise ValueError(f"{groups[0]} ({ints[groups[0]]}) must be a multiple of {groups[1]} ({ints[groups[1]]})")
    for name, value in flags.items():
        check_bool(name, value)
    for name, value in positive.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise TypeError(f"{name} must be a finite real number, got {value!r}")
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    if positive.get("time_step_min", 0) > positive.get("time_step_max", math.inf):
        raise ValueError(f"time_step_min ({positive['time_step_min']}) must not exceed time_step_max "
                         f"({positive['time_step_max']})")
    check_choice("hidden_act", hidden_act, HIDDEN_ACTS)  # the conv kernel's activation
    check_choice("backend", backend, BACKENDS)
    if dtype is not None and dtype not in FLOAT_DTYPES:
        allowed = ", ".join(str(d).replace("torch.", "") for d in FLOAT_DTYPES)
        raise TypeError(f"dtype must be {allowed} or None (the kernels' dtypes), got {dtype!r}")
    return ints


def dt_bias_init(n: int, dt_min: float = 1e-3, dt_max: float = 0.1, dt_floor: float = 0.0,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Mamba's dt bias initialisation (float32, on the CPU): softplus^-1 of a dt log-uniform in
    [dt_min, dt_max], at least dt_floor."""
    dt = torch.exp(torch.rand(n, generator=generator) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = dt.clamp(min=dt_floor)
    return dt + torch.log(-torch.expm1(-dt))


def _short(value) -> str:
    """A tensor as its shape and dtype (a repr, not the data); anything else as its repr."""
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    return repr(value)


class ShortRepr:
    """A dataclass repr that shows tensors by shape and dtype: a snapshot holds megabytes."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{f.name}={_short(getattr(self, f.name))}' for f in fields(self))})"


@dataclass(frozen=True, eq=False, repr=False)
class Snapshot(ShortRepr):
    """A mixer layer's state at an absolute position: what a prefix cache stores and restores.

    position: the state is the one after tokens [0, position) of the sequence.
    conv: (conv_dim, conv_kernel - 1), the layer's activation dtype: the conv inputs before it.
    ssm: the SSM state, float32: (nheads, headdim, dstate) for Mamba-2, (intermediate, dstate)
        for Mamba-1.
    """

    position: int
    conv: torch.Tensor
    ssm: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.ssm.numel() * self.ssm.element_size()


def _owned(row: torch.Tensor) -> torch.Tensor:
    """``row``, copied where it is a view into a larger buffer (a pass's captures): a snapshot
    that a cache holds must not keep the pass's other captures alive, nor weigh more than it says."""
    return row if row.untyped_storage().nbytes() == row.numel() * row.element_size() else row.clone()


@dataclass(repr=False)
class LayerState(ShortRepr):
    """The running state of a mixer layer for nseq sequences.

    conv: (nseq, conv_dim, conv_kernel - 1), the activation dtype; ssm: (nseq, *ssm shape)
    float32; positions: the absolute position each sequence is at (tokens consumed so far).
    """

    conv: torch.Tensor
    ssm: torch.Tensor
    positions: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.positions)

    @property
    def position(self) -> int:
        """The position of a single-sequence state."""
        if self.count != 1:
            raise ValueError(f"position is defined for a single-sequence state; this one holds "
                             f"{self.count} sequences (see positions)")
        return self.positions[0]

    def snapshot(self, index: int = 0) -> Snapshot:
        """Sequence ``index``'s state as a Snapshot (copies)."""
        index = check_int("index", index)  # True would take sequence 1
        return Snapshot(self.positions[index], self.conv[index].clone(), self.ssm[index].clone())

    def clone(self) -> "LayerState":
        return LayerState(self.conv.clone(), self.ssm.clone(), self.positions)


class MixerOutput(NamedTuple):
    """What a mixer's forward returns: out (batch, seqlen, hidden_size); state, the layer state
    after the pass; snapshots, one Snapshot per requested capture, in the order given."""

    out: torch.Tensor
    state: LayerState
    snapshots: list[Snapshot]


class SSMMixer(nn.Module):
    """Forward plumbing shared by the Mamba mixers: validation, states, captures, snapshots.

    Subclasses set ``conv_dim``, ``conv_kernel``, ``hidden_size``, ``exact``, ``backend`` and
    implement ``ssm_state_shape`` and ``_mix``/``_step``.
    """

    conv_dim: int
    conv_kernel: int
    hidden_size: int
    exact: bool
    backend: str

    @property
    def ssm_state_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    def _describe(self) -> str:
        return (f"{type(self).__name__} (conv state {self.conv_state_shape}, "
                f"SSM state {self.ssm_state_shape})")

    def _linear(self, linear, x, bias=True):
        """A projection (an nn.Linear, its bias left out where not `bias`) over x (..., in):
        batch-invariant tiles when exact, else one batched call."""
        if self.exact:
            return exact_linear(linear, x, bias)
        return linear(x) if bias else F.linear(x, linear.weight)

    def _rowwise(self, fn, *xs):
        """A per-row function (a norm, a gate): batch-invariant tiles when exact, else one call."""
        return exact_rowwise(fn, *xs) if self.exact else fn(*xs)

    # -- states ---------------------------------------------------------------------------
    def initial_state(self, nseq: int = 1, *, dtype: torch.dtype | None = None,
                      device: torch.device | None = None) -> LayerState:
        """Zero states for ``nseq`` sequences at position 0 (dtype: of the conv inputs, default
        the parameters')."""
        nseq = check_int("nseq", nseq, 0)
        param = next(self.parameters())
        dtype = param.dtype if dtype is None else dtype
        device = param.device if device is None else device
        check_fits("the conv states", (nseq, *self.conv_state_shape), dtype, torch.device(device))
        check_fits("the SSM states", (nseq, *self.ssm_state_shape), torch.float32, torch.device(device))
        return LayerState(torch.zeros(nseq, *self.conv_state_shape, dtype=dtype, device=device),
                          torch.zeros(nseq, *self.ssm_state_shape, dtype=torch.float32, device=device),
                          (0,) * nseq)

    def restore(self, snapshots: Snapshot | Sequence[Snapshot]) -> LayerState:
        """A layer state from one snapshot per sequence (copies, on the layer's device); rejects
        snapshots of another layer shape with a ValueError, a conv state not in the layer's dtype
        or an SSM state not float32 with a TypeError."""
        if isinstance(snapshots, Snapshot):
            snapshots = [snapshots]
        snapshots = list(snapshots)
        for i, snap in enumerate(snapshots):
            if not isinstance(snap, Snapshot):
                raise TypeError(f"snapshots[{i}] must be a Snapshot, got {type(snap).__name__}")
            check_int(f"snapshots[{i}].position", snap.position, 0)  # tokens consumed
            check_tensor_args({f"snapshots[{i}].conv": snap.conv, f"snapshots[{i}].ssm": snap.ssm})
            for part, got, want in (("conv", snap.conv, self.conv_state_shape),
                                    ("ssm", snap.ssm, self.ssm_state_shape)):
                if tuple(got.shape) != tuple(want):
                    raise ValueError(f"snapshots[{i}] has a {part} state of shape {tuple(got.shape)}, but "
                                     f"{self._describe()} needs {tuple(want)}: it was taken from a layer "
                                     "of another shape")
            if snap.ssm.dtype != torch.float32:
                raise TypeError(f"snapshots[{i}] has an SSM state of dtype {snap.ssm.dtype}; it must be float32")
            if snap.conv.dtype != self.in_proj.weight.dtype:
                raise TypeError(f"snapshots[{i}] has a conv state of dtype {snap.conv.dtype}; {self._describe()} "
                                f"runs in {self.in_proj.weight.dtype}")
        if not snapshots:
            raise ValueError("restore needs at least one snapshot")
        device = self.in_proj.weight.device
        return LayerState(torch.stack([s.conv.to(device) for s in snapshots]),
                          torch.stack([s.ssm.to(device) for s in snapshots]), tuple(s.position for s in snapshots))

    def _check_state(self, state, nseq: int, dtype: torch.dtype, device: torch.device) -> LayerState:
        if dtype != self.in_proj.weight.dtype:  # the projections multiply hidden states by the weights
            raise TypeError(f"hidden_states must have the layer's dtype {self.in_proj.weight.dtype}, got {dtype}")
        if state is None:
            return self.initial_state(nseq, dtype=dtype, device=device)
        if not isinstance(state, LayerState):
            raise TypeError(f"state must be a LayerState, got {type(state).__name__}")
        check_tensor("state.conv", state.conv, [("nseq", nseq), ("conv_dim", self.conv_dim),
                                                ("conv_kernel - 1", self.conv_kernel - 1)])
        check_tensor("state.ssm", state.ssm, [("nseq", nseq)] + [(f"ssm dim {i}", n) for i, n in
                                                                 enumerate(self.ssm_state_shape)],
                     (torch.float32,))
        if state.conv.dtype != dtype:
            raise TypeError(f"state.conv must have the hidden states' dtype {dtype}, got {state.conv.dtype}")
        if len(state.positions) != nseq:
            raise ValueError(f"state.positions must hold {nseq} positions, got {len(state.positions)}")
        for s, position in enumerate(state.positions):
            check_int(f"state.positions[{s}]", position, 0)
        return state

    # -- passes ---------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, state: LayerState | None = None, cu_seqlens=None,
                capture=None) -> MixerOutput:
        """One prefill pass.

        Args:
            hidden_states: (batch, seqlen, hidden_size), float32/float16/bfloat16.
            state: the LayerState of the nseq sequences before the pass (None: zeros at 0).
            cu_seqlens: (nseq + 1,) int tensor or list of ints, optional: sequences packed along
                seqlen (batch 1). A tensor's values are read back once (on a GPU, one sync a
                layer); the conv and the scan take them from the host.
            capture: (sequence index, offset) pairs, offsets into the pass (0..length); each
                becomes a Snapshot at absolute position state.positions[s] + offset.

        Returns:
            MixerOutput(out, new state, snapshots in capture order). The input state is not
            modified.
        """
        check_tensor("hidden_states", hidden_states, [("batch", None), ("seqlen", None),
                                                      ("hidden_size", self.hidden_size)], FLOAT_DTYPES)
        device = hidden_states.device
        seqs = make_sequences(hidden_states.shape[0], hidden_states.shape[1], cu_seqlens, device)
        state = self._check_state(state, seqs.count, hidden_states.dtype, device)
        table = make_capture_table(capture, seqs, device)
        self._check_no_grad(hidden_states)
        pairs = [None] * table.count
        for s, k, row in table.entries:
            pairs[row] = (s, k)
        out, conv, scan = self._mix(hidden_states, state, seqs.host_bounds(), pairs)
        snapshots = [Snapshot(state.positions[s] + k, _owned(conv.captured_states[i]), _owned(scan.captured_states[i]))
                     for i, (s, k) in enumerate(pairs)]
        positions = tuple(p + n for p, n in zip(state.positions, seqs.lengths))
        return MixerOutput(out, LayerState(conv.final_states, scan.final_states, positions), snapshots)

    def step(self, hidden_states: torch.Tensor, state: LayerState) -> torch.Tensor:
        """One decode token per sequence: hidden_states (nseq, hidden_size) -> (nseq, hidden_size).

        Updates ``state`` in place (its tensors and positions); bit-identical to a one-token
        forward pass on the recurrent scan (a layer with algorithm="chunked" steps by the recurrence
        too, which agrees with its one-token chunked pass to rounding).
        """
        check_tensor("hidden_states", hidden_states, [("nseq", None), ("hidden_size", self.hidden_size)],
                     FLOAT_DTYPES)
        if state is None:
            raise TypeError("step needs a LayerState (use initial_state() for zeros)")
        self._check_state(state, hidden_states.shape[0], hidden_states.dtype, hidden_states.device)
        check_written({"state.conv": state.conv, "state.ssm": state.ssm}, dict(hidden_states=hidden_states))
        self._check_no_grad(hidden_states)
        out = self._step(hidden_states, state)
        state.positions = tuple(p + 1 for p in state.positions)
        return out

    def _check_no_grad(self, hidden_states):
        """The kernels have no backward: in grad mode, with the layer's parameters or the input
        requiring grad, a pass would return an output whose gradient misses the scan's part."""
        if torch.is_grad_enabled() and (hidden_states.requires_grad or any(p.requires_grad for p in self.parameters())):
            raise ValueError(f"{type(self).__name__} is forward only (its kernels have no backward) and grad mode is "
                             "on with parameters or hidden_states requiring grad: call it under torch.no_grad() or "
                             "torch.inference_mode()")

    def _mix(self, hidden_states, state, cu_seqlens, capture):
        """Return (out, ConvResult, ScanResult) of a validated pass (cu_seqlens: its bounds on the
        host, or None)."""
        raise NotImplementedError

    def _step(self, hidden_states, state):
        raise NotImplementedError
