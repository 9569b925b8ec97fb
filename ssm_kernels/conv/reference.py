"""Float64 reference of the causal conv: a plain loop over time, the specification."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._common import make_capture_table, make_sequences
from .problem import ConvResult


def causal_conv1d_ref(x, weight, bias=None, *, activation=None, initial_states=None, cu_seqlens=None,
                      capture=None) -> ConvResult:
    """Float64 causal_conv1d: out (batch, dim, seqlen), states (.., dim, width - 1), all float64.

    out[:, t] = act(bias + sum_k weight[:, k] * input[t - (width - 1) + k]), where inputs before
    the sequence come from initial_states (zeros without it).
    """
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    seqs = make_sequences(batch, seqlen, cu_seqlens, x.device)
    entries = make_capture_table(capture, seqs, x.device).entries
    w = weight.to(torch.float64)
    f64 = dict(dtype=torch.float64, device=x.device)  # computed where the inputs are, as the scans' references
    out = torch.zeros(batch, dim, seqlen, **f64)
    finals, captured = [], [None] * len(entries)
    for s, (b, start, length) in enumerate(seqs.spans()):
        init = (torch.zeros(dim, width - 1, **f64) if initial_states is None
                else initial_states[s].to(torch.float64))
        xin = torch.cat([init, x[b, :, start:start + length].to(torch.float64)], dim=1)
        for t in range(length):
            acc = torch.zeros(dim, **f64) if bias is None else bias.to(torch.float64).clone()
            for k in range(width):
                acc = acc + w[:, k] * xin[:, t + k]
            out[b, :, start + t] = F.silu(acc) if activation in ("silu", "swish") else acc
        finals.append(xin[:, length:])
        for seq, k, row in entries:
            if seq == s:
                captured[row] = xin[:, k:k + width - 1]
    empty = torch.zeros(0, dim, width - 1, **f64)
    return ConvResult(out, torch.stack(finals) if finals else empty,
                      torch.stack(captured) if captured else empty)
