"""The engine ops refuse what they cannot run correctly, before they write anything: racing
decode slots, slots past the cache, too few tokens, out over x in the conv, non-bool flags; and
a declined capture never disturbs the others, whatever placeholder values it holds."""
from __future__ import annotations

import pytest
import torch

from ssm_kernels import causal_conv1d, mamba2_scan
from ssm_kernels import cache_ops

from helpers import reads_back

BACKENDS = ["torch", "triton"]
H, P, N, DIM, WIDTH = 2, 4, 8, 6, 4


@pytest.fixture(autouse=True)
def tensors_on_the_backends_device(request):
    """As in test_cache_ops.py: the Triton backend on CUDA tensors where there is a GPU, through the
    interpreter on CPU tensors elsewhere."""
    backend = request.node.callspec.params.get("backend") if hasattr(request.node, "callspec") else None
    torch.set_default_device("cuda" if backend == "triton" and torch.cuda.is_available() else "cpu")
    yield
    torch.set_default_device(None)  # no default-device mode left behind


def _mamba2(T):
    return torch.randn(T, H, P), torch.randn(T, H), -(torch.rand(H) + 0.5), torch.randn(T, 1, N), torch.randn(T, 1, N)


def _mamba1(T, dim=DIM):
    return (torch.randn(dim, T), torch.randn(dim, T) * 0.5, -(torch.rand(dim, N) + 0.5), torch.randn(N, T),
            torch.randn(N, T))


def test_decode_batch_refuses_a_row_writing_a_slot_another_row_reads():
    """The rows run in parallel: row 0 writing slot 2 while row 1 reads it would race (as
    selective_state_update refuses)."""
    with pytest.raises(ValueError, match=r"dst_state_indices\[0\] = 2 is the slot row 1 reads"):
        cache_ops.decode_batch(torch.tensor([1, 2]), dst_state_indices=torch.tensor([2, 3]), nslots=4)
    with pytest.raises(ValueError, match=r"dst_state_indices\[0\] = 1 is the slot row 1 reads"):
        cache_ops.decode_batch(torch.tensor([0, 1]), dst_state_indices=torch.tensor([1, 0]))
    # A padded row reads nothing, so writing its slot is fine.
    cache_ops.decode_batch(torch.tensor([-1, 2]), dst_state_indices=torch.tensor([0, 3]), nslots=4)


def test_decode_batch_reads_each_index_tensor_back_once():
    """Validating a decode step reads state_indices and dst_state_indices to the host once each (a
    sync on a GPU apiece), the race and range checks included; and still refuses what they refuse."""
    src, dst = torch.tensor([0, -1, 2]), torch.tensor([3, 5, 4])
    with reads_back(src) as src_reads, reads_back(dst) as dst_reads:
        cache_ops.decode_batch(src, dst_state_indices=dst, nslots=5)
    assert (len(src_reads), len(dst_reads)) == (1, 1)
    with pytest.raises(ValueError, match=r"dst_state_indices\[0\] = 5 is out of range"):
        cache_ops.decode_batch(src, dst_state_indices=torch.tensor([5, 0, 4]), nslots=5)
    with pytest.raises(ValueError, match=r"state_indices\[2\] = 5 is out of range"):
        cache_ops.decode_batch(torch.tensor([0, -1, 5]), nslots=5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("declined", [(-1, 0), (0, 5), (0, 99), (1, -5)])
def test_a_declined_capture_with_placeholder_values_leaves_the_others_alone(backend, declined):
    """A capture declined by its slot (skip_slot) may carry any sequence and offset: the valid
    captures of every row are still written, and nothing is read out of bounds."""
    T, nslots = 10, 6
    x, dt, A, B, C = _mamba2(T)
    xc, w = torch.randn(DIM, T), torch.randn(DIM, WIDTH)
    cu = torch.tensor([0, 4, T])
    batch = cache_ops.prefill_batch(cu, torch.tensor([0, 1]), has_initial_state=torch.tensor([False, False]),
                                 capture_seq=torch.tensor([declined[0], 0, 1]),
                                 capture_offset=torch.tensor([declined[1], 2, 3]),
                                 capture_slot=torch.tensor([-1, 3, 4]), nslots=nslots)
    cache, conv_cache = torch.zeros(nslots, H, P, N), torch.zeros(nslots, DIM, WIDTH - 1)
    cache_ops.mamba2_prefill(batch, x, dt, A, B, C, ssm_state=cache, out=torch.empty_like(x), backend=backend)
    cache_ops.conv_prefill(batch, xc, w, conv_state=conv_cache, out=torch.empty_like(xc), backend=backend)
    ref = mamba2_scan(x[None], dt[None], A, B[None], C[None], cu_seqlens=cu, capture=[(0, 2), (1, 3)], backend=backend)
    conv_ref = causal_conv1d(xc[None], w, cu_seqlens=cu, capture=[(0, 2), (1, 3)], backend=backend)
    for i, slot in enumerate((3, 4)):
        assert torch.equal(cache[slot], ref.captured_states[i]), f"ssm capture to slot {slot}"
        assert torch.equal(conv_cache[slot], conv_ref.captured_states[i]), f"conv capture to slot {slot}"
    assert not cache[[2, 5]].any() and not conv_cache[[2, 5]].any()


def test_declined_captures_only_leave_no_capture():
    batch = cache_ops.prefill_batch(torch.tensor([0, 3]), torch.tensor([0]), capture_seq=torch.tensor([-1]),
                                 capture_offset=torch.tensor([50]), capture_slot=torch.tensor([-1]))
    assert batch.captures.count == 0


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bytes: an unwritten torch.empty output may hold NaN, which
    torch.equal never finds equal to itself."""
    as_ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return torch.equal(a.view(as_ints[a.element_size()]), b.view(as_ints[b.element_size()]))


def _refused(match, call, *caches):
    before = [c.clone() for c in caches]
    with pytest.raises(ValueError, match=match):
        call()
    for c, b in zip(caches, before):
        assert _same_bits(c, b), "a refused call wrote the cache"


@pytest.mark.parametrize("validate", [True, False])
def test_prefill_slots_past_the_cache_are_refused(validate):
    """Without nslots the batch cannot know the cache's size: each op checks it, before any write."""
    T = 8
    cu = torch.tensor([0, 3, T])
    x, dt, A, B, C = _mamba2(T)
    u, delta, A1, B1, C1 = _mamba1(T)
    xc, w = torch.randn(DIM, T), torch.randn(DIM, WIDTH)
    cache, cache1, conv_cache = torch.randn(4, H, P, N), torch.randn(4, DIM, N), torch.randn(4, DIM, WIDTH - 1)
    calls = lambda batch: [
        (lambda: cache_ops.mamba2_prefill(batch, x, dt, A, B, C, ssm_state=cache, out=torch.empty_like(x)), cache,
         "ssm_state"),
        (lambda: cache_ops.mamba1_prefill(batch, u, delta, A1, B1, C1, ssm_state=cache1, out=torch.empty_like(u)),
         cache1, "ssm_state"),
        (lambda: cache_ops.conv_prefill(batch, xc, w, conv_state=conv_cache, out=torch.empty_like(xc)), conv_cache,
         "conv_state")]
    batch = cache_ops.prefill_batch(cu, torch.tensor([0, 5]), validate=validate)
    for call, c, name in calls(batch):
        _refused(rf"state_indices\[1\] = 5 is out of range for {name} with 4 slots", call, c)
    batch = cache_ops.prefill_batch(cu, torch.tensor([0, 1]), capture_seq=torch.tensor([1, 0]),
                                 capture_offset=torch.tensor([2, 1]), capture_slot=torch.tensor([-1, 4]),
                                 validate=validate)
    for call, c, name in calls(batch):
        _refused(rf"capture_slot\[1\] = 4 is out of range for {name} with 4 slots", call, c)


def test_decode_slots_past_the_cache_are_refused():
    x, dt, A, B, C = (t[:2] if t.ndim > 1 else t for t in _mamba2(2))
    u, delta, A1, B1, C1 = (t.t() if i != 2 else t for i, t in enumerate(_mamba1(2)))
    xc, w = torch.randn(2, DIM), torch.randn(DIM, WIDTH)
    cache, cache1, conv_cache = torch.randn(4, H, P, N), torch.randn(4, DIM, N), torch.randn(4, DIM, WIDTH - 1)
    batch = cache_ops.decode_batch(torch.tensor([0, 5]))
    _refused(r"state_indices\[1\] = 5 is out of range for conv_state with 4 slots", lambda: cache_ops.conv_decode(
        batch, xc, w, conv_state=conv_cache, out=torch.empty_like(xc)), conv_cache)
    _refused(r"state_indices\[1\] = 5 is out of range for ssm_state with 4 slots", lambda: cache_ops.mamba1_decode(
        batch, u, delta, A1, B1, C1, ssm_state=cache1, out=torch.empty_like(u)), cache1)
    batch = cache_ops.decode_batch(torch.tensor([0, 1]), dst_state_indices=torch.tensor([2, 4]))
    _refused(r"dst_state_indices\[1\] = 4 is out of range for ssm_state with 4 slots", lambda: cache_ops.mamba2_decode(
        batch, x, dt, A, B, C, ssm_state=cache, out=torch.empty_like(x)), cache)


def test_prefill_needs_the_batch_tokens():
    """cu_seqlens[-1] tokens at least (trailing padding tokens are fine)."""
    batch = cache_ops.prefill_batch(torch.tensor([0, 5, 12]), torch.tensor([0, 1]))
    x, dt, A, B, C = _mamba2(9)
    u, delta, A1, B1, C1 = _mamba1(9)
    xc, w = torch.randn(DIM, 9), torch.randn(DIM, WIDTH)
    cache, cache1, conv_cache = torch.randn(2, H, P, N), torch.randn(2, DIM, N), torch.randn(2, DIM, WIDTH - 1)
    match = "the inputs hold 9 tokens but the batch's cu_seqlens ends at 12"
    _refused(match, lambda: cache_ops.mamba2_prefill(batch, x, dt, A, B, C, ssm_state=cache, out=torch.empty_like(x)),
             cache)
    _refused(match, lambda: cache_ops.mamba1_prefill(batch, u, delta, A1, B1, C1, ssm_state=cache1,
                                                  out=torch.empty_like(u)), cache1)
    _refused(match, lambda: cache_ops.conv_prefill(batch, xc, w, conv_state=conv_cache, out=torch.empty_like(xc)),
             conv_cache)
    padded = cache_ops.prefill_batch(torch.tensor([0, 5, 7]), torch.tensor([0, 1]))
    cache_ops.conv_prefill(padded, xc, w, conv_state=conv_cache, out=torch.empty_like(xc))


def test_conv_out_over_x_is_refused():
    """The Triton kernel stores outputs before it reads the conv states' inputs from x."""
    cache = torch.randn(3, DIM, WIDTH - 1)
    w = torch.randn(DIM, WIDTH)
    x = torch.randn(DIM, 7)
    batch = cache_ops.prefill_batch(torch.tensor([0, 3, 7]), torch.tensor([0, 1]))
    _refused("out must not overlap x", lambda: cache_ops.conv_prefill(batch, x, w, conv_state=cache, out=x), cache)
    xd = torch.randn(2, DIM)
    _refused("out must not overlap x", lambda: cache_ops.conv_decode(
        cache_ops.decode_batch(torch.tensor([0, 2])), xd, w, conv_state=cache, out=xd), cache)
    # Disjoint halves of one buffer are fine.
    buf = torch.randn(2, DIM, 7)
    cache_ops.conv_prefill(batch, buf[0], w, conv_state=cache, out=buf[1])


def test_softplus_flags_must_be_bools():
    T = 5
    pb, db = cache_ops.prefill_batch(torch.tensor([0, T]), torch.tensor([0])), cache_ops.decode_batch(torch.tensor([0]))
    x, dt, A, B, C = _mamba2(T)
    u, delta, A1, B1, C1 = _mamba1(T)
    cache, cache1 = torch.zeros(1, H, P, N), torch.zeros(1, DIM, N)
    one = lambda t: t[:1]
    with pytest.raises(TypeError, match="dt_softplus must be a bool"):
        cache_ops.mamba2_prefill(pb, x, dt, A, B, C, ssm_state=cache, out=torch.empty_like(x), dt_softplus="False")
    with pytest.raises(TypeError, match="dt_softplus must be a bool"):
        cache_ops.mamba2_decode(db, one(x), one(dt), A, one(B), one(C), ssm_state=cache, out=torch.empty_like(one(x)),
                             dt_softplus="False")
    with pytest.raises(TypeError, match="delta_softplus must be a bool"):
        cache_ops.mamba1_prefill(pb, u, delta, A1, B1, C1, ssm_state=cache1, out=torch.empty_like(u),
                              delta_softplus="False")
    with pytest.raises(TypeError, match="delta_softplus must be a bool"):
        cache_ops.mamba1_decode(db, u[:, :1].t(), delta[:, :1].t(), A1, B1[:, :1].t(), C1[:, :1].t(), ssm_state=cache1,
                             out=torch.empty(1, DIM), delta_softplus="False")
    assert not cache.any() and not cache1.any()


def test_conv_decode_names_a_wrong_out():
    with pytest.raises(ValueError, match=r"out must have 2 dimensions \(batch, dim\)"):
        cache_ops.conv_decode(cache_ops.decode_batch(torch.tensor([0, 1])), torch.randn(2, DIM),
                              torch.randn(DIM, WIDTH), conv_state=torch.zeros(2, DIM, WIDTH - 1),
                              out=torch.empty(2, DIM, 1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_conv_in_place_with_taps_past_a_time_tile(backend):
    """width - 1 = 129 taps reach past the Triton kernel's 128-token time tile: the later tiles must
    not read the slot's initial inputs after the first tile has updated them in place."""
    width, T = 130, 150
    x, w = torch.randn(2, T), torch.randn(2, width) * 0.1
    cache = torch.randn(2, 2, width - 1)
    before = cache.clone()
    out = torch.empty_like(x)
    cache_ops.conv_prefill(cache_ops.prefill_batch(torch.tensor([0, T]), torch.tensor([1])), x, w, conv_state=cache,
                        out=out, backend=backend)
    want = causal_conv1d(x[None], w, initial_states=before[1:2], backend=backend)
    assert torch.equal(out, want.out[0]) and torch.equal(cache[1], want.final_states[0])
    assert torch.equal(cache[0], before[0])


def _ops(T=5, nslots=3):
    """Every engine op with valid arguments: {name: (call(**changes), written caches)}."""
    cu = torch.tensor([0, 2, T])
    pb, db = cache_ops.prefill_batch(cu, torch.tensor([0, 1])), cache_ops.decode_batch(torch.tensor([0, 2]))
    x, dt, A, B, C = _mamba2(T)
    u, delta, A1, B1, C1 = _mamba1(T)
    xc, w = torch.randn(DIM, T), torch.randn(DIM, WIDTH)
    cache, cache1, conv_cache = torch.zeros(nslots, H, P, N), torch.zeros(nslots, DIM, N), torch.zeros(nslots, DIM,
                                                                                                        WIDTH - 1)
    rows = lambda t: t[:2]
    cols = lambda t: t[:, :2].t()
    args = {
        "mamba2_prefill": (pb, dict(x=x, dt=dt, A=A, B=B, C=C, ssm_state=cache, out=torch.empty_like(x),
                                    D=torch.randn(H), z=torch.randn_like(x), dt_bias=torch.randn(H))),
        "mamba2_decode": (db, dict(x=rows(x), dt=rows(dt), A=A, B=rows(B), C=rows(C), ssm_state=cache,
                                   out=torch.empty_like(rows(x)), D=torch.randn(H), z=torch.randn_like(rows(x)),
                                   dt_bias=torch.randn(H))),
        "mamba1_prefill": (pb, dict(u=u, delta=delta, A=A1, B=B1, C=C1, ssm_state=cache1, out=torch.empty_like(u),
                                    D=torch.randn(DIM), z=torch.randn_like(u), delta_bias=torch.randn(DIM))),
        "mamba1_decode": (db, dict(u=cols(u), delta=cols(delta), A=A1, B=cols(B1), C=cols(C1), ssm_state=cache1,
                                   out=torch.empty(2, DIM), D=torch.randn(DIM), z=torch.randn(2, DIM),
                                   delta_bias=torch.randn(DIM))),
        "conv_prefill": (pb, dict(x=xc, weight=w, bias=torch.randn(DIM), conv_state=conv_cache,
                                  out=torch.empty_like(xc))),
        "conv_decode": (db, dict(x=cols(xc).contiguous(), weight=w, bias=torch.randn(DIM), conv_state=conv_cache,
                                 out=torch.empty(2, DIM))),
    }
    return args


def _call(op, batch, kw):
    return getattr(cache_ops, op)(batch, **kw)


@pytest.mark.parametrize("op", ["mamba2_prefill", "mamba2_decode", "mamba1_prefill", "mamba1_decode", "conv_prefill",
                                "conv_decode"])
def test_every_tensor_argument_is_type_checked(op):
    """A list (or None for a required tensor) where a tensor belongs: a TypeError naming it, not
    an AttributeError from inside."""
    batch, kw = _ops()[op]
    for name in kw:
        for bad in ([1.0, 2.0], None) if name not in ("D", "z", "dt_bias", "delta_bias", "bias") else ([1.0],):
            with pytest.raises(TypeError, match=rf"^{name} must be a torch.Tensor"):
                _call(op, batch, {**kw, name: bad})


def _overlapping_outs(op, kw):
    """(description, changes, message) of outputs that share memory with another argument."""
    cache_name = "conv_state" if op.startswith("conv") else "ssm_state"
    out, cache = kw["out"], kw[cache_name]
    first = next(iter(kw))  # x or u
    expanded = out[:1].expand_as(out) if out.shape[0] > 1 else out[:, :1].expand_as(out)
    on_cache = torch.zeros(cache.numel() + out.numel())  # y would be overwritten by the final states
    in_cache = on_cache[:cache.numel()].view(cache.shape)
    out_in_cache = on_cache[cache.numel() // 2:][:out.numel()].view(out.shape)
    cases = [
        ("expanded out", dict(out=expanded), "out has overlapping memory"),
        ("out over the cache", {"out": out_in_cache, cache_name: in_cache}, f"out must not overlap {cache_name}"),
        ("out over an input", dict(out=kw[first]), f"out must not overlap {first}"),
        ("cache over an input", {cache_name: in_cache, first: on_cache[:kw[first].numel()].view(kw[first].shape)},
         f"{cache_name} must not overlap {first}"),
    ]
    if "z" in kw:
        cases.append(("out over the gate", dict(out=kw["z"]), "out must not overlap z"))
    return cases


@pytest.mark.parametrize("op", ["mamba2_prefill", "mamba2_decode", "mamba1_prefill", "mamba1_decode", "conv_prefill",
                                "conv_decode"])
def test_outputs_sharing_memory_with_other_arguments_are_refused(op):
    """An expanded out (rows writing over each other), an out over the state cache (y overwritten
    by the final states) or over an input: refused before anything is written."""
    batch, kw = _ops()[op]
    for what, changes, message in _overlapping_outs(op, kw):
        args = {**kw, **changes}
        before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
        with pytest.raises(ValueError, match=message):
            _call(op, batch, args)
        for k, v in before.items():
            assert _same_bits(args[k], v), f"{what}: the refused call wrote {k}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_disjoint_slices_of_one_buffer_are_accepted(backend):
    """x, out and the cache cut from one buffer without sharing an element run as separate tensors
    do (the overlap check is exact for views cut alike)."""
    T = 6
    batch = cache_ops.prefill_batch(torch.tensor([0, 2, T]), torch.tensor([0, 1]),
                                 has_initial_state=torch.tensor([True, False]))
    x, dt, A, B, C = _mamba2(T)
    init = torch.randn(2, H, P, N)
    buf = torch.full((T, 3, H, P), float("nan"))  # per token: [x | out | unused]
    buf[:, 0] = x
    cache_buf = torch.zeros(2, 2, H, P, N)  # [slot][cache | other]
    cache_buf[:, 0] = init
    cache_ops.mamba2_prefill(batch, buf[:, 0], dt, A, B, C, ssm_state=cache_buf[:, 0], out=buf[:, 1], backend=backend)
    cache, out = init.clone(), torch.empty_like(x)
    cache_ops.mamba2_prefill(batch, x, dt, A, B, C, ssm_state=cache, out=out, backend=backend)
    assert torch.equal(buf[:, 1], out) and torch.equal(cache_buf[:, 0], cache)
    assert torch.equal(buf[:, 0], x) and not cache_buf[:, 1].any()


@pytest.mark.parametrize("flag", ["no", "", 1, torch.tensor(True)])
def test_batch_validate_flag_must_be_a_bool(flag):
    """validate="no" would validate (truthy) and validate="" would silently skip validation."""
    with pytest.raises(TypeError, match=r"validate must be a bool \(True or False\)"):
        cache_ops.prefill_batch(torch.tensor([0, 3]), torch.tensor([0]), validate=flag)
    with pytest.raises(TypeError, match=r"validate must be a bool \(True or False\)"):
        cache_ops.decode_batch(torch.tensor([0]), validate=flag)


@pytest.mark.parametrize("changes, error, message", [
    (dict(nslots="8"), TypeError, "nslots must be an int, got str"),
    (dict(nslots=True), TypeError, "nslots must be an int, got True"),
    (dict(nslots=0), ValueError, "nslots must be >= 1, got 0"),
    (dict(skip_slot=1.0), TypeError, "skip_slot must be an int, got float"),
    (dict(skip_slot=False), TypeError, "skip_slot must be an int, got False"),
])
def test_batch_ints_are_checked(changes, error, message):
    with pytest.raises(error, match=message):
        cache_ops.prefill_batch(torch.tensor([0, 3]), torch.tensor([0]), **changes)
    with pytest.raises(error, match=message):
        cache_ops.decode_batch(torch.tensor([0]), **changes)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("positions", [None, [0, 16]])
def test_has_initial_state_may_be_a_host_list_of_bools(backend, positions):
    """An engine's host bools give the batch a tensor's results (with and without the host step
    of start_positions)."""
    T = 7
    cu, slots = torch.tensor([0, 3, T]), torch.tensor([1, 0])
    x, dt, A, B, C = _mamba2(T)
    init = torch.randn(2, H, P, N)
    results = []
    for flags in ([False, True], torch.tensor([False, True])):
        batch = cache_ops.prefill_batch(cu, slots, has_initial_state=flags, start_positions=positions)
        cache, out = init.clone(), torch.empty_like(x)
        cache_ops.mamba2_prefill(batch, x, dt, A, B, C, ssm_state=cache, out=out, backend=backend)
        results.append((cache, out))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    ref = mamba2_scan(x[None], dt[None], A, B[None], C[None], cu_seqlens=cu,
                      initial_states=torch.stack([torch.zeros(H, P, N), init[0]]), backend=backend)
    assert torch.equal(results[0][1], ref.y[0])
    assert torch.equal(results[0][0][1], ref.final_states[0]) and torch.equal(results[0][0][0], ref.final_states[1])


@pytest.mark.parametrize("flags, error, message", [
    ([1, 0], TypeError, r"has_initial_state\[0\] must be a bool \(True or False\), got 1"),
    ([True], ValueError, r"has_initial_state must hold one bool per sequence \(2\), got 1"),
    ("yes", TypeError, "has_initial_state must be a \\(nseq,\\) bool tensor or a list of bools, got str"),
    (torch.tensor([1, 0]), TypeError, "has_initial_state must have dtype bool"),
])
def test_bad_has_initial_state_is_named(flags, error, message):
    with pytest.raises(error, match=message):
        cache_ops.prefill_batch(torch.tensor([0, 3, 5]), torch.tensor([0, 1]), has_initial_state=flags)


@pytest.mark.parametrize("make, message", [
    (lambda L: cache_ops.prefill_batch(L([0, 3, 5]), L([0, 1, 2])),
     r"state_indices must have shape \(nseq\) = \(2,\), got \(3,\)"),
    (lambda L: cache_ops.prefill_batch(L([0, 3, 5]), L([0, 1]), capture_seq=L([[0, 0]]), capture_offset=L([1]),
                                       capture_slot=L([2])), r"capture_seq must have 1 dimensions \(ncapture\)"),
    (lambda L: cache_ops.prefill_batch(L([0, 3, 5]), L([0, 1]), capture_seq=L([0, 0]), capture_offset=L([1, 2]),
                                       capture_slot=L([-1, 99]), nslots=4),
     r"capture_slot\[1\] = 99 is out of range for a cache with 4 slots"),  # declined entries keep their index
    (lambda L: cache_ops.prefill_batch(L([0, 3, 5]), L([-5, 1])), r"state_indices\[0\] = -5 must be >= 0$"),
    (lambda L: cache_ops.decode_batch(L([[0, 1]])), r"state_indices must have 1 dimensions \(batch\)"),
    (lambda L: cache_ops.decode_batch(L([-5, 1])), r"state_indices\[0\] = -5 must be >= 0 \(and is not skip_slot -1\)"),
    (lambda L: cache_ops.decode_batch(L([0, 1]), dst_state_indices=L([-3, 1])),
     r"dst_state_indices\[0\] = -3 must be >= 0$"),
])
def test_batch_errors_name_the_argument_its_size_and_index(make, message):
    with pytest.raises(ValueError, match=message):
        make(lambda values: torch.tensor(values))


@pytest.mark.parametrize("kw, message", [
    (dict(state_indices=[1, 4], nslots=4), r"state_indices\[1\] = 4 is out of range for a cache with 4 slots"),
    (dict(capture_seq=[2], capture_offset=[0], capture_slot=[3]),
     r"capture_seq\[0\] = 2 names no sequence \(the pass has 2\)"),
    (dict(capture_seq=[-1], capture_offset=[0], capture_slot=[3]),
     r"capture_seq\[0\] = -1 names no sequence \(the pass has 2\)"),
    (dict(capture_seq=[0, 1], capture_offset=[1, 1], capture_slot=[3, 3]), "capture_slot must be distinct"),
    (dict(state_indices=[-1, 2], capture_seq=[0], capture_offset=[1], capture_slot=[3]),
     r"capture_seq\[0\] = 0 names a skipped row \(slot -1\)"),
    (dict(host_cu_seqlens=[0, 2, 5]), r"host_cu_seqlens \[0, 2, 5\] differs from cu_seqlens \[0, 3, 5\]"),
    (dict(cu_seqlens=[], state_indices=[]), r"cu_seqlens must hold at least one entry \(0\)"),
])
def test_prefill_batch_validation_at_its_bounds(kw, message):
    """Each check at its edge: slot nslots, a sequence index one past either end, one slot for two
    captures, a capture of a skipped row, host lengths that disagree, no entry at all."""
    args = dict(cu_seqlens=[0, 3, 5], state_indices=[0, 1])
    args.update(kw)
    cu, slots = (torch.tensor(args.pop(k), dtype=torch.int64) for k in ("cu_seqlens", "state_indices"))
    if "capture_slot" in args:
        args["capture_slot"] = torch.tensor(args["capture_slot"])
    with pytest.raises(ValueError, match=message):
        cache_ops.prefill_batch(cu, slots, **args)


def test_prefill_batch_takes_captures_at_offsets_0_and_the_length():
    batch = cache_ops.prefill_batch(torch.tensor([0, 3, 5]), torch.tensor([0, 1]), capture_seq=[0, 1],
                                    capture_offset=[0, 2], capture_slot=torch.tensor([2, 3]), nslots=4)
    assert batch.captures.entries == [(0, 0, 2), (1, 2, 3)]
