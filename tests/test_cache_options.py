"""The kernels' options for an engine's cache (ScanProblem / ConvProblem fields): states read and
written by slot in the cache's dtype, per-row initial-state flags, a skip slot for padding rows
and declined captures. Each live row gives the bits of the public op on its own row."""
import math

import pytest
import torch

from helpers import mamba2_inputs, mamba2_positional
from ssm_kernels import _common, causal_conv1d, mamba2_scan
from ssm_kernels.conv.problem import ConvProblem
from ssm_kernels.conv.torch_kernel import run_torch as run_conv_torch
from ssm_kernels.conv.triton_kernel import run_triton as run_conv_triton
from ssm_kernels.scan import dispatch
from ssm_kernels.scan.mamba2 import mamba2_problem

BACKENDS = ["torch", "triton"]
LENGTHS = [5, 0, 7, 3]  # row 2 is padding (skipped)
SLOTS = [2, 0, 9, 3]  # 9 is the skip slot
STARTS = [True, False, True, True]  # row 1 starts from zeros although its slot holds a state
SKIP = 9


def _rows(t, cu, s):
    return t[:, int(cu[s]):int(cu[s + 1])]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_scan_by_slot(backend, cache_dtype, device):
    args, kw = mamba2_positional(mamba2_inputs(1, sum(LENGTHS), nseq=4, device=device))
    x, dt, A, B, C = args
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), device=device)
    seqs = _common.make_sequences(1, x.shape[1], cu, device)
    # Captures go to slots of the same cache; row 3's capture is declined (the skip slot).
    captures = _common.make_capture_table([(0, 2), (3, 1)], seqs, device)
    cache = torch.randn(10, 4, 8, 16, device=device).to(cache_dtype)
    before = cache.clone()
    cap_rows = torch.tensor([6, SKIP])
    captures = _common.CaptureTable(captures.ptr, captures.offset, cap_rows[captures.row.cpu()].to(device),
                                    [(s, k, int(cap_rows[r])) for s, k, r in captures.entries])
    y = torch.full_like(x, math.nan)
    p = mamba2_problem(x, dt, A, B, C, kw["D"], kw["z"], kw["dt_bias"], True, (0.0, math.inf), cache,
                 torch.tensor(SLOTS, device=device), seqs, captures, y, cache, cache)
    p.has_initial = torch.tensor(STARTS, device=device)
    p.skip_slot = SKIP
    dispatch.run(p, backend)

    for s in (0, 1, 3):
        init = cache.new_zeros(1, 4, 8, 16).float() if not STARTS[s] else before[SLOTS[s]:SLOTS[s] + 1].float()
        one = mamba2_scan(_rows(x, cu, s), _rows(dt, cu, s), A, _rows(B, cu, s), _rows(C, cu, s), D=kw["D"],
                          z=_rows(kw["z"], cu, s), dt_bias=kw["dt_bias"], dt_softplus=True, initial_states=init,
                          capture=[(0, 2)] if s == 0 else None, backend=backend)
        assert torch.equal(_rows(y, cu, s), one.y)
        assert torch.equal(cache[SLOTS[s]], one.final_states[0].to(cache_dtype))
        if s == 0:
            assert torch.equal(cache[6], one.captured_states[0].to(cache_dtype))
    assert torch.isnan(_rows(y, cu, 2)).all(), "a skipped row wrote its output"
    untouched = [i for i in range(10) if i not in (2, 0, 3, 6)]
    assert torch.equal(cache[untouched], before[untouched])


@pytest.mark.parametrize("backend", BACKENDS)
def test_conv_in_place_by_slot(backend, device):
    dim, width = 12, 4
    x = torch.randn(1, dim, sum(LENGTHS), device=device)
    weight, bias = torch.randn(dim, width, device=device), torch.randn(dim, device=device)
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), device=device)
    seqs = _common.make_sequences(1, x.shape[2], cu, device)
    cache = torch.randn(10, dim, width - 1, device=device)
    before = cache.clone()
    out = torch.full_like(x, math.nan)
    p = ConvProblem(x=x, weight=weight, bias=bias, silu=True, state_in=cache, seqs=seqs,
                    captures=_common.NO_CAPTURES, out=out, state_out=cache, captured=cache[:0],
                    state_index=torch.tensor(SLOTS, device=device), has_initial=torch.tensor(STARTS, device=device),
                    skip_slot=SKIP)
    (run_conv_triton if backend == "triton" else run_conv_torch)(p)
    rows = lambda t, s: t[..., int(cu[s]):int(cu[s + 1])]
    for s in (0, 1, 3):
        init = before[SLOTS[s]:SLOTS[s] + 1] if STARTS[s] else torch.zeros_like(before[:1])
        one = causal_conv1d(rows(x, s), weight, bias, activation="silu", initial_states=init, backend=backend)
        assert torch.equal(rows(out, s), one.out)
        assert torch.equal(cache[SLOTS[s]], one.final_states[0])
    assert torch.isnan(rows(out, 2)).all()
    untouched = [i for i in range(10) if i not in (2, 0, 3)]
    assert torch.equal(cache[untouched], before[untouched])
