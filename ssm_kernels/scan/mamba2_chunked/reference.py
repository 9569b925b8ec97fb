"""Float64 references of the chunked scan's five stages (as mamba_ssm has chunk_state_ref and
state_passing_ref): what each stage of triton_kernel.py computes, stated plainly, so that a wrong
stage fails its own test (tests/test_chunked_stages.py).

Written from the definitions, not from the kernels: natural-log decays (the kernels keep base-2
ones), each decay exp(cs_i - cs_j) taken whole (the output kernel factors it through a token
before the row block), every product in float64. Inputs are mamba2_scan's tensors (x (batch,
seqlen, nheads, headdim), dt (batch, seqlen, nheads), A (nheads,), B and C (batch, seqlen, ngroups,
dstate), any float dtype) and the pass's ChunkTables; head h reads group h // (nheads // ngroups).
Outputs are float64, laid out as the kernels' scratch (triton_kernel.Workspace): per chunk, `chunk`
entries a row, zero past the chunk's end unless said. Composed in order (chunked_scan_ref) they
are the scan itself (scan.reference.mamba2_scan_ref), to float64 rounding.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..._common import ScanResult
from .tables import ChunkTables


def _group_of_heads(nheads: int, ngroups: int, device) -> torch.Tensor:
    return torch.arange(nheads, device=device) // (nheads // ngroups)


def _stack(states: list, like: torch.Tensor) -> torch.Tensor:
    """States (nheads, headdim, dstate) stacked, or none of them shaped like `like`'s rows."""
    return torch.stack(states) if states else like.new_zeros(0, *like.shape[1:])


def dt_cumsum_ref(dt, A, tables: ChunkTables, *, dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf)):
    """Stage 1, per chunk and head: (dt', cs, decay).

    dt' (nchunks, nheads, chunk) = clamp(softplus(dt + dt_bias) if dt_softplus else dt + dt_bias,
    *dt_limit), 0 past the chunk's end; cs (nchunks, nheads, chunk): cs_i = sum over the chunk's
    tokens j <= i of dt'_j A, the chunk's total past its end; decay (nchunks, nheads) = exp(total).
    """
    nheads, L = A.shape[0], tables.chunk_size
    dtp = torch.zeros(tables.nchunks, nheads, L, dtype=torch.float64, device=dt.device)
    for c, (b, t0, n) in enumerate(tables.chunk_list):
        d = dt[b, t0:t0 + n].double()  # (n, nheads)
        if dt_bias is not None:
            d = d + dt_bias.double()
        if dt_softplus:
            d = torch.logaddexp(d, torch.zeros_like(d))
        dtp[c, :, :n] = d.clamp(*dt_limit).T
    cs = torch.cumsum(dtp * A.double()[:, None], dim=2)
    return dtp, cs, torch.exp(cs[:, :, -1])


def chunk_cb_ref(B, C, tables: ChunkTables):
    """Stage 2, per chunk and group: (nchunks, ngroups, chunk, chunk), entry (i, j) = C_i . B_j
    over dstate for the chunk's tokens i and j (all of them, not only the causal i >= j)."""
    L = tables.chunk_size
    cb = torch.zeros(tables.nchunks, B.shape[2], L, L, dtype=torch.float64, device=B.device)
    for c, (b, t0, n) in enumerate(tables.chunk_list):
        cb[c, :, :n, :n] = torch.einsum("ign,jgn->gij", C[b, t0:t0 + n].double(), B[b, t0:t0 + n].double())
    return cb


def chunk_state_ref(x, B, dt, cs, tables: ChunkTables):
    """Stage 3, from stage 1's dt' and cs: (states, partial).

    states (nchunks, nheads, headdim, dstate): each chunk's own contribution to its end state (the
    state its tokens leave from a zero state), sum over its tokens j of exp(cs_last - cs_j) dt'_j
    x_j (outer) B_j. partial (ninner, nheads, headdim, dstate): for each inner capture
    (ChunkTables.inner_list) the same sum over the first `offset` tokens of its chunk, decayed to
    token offset - 1.
    """
    group = _group_of_heads(x.shape[2], B.shape[2], x.device)

    def contribution(c, k):  # of chunk c's first k tokens
        b, t0, _ = tables.chunk_list[c]
        w = torch.exp(cs[c, :, k - 1:k] - cs[c, :, :k]) * dt[c, :, :k]  # (nheads, k)
        return torch.einsum("hj,jhp,jhn->hpn", w, x[b, t0:t0 + k].double(), B[b, t0:t0 + k, group].double())

    like = x.new_zeros(0, x.shape[2], x.shape[3], B.shape[3], dtype=torch.float64)
    states = _stack([contribution(c, n) for c, (_, _, n) in enumerate(tables.chunk_list)], like)
    return states, _stack([contribution(c, j) for _, c, j in tables.inner_list], like)


def state_passing_ref(states, decay, cs, partial, tables: ChunkTables, initial_states=None, capture_rows=None):
    """Stage 4: the walk over each sequence's chunks, from stages 1 and 3: (start, final, captured).

    S_0 is the sequence's initial state (zeros if None), S_{c+1} = decay_c S_c + states_c; start
    (nchunks, nheads, headdim, dstate) holds each chunk's S_c, final (nseq, ...) each sequence's
    last S. captured (ncapture, ...) holds each capture (ChunkTables.capture_list), in row
    capture_rows[entry] (default: its entry): at a chunk's start its S_c, at the sequence's end its
    final state, inside a chunk (offset j) exp(cs_{j-1}) S_c + its partial.
    """
    inner = {(c, j): partial[i] for i, (_, c, j) in enumerate(tables.inner_list)}
    by_chunk = {}
    for entry, c, j in tables.capture_list:
        by_chunk.setdefault(c, []).append((entry, j))
    captured = {}
    start, finals = torch.zeros_like(states), []
    for s in range(len(tables.seq_chunk_list) - 1):
        S = initial_states[s].double() if initial_states is not None else states.new_zeros(states.shape[1:])
        chunks = range(tables.seq_chunk_list[s], tables.seq_chunk_list[s + 1])
        for c in chunks:
            start[c] = S
            end = decay[c][:, None, None] * S + states[c]
            for entry, j in by_chunk.get(c, ()):
                n = tables.chunk_list[c].length
                captured[entry] = S if j == 0 else end if j == n else \
                    torch.exp(cs[c, :, j - 1])[:, None, None] * S + inner[c, j]
            S = end
        if not chunks:  # an empty sequence: its row follows the chunks
            row = next(r for r, chunk in enumerate(tables.row_list) if chunk.seq == s)
            for entry, _ in by_chunk.get(row, ()):
                captured[entry] = S
        finals.append(S)
    like = states.new_zeros(0, *states.shape[1:])
    rows = capture_rows if capture_rows is not None else range(len(captured))
    by_row = {row: captured[entry] for entry, row in enumerate(rows)}
    return start, _stack(finals, like), _stack([by_row[row] for row in range(len(by_row))], like)


def chunk_output_ref(x, C, dt, cs, cb, start, tables: ChunkTables, *, D=None, z=None):
    """Stage 5, from stages 1, 2 and 4: y (batch, seqlen, nheads, headdim), zero at tokens in no
    chunk. For token i of a chunk, head h (group g):

        y_i = exp(cs_i) C_i . S + sum over the chunk's tokens j <= i of cb_ij exp(cs_i - cs_j) dt'_j x_j
              (+ D x_i), times silu(z_i),

    S the chunk's start state; D (nheads,) or (nheads, headdim).
    """
    nheads = x.shape[2]
    group = _group_of_heads(nheads, C.shape[2], x.device)
    y = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for c, (b, t0, n) in enumerate(tables.chunk_list):
        tok = slice(t0, t0 + n)
        xc, csc = x[b, tok].double(), cs[c, :, :n]  # (n, nheads, headdim), (nheads, n)
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        decay = torch.exp((csc[:, :, None] - csc[:, None, :]).masked_fill(~causal, -math.inf))  # (nheads, i, j)
        w = cb[c, group, :n, :n] * decay * dt[c, :, None, :n]
        yc = torch.einsum("hij,jhp->ihp", w, xc)
        yc = yc + torch.einsum("ihn,hpn->ihp", C[b, tok, group].double(), start[c]) * torch.exp(csc).T[:, :, None]
        if D is not None:
            yc = yc + D.double().reshape(nheads, -1) * xc
        if z is not None:
            yc = yc * F.silu(z[b, tok].double())
        y[b, tok] = yc
    return y


def chunked_scan_ref(x, dt, A, B, C, tables: ChunkTables, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                     dt_limit=(0.0, math.inf), initial_states=None, capture_rows=None) -> ScanResult:
    """The five stage references in order: the chunked scan of mamba2_scan's arguments on `tables`'s
    chunk grid, in float64 (capture_rows: as state_passing_ref's)."""
    dtp, cs, decay = dt_cumsum_ref(dt, A, tables, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
    cb = chunk_cb_ref(B, C, tables)
    states, partial = chunk_state_ref(x, B, dtp, cs, tables)
    start, final, captured = state_passing_ref(states, decay, cs, partial, tables, initial_states, capture_rows)
    return ScanResult(chunk_output_ref(x, C, dtp, cs, cb, start, tables, D=D, z=z), final, captured)
