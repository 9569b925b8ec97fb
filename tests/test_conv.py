"""Causal conv with conv-state capture: accuracy against float64, bitwise split invariance,
the decode step, and rejected input."""
import pytest
import torch

from helpers import TOLERANCE, assert_rel_close
from ssm_kernels.conv import causal_conv1d, causal_conv1d_ref, causal_conv1d_update

BACKENDS = ["torch", "triton"]
DIM, WIDTH = 12, 4


def conv_inputs(batch, seqlen, dim=DIM, width=WIDTH, *, dtype=torch.float32, nseq=None, device="cpu"):
    nseq = batch if nseq is None else nseq
    return dict(x=torch.randn(batch, dim, seqlen, device=device).to(dtype),
                weight=torch.randn(dim, width, device=device) * 0.5, bias=torch.randn(dim, device=device),
                initial_states=torch.randn(nseq, dim, width - 1, device=device).to(dtype))


def time_slice(kw, lo, hi, **changes):
    return dict(kw, x=kw["x"][..., lo:hi], **changes)


# -------------------------------------------------------------------------------------------
# Accuracy against the float64 reference
# -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_matches_reference(backend, dtype, activation, device):
    kw = conv_inputs(2, 70, dtype=dtype, device=device)
    capture = [(0, 0), (1, 2), (0, 70), (1, 33)]
    got = causal_conv1d(**kw, activation=activation, capture=capture, backend=backend)
    want = causal_conv1d_ref(**kw, activation=activation, capture=capture)
    assert got.out.dtype == dtype and got.final_states.dtype == dtype
    assert_rel_close(got.out, want.out, TOLERANCE[dtype], "out")
    # States are inputs: copied exactly.
    assert torch.equal(got.final_states.double(), want.final_states)
    assert torch.equal(got.captured_states.double(), want.captured_states)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seqlen", [1, 7, 63, 130])
def test_odd_lengths_no_bias_no_initial_state(backend, seqlen, device):
    x = torch.randn(1, 5, seqlen, device=device)
    weight = torch.randn(5, 3, device=device)
    got = causal_conv1d(x, weight, capture=[(0, 1), (0, seqlen)], backend=backend)
    want = causal_conv1d_ref(x, weight, capture=[(0, 1), (0, seqlen)])
    assert_rel_close(got.out, want.out, 1e-5, "out")
    assert torch.equal(got.captured_states.double(), want.captured_states)
    assert torch.equal(got.captured_states[1], got.final_states[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_with_empty_and_short_sequences(backend, device):
    lengths = [5, 0, 1, 9, 2]
    cu = torch.tensor([0, 5, 5, 6, 15, 17], dtype=torch.int32, device=device)
    kw = conv_inputs(1, sum(lengths), nseq=len(lengths), device=device)
    capture = [(1, 0), (2, 1), (3, 1), (3, 9), (4, 0), (0, 3)]
    got = causal_conv1d(**kw, activation="silu", cu_seqlens=cu, capture=capture, backend=backend)
    want = causal_conv1d_ref(**kw, activation="silu", cu_seqlens=cu, capture=capture)
    assert_rel_close(got.out, want.out, 1e-5, "out")
    assert torch.equal(got.final_states.double(), want.final_states)
    assert torch.equal(got.captured_states.double(), want.captured_states)
    # The empty sequence's final state is its initial state.
    assert torch.equal(got.final_states[1], kw["initial_states"][1])
    # cu_seqlens as host ints: the same bits, nothing read back.
    hosted = causal_conv1d(**kw, activation="silu", cu_seqlens=cu.tolist(), capture=capture, backend=backend)
    assert all(torch.equal(h, g) for h, g in zip(hosted, got))


@pytest.mark.parametrize("backend", BACKENDS)
def test_channel_last_strides_and_other_weight_dtypes(backend, device):
    """x as a transposed (batch, seqlen, dim) tensor (what a projection gives), float64 weight
    and bfloat16 bias."""
    x = torch.randn(2, 11, DIM, device=device).transpose(1, 2)
    weight = torch.randn(DIM, WIDTH, dtype=torch.float64, device=device)
    bias = torch.randn(DIM, device=device).bfloat16()
    got = causal_conv1d(x, weight, bias, activation="silu", backend=backend)
    assert_rel_close(got.out, causal_conv1d_ref(x, weight, bias, activation="silu").out, 1e-5, "out")
    assert torch.equal(got.out, causal_conv1d(x.contiguous(), weight, bias, activation="silu", backend=backend).out)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width", [1, 2])
def test_narrow_kernels(backend, width, device):
    kw = conv_inputs(1, 6, width=width, device=device)
    got = causal_conv1d(**kw, capture=[(0, 0), (0, 6)], backend=backend)
    want = causal_conv1d_ref(**kw, capture=[(0, 0), (0, 6)])
    assert_rel_close(got.out, want.out, 1e-5, "out")
    assert got.final_states.shape == (1, DIM, width - 1)
    assert torch.equal(got.captured_states.double(), want.captured_states)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_pass_keeps_the_initial_state(backend, device):
    kw = conv_inputs(2, 0, dtype=torch.bfloat16, device=device)
    got = causal_conv1d(**kw, activation="silu", capture=[(1, 0)], backend=backend)
    assert got.out.shape == (2, DIM, 0)
    assert torch.equal(got.final_states, kw["initial_states"])
    assert torch.equal(got.captured_states[0], kw["initial_states"][1])


# -------------------------------------------------------------------------------------------
# Exactness: splits, neighbours, captures, decode
# -------------------------------------------------------------------------------------------
SEQLEN = 13


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [0, 1, 2, SEQLEN - 1, SEQLEN])
def test_split_at_any_offset_is_bitwise(backend, dtype, k, device):
    """Offsets below width - 1 take part of the captured state from the initial state."""
    kw = conv_inputs(1, SEQLEN, dtype=dtype, device=device)
    whole = causal_conv1d(**kw, activation="silu", capture=[(0, k)], backend=backend)
    head = causal_conv1d(**time_slice(kw, 0, k), activation="silu", backend=backend)
    tail = causal_conv1d(**time_slice(kw, k, SEQLEN, initial_states=whole.captured_states),
                         activation="silu", backend=backend)
    assert torch.equal(head.final_states, whole.captured_states)
    assert torch.equal(head.out, whole.out[..., :k])
    assert torch.equal(tail.out, whole.out[..., k:])
    assert torch.equal(tail.final_states, whole.final_states)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_token_passes_equal_one_pass(backend, device):
    kw = conv_inputs(1, 6, device=device)
    whole = causal_conv1d(**kw, activation="silu", backend=backend)
    state, outs = kw["initial_states"], []
    for t in range(6):
        part = causal_conv1d(**time_slice(kw, t, t + 1, initial_states=state), activation="silu", backend=backend)
        state = part.final_states
        outs.append(part.out)
    assert torch.equal(torch.cat(outs, dim=-1), whole.out)
    assert torch.equal(state, whole.final_states)


@pytest.mark.parametrize("backend", BACKENDS)
def test_neighbours_and_captures_change_nothing(backend, device):
    lengths = [3, 0, SEQLEN, 1, 5]
    cu = torch.tensor([0, 3, 3, 16, 17, 22], device=device)
    kw = conv_inputs(1, sum(lengths), nseq=len(lengths), device=device)
    many = [(2, k) for k in (SEQLEN, 0, 5, 5, 1)] + [(0, 2), (4, 5), (1, 0)]
    packed = causal_conv1d(**kw, activation="silu", cu_seqlens=cu, capture=many, backend=backend)
    bare = causal_conv1d(**kw, activation="silu", cu_seqlens=cu, backend=backend)
    assert torch.equal(packed.out, bare.out) and torch.equal(packed.final_states, bare.final_states)

    alone_kw = time_slice(kw, 3, 16, initial_states=kw["initial_states"][2:3])
    alone = causal_conv1d(**alone_kw, activation="silu", capture=[(0, 5)], backend=backend)
    assert torch.equal(alone.out, packed.out[..., 3:16])
    assert torch.equal(alone.final_states[0], packed.final_states[2])
    assert torch.equal(alone.captured_states[0], packed.captured_states[2])

    # Row 1 of a dense batch beside an unrelated row.
    dense = causal_conv1d(torch.cat([torch.randn_like(alone_kw["x"]), alone_kw["x"]]), kw["weight"], kw["bias"],
                          initial_states=torch.cat([torch.randn_like(alone_kw["initial_states"]),
                                                    alone_kw["initial_states"]]),
                          activation="silu", capture=[(1, 5)], backend=backend)
    assert torch.equal(dense.out[1], alone.out[0]) and torch.equal(dense.final_states[1], alone.final_states[0])
    assert torch.equal(dense.captured_states[0], alone.captured_states[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicate_and_unordered_captures_land_in_their_rows(backend, device):
    kw = conv_inputs(1, SEQLEN, device=device)
    order = [7, 1, SEQLEN, 7, 0]
    got = causal_conv1d(**kw, capture=torch.tensor([[0, k] for k in order]), backend=backend)
    for row, k in enumerate(order):
        single = causal_conv1d(**kw, capture=[(0, k)], backend=backend)
        assert torch.equal(got.captured_states[row], single.captured_states[0])
    assert torch.equal(got.captured_states[2], got.final_states[0])
    assert torch.equal(got.captured_states[4], kw["initial_states"][0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_equals_one_token_pass(backend, dtype, device):
    kw = conv_inputs(3, 1, dtype=dtype, device=device)
    pool = torch.randn(6, DIM, WIDTH - 1, device=device).to(dtype)
    slots = torch.tensor([5, 1, 3], device=device)
    one = causal_conv1d(**dict(kw, initial_states=pool[slots]), activation="silu", backend=backend)
    state = pool.clone()
    out = causal_conv1d_update(kw["x"][..., 0], state, kw["weight"], kw["bias"], "silu", slots, backend=backend)
    assert out.dtype == dtype
    assert torch.equal(out, one.out[..., 0])
    assert torch.equal(state[slots], one.final_states)
    assert torch.equal(state[[0, 2, 4]], pool[[0, 2, 4]])
    unchecked = pool.clone()  # validate=False skips the checks, not the work
    again = causal_conv1d_update(kw["x"][..., 0], unchecked, kw["weight"], kw["bias"], "silu", slots, validate=False,
                                 backend=backend)
    assert torch.equal(again, out) and torch.equal(unchecked, state)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_continues_a_prefill_bitwise(backend, device):
    kw = conv_inputs(1, SEQLEN, device=device)
    whole = causal_conv1d(**kw, activation="silu", backend=backend)
    state = causal_conv1d(**time_slice(kw, 0, SEQLEN - 1), activation="silu", backend=backend).final_states.clone()
    out = causal_conv1d_update(kw["x"][..., -1], state, kw["weight"], kw["bias"], activation="silu", backend=backend)
    assert torch.equal(out, whole.out[..., -1]) and torch.equal(state, whole.final_states)


# -------------------------------------------------------------------------------------------
# Rejected input: an error naming the argument, nothing written
# -------------------------------------------------------------------------------------------
def call(**changes):
    kw = conv_inputs(2, 5)
    kw.update(changes)
    return causal_conv1d(**kw)


CASES = [
    (dict(x=torch.randn(2, DIM)), ValueError, "x must have 3 dimensions"),
    (dict(x=torch.ones(2, DIM, 5, dtype=torch.int64)), TypeError, "x must have dtype"),
    (dict(x=[1.0]), TypeError, "x must be a torch.Tensor"),
    (dict(weight=torch.randn(DIM + 1, WIDTH)), ValueError, r"weight must have shape .*dim is 13, expected 12"),
    (dict(weight=torch.randn(DIM, 1, WIDTH)), ValueError, "weight must have 2 dimensions"),
    (dict(weight=torch.randn(DIM, WIDTH).int()), TypeError, "weight must have dtype"),
    (dict(weight=torch.randn(DIM, 0), initial_states=None), ValueError, "width must be at least 1"),
    (dict(bias=torch.randn(DIM - 1)), ValueError, r"bias must have shape"),
    (dict(activation="relu"), ValueError, "activation must be one of"),
    (dict(activation=True), ValueError, "activation must be one of"),
    (dict(initial_states=torch.randn(3, DIM, WIDTH - 1)), ValueError, r"initial_states .*nseq is 3, expected 2"),
    (dict(initial_states=torch.randn(2, DIM, WIDTH)), ValueError, r"initial_states .*width - 1 is 4, expected 3"),
    (dict(initial_states=torch.randn(2, DIM, WIDTH - 1).bfloat16()), TypeError,
     "initial_states must have x's dtype float32"),
    (dict(bias=torch.randn(DIM, device="meta")), ValueError,
     "bias is on the meta device, which holds shapes but no data"),
    (dict(capture=torch.empty(3, 0, dtype=torch.int64)), ValueError, r"capture must have shape \(ncapture, 2\)"),
    (dict(cu_seqlens=torch.tensor([0, 5, 10])), ValueError, "varlen batch .* must have batch size 1, got 2"),
    (dict(capture=[(0, 6)]), ValueError, "capture offset 6 for sequence 0 is past its length 5"),
    (dict(capture=[(2, 0)]), ValueError, r"capture\[0\] names sequence 2, but the batch has 2 sequences"),
    (dict(capture=[(0, 1.5)]), TypeError, r"capture\[0\] must be a pair of ints"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
    (dict(weight=torch.randn(DIM, WIDTH, requires_grad=True)), ValueError,
     "weight requires grad, but the kernels are forward only"),
]


@pytest.mark.parametrize("changes, error, message", CASES, ids=[c[2][:40] for c in CASES])
def test_causal_conv1d_rejects(changes, error, message):
    with pytest.raises(error, match=message):
        call(**changes)


UPDATE_CASES = [
    (dict(x=torch.randn(3, DIM, 1)), ValueError, "x must have 2 dimensions"),
    (dict(conv_state=torch.randn(4, DIM, WIDTH)), ValueError, r"conv_state .*width - 1 is 4, expected 3"),
    (dict(conv_state=torch.randn(4, DIM, WIDTH - 1).half()), TypeError, "conv_state must have x's dtype"),
    (dict(state_indices=torch.tensor([0, 1, 4])), ValueError, r"state_indices\[2\] = 4 is out of range"),
    (dict(state_indices=torch.tensor([0, 1, 1])), ValueError, "state_indices must be distinct"),
    (dict(state_indices=torch.tensor([0.0, 1.0, 2.0])), TypeError, "state_indices must have dtype"),
    (dict(state_indices=None, conv_state=torch.randn(2, DIM, WIDTH - 1)), ValueError,
     r"the batch \(3\) must not exceed conv_state's slots \(2\)"),
    (dict(activation="gelu"), ValueError, "activation must be one of"),
    (dict(conv_state=torch.randn(1, DIM, WIDTH - 1).expand(4, DIM, WIDTH - 1)), ValueError,
     r"conv_state has overlapping memory \(shape \(4, 12, 3\), strides \(0, 3, 1\)"),
    (dict(conv_state=torch.randn(4, DIM, WIDTH - 1, requires_grad=True)), ValueError, "conv_state requires grad"),
    (dict(x=torch.randn(3, DIM, requires_grad=True)), ValueError, "x requires grad, but the kernels are forward only"),
]


@pytest.mark.parametrize("changes, error, message", UPDATE_CASES, ids=[c[2][:40] for c in UPDATE_CASES])
def test_causal_conv1d_update_rejects_and_writes_nothing(changes, error, message):
    kw = dict(x=torch.randn(3, DIM), conv_state=torch.randn(4, DIM, WIDTH - 1), weight=torch.randn(DIM, WIDTH),
              bias=None, activation="silu", state_indices=torch.tensor([2, 0, 1]))
    kw.update(changes)
    before = kw["conv_state"].clone()
    with pytest.raises(error, match=message):
        causal_conv1d_update(**kw)
    assert torch.equal(kw["conv_state"], before)


@pytest.mark.parametrize("flag", ["no", "", 0, None])
def test_causal_conv1d_update_validate_must_be_a_bool(flag):
    """validate="no" (truthy) would validate and validate="" would skip every check silently."""
    state = torch.randn(3, DIM, WIDTH - 1)
    before = state.clone()
    with pytest.raises(TypeError, match=r"validate must be a bool \(True or False\)"):
        causal_conv1d_update(torch.randn(3, DIM), state, torch.randn(DIM, WIDTH), validate=flag)
    assert torch.equal(state, before)


def test_triton_backend_needs_cuda_or_the_interpreter(monkeypatch):
    import ssm_kernels._triton
    monkeypatch.setattr(ssm_kernels._triton, "RUNS_ON_CPU", False)
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        call(backend="triton")


def test_every_tensor_argument_is_type_checked():
    kw = conv_inputs(2, 5)
    update = dict(x=torch.randn(3, DIM), conv_state=torch.randn(4, DIM, WIDTH - 1), weight=torch.randn(DIM, WIDTH),
                  bias=torch.randn(DIM), state_indices=torch.tensor([2, 0, 1]))
    for fn, named, optional in ((causal_conv1d, kw, ("bias", "initial_states")),
                                (causal_conv1d_update, update, ("bias", "state_indices"))):
        for name in named:
            for bad in ([1.0],) if name in optional else ([1.0], None):
                with pytest.raises(TypeError, match=rf"^{name} must be a torch.Tensor"):
                    fn(**{**named, name: bad})


def test_update_refuses_a_conv_state_over_its_input():
    """x read from the pool it shifts in place: the update would change x under the kernel."""
    conv_state = torch.randn(4, DIM, WIDTH - 1)
    before = conv_state.clone()
    with pytest.raises(ValueError, match="conv_state must not overlap x in memory"):
        causal_conv1d_update(conv_state[:3, :, 0], conv_state, torch.randn(DIM, WIDTH))
    assert torch.equal(conv_state, before)


def test_outputs_beyond_the_device_memory_are_refused_by_name():
    x = torch.randn(1, 1, 1).expand(1, DIM, 2 ** 40)
    with pytest.raises(ValueError, match=r"out of shape \(1, 12, 1099511627776\) \(float32\) would need \d+ bytes"):
        causal_conv1d(x, torch.randn(DIM, WIDTH), backend="torch")
