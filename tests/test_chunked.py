"""mamba2_scan(algorithm="chunked"): accuracy against float64, captures, varlen, restores, input checks.

The Triton kernels run through the interpreter here, with small chunks (16) so that short
sequences cross several chunk boundaries and end in partial chunks.
"""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from helpers import assert_rel_close, mamba2_inputs, mamba2_positional
from ssm_kernels import mamba2_scan
from ssm_kernels._common import Sequences, make_capture_table
from ssm_kernels._triton import launch
from ssm_kernels.scan.mamba2_chunked import AUTO_CHUNKED_MIN_TOKENS, resolve_algorithm
from ssm_kernels.scan.mamba2_chunked import tables as chunk_tables
from ssm_kernels.scan.mamba2_chunked import triton_kernel as tk
from ssm_kernels.scan.mamba2_chunked.tables import plan_chunks
from ssm_kernels.scan.reference import mamba2_scan_ref

BACKENDS = ["triton", "torch"]
CHUNK = 16
# RMS-relative error allowed against float64: full-precision fp32 matmuls, or 16-bit matmuls.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
SMALL = dict(nheads=4, headdim=16, ngroups=2, dstate=16)


def chunked(*args, backend, chunk_size=CHUNK, **kw):
    return mamba2_scan(*args, **kw, backend=backend, algorithm="chunked", chunk_size=chunk_size)


def captures_for(lengths):
    """Captures at 0, 1, len-1, len, on and next to chunk boundaries, inside chunks; shuffled,
    with one duplicate."""
    pairs = set()
    for s, n in enumerate(lengths):
        points = {0, 1, n - 1, n, n // 2} | {b + d for b in range(CHUNK, n, CHUNK) for d in (-1, 0, 1)}
        pairs |= {(s, k) for k in points if 0 <= k <= n}
    pairs = sorted(pairs)
    pairs = [pairs[i] for i in torch.randperm(len(pairs)).tolist()]
    return pairs + pairs[:1]


def check(got, want, dtype, what):
    tol = TOLERANCE[dtype]
    assert got.y.dtype == dtype
    assert got.final_states.dtype == torch.float32 and got.captured_states.dtype == torch.float32
    assert_rel_close(got.y, want.y, tol, f"{what} y")
    assert_rel_close(got.final_states, want.final_states, tol, f"{what} final_states")
    assert got.captured_states.shape == want.captured_states.shape
    if want.captured_states.numel():
        assert_rel_close(got.captured_states, want.captured_states, tol, f"{what} captured_states")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seqlen", [1, 7, 17, 63])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_options_against_float64(backend, seqlen, dtype, device):
    args, kw = mamba2_positional(mamba2_inputs(2, seqlen, **SMALL, dtype=dtype, device=device))
    kw.update(dt_softplus=True, capture=captures_for([seqlen, seqlen]))
    check(chunked(*args, **kw, backend=backend), mamba2_scan_ref(*args, **kw), dtype, f"{backend} {seqlen}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_with_empty_and_one_token_sequences(backend, device):
    lengths = [0, 1, 17, 0, 33, 7, 16]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    args, kw = mamba2_positional(mamba2_inputs(1, sum(lengths), **SMALL, nseq=len(lengths), device=device))
    kw.update(dt_softplus=True, cu_seqlens=cu, capture=torch.tensor(captures_for(lengths), device=device))
    check(chunked(*args, **kw, backend=backend), mamba2_scan_ref(*args, **kw), torch.float32, "varlen")


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_empty_sequences(backend, device):
    args, kw = mamba2_positional(mamba2_inputs(1, 0, **SMALL, nseq=2, device=device))
    got = chunked(*args, **kw, cu_seqlens=torch.tensor([0, 0, 0], device=device), capture=[(1, 0)], backend=backend)
    assert got.y.shape == args[0].shape
    assert torch.equal(got.final_states, kw["initial_states"])
    assert torch.equal(got.captured_states[0], kw["initial_states"][1])


VARIANTS = {
    "plain": dict(),  # no D, z, dt_bias, initial states; no softplus
    "D_per_row": dict(D_per_row=True),
    "dt_limit": dict(dt_limit=(0.05, 0.4)),  # no softplus: negative dt clamps to 0.05
    "one_group": dict(ngroups=1),
    "group_per_head": dict(ngroups=4),
    "odd_dims": dict(headdim=12, dstate=10),  # masked tiles
    "two_p_blocks": dict(nheads=2, headdim=80, ngroups=1),
    "big_chunk": dict(nheads=2, ngroups=1, seqlen=150, chunk_size=128),  # several M and K blocks
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants(backend, variant, device):
    opts = dict(SMALL, **VARIANTS[variant])
    seqlen, chunk_size, dt_limit = opts.pop("seqlen", 40), opts.pop("chunk_size", CHUNK), opts.pop("dt_limit", None)
    args, kw = mamba2_positional(mamba2_inputs(2, seqlen, **opts, device=device))
    if variant == "plain":
        kw = {}  # dt' = dt clamped at 0
    elif dt_limit:
        kw["dt_limit"] = dt_limit
    else:
        kw["dt_softplus"] = True
    kw["capture"] = [(0, 5), (1, 33), (0, seqlen)]
    got = chunked(*args, **kw, chunk_size=chunk_size, backend=backend)
    check(got, mamba2_scan_ref(*args, **kw), torch.float32, variant)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("headdim, dstate", [(12, 10), (5, 7), (16, 16)])
def test_inner_captures_of_16bit_passes(dtype, headdim, dstate, device):
    """Captures inside chunks are built from the float32 start state and a 16-bit partial sum, at
    odd and even state sizes."""
    args, kw = mamba2_positional(mamba2_inputs(2, 40, nheads=3, headdim=headdim, ngroups=1, dstate=dstate,
                                               dtype=dtype, device=device))
    kw.update(dt_softplus=True, capture=[(0, 5), (1, 17), (0, 33), (1, 39), (0, 16)])
    check(chunked(*args, **kw, backend="triton"), mamba2_scan_ref(*args, **kw), dtype, f"{headdim}x{dstate}")


@pytest.mark.parametrize("dtype, bc_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                             (torch.bfloat16, torch.float32)])
def test_one_token_passes_of_16bit_inputs(dtype, bc_dtype, device):
    """A 1-token pass's y is its one weight, C B^T dt', times x: C B^T multiplies B and C in their
    own dtype, exactly, so that a dot over dstate that cancels does not magnify their rounding
    (rounded to bfloat16, float16's put y of some of these passes at 2e-2 to 5e-2)."""
    for seed in range(40):
        torch.manual_seed(seed)
        args, kw = mamba2_positional(mamba2_inputs(2, 1, nheads=1, headdim=17, ngroups=1, dstate=64, dtype=dtype,
                                                   device=device))
        if bc_dtype != dtype:  # B and C of their own dtype, not x's values widened
            args = args[:3] + tuple(torch.randn(t.shape, device=device, dtype=bc_dtype) for t in args[3:])
        kw = dict(z=kw["z"], dt_bias=kw["dt_bias"], dt_softplus=True)
        got = chunked(*args, **kw, chunk_size=64, start_positions=[63, 63], backend="triton")
        assert_rel_close(got.y, mamba2_scan_ref(*args, **kw).y, TOLERANCE[dtype], f"seed {seed} y")


@pytest.mark.parametrize("backend", BACKENDS)
def test_captures_leave_y_and_final_states_bitwise_unchanged(backend, device):
    lengths = [20, 1, 0, 35]
    args, kw = mamba2_positional(mamba2_inputs(1, sum(lengths), **SMALL, nseq=len(lengths),
                                               dtype=torch.bfloat16, device=device))
    kw.update(dt_softplus=True, cu_seqlens=torch.tensor([0, 20, 21, 21, 56], device=device))
    bare = chunked(*args, **kw, backend=backend)
    many = chunked(*args, **kw, capture=captures_for(lengths), backend=backend)
    assert torch.equal(many.y, bare.y) and torch.equal(many.final_states, bare.final_states)
    assert bare.captured_states.shape[0] == 0


def test_output_kernel_split_over_launches_gives_the_same_bits(monkeypatch, device):
    """A pass with more chunks than a grid's third axis holds runs the output kernel in several
    launches, each from its first chunk: the same bits as one launch."""
    lengths = [40, 1, 0, 35]  # 3 + 1 + 3 chunks of 16
    args, kw = mamba2_positional(mamba2_inputs(1, sum(lengths), **SMALL, nseq=len(lengths),
                                               dtype=torch.bfloat16, device=device))
    kw.update(dt_softplus=True, cu_seqlens=torch.tensor([0, 40, 41, 41, 76], device=device))
    whole = chunked(*args, **kw, backend="triton")
    monkeypatch.setattr(tk, "MAX_GRID_Z", 3)
    split = chunked(*args, **kw, backend="triton")
    assert torch.equal(split.y, whole.y) and torch.equal(split.final_states, whole.final_states)
    assert_rel_close(whole.y, mamba2_scan_ref(*args, **kw).y, TOLERANCE[torch.bfloat16], "y")


@pytest.mark.parametrize("lengths, varlen, starts, row_chunks", [
    ([37, 37, 37], False, [0, 0, 0], 3),  # dense, from the grid's origin
    ([37, 37], False, [32, 64], 3),  # dense, resumed on the grid
    ([37, 37], False, [0, 5], 0),  # a row resumed off the grid
    ([37], True, [16], 3),  # varlen, one sequence
    ([37, 37], True, [0, 0], 0),  # varlen, two sequences: row 0 holds both
    ([0, 0], False, [0, 0], 0),  # no chunks
])
def test_row_chunks_only_where_each_sequence_starts_its_row_on_the_grid(lengths, varlen, starts, row_chunks):
    seqs = Sequences(None, lengths, varlen)
    plan = plan_chunks(seqs, [], CHUNK, starts)
    assert plan.row_chunks == row_chunks
    if row_chunks:  # chunk c is chunk c % row_chunks of row c // row_chunks, from its index alone
        assert plan.chunk_list == [(c // row_chunks * (not varlen), c % row_chunks * CHUNK,
                                    min(CHUNK, lengths[0] - c % row_chunks * CHUNK))
                                   for c in range(len(plan.chunk_list))]


PASS = dict(lengths=(37, 0, 5), varlen=True, captures=((0, 20), (2, 5)), chunk=CHUNK, starts=(16, 0, 3))


def _tables(make, device=torch.device("cpu"), **changes):
    """make (make_chunk_tables, or a recent pass's tables) for PASS with `changes`."""
    p = {**PASS, **changes}
    seqs = Sequences(None, list(p["lengths"]), p["varlen"])
    return make(seqs, make_capture_table(list(p["captures"]), seqs, torch.device("cpu")), p["chunk"],
                list(p["starts"]), device)


def _recent(**changes):
    return _tables(lambda *args: chunk_tables.recent_pass(*args).tables, **changes)


def _same_tables(a, b) -> bool:
    return all(torch.equal(getattr(a, f.name), getattr(b, f.name)) if isinstance(getattr(a, f.name), torch.Tensor)
               else getattr(a, f.name) == getattr(b, f.name) for f in dataclasses.fields(a))


def test_a_pass_like_a_recent_one_takes_its_tables():
    """A model's layers run one pass after another on the same sequences: its chunk tables are
    planned and copied once. Captures at the same places in another order take them too (each
    call's own row table says where each capture goes); a pass that differs in lengths, layout,
    captures, chunk size or start positions gets tables of its own, as planned afresh."""
    first = _recent()
    assert _recent() is first
    assert _recent(captures=((2, 5), (0, 20))) is first
    for other in [dict(lengths=(37, 0, 6)), dict(varlen=False), dict(captures=((0, 21), (2, 5))),
                  dict(captures=((0, 20), (2, 5), (2, 5))), dict(chunk=32), dict(starts=(5, 0, 3))]:
        got = _recent(**other)
        assert got is not first and not _same_tables(got, first), other
        assert _same_tables(got, _tables(chunk_tables.make_chunk_tables, **other)), other
    for n in range(chunk_tables.RECENT_TABLES):
        _recent(lengths=(40 + n, 0, 5))
    assert _recent() is not first and _same_tables(_recent(), first)  # forgotten, planned again alike


def test_recent_tables_are_kept_per_stream_and_never_for_a_captured_graph(monkeypatch):
    """On a GPU the tables' copy runs on the pass's stream: a pass on another stream gets tables of
    its own, and a pass captured into a CUDA graph, which would keep reading them after this
    cache let them go, always does."""
    real = chunk_tables.int_tables
    monkeypatch.setattr(chunk_tables, "int_tables", lambda device, *lists: real(torch.device("cpu"), *lists))
    current = {"stream": 1, "capturing": False}
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: SimpleNamespace(cuda_stream=current["stream"]))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: current["capturing"])
    cuda = torch.device("cuda", 0)
    first = _recent(device=cuda)
    assert _recent(device=cuda) is first
    assert _recent() is not first  # another device
    current["stream"] = 2
    second = _recent(device=cuda)
    assert second is not first and _same_tables(second, first)
    current["capturing"] = True
    assert _recent(device=cuda) is not second and _recent(device=cuda) is not _recent(device=cuda)


@pytest.mark.parametrize("backend", BACKENDS)
def test_passes_one_after_another_each_on_its_own_tables(backend, device):
    """A pass between two like passes, with other lengths and captures, gives what it gives alone."""
    args, kw = mamba2_positional(mamba2_inputs(1, 40, **SMALL, nseq=2, device=device))
    kw.update(dt_softplus=True)
    cu = lambda bounds: torch.tensor(bounds, device=device)
    a = dict(cu_seqlens=cu([0, 23, 40]), capture=[(0, 5), (1, 17)], start_positions=[16, 0])
    b = dict(cu_seqlens=cu([0, 9, 40]), capture=[(1, 30)], start_positions=[0, 32])
    alone = chunked(*args, **kw, **b, backend=backend)
    chunk_tables._recent_tables.cache_clear()
    first = chunked(*args, **kw, **a, backend=backend)
    between = chunked(*args, **kw, **b, backend=backend)
    again = chunked(*args, **kw, **a, backend=backend)
    for got, want in [(between, alone), (again, first)]:
        assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("batch, cu_seqlens, starts", [(3, None, [0, 32, 0]), (1, [0, 45], [16])])
def test_output_kernel_spans_from_the_chunk_index_give_the_tables_bits(monkeypatch, batch, cu_seqlens, starts,
                                                                      device):
    """Where ChunkTables.row_chunks holds, the output kernel finds each chunk's span from its
    index: y as from the chunk table, bit for bit."""
    seqlen = 45 if cu_seqlens is None else cu_seqlens[-1]
    args, kw = mamba2_positional(mamba2_inputs(batch, seqlen, **SMALL, dtype=torch.bfloat16, device=device))
    kw.update(dt_softplus=True, start_positions=starts, capture=[(0, 20)])
    if cu_seqlens is not None:
        kw.update(cu_seqlens=torch.tensor(cu_seqlens, device=device))
    row_chunks, at = [], tk._chunk_output_kernel.arg_names.index("row_chunks")

    def recording(kernel, grid, *a, **k):
        if kernel is tk._chunk_output_kernel:
            row_chunks.append(a[at])
        launch(kernel, grid, *a, **k)

    monkeypatch.setattr(tk, "launch", recording)
    from_index = chunked(*args, **kw, backend="triton")
    assert row_chunks == [3]
    real = chunk_tables.plan_chunks
    monkeypatch.setattr(chunk_tables, "plan_chunks", lambda *a: dataclasses.replace(real(*a), row_chunks=0))
    chunk_tables._recent_tables.cache_clear()  # the pass is planned again, not taken from the last one
    from_table = chunked(*args, **kw, backend="triton")
    assert row_chunks == [3, 0]
    assert torch.equal(from_index.y, from_table.y) and torch.equal(from_index.final_states, from_table.final_states)
    kw.pop("start_positions")  # the float64 reference has no grid
    assert_rel_close(from_index.y, mamba2_scan_ref(*args, **kw).y, TOLERANCE[torch.bfloat16], "y")


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicate_and_unordered_captures_land_in_their_rows(backend, device):
    args, kw = mamba2_positional(mamba2_inputs(1, 37, **SMALL, device=device))
    kw.update(dt_softplus=True)
    order = [23, 16, 37, 0, 23, 1, 32]
    got = chunked(*args, **kw, capture=[(0, k) for k in order], backend=backend)
    for row, k in enumerate(order):
        single = chunked(*args, **kw, capture=[(0, k)], backend=backend)
        assert torch.equal(got.captured_states[row], single.captured_states[0]), k
    assert torch.equal(got.captured_states[2], got.final_states[0])  # offset len: the final state
    assert torch.equal(got.captured_states[3], kw["initial_states"][0])  # offset 0: the initial state


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [9, 16, 23])
def test_warm_restore_matches_cold_run(backend, dtype, k, device):
    """Resume from a state captured inside (or at the edge of) a chunk: the tail pass has its own
    chunk grid, so it matches the cold run to rounding, not bitwise."""
    n = 45
    args, kw = mamba2_positional(mamba2_inputs(1, n, **SMALL, dtype=dtype, device=device))
    kw.update(dt_softplus=True)
    cold = chunked(*args, **kw, capture=[(0, k)], backend=backend)
    x, dt, A, B, C = args
    tail = chunked(x[:, k:], dt[:, k:], A, B[:, k:], C[:, k:],
                   **dict(kw, z=kw["z"][:, k:], initial_states=cold.captured_states), backend=backend)
    tol = TOLERANCE[dtype]
    assert_rel_close(tail.y, cold.y[:, k:], tol, "warm y vs cold y")
    assert_rel_close(tail.final_states, cold.final_states, tol, "warm final vs cold final")
    want = mamba2_scan_ref(*args, **kw)
    assert_rel_close(tail.y, want.y[:, k:], tol, "warm y vs float64")
    assert_rel_close(tail.final_states, want.final_states, tol, "warm final vs float64")


def test_triton_and_torch_chunked_paths_agree(device):
    args, kw = mamba2_positional(mamba2_inputs(2, 40, **SMALL, device=device))
    kw.update(dt_softplus=True, capture=[(1, 3), (0, 40), (1, 16), (0, 29)])
    a = chunked(*args, **kw, backend="torch")
    b = chunked(*args, **kw, backend="triton")
    for name, u, v in zip(a._fields, a, b):
        assert_rel_close(v, u, 1e-6, name)


def test_default_chunk_size_on_the_torch_path(device):
    """chunk_size=None is 256 tokens: 300 tokens cross one chunk boundary."""
    args, kw = mamba2_positional(mamba2_inputs(1, 300, nheads=2, headdim=8, ngroups=1, device=device))
    kw.update(dt_softplus=True, capture=[(0, 255), (0, 256), (0, 257), (0, 300)])
    got = mamba2_scan(*args, **kw, algorithm="chunked", backend="torch")
    check(got, mamba2_scan_ref(*args, **kw), torch.float32, "default chunk")
    smaller = chunked(*args, **kw, backend="torch")  # another grid: other rounding, same values
    assert not torch.equal(smaller.final_states, got.final_states)
    assert_rel_close(smaller.final_states, got.final_states, 1e-5, "chunk 16 vs 256")


@pytest.mark.parametrize("backend", BACKENDS)
def test_float16_states_and_cb_past_its_range(backend, device):
    """float16 inputs whose chunk-start states (1e5) and C B^T (16 x 70 x 70 = 78400) pass
    float16's 65504 while y stays small: the chunked path keeps them in range."""
    args, kw = mamba2_positional(mamba2_inputs(1, 2 * CHUNK + 3, **SMALL, dtype=torch.float16, device=device))
    x, dt, A, B, C = args
    big_state = dict(initial_states=torch.full((1, 4, 16, 16), 1e5, device=device))
    big_cb = torch.full_like(B, 70.0)
    for x_, B_, C_, kw in ((x, B, C * 1e-3, big_state), (x * 1e-4, big_cb, big_cb, {})):
        want = mamba2_scan_ref(x_, dt, A * 0.01, B_, C_, **kw)
        assert want.y.abs().max() < 1e4
        check(chunked(x_, dt, A * 0.01, B_, C_, **kw, backend=backend), want, torch.float16, f"{backend} float16")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reset", [-3000.0, -1e5])
def test_a_reset_token_keeps_the_rest_of_its_chunk_accurate(backend, reset, device):
    """One token of a chunk decays by exp(reset) (a large dt: the state is forgotten), the others by
    about exp(-0.1): the in-chunk cumulative log decay must not carry the reset's magnitude into
    the later tokens' decays, whose float32 differences would lose their precision."""
    args, kw = mamba2_positional(mamba2_inputs(1, 2 * CHUNK, **SMALL, device=device))
    x, _, A, B, C = args
    A = torch.full_like(A, -10.0)
    dt = torch.full((1, 2 * CHUNK, A.numel()), 0.01, device=device)
    dt[:, 3] = dt[:, CHUNK + 5] = reset / -10.0
    kw = dict(capture=[(0, CHUNK // 2), (0, CHUNK + 9)])
    want = mamba2_scan_ref(x, dt, A, B, C, **kw)
    check(chunked(x, dt, A, B, C, **kw, backend=backend), want, torch.float32, f"{backend} reset {reset}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_and_auto_on_cpu_are_the_recurrent_path(backend, device):
    if device.type != "cpu":
        pytest.skip("auto picks by device: this is the CPU rule")
    args, kw = mamba2_positional(mamba2_inputs(1, 20, **SMALL, device=device))
    kw.update(dt_softplus=True, capture=[(0, 7)])
    exact = mamba2_scan(*args, **kw, backend=backend, algorithm="recurrent")
    for got in (mamba2_scan(*args, **kw, backend=backend),
                mamba2_scan(*args, **kw, backend=backend, algorithm="auto", chunk_size=16)):
        for u, v in zip(exact, got):
            assert torch.equal(u, v)


def test_auto_rule():
    def seqs(lengths):
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
        return Sequences(cu, lengths, varlen=True)

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    long = [3, AUTO_CHUNKED_MIN_TOKENS, 0]
    short = [3, AUTO_CHUNKED_MIN_TOKENS - 1]
    assert resolve_algorithm("auto", cuda, seqs(long)) == "chunked"
    assert resolve_algorithm("auto", cuda, seqs(short)) == "recurrent"
    assert resolve_algorithm("auto", cuda, seqs([])) == "recurrent"
    assert resolve_algorithm("auto", cpu, seqs(long)) == "recurrent"
    assert resolve_algorithm("chunked", cpu, seqs(short)) == "chunked"


@pytest.mark.parametrize("changes, error, message", [
    (dict(algorithm="fast"), ValueError, r"algorithm must be one of \('recurrent', 'chunked', 'auto'\), got 'fast'"),
    (dict(algorithm=None), ValueError, "algorithm must be one of"),
    (dict(chunk_size=24), ValueError, "chunk_size must be a power of two from 16 .* got 24"),
    (dict(chunk_size=8), ValueError, "chunk_size must be a power of two from 16 .* got 8"),
    (dict(chunk_size=0), ValueError, "chunk_size must be a power of two"),
    (dict(chunk_size=-16), ValueError, "chunk_size must be a power of two"),
    (dict(chunk_size=2048), ValueError, "chunk_size must be a power of two from 16 .* to 1024, got 2048"),
    (dict(chunk_size=16.0), TypeError, "chunk_size must be an int, got float"),
    (dict(chunk_size=True), TypeError, "chunk_size must be an int"),
    (dict(chunk_size=32, algorithm="recurrent"), None, None),
    (dict(chunk_size=32, algorithm="chunked", backend="torch"), None, None),
])
def test_bad_algorithm_and_chunk_size(changes, error, message):
    args, kw = mamba2_positional(mamba2_inputs(2, 5, **SMALL))
    kw = dict(kw, algorithm="chunked", backend="torch")
    kw.update(changes)
    if error is None:
        mamba2_scan(*args, **kw)
        return
    with pytest.raises(error, match=message):
        mamba2_scan(*args, **kw)


def test_a_stride_too_large_for_the_kernels_tile_offsets_is_refused(device):
    """The kernels offset a chunk's tokens in int32: chunk_size x a stride along the sequence of
    2^21 elements reaches 2^31, and is refused rather than wrapped."""
    inputs = mamba2_inputs(1, 2, **SMALL, dtype=torch.bfloat16, device=device)
    x = inputs["x"]
    wide = torch.zeros(1, 2, 2 ** 21, dtype=torch.bfloat16, device=device)
    args, kw = mamba2_positional(dict(inputs, x=wide[..., :x[0, 0].numel()].unflatten(2, x.shape[2:]).copy_(x)))
    with pytest.raises(ValueError, match="chunk_size x .stride along the sequence. < 2.31; x's stride of 2097152"):
        chunked(*args, **kw, backend="triton", chunk_size=1024)
    strided = chunked(*args, **kw, backend="triton", chunk_size=512)
    args, kw = mamba2_positional(inputs)
    assert torch.equal(strided.y, chunked(*args, **kw, backend="triton", chunk_size=512).y)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_size_on_gpu(dtype):
    """Realistic head sizes with the compiled kernels and the default 256-token chunks."""
    device = torch.device("cuda")
    args, kw = mamba2_positional(mamba2_inputs(1, 600, nheads=8, headdim=64, ngroups=1, dstate=128,
                                               dtype=dtype, device=device))
    kw.update(dt_softplus=True, capture=[(0, 0), (0, 100), (0, 256), (0, 300), (0, 511), (0, 600)])
    got = mamba2_scan(*args, **kw, algorithm="chunked")
    check(got, mamba2_scan_ref(*args, **kw), dtype, f"gpu {dtype}")
    bare = mamba2_scan(*args, **dict(kw, capture=None), algorithm="chunked")
    assert torch.equal(bare.y, got.y) and torch.equal(bare.final_states, got.final_states)
    assert mamba2_scan(*args, **kw, algorithm="auto").y.shape == got.y.shape


def test_int_tables_upload_each_table_whole_and_16_byte_aligned():
    from ssm_kernels._common import int_tables

    tables = [[(0, 5, 7), (1, 2, 3)], [], [4], [9, -1, 8], [(6, 6)]]
    got = int_tables(torch.device("cpu"), *tables)
    flat = [[v for item in t for v in (item if isinstance(item, tuple) else (item,))] for t in tables]
    assert [t.tolist() for t in got] == flat
    assert all(t.dtype == torch.int64 and t.ndim == 1 for t in got)
    assert len({t.untyped_storage().data_ptr() for t in got}) == 1  # one buffer, one transfer
    assert all(t.storage_offset() % 2 == 0 for t in got)  # 16-byte aligned, as tensors of their own
