"""mamba_ssm-compatible entry points running this library's kernels.

Code written against mamba_ssm can import the three names from here instead::

    from ssm_kernels.adapters.mamba_ssm_compat import (
        mamba_chunk_scan_combined, selective_scan_fn, selective_state_update)

They take mamba_ssm's arguments, in mamba_ssm's order, and return what mamba_ssm returns. Each
adds one keyword-only argument, ``backend`` ("auto", "triton", "torch"). What they cannot honour
raises ValueError/TypeError naming the argument (complex A, a seq_idx that decreases along a row
or disagrees with cu_seqlens, flags that are not bools); nothing is written before the checks pass.

dt clamping, kernel by kernel, as in mamba_ssm 2.3.2:
- ``mamba_chunk_scan_combined``: its Triton kernel (``_chunk_cumsum_fwd_kernel``) always clamps
  dt' (after bias and softplus) to ``dt_limit``, default (0.0, inf): a negative dt' becomes 0.
  ``dt_limit`` is passed on unchanged. (mamba_ssm's PyTorch reference ``ssd_selective_scan``
  clamps only for a non-default dt_limit; the kernel is what models run.)
- ``selective_state_update``: no dt_limit argument and no clamp; dt is passed on unclamped.
- ``selective_scan_fn`` (Mamba-1): no clamp, as in mamba1_scan.

Sequences in ``mamba_chunk_scan_combined``: ``seq_idx`` (batch, seqlen) labels each token with its
sequence; a sequence is a run of equal labels (mamba_ssm resets the state where the label
changes), and labels must not decrease along a row. ``initial_states[b]`` is the state before
row b's sequence 0, as in mamba_ssm, whose state passing starts at label 0; a row that does not
start with label 0 is refused when initial_states is given (mamba_ssm drops the state there, or
decays it through the tokens before label 0, depending on where its chunks end). ``cu_seqlens``
is needed only for ``return_varlen_states``; with seq_idx it must agree.

Where this module deliberately differs from mamba_ssm 2.3.2:
- varlen states with initial states: mamba_ssm's ``chunk_state_varlen`` adds the incoming state
  only to a sequence that began in an earlier chunk, so the first sequence's varlen state lacks
  ``initial_states`` when that sequence ends inside the first chunk. Here each varlen state is
  the state at its sequence's end, initial state included.
- varlen states without seq_idx: the scan runs across the cu_seqlens boundaries and each varlen
  state is the scan's state at its sequence's end (mamba_ssm keeps the earlier sequences'
  contributions for a sequence that spans a chunk boundary and drops them otherwise).
- ``selective_state_update`` with ``D=None`` or ``dt_bias=None``: mamba_ssm's Triton kernel raises
  a TypeError (it unpacks their strides); here the step runs without them.
- ``state_batch_indices`` must be distinct slots in range (mamba_ssm skips negative ones).
"""
from __future__ import annotations

import math

import torch

from .._common import (FLOAT_DTYPES, NO_CAPTURES, Sequences, check_bool, check_decode_slots, check_int,
                       check_same_device, check_tensor, check_tensor_args, check_written, make_sequences, new_output,
                       resolve_backend)
from ..scan import dispatch, mamba1_scan, mamba2_scan
from ..scan import selective_state_update as _state_update
from ..scan.problem import ScanProblem, check_scan_sizes

NO_CLAMP = (-math.inf, math.inf)  # selective_state_update: mamba_ssm's decode step never clamps dt

__all__ = ["selective_scan_fn", "mamba_chunk_scan_combined", "selective_state_update"]


def _real_float(name, t, want_f32=False):
    """Reject complex or non-float tensors; optionally return a float32 copy."""
    if t is None:
        return None
    check_tensor_args({name: t})
    if t.is_complex():
        raise TypeError(f"{name} is complex ({t.dtype}); ssm_kernels scans real-valued SSMs only "
                        "(mamba_ssm's complex S4D variant is not supported)")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    return t.float() if want_f32 and t.dtype != torch.float32 else t


# ---------------------------------------------------------------------------------------------
# selective_scan_fn (mamba_ssm.ops.selective_scan_interface)
# ---------------------------------------------------------------------------------------------
def _bc_layout(B, C, batch, dim, seqlen, dstate):
    """mamba_ssm's B/C layouts -> one layout mamba1_scan takes for both, each checked as given.

    (batch, dstate, seqlen) and (batch, ngroups, dstate, seqlen) are input-dependent; a
    (dim, dstate) B or C is time-invariant (one row per channel). When B and C differ in layout,
    both become per-channel groups, (batch, dim, dstate, seqlen) (stride-0 views where possible).
    """
    layouts = {2: [("dim", dim), ("dstate", dstate)], 3: [("batch", batch), ("dstate", dstate), ("seqlen", seqlen)],
               4: [("batch", batch), ("ngroups", None), ("dstate", dstate), ("seqlen", seqlen)]}
    for name, t in (("B", B), ("C", C)):
        if t.ndim not in layouts:
            raise ValueError(f"{name} must be (dim, dstate), (batch, dstate, seqlen) or "
                             f"(batch, ngroups, dstate, seqlen), got {tuple(t.shape)}")
        check_tensor(name, t, layouts[t.ndim], FLOAT_DTYPES)
    if B.ndim != 2 and B.shape == C.shape:
        return B, C

    def per_channel(name, t):
        if t.ndim == 2:
            return t.unsqueeze(0).unsqueeze(-1).expand(batch, dim, t.shape[1], seqlen)
        if t.ndim == 3:
            return t.unsqueeze(1).expand(t.shape[0], dim, *t.shape[1:])
        if t.shape[1] < 1:
            raise ValueError(f"{name} must have at least one group, got shape {tuple(t.shape)} (ngroups 0)")
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
    check_tensor_args(dict(u=u, delta=delta, A=A, B=B, C=C), dict(D=D, z=z, delta_bias=delta_bias))
    A = _real_float("A", A, want_f32=True)
    _real_float("B", B)
    _real_float("C", C)
    check_bool("delta_softplus", delta_softplus)
    check_bool("return_last_state", return_last_state)
    check_tensor("u", u, [("batch", None), ("dim", None), ("seqlen", None)], FLOAT_DTYPES)
    check_tensor("A", A, [("dim", u.shape[1]), ("dstate", None)])
    B, C = _bc_layout(B, C, *u.shape, A.shape[1])
    result = mamba1_scan(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                         backend=backend)
    return (result.y, result.final_states) if return_last_state else result.y


# ---------------------------------------------------------------------------------------------
# mamba_chunk_scan_combined (mamba_ssm.ops.triton.ssd_combined)
# ---------------------------------------------------------------------------------------------
def _check_seq_idx(seq_idx, bounds: list[int]):
    """With cu_seqlens (its values `bounds`), seq_idx must say what it says: token t of sequence s
    has seq_idx[0, t] == s."""
    want = torch.repeat_interleave(torch.arange(len(bounds) - 1, device="cpu"), torch.tensor(
        [max(b - a, 0) for a, b in zip(bounds, bounds[1:])], dtype=torch.int64, device="cpu"))
    got = seq_idx[0].to("cpu", torch.int64)
    if got.shape != want.shape or not torch.equal(got, want):
        bad = next((t for t in range(min(len(got), len(want))) if got[t] != want[t]), min(len(got), len(want)))
        raise ValueError(f"seq_idx disagrees with cu_seqlens at token {bad}: seq_idx says "
                         f"{got[bad].item() if bad < len(got) else None}, cu_seqlens says "
                         f"{want[bad].item() if bad < len(want) else None} (seq_idx[0, t] must be the index "
                         "of the sequence that holds token t)")


def _packed_sequences(seq_idx, cu_seqlens, batch, seqlen, device):
    """The sequences of a seq_idx call, packed into one row of batch * seqlen tokens.

    Returns (cu_seqlens of the packed row as a host list, each row's first and last sequence,
    whether each row's first sequence is labelled 0, i.e. takes that row's initial state).
    """
    check_tensor("seq_idx", seq_idx, [("batch", batch), ("seqlen", seqlen)])
    if seq_idx.dtype.is_floating_point or seq_idx.dtype.is_complex or seq_idx.dtype == torch.bool:
        raise TypeError(f"seq_idx must be an integer tensor, got {seq_idx.dtype}")
    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(f"seq_idx with cu_seqlens needs a packed batch of size 1, got batch {batch}")
        seqs = make_sequences(batch, seqlen, cu_seqlens, device)  # validates cu_seqlens
        bounds = seqs.host_bounds()
        _check_seq_idx(seq_idx, bounds)
        last = max((s for s, n in enumerate(seqs.lengths) if n > 0), default=0)
        # an empty first sequence leaves the row's first token labelled 1 or more: refused as without cu_seqlens
        return bounds, [0], [last], [not seqlen or int(seq_idx[0, 0]) == 0]
    labels = seq_idx.to("cpu", torch.int64)
    steps = labels[:, 1:] - labels[:, :-1]
    if bool((steps < 0).any()):
        b, t = (steps < 0).nonzero()[0].tolist()
        raise ValueError(f"seq_idx must not decrease along a row (a sequence is a run of equal labels), got "
                         f"seq_idx[{b}, {t + 1}] = {labels[b, t + 1].item()} after seq_idx[{b}, {t}] = "
                         f"{labels[b, t].item()}")
    bounds, first, last = [0], [], []
    for b in range(batch):
        first.append(len(bounds) - 1)
        starts = (steps[b].nonzero().flatten() + 1).tolist()
        bounds += [b * seqlen + t for t in starts] + [(b + 1) * seqlen]
        last.append(len(bounds) - 2)
    label0 = (labels[:, 0] == 0).tolist() if seqlen else [True] * batch
    return bounds, first, last, label0


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False, *, backend="auto"):
    """mamba_ssm's ``mamba_chunk_scan_combined`` on :func:`ssm_kernels.mamba2_scan`.

    Args (mamba_ssm's):
        x: (batch, seqlen, nheads, headdim); dt: (batch, seqlen, nheads); A: (nheads,) real;
        B, C: (batch, seqlen, ngroups, dstate); chunk_size: a positive int, checked and
            otherwise ignored (the scan runs mamba2_scan's default algorithm, "auto", with its own
            chunk size);
        D: (nheads, headdim) or (nheads,); z: like x; dt_bias: (nheads,);
        initial_states: (batch, nheads, headdim, dstate): the state before each row (with seq_idx,
            before its first sequence, which must be labelled 0);
        seq_idx: (batch, seqlen) int, optional: each token's sequence label, non-decreasing along
            a row; the state restarts where the label changes;
        cu_seqlens: (nseq + 1,), needed for return_varlen_states: the sequences whose last states
            are returned; with seq_idx it must agree with it (batch 1);
        dt_softplus: softplus(dt + dt_bias); dt_limit: clamp of dt', default (0.0, inf) (a
            negative dt' becomes 0, as in mamba_ssm's kernel);
        return_final_states, return_varlen_states: as in mamba_ssm.

    Returns (mamba_ssm's order):
        out (like x); with return_final_states also final_states (batch, nheads, headdim,
        dstate) float32 (the state after each row's last token); with return_varlen_states also
        varlen_states (nseq, nheads, headdim, dstate) in C's dtype (each sequence's last state,
        rounded to nearest even from float32 for 16-bit C, as mamba_ssm returns them).
    """
    check_int("chunk_size", chunk_size, 1)
    check_tensor_args(dict(x=x, dt=dt, A=A, B=B, C=C), dict(D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
                                                           seq_idx=seq_idx, cu_seqlens=cu_seqlens))
    for name, flag in (("dt_softplus", dt_softplus), ("return_final_states", return_final_states),
                       ("return_varlen_states", return_varlen_states)):
        check_bool(name, flag)
    A = _real_float("A", A, want_f32=True)
    initial_states = _real_float("initial_states", initial_states, want_f32=True)
    check_tensor("x", x, [("batch", None), ("seqlen", None), ("nheads", None), ("headdim", None)], FLOAT_DTYPES)
    batch, seqlen = x.shape[:2]
    if return_varlen_states and cu_seqlens is None:
        raise ValueError("return_varlen_states=True needs cu_seqlens (as in mamba_ssm)")
    common = dict(D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, backend=backend)

    if seq_idx is None:
        varlen_capture = None
        if return_varlen_states:
            if batch != 1:
                raise ValueError(f"return_varlen_states needs a packed batch of size 1, got batch {batch}")
            bounds = make_sequences(batch, seqlen, cu_seqlens, x.device).host_bounds()  # validates cu_seqlens
            varlen_capture = [(0, end) for end in bounds[1:]]
        result = mamba2_scan(x, dt, A, B, C, z=z, initial_states=initial_states, capture=varlen_capture, **common)
        out, final_states, varlen_states = result.y, result.final_states, result.captured_states
    else:
        out, final_states, varlen_states = _packed_scan(x, dt, A, B, C, z, initial_states, seq_idx, cu_seqlens,
                                                        common)
    if return_varlen_states:
        varlen_states = varlen_states.to(C.dtype)  # mamba_ssm keeps its chunk states, these too, in C's dtype
        return (out, final_states, varlen_states) if return_final_states else (out, varlen_states)
    return (out, final_states) if return_final_states else out


def _packed_scan(x, dt, A, B, C, z, initial_states, seq_idx, cu_seqlens, common):
    """mamba_chunk_scan_combined with seq_idx: the rows packed into one varlen row, one sequence
    per run of equal labels. Returns (out, final_states per row, every sequence's final state)."""
    batch, seqlen, nheads, headdim = x.shape
    token_dims = [("batch", batch), ("seqlen", seqlen)]
    check_tensor("dt", dt, token_dims + [("nheads", nheads)], FLOAT_DTYPES)
    check_tensor("B", B, token_dims + [("ngroups", None), ("dstate", None)], FLOAT_DTYPES)
    check_tensor("C", C, token_dims + [("ngroups", B.shape[2]), ("dstate", B.shape[3])], FLOAT_DTYPES)
    if z is not None:
        check_tensor("z", z, token_dims + [("nheads", nheads), ("headdim", headdim)], FLOAT_DTYPES)
    bounds, first, last, label0 = _packed_sequences(seq_idx, cu_seqlens, batch, seqlen, x.device)
    init = None
    if initial_states is not None:
        check_tensor("initial_states", initial_states, [("batch", batch), ("nheads", nheads), ("headdim", headdim),
                                                        ("dstate", B.shape[3])])
        b = next((b for b in range(batch) if not label0[b]), None)
        if b is not None:
            raise ValueError(f"initial_states is the state before a row's tokens labelled 0, but row {b} starts "
                             f"with seq_idx {seq_idx[b, 0].item()} (mamba_ssm's result there depends on its chunk "
                             "size); start every row with label 0, or pass no initial_states")
        init = initial_states.new_zeros(len(bounds) - 1, *initial_states.shape[1:])
        init[first] = initial_states
    pack = lambda t: None if t is None else t.reshape(1, batch * seqlen, *t.shape[2:])
    result = mamba2_scan(pack(x), pack(dt), A, pack(B), pack(C), z=pack(z), initial_states=init,
                         cu_seqlens=bounds, **common)
    return result.y.view(x.shape), result.final_states[last], result.final_states


# ---------------------------------------------------------------------------------------------
# selective_state_update (mamba_ssm.ops.triton.selective_state_update)
# ---------------------------------------------------------------------------------------------
def _broadcast_along(t, dims) -> bool:
    """Whether t repeats one value along dims by its strides (0, or size 1): mamba_ssm's
    tie_hdim test, read from the layout rather than the values (no device sync)."""
    return t is None or all(t.stride(d) == 0 or t.shape[d] == 1 for d in dims)


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None, *, backend="auto"):
    """mamba_ssm's ``selective_state_update``: one decode token, ``state`` updated in place.

    Args (mamba_ssm's):
        state: (nslots, dim, dstate) or (nslots, nheads, dim, dstate), float32, float16 or
            bfloat16 (no overlapping memory, not requiring grad);
        x, dt, z: (batch, dim) or (batch, nheads, dim); A: (dim, dstate) or (nheads, dim, dstate);
        B, C: (batch, dstate) or (batch, ngroups, dstate); D, dt_bias: (dim,) or (nheads, dim);
        dt_softplus: softplus(dt + dt_bias); dt is never clamped (as in mamba_ssm);
        state_batch_indices: (batch,) distinct slots of ``state`` (default 0..batch-1).

    When A is broadcast along (dim, dstate) and dt, dt_bias along dim (stride 0: mamba_ssm's
    "tie_hdim" Mamba-2 layout, read from the strides as mamba_ssm does), this is
    :func:`ssm_kernels.selective_state_update`; otherwise (a Mamba-1 layout, A per channel and
    state) the one-token recurrent pass :func:`ssm_kernels.mamba1_scan` runs, with every entry of
    A. Either way the batch's slots of a float32, float16 or bfloat16 state are updated in place
    (float32 arithmetic, stored rounded as mamba_ssm's kernel stores it).

    Returns:
        out, like x, in x's dtype.
    """
    check_tensor_args(dict(state=state, x=x, dt=dt, A=A, B=B, C=C),
                      dict(D=D, z=z, dt_bias=dt_bias, state_batch_indices=state_batch_indices))
    check_bool("dt_softplus", dt_softplus)
    written = dict(state=state)  # before the views below: named as given
    read = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, state_batch_indices=state_batch_indices)
    has_heads = state.ndim > 3
    if state.ndim == 3:
        state = state.unsqueeze(1)
    # mamba_ssm's own promotion of the head-less layout: a head axis of size 1.
    per_row = lambda t: None if t is None else (t.unsqueeze(1) if t.ndim == 2 else t)
    per_head = lambda t, n: None if t is None else (t.unsqueeze(0) if t.ndim == n else t)
    x, dt, z, B, C = per_row(x), per_row(dt), per_row(z), per_row(B), per_row(C)
    A, D, dt_bias = per_head(A, 2), per_head(D, 1), per_head(dt_bias, 1)
    check_tensor("state", state, [("nslots", None), ("nheads", None), ("dim", None), ("dstate", None)],
                 FLOAT_DTYPES)
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
    # Head h reads group h // (nheads // ngroups), on either path (mamba_ssm refuses the rest).
    check_scan_sizes("nheads", nheads, B.shape[1], dstate, dim=dim)
    tied = _broadcast_along(A, (1, 2)) and _broadcast_along(dt, (2,)) and _broadcast_along(dt_bias, (1,))
    A = _real_float("A", A, want_f32=True)
    check_written(written, read)
    check_decode_slots(state_batch_indices, None, None, batch, state.shape[0], name="state_batch_indices")
    slots = (torch.arange(batch, device=state.device) if state_batch_indices is None
             else state_batch_indices.to(state.device, torch.int64))

    if tied:
        y = _state_update(state, x, dt[:, :, 0], A[:, 0, 0].contiguous(), B, C, D=D, z=z,
                          dt_bias=None if dt_bias is None else dt_bias[:, 0], dt_softplus=dt_softplus,
                          dt_limit=NO_CLAMP, state_indices=slots, backend=backend)
    else:
        y = _untied_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slots, backend)
    return y if has_heads else y[:, 0]


def _untied_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slots, backend):
    """A per (channel, state): the one-token recurrent pass in the scan's layout with every entry
    of A read (ScanProblem.a_per_state, as mamba1_scan runs it), on the arguments checked above,
    updating state[slots] in place in the state's dtype (computed in float32 and stored rounded,
    as the tied path stores it): no copy of the batch's rows."""
    device = check_same_device(state=state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, slots=slots)
    batch = x.shape[0]
    one_token = lambda t: None if t is None else t.unsqueeze(1)  # (batch, 1, ...): the scan's time axis
    y = new_output(batch, 1, *x.shape[1:], dtype=x.dtype, device=device, name="y")
    dispatch.run_public(ScanProblem(
        x=one_token(x), dt=one_token(dt), A=A, B=one_token(B), C=one_token(C), D=D, z=one_token(z), dt_bias=dt_bias,
        dt_softplus=dt_softplus, dt_min=NO_CLAMP[0], dt_max=NO_CLAMP[1], a_per_state=True, state_in=state,
        state_index=slots, seqs=Sequences(None, [1] * batch, varlen=False), captures=NO_CAPTURES, y=y,
        state_out=state, captured=state[:0]), resolve_backend(backend, device))
    return y[:, 0]
