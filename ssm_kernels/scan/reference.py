"""Float64 references of the scans: plain loops over time that are their specification.

Same signatures as the public functions (less `backend`); every computation in float64. They
check nothing beyond what their loops need: validation is the public functions' job.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._common import ScanResult


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """RMS of the difference over the RMS of the float64 reference ``expected`` (on the CPU,
    wherever each is): the accuracy measure the tests hold each dtype to."""
    actual, expected = actual.double().cpu(), expected.double().cpu()
    scale = expected.pow(2).mean().sqrt()
    return ((actual - expected).pow(2).mean().sqrt() / scale.clamp_min(1e-300)).item()


def _f64(t):
    return None if t is None else t.to(torch.float64)


def _spans(batch, seqlen, cu_seqlens):
    """(batch row, first token, length) of each sequence."""
    if cu_seqlens is None:
        return [(b, 0, seqlen) for b in range(batch)]
    bounds = [int(v) for v in cu_seqlens]
    return [(0, lo, hi - lo) for lo, hi in zip(bounds, bounds[1:])]


def _pairs(capture):
    if capture is None:
        return []
    if isinstance(capture, torch.Tensor):
        return [tuple(int(v) for v in row) for row in capture.reshape(-1, 2).tolist()]
    return [(int(s), int(k)) for s, k in capture]


def _softplus(v):
    return torch.logaddexp(v, torch.zeros_like(v))


def _scan(spans, pairs, initial_states, zero_state, step):
    """Run `step(state, batch_row, token)` over each sequence; return finals and captures."""
    finals, captured = [], [None] * len(pairs)
    for s, (b, start, length) in enumerate(spans):
        state = zero_state() if initial_states is None else initial_states[s].to(torch.float64).clone()
        for k in range(length + 1):
            for i, pair in enumerate(pairs):
                if pair == (s, k):
                    captured[i] = state.clone()
            if k < length:
                state = step(state, b, start + k)
        finals.append(state)
    stack = lambda states, like: torch.stack(states) if states else like.new_zeros(0, *like.shape)
    like = zero_state()
    return stack(finals, like), stack(captured, like)


def mamba2_scan_ref(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                    dt_limit=(0.0, math.inf), initial_states=None, cu_seqlens=None, capture=None) -> ScanResult:
    """Float64 mamba2_scan: y (batch, seqlen, nheads, headdim), states (.., nheads, headdim, dstate)."""
    x, dt, A, B, C, D, z, dt_bias = map(_f64, (x, dt, A, B, C, D, z, dt_bias))
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2:]
    group = torch.arange(nheads) // (nheads // ngroups)
    y = torch.zeros_like(x)

    def step(state, b, t):
        d = dt[b, t] + (dt_bias if dt_bias is not None else 0.0)  # (nheads,)
        if dt_softplus:
            d = _softplus(d)
        d = d.clamp(*dt_limit)
        Bt, Ct = B[b, t, group], C[b, t, group]  # (nheads, dstate)
        state = (torch.exp(d * A)[:, None, None] * state
                 + (d[:, None] * x[b, t])[:, :, None] * Bt[:, None, :])
        out = (state * Ct[:, None, :]).sum(-1)
        if D is not None:
            out = out + (D[:, None] if D.ndim == 1 else D) * x[b, t]
        if z is not None:
            out = out * F.silu(z[b, t])
        y[b, t] = out
        return state

    finals, captured = _scan(_spans(batch, seqlen, cu_seqlens), _pairs(capture), initial_states,
                             lambda: x.new_zeros(nheads, headdim, dstate), step)
    return ScanResult(y, finals, captured)


def mamba1_scan_ref(u, delta, A, B, C, *, D=None, z=None, delta_bias=None, delta_softplus=False,
                    initial_states=None, cu_seqlens=None, capture=None) -> ScanResult:
    """Float64 mamba1_scan: y (batch, dim, seqlen), states (.., dim, dstate)."""
    u, delta, A, B, C, D, z, delta_bias = map(_f64, (u, delta, A, B, C, D, z, delta_bias))
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    if B.ndim == 3:
        B, C = B.unsqueeze(1), C.unsqueeze(1)
    group = torch.arange(dim, device=u.device) // (dim // B.shape[1])
    y = torch.zeros_like(u)

    def step(state, b, t):
        d = delta[b, :, t] + (delta_bias if delta_bias is not None else 0.0)  # (dim,)
        if delta_softplus:
            d = _softplus(d)
        Bt, Ct = B[b, group, :, t], C[b, group, :, t]  # (dim, dstate)
        state = torch.exp(d[:, None] * A) * state + (d * u[b, :, t])[:, None] * Bt
        out = (state * Ct).sum(-1)
        if D is not None:
            out = out + D * u[b, :, t]
        if z is not None:
            out = out * F.silu(z[b, :, t])
        y[b, :, t] = out
        return state

    finals, captured = _scan(_spans(batch, seqlen, cu_seqlens), _pairs(capture), initial_states,
                             lambda: u.new_zeros(dim, dstate), step)
    return ScanResult(y, finals, captured)


def selective_state_update_ref(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                               dt_limit=(0.0, math.inf), state_indices=None) -> torch.Tensor:
    """Float64 selective_state_update: updates `state` in place (in its own dtype), returns y
    (batch, nheads, headdim) in float64."""
    slots = range(x.shape[0]) if state_indices is None else [int(i) for i in state_indices]
    ys = []
    for b, slot in enumerate(slots):
        one = lambda t: None if t is None else t[b:b + 1].unsqueeze(1)  # a one-token sequence
        result = mamba2_scan_ref(one(x), one(dt), A, one(B), one(C), D=D, z=one(z), dt_bias=dt_bias,
                                 dt_softplus=dt_softplus, dt_limit=dt_limit,
                                 initial_states=state[slot:slot + 1])
        state[slot] = result.final_states[0].to(state.dtype)
        ys.append(result.y[0, 0])
    return torch.stack(ys) if ys else torch.zeros(x.shape, dtype=torch.float64, device=x.device)
