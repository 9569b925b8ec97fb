"""Mamba-2 layout: mamba2_scan (a prefill pass) and selective_state_update (one decode token).

What is bit-identical where, and the accuracy against the float64 references: README.md, section
"Semantics and exactness". Here: the arguments' checks, and the dispatch to the recurrent kernels
(dispatch.py) or the chunked path (mamba2_chunked/).
"""
from __future__ import annotations

import math

import torch

from .._common import (FLOAT_DTYPES, NO_CAPTURES, ScanResult, Sequences, check_bool, check_decode_slots,
                       check_dt_limit, check_same_device, check_tensor, check_tensor_args, check_written,
                       make_sequences, new_output, resolve_backend)
from . import mamba2_chunked
from . import dispatch
from .problem import ScanProblem, check_scan_sizes

F32 = (torch.float32,)


def check_mamba2_args(x, dt, A, B, C, D, z, dt_bias, *, token_dims):
    """Validate Mamba-2 arguments; token_dims names the leading axes ((batch, seqlen) or (batch,)).

    Returns (nheads, headdim, ngroups, dstate).
    """
    check_tensor_args(dict(x=x, dt=dt, A=A, B=B, C=C), dict(D=D, z=z, dt_bias=dt_bias))
    lead = [(name, None) for name in token_dims]
    check_tensor("x", x, lead + [("nheads", None), ("headdim", None)], FLOAT_DTYPES)
    sizes = list(zip(token_dims, x.shape))
    nheads, headdim = x.shape[-2:]
    check_tensor("dt", dt, sizes + [("nheads", nheads)], FLOAT_DTYPES)
    check_tensor("A", A, [("nheads", nheads)], F32)
    check_tensor("B", B, sizes + [("ngroups", None), ("dstate", None)], FLOAT_DTYPES)
    ngroups, dstate = B.shape[-2:]
    check_tensor("C", C, sizes + [("ngroups", ngroups), ("dstate", dstate)], FLOAT_DTYPES)
    check_scan_sizes("nheads", nheads, ngroups, dstate, headdim=headdim)
    if D is not None:
        if D.ndim not in (1, 2):
            raise ValueError(f"D must have shape (nheads,) or (nheads, headdim) = ({nheads},) or ({nheads}, "
                             f"{headdim}), got shape {tuple(D.shape)}")
        dims = [("nheads", nheads)] if D.ndim == 1 else [("nheads", nheads), ("headdim", headdim)]
        check_tensor("D", D, dims, FLOAT_DTYPES)
    if z is not None:
        check_tensor("z", z, sizes + [("nheads", nheads), ("headdim", headdim)], FLOAT_DTYPES)
    if dt_bias is not None:
        check_tensor("dt_bias", dt_bias, [("nheads", nheads)], FLOAT_DTYPES)
    return nheads, headdim, ngroups, dstate


def _per_row(t, nheads, headdim):
    """A per-head (nheads,) or per-row (nheads, headdim) parameter as (nheads, headdim)."""
    if t is None:
        return None
    return (t.unsqueeze(-1) if t.ndim == 1 else t).expand(nheads, headdim)


def mamba2_problem(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, state_in, state_index,
                   seqs, captures, y, state_out, captured, **engine_fields) -> ScanProblem:
    """The scan layout for Mamba-2 tensors with a time axis: (batch, seqlen, nheads, headdim).
    engine_fields: ScanProblem's optional engine fields (state_out_index, has_initial, skip_slot)."""
    nheads, headdim = x.shape[2:]
    dstate = B.shape[3]
    return ScanProblem(
        x=x, dt=dt.unsqueeze(-1).expand(*dt.shape, headdim),
        A=A.view(nheads, 1, 1).expand(nheads, headdim, dstate), B=B, C=C,
        D=_per_row(D, nheads, headdim), z=z, dt_bias=_per_row(dt_bias, nheads, headdim),
        dt_softplus=dt_softplus, dt_min=dt_limit[0], dt_max=dt_limit[1], a_per_state=False,
        state_in=state_in, state_index=state_index, seqs=seqs, captures=captures,
        y=y, state_out=state_out, captured=captured, **engine_fields)


def mamba2_scan(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                dt_limit=(0.0, math.inf), initial_states=None, cu_seqlens=None, capture=None,
                backend="auto", algorithm="auto", chunk_size=None, start_positions=None) -> ScanResult:
    """Selective scan over a prefill pass (Mamba-2 multi-head layout), with in-pass captures.

    Per head h (group g = h // (nheads // ngroups)) and token t:
        dt' = clamp(softplus(dt + dt_bias) if dt_softplus else dt + dt_bias, *dt_limit)
        state = exp(dt' * A[h]) * state + dt' * x[t] (outer) B[t, g]
        y[t] = state @ C[t, g] + D[h] * x[t];  y[t] *= silu(z[t]) when z is given.

    Args:
        x: (batch, seqlen, nheads, headdim) float32, float16 or bfloat16.
        dt: (batch, seqlen, nheads), float.
        A: (nheads,) float32.
        B, C: (batch, seqlen, ngroups, dstate), float; nheads % ngroups == 0; dstate <= 256.
        D: (nheads,) or (nheads, headdim), float, optional.
        z: like x, optional gate.
        dt_bias: (nheads,), float, optional.
        dt_softplus: apply softplus to dt + dt_bias.
        dt_limit: (min, max) clamp of dt'; the default (0, inf) maps negative dt' to 0.
        initial_states: (nseq, nheads, headdim, dstate) float32, optional (zeros).
        cu_seqlens: (nseq + 1,) int32/int64 tensor, or a list of ints, optional: a varlen batch
            packed along seqlen (batch must be 1; empty sequences allowed). nseq is batch without
            it. A tensor's values are read back (on a GPU, a sync); a list reads nothing back.
        capture: (ncapture, 2) int tensor or a sequence of (sequence index, offset) pairs with
            0 <= offset <= that sequence's length; any order, duplicates allowed.
        backend: "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch".
        algorithm: "auto" (default: recurrent on CPU; on CUDA chunked when the longest sequence
            has at least ssm_kernels.scan.mamba2_chunked.AUTO_CHUNKED_MIN_TOKENS tokens),
            "recurrent" (one token at a time) or "chunked" (matmuls inside chunks; fast on GPU for
            long passes). Pass "recurrent" where passes must agree bit for bit at any split.
        chunk_size: tokens per chunk of the chunked algorithm, a power of two from 16 to 1024
            (default 256). Checked, but not used, by "recurrent".
        start_positions: (nseq,) ints (a sequence or a 1-D int tensor), optional: the absolute
            position of each sequence's first token in this pass (default 0). The chunked
            algorithm puts its chunk boundaries at the multiples of chunk_size of these absolute
            positions; "recurrent" does not need them (its results do not depend on them).

    Returns:
        ScanResult(y: like x in x's dtype, final_states: (nseq, nheads, headdim, dstate) float32,
        captured_states: (ncapture, nheads, headdim, dstate) float32, the state after the first
        `offset` tokens of the named sequence, in the order given).

    What each algorithm is exact at (splits, batching, captures), what "auto" picks, and the
    accuracy: README.md, section "Semantics and exactness".
    """
    nheads, headdim, _, dstate = check_mamba2_args(x, dt, A, B, C, D, z, dt_bias, token_dims=("batch", "seqlen"))
    check_tensor_args({}, dict(initial_states=initial_states))
    check_bool("dt_softplus", dt_softplus)
    dt_limit = check_dt_limit(dt_limit)
    device = check_same_device(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                               initial_states=initial_states)
    seqs = make_sequences(x.shape[0], x.shape[1], cu_seqlens, device)
    state_shape = [("nseq", seqs.count), ("nheads", nheads), ("headdim", headdim), ("dstate", dstate)]
    if initial_states is not None:
        check_tensor("initial_states", initial_states, state_shape, F32)
    prepared = dispatch.prepare_pass(x, seqs, (nheads, headdim, dstate), mamba2_chunked, capture=capture,
                                     backend=backend, algorithm=algorithm, chunk_size=chunk_size,
                                     start_positions=start_positions)
    problem = mamba2_problem(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, initial_states, None,
                             seqs, prepared.captures, prepared.y, prepared.final_states, prepared.captured)
    return dispatch.run_pass(prepared, problem, mamba2_chunked)


STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def selective_state_update(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                           dt_limit=(0.0, math.inf), state_indices=None, dst_state_indices=None,
                           pad_slot_id=None, validate=True, backend="auto") -> torch.Tensor:
    """One decode token for each batch row (Mamba-2 layout), updating a state pool in place.

    Args:
        state: (nslots, nheads, headdim, dstate) float32, bfloat16 or float16: a pool of slots
            (any strides, but no overlapping memory, and not requiring grad). Row b reads slot
            state_indices[b] and writes slot dst_state_indices[b]. The update runs in float32;
            a 16-bit pool is read into float32 and stored rounded.
        x: (batch, nheads, headdim); dt: (batch, nheads); A: (nheads,) float32;
        B, C: (batch, ngroups, dstate); D: (nheads,) or (nheads, headdim); z: like x;
        dt_bias: (nheads,); dt_softplus and dt_limit as in mamba2_scan.
        state_indices: (batch,) int32/int64, the slots read (default 0..batch-1).
        dst_state_indices: (batch,) int32/int64, the slots written (default: state_indices).
        pad_slot_id: an int, or None: a row whose state_indices entry equals it is padding: it
            reads and writes no state and its y is zeros.
        validate: check every argument, index ranges included (the indices are read on the
            host: one device sync on CUDA). False skips all checks and host work, for engines
            that already validated; invalid input is then undefined behaviour.
        backend: as in mamba2_scan.

    Validation refuses destinations that collide (two rows writing one slot), a destination
    that is another row's source, and a state whose slots overlap in memory (an expanded
    view): the rows run in parallel, so any of these would race.

    Returns:
        y: (batch, nheads, headdim) in x's dtype.

    Exactness against a one-token mamba2_scan pass, with a float32 or a 16-bit pool: README.md,
    section "Semantics and exactness".
    """
    if check_bool("validate", validate):
        nheads, headdim, _, dstate = check_mamba2_args(x, dt, A, B, C, D, z, dt_bias, token_dims=("batch",))
        check_tensor_args(dict(state=state), dict(state_indices=state_indices, dst_state_indices=dst_state_indices))
        check_bool("dt_softplus", dt_softplus)
        dt_limit = check_dt_limit(dt_limit)
        check_tensor("state", state, [("nslots", None), ("nheads", nheads), ("headdim", headdim),
                                      ("dstate", dstate)], STATE_DTYPES)
        device = check_same_device(state=state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                                   state_indices=state_indices, dst_state_indices=dst_state_indices)
        check_written(dict(state=state), dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                                              state_indices=state_indices, dst_state_indices=dst_state_indices))
        check_decode_slots(state_indices, dst_state_indices, pad_slot_id, x.shape[0], state.shape[0])
        backend = resolve_backend(backend, device)
    else:
        nheads, headdim = x.shape[-2:]
        dt_limit = tuple(float(v) for v in dt_limit)
        backend = resolve_backend(backend, x.device)
    batch = x.shape[0]
    y = new_output(batch, 1, nheads, headdim, dtype=x.dtype, device=x.device, name="y")
    if pad_slot_id is not None:  # padded rows write nothing: their y stays zero
        y.zero_()
    problem = mamba2_problem(x.unsqueeze(1), dt.unsqueeze(1), A, B.unsqueeze(1), C.unsqueeze(1), D,
                       None if z is None else z.unsqueeze(1), dt_bias, dt_softplus, dt_limit,
                       state, state_indices, Sequences(None, [1] * batch, varlen=False), NO_CAPTURES,
                       y, state, state[:0], state_out_index=dst_state_indices, skip_slot=pad_slot_id)
    dispatch.run_public(problem, backend)
    return y[:, 0]
