"""The engine prefill ops' chunked algorithm: the bits of mamba2_scan / mamba1_scan's chunked
algorithm on the same rows, states in place in a cache by slot (skip rows, fresh rows, captures,
cache dtypes), accurate against the float64 references, and a warm continuation from a grid point
that equals the cold pass bit for bit."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import TOLERANCE, assert_rel_close, mamba1_inputs, mamba2_inputs
from ssm_kernels import _replay, cache_ops, mamba1_scan, mamba2_scan
from ssm_kernels.scan.mamba2_chunked import triton_kernel as mamba2_triton
from ssm_kernels.scan.reference import mamba1_scan_ref, mamba2_scan_ref
from test_cache_ops import tensors_on_the_backends_device  # noqa: F401 (autouse: the Triton tests' device)

BACKENDS = ["torch", "triton"]
CHUNK = 16
# Row 1 is empty, row 3 holds one token, row 5 is a padded row with tokens (skipped). Start
# positions put rows on and off the chunk grid; row 2 crosses two grid points.
LENGTHS = [5, 0, 21, 1, 4, 3]
SLOTS = [4, 7, 1, 5, 6, -1]
HAS_INIT = [True, False, True, True, False, True]
POSITIONS = [16, 0, 13, 31, 32, 0]
# (sequence, offset, slot): offsets 0, 1, len - 1 and len; the last one goes to the skip slot.
CAPTURES = [(0, 1, 8), (2, 21, 0), (2, 0, 9), (2, 20, 3), (4, 4, 11), (0, 4, 10), (3, 0, 2), (2, 5, -1)]
NSLOTS = 12
LIVE = [s for s, slot in enumerate(SLOTS) if slot != -1]
WRITTEN = [c for c in CAPTURES if c[2] != -1]


def _cu():
    return torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.int32)


def _batch(positions=POSITIONS, captures=CAPTURES):
    seq, off, slot = (torch.tensor(c) for c in zip(*captures))
    return cache_ops.prefill_batch(_cu(), torch.tensor(SLOTS, dtype=torch.int32),
                                has_initial_state=torch.tensor(HAS_INIT), capture_seq=seq, capture_offset=off,
                                capture_slot=slot, nslots=NSLOTS, start_positions=positions)


def _initial(cache):
    return torch.stack([cache[slot].float() if h and slot != -1 else torch.zeros_like(cache[0], dtype=torch.float32)
                        for slot, h in zip(SLOTS, HAS_INIT)])


def _live_tokens():
    cu = _cu().tolist()
    return torch.cat([torch.arange(cu[s], cu[s + 1]) for s in LIVE])


def _check_cache(cache, before, final, captured):
    """Final states and captures in their slots (rounded as stored), every other slot untouched."""
    expected = {SLOTS[s]: final[s] for s in LIVE}
    expected.update({slot: captured[i] for i, (_, _, slot) in enumerate(CAPTURES) if slot != -1})
    for slot in range(NSLOTS):
        want = expected[slot].to(cache.dtype) if slot in expected else before[slot]
        assert torch.equal(cache[slot], want), f"slot {slot}"


def _mamba2_case(cache_dtype, states_transposed=False):
    """Inputs and a cache; with states_transposed each slot's (headdim, dstate) state is stored
    dstate-major (the kernels write captures at the cache's strides)."""
    kw = mamba2_inputs(1, sum(LENGTHS))
    nheads, headdim, dstate = kw["initial_states"].shape[1:]
    if states_transposed:
        return kw, torch.randn(NSLOTS, nheads, dstate, headdim).to(cache_dtype).transpose(-1, -2)
    return kw, torch.randn(NSLOTS, nheads, headdim, dstate).to(cache_dtype)


def _mamba2_prefill(batch, kw, cache, out, **options):
    cache_ops.mamba2_prefill(batch, kw["x"][0], kw["dt"][0], kw["A"], kw["B"][0], kw["C"][0], ssm_state=cache, out=out,
                          D=kw["D"], z=kw["z"][0], dt_bias=kw["dt_bias"], dt_softplus=True, **options)


def _mamba1_prefill(batch, kw, cache, out, **options):
    cache_ops.mamba1_prefill(batch, kw["u"][0], kw["delta"][0], kw["A"], kw["B"][0], kw["C"][0], ssm_state=cache,
                          out=out, D=kw["D"], z=kw["z"][0], delta_bias=kw["delta_bias"], delta_softplus=True,
                          **options)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_dtype, states_transposed", [(torch.float32, False), (torch.bfloat16, False),
                                                             (torch.float16, False), (torch.float32, True),
                                                             (torch.bfloat16, True)])
def test_mamba2_chunked_prefill_matches_public_chunked_scan(backend, cache_dtype, states_transposed):
    kw, cache = _mamba2_case(cache_dtype, states_transposed)
    kw = {k: v.to(torch.get_default_device()) for k, v in kw.items()}
    cache = cache.to(torch.get_default_device())
    assert (cache.stride(-1) == 1) != states_transposed
    before = cache.clone()
    out = torch.full_like(kw["x"][0], float("nan"))
    _mamba2_prefill(_batch(), kw, cache, out, backend=backend, algorithm="chunked", chunk_size=CHUNK)
    ref = mamba2_scan(kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], D=kw["D"], z=kw["z"], dt_bias=kw["dt_bias"],
                      dt_softplus=True, initial_states=_initial(before), cu_seqlens=_cu().to(cache.device),
                      capture=[(s, k) for s, k, _ in CAPTURES], backend=backend, algorithm="chunked",
                      chunk_size=CHUNK, start_positions=POSITIONS)
    live = _live_tokens()
    assert torch.equal(out[live], ref.y[0][live])
    assert torch.isnan(out[-LENGTHS[-1]:]).all(), "the skipped row wrote its output"
    _check_cache(cache, before, ref.final_states, ref.captured_states)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_mamba1_chunked_prefill_matches_public_chunked_scan(backend, cache_dtype):
    kw = {k: v.to(torch.get_default_device()) for k, v in mamba1_inputs(1, sum(LENGTHS), ngroups=2).items()}
    cache = torch.randn(NSLOTS, *kw["initial_states"].shape[1:]).to(cache_dtype)
    before = cache.clone()
    out = torch.full_like(kw["u"][0], float("nan"))
    _mamba1_prefill(_batch(), kw, cache, out, backend=backend, algorithm="chunked", chunk_size=CHUNK)
    ref = mamba1_scan(kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], D=kw["D"], z=kw["z"],
                      delta_bias=kw["delta_bias"], delta_softplus=True, initial_states=_initial(before),
                      cu_seqlens=_cu().to(cache.device), capture=[(s, k) for s, k, _ in CAPTURES], backend=backend,
                      algorithm="chunked", chunk_size=CHUNK, start_positions=POSITIONS)
    live = _live_tokens()
    assert torch.equal(out[:, live], ref.y[0][:, live])
    assert torch.isnan(out[:, -LENGTHS[-1]:]).all(), "the skipped row wrote its output"
    _check_cache(cache, before, ref.final_states, ref.captured_states)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layer", ["mamba2", "mamba1"])
def test_a_step_s_layers_may_differ_in_groups(backend, layer):
    """Layers of one step whose B and C have other group counts (the step shares a workspace and
    replays launches between layers of one shape): each gives the bits of the same layer in a
    step of its own. A workspace shared across group counts had been written past its end."""
    step = _batch()
    for ngroups in (1, 2, 1, 2, 1):
        if layer == "mamba2":
            kw = mamba2_inputs(1, sum(LENGTHS), ngroups=ngroups)
            cache, run, x = torch.randn(NSLOTS, *kw["initial_states"].shape[1:]), _mamba2_prefill, "x"
        else:
            kw = mamba1_inputs(1, sum(LENGTHS), ngroups=ngroups)
            cache, run, x = torch.randn(NSLOTS, *kw["initial_states"].shape[1:]), _mamba1_prefill, "u"
        kw = {k: v.to(torch.get_default_device()) for k, v in kw.items()}
        results = []
        for batch in (step, _batch()):
            c, out = cache.clone().to(torch.get_default_device()), torch.zeros_like(kw[x][0])
            run(batch, kw, c, out, backend=backend, algorithm="chunked", chunk_size=CHUNK)
            results.append((c, out))
        assert torch.equal(results[0][0], results[1][0]), f"cache, ngroups {ngroups}"
        assert torch.equal(results[0][1], results[1][1]), f"out, ngroups {ngroups}"


def test_chunked_prefill_against_float64_references():
    live = _live_tokens()
    tol = TOLERANCE[torch.float32]
    kw, cache = _mamba2_case(torch.float32)
    init = _initial(cache)
    out = torch.empty_like(kw["x"][0])
    _mamba2_prefill(_batch(), kw, cache, out, algorithm="chunked", chunk_size=CHUNK)
    ref = mamba2_scan_ref(kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], D=kw["D"], z=kw["z"], dt_bias=kw["dt_bias"],
                          dt_softplus=True, initial_states=init, cu_seqlens=_cu(),
                          capture=[(s, k) for s, k, _ in CAPTURES])
    assert_rel_close(out[live], ref.y[0][live], tol, "mamba2 y")
    for i, (_, _, slot) in enumerate(WRITTEN):
        assert_rel_close(cache[slot], ref.captured_states[i], tol, f"mamba2 capture {i}")

    kw = mamba1_inputs(1, sum(LENGTHS))
    cache = torch.randn(NSLOTS, *kw["initial_states"].shape[1:])
    init = _initial(cache)
    out = torch.empty_like(kw["u"][0])
    _mamba1_prefill(_batch(), kw, cache, out, algorithm="chunked", chunk_size=CHUNK)
    ref = mamba1_scan_ref(kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], D=kw["D"], z=kw["z"],
                          delta_bias=kw["delta_bias"], delta_softplus=True, initial_states=init, cu_seqlens=_cu(),
                          capture=[(s, k) for s, k, _ in CAPTURES])
    assert_rel_close(out[:, live], ref.y[0][:, live], tol, "mamba1 y")
    for s in LIVE:
        assert_rel_close(cache[SLOTS[s]], ref.final_states[s], tol, f"mamba1 final state {s}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layer", ["mamba2", "mamba1"])
def test_warm_continuation_from_a_grid_point_equals_the_cold_pass(backend, layer):
    """A 40-token prompt cold (capturing the state at 32 into slot 2), then its last 8 tokens warm
    from slot 2 at start position 32: y and the final state bit for bit."""
    n, cut = 40, 2 * CHUNK
    device = torch.get_default_device()
    if layer == "mamba2":
        kw = {k: v.to(device) for k, v in mamba2_inputs(1, n).items()}
        run, tokens, out = _mamba2_prefill, (lambda t, a, b: t[:, a:b]), torch.empty_like(kw["x"][0])
        state_shape = kw["initial_states"].shape[1:]
    else:
        kw = {k: v.to(device) for k, v in mamba1_inputs(1, n).items()}
        run, tokens, out = _mamba1_prefill, (lambda t, a, b: t[..., a:b]), torch.empty_like(kw["u"][0])
        state_shape = kw["initial_states"].shape[1:]
    cache = torch.zeros(3, *state_shape)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
    cold = cache_ops.prefill_batch(i32(0, n), i32(0), has_initial_state=torch.tensor([False]), capture_seq=i32(0),
                                capture_offset=i32(cut), capture_slot=i32(2), start_positions=[0])
    run(cold, kw, cache, out, backend=backend, algorithm="chunked", chunk_size=CHUNK)
    warm_kw = {k: tokens(v, cut, n) if v.ndim >= 2 and v.shape[0] == 1 else v for k, v in kw.items()}
    warm_out = torch.empty_like(tokens(out[None], cut, n)[0])
    warm = cache_ops.prefill_batch(i32(0, n - cut), i32(2), has_initial_state=torch.tensor([True]),
                                start_positions=torch.tensor([cut]))
    run(warm, warm_kw, cache, warm_out, backend=backend, algorithm="chunked", chunk_size=CHUNK)
    assert torch.equal(warm_out, tokens(out[None], cut, n)[0])
    assert torch.equal(cache[2], cache[0])


def test_auto_runs_the_recurrent_scan_on_cpu():
    kw, cache = _mamba2_case(torch.float32)
    outs, caches = [], []
    for algorithm in ("auto", "recurrent"):
        c, out = cache.clone(), torch.empty_like(kw["x"][0])
        _mamba2_prefill(_batch(), kw, c, out, algorithm=algorithm)
        outs.append(out[_live_tokens()])
        caches.append(c)
    assert torch.equal(outs[0], outs[1]) and torch.equal(caches[0], caches[1])


def test_bad_chunked_arguments_raise_naming_them():
    kw, cache = _mamba2_case(torch.float32)
    before = cache.clone()
    out = torch.zeros_like(kw["x"][0])
    with pytest.raises(ValueError, match="start_positions"):
        _mamba2_prefill(_batch(positions=None), kw, cache, out, algorithm="chunked")
    with pytest.raises(ValueError, match="start_positions"):
        _batch(positions=POSITIONS[:-1])
    with pytest.raises(TypeError, match="start_positions"):
        _batch(positions=torch.tensor(POSITIONS, dtype=torch.float32))
    with pytest.raises(TypeError, match="start_positions"):
        _batch(positions=torch.tensor([POSITIONS]))
    with pytest.raises(ValueError, match=r"start_positions\[1\]"):
        _batch(positions=[0, -1, 0, 0, 0, 0])
    for chunk_size, error in ((24, ValueError), (8, ValueError), (2048, ValueError), (16.0, TypeError)):
        with pytest.raises(error, match="chunk_size"):
            _mamba2_prefill(_batch(), kw, cache, out, algorithm="chunked", chunk_size=chunk_size)
    with pytest.raises(ValueError, match="chunk_size"):
        _mamba1_prefill(_batch(), mamba1_inputs(1, sum(LENGTHS)), torch.zeros(NSLOTS, 12, 8),
                        torch.zeros(12, sum(LENGTHS)), algorithm="chunked", chunk_size=512)
    with pytest.raises(ValueError, match="algorithm"):
        _mamba2_prefill(_batch(), kw, cache, out, algorithm="ssd")
    assert torch.equal(cache, before) and not out.any(), "a refused call wrote"


READS = ("tolist", "item", "__int__", "__bool__", "__index__")


def _count_reads(monkeypatch, names=READS) -> list[str]:
    """Patch torch.Tensor's ways of reading values to the host to record their names in the
    returned list (a read's own inner calls are not reads of their own)."""
    reads, depth = [], [0]

    def counted(name, real):
        def read(self, *args):
            if not depth[0]:
                reads.append(name)
            depth[0] += 1
            try:
                return real(self, *args)
            finally:
                depth[0] -= 1
        return read

    for name in names:
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    return reads


@pytest.mark.runs_triton
def test_a_step_reads_its_tensors_back_once(monkeypatch):
    """prefill_batch with start_positions reads the step's index tensors back in one transfer (one
    sync on a GPU), and the layers' chunked calls read nothing back."""
    seq, off, slot = (torch.tensor(c) for c in zip(*CAPTURES))
    cu, slots, has_init = _cu(), torch.tensor(SLOTS, dtype=torch.int32), torch.tensor(HAS_INIT)
    kw, cache = _mamba2_case(torch.float32)
    kw, cache = {k: v.to(cu.device) for k, v in kw.items()}, cache.to(cu.device)
    reads = _count_reads(monkeypatch)
    batch = cache_ops.prefill_batch(cu, slots, has_initial_state=has_init, capture_seq=seq, capture_offset=off,
                                    capture_slot=slot, nslots=NSLOTS, start_positions=POSITIONS)
    assert reads == ["tolist"]
    reads.clear()
    for backend in BACKENDS:
        _mamba2_prefill(batch, kw, cache, torch.empty_like(kw["x"][0]), backend=backend, algorithm="chunked",
                        chunk_size=CHUNK)
        assert reads == [], backend


def _host_batch_args():
    """prefill_batch's arguments for the step of _batch from what an engine holds on the host:
    lengths, start positions, the captures' sequences and offsets (their slots stay on the device)."""
    seq, off, slot = zip(*CAPTURES)
    bounds = [0]
    for n in LENGTHS:
        bounds.append(bounds[-1] + n)
    return (_cu(), torch.tensor(SLOTS, dtype=torch.int32)), dict(
        has_initial_state=torch.tensor(HAS_INIT), capture_seq=list(seq), capture_offset=list(off),
        capture_slot=torch.tensor(slot), validate=False, start_positions=POSITIONS, host_cu_seqlens=bounds)


@pytest.mark.runs_triton
def test_a_step_from_host_data_reads_nothing_back(monkeypatch):
    """Built from host lengths and captures, a step reads nothing back on the chunked Triton paths,
    the conv and the recurrent scans, and gives the bits of a step that read its indices back;
    the PyTorch chunked paths, which plan with the slots on the host, read them back once a step."""
    kw, cache = _mamba2_case(torch.bfloat16)
    kw = {k: v.to(torch.get_default_device()) for k, v in kw.items()}
    cache = cache.to(torch.get_default_device())
    want_cache, want_out = cache.clone(), torch.full_like(kw["x"][0], float("nan"))
    _mamba2_prefill(_batch(), kw, want_cache, want_out, backend="triton", algorithm="chunked", chunk_size=CHUNK)
    args, kwargs = _host_batch_args()
    out = torch.full_like(kw["x"][0], float("nan"))
    xbc, conv_state = torch.randn(8, sum(LENGTHS)), torch.zeros(NSLOTS, 3, 8).transpose(1, 2)
    kw1 = {k: v.to(cache.device) for k, v in mamba1_inputs(1, sum(LENGTHS), ngroups=2).items()}
    mamba1 = lambda b, **options: _mamba1_prefill(b, kw1, torch.zeros(NSLOTS, 12, 8), torch.zeros(12, sum(LENGTHS)),
                                                  algorithm="chunked", chunk_size=CHUNK, **options)
    reads = _count_reads(monkeypatch)
    batch = cache_ops.prefill_batch(*args, **kwargs)
    for algorithm in ("chunked", "recurrent"):
        _mamba2_prefill(batch, kw, cache if algorithm == "chunked" else cache.clone(), out.clone()
                        if algorithm == "recurrent" else out, backend="triton", algorithm=algorithm, chunk_size=CHUNK)
    cache_ops.conv_prefill(batch, xbc, torch.ones(8, 4), conv_state=conv_state, out=torch.empty_like(xbc),
                           backend="triton")
    mamba1(batch, backend="triton")
    assert reads == []
    monkeypatch.undo()
    live = _live_tokens()
    assert torch.equal(out[live], want_out[live]) and torch.equal(cache, want_cache)
    assert torch.isnan(out[-LENGTHS[-1]:]).all(), "the skipped row wrote its output"

    for call in (lambda b: mamba1(b, backend="torch"),
                 lambda b: _mamba2_prefill(b, kw, cache.clone(), out.clone(), backend="torch", algorithm="chunked",
                                           chunk_size=CHUNK)):
        batch = cache_ops.prefill_batch(*args, **kwargs)
        reads = _count_reads(monkeypatch, ["tolist"])
        call(batch)
        call(batch)  # the step's second layer
        monkeypatch.undo()
        assert reads == ["tolist"], "one read a step"


@pytest.mark.runs_triton
@pytest.mark.parametrize("algorithm", ["recurrent", "chunked"])
def test_a_layer_without_validation_gives_the_same_bits(algorithm):
    """validate=False (a step's later layers, as an engine calls them) skips the checks and
    changes nothing else; a non-bool validate is refused."""
    kw, cache = _mamba2_case(torch.float32)
    kw = {k: v.to(torch.get_default_device()) for k, v in kw.items()}
    cache = cache.to(torch.get_default_device())
    results = []
    for validate in (True, False):
        c, out = cache.clone(), torch.zeros_like(kw["x"][0])
        _mamba2_prefill(_batch(), kw, c, out, backend="triton", algorithm=algorithm, chunk_size=CHUNK,
                        validate=validate)
        results.append((c, out))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    with pytest.raises(TypeError, match="validate"):
        _mamba2_prefill(_batch(), kw, cache, torch.zeros_like(kw["x"][0]), algorithm=algorithm, validate=1)


@pytest.mark.runs_triton
def test_a_step_from_host_data_sends_one_copy(monkeypatch):
    """prefill_batch(..., chunk_size=...) from host data sends the step's capture and chunk tables
    to the device in one copy; the step's layers send none."""
    from ssm_kernels.cache_ops import batch as batch_module, chunked as chunked_module
    from ssm_kernels.scan.mamba2_chunked import tables as tables_module
    copies = []
    for module in (batch_module, chunked_module, tables_module):
        real = module.int_tables
        monkeypatch.setattr(module, "int_tables", lambda *a, _real=real: (copies.append(1), _real(*a))[1])
    kw, cache = _mamba2_case(torch.float32)
    kw = {k: v.to(torch.get_default_device()) for k, v in kw.items()}
    args, kwargs = _host_batch_args()
    batch = cache_ops.prefill_batch(*args, **kwargs, chunk_size=CHUNK)
    for _ in range(2):  # two layers
        _mamba2_prefill(batch, kw, cache.to(torch.get_default_device()), torch.empty_like(kw["x"][0]),
                        backend="triton", algorithm="chunked", chunk_size=CHUNK)
    assert copies == [1]


def test_host_data_is_checked():
    """Host lengths and captures are refused with the argument named: not a list, the wrong
    count, not ints, a bad chunk size, (validated) lengths that differ from cu_seqlens, and
    captures outside their sequence, declined ones too."""
    args, kwargs = _host_batch_args()
    bad = [(dict(host_cu_seqlens=tuple(range(3))), ValueError, "host_cu_seqlens"),
           (dict(host_cu_seqlens=torch.tensor(kwargs["host_cu_seqlens"])), TypeError, "host_cu_seqlens"),
           (dict(capture_offset=kwargs["capture_offset"][:-1]), ValueError, "capture_offset"),
           (dict(capture_seq=[0.5] * len(CAPTURES)), TypeError, r"capture_seq\[0\]"),
           (dict(chunk_size=24), ValueError, "chunk_size"),
           (dict(validate=True, host_cu_seqlens=[0] * (len(LENGTHS) + 1)), ValueError, "host_cu_seqlens")]
    # A declined capture's placeholder (the last one's slot is skip_slot, on the device) is checked
    # too: a kernel given it had written other rows' states.
    seq, off = kwargs["capture_seq"], kwargs["capture_offset"]
    bad += [(dict(capture_seq=seq[:-1] + [len(LENGTHS)]), ValueError, r"capture_seq\[7\] = 6 names no sequence"),
            (dict(capture_offset=off[:-1] + [22]), ValueError, r"capture_offset\[7\] = 22 for sequence 2 is outside"),
            (dict(capture_offset=off[:-1] + [-5]), ValueError, r"capture_offset\[7\] = -5")]
    for change, error, name in bad:
        with pytest.raises(error, match=name):
            cache_ops.prefill_batch(*args, **{**kwargs, **change})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("algorithm", ["recurrent", "chunked"])
def test_a_host_step_leaves_a_skipped_row_alone_and_is_checked_against_the_inputs(backend, algorithm):
    """Built from host data, a step whose skipped row (slot -1) holds a declined capture inside
    its tokens leaves that row's out untouched (the Triton recurrent kernel had walked its tokens
    up to the capture's offset and written y there); and the ops check its token count against
    their inputs (a short input had been read and written past its end)."""
    args, kwargs = _host_batch_args()
    skipped = SLOTS.index(-1)
    kwargs = {**kwargs, "capture_seq": kwargs["capture_seq"] + [skipped],
              "capture_offset": kwargs["capture_offset"] + [2],
              "capture_slot": torch.cat([kwargs["capture_slot"], torch.tensor([-1])])}
    device = torch.get_default_device()
    rows = torch.arange(sum(LENGTHS[:skipped]), sum(LENGTHS))
    kw, cache = _mamba2_case(torch.float32)
    kw = {k: v.to(device) for k, v in kw.items()}
    out = torch.full_like(kw["x"][0], float("nan"))
    _mamba2_prefill(cache_ops.prefill_batch(*args, **kwargs), kw, cache.to(device), out, backend=backend,
                    algorithm=algorithm, chunk_size=CHUNK)
    assert torch.isnan(out[rows]).all(), "mamba2_prefill wrote the skipped row's out"
    kw1 = {k: v.to(device) for k, v in mamba1_inputs(1, sum(LENGTHS)).items()}
    out1 = torch.full_like(kw1["u"][0], float("nan"))
    _mamba1_prefill(cache_ops.prefill_batch(*args, **kwargs), kw1, torch.zeros(NSLOTS, *kw1["initial_states"].shape[1:],
                                                                                device=device), out1,
                    backend=backend, algorithm=algorithm, chunk_size=CHUNK)
    assert torch.isnan(out1[:, rows]).all(), "mamba1_prefill wrote the skipped row's out"

    short = {k: v[:, :-4] if k in ("x", "dt", "B", "C", "z") else v for k, v in kw.items()}
    with pytest.raises(ValueError, match=rf"the inputs hold {sum(LENGTHS) - 4} tokens but the batch's cu_seqlens"):
        _mamba2_prefill(cache_ops.prefill_batch(*args, **kwargs), short, cache.to(device), out[:-4], backend=backend,
                        algorithm=algorithm, chunk_size=CHUNK)


class _FilledAllocations(TorchDispatchMode):
    """Every floating-point tensor allocated uninitialised (workspaces, scratch, outputs) is filled
    with `value`: on a GPU such memory holds whatever was there before, NaN or inf included."""

    def __init__(self, value: float):
        super().__init__()
        self.value = value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in _replay.ALLOCATIONS and out.is_floating_point():
            out.fill_(self.value)
        return out


@pytest.mark.parametrize("backend, layer", [("torch", "mamba2"), ("torch", "mamba1"), ("triton", "mamba2"),
                                            ("triton", "mamba2 fused"), ("triton", "mamba1")])
def test_unwritten_memory_reaches_no_output(backend, layer):
    """A pass whose uninitialised allocations hold NaN gives the bits of one whose allocations hold
    zeros: no element a kernel reads without writing it first (a masked-out lane, a row past a
    chunk's end, a chunk's scratch before its stage wrote it) reaches y or the cache, not even as
    0 x NaN in a matmul. 16-bit inputs and cache, the batch's captures, skipped and fresh rows."""
    device = torch.get_default_device()
    if layer == "mamba1":
        kw = mamba1_inputs(1, sum(LENGTHS), ngroups=2)
        kw = {k: v.to(device=device, dtype=torch.bfloat16 if k in ("u", "B", "C", "z") else v.dtype)
              for k, v in kw.items()}
        cache, run, x = torch.randn(NSLOTS, *kw["initial_states"].shape[1:]), _mamba1_prefill, "u"
    else:
        kw, cache = _mamba2_case(torch.float32)
        kw = {k: v.to(device=device, dtype=torch.bfloat16 if k in ("x", "B", "C", "z") else v.dtype)
              for k, v in kw.items()}
        run, x = _mamba2_prefill, "x"
    cache = cache.to(device=device, dtype=torch.bfloat16)
    results = []
    for value in (float("nan"), 0.0):
        out, slots = torch.zeros_like(kw[x][0]), cache.clone()
        with mamba2_triton.fused_pass(layer == "mamba2 fused"), _FilledAllocations(value):
            run(_batch(), kw, slots, out, backend=backend, algorithm="chunked", chunk_size=CHUNK)
        results.append((out, slots))
    assert not results[1][0].isnan().any()
    assert torch.equal(results[0][0], results[1][0]), "y"
    assert torch.equal(results[0][1], results[1][1]), "cache"
