"""mamba_ssm-compatible entry points (ssm_kernels.adapters.mamba_ssm_compat) against the float64
references, with mamba_ssm's argument conventions."""
import math

import pytest
import torch

from helpers import TOLERANCE, assert_rel_close, mamba1_inputs, mamba2_inputs
from ssm_kernels.adapters.mamba_ssm_compat import (mamba_chunk_scan_combined, selective_scan_fn,
                                                   selective_state_update)
from ssm_kernels.scan.reference import mamba1_scan_ref, mamba2_scan_ref, selective_state_update_ref

TOL = TOLERANCE[torch.float32]
NO_CLAMP = (-math.inf, math.inf)


def to(device, kw):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


# ---------------------------------------------------------------------------------------------
# selective_scan_fn
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["shared", "grouped", "time_invariant_B"])
def test_selective_scan_fn_matches_reference(layout, device):
    kw = to(device, mamba1_inputs(2, 9, dim=12, dstate=8, ngroups=3 if layout == "grouped" else None))
    kw.pop("initial_states")
    if layout == "time_invariant_B":
        kw["B"] = torch.randn(12, 8, device=device)  # (dim, dstate): one row per channel, every token
    out, last = selective_scan_fn(kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"],
                                  kw["delta_bias"], True, True)
    ref_kw = dict(kw)
    if layout == "time_invariant_B":  # the same SSM with per-channel groups
        ref_kw["B"] = kw["B"][None, :, :, None].expand(2, 12, 8, 9)
        ref_kw["C"] = kw["C"][:, None].expand(2, 12, 8, 9)
    ref = mamba1_scan_ref(**ref_kw, delta_softplus=True)
    assert_rel_close(out, ref.y, TOL, "out")
    assert_rel_close(last, ref.final_states, TOL, "last_state")
    assert last.shape == (2, 12, 8) and last.dtype == torch.float32
    alone = selective_scan_fn(kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"])  # mamba_ssm's defaults
    assert isinstance(alone, torch.Tensor)
    assert_rel_close(alone, mamba1_scan_ref(**{**ref_kw, "D": None, "z": None, "delta_bias": None}).y, TOL, "defaults")


def test_selective_scan_fn_rejects_complex_a(device):
    kw = to(device, mamba1_inputs(1, 4, dim=4, dstate=2))
    with pytest.raises(TypeError, match="A is complex"):
        selective_scan_fn(kw["u"], kw["delta"], kw["A"].to(torch.complex64), kw["B"], kw["C"])


# ---------------------------------------------------------------------------------------------
# mamba_chunk_scan_combined
# ---------------------------------------------------------------------------------------------
def test_chunk_scan_dense_matches_reference(device):
    kw = to(device, mamba2_inputs(2, 11))
    out, final = mamba_chunk_scan_combined(kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], 4, D=kw["D"], z=kw["z"],
                                           dt_bias=kw["dt_bias"], initial_states=kw["initial_states"],
                                           dt_softplus=True, return_final_states=True)
    ref = mamba2_scan_ref(**kw, dt_softplus=True)
    assert_rel_close(out, ref.y, TOL, "out")
    assert_rel_close(final, ref.final_states, TOL, "final_states")
    clamped = mamba_chunk_scan_combined(kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], 4, dt_bias=kw["dt_bias"],
                                        dt_softplus=True, dt_limit=(0.3, 0.8))
    assert_rel_close(clamped, mamba2_scan_ref(kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], dt_bias=kw["dt_bias"],
                                              dt_softplus=True, dt_limit=(0.3, 0.8)).y, TOL, "dt_limit")


def test_chunk_scan_default_dt_limit_means_no_clamp(device):
    """mamba_ssm's default (0, inf) does not clamp: a negative dt without softplus stays negative."""
    kw = to(device, mamba2_inputs(1, 7))
    dt = -kw["dt"].abs() * 0.2
    out = mamba_chunk_scan_combined(kw["x"], dt, kw["A"], kw["B"], kw["C"], 8)
    unclamped = mamba2_scan_ref(kw["x"], dt, kw["A"], kw["B"], kw["C"], dt_limit=NO_CLAMP).y
    clamped = mamba2_scan_ref(kw["x"], dt, kw["A"], kw["B"], kw["C"]).y
    assert_rel_close(out, unclamped, TOL, "out")
    assert (out.double() - clamped).abs().max() > 1e-3  # the case matters


def test_chunk_scan_packed_sequences(device):
    """seq_idx + cu_seqlens: sequences restart at their boundaries (empty ones allowed); the
    initial state is the first sequence's; final_states is the row's last state."""
    lengths = [4, 0, 6, 3, 0]
    cu = torch.tensor([0, 4, 4, 10, 13, 13], device=device)
    seq_idx = torch.repeat_interleave(torch.arange(5), torch.tensor(lengths)).unsqueeze(0).to(device, torch.int32)
    kw = to(device, mamba2_inputs(1, 13, nseq=1))
    out, final, varlen = mamba_chunk_scan_combined(
        kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], 4, D=kw["D"], z=kw["z"], dt_bias=kw["dt_bias"],
        initial_states=kw["initial_states"], seq_idx=seq_idx, cu_seqlens=cu, dt_softplus=True,
        return_final_states=True, return_varlen_states=True)
    init = torch.cat([kw["initial_states"], torch.zeros(4, *kw["initial_states"].shape[1:], device=device)])
    ref = mamba2_scan_ref(**{**kw, "initial_states": init}, dt_softplus=True, cu_seqlens=cu)
    assert_rel_close(out, ref.y, TOL, "out")
    assert_rel_close(varlen, ref.final_states, TOL, "varlen_states")
    assert_rel_close(final, ref.final_states[3:4], TOL, "final_states (last non-empty sequence)")
    only_varlen = mamba_chunk_scan_combined(kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], 4, seq_idx=seq_idx,
                                            cu_seqlens=cu, return_varlen_states=True)
    assert isinstance(only_varlen, tuple) and len(only_varlen) == 2


def test_chunk_scan_varlen_states_without_seq_idx(device):
    """cu_seqlens without seq_idx only marks where varlen states are read (mamba_ssm's meaning):
    the scan itself runs across the boundaries."""
    cu = torch.tensor([0, 3, 8, 11], device=device)
    kw = to(device, mamba2_inputs(1, 11, nseq=1))
    out, varlen = mamba_chunk_scan_combined(kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], 4, cu_seqlens=cu,
                                            dt_softplus=True, return_varlen_states=True)
    ref = mamba2_scan_ref(kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], dt_softplus=True, dt_limit=NO_CLAMP,
                          capture=[(0, 3), (0, 8), (0, 11)])
    assert_rel_close(out, ref.y, TOL, "out")
    assert_rel_close(varlen, ref.captured_states, TOL, "varlen_states")


@pytest.mark.parametrize("changes, error, message", [
    (dict(seq_idx=torch.zeros(1, 6, dtype=torch.int32)), ValueError, "seq_idx without cu_seqlens"),
    (dict(return_varlen_states=True), ValueError, "needs cu_seqlens"),
    (dict(seq_idx=torch.tensor([[0, 0, 1, 1, 1, 1]]), cu_seqlens=torch.tensor([0, 3, 6])), ValueError,
     "seq_idx disagrees with cu_seqlens at token 2"),
    (dict(chunk_size=0), ValueError, "chunk_size must be positive"),
    (dict(A=-torch.rand(4).to(torch.complex64)), TypeError, "A is complex"),
])
def test_chunk_scan_rejects_what_it_cannot_honour(changes, error, message):
    kw = mamba2_inputs(1, 6)
    args = dict(x=kw["x"], dt=kw["dt"], A=kw["A"], B=kw["B"], C=kw["C"], chunk_size=4)
    args.update(changes)
    with pytest.raises(error, match=message):
        mamba_chunk_scan_combined(**args)


# ---------------------------------------------------------------------------------------------
# selective_state_update
# ---------------------------------------------------------------------------------------------
def test_state_update_mamba2_layout(device):
    """mamba_ssm's Mamba-2 call: A, dt, dt_bias, D broadcast along headdim (tie_hdim)."""
    batch, nheads, headdim, dstate, ngroups = 3, 4, 8, 16, 2
    kw = to(device, mamba2_inputs(batch, 1, nheads, headdim, ngroups, dstate))
    x, dt, B, C, z = kw["x"][:, 0], kw["dt"][:, 0], kw["B"][:, 0], kw["C"][:, 0], kw["z"][:, 0]
    state = torch.randn(5, nheads, headdim, dstate, device=device)
    slots = torch.tensor([4, 0, 2], device=device)
    expected_state = state.clone()
    ref = selective_state_update_ref(expected_state, x, dt, kw["A"], B, C, D=kw["D"], z=z, dt_bias=kw["dt_bias"],
                                     dt_softplus=True, dt_limit=NO_CLAMP, state_indices=slots)
    y = selective_state_update(state, x, dt[..., None].expand(-1, -1, headdim),
                               kw["A"][:, None, None].expand(-1, headdim, dstate), B, C,
                               D=kw["D"][:, None].expand(-1, headdim), z=z,
                               dt_bias=kw["dt_bias"][:, None].expand(-1, headdim), dt_softplus=True,
                               state_batch_indices=slots)
    assert_rel_close(y, ref, TOL, "out")
    assert_rel_close(state, expected_state, TOL, "state")


@pytest.mark.parametrize("heads", [False, True])
def test_state_update_mamba1_layout(heads, device):
    """A per (channel, state) is not a Mamba-2 step: it runs as a one-token Mamba-1 scan."""
    batch, dim, dstate = 2, 12, 8
    kw = to(device, mamba1_inputs(batch, 1, dim=dim, dstate=dstate))
    state = torch.randn(batch, dim, dstate, device=device)
    ref = mamba1_scan_ref(kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], D=kw["D"], z=kw["z"],
                          delta_bias=kw["delta_bias"], delta_softplus=True, initial_states=state)
    args = [kw["u"][..., 0], kw["delta"][..., 0], kw["A"], kw["B"][..., 0], kw["C"][..., 0]]
    opts = dict(D=kw["D"], z=kw["z"][..., 0], dt_bias=kw["delta_bias"], dt_softplus=True)
    if heads:  # the same thing with an explicit head axis of 3 heads of 4 channels
        state = state.view(batch, 3, 4, dstate)
        args = [args[0].view(batch, 3, 4), args[1].view(batch, 3, 4), args[2].view(3, 4, dstate),
                args[3][:, None], args[4][:, None]]
        opts = dict(D=kw["D"].view(3, 4), z=opts["z"].view(batch, 3, 4), dt_bias=kw["delta_bias"].view(3, 4),
                    dt_softplus=True)
    y = selective_state_update(state, *args, **opts)
    assert_rel_close(y.reshape(batch, dim), ref.y[..., 0], TOL, "out")
    assert_rel_close(state.reshape(batch, dim, dstate), ref.final_states, TOL, "state")


def test_state_update_half_state_and_rejections(device):
    batch, nheads, headdim, dstate = 2, 4, 8, 16
    kw = to(device, mamba2_inputs(batch, 1, nheads, headdim, 1, dstate))
    x, dt, B, C = kw["x"][:, 0], kw["dt"][:, 0], kw["B"][:, 0], kw["C"][:, 0]
    A3 = kw["A"][:, None, None].expand(-1, headdim, dstate)
    dt3 = dt[..., None].expand(-1, -1, headdim)
    state = torch.randn(batch, nheads, headdim, dstate, device=device).to(torch.bfloat16)
    expected = state.float()
    ref = selective_state_update_ref(expected, x, dt, kw["A"], B, C, dt_softplus=True, dt_limit=NO_CLAMP)
    y = selective_state_update(state, x, dt3, A3, B, C, dt_softplus=True)
    assert_rel_close(y, ref, TOL, "out (bfloat16 state)")
    assert_rel_close(state, expected, TOLERANCE[torch.bfloat16], "bfloat16 state")

    before = state.clone()
    with pytest.raises(ValueError, match="distinct"):
        selective_state_update(state, x, dt3, A3, B, C, state_batch_indices=torch.tensor([1, 1], device=device))
    with pytest.raises(ValueError, match="dt must have shape"):
        selective_state_update(state, x, dt3[:, :, :3], A3, B, C)
    assert torch.equal(state, before)
