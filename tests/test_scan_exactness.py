"""The property the prefix cache rests on: on the recurrent path, results are bit-identical
(torch.equal) however a sequence is split into passes, batched, or captured."""
import functools

import pytest
import torch

from helpers import mamba1_inputs, mamba1_positional, mamba2_inputs, mamba2_positional
import ssm_kernels
from ssm_kernels import selective_state_update
from ssm_kernels.scan import cpu_loop

# The recurrent path by name: the scans' default, "auto", takes the chunked path on CUDA for long
# passes (its exactness and tolerances differ: README.md, "Semantics and exactness").
mamba2_scan = functools.partial(ssm_kernels.mamba2_scan, algorithm="recurrent")
mamba1_scan = functools.partial(ssm_kernels.mamba1_scan, algorithm="recurrent")

BACKENDS = ["torch", "torch-pytorch-loop", "triton"]
SEQLEN = 13


@pytest.fixture
def backend(request, monkeypatch):
    """The backend by name; "torch-pytorch-loop" is the torch backend with the recurrent scan's
    PyTorch token loop (which runs where the compiled CPU loop does not build)."""
    if request.param == "torch-pytorch-loop":
        monkeypatch.setattr(cpu_loop, "library", lambda: None)
        return "torch"
    return request.param


def one_sequence(dtype=torch.float32, device="cpu"):
    args, kw = mamba2_positional(mamba2_inputs(1, SEQLEN, dtype=dtype, device=device))
    kw.update(dt_softplus=True)
    return args, kw


def slice_time(args, kw, lo, hi):
    """The same inputs restricted to tokens [lo, hi) (time is axis 1 of x, dt, B, C, z)."""
    x, dt, A, B, C = args
    kw = dict(kw, z=kw["z"][:, lo:hi])
    return (x[:, lo:hi], dt[:, lo:hi], A, B[:, lo:hi], C[:, lo:hi]), kw


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [0, 1, 6, SEQLEN - 1, SEQLEN])
def test_split_at_any_offset_is_bitwise(backend, dtype, k, device):
    args, kw = one_sequence(dtype, device)
    whole = mamba2_scan(*args, **kw, capture=[(0, k)], backend=backend)
    head_args, head_kw = slice_time(args, kw, 0, k)
    head = mamba2_scan(*head_args, **head_kw, backend=backend)
    tail_args, tail_kw = slice_time(args, kw, k, SEQLEN)
    tail_kw["initial_states"] = whole.captured_states  # restore the in-pass snapshot
    tail = mamba2_scan(*tail_args, **tail_kw, backend=backend)
    assert torch.equal(head.final_states, whole.captured_states)
    assert torch.equal(head.y, whole.y[:, :k])
    assert torch.equal(tail.y, whole.y[:, k:])
    assert torch.equal(tail.final_states, whole.final_states)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_three_passes_equal_one(backend, device):
    args, kw = one_sequence(device=device)
    whole = mamba2_scan(*args, **kw, backend=backend)
    state, ys = kw["initial_states"], []
    for lo, hi in [(0, 4), (4, 5), (5, SEQLEN)]:
        part_args, part_kw = slice_time(args, kw, lo, hi)
        part = mamba2_scan(*part_args, **dict(part_kw, initial_states=state), backend=backend)
        state = part.final_states
        ys.append(part.y)
    assert torch.equal(torch.cat(ys, dim=1), whole.y)
    assert torch.equal(state, whole.final_states)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_batch_neighbours_and_captures_change_nothing(backend, device):
    """A sequence gives the same bits alone, packed among others (empty and 1-token ones
    included), in a dense batch, and with or without any captures."""
    lengths = [3, 0, SEQLEN, 1, 5]
    args, kw = mamba2_positional(mamba2_inputs(1, sum(lengths), nseq=len(lengths), device=device))
    kw.update(dt_softplus=True)
    cu = torch.tensor([0, 3, 3, 16, 17, 22], device=device)
    many = [(2, k) for k in (SEQLEN, 0, 5, 5, 1)] + [(0, 2), (4, 5), (1, 0)]
    packed = mamba2_scan(*args, **kw, cu_seqlens=cu, capture=many, backend=backend)
    bare = mamba2_scan(*args, **kw, cu_seqlens=cu, backend=backend)
    assert torch.equal(packed.y, bare.y) and torch.equal(packed.final_states, bare.final_states)

    alone_args, alone_kw = slice_time(args, kw, 3, 16)
    alone_kw["initial_states"] = kw["initial_states"][2:3]
    alone = mamba2_scan(*alone_args, **alone_kw, backend=backend)
    assert torch.equal(alone.y, packed.y[:, 3:16])
    assert torch.equal(alone.final_states[0], packed.final_states[2])

    # The same sequence as row 1 of a dense batch beside an unrelated row.
    dense_args = [torch.cat([torch.randn_like(a), a]) if a.ndim > 1 else a for a in alone_args]
    dense_kw = dict(alone_kw, z=torch.cat([torch.randn_like(alone_kw["z"]), alone_kw["z"]]),
                    initial_states=torch.cat([torch.randn_like(alone_kw["initial_states"]),
                                              alone_kw["initial_states"]]))
    dense = mamba2_scan(*dense_args, **dense_kw, capture=[(1, 5)], backend=backend)
    assert torch.equal(dense.y[1], alone.y[0]) and torch.equal(dense.final_states[1], alone.final_states[0])
    assert torch.equal(dense.captured_states[0], packed.captured_states[2])


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_duplicate_and_unordered_captures_land_in_their_rows(backend, device):
    args, kw = one_sequence(device=device)
    order = [7, 2, SEQLEN, 7, 0]
    got = mamba2_scan(*args, **kw, capture=[(0, k) for k in order], backend=backend)
    for row, k in enumerate(order):
        single = mamba2_scan(*args, **kw, capture=[(0, k)], backend=backend)
        assert torch.equal(got.captured_states[row], single.captured_states[0])
    assert torch.equal(got.captured_states[2], got.final_states[0])
    assert torch.equal(got.captured_states[4], kw["initial_states"][0])


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_decode_step_equals_one_token_pass(backend, device):
    args, kw = mamba2_positional(mamba2_inputs(3, 1, device=device))
    x, dt, A, B, C = args
    opts = dict(D=kw["D"], z=kw["z"], dt_bias=kw["dt_bias"], dt_softplus=True)
    pool = torch.randn(6, 4, 8, 16, device=device)
    slots = torch.tensor([5, 1, 3], device=device)
    scan = mamba2_scan(*args, **opts, initial_states=pool[slots], backend=backend)
    state = pool.clone()
    y = selective_state_update(state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], **dict(opts, z=opts["z"][:, 0]),
                               state_indices=slots, backend=backend)
    assert torch.equal(y, scan.y[:, 0])
    assert torch.equal(state[slots], scan.final_states)
    assert torch.equal(state[[0, 2, 4]], pool[[0, 2, 4]])


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_decode_continues_a_prefill_bitwise(backend, device):
    """Prefill n tokens, then decode token n: the same bits as prefilling n + 1 tokens."""
    args, kw = one_sequence(device=device)
    whole = mamba2_scan(*args, **kw, backend=backend)
    head_args, head_kw = slice_time(args, kw, 0, SEQLEN - 1)
    state = mamba2_scan(*head_args, **head_kw, backend=backend).final_states.clone()
    x, dt, A, B, C = args
    t = SEQLEN - 1
    y = selective_state_update(state, x[:, t], dt[:, t], A, B[:, t], C[:, t], D=kw["D"], z=kw["z"][:, t],
                               dt_bias=kw["dt_bias"], dt_softplus=True, backend=backend)
    assert torch.equal(y, whole.y[:, t]) and torch.equal(state, whole.final_states)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("k", [0, 4, 11])
def test_mamba1_split_and_varlen_are_bitwise(backend, k, device):
    args, kw = mamba1_positional(mamba1_inputs(1, 11, ngroups=2, device=device))
    kw.update(delta_softplus=True)
    u, delta, A, B, C = args
    whole = mamba1_scan(*args, **kw, capture=[(0, k)], backend=backend)
    tail = mamba1_scan(u[..., k:], delta[..., k:], A, B[..., k:], C[..., k:],
                       **dict(kw, z=kw["z"][..., k:], initial_states=whole.captured_states), backend=backend)
    assert torch.equal(tail.y, whole.y[..., k:]) and torch.equal(tail.final_states, whole.final_states)
    # Packed after a 4-token neighbour.
    pad = lambda t: torch.cat([torch.randn_like(t[..., :4]), t], dim=-1)
    packed = mamba1_scan(pad(u), pad(delta), A, pad(B), pad(C),
                         **dict(kw, z=pad(kw["z"]), initial_states=torch.cat([kw["initial_states"]] * 2)),
                         cu_seqlens=torch.tensor([0, 4, 15], device=device), backend=backend)
    assert torch.equal(packed.y[..., 4:], whole.y) and torch.equal(packed.final_states[1], whole.final_states[0])


@pytest.mark.gpu
def test_model_size_split_is_bitwise_on_gpu():
    """Realistic head sizes (headdim 64, dstate 128, bf16) with the compiled kernel."""
    device = torch.device("cuda")
    args, kw = mamba2_positional(mamba2_inputs(1, 300, nheads=8, headdim=64, ngroups=1, dstate=128,
                                               dtype=torch.bfloat16, device=device))
    kw.update(dt_softplus=True)
    whole = mamba2_scan(*args, **kw, capture=[(0, 257)])
    tail_args, tail_kw = slice_time(args, kw, 257, 300)
    tail = mamba2_scan(*tail_args, **dict(tail_kw, initial_states=whole.captured_states))
    assert torch.equal(tail.y, whole.y[:, 257:]) and torch.equal(tail.final_states, whole.final_states)


def decode_batch(device, batch=5):
    """Decode inputs for `batch` rows and the mamba2_scan options they share."""
    args, kw = mamba2_positional(mamba2_inputs(batch, 1, device=device))
    return args, dict(D=kw["D"], z=kw["z"], dt_bias=kw["dt_bias"], dt_softplus=True)


def one_token_pass(args, opts, states, backend):
    """The one-token mamba2_scan pass that a decode step must reproduce, from float32 states."""
    return mamba2_scan(*args, **opts, initial_states=states, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("validate", [True, False])
def test_decode_into_other_slots_with_padding(backend, validate, device):
    """Rows read state_indices and write dst_state_indices; padded rows touch no state and
    return zeros; the live rows are a one-token pass, bit for bit."""
    args, opts = decode_batch(device)
    x, dt, A, B, C = args
    pool = torch.randn(9, 4, 8, 16, device=device)
    src = torch.tensor([5, -1, 1, 3, -1], device=device)
    dst = torch.tensor([0, 7, 2, 3, 8], device=device)
    live = [0, 2, 3]
    scan = one_token_pass(args, opts, pool[src.clamp_min(0)], backend)
    state = pool.clone()
    y = selective_state_update(state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], **dict(opts, z=opts["z"][:, 0]),
                               state_indices=src, dst_state_indices=dst, pad_slot_id=-1, validate=validate,
                               backend=backend)
    assert torch.equal(y[live], scan.y[live, 0])
    assert torch.equal(y[[1, 4]], torch.zeros_like(y[[1, 4]]))
    assert torch.equal(state[dst[live]], scan.final_states[live])
    untouched = [1, 4, 5, 6, 7, 8]  # read-only sources, a padded row's dst, unused slots
    assert torch.equal(state[untouched], pool[untouched])


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_with_a_16_bit_state_pool(backend, dtype, device):
    """A 16-bit pool: y is the one-token pass's from the stored state in float32, and the
    written state is that pass's final state rounded to the pool's dtype."""
    args, opts = decode_batch(device, batch=3)
    x, dt, A, B, C = args
    pool = torch.randn(4, 4, 8, 16, device=device).to(dtype)
    slots = torch.tensor([3, 0, 2], device=device)
    scan = one_token_pass(args, opts, pool[slots].float(), backend)
    state = pool.clone()
    y = selective_state_update(state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], **dict(opts, z=opts["z"][:, 0]),
                               state_indices=slots, backend=backend)
    assert torch.equal(y, scan.y[:, 0])
    assert torch.equal(state[slots], scan.final_states.to(dtype))
    assert torch.equal(state[1], pool[1])
