"""The PyTorch version of the Mamba-1 scan parallel in time (same algorithm and chunk grid as
the Triton kernel, float32), for CPU tensors.

Each chunk is computed on tensors of one fixed shape (channels, dstate, chunk) with the tokens
outside the pass as identities, so a chunk's bits do not depend on the pass it falls in
(PyTorch's CPU kernels round a transcendental differently in a vector body and its tail: the
shapes must not depend on the pass). The associative scan is a Hillis-Steele scan over the
chunk's time axis (log2(chunk) steps of elementwise products).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..problem import ScanProblem
from ..torch_kernel import discretize_dt


def _scan(a, b):
    """Inclusive scan of the pairs (a, b) along the last axis under (a1, b1) then (a2, b2) =
    (a1 a2, a2 b1 + b2): with the start state folded into b_0, the second output is h_t."""
    step = 1
    while step < a.shape[-1]:
        a, b = (torch.cat([a[..., :step], a[..., :-step] * a[..., step:]], -1),
                torch.cat([b[..., :step], a[..., step:] * b[..., :-step] + b[..., step:]], -1))
        step *= 2
    return a, b


def run_torch(p: ScanProblem, chunk: int, positions: list[int]) -> None:
    """Write p.y, p.state_out and p.captured, one sequence and one chunk at a time."""
    _, _, ngroups, rows = p.x.shape
    dstate = p.A.shape[2]
    device = p.x.device
    A2 = p.A.float() * (1 / math.log(2))  # exp(dt' A) = exp2(dt' A log2(e)), as the kernel
    D = p.D.float().unsqueeze(-1) if p.D is not None else None
    dt_bias = p.dt_bias.float().unsqueeze(-1) if p.dt_bias is not None else None
    captures, capture_rows = p.captures.entries, p.captures.host_rows()  # sorted by (sequence, offset)
    c = 0
    for s, (b, start, length) in enumerate(p.seqs.spans()):
        h0 = p.state_in[s].float() if p.state_in is not None else torch.zeros(ngroups, rows, dstate, device=device)
        while c < len(captures) and captures[c][:2] == (s, 0):
            p.captured[capture_rows[c]].copy_(h0)
            c += 1
        for lo in range(-(positions[s] % chunk), length, chunk) if length else ():
            offsets = torch.arange(lo, lo + chunk, device=device)
            valid = (offsets >= 0) & (offsets < length)
            tok = start + offsets.clamp(0, max(length - 1, 0))  # padding reads a valid token, then masked
            take = lambda t: t[b, tok].float().permute(1, 2, 0)  # (G, P or N, chunk)
            x, z = take(p.x), (take(p.z) if p.z is not None else None)
            dt = discretize_dt(take(p.dt), dt_bias, p)
            dt = torch.where(valid, dt, 0.0)  # outside the pass: the identity (a = 1, b = 0)
            Bc, Cc = take(p.B).unsqueeze(1), take(p.C).unsqueeze(1)  # (G, 1, N, chunk)
            a = torch.exp2(dt.unsqueeze(2) * A2.unsqueeze(-1))  # (G, P, N, chunk)
            b_ = (dt * x).unsqueeze(2) * Bc
            b_[..., 0] += a[..., 0] * h0  # the start state enters at the chunk's position 0
            _, h = _scan(a, b_)
            y = (h * Cc).sum(2)
            if D is not None:
                y = y + D * x
            if z is not None:
                y = y * F.silu(z)
            keep = valid.nonzero().flatten()
            p.y[b, tok[keep]] = y[..., keep].permute(2, 0, 1).to(p.y.dtype)
            while c < len(captures) and captures[c][0] == s and captures[c][1] <= lo + chunk:
                p.captured[capture_rows[c]].copy_(h[..., captures[c][1] - 1 - lo])
                c += 1
            h0 = h[..., -1]
        p.state_out[s] = h0
