"""The PyTorch path of the causal conv, for CPU tensors.

Same semantics and exactness as the Triton kernel. The taps are accumulated over the whole
sequence at once (a multiply and an add per tap: correctly rounded, so the same bits in a
vector body or a scalar tail), and so is the cast to x's dtype. PyTorch's CPU kernels compute a
transcendental (silu's exp) differently in a vector body and in its scalar tail, and which
elements land in the tail depends on the shape (and on how threads split the work): so the
activation runs on token rows padded to a whole number of vector steps, in blocks small enough
for one thread, and every element is computed by the vector body, wherever the pass starts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .problem import ConvProblem


# A padded row holds a whole number of a CPU's vector steps (PyTorch's elementwise loops take two
# vectors a step: 32 float32 with AVX-512); an elementwise op over fewer than PyTorch's grain size
# of elements runs on one thread, in one loop.
ROW_MULTIPLE = 64
ONE_THREAD = 32768


def _silu(acc: torch.Tensor) -> torch.Tensor:
    """silu of (dim, length) float32, each element computed by the vector body (the module's doc)."""
    dim, length = acc.shape
    rows = acc.new_zeros(length, -(-dim // ROW_MULTIPLE) * ROW_MULTIPLE)
    rows[:, :dim] = acc.t()
    step = max(1, ONE_THREAD // rows.shape[1])
    for t in range(0, length, step):
        rows[t:t + step] = F.silu(rows[t:t + step])
    return rows[:, :dim].t()


def run_torch(p: ConvProblem) -> None:
    """Write p.out, p.state_out and p.captured, one sequence at a time."""
    dim, width = p.weight.shape
    weight = p.weight.float()
    bias = p.bias.float() if p.bias is not None else None
    captures, capture_rows = p.captures.entries, p.captures.host_rows()  # sorted by (sequence, offset)
    slots = p.state_index.tolist() if p.state_index is not None else range(p.seqs.count)
    starts = p.has_initial.tolist() if p.has_initial is not None else [True] * p.seqs.count
    c = 0
    for s, (b, start, length) in enumerate(p.seqs.spans()):
        slot = slots[s]
        if p.skip_slot is not None and slot == p.skip_slot:  # a skipped row: nothing read or written
            while c < len(captures) and captures[c][0] == s:
                c += 1
            continue
        if p.state_in is not None and starts[s]:
            init = p.state_in[slot].to(p.x.dtype)
        else:
            init = p.x.new_zeros(dim, width - 1)
        xin = torch.cat([init, p.x[b, :, start:start + length]], dim=1)  # (dim, width - 1 + length)
        # The state at offset k is xin[:, k:k + width - 1]: the width - 1 inputs before k. (xin is
        # a new tensor: writing a state in place below cannot change it.)
        p.state_out[slot] = xin[:, length:]
        while c < len(captures) and captures[c][0] == s:
            (_, k, _), row = captures[c], capture_rows[c]
            if p.skip_slot is None or row != p.skip_slot:
                p.captured[row] = xin[:, k:k + width - 1]
            c += 1
        if length == 0:
            continue
        xin = xin.float()
        acc = torch.zeros(dim, length, dtype=torch.float32, device=p.x.device)
        if bias is not None:
            acc = acc + bias[:, None]
        for k in range(width):
            acc = acc + weight[:, k:k + 1] * xin[:, k:k + length]
        p.out[b, :, start:start + length] = (_silu(acc) if p.silu else acc).to(p.out.dtype)
