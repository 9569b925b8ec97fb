"""Mamba-1 layout (mamba_ssm's selective_scan_fn), plus initial states, varlen and captures."""
from __future__ import annotations

import math

import torch

from .._common import (FLOAT_DTYPES, NO_CAPTURES, ScanResult, Sequences, check_bool, check_same_device, check_tensor,
                       check_tensor_args, make_sequences, new_output, resolve_backend)
from . import dispatch, mamba1_chunked
from .problem import ScanProblem, check_scan_sizes

F32 = (torch.float32,)


def _as_rows(t, ngroups):
    """(batch, dim, seqlen) -> the scan layout (batch, seqlen, ngroups, dim // ngroups), a view."""
    return t.unflatten(1, (ngroups, -1)).permute(0, 3, 1, 2)


def mamba1_scan(u, delta, A, B, C, *, D=None, z=None, delta_bias=None, delta_softplus=False,
                initial_states=None, cu_seqlens=None, capture=None, backend="auto", algorithm="auto",
                chunk_size=None, start_positions=None) -> ScanResult:
    """Selective scan in mamba_ssm's selective_scan_fn layout, with in-pass captures.

    Per channel d (group g = d // (dim // ngroups)) and token t:
        delta' = softplus(delta + delta_bias) if delta_softplus else delta + delta_bias
        state[d] = exp(delta' * A[d]) * state[d] + delta' * u[d, t] * B[g, :, t]
        y[d, t] = state[d] . C[g, :, t] + D[d] * u[d, t];  y *= silu(z[d, t]) when z is given.

    Args:
        u, delta: (batch, dim, seqlen), float32, float16 or bfloat16.
        A: (dim, dstate) float32; dstate <= 256.
        B, C: (batch, dstate, seqlen) or (batch, ngroups, dstate, seqlen), float, the same shape;
            dim % ngroups == 0.
        D, delta_bias: (dim,), float, optional.
        z: (batch, dim, seqlen), optional gate.
        initial_states: (nseq, dim, dstate) float32, optional (zeros).
        cu_seqlens, capture, backend: as in mamba2_scan (sequences packed along seqlen).
        algorithm: "auto" (default: recurrent on CPU; on CUDA chunked when the longest sequence
            has at least ssm_kernels.scan.mamba1_chunked.AUTO_CHUNKED_MIN_TOKENS tokens),
            "recurrent" (one token at a time) or "chunked" (parallel in time). Pass "recurrent"
            where passes must agree bit for bit at any split.
        chunk_size: tokens per chunk of the chunked algorithm, a power of two from 16 to 256
            (default 64). Checked, but not used, by "recurrent".
        start_positions: (nseq,) ints (a sequence or a 1-D int tensor), optional: the absolute
            position of each sequence's first token in this pass (default 0). The chunked
            algorithm puts its chunk boundaries at the multiples of chunk_size of these absolute
            positions; "recurrent" does not need them.

    Returns:
        ScanResult(y: (batch, dim, seqlen) in u's dtype, final_states: (nseq, dim, dstate) float32,
        captured_states: (ncapture, dim, dstate) float32).

    What each algorithm is exact at (splits, batching, captures), what "auto" picks, and the
    accuracy: README.md, section "Semantics and exactness".
    """
    check_tensor_args(dict(u=u, delta=delta, A=A, B=B, C=C),
                      dict(D=D, z=z, delta_bias=delta_bias, initial_states=initial_states))
    check_tensor("u", u, [("batch", None), ("dim", None), ("seqlen", None)], FLOAT_DTYPES)
    batch, dim, seqlen = u.shape
    check_tensor("delta", delta, [("batch", batch), ("dim", dim), ("seqlen", seqlen)], FLOAT_DTYPES)
    check_tensor("A", A, [("dim", dim), ("dstate", None)], F32)
    dstate = A.shape[1]
    if B.ndim == 3:
        b_dims = [("batch", batch), ("dstate", dstate), ("seqlen", seqlen)]
    else:
        b_dims = [("batch", batch), ("ngroups", None), ("dstate", dstate), ("seqlen", seqlen)]
    check_tensor("B", B, b_dims, FLOAT_DTYPES)
    check_tensor("C", C, [(name, B.shape[i]) for i, (name, _) in enumerate(b_dims)], FLOAT_DTYPES)
    ngroups = 1 if B.ndim == 3 else B.shape[1]
    check_scan_sizes("dim", dim, ngroups, dstate)
    for name, t in (("D", D), ("delta_bias", delta_bias)):
        if t is not None:
            check_tensor(name, t, [("dim", dim)], FLOAT_DTYPES)
    if z is not None:
        check_tensor("z", z, [("batch", batch), ("dim", dim), ("seqlen", seqlen)], FLOAT_DTYPES)
    check_bool("delta_softplus", delta_softplus)
    device = check_same_device(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias,
                               initial_states=initial_states)
    seqs = make_sequences(batch, seqlen, cu_seqlens, device)
    if initial_states is not None:
        check_tensor("initial_states", initial_states,
                     [("nseq", seqs.count), ("dim", dim), ("dstate", dstate)], F32)
    prepared = dispatch.prepare_pass(u, seqs, (dim, dstate), mamba1_chunked, capture=capture, backend=backend,
                                     algorithm=algorithm, chunk_size=chunk_size, start_positions=start_positions)
    problem = mamba1_problem(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_states, seqs,
                             prepared.captures, prepared.y, prepared.final_states, prepared.captured)
    return dispatch.run_pass(prepared, problem, mamba1_chunked)


def mamba1_problem(u, delta, A, B, C, D, z, delta_bias, delta_softplus, state_in, seqs, captures, y, state_out,
                   captured) -> ScanProblem:
    """The scan problem of checked mamba1_scan arguments, its outputs y (like u), state_out and
    captured ((n, dim, dstate) float32): views of mamba_ssm's layout in the scan's."""
    ngroups = 1 if B.ndim == 3 else B.shape[1]
    grouped = lambda t: None if t is None else t.unflatten(0, (ngroups, -1))  # (dim, ...) -> (G, P, ...)
    bc_rows = lambda t: (t.unsqueeze(1) if t.ndim == 3 else t).permute(0, 3, 1, 2)  # (batch, seqlen, G, N)
    states = lambda t: None if t is None else t.unflatten(1, (ngroups, -1))
    return ScanProblem(
        x=_as_rows(u, ngroups), dt=_as_rows(delta, ngroups), A=grouped(A), B=bc_rows(B), C=bc_rows(C),
        D=grouped(D), z=None if z is None else _as_rows(z, ngroups), dt_bias=grouped(delta_bias),
        dt_softplus=delta_softplus, dt_min=-math.inf, dt_max=math.inf, a_per_state=True,
        state_in=states(state_in), state_index=None, seqs=seqs, captures=captures,
        y=_as_rows(y, ngroups), state_out=states(state_out), captured=states(captured),
    )


def mamba1_step_unchecked(state, u, delta, A, B, C, *, D=None, z=None, delta_bias=None, delta_softplus=False,
                          backend="auto") -> torch.Tensor:
    """One token per sequence in mamba1_scan's layout (seqlen 1), ``state`` (batch, dim, dstate)
    float32 updated in place; returns y (batch, dim, 1) in u's dtype. Bit for bit a one-token
    recurrent mamba1_scan from ``state``. Nothing is checked: for a caller that checked its
    arguments (Mamba1Mixer.step); invalid input is undefined behaviour."""
    y = new_output(*u.shape, dtype=u.dtype, device=u.device, name="y")
    problem = mamba1_problem(u, delta, A, B, C, D, z, delta_bias, delta_softplus, state,
                             Sequences(None, [1] * u.shape[0], varlen=False), NO_CAPTURES, y, state, state[:0])
    dispatch.run_public(problem, resolve_backend(backend, u.device))
    return y
