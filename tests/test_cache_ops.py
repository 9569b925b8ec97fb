"""The engine-facing layer (ssm_kernels.cache_ops): states in place in a cache by slot, captures to
slots, skip rows, per-row initial-state flags, cache dtypes; bit-identical to the public ops."""
from __future__ import annotations

import pytest
import torch

from helpers import TOLERANCE, assert_rel_close
from ssm_kernels import causal_conv1d, causal_conv1d_update, mamba1_scan, mamba2_scan, selective_state_update
from ssm_kernels import cache_ops
from ssm_kernels.scan.reference import mamba2_scan_ref

BACKENDS = ["torch", "triton"]


@pytest.fixture(autouse=True)
def tensors_on_the_backends_device(request):
    """The Triton backend's tests (backend="triton", or marked runs_triton) run on CUDA tensors
    where there is a GPU (torch's default device), through the interpreter on CPU tensors elsewhere."""
    backend = request.node.callspec.params.get("backend") if hasattr(request.node, "callspec") else None
    triton = backend == "triton" or request.node.get_closest_marker("runs_triton") is not None
    on_gpu = triton and torch.cuda.is_available()
    torch.set_default_device("cuda" if on_gpu else "cpu")
    yield
    torch.set_default_device(None)  # no default-device mode left behind
LENGTHS = [5, 0, 13, 1, 4]  # row 3 is a padded row (skipped)
SLOTS = [4, 7, 1, -1, 6]
HAS_INIT = [True, False, True, False, False]
CAPTURES = [(0, 2, 8), (2, 13, 0), (2, 0, 9), (2, 6, 3), (4, 4, 11)]  # (sequence, offset, slot)
NSLOTS = 12


def _batch(device=None, validate=True, captures=CAPTURES):
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.int32, device=device)
    seq, off, slot = (torch.tensor(c, device=device) for c in zip(*captures)) if captures else (None,) * 3
    return cache_ops.prefill_batch(cu, torch.tensor(SLOTS, dtype=torch.int32, device=device),
                                has_initial_state=torch.tensor(HAS_INIT, device=device),
                                capture_seq=seq, capture_offset=off, capture_slot=slot,
                                nslots=NSLOTS, validate=validate), cu


def _initial(cache, rows=None):
    """What the public op gets as initial states: the row's slot where it continues, else zeros."""
    init = torch.stack([cache[s].float() if h else torch.zeros_like(cache[0], dtype=torch.float32)
                        for s, h in zip(SLOTS, HAS_INIT)])
    return init


def _stored(got, value, name):
    """`value` (float32) stored in got's dtype, rounded to nearest even (as PyTorch rounds)."""
    assert torch.equal(got, value.to(got.dtype)), name


def _check_cache(cache, before, final, captured, live_rows):
    """Final states in their slots, captures in theirs, every other slot untouched."""
    written = set()
    for s in live_rows:
        _stored(cache[SLOTS[s]], final[s], f"final state of row {s}")
        written.add(SLOTS[s])
    for i, (_, _, slot) in enumerate(CAPTURES):
        _stored(cache[slot], captured[i], f"capture {i}")
        written.add(slot)
    for slot in range(NSLOTS):
        if slot not in written:
            assert torch.equal(cache[slot], before[slot], ) or torch.isnan(before[slot]).all(), f"slot {slot} changed"


LIVE = [s for s in range(len(LENGTHS)) if SLOTS[s] != -1]


def _live_tokens(cu):
    bounds = cu.tolist()
    return torch.cat([torch.arange(bounds[s], bounds[s + 1]) for s in LIVE])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("validate", [True, False])
def test_mamba2_prefill_matches_public_scan(backend, cache_dtype, validate, monkeypatch):
    T, H, P, G, N = sum(LENGTHS), 4, 8, 2, 16
    x, z = torch.randn(T, H, P), torch.randn(T, H, P)
    dt, A = torch.randn(T, H) * 0.5, -(torch.rand(H) + 0.5)
    B, C = torch.randn(T, G, N), torch.randn(T, G, N)
    D, dt_bias = torch.randn(H), torch.randn(H) * 0.5
    cache = torch.randn(NSLOTS, H, P, N).to(cache_dtype)
    before = cache.clone()
    batch, cu = _batch(validate=validate)
    out = torch.full_like(x, float("nan"))
    cache_ops.mamba2_prefill(batch, x, dt, A, B, C, ssm_state=cache, out=out, D=D, z=z, dt_bias=dt_bias,
                          dt_softplus=True, backend=backend)
    ref = mamba2_scan(x[None], dt[None], A, B[None], C[None], D=D, z=z[None], dt_bias=dt_bias, dt_softplus=True,
                      initial_states=_initial(before), cu_seqlens=cu,
                      capture=[(s, k) for s, k, _ in CAPTURES], backend=backend)
    live = _live_tokens(cu)
    assert torch.equal(out[live], ref.y[0][live])
    skipped = torch.arange(int(cu[3]), int(cu[4]))
    assert torch.isnan(out[skipped]).all(), "a skipped row wrote its output"
    _check_cache(cache, before, ref.final_states, ref.captured_states, LIVE)


def test_mamba2_prefill_against_float64_reference():
    T, H, P, G, N = sum(LENGTHS), 4, 8, 1, 16
    x, dt, A = torch.randn(T, H, P), torch.randn(T, H) * 0.5, -(torch.rand(H) + 0.5)
    B, C, D = torch.randn(T, G, N), torch.randn(T, G, N), torch.randn(H)
    cache = torch.randn(NSLOTS, H, P, N)
    init = _initial(cache)
    batch, cu = _batch()
    out = torch.empty_like(x)
    cache_ops.mamba2_prefill(batch, x, dt, A, B, C, ssm_state=cache, out=out, D=D, dt_softplus=True)
    ref = mamba2_scan_ref(x[None], dt[None], A, B[None], C[None], D=D, dt_softplus=True, initial_states=init,
                          cu_seqlens=cu, capture=[(s, k) for s, k, _ in CAPTURES])
    live = _live_tokens(cu)
    assert_rel_close(out[live], ref.y[0][live], TOLERANCE[torch.float32], "y")
    for i, (_, _, slot) in enumerate(CAPTURES):
        assert_rel_close(cache[slot], ref.captured_states[i], TOLERANCE[torch.float32], f"capture {i}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_mamba1_prefill_matches_public_scan(backend, monkeypatch):
    T, dim, N, G = sum(LENGTHS), 12, 8, 2
    u, delta, z = torch.randn(dim, T), torch.randn(dim, T) * 0.5, torch.randn(dim, T)
    A, B, C = -(torch.rand(dim, N) + 0.5), torch.randn(G, N, T), torch.randn(G, N, T)
    D, bias = torch.randn(dim), torch.randn(dim) * 0.5
    cache = torch.randn(NSLOTS, dim, N).to(torch.bfloat16)
    before = cache.clone()
    batch, cu = _batch()
    out = torch.full_like(u, float("nan"))
    cache_ops.mamba1_prefill(batch, u, delta, A, B, C, ssm_state=cache, out=out, D=D, z=z, delta_bias=bias,
                          delta_softplus=True, backend=backend)
    ref = mamba1_scan(u[None], delta[None], A, B[None], C[None], D=D, z=z[None], delta_bias=bias,
                      delta_softplus=True, initial_states=_initial(before), cu_seqlens=cu,
                      capture=[(s, k) for s, k, _ in CAPTURES], backend=backend)
    live = _live_tokens(cu)
    assert torch.equal(out[:, live], ref.y[0][:, live])
    _check_cache(cache, before, ref.final_states, ref.captured_states, LIVE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("vllm_layout", [False, True])
def test_conv_prefill_matches_public_conv(backend, vllm_layout):
    T, dim, width = sum(LENGTHS), 40, 4
    x = torch.randn(dim, T)
    weight, bias = torch.randn(dim, width), torch.randn(dim)
    if vllm_layout:  # vLLM keeps (nslots, width - 1, dim) and passes the transpose
        cache = torch.randn(NSLOTS, width - 1, dim).transpose(1, 2)
    else:
        cache = torch.randn(NSLOTS, dim, width - 1)
    before = cache.clone()
    batch, cu = _batch()
    out = torch.full_like(x, float("nan"))
    cache_ops.conv_prefill(batch, x, weight, bias, conv_state=cache, out=out, activation="silu", backend=backend)
    ref = causal_conv1d(x[None], weight, bias, activation="silu", initial_states=_initial(before),
                        cu_seqlens=cu, capture=[(s, k) for s, k, _ in CAPTURES], backend=backend)
    live = _live_tokens(cu)
    assert torch.equal(out[:, live], ref.out[0][:, live])
    _check_cache(cache, before, ref.final_states, ref.captured_states, LIVE)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mamba2_decode_matches_selective_state_update(backend):
    H, P, G, N, nslots = 4, 8, 2, 16, 9
    slots, dst = [3, 0, 5, 7], [3, 2, 5, 8]  # row 1 is padding (NULL_BLOCK_ID 0); row 3 moves its state
    x, dt = torch.randn(4, H, P), torch.randn(4, H)
    A, B, C = -(torch.rand(H) + 0.5), torch.randn(4, G, N), torch.randn(4, G, N)
    D, z, bias = torch.randn(H), torch.randn(4, H, P), torch.randn(H)
    cache = torch.randn(nslots, H, P, N).to(torch.bfloat16)
    before = cache.clone()
    batch = cache_ops.decode_batch(torch.tensor(slots), dst_state_indices=torch.tensor(dst),
                                skip_slot=cache_ops.NULL_BLOCK_ID, nslots=nslots)
    out = torch.full_like(x, float("nan"))
    cache_ops.mamba2_decode(batch, x, dt, A, B, C, ssm_state=cache, out=out, D=D, z=z, dt_bias=bias,
                         dt_softplus=True, backend=backend)
    state = before.float()
    live = [0, 2, 3]
    y = selective_state_update(state, x[live], dt[live], A, B[live], C[live], D=D, z=z[live], dt_bias=bias,
                               dt_softplus=True, state_indices=torch.tensor([slots[r] for r in live]),
                               backend=backend)
    assert torch.equal(out[live], y)
    assert torch.isnan(out[1]).all()
    for r in live:
        _stored(cache[dst[r]], state[slots[r]], f"row {r}'s state")
    for slot in set(range(nslots)) - {dst[r] for r in live}:
        assert torch.equal(cache[slot], before[slot])


@pytest.mark.parametrize("backend", BACKENDS)
def test_mamba1_decode_matches_one_token_scan(backend):
    dim, N, nslots = 12, 8, 5
    slots = torch.tensor([4, 1])
    u, delta, z = torch.randn(2, dim), torch.randn(2, dim) * 0.5, torch.randn(2, dim)
    A, B, C, D = -(torch.rand(dim, N) + 0.5), torch.randn(2, N), torch.randn(2, N), torch.randn(dim)
    cache = torch.randn(nslots, dim, N)
    before = cache.clone()
    out = torch.empty_like(u)
    cache_ops.mamba1_decode(cache_ops.decode_batch(slots), u, delta, A, B, C, ssm_state=cache, out=out, D=D, z=z,
                         delta_softplus=True, backend=backend)
    ref = mamba1_scan(u[:, :, None], delta[:, :, None], A, B[:, :, None], C[:, :, None], D=D, z=z[:, :, None],
                      delta_softplus=True, initial_states=before[slots], backend=backend)
    assert torch.equal(out, ref.y[:, :, 0])
    assert torch.equal(cache[slots], ref.final_states)


@pytest.mark.parametrize("backend", BACKENDS)
def test_conv_decode_matches_update(backend):
    dim, width, nslots = 40, 4, 6
    slots = torch.tensor([5, -1, 2])
    x, weight, bias = torch.randn(3, dim), torch.randn(dim, width), torch.randn(dim)
    cache = torch.randn(nslots, width - 1, dim).transpose(1, 2)
    before = cache.clone()
    out = torch.full_like(x, float("nan"))
    cache_ops.conv_decode(cache_ops.decode_batch(slots), x, weight, bias, conv_state=cache, out=out, activation="silu",
                       backend=backend)
    pool = before.clone()
    y = causal_conv1d_update(x[[0, 2]], pool, weight, bias, "silu", torch.tensor([5, 2]), backend=backend)
    assert torch.equal(out[[0, 2]], y)
    assert torch.isnan(out[1]).all()
    assert torch.equal(cache, pool)


def test_split_passes_through_the_cache_are_bit_identical():
    """A sequence prefilled in two steps through the cache (the engine's chunked prefill), with a
    capture in each, equals one pass: the warm restore a prefix cache relies on."""
    T, H, P, G, N = 37, 2, 4, 1, 8
    x, dt, A = torch.randn(T, H, P), torch.randn(T, H), -(torch.rand(H) + 0.5)
    B, C = torch.randn(T, G, N), torch.randn(T, G, N)
    run = lambda xs, cu, slot, init, caps, cache, out: cache_ops.mamba2_prefill(
        cache_ops.prefill_batch(torch.tensor(cu), torch.tensor([slot]), has_initial_state=torch.tensor([init]),
                             capture_seq=torch.tensor([0] * len(caps)),
                             capture_offset=torch.tensor([k for k, _ in caps]),
                             capture_slot=torch.tensor([s for _, s in caps])),
        *xs, ssm_state=cache, out=out, dt_softplus=True)
    one, split = torch.zeros(4, H, P, N), torch.zeros(4, H, P, N)
    y1, y2 = torch.empty_like(x), torch.empty_like(x)
    run((x, dt, A, B, C), [0, T], 0, False, [(16, 1), (32, 2)], one, y1)
    run((x[:20], dt[:20], A, B[:20], C[:20]), [0, 20], 0, False, [(16, 1)], split, y2[:20])
    run((x[20:], dt[20:], A, B[20:], C[20:]), [0, T - 20], 0, True, [(12, 2)], split, y2[20:])
    assert torch.equal(y1, y2) and torch.equal(one, split)


def test_validation_names_the_argument():
    cu = torch.tensor([0, 3, 5])
    with pytest.raises(ValueError, match="state_indices must be distinct"):
        cache_ops.prefill_batch(cu, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"state_indices\[1\] = 9 is out of range"):
        cache_ops.prefill_batch(cu, torch.tensor([1, 9]), nslots=4)
    with pytest.raises(ValueError, match=r"capture_offset\[0\] = 4 for sequence 0"):
        cache_ops.prefill_batch(cu, torch.tensor([1, 2]), capture_seq=torch.tensor([0]),
                             capture_offset=torch.tensor([4]), capture_slot=torch.tensor([3]))
    with pytest.raises(ValueError, match="capture_slot .* is also a row's state slot"):
        cache_ops.prefill_batch(cu, torch.tensor([1, 2]), capture_seq=torch.tensor([0]),
                             capture_offset=torch.tensor([1]), capture_slot=torch.tensor([2]))
    with pytest.raises(ValueError, match="go together"):
        cache_ops.prefill_batch(cu, torch.tensor([1, 2]), capture_seq=torch.tensor([0]))
    with pytest.raises(TypeError, match="has_initial_state must have dtype bool"):
        cache_ops.prefill_batch(cu, torch.tensor([1, 2]), has_initial_state=torch.tensor([1, 0]))
    batch = cache_ops.prefill_batch(cu, torch.tensor([1, 2]))
    x = torch.randn(5, 2, 4)
    with pytest.raises(TypeError, match="out must have the input's dtype"):
        cache_ops.mamba2_prefill(batch, x, torch.randn(5, 2), -torch.rand(2), torch.randn(5, 1, 8),
                                 torch.randn(5, 1, 8), ssm_state=torch.zeros(3, 2, 4, 8),
                                 out=torch.empty(5, 2, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="ssm_state must have shape"):
        cache_ops.mamba2_prefill(batch, x, torch.randn(5, 2), -torch.rand(2), torch.randn(5, 1, 8),
                                 torch.randn(5, 1, 8), ssm_state=torch.zeros(3, 2, 4, 9), out=torch.empty_like(x))
    with pytest.raises(TypeError, match="batch must be a PrefillBatch"):
        cache_ops.conv_prefill(cache_ops.decode_batch(torch.tensor([0])), torch.randn(4, 5), torch.randn(4, 3),
                            conv_state=torch.zeros(2, 4, 2), out=torch.empty(4, 5))


def test_a_capture_to_the_skip_slot_is_dropped():
    """An engine proposes captures on the device and declines some by pointing them at the skip
    slot (vLLM: a block-table entry left null): nothing is written for those."""
    T, H, P, G, N = 20, 2, 4, 1, 8
    x, dt, A = torch.randn(T, H, P), torch.randn(T, H), -(torch.rand(H) + 0.5)
    B, C = torch.randn(T, G, N), torch.randn(T, G, N)
    for backend in BACKENDS if not torch.cuda.is_available() else ["torch"]:
        cache = torch.zeros(5, H, P, N)
        conv_cache = torch.zeros(5, 12, 3)
        batch = cache_ops.prefill_batch(torch.tensor([0, T]), torch.tensor([0]), capture_seq=torch.tensor([0, 0]),
                                     capture_offset=torch.tensor([8, 16]), capture_slot=torch.tensor([-1, 3]))
        cache_ops.mamba2_prefill(batch, x, dt, A, B, C, ssm_state=cache, out=torch.empty_like(x), backend=backend)
        cache_ops.conv_prefill(batch, torch.randn(12, T), torch.randn(12, 4), conv_state=conv_cache,
                            out=torch.empty(12, T), backend=backend)
        ref = mamba2_scan(x[None], dt[None], A, B[None], C[None], capture=[(0, 16)], backend=backend)
        assert torch.equal(cache[3], ref.captured_states[0])
        for slot in (1, 2, 4):
            assert not cache[slot].any() and not conv_cache[slot].any(), f"{backend}: slot {slot} written"


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_parallel_head_slices_give_the_full_layer(backend):
    """Tensor parallelism hands each rank a contiguous slice of heads with the group replicated
    (ngroups 1) and a cache of its own: per-rank calls reproduce the full layer, bit for bit on the
    Triton path (one program per head); the PyTorch path computes all of a rank's heads in one
    vector op, whose rounding of exp/softplus depends on the vector's length, so there to rounding."""
    T, H, P, N, tp = 30, 8, 4, 8, 2
    x, dt, A = torch.randn(T, H, P), torch.randn(T, H), -(torch.rand(H) + 0.5)
    B, C, D, bias = torch.randn(T, 1, N), torch.randn(T, 1, N), torch.randn(H), torch.randn(H)
    batch = cache_ops.prefill_batch(torch.tensor([0, 12, T]), torch.tensor([2, 5]), capture_seq=torch.tensor([1]),
                                 capture_offset=torch.tensor([9]), capture_slot=torch.tensor([7]))
    full, y = torch.zeros(8, H, P, N), torch.empty_like(x)
    cache_ops.mamba2_prefill(batch, x, dt, A, B, C, ssm_state=full, out=y, D=D, dt_bias=bias, dt_softplus=True,
                          backend=backend)
    h = H // tp
    for rank in range(tp):
        heads = slice(rank * h, (rank + 1) * h)
        cache, y_rank = torch.zeros(8, h, P, N), torch.empty(T, h, P)
        cache_ops.mamba2_prefill(batch, x[:, heads], dt[:, heads], A[heads], B, C, ssm_state=cache, out=y_rank,
                              D=D[heads], dt_bias=bias[heads], dt_softplus=True, backend=backend)
        if backend == "triton":
            assert torch.equal(y_rank, y[:, heads]) and torch.equal(cache, full[:, heads])
        else:
            assert_rel_close(y_rank, y[:, heads], 1e-6, "y")
            assert_rel_close(cache, full[:, heads], 1e-6, "states")


def test_the_pytorch_paths_read_a_device_only_batch_back_once():
    """A batch whose lengths and captures stayed on the device (a CUDA batch built with
    validate=False and no start_positions; made here on CPU tensors through the same builder):
    the PyTorch paths read its tables back once a step and give the on-host batch's bits, a
    declined capture among the others included (they had walked its placeholder lengths and
    computed nothing, or failed on its captures)."""
    from ssm_kernels.cache_ops import batch as batch_module

    captures = CAPTURES[:2] + [(1, 3, -1)] + CAPTURES[2:]  # a declined capture, placeholder values
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist())
    seq, off, slot = (torch.tensor(c) for c in zip(*captures))
    args = (cu, torch.tensor(SLOTS), torch.tensor(HAS_INIT), seq, off, slot, -1)
    on_host = cache_ops.prefill_batch(*args[:2], has_initial_state=args[2], capture_seq=seq, capture_offset=off,
                                      capture_slot=slot, nslots=NSLOTS)
    T, H, P, G, N, dim = sum(LENGTHS), 2, 4, 1, 8, 6
    x, dt, A = torch.randn(T, H, P), torch.randn(T, H), -(torch.rand(H) + 0.5)
    B, C = torch.randn(T, G, N), torch.randn(T, G, N)
    u, delta, A1 = torch.randn(dim, T), torch.randn(dim, T), -(torch.rand(dim, N) + 0.5)
    xc, weight = torch.randn(dim, T), torch.randn(dim, 4)
    caches = (torch.randn(NSLOTS, H, P, N), torch.randn(NSLOTS, dim, N), torch.randn(NSLOTS, dim, 3))
    results = []
    for batch in (on_host, batch_module._device_batch(*args)):
        assert batch.device_only == (batch is not on_host)
        state2, state1, conv = (c.clone() for c in caches)
        y2, y1, yc = torch.zeros_like(x), torch.zeros_like(u), torch.zeros_like(xc)
        cache_ops.mamba2_prefill(batch, x, dt, A, B, C, ssm_state=state2, out=y2, backend="torch", validate=False)
        cache_ops.mamba1_prefill(batch, u, delta, A1, B[:, 0].T, C[:, 0].T, ssm_state=state1, out=y1,
                                 backend="torch", validate=False)
        cache_ops.conv_prefill(batch, xc, weight, conv_state=conv, out=yc, activation="silu", backend="torch",
                               validate=False)
        results.append((y2, y1, yc, state2, state1, conv))
        if batch.device_only:
            assert list(batch.prepared) == ["host view"]  # read back once for the three layers
    for name, got, want in zip(("y2", "y1", "yc", "state2", "state1", "conv"), results[1], results[0]):
        assert torch.equal(got, want), name
    assert results[0][0].abs().sum() > 0


@pytest.mark.runs_triton
def test_conv_prefill_launches_over_the_longest_sequence_not_the_pass(monkeypatch):
    """A batch with host lengths (as an engine builds it) sizes the conv's grid by its longest
    sequence; only a device-only batch (lengths unknown on the host) covers the whole pass."""
    from ssm_kernels.cache_ops import batch as batch_module
    from ssm_kernels.conv import triton_kernel as conv_triton

    grids, real = [], conv_triton.launch

    def launch(kernel, grid, *args, **kwargs):
        grids.append(grid)
        real(kernel, grid, *args, **kwargs)
    monkeypatch.setattr(conv_triton, "launch", launch)
    lengths = [130, 3, 0, 1, 140]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    x, weight = torch.randn(8, sum(lengths)), torch.randn(8, 4)
    slots = torch.arange(len(lengths))
    outs = []
    for batch in (cache_ops.prefill_batch(cu, slots, nslots=8),
                  batch_module._device_batch(cu, slots, None, None, None, None, -1)):
        out = torch.zeros_like(x)
        cache_ops.conv_prefill(batch, x, weight, conv_state=torch.zeros(8, 8, 3), out=out, activation="silu",
                               backend="triton")
        outs.append(out)
    assert grids[0][0] < grids[1][0]  # time tiles: of 140 tokens, of the pass's 274
    assert torch.equal(outs[0], outs[1])
