"""The PyTorch path of the recurrent scan, for CPU tensors.

Same semantics and the same exactness as the Triton kernel: each token is one call of
`token_step` on tensors whose shapes depend on the model dimensions alone. Vectorising over
time or over the sequences of a batch would be faster, but PyTorch's CPU kernels compute an
element of a transcendental (exp, softplus, silu) differently in a vector body and in its scalar
tail, so the bits would then depend on where the pass starts and what is batched with it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_loop
from .problem import ScanProblem


def discretize_dt(dt, dt_bias, p: ScanProblem):
    """dt' = clamp(softplus(dt + dt_bias) if p.dt_softplus else dt + dt_bias, p.dt_min, p.dt_max),
    in float32 (dt_bias, float32, may be None)."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias
    if p.dt_softplus:
        dt = F.softplus(dt)  # threshold 20, as the kernels
    return dt.clamp(p.dt_min, p.dt_max)


def token_step(state, x, dt, B, C, z, A, D, dt_bias, p: ScanProblem):
    """Advance a (nheads, headdim, dstate) float32 state by one token; return (state, y).

    x, dt, z: (nheads, headdim); B, C: (nheads, dstate), already gathered per head.
    A: (nheads, headdim, dstate), or (nheads, headdim) when one decay per head.
    """
    x = x.float()
    dt = discretize_dt(dt, dt_bias, p)
    dA = torch.exp(dt.unsqueeze(-1) * A) if p.a_per_state else torch.exp(dt * A).unsqueeze(-1)
    state = state * dA + (dt * x).unsqueeze(-1) * B.float().unsqueeze(1)
    y = (state * C.float().unsqueeze(1)).sum(-1)
    if D is not None:
        y = y + D * x
    if z is not None:
        y = y * F.silu(z.float())
    return state, y


def run_torch(p: ScanProblem) -> None:
    """Write p.y, p.state_out and p.captured, one sequence and one token at a time (on CPU
    tensors by the compiled loop of cpu_loop.py where it builds)."""
    nheads, headdim, dstate, ngroups = p.dims
    device = p.x.device
    group_of_head = torch.arange(nheads, device=device) // (nheads // ngroups)
    lib = cpu_loop.library() if device.type == "cpu" else None
    compiled = cpu_loop.CompiledPass(lib, p, group_of_head) if lib is not None else None
    A = p.A.float() if p.a_per_state else p.A[:, :, 0].float()
    D = p.D.float() if p.D is not None else None
    dt_bias = p.dt_bias.float() if p.dt_bias is not None else None
    sources = p.state_index.tolist() if p.state_index is not None else range(p.seqs.count)
    targets = p.state_out_index.tolist() if p.state_out_index is not None else sources
    starts = p.has_initial.tolist() if p.has_initial is not None else [True] * p.seqs.count
    captures, capture_rows = p.captures.entries, p.captures.host_rows()  # sorted by (sequence, offset)
    c = 0
    for s, (b, start, length) in enumerate(p.seqs.spans()):
        first = c
        while c < len(captures) and captures[c][0] == s:
            c += 1
        # (offset, row) of the sequence's captures that are written, by offset
        mine = [(captures[i][1], capture_rows[i]) for i in range(first, c)
                if p.skip_slot is None or capture_rows[i] != p.skip_slot]
        if p.skip_slot is not None and sources[s] == p.skip_slot:  # a skipped row: nothing read or written
            continue
        if p.state_in is not None and starts[s]:
            state = p.state_in[sources[s]].float()
        else:
            state = torch.zeros(nheads, headdim, dstate, dtype=torch.float32, device=device)
        if compiled is not None:
            y, state, captured = compiled.run(b, start, length, state, [k for k, _ in mine])
            p.y[b, start:start + length] = y
            for (_, row), value in zip(mine, captured):
                p.captured[row].copy_(value)
            p.state_out[targets[s]] = state  # rounded to the pool's dtype if it is a 16-bit one
            continue
        m = 0
        for k in range(length + 1):
            while m < len(mine) and mine[m][0] == k:
                p.captured[mine[m][1]].copy_(state)
                m += 1
            if k == length:
                break
            t = start + k
            state, y = token_step(
                state, p.x[b, t], p.dt[b, t], p.B[b, t, group_of_head], p.C[b, t, group_of_head],
                p.z[b, t] if p.z is not None else None, A, D, dt_bias, p)
            p.y[b, t] = y
        p.state_out[targets[s]] = state  # rounded to the pool's dtype if it is a 16-bit one
