"""mamba2_scan, mamba1_scan and selective_state_update against their float64 references."""

import functools

import pytest
import torch

from helpers import (TOLERANCE, assert_rel_close, mamba1_inputs, mamba1_positional, mamba2_inputs,
                     mamba2_positional)
import ssm_kernels
from ssm_kernels import selective_state_update
from ssm_kernels.scan.reference import mamba1_scan_ref, mamba2_scan_ref, selective_state_update_ref

# The recurrent path by name: the scans' default, "auto", takes the chunked path on CUDA for long
# passes (its exactness and tolerances differ: README.md, "Semantics and exactness").
mamba2_scan = functools.partial(ssm_kernels.mamba2_scan, algorithm="recurrent")
mamba1_scan = functools.partial(ssm_kernels.mamba1_scan, algorithm="recurrent")

BACKENDS = ["torch", "triton"]


def edge_captures(lengths):
    """Captures at 0, 1, len-1 and len of every sequence (where they exist), shuffled, one duplicate."""
    pairs = sorted({(s, k) for s, n in enumerate(lengths) for k in (0, 1, n - 1, n) if 0 <= k <= n})
    pairs = [pairs[i] for i in torch.randperm(len(pairs)).tolist()]
    return pairs + pairs[:1]


def check_result(got, want, dtype, what):
    tol = TOLERANCE[dtype]
    assert got.y.dtype == dtype and got.final_states.dtype == torch.float32
    assert_rel_close(got.y, want.y, tol, f"{what} y")
    assert_rel_close(got.final_states, want.final_states, tol, f"{what} final_states")
    if want.captured_states.numel():
        assert_rel_close(got.captured_states, want.captured_states, tol, f"{what} captured_states")
    assert got.captured_states.shape == want.captured_states.shape


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seqlen", [1, 7, 63])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mamba2_all_options(backend, seqlen, dtype, device):
    kw = mamba2_inputs(2, seqlen, dtype=dtype, device=device)
    args, kw = mamba2_positional(kw)
    kw.update(dt_softplus=True, capture=edge_captures([seqlen, seqlen]))
    check_result(mamba2_scan(*args, **kw, backend=backend), mamba2_scan_ref(*args, **kw), dtype, "mamba2")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["plain", "D_per_row", "dt_limit", "one_group", "group_per_head"])
def test_mamba2_variants(backend, variant, device):
    ngroups = {"one_group": 1, "group_per_head": 4}.get(variant, 2)
    kw = mamba2_inputs(2, 9, ngroups=ngroups, D_per_row=variant == "D_per_row", device=device)
    args, kw = mamba2_positional(kw)
    if variant == "plain":
        kw = {}
    if variant == "dt_limit":
        kw.update(dt_limit=(0.05, 0.4))  # no softplus: negative dt clamps to 0.05
    check_result(mamba2_scan(*args, **kw, backend=backend), mamba2_scan_ref(*args, **kw), torch.float32, variant)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mamba2_long_odd_sequence(backend, device):
    args, kw = mamba2_positional(mamba2_inputs(1, 130, nheads=2, headdim=4, ngroups=1, device=device))
    kw.update(dt_softplus=True, capture=edge_captures([130]) + [(0, 64)])
    check_result(mamba2_scan(*args, **kw, backend=backend), mamba2_scan_ref(*args, **kw), torch.float32, "130")


@pytest.mark.parametrize("backend", BACKENDS)
def test_mamba2_varlen_with_empty_and_one_token_sequences(backend, device):
    lengths = [0, 1, 7, 0, 13, 2]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)
    args, kw = mamba2_positional(mamba2_inputs(1, sum(lengths), nseq=len(lengths), device=device))
    kw.update(dt_softplus=True, cu_seqlens=cu, capture=torch.tensor(edge_captures(lengths), device=device))
    check_result(mamba2_scan(*args, **kw, backend=backend), mamba2_scan_ref(*args, **kw), torch.float32, "varlen")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ngroups", [None, 1, 3])
def test_mamba1(backend, dtype, ngroups, device):
    args, kw = mamba1_positional(mamba1_inputs(2, 11, ngroups=ngroups, dtype=dtype, device=device))
    kw.update(delta_softplus=True, capture=edge_captures([11, 11]))
    check_result(mamba1_scan(*args, **kw, backend=backend), mamba1_scan_ref(*args, **kw), dtype, "mamba1")


@pytest.mark.parametrize("backend", BACKENDS)
def test_mamba1_plain_varlen(backend, device):
    lengths = [5, 0, 1, 8]
    cu = torch.tensor([0, 5, 5, 6, 14], device=device)
    args, kw = mamba1_positional(mamba1_inputs(1, 14, nseq=4, device=device))
    kw = dict(cu_seqlens=cu, capture=edge_captures(lengths))
    check_result(mamba1_scan(*args, **kw, backend=backend), mamba1_scan_ref(*args, **kw), torch.float32, "m1 varlen")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)])
def test_selective_state_update(backend, dtype, state_dtype, device):
    kw = mamba2_inputs(3, 1, dtype=dtype, device=device)
    x, dt, B, C, z = (kw[k][:, 0] for k in ("x", "dt", "B", "C", "z"))
    state = torch.randn(5, 4, 8, 16, device=device).to(state_dtype)
    indices = torch.tensor([4, 0, 2], device=device)
    opts = dict(D=kw["D"], z=z, dt_bias=kw["dt_bias"], dt_softplus=True, dt_limit=(0.0, 2.0), state_indices=indices)
    want_state = state.double()
    want_y = selective_state_update_ref(want_state, x, dt, kw["A"], B, C, **opts)
    got_state = state.clone()
    got_y = selective_state_update(got_state, x, dt, kw["A"], B, C, **opts, backend=backend)
    assert got_y.dtype == dtype and got_y.shape == x.shape and got_state.dtype == state_dtype
    tol = max(TOLERANCE[dtype], TOLERANCE[state_dtype])
    assert_rel_close(got_y, want_y, tol, "decode y")
    assert_rel_close(got_state, want_state, tol, "decode state")
    untouched = [1, 3]
    assert torch.equal(got_state[untouched], state[untouched])


def test_triton_matches_torch_path(device):
    """The two backends agree on the same inputs (to rounding: they are different programs)."""
    args, kw = mamba2_positional(mamba2_inputs(2, 17, device=device))
    kw.update(dt_softplus=True, capture=[(1, 3), (0, 17)])
    a = mamba2_scan(*args, **kw, backend="torch")
    b = mamba2_scan(*args, **kw, backend="triton")
    for name, u, v in zip(a._fields, a, b):
        assert_rel_close(v, u, 1e-6, name)


@pytest.mark.parametrize("algorithm, chunk_size, tol", [("recurrent", None, 1e-5), ("chunked", 16, 1e-4)])
def test_softplus_extremes(device, algorithm, chunk_size, tol):
    """Large dt takes the identity branch; very negative dt stays accurate (no log(1 + tiny) loss).
    Token by token, and the state after each: the large-dt tokens' outputs dwarf the others', and
    their decay wipes the earlier tokens out of the final state."""
    args, kw = mamba2_positional(mamba2_inputs(1, 6, nheads=4, headdim=16, ngroups=2, dstate=16, device=device))
    x, dt, A, B, C = args
    dt = torch.tensor([-30.0, -12.0, -3.0, 0.0, 19.0, 40.0], device=device).view(1, 6, 1).expand(1, 6, 4).contiguous()
    after_each = [(0, t) for t in range(1, 7)]
    want = mamba2_scan_ref(x, dt, A, B, C, dt_softplus=True, capture=after_each)
    for backend in BACKENDS:
        got = mamba2_scan(x, dt, A, B, C, dt_softplus=True, backend=backend, algorithm=algorithm,
                          chunk_size=chunk_size, capture=after_each)
        for t in range(6):
            assert_rel_close(got.y[:, t], want.y[:, t], tol, f"{algorithm} {backend} y at token {t}")
            assert_rel_close(got.captured_states[t], want.captured_states[t], tol,
                             f"{algorithm} {backend} state after token {t}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dstate", [1, 2, 3, 5, 32])
def test_small_and_odd_state_sizes(backend, dstate, device):
    """A thread's columns of a row: one, a few, a ragged tile; the dot with C is a chain over them."""
    args, kw = mamba2_positional(mamba2_inputs(2, 7, nheads=2, headdim=4, dstate=dstate, device=device))
    kw.update(dt_softplus=True, capture=edge_captures([7, 7]))
    check_result(mamba2_scan(*args, **kw, backend=backend), mamba2_scan_ref(*args, **kw), torch.float32,
                 f"mamba2 dstate {dstate}")
    args, kw = mamba1_positional(mamba1_inputs(2, 7, dim=6, dstate=dstate, device=device))
    kw.update(capture=edge_captures([7, 7]))
    check_result(mamba1_scan(*args, **kw, backend=backend), mamba1_scan_ref(*args, **kw), torch.float32,
                 f"mamba1 dstate {dstate}")
