"""The chunked Mamba-2 scan in PyTorch: the same algorithm as the Triton kernels, written out.

For CPU users (a faster alternative to the recurrent loop) and as the readable statement of
what the kernels compute. Per sequence, chunk by chunk (the absolute grid of ChunkTables), in
float32 whatever the input dtype:

    cs = cumsum(dt' * A) inside the chunk                                  (L, H)
    y_i = exp(cs_i) C_i S0 + sum_{j <= i} (C_i . B_j) exp(cs_i - cs_j) dt'_j x_j   (+ D x, * silu z)
    state after j tokens = exp(cs_{j-1}) S0 + sum_{i < j} exp(cs_{j-1} - cs_i) dt'_i x_i (outer) B_i

Captures inside a chunk use the last formula from the chunk-start state, apart from y and the
final state; captures at a chunk's start or a sequence's end are copies of the state passed.
Every chunk is computed from fresh float32 copies of its own inputs, with tensor shapes set by its
length alone, so the same chunk from the same start state gives the same bits in any pass.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..problem import ScanProblem
from ..torch_kernel import discretize_dt
from .tables import ChunkTables
from .triton_kernel import ZERO_DECAY_LOG2

ZERO_DECAY_LOG = ZERO_DECAY_LOG2.value * math.log(2)  # in natural-log units


def dt_cumsum(dt, A):
    """Stage 1 of a chunk, after discretize_dt: cs = cumsum(dt' * A) (L, H) from dt' (L, H) and
    A (H,), each token's log decay floored as the Triton kernels floor it. The floor's sum skips
    NaN and the floor is selected, so a NaN dt' stays NaN at its own token and spares the ones
    before it."""
    a = dt * A
    floor = -ZERO_DECAY_LOG - torch.where(a > 0, a, 0.0).sum(0)
    return torch.cumsum(torch.where(a < floor, floor, a), dim=0)


def state_after(S0, cs, dt, x, B, j):
    """The state after the chunk's first j >= 1 tokens, from its start state S0 (H, P, N): with S0
    zero, stage 3 (a chunk's own contribution, or an inner capture's partial one)."""
    w = torch.exp(cs[j - 1] - cs[:j]) * dt[:j]  # (j, H)
    return torch.exp(cs[j - 1])[:, None, None] * S0 + torch.einsum("jh,jhp,jhn->hpn", w, x[:j], B[:j])


def chunk_output(S0, cs, dt, x, B, C, D, z):
    """Stage 5 of a chunk (with its C B^T, stage 2): y (L, H, P) from its start state S0; D (H, P)
    and the gate z (L, H, P) may be None."""
    n = x.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()[:, :, None]
    # The causal mask selects: a product with a zero mask would carry a later token's NaN or inf
    # (or an overflowed decay above the diagonal) back to earlier rows as NaN.
    decay = torch.exp(cs[:, None] - cs[None])  # (i, j, H)
    scores = torch.where(causal, torch.einsum("ihn,jhn->ijh", C, B) * decay * dt[None], 0.0)
    # A non-finite x_j enters the matmul as zero (it would reach every row), and its column is
    # NaN from row j on, as the Triton kernel does it.
    finite = (x - x) == 0  # isfinite, in two cheap ops
    y = torch.einsum("ijh,jhp->ihp", scores, torch.where(finite, x, 0.0))
    columns = finite.reshape(n, -1).t()  # the scan along a contiguous axis: 4x faster on CPU
    y = torch.where(torch.cummin(columns, dim=1).values.t().reshape(finite.shape), y, float("nan"))
    y = y + torch.einsum("ihn,hpn->ihp", C, S0) * torch.exp(cs)[:, :, None]
    if D is not None:
        y = y + D * x
    if z is not None:
        y = y * F.silu(z)
    return y


def run_chunked_torch(p: ScanProblem, tables: ChunkTables) -> None:
    """Write p.y, p.state_out and p.captured, one sequence and one chunk at a time."""
    assert not p.a_per_state and p.state_index is None, "the chunked scan serves mamba2_scan only"
    nheads, headdim, dstate, ngroups = p.dims
    device = p.x.device
    group = torch.arange(nheads, device=device) // (nheads // ngroups)
    A = p.A[:, 0, 0].float()
    D = p.D.float() if p.D is not None else None  # (H, P)
    dt_bias = p.dt_bias[:, 0].float() if p.dt_bias is not None else None  # (H,)
    captures = {}  # row of the tables -> its captures' (entry, offset)
    for entry, r, j in tables.capture_list:
        captures.setdefault(r, []).append((entry, j))
    for r, (b, t0, n, s, index, last) in enumerate(tables.row_list):
        if index == 0:  # the sequence's first row: its initial state
            if p.state_in is not None:
                state = p.state_in[s].float().clone()
            else:
                state = torch.zeros(nheads, headdim, dstate, dtype=torch.float32, device=device)
        start = state
        if n:
            tok = slice(t0, t0 + n)
            x = p.x[b, tok].to(torch.float32, copy=True)  # (L, H, P)
            B, C = p.B[b, tok][:, group].float(), p.C[b, tok][:, group].float()  # (L, H, N), gathered: new tensors
            dt = discretize_dt(p.dt[b, tok, :, 0].to(torch.float32, copy=True), dt_bias, p)  # (L, H)
            cs = dt_cumsum(dt, A)
            z = p.z[b, tok].to(torch.float32, copy=True) if p.z is not None else None
            p.y[b, tok] = chunk_output(start, cs, dt, x, B, C, D, z)
            state = state_after(start, cs, dt, x, B, n)
        for entry, j in captures.get(r, ()):
            p.captured[p.captures.row[entry]] = start if j == 0 else state if j == n else \
                state_after(start, cs, dt, x, B, j)
        if last:
            p.state_out[s] = state
