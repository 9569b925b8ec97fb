"""mamba_ssm-compatible entry points (ssm_kernels.adapters.mamba_ssm_compat) against the float64
references, with mamba_ssm's argument conventions."""
import math

import pytest
import torch

from helpers import TOLERANCE, assert_rel_close, mamba1_inputs, mamba2_inputs, reads_back
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


def test_selective_scan_fn_refuses_inputs_that_require_grad():
    kw = mamba1_inputs(1, 4, dim=4, dstate=2)
    with pytest.raises(ValueError, match="delta requires grad, but the kernels are forward only"):
        selective_scan_fn(kw["u"], kw["delta"].requires_grad_(), kw["A"], kw["B"], kw["C"])


def test_selective_scan_fn_rejects_complex_a(device):
    kw = to(device, mamba1_inputs(1, 4, dim=4, dstate=2))
    with pytest.raises(TypeError, match="A is complex"):
        selective_scan_fn(kw["u"], kw["delta"], kw["A"].to(torch.complex64), kw["B"], kw["C"])


def test_selective_scan_fn_refuses_zero_groups():
    """B with ngroups 0 next to a C of another layout: a ValueError naming B, not a ZeroDivisionError."""
    kw = mamba1_inputs(1, 3, dim=4, dstate=8)
    with pytest.raises(ValueError, match=r"B must have at least one group, got shape \(1, 0, 8, 3\)"):
        selective_scan_fn(kw["u"], kw["delta"], kw["A"], torch.randn(1, 0, 8, 3), kw["C"])
    with pytest.raises(ValueError, match="ngroups must be at least 1, got 0"):
        selective_scan_fn(kw["u"], kw["delta"], kw["A"], torch.randn(1, 0, 8, 3), torch.randn(1, 0, 8, 3))


def test_selective_scan_fn_names_b_and_c_in_the_layout_given():
    """A wrong B or C is reported with the shape the caller passed, checked against u and A,
    before B and C are widened to one layout."""
    kw = mamba1_inputs(2, 5, dim=6, dstate=4, ngroups=2)
    u, delta, A = kw["u"], kw["delta"], kw["A"]
    with pytest.raises(ValueError, match=r"B must have shape \(batch, dstate, seqlen\) = \(2, 4, 5\), got \(2, 4, 6\)"):
        selective_scan_fn(u, delta, A, torch.randn(2, 4, 6), kw["C"])
    with pytest.raises(ValueError, match=r"B must have shape \(dim, dstate\) = \(6, 4\), got \(6, 5\)"):
        selective_scan_fn(u, delta, A, torch.randn(6, 5), torch.randn(2, 4, 5))
    with pytest.raises(ValueError, match=r"A must have shape \(dim, dstate\) = \(6, '\*'\), got \(5, 4\)"):
        selective_scan_fn(u, delta, A[:5], kw["B"], kw["C"])


@pytest.mark.parametrize("name, shape, message", [
    ("z", (2, 8, 2, 3), r"z must have shape \(batch, seqlen, nheads, headdim\) = \(2, 8, 2, 4\), got \(2, 8, 2, 3\)"),
    ("C", (2, 8, 1, 7), r"C must have shape \(batch, seqlen, ngroups, dstate\) = \(2, 8, 1, 8\), got \(2, 8, 1, 7\)"),
    ("initial_states", (2, 2, 4, 7),
     r"initial_states must have shape \(batch, nheads, headdim, dstate\) = \(2, 2, 4, 8\), got \(2, 2, 4, 7\)"),
])
def test_chunk_scan_with_seq_idx_names_tensors_as_given(name, shape, message):
    """With seq_idx the rows are packed into one; a wrong tensor is reported before that, in the
    caller's (batch, seqlen, ...) layout."""
    args = dict(x=torch.randn(2, 8, 2, 4), dt=torch.randn(2, 8, 2), A=-torch.rand(2), B=torch.randn(2, 8, 1, 8),
                C=torch.randn(2, 8, 1, 8), chunk_size=4, seq_idx=torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]] * 2))
    args[name] = torch.randn(shape)
    with pytest.raises(ValueError, match=message):
        mamba_chunk_scan_combined(**args)


def test_every_tensor_argument_is_type_checked():
    """A list where a tensor belongs (or None where one is required): a TypeError naming it."""
    m1, m2 = mamba1_inputs(1, 4, dim=4, dstate=2), mamba2_inputs(1, 6)
    x, dt, A, A3, B, C = _decode_inputs("cpu")
    calls = [
        (selective_scan_fn, dict(u=m1["u"], delta=m1["delta"], A=m1["A"], B=m1["B"], C=m1["C"], D=m1["D"],
                                 z=m1["z"], delta_bias=m1["delta_bias"])),
        (mamba_chunk_scan_combined, dict(x=m2["x"], dt=m2["dt"], A=m2["A"], B=m2["B"], C=m2["C"], chunk_size=4,
                                         D=m2["D"], z=m2["z"], dt_bias=m2["dt_bias"])),
        (selective_state_update, dict(state=torch.zeros(2, *x.shape[1:], 16), x=x, dt=dt[..., None].expand_as(x),
                                      A=A3, B=B, C=C, state_batch_indices=torch.tensor([1, 0]))),
    ]
    for fn, named in calls:
        for name, value in named.items():
            if not isinstance(value, torch.Tensor):
                continue
            optional = name in ("D", "z", "delta_bias", "dt_bias", "state_batch_indices")
            for bad in ([1.0],) if optional else ([1.0], None):
                with pytest.raises(TypeError, match=rf"^{name} must be a torch.Tensor"):
                    fn(**{**named, name: bad})


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


def test_chunk_scan_default_dt_limit_clamps_like_mamba_ssm(device):
    """mamba_ssm's kernel clamps dt' to dt_limit, default (0, inf): a negative dt (no softplus)
    becomes 0. An explicit (-inf, inf) leaves it alone."""
    kw = to(device, mamba2_inputs(1, 7))
    dt = -kw["dt"].abs() * 0.2
    out = mamba_chunk_scan_combined(kw["x"], dt, kw["A"], kw["B"], kw["C"], 8)
    clamped = mamba2_scan_ref(kw["x"], dt, kw["A"], kw["B"], kw["C"], dt_limit=(0.0, math.inf)).y
    unclamped = mamba2_scan_ref(kw["x"], dt, kw["A"], kw["B"], kw["C"], dt_limit=NO_CLAMP).y
    assert_rel_close(out, clamped, TOL, "out")
    assert (clamped - unclamped).abs().max() > 1e-3  # the case matters
    free = mamba_chunk_scan_combined(kw["x"], dt, kw["A"], kw["B"], kw["C"], 8, dt_limit=NO_CLAMP)
    assert_rel_close(free, unclamped, TOL, "dt_limit=(-inf, inf)")


def test_chunk_scan_packed_sequences(device):
    """seq_idx + cu_seqlens: sequences restart at their boundaries (empty ones allowed); the
    initial state is the first sequence's; final_states is the row's last state."""
    lengths = [4, 0, 6, 3, 0]
    cu = torch.tensor([0, 4, 4, 10, 13, 13], device=device)
    seq_idx = torch.repeat_interleave(torch.arange(5), torch.tensor(lengths)).unsqueeze(0).to(device, torch.int32)
    kw = to(device, mamba2_inputs(1, 13, nseq=1))
    with reads_back(cu) as reads:
        out, final, varlen = mamba_chunk_scan_combined(
            kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], 4, D=kw["D"], z=kw["z"], dt_bias=kw["dt_bias"],
            initial_states=kw["initial_states"], seq_idx=seq_idx, cu_seqlens=cu, dt_softplus=True,
            return_final_states=True, return_varlen_states=True)
    assert len(reads) == 1  # checked against seq_idx from its host copy, and the scan given that copy
    init = torch.cat([kw["initial_states"], torch.zeros(4, *kw["initial_states"].shape[1:], device=device)])
    ref = mamba2_scan_ref(**{**kw, "initial_states": init}, dt_softplus=True, cu_seqlens=cu)
    assert_rel_close(out, ref.y, TOL, "out")
    assert_rel_close(varlen, ref.final_states, TOL, "varlen_states")
    assert_rel_close(final, ref.final_states[3:4], TOL, "final_states (last non-empty sequence)")
    only_varlen = mamba_chunk_scan_combined(kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], 4, seq_idx=seq_idx,
                                            cu_seqlens=cu, return_varlen_states=True)
    assert isinstance(only_varlen, tuple) and len(only_varlen) == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunk_scan_returns_mamba_ssm_s_dtypes(dtype, device):
    """16-bit inputs: out in x's dtype, final_states float32, varlen_states in C's dtype (mamba_ssm
    stores its chunk states, and so its varlen states, in C's dtype)."""
    cu = torch.tensor([0, 5, 12], device=device)
    seq_idx = torch.tensor([[0] * 5 + [1] * 7], dtype=torch.int32, device=device)
    kw = to(device, mamba2_inputs(1, 12, nseq=1, dtype=dtype))
    out, final, varlen = mamba_chunk_scan_combined(kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], 8, seq_idx=seq_idx,
                                                   cu_seqlens=cu, return_final_states=True,
                                                   return_varlen_states=True)
    assert (out.dtype, final.dtype, varlen.dtype) == (dtype, torch.float32, dtype)
    assert torch.equal(varlen[1].float(), final[0].to(dtype).float())  # the same state, rounded once
    ref = mamba2_scan_ref(kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], cu_seqlens=cu, dt_limit=(0.0, math.inf))
    assert_rel_close(varlen, ref.final_states, TOLERANCE[dtype], "varlen_states")


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


def test_chunk_scan_seq_idx_without_cu_seqlens(device):
    """mamba_ssm's usual packed call: seq_idx alone, on a batch of two rows. Each run of equal
    labels is a sequence; initial_states[b] is the state before row b's first sequence (label 0);
    final_states is each row's last state."""
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 3, 3], [0, 0, 0, 0, 0, 4, 4, 4, 4]], dtype=torch.int32)
    kw = to(device, mamba2_inputs(2, 9))
    out, final = mamba_chunk_scan_combined(
        kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], 4, D=kw["D"], z=kw["z"], dt_bias=kw["dt_bias"],
        initial_states=kw["initial_states"], seq_idx=seq_idx.to(device), dt_softplus=True, return_final_states=True)
    for row, starts in ((0, [0, 3, 7, 9]), (1, [0, 5, 9])):
        for i, (lo, hi) in enumerate(zip(starts, starts[1:])):
            init = kw["initial_states"][row:row + 1] if i == 0 else torch.zeros_like(kw["initial_states"][:1])
            piece = {k: v[row:row + 1, lo:hi] for k, v in kw.items() if k in ("x", "dt", "B", "C", "z")}
            ref = mamba2_scan_ref(**piece, A=kw["A"], D=kw["D"], dt_bias=kw["dt_bias"], initial_states=init,
                                  dt_softplus=True)
            assert_rel_close(out[row:row + 1, lo:hi], ref.y, TOL, f"row {row} sequence {i}")
        assert_rel_close(final[row:row + 1], ref.final_states, TOL, f"row {row} final state")


def test_chunk_scan_refuses_initial_states_where_cu_seqlens_opens_with_an_empty_sequence():
    """cu_seqlens [0, 0, 6]: the row's tokens are all labelled 1, as without cu_seqlens: refused,
    not served with the initial state on the empty sequence and dropped from the tokens."""
    kw = mamba2_inputs(1, 6)
    with pytest.raises(ValueError, match="row 0 starts with seq_idx 1"):
        mamba_chunk_scan_combined(kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], 4, initial_states=kw["initial_states"],
                                  seq_idx=torch.ones(1, 6, dtype=torch.int32), cu_seqlens=torch.tensor([0, 0, 6]))


@pytest.mark.parametrize("labels", [[1, 1, 1, 2, 2, 2], [-1, -1, 0, 0, 0, 0]])
def test_chunk_scan_refuses_initial_states_for_a_row_without_label_0_first(labels):
    """Where the row's first sequence is not labelled 0, mamba_ssm drops the initial state or
    decays it through the tokens before label 0, by its chunk size: refused, not guessed. The same
    labels without initial states are served, the first run being a sequence like any other."""
    kw = mamba2_inputs(2, 6)
    seq_idx = torch.tensor([[0] * 6, labels])
    args = (kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], 4)
    with pytest.raises(ValueError, match=f"row 1 starts with seq_idx {labels[0]}"):
        mamba_chunk_scan_combined(*args, initial_states=kw["initial_states"], seq_idx=seq_idx)
    out = mamba_chunk_scan_combined(*args, seq_idx=seq_idx)
    lo = labels.index(labels[-1])
    for a, b in ((0, lo), (lo, 6)):
        ref = mamba2_scan_ref(**{k: kw[k][1:, a:b] for k in ("x", "dt", "B", "C")}, A=kw["A"])
        assert_rel_close(out[1:, a:b], ref.y, TOL, f"tokens {a}..{b}")


@pytest.mark.parametrize("changes, error, message", [
    (dict(seq_idx=torch.tensor([[0, 0, 1, 1, 0, 0]])), ValueError,
     r"seq_idx must not decrease along a row.*seq_idx\[0, 4\] = 0 after seq_idx\[0, 3\] = 1"),
    (dict(seq_idx=torch.zeros(1, 6)), TypeError, "seq_idx must be an integer tensor"),
    (dict(return_varlen_states=True), ValueError, "needs cu_seqlens"),
    (dict(seq_idx=torch.tensor([[0, 0, 1, 1, 1, 1]]), cu_seqlens=torch.tensor([0, 3, 6])), ValueError,
     "seq_idx disagrees with cu_seqlens at token 2"),
    (dict(chunk_size=0), ValueError, "chunk_size must be >= 1"),
    (dict(cu_seqlens=torch.tensor([0.0, 2.0, 6.0]), return_varlen_states=True), TypeError,
     "cu_seqlens must have dtype int32, int64"),
    (dict(cu_seqlens=torch.tensor([0, 2, 5]), return_varlen_states=True), ValueError,
     "cu_seqlens must end at seqlen = 6"),
    (dict(A=-torch.rand(4).to(torch.complex64)), TypeError, "A is complex"),
    (dict(dt_softplus="False"), TypeError, r"dt_softplus must be a bool \(True or False\), got 'False'"),
    (dict(return_final_states=1), TypeError, "return_final_states must be a bool"),
    (dict(dt_limit=("0", "1")), TypeError, "dt_limit must be a pair of real numbers"),
    # mamba_ssm's functions have a backward; these record no graph, so a gradient would be lost
    (dict(x=torch.randn(1, 6, 4, 8, requires_grad=True)), ValueError, "x requires grad, but the kernels are forward"),
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


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("heads", [False, True])
def test_state_update_mamba1_layout(heads, backend, device):
    """A per (channel, state) is not a Mamba-2 step: it runs as a one-token Mamba-1 scan, on the
    state in place (Triton too, under the interpreter without a GPU)."""
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
    y = selective_state_update(state, *args, **opts, backend=backend)
    assert_rel_close(y.reshape(batch, dim), ref.y[..., 0], TOL, "out")
    assert_rel_close(state.reshape(batch, dim, dstate), ref.final_states, TOL, "state")


def _decode_inputs(device, batch=2, nheads=4, headdim=8, dstate=16):
    kw = to(device, mamba2_inputs(batch, 1, nheads, headdim, 1, dstate))
    x, dt, B, C = kw["x"][:, 0], kw["dt"][:, 0], kw["B"][:, 0], kw["C"][:, 0]
    A3 = kw["A"][:, None, None].expand(-1, headdim, dstate)  # mamba_ssm's tie_hdim layout: stride 0
    return x, dt, kw["A"], A3, B, C


@pytest.mark.parametrize("tied", [True, False], ids=["mamba2-step", "per-channel"])
def test_state_update_half_state_touches_only_the_batch_slots(tied, device):
    """A bfloat16 pool: the batch's slots go through float32 and are rounded back; the others keep
    every bit, and no op reads or writes the whole pool (no per-step O(nslots) copy) or compares
    values (mamba_ssm's tie_hdim is read from the strides); on the Mamba-2 step and, with A and dt
    materialised, on the per-channel path."""
    from torch.utils._python_dispatch import TorchDispatchMode

    x, dt, A, A3, B, C = _decode_inputs(device)
    dt3 = dt[..., None].expand(-1, -1, x.shape[-1])
    if not tied:
        A3, dt3 = A3.contiguous(), dt3.contiguous()
    state = torch.randn(64, *x.shape[1:], 16, device=device).to(torch.bfloat16)
    slots = torch.tensor([41, 3], device=device)
    before = state.clone()
    expected = state[slots].float()
    ref = selective_state_update_ref(expected, x, dt, A, B, C, dt_softplus=True, dt_limit=NO_CLAMP)

    class Ops(TorchDispatchMode):
        seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.__name__.split(".")[0].endswith("_"):  # in-place ops return their target
                self.seen += [(str(func), t.numel()) for t in (out if isinstance(out, tuple) else (out,))
                              if isinstance(t, torch.Tensor)]
            return out

    with Ops():
        y = selective_state_update(state, x, dt3, A3, B, C, dt_softplus=True, state_batch_indices=slots)
    assert_rel_close(y, ref, TOL, "out (bfloat16 state)")
    assert_rel_close(state[slots], expected, TOLERANCE[torch.bfloat16], "bfloat16 state")
    assert torch.equal(state[slots], expected.to(torch.bfloat16))  # rounded back as mamba_ssm stores it
    others = torch.ones(64, dtype=torch.bool)
    others[slots.cpu()] = False
    assert torch.equal(state[others.to(device)], before[others.to(device)])
    assert not [op for op, _ in Ops.seen if "equal" in op]
    assert max(n for _, n in Ops.seen) < state.numel() // 8, sorted(Ops.seen, key=lambda s: -s[1])[:3]


def test_state_update_layout_is_read_from_strides(device, monkeypatch):
    """Broadcast (stride-0) A and dt run the Mamba-2 step; the same values materialised run the
    per-channel path, as in mamba_ssm; both give the reference's result."""
    import ssm_kernels.adapters.mamba_ssm_compat as compat

    x, dt, A, A3, B, C = _decode_inputs(device)
    dt3 = dt[..., None].expand(-1, -1, x.shape[-1])
    calls = []
    for name in ("_state_update", "_untied_update"):
        real = getattr(compat, name)
        monkeypatch.setattr(compat, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    pool = torch.randn(2, *x.shape[1:], 16, device=device)
    expected = pool.clone()
    ref = selective_state_update_ref(expected, x, dt, A, B, C, dt_softplus=True, dt_limit=NO_CLAMP)
    for A_in, dt_in, path in ((A3, dt3, "_state_update"), (A3.contiguous(), dt3.contiguous(), "_untied_update")):
        state = pool.clone()
        y = selective_state_update(state, x, dt_in, A_in, B, C, dt_softplus=True)
        assert calls[-1] == path
        assert_rel_close(y, ref, TOL, f"out via {path}")
        assert_rel_close(state, expected, TOL, f"state via {path}")


@pytest.mark.parametrize("bad, error, message", [
    (dict(state_batch_indices=torch.tensor([1, 1])), ValueError, "distinct"),
    (dict(dt=lambda dt3: dt3[:, :, :3]), ValueError, "dt must have shape"),
    (dict(dt_softplus="False"), TypeError, "dt_softplus must be a bool"),
    (dict(state=lambda s: s[:1].expand(2, *s.shape[1:])), ValueError, "state has overlapping memory"),
    (dict(state=lambda s: s.requires_grad_()), ValueError, "state requires grad"),
    (dict(B=lambda b: b.clone().requires_grad_()), ValueError, "B requires grad, but the kernels are forward only"),
])
def test_state_update_rejections_write_nothing(bad, error, message, device):
    x, dt, A, A3, B, C = _decode_inputs(device)
    dt3 = dt[..., None].expand(-1, -1, x.shape[-1])
    state = torch.randn(2, *x.shape[1:], 16, device=device)
    before = state.clone()
    args = dict(state=state, x=x, dt=dt3, A=A3, B=B, C=C)
    for name, value in bad.items():
        args[name] = value(args[name]) if callable(value) else (
            value.to(device) if isinstance(value, torch.Tensor) else value)
    with pytest.raises(error, match=message):
        selective_state_update(**args)
    assert torch.equal(state.detach(), before)


def test_state_update_groups_must_divide_heads_on_the_per_channel_path():
    """2 heads with 4 groups: mamba_ssm refuses it, and so does the tied (Mamba-2) path here; the
    per-channel path took it and mapped the groups onto channels."""
    nheads, dim, dstate = 2, 4, 8
    state = torch.zeros(1, nheads, dim, dstate)
    args = (torch.randn(1, nheads, dim), torch.randn(1, nheads, dim), -torch.rand(nheads, dim, dstate),
            torch.randn(1, 4, dstate), torch.randn(1, 4, dstate))
    with pytest.raises(ValueError, match=r"nheads \(2\) must be a multiple of ngroups \(4\)"):
        selective_state_update(state, *args)
    assert not state.any()


def test_state_update_refuses_a_state_over_its_inputs(device):
    x, dt, A, A3, B, C = _decode_inputs(device)
    state = torch.randn(2, *x.shape[1:], 16, device=device)
    before = state.clone()
    with pytest.raises(ValueError, match="state must not overlap x in memory"):
        selective_state_update(state, state[0, :, :, :2].permute(2, 0, 1), dt[..., None].expand_as(x), A3, B, C)
    assert torch.equal(state, before)
