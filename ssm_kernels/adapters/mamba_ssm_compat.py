"""mamba_ssm-compatible entry points running this library's kernels.

Code written against mamba_ssm can import the three names from here instead::

    from ssm_kernels.adapters.mamba_ssm_compat import (
        mamba_chunk_scan_combined, selective_scan_fn, selective_state_update)

They take mamba_ssm's arguments, in mamba_ssm's order, and return what mamba_ssm returns. Each
adds one keyword-only argument, ``backend`` ("auto", "triton", "torch"). What they cannot honour
raises ValueError/TypeError naming the argument (complex A, seq_idx without cu_seqlens, a
seq_idx that disagrees with cu_seqlens); nothing is written before the checks pass.

Two conventions differ between mamba_ssm and the kernels and are mapped here:
- mamba_ssm's default ``dt_limit=(0.0, inf)`` means "no clamp"; the kernels' default clamps dt
  to [0, inf). With softplus both agree; without it a negative dt would differ, so the default
  is passed on as (-inf, inf). Any other dt_limit clamps, as in mamba_ssm.
- mamba_ssm's ``selective_state_update`` never clamps dt; it is passed on as (-inf, inf).
"""
from __future__ import annotations

import math
import operator

import torch

from .._common import FLOAT_DTYPES, check_state_indices, check_tensor, make_sequences
from ..scan import mamba1_scan, mamba2_scan
from ..scan import selective_state_update as _state_update
from ..scan.mamba2 import STATE_DTYPES

NO_CLAMP = (-math.inf, math.inf)

__all__ = ["selective_scan_fn", "mamba_chunk_scan_combined", "selective_state_update"]


def _real_float(name, t, want_f32=False):
    """Reject complex or non-float tensors; optionally return a float32 copy."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_complex():
        raise TypeError(f"{name} is complex ({t.dtype}); ssm_kernels scans real-valued SSMs only "
                        "(mamba_ssm's complex S4D variant is not supported)")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    return t.float() if want_f32 and t.dtype != torch.float32 else t


def _is_mamba_ssm_default_limit(dt_limit) -> bool:
    try:
        lo, hi = dt_limit
        return float(lo) == 0.0 and float(hi) == math.inf
    except (TypeError, ValueError):
        return False  # malformed: the kernel's check names it


# ---------------------------------------------------------------------------------------------
# selective_scan_fn (mamba_ssm.ops.selective_scan_interface)
# ---------------------------------------------------------------------------------------------
def _bc_layout(B, C, batch, dim, seqlen):
    """mamba_ssm's B/C layouts -> one layout mamba1_scan takes for both.

    (batch, dstate, seqlen) and (batch, ngroups, dstate, seqlen) are input-dependent; a
    (dim, dstate) B or C is time-invariant (one row per channel). When B and C differ in layout,
    both become per-channel groups, (batch, dim, dstate, seqlen) (stride-0 views where possible).
    """
    for name, t in (("B", B), ("C", C)):
        if t.ndim not in (2, 3, 4):
            raise ValueError(f"{name} must be (dim, dstate), (batch, dstate, seqlen) or "
                             f"(batch, ngroups, dstate, seqlen), got {tuple(t.shape)}")
    if B.ndim != 2 and B.shape == C.shape:
        return B, C

    def per_channel(name, t):
        if t.ndim == 2:
            check_tensor(name, t, [("dim", dim), ("dstate", None)], FLOAT_DTYPES)
            return t.unsqueeze(0).unsqueeze(-1).expand(batch, dim, t.shape[1], seqlen)
        if t.ndim == 3:
            return t.unsqueeze(1).expand(t.shape[0], dim, *t.shape[1:])
        if dim % t.shape[1]:
            raise ValueError(f"dim ({dim}) must be a multiple of {name}'s ngroups ({t.shape[1]})")
        return t.repeat_interleave(dim // t.shape[1], dim=1)

    return per_channel("B", B), per_channel("C", C)


def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False, *, backend="auto"):
    """mamba_ssm's ``selective_scan_fn`` on :func:`ssm_kernels.mamba1_scan`.

    Args (mamba_ssm's):
        u, delta: (batch, dim, seqlen); A: (dim, dstate) real (cast to float32);
        B, C: (batch, dstate, seqlen), (batch, ngroups, dstate, seqlen) or, time-invariant,
            (dim, dstate); D, delta_bias: (dim,); z: (batch, dim, seqlen);
        delta_softplus: softplus(delta + delta_bias); return_last_state: also return the state.

    Returns:
        out (batch, dim, seqlen) in u's dtype, or (out, last_state (batch, dim, dstate) float32)
        with return_last_state.
    """
    A = _real_float("A", A, want_f32=True)
    _real_float("B", B)
    _real_float("C", C)
    check_tensor("u", u, [("batch", None), ("dim", None), ("seqlen", None)], FLOAT_DTYPES)
    B, C = _bc_layout(B, C, *u.shape)
    result = mamba1_scan(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias,
                         delta_softplus=bool(delta_softplus), backend=backend)
    return (result.y, result.final_states) if return_last_state else result.y


# ---------------------------------------------------------------------------------------------
# mamba_chunk_scan_combined (mamba_ssm.ops.triton.ssd_combined)
# ---------------------------------------------------------------------------------------------
def _check_seq_idx(seq_idx, cu_seqlens, batch, seqlen):
    """seq_idx must say what cu_seqlens says: token t of sequence s has seq_idx[0, t] == s."""
    check_tensor("seq_idx", seq_idx, [("batch", batch), ("seqlen", seqlen)])
    if seq_idx.dtype.is_floating_point or seq_idx.dtype == torch.bool:
        raise TypeError(f"seq_idx must be an integer tensor, got {seq_idx.dtype}")
    if batch != 1:
        raise ValueError(f"seq_idx with cu_seqlens needs a packed batch of size 1, got batch {batch}")
    bounds = cu_seqlens.tolist()
    want = torch.repeat_interleave(torch.arange(len(bounds) - 1), torch.tensor(
        [max(b - a, 0) for a, b in zip(bounds, bounds[1:])], dtype=torch.int64))
    got = seq_idx[0].to("cpu", torch.int64)
    if got.shape != want.shape or not torch.equal(got, want):
        bad = next((t for t in range(min(len(got), len(want))) if got[t] != want[t]), min(len(got), len(want)))
        raise ValueError(f"seq_idx disagrees with cu_seqlens at token {bad}: seq_idx says "
                         f"{got[bad].item() if bad < len(got) else None}, cu_seqlens says "
                         f"{want[bad].item() if bad < len(want) else None} (seq_idx[0, t] must be the index "
                         "of the sequence that holds token t)")


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False, *, backend="auto"):
    """mamba_ssm's ``mamba_chunk_scan_combined`` on :func:`ssm_kernels.mamba2_scan`.

    Args (mamba_ssm's):
        x: (batch, seqlen, nheads, headdim); dt: (batch, seqlen, nheads); A: (nheads,) real;
        B, C: (batch, seqlen, ngroups, dstate); chunk_size: a positive int (the recurrent scan
            needs no chunks; it is checked and otherwise ignored);
        D: (nheads, headdim) or (nheads,); z: like x; dt_bias: (nheads,);
        initial_states: (batch, nheads, headdim, dstate): with seq_idx, the state before the
            first sequence of the packed row (the others start from zeros), as in mamba_ssm;
        seq_idx: (1, seqlen), the sequence index of each token of a packed row; it needs
            cu_seqlens (the boundaries) and must agree with it;
        cu_seqlens: (nseq + 1,): with seq_idx, the packed sequences; without seq_idx it only
            marks where return_varlen_states reads the state of the unsegmented scan, as in
            mamba_ssm;
        dt_softplus, dt_limit: the default (0.0, inf) means no clamp, as in mamba_ssm;
        return_final_states, return_varlen_states: as in mamba_ssm.

    Returns (mamba_ssm's order):
        out (like x); with return_final_states also final_states (batch, nheads, headdim,
        dstate) float32 (the state after the row's last token); with return_varlen_states also
        varlen_states (nseq, nheads, headdim, dstate) float32 (each sequence's last state).
    """
    try:
        chunk = operator.index(chunk_size)
    except TypeError:
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__}") from None
    if chunk < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk}")
    A = _real_float("A", A, want_f32=True)
    initial_states = _real_float("initial_states", initial_states, want_f32=True)
    check_tensor("x", x, [("batch", None), ("seqlen", None), ("nheads", None), ("headdim", None)], FLOAT_DTYPES)
    batch, seqlen = x.shape[:2]
    limit = NO_CLAMP if _is_mamba_ssm_default_limit(dt_limit) else dt_limit
    if return_varlen_states and cu_seqlens is None:
        raise ValueError("return_varlen_states=True needs cu_seqlens (as in mamba_ssm)")
    if seq_idx is not None and cu_seqlens is None:
        raise ValueError("seq_idx without cu_seqlens cannot be honoured: pass cu_seqlens (nseq + 1,) with the "
                         "packed sequences' boundaries as well")
    common = dict(D=D, z=z, dt_bias=dt_bias, dt_softplus=bool(dt_softplus), dt_limit=limit, backend=backend)

    if seq_idx is None:
        varlen_capture = None
        if return_varlen_states:
            check_tensor("cu_seqlens", cu_seqlens, [("nseq + 1", None)])
            if batch != 1:
                raise ValueError(f"return_varlen_states needs a packed batch of size 1, got batch {batch}")
            bounds = cu_seqlens.tolist()
            if not bounds or bounds[0] != 0 or bounds[-1] != seqlen or any(b < a for a, b in zip(bounds, bounds[1:])):
                raise ValueError(f"cu_seqlens must rise from 0 to seqlen = {seqlen}, got {bounds}")
            varlen_capture = [(0, end) for end in bounds[1:]]
        result = mamba2_scan(x, dt, A, B, C, initial_states=initial_states, capture=varlen_capture, **common)
        final_states, varlen_states = result.final_states, result.captured_states
    else:
        seqs = make_sequences(batch, seqlen, cu_seqlens, x.device)  # validates cu_seqlens
        _check_seq_idx(seq_idx, cu_seqlens, batch, seqlen)
        if initial_states is not None:
            check_tensor("initial_states", initial_states, [("batch", batch)] + [(n, None) for n in
                                                                                  ("nheads", "headdim", "dstate")])
            rest = initial_states.new_zeros(max(seqs.count - 1, 0), *initial_states.shape[1:])
            initial_states = torch.cat([initial_states, rest])[:seqs.count]
        result = mamba2_scan(x, dt, A, B, C, initial_states=initial_states, cu_seqlens=cu_seqlens, **common)
        varlen_states = result.final_states
        owner = max((s for s, n in enumerate(seqs.lengths) if n > 0), default=0)
        final_states = varlen_states[owner:owner + 1]
    out = result.y
    if return_varlen_states:
        return (out, final_states, varlen_states) if return_final_states else (out, varlen_states)
    return (out, final_states) if return_final_states else out


# ---------------------------------------------------------------------------------------------
# selective_state_update (mamba_ssm.ops.triton.selective_state_update)
# ---------------------------------------------------------------------------------------------
def _constant_along(t, dims) -> bool:
    """Whether t holds one value along `dims` (mamba_ssm's tie_hdim, checked by value)."""
    if t is None:
        return True
    index = tuple(slice(0, 1) if d in dims else slice(None) for d in range(t.ndim))
    return bool(torch.equal(t, t[index].expand_as(t)))


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None, *, backend="auto"):
    """mamba_ssm's ``selective_state_update``: one decode token, ``state`` updated in place.

    Args (mamba_ssm's):
        state: (nslots, dim, dstate) or (nslots, nheads, dim, dstate), any float dtype;
        x, dt, z: (batch, dim) or (batch, nheads, dim); A: (dim, dstate) or (nheads, dim, dstate);
        B, C: (batch, dstate) or (batch, ngroups, dstate); D, dt_bias: (dim,) or (nheads, dim);
        dt_softplus: softplus(dt + dt_bias); dt is never clamped (as in mamba_ssm);
        state_batch_indices: (batch,) distinct slots of ``state`` (default 0..batch-1).

    When A is one value per head and dt, dt_bias one per head (mamba_ssm's "tie_hdim" Mamba-2
    layout, found by value), this is :func:`ssm_kernels.selective_state_update`; otherwise
    (a Mamba-1 layout, A per channel and state) a one-token :func:`ssm_kernels.mamba1_scan`.
    A float16/bfloat16 state is updated in place in the first case (float32 arithmetic, stored
    rounded), through a float32 copy in the second.

    Returns:
        out, like x, in x's dtype.
    """
    A = _real_float("A", A, want_f32=True)
    for name, t in (("state", state), ("x", x), ("dt", dt), ("B", B), ("C", C)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    has_heads = state.ndim > 3
    if state.ndim == 3:
        state = state.unsqueeze(1)
    # mamba_ssm's own promotion of the head-less layout: a head axis of size 1.
    per_row = lambda t: None if t is None else (t.unsqueeze(1) if t.ndim == 2 else t)
    per_head = lambda t, n: None if t is None else (t.unsqueeze(0) if t.ndim == n else t)
    x, dt, z, B, C = per_row(x), per_row(dt), per_row(z), per_row(B), per_row(C)
    A, D, dt_bias = per_head(A, 2), per_head(D, 1), per_head(dt_bias, 1)
    check_tensor("state", state, [("nslots", None), ("nheads", None), ("dim", None), ("dstate", None)])
    _, nheads, dim, dstate = state.shape
    batch = x.shape[0]
    check_tensor("x", x, [("batch", None), ("nheads", nheads), ("dim", dim)], FLOAT_DTYPES)
    check_tensor("dt", dt, [("batch", batch), ("nheads", nheads), ("dim", dim)], FLOAT_DTYPES)
    check_tensor("A", A, [("nheads", nheads), ("dim", dim), ("dstate", dstate)])
    check_tensor("B", B, [("batch", batch), ("ngroups", None), ("dstate", dstate)], FLOAT_DTYPES)
    check_tensor("C", C, [("batch", batch), ("ngroups", B.shape[1]), ("dstate", dstate)], FLOAT_DTYPES)
    if z is not None:
        check_tensor("z", z, [("batch", batch), ("nheads", nheads), ("dim", dim)], FLOAT_DTYPES)
    for name, t in (("D", D), ("dt_bias", dt_bias)):
        if t is not None:
            check_tensor(name, t, [("nheads", nheads), ("dim", dim)], FLOAT_DTYPES)
    if not state.dtype.is_floating_point:
        raise TypeError(f"state must be a floating-point tensor, got {state.dtype}")
    slots = check_state_indices(state_batch_indices, batch, state.shape[0], "state", state.device,
                                name="state_batch_indices")

    tied = _constant_along(A, (1, 2)) and _constant_along(dt, (2,)) and _constant_along(dt_bias, (1,))
    work = state if state.dtype == torch.float32 or (tied and state.dtype in STATE_DTYPES) else state.float()
    if tied:
        y = _state_update(work, x, dt[:, :, 0], A[:, 0, 0].contiguous(), B, C, D=D, z=z,
                          dt_bias=None if dt_bias is None else dt_bias[:, 0], dt_softplus=bool(dt_softplus),
                          dt_limit=NO_CLAMP, state_indices=slots, backend=backend)
    else:
        y = _untied_update(work, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slots, backend)
    if work is not state:
        state.copy_(work)
    return y if has_heads else y[:, 0]


def _untied_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slots, backend):
    """A per-(channel, state) A: a one-token mamba1_scan over nheads * dim channels."""
    batch, nheads, dim = x.shape
    dstate = state.shape[-1]
    channels = lambda t: None if t is None else t.reshape(batch, nheads * dim, 1)
    flat = lambda t: None if t is None else t.reshape(nheads * dim)
    result = mamba1_scan(channels(x), channels(dt), A.reshape(nheads * dim, dstate), B.unsqueeze(-1),
                         C.unsqueeze(-1), D=flat(D), z=channels(z), delta_bias=flat(dt_bias),
                         delta_softplus=bool(dt_softplus),
                         initial_states=state[slots].reshape(batch, nheads * dim, dstate), backend=backend)
    state.index_copy_(0, slots, result.final_states.reshape(batch, nheads, dim, dstate))
    return result.y.reshape(batch, nheads, dim)
