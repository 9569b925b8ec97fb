"""Bad input is rejected with an error naming the argument, and writes nothing."""
import pytest
import torch

from helpers import mamba1_inputs, mamba1_positional, mamba2_inputs, mamba2_positional, reads_back
from ssm_kernels import mamba1_scan, mamba2_scan, selective_state_update
from ssm_kernels._common import (Sequences, capture_table, check_same_device, host_ints, lengths_from_bounds,
                                 make_capture_table, make_sequences, resolve_backend)


def m2(**changes):
    """Valid mamba2_scan arguments (2 sequences of 5 tokens) with `changes` applied."""
    args, kw = mamba2_positional(mamba2_inputs(2, 5))
    named = dict(zip(("x", "dt", "A", "B", "C"), args), **kw)
    named.update(changes)
    return named


def call_m2(**changes):
    named = m2(**changes)
    args = [named.pop(k) for k in ("x", "dt", "A", "B", "C")]
    return mamba2_scan(*args, **named)


CASES = [
    # (changes, error type, message fragment)
    (dict(x=torch.randn(2, 5, 4)), ValueError, "x must have 4 dimensions"),
    (dict(x=torch.ones(2, 5, 4, 8, dtype=torch.int32)), TypeError, "x must have dtype"),
    (dict(x=[1.0]), TypeError, "x must be a torch.Tensor"),
    (dict(dt=torch.randn(2, 6, 4)), ValueError, r"dt must have shape .*seqlen is 6, expected 5"),
    (dict(dt=torch.randn(3, 5, 4)), ValueError, r"dt .*batch is 3, expected 2"),
    (dict(A=torch.randn(4, dtype=torch.float64)), TypeError, "A must have dtype float32"),
    (dict(A=torch.randn(3)), ValueError, r"A must have shape .*nheads is 3, expected 4"),
    (dict(B=torch.randn(2, 5, 3, 16), C=torch.randn(2, 5, 3, 16)), ValueError,
     r"nheads \(4\) must be a multiple of ngroups \(3\)"),
    (dict(C=torch.randn(2, 5, 1, 16)), ValueError, r"C must have shape .*ngroups is 1, expected 2"),
    (dict(B=torch.randn(2, 5, 2, 300), C=torch.randn(2, 5, 2, 300), initial_states=None), ValueError,
     "dstate 300 is beyond the kernel's limit of 256"),
    (dict(D=torch.randn(5)), ValueError, r"D must have shape"),
    (dict(D=torch.randn(4, 7)), ValueError, r"D must have shape .*headdim is 7, expected 8"),
    (dict(D=torch.randn(1, 4, 8)), ValueError,
     r"D must have shape \(nheads,\) or \(nheads, headdim\) = \(4,\) or \(4, 8\)"),
    (dict(z=torch.randn(2, 5, 4, 7)), ValueError, "z must have shape"),
    (dict(dt_bias=torch.randn(4, 1)), ValueError, "dt_bias must have 1 dimensions"),
    (dict(dt_limit=(1.0, 0.5)), ValueError, "dt_limit must satisfy min <= max"),
    (dict(dt_limit=3.0), TypeError, "dt_limit must be a pair"),
    (dict(initial_states=torch.randn(3, 4, 8, 16)), ValueError, r"initial_states .*nseq is 3, expected 2"),
    (dict(initial_states=torch.randn(2, 4, 8, 16).half()), TypeError, "initial_states must have dtype float32"),
    (dict(dt=torch.randn(2, 5, 4, device="meta")), ValueError,
     "dt is on the meta device, which holds shapes but no data"),
    (dict(x=torch.randn(2, 5, 4, 8, device="meta"), dt=torch.randn(2, 5, 4, device="meta")), ValueError,
     "x is on the meta device"),
    (dict(dt_softplus="False"), TypeError, r"dt_softplus must be a bool \(True or False\), got 'False' \(str\)"),
    (dict(dt_softplus=torch.tensor(True)), TypeError, "dt_softplus must be a bool"),
    (dict(dt_limit=("0", "1")), TypeError, r"dt_limit must be a pair of real numbers \(min, max\), got \('0', '1'\)"),
    (dict(dt_limit=(0.0, float("nan"))), TypeError, "dt_limit must be a pair of real numbers"),
    (dict(dt_limit=(0.0, 1.0, 2.0)), TypeError, "dt_limit must be a pair of real numbers"),
    (dict(dt_limit=(False, True)), TypeError, "dt_limit must be a pair of real numbers"),
    (dict(cu_seqlens=torch.tensor([0, 5, 10])), ValueError, "varlen batch .* must have batch size 1, got 2"),
    (dict(capture=[(0, 6)]), ValueError, "capture offset 6 for sequence 0 is past its length 5"),
    (dict(capture=[(1, -1)]), ValueError, "capture offset -1 for sequence 1 is negative"),
    (dict(capture=[(2, 0)]), ValueError, r"capture\[0\] names sequence 2, but the batch has 2 sequences"),
    (dict(capture=torch.tensor([[0.0, 1.0]])), TypeError, "capture must be an integer tensor"),
    (dict(capture=torch.tensor([[0, 1, 2]])), ValueError, r"capture must have shape \(ncapture, 2\)"),
    (dict(capture=torch.empty(3, 0, dtype=torch.int64)), ValueError,
     r"capture must have shape \(ncapture, 2\) \(ncapture may be 0\), got \(3, 0\)"),
    (dict(capture=torch.empty(0, dtype=torch.int64)), ValueError, r"capture must have shape \(ncapture, 2\)"),
    (dict(capture=torch.zeros(1, 2, dtype=torch.int64, device="meta")), ValueError, "capture is on the meta device"),
    (dict(capture=[(0, 1), 3]), TypeError, r"capture\[1\] must be a pair of ints"),
    (dict(capture=[(0, 1.5)]), TypeError, r"capture\[0\] must be a pair of ints"),
    (dict(capture=5), TypeError, "capture must be an int tensor"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
]


@pytest.mark.parametrize("changes, error, message", CASES, ids=[c[2][:40] for c in CASES])
def test_mamba2_scan_rejects(changes, error, message):
    with pytest.raises(error, match=message):
        call_m2(**changes)


def test_dt_limit_beyond_float32_clamps_as_infinity():
    # dt' is float32, so a bound past its range is an infinite one (not an overflow error)
    named = m2(backend="torch")
    args = [named.pop(k) for k in ("x", "dt", "A", "B", "C")]
    wide = mamba2_scan(*args, **named, dt_limit=(-1e300, 1e40))
    infinite = mamba2_scan(*args, **named, dt_limit=(-float("inf"), float("inf")))
    assert torch.equal(wide.y, infinite.y) and torch.equal(wide.final_states, infinite.final_states)


def varlen_call(cu, seqlen=10):
    args, kw = mamba2_positional(mamba2_inputs(1, seqlen, nseq=len(cu) - 1))
    return mamba2_scan(*args, **kw, cu_seqlens=torch.tensor(cu))


@pytest.mark.parametrize("algorithm", ["recurrent", "chunked"])
def test_torch_default_device_does_not_move_the_host_tables(algorithm):
    """The host lists a pass turns into index tensors (captures, sequences, chunks) are built on the
    CPU whatever torch's default device is (an engine may set it to cuda, where pinning them failed):
    here "meta", which holds no data, so a table built there could not be copied."""
    args, kw = mamba2_positional(mamba2_inputs(1, 40, nseq=2))
    cu = torch.tensor([0, 17, 40])
    chunk = dict(chunk_size=16) if algorithm == "chunked" else {}
    want = mamba2_scan(*args, **kw, cu_seqlens=cu, capture=[(0, 1), (1, 20)], algorithm=algorithm, **chunk)
    torch.set_default_device("meta")
    try:
        got = mamba2_scan(*args, **kw, cu_seqlens=cu, capture=[(0, 1), (1, 20)], algorithm=algorithm, **chunk)
    finally:
        torch.set_default_device(None)  # no default-device mode left behind
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_empty_capture_tensor_means_no_captures():
    out = call_m2(capture=torch.empty(0, 2, dtype=torch.int64))
    assert out.captured_states.shape == (0, 4, 8, 16)


@pytest.mark.parametrize("cu, message", [
    ([1, 4, 10], "cu_seqlens must start at 0"),
    ([0, 6, 4, 10], r"cu_seqlens must be non-decreasing, but cu_seqlens\[2\] = 4 < cu_seqlens\[1\] = 6"),
    ([0, 4, 9], "cu_seqlens must end at seqlen = 10, got 9"),
])
def test_bad_cu_seqlens(cu, message):
    with pytest.raises(ValueError, match=message):
        varlen_call(cu)


@pytest.mark.parametrize("cu, error, message", [
    ([0, 4.0, 10], TypeError, r"cu_seqlens\[1\] must be an int, got float"),
    ([0, True, 10], TypeError, r"cu_seqlens\[1\] must be an int, got True"),
    ((0, 6, 4, 10), ValueError, r"cu_seqlens must be non-decreasing"),
    ([0, 4], ValueError, "cu_seqlens must end at seqlen = 10, got 4"),
    (7, TypeError, "cu_seqlens must be an int tensor or a list of ints, got int"),
    (torch.tensor([[0, 10]]), ValueError, "cu_seqlens must have 1 dimensions"),
])
def test_bad_host_cu_seqlens(cu, error, message):
    args, kw = mamba2_positional(mamba2_inputs(1, 10, nseq=2))
    with pytest.raises(error, match=message):
        mamba2_scan(*args, **kw, cu_seqlens=cu)


@pytest.mark.parametrize("backend, algorithm", [("torch", "recurrent"), ("torch", "chunked"),
                                                ("triton", "recurrent"), ("triton", "chunked")])
def test_host_cu_seqlens_give_the_tensors_results(backend, algorithm, device):
    """cu_seqlens as a list or tuple of ints: the same results bit for bit as the tensor (which
    is read back once)."""
    bounds = [0, 17, 17, 40]
    args, kw = mamba2_positional(mamba2_inputs(1, 40, nseq=3, device=device))
    opts = dict(capture=[(0, 1), (2, 20)], backend=backend, algorithm=algorithm, chunk_size=16)
    cu = torch.tensor(bounds, device=device)
    with reads_back(cu) as reads:
        want = mamba2_scan(*args, **kw, cu_seqlens=cu, **opts)
    assert len(reads) == 1
    for given in (bounds, tuple(bounds)):
        got = mamba2_scan(*args, **kw, cu_seqlens=given, **opts)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    m1_args, m1_kw = mamba1_positional(mamba1_inputs(1, 40, nseq=3, device=device))
    m1 = [mamba1_scan(*m1_args, **m1_kw, cu_seqlens=c, **opts) for c in (cu, bounds)]
    assert all(torch.equal(g, w) for g, w in zip(*m1))


def test_host_cu_seqlens_share_one_device_copy():
    a, b = (make_sequences(1, 10, [0, 4, 10], torch.device("cpu")) for _ in range(2))
    assert a.cu_seqlens is b.cu_seqlens and a.cu_seqlens.dtype == torch.int64
    assert a.cu_seqlens.tolist() == [0, 4, 10] and a.host_bounds() == [0, 4, 10] and a.lengths == [4, 6]
    assert make_sequences(1, 10, [0, 5, 10], torch.device("cpu")).cu_seqlens.tolist() == [0, 5, 10]
    assert make_sequences(2, 10, None, torch.device("cpu")).host_bounds() is None


def test_cu_seqlens_dtype():
    args, kw = mamba2_positional(mamba2_inputs(1, 4, nseq=1))
    with pytest.raises(TypeError, match="cu_seqlens must have dtype int32, int64"):
        mamba2_scan(*args, **kw, cu_seqlens=torch.tensor([0.0, 4.0]))


def test_capture_offset_checked_against_its_own_sequence():
    with pytest.raises(ValueError, match="capture offset 4 for sequence 1 is past its length 3"):
        args, kw = mamba2_positional(mamba2_inputs(1, 10, nseq=2))
        mamba2_scan(*args, **kw, cu_seqlens=torch.tensor([0, 7, 10]), capture=[(0, 7), (1, 4)])


def test_triton_backend_needs_cuda_or_the_interpreter():
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        resolve_backend("triton", torch.device("cpu"), triton_runs_on_cpu=False)
    assert resolve_backend("auto", torch.device("cpu"), triton_runs_on_cpu=True) == "torch"


@pytest.mark.parametrize("changes, error, message", [
    (dict(u=torch.randn(2, 12)), ValueError, "u must have 3 dimensions"),
    (dict(delta=torch.randn(2, 12, 4)), ValueError, r"delta .*seqlen is 4, expected 11"),
    (dict(A=torch.randn(12, 8).double()), TypeError, "A must have dtype float32"),
    (dict(B=torch.randn(2, 5, 8, 11), C=torch.randn(2, 5, 8, 11)), ValueError,
     r"dim \(12\) must be a multiple of ngroups \(5\)"),
    (dict(C=torch.randn(2, 2, 8, 11)), ValueError, "C must have 3 dimensions"),
    (dict(B=torch.randn(2, 7, 11)), ValueError, r"B must have shape .*dstate is 7, expected 8"),
    (dict(D=torch.randn(11)), ValueError, r"D must have shape .*dim is 11, expected 12"),
    (dict(initial_states=torch.randn(2, 12, 4)), ValueError, r"initial_states .*dstate is 4, expected 8"),
    (dict(capture=[(0, 12)]), ValueError, "capture offset 12 for sequence 0 is past its length 11"),
    (dict(delta_softplus="False"), TypeError, r"delta_softplus must be a bool \(True or False\), got 'False'"),
    (dict(delta_softplus=1), TypeError, "delta_softplus must be a bool"),
])
def test_mamba1_scan_rejects(changes, error, message):
    args, kw = mamba1_positional(mamba1_inputs(2, 11))
    named = dict(zip(("u", "delta", "A", "B", "C"), args), **kw)
    named.update(changes)
    args = [named.pop(k) for k in ("u", "delta", "A", "B", "C")]
    with pytest.raises(error, match=message):
        mamba1_scan(*args, **named)


def decode_args(batch=3):
    kw = mamba2_inputs(batch, 1)
    return dict(state=torch.randn(4, 4, 8, 16), x=kw["x"][:, 0], dt=kw["dt"][:, 0], A=kw["A"],
                B=kw["B"][:, 0], C=kw["C"][:, 0], D=kw["D"], dt_bias=kw["dt_bias"])


@pytest.mark.parametrize("changes, error, message", [
    (dict(state_indices=torch.tensor([0, 4, 1])), ValueError,
     r"state_indices\[1\] = 4 is out of range for a state with 4 slots"),
    (dict(state_indices=torch.tensor([0, -1, 1])), ValueError, r"state_indices\[1\] = -1 is out of range"),
    (dict(state_indices=torch.tensor([2, 2, 1])), ValueError, "state_indices must be distinct"),
    (dict(state_indices=torch.tensor([0, 1])), ValueError, r"state_indices .*batch is 2, expected 3"),
    (dict(state_indices=torch.tensor([0.0, 1.0, 2.0])), TypeError, "state_indices must have dtype"),
    (dict(state=torch.randn(4, 4, 8, 16).double()), TypeError, "state must have dtype float32"),
    (dict(state=torch.randn(2, 4, 8, 16)), ValueError, r"the batch \(3\) must not exceed state's slots \(2\)"),
    (dict(x=torch.randn(3, 4, 9)), ValueError, r"state must have shape .*headdim is 8, expected 9"),
    (dict(B=torch.randn(3, 2, 8)), ValueError, r"C must have shape .*dstate is 16, expected 8"),
    (dict(dt=torch.randn(3, 4, 1)), ValueError, "dt must have 2 dimensions"),
    (dict(dt_softplus="False"), TypeError, "dt_softplus must be a bool"),
    (dict(state=torch.randn(1, 4, 8, 16).expand(4, 4, 8, 16)), ValueError,
     r"state has overlapping memory \(shape \(4, 4, 8, 16\), strides \(0, 128, 16, 1\)"),
    (dict(state=torch.randn(16, 4, 8, 4).transpose(0, 3)[:, :, :, :16:4].as_strided((4, 4, 8, 16), (1, 1, 1, 1))),
     ValueError, "state has overlapping memory"),
    (dict(state=torch.randn(4, 4, 8, 16, requires_grad=True)), ValueError, r"state requires grad.*state.detach\(\)"),
    (dict(state_indices=torch.tensor([0, 1, 2]), dst_state_indices=torch.tensor([3, 3, 1])), ValueError,
     "dst_state_indices must be distinct"),
    (dict(state_indices=torch.tensor([0, 1, 2]), dst_state_indices=torch.tensor([3, 0, 2])), ValueError,
     r"dst_state_indices\[1\] = 0 is the slot row 0 reads"),
    (dict(state_indices=torch.tensor([0, 1, 2]), dst_state_indices=torch.tensor([3, 4, 2])), ValueError,
     r"dst_state_indices\[1\] = 4 is out of range"),
    (dict(state_indices=torch.tensor([0, -2, 2]), pad_slot_id=-1), ValueError,
     r"state_indices\[1\] = -2 is out of range for a state with 4 slots \(and is not pad_slot_id -1\)"),
    (dict(state_indices=torch.tensor([0, -1, 2]), pad_slot_id=-1.0), TypeError, "pad_slot_id must be an int"),
    (dict(dst_state_indices=torch.tensor([0, 1])), ValueError, r"dst_state_indices .*batch is 2, expected 3"),
])
def test_selective_state_update_rejects_and_leaves_state_untouched(changes, error, message):
    named = decode_args()
    named.update(changes)
    state = named["state"]
    before = state.clone()
    args = [named.pop(k) for k in ("state", "x", "dt", "A", "B", "C")]
    with pytest.raises(error, match=message):
        selective_state_update(*args, **named)
    assert torch.equal(state, before)


def test_padded_rows_may_share_a_pad_slot_and_destination():
    """Padded rows are not checked for collisions: they write nothing."""
    named = decode_args()
    named.update(state_indices=torch.tensor([-1, 1, -1]), dst_state_indices=torch.tensor([0, 2, 0]), pad_slot_id=-1)
    state = named["state"]
    before = state.clone()
    args = [named.pop(k) for k in ("state", "x", "dt", "A", "B", "C")]
    y = selective_state_update(*args, **named)
    assert torch.equal(y[[0, 2]], torch.zeros_like(y[[0, 2]]))
    assert torch.equal(state[[0, 1, 3]], before[[0, 1, 3]]) and not torch.equal(state[2], before[2])



def _decode_slot_error(sources, targets, pad, nslots):
    """The first thing wrong with a decode batch's slots, row by row, as the docs define it (None
    when nothing is): a live row's source or destination out of range, two live rows writing one
    slot, a live row writing the slot another live row reads."""
    live = [b for b, slot in enumerate(sources) if slot != pad]
    for b in live:
        if not 0 <= sources[b] < nslots:
            return f"state_indices[{b}] = {sources[b]} is out of range"
    for b in live:
        if not 0 <= targets[b] < nslots:
            return f"dst_state_indices[{b}] = {targets[b]} is out of range"
    if len({targets[b] for b in live}) < len(live):
        return "must be distinct over the rows that are not padding"
    for b in live:
        other = [a for a in live if a != b and sources[a] == targets[b]]
        if other:
            return f"dst_state_indices[{b}] = {targets[b]} is the slot row {other[0]} reads"
    return None


def test_decode_slot_checks_agree_with_their_row_by_row_definition():
    """check_decode_slots (set operations, the rows walked only to name a wrong one) refuses
    exactly the batches the row-by-row definition refuses, naming the same first row, on random
    small batches with padding, explicit and default destinations."""
    from ssm_kernels._common import check_decode_slots
    rng = torch.Generator().manual_seed(0)
    refused = 0
    for case in range(3000):
        batch, nslots = int(torch.randint(1, 6, (1,), generator=rng)), int(torch.randint(1, 8, (1,), generator=rng))
        sources = torch.randint(-1, nslots + 1, (batch,), generator=rng)
        kind = case % 3  # destinations: random, the sources (in place, explicit), none (default)
        targets = torch.randint(-1, nslots + 1, (batch,), generator=rng) if kind == 0 else sources.clone()
        pad = -1 if case % 2 else None
        expected = _decode_slot_error(sources.tolist(), targets.tolist(), pad, nslots)
        if expected is not None and kind == 2 and expected.startswith("dst_state_indices"):
            expected = expected.replace("dst_state_indices", "state_indices")  # never reached: the sources fail first
        try:
            check_decode_slots(sources, None if kind == 2 else targets, pad, batch, nslots)
            got = None
        except ValueError as error:
            got = str(error)
        assert (got is None) == (expected is None), (sources, targets, pad, nslots, got, expected)
        if expected is not None:
            assert expected in got, (got, expected)
            refused += 1
    assert 500 < refused < 2500  # both outcomes well represented

# -------------------------------------------------------------------------------------------
# Every tensor argument type-checked; flags are bools; outputs beyond the device refused
# -------------------------------------------------------------------------------------------
OPTIONAL = ("D", "z", "dt_bias", "delta_bias", "initial_states", "cu_seqlens", "state_indices", "dst_state_indices")


def _named_calls():
    """(public function, its valid arguments by name) for the three scans."""
    m1 = mamba1_inputs(2, 5)
    state = decode_args()
    return [(mamba2_scan, m2(cu_seqlens=None)), (mamba1_scan, m1),
            (selective_state_update, dict(state, state_indices=torch.tensor([0, 1, 2]),
                                          dst_state_indices=torch.tensor([3, 1, 2])))]


@pytest.mark.parametrize("which", [0, 1, 2], ids=["mamba2_scan", "mamba1_scan", "selective_state_update"])
def test_every_tensor_argument_is_type_checked(which):
    fn, named = _named_calls()[which]
    tensors = [k for k, v in named.items() if isinstance(v, torch.Tensor)]
    for name in tensors:
        for bad in ([1.0],) if name in OPTIONAL else ([1.0], None):
            with pytest.raises(TypeError, match=rf"^{name} must be a torch.Tensor"):
                fn(**{**named, name: bad})


@pytest.mark.parametrize("flag", ["no", "", 0, torch.tensor(False)])
def test_selective_state_update_validate_must_be_a_bool(flag):
    """validate="no" (truthy) would validate and validate="" would skip every check silently."""
    named = decode_args()
    before = named["state"].clone()
    with pytest.raises(TypeError, match=r"validate must be a bool \(True or False\)"):
        selective_state_update(**named, validate=flag)
    assert torch.equal(named["state"], before)


def test_selective_state_update_state_over_an_input_is_refused():
    """x read from the pool it updates: a row's write would change the x another row reads."""
    named = decode_args()
    state = named["state"]
    before = state.clone()
    x = state[0, :, :, :3].permute(2, 0, 1)  # (3, 4, 8): three tokens' x inside slot 0
    with pytest.raises(ValueError, match="state must not overlap x in memory"):
        selective_state_update(**{**named, "x": x})
    assert torch.equal(state, before)


def test_outputs_beyond_the_device_memory_are_refused_by_name():
    """2^40 tokens (stride-0 inputs, so they cost nothing): a clear error naming the output and
    its size, before any allocation, instead of the allocator's traceback."""
    T = 2 ** 40
    kw = mamba2_inputs(1, 1)
    big = lambda t: t.expand(1, T, *t.shape[2:])
    with pytest.raises(ValueError, match=r"y of shape \(1, 1099511627776, 4, 8\) \(float32\) would need "
                                         r"140737488355328 bytes .* more than the .* GiB of memory of cpu"):
        mamba2_scan(big(kw["x"]), big(kw["dt"]), kw["A"], big(kw["B"]), big(kw["C"]), backend="torch")
    kw = mamba1_inputs(1, 1)
    big = lambda t: t.expand(*t.shape[:-1], T)
    with pytest.raises(ValueError, match=r"y of shape \(1, 12, 1099511627776\) \(float32\) would need"):
        mamba1_scan(big(kw["u"]), big(kw["delta"]), kw["A"], big(kw["B"]), big(kw["C"]), backend="torch")


@pytest.mark.parametrize("which", [0, 1, 2], ids=["mamba2_scan", "mamba1_scan", "selective_state_update"])
def test_every_tensor_argument_that_requires_grad_is_refused(which):
    """The kernels record no autograd graph: with grad mode on, an input requiring grad is refused
    (its gradient would be dropped silently); under torch.no_grad() the same call runs."""
    fn, named = _named_calls()[which]
    floats = [k for k, v in named.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    assert len(floats) >= 6
    for name in floats:
        with pytest.raises(ValueError, match=rf"^{name} requires grad, but the kernels are forward only"):
            fn(**{**named, name: named[name].clone().requires_grad_()})
    first = next(name for name in floats if name != "state")  # a state updated in place is refused anyway
    with torch.no_grad():
        fn(**{**named, first: named[first].clone().requires_grad_()})


def test_host_checks_at_their_edges():
    """One bound (0) is a pass of no sequence, none is refused; host ints are a list of count ints,
    not a tensor; a capture's sequence is an int, not a bool; offset 0 is the initial state; the
    same captures give the same table; sequence s owns entries [ptr[s], ptr[s + 1])."""
    assert lengths_from_bounds([0]) == [] and lengths_from_bounds([0, 3, 3]) == [3, 0]
    with pytest.raises(ValueError, match=r"cu_seqlens must hold at least one entry \(0\)"):
        lengths_from_bounds([])
    with pytest.raises(ValueError, match="y is on meta but x is on cpu"):
        check_same_device(x=torch.zeros(1), y=torch.zeros(1, device="meta"))
    with pytest.raises(TypeError, match="start_positions must be a list of ints, got Tensor"):
        host_ints("start_positions", torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="start_positions must hold 3 ints"):
        host_ints("start_positions", [0, 3], 3)
    seqs = Sequences(None, [5, 5], False)
    with pytest.raises(TypeError, match=r"capture\[0\] must be a pair of ints"):
        make_capture_table([(True, 2)], seqs, torch.device("cpu"))
    table = make_capture_table([(0, 0), (1, 5)], seqs, torch.device("cpu"))
    assert table.entries == [(0, 0, 0), (1, 5, 1)]
    assert make_capture_table([(0, 0), (1, 5)], seqs, torch.device("cpu")) is table
    assert capture_table([(1, 2, 0), (1, 4, 1), (2, 1, 2)], 3, torch.device("cpu")).ptr.tolist() == [0, 0, 2, 3]
