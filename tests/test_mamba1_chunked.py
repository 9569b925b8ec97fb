"""mamba1_scan(algorithm="chunked"): parallel in time on the absolute chunk grid.

Accurate against the float64 reference; bit-identical (torch.equal) when a sequence is split
at a grid point, however the passes are batched and whatever is captured, on each backend."""
import pytest
import torch

from helpers import TOLERANCE, assert_rel_close, mamba1_inputs, mamba1_positional
from ssm_kernels import mamba1_scan
from ssm_kernels._common import CaptureTable, Sequences, make_capture_table
from ssm_kernels.scan.mamba1_chunked.triton_kernel import capture_steps
from ssm_kernels.scan.reference import mamba1_scan_ref

BACKENDS = ["torch", "triton"]
CHUNK = 16


def edge_captures(lengths):
    return sorted({(s, k) for s, n in enumerate(lengths) for k in (0, 1, n - 1, n, 17) if 0 <= k <= n})


def chunked(*args, **kw):
    return mamba1_scan(*args, **kw, algorithm="chunked", chunk_size=CHUNK)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, ngroups", [(torch.float32, None), (torch.bfloat16, 3), (torch.float16, 1)])
def test_accuracy_with_offsets_and_captures(backend, dtype, ngroups, device):
    """Passes that start on and off the grid, captures at 0, 1, len-1, len and inside a chunk."""
    args, kw = mamba1_positional(mamba1_inputs(2, 37, ngroups=ngroups, dtype=dtype, device=device))
    kw.update(delta_softplus=True, capture=edge_captures([37, 37]))
    want = mamba1_scan_ref(*args, **kw)
    got = chunked(*args, **kw, start_positions=[5, 32], backend=backend)
    for name, g, w in zip(got._fields, got, want):
        assert g.dtype == (dtype if name == "y" else torch.float32)
        assert_rel_close(g, w, TOLERANCE[dtype], name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_with_empty_and_one_token_sequences(backend, device):
    lengths = [0, 1, 20, 0, 9]
    cu = torch.tensor([0, 0, 1, 21, 21, 30], device=device)
    args, kw = mamba1_positional(mamba1_inputs(1, 30, nseq=5, device=device))
    kw.update(cu_seqlens=cu, capture=edge_captures(lengths))
    want = mamba1_scan_ref(*args, **kw)
    got = chunked(*args, **kw, start_positions=torch.tensor([3, 15, 16, 0, 7]), backend=backend)
    for name, g, w in zip(got._fields, got, want):
        assert_rel_close(g, w, TOLERANCE[torch.float32], name)


def split(args, kw, lo, hi):
    u, delta, A, B, C = args
    cut = lambda t: t[..., lo:hi]
    return (cut(u), cut(delta), A, cut(B), cut(C)), dict(kw, z=cut(kw["z"]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_at_a_grid_point_is_bitwise(backend, dtype, device):
    """Cold: one pass from absolute position 16 with captures. Warm: resume at the grid point 48
    from the state captured there, packed after an unrelated sequence: the same bits."""
    args, kw = mamba1_positional(mamba1_inputs(1, 45, ngroups=2, dtype=dtype, device=device))
    kw.update(delta_softplus=True)
    k = 32  # absolute position 16 + 32 = 48, a multiple of CHUNK
    whole = chunked(*args, **kw, capture=[(0, k), (0, 7)], start_positions=[16], backend=backend)
    bare = chunked(*args, **kw, start_positions=[16], backend=backend)
    assert torch.equal(whole.y, bare.y) and torch.equal(whole.final_states, bare.final_states)

    head_args, head_kw = split(args, kw, 0, k)
    head = chunked(*head_args, **head_kw, start_positions=[16], backend=backend)
    assert torch.equal(head.y, whole.y[..., :k]) and torch.equal(head.final_states, whole.captured_states[:1])

    tail_args, tail_kw = split(args, kw, k, 45)
    other_args, other_kw = mamba1_positional(mamba1_inputs(1, 6, ngroups=2, dtype=dtype, device=device))
    packed = [t if i == 2 else torch.cat([o, t], dim=-1) for i, (o, t) in enumerate(zip(other_args, tail_args))]
    tail = chunked(*packed, **dict(tail_kw, z=torch.cat([other_kw["z"], tail_kw["z"]], dim=-1),
                                   initial_states=torch.cat([other_kw["initial_states"], whole.captured_states[:1]])),
                   cu_seqlens=torch.tensor([0, 6, 19], device=device), start_positions=[3, 48], backend=backend)
    assert torch.equal(tail.y[..., 6:], whole.y[..., k:])
    assert torch.equal(tail.final_states[1], whole.final_states[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_off_grid_split_agrees_to_rounding(backend, device):
    args, kw = mamba1_positional(mamba1_inputs(1, 40, device=device))
    whole = chunked(*args, **kw, capture=[(0, 21)], backend=backend)
    tail_args, tail_kw = split(args, kw, 21, 40)
    tail = chunked(*tail_args, **dict(tail_kw, initial_states=whole.captured_states), start_positions=[21],
                   backend=backend)
    assert_rel_close(tail.y, whole.y[..., 21:], 1e-6, "y")
    assert_rel_close(tail.final_states, whole.final_states, 1e-6, "final_states")


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_captures_in_one_chunk(backend, device):
    """Seven captures after one chunk's tokens, one of them twice (the Triton kernel takes more
    than MAX_CAPTURE_STEPS in a loop, fewer in unrolled steps): accurate, and each capture the
    same bits as when it is the chunk's only one."""
    args, kw = mamba1_positional(mamba1_inputs(1, 40, ngroups=2, dtype=torch.bfloat16, device=device))
    kw.update(delta_softplus=True)
    many = [(0, o) for o in (17, 18, 20, 20, 23, 27, 32)]
    assert steps_of(many, 40) == (0, True)
    got = chunked(*args, **kw, capture=many, backend=backend)
    assert_rel_close(got.captured_states, mamba1_scan_ref(*args, **kw, capture=many).captured_states,
                     TOLERANCE[torch.bfloat16], "captured_states")
    for row, capture in enumerate(many):
        alone = chunked(*args, **kw, capture=[capture], backend=backend)
        assert torch.equal(alone.captured_states[0], got.captured_states[row]), capture
        assert torch.equal(alone.y, got.y) and torch.equal(alone.final_states, got.final_states)


def steps_of(capture, length, start=0):
    """capture_steps of a one-sequence pass of `length` tokens from absolute position `start`."""
    return capture_steps(make_capture_table(capture, Sequences(None, [length], varlen=False), torch.device("cpu")),
                         CHUNK, [start])


@pytest.mark.parametrize("capture, start, steps", [
    ([], 0, (0, False)),
    ([(0, 0)], 0, (0, False)),  # the initial state: taken before the chunks
    ([(0, 0), (0, 16), (0, 17)], 0, (1, False)),  # offsets 16 and 17 end in chunks 0 and 1
    ([(0, 1), (0, 16)], 0, (2, False)),
    ([(0, 11), (0, 12)], 5, (1, False)),  # from position 5 the first chunk ends after offset 11
    ([(0, o) for o in (1, 2, 3)], 0, (4, False)),
    ([(0, o) for o in (1, 2, 3, 4)], 0, (4, False)),
    ([(0, o) for o in (1, 2, 3, 4, 5)], 0, (0, True)),
])
def test_capture_steps(capture, start, steps):
    assert steps_of(capture, 40, start) == steps


def test_captures_whose_offsets_are_on_the_device_only_take_the_loop():
    assert capture_steps(CaptureTable(None, None, None, [None, None]), CHUNK, [0]) == (0, True)


def test_triton_matches_torch_path(device):
    args, kw = mamba1_positional(mamba1_inputs(2, 30, ngroups=2, device=device))
    kw.update(delta_softplus=True, capture=[(1, 9), (0, 30)], start_positions=[2, 0])
    a = chunked(*args, **kw, backend="torch")
    b = chunked(*args, **kw, backend="triton")
    for name, u, v in zip(a._fields, a, b):
        assert_rel_close(v, u, 1e-6, name)


@pytest.mark.parametrize("changes, error, message", [
    (dict(algorithm="parallel"), ValueError, "algorithm must be one of"),
    (dict(algorithm="chunked", chunk_size=24), ValueError, "chunk_size must be a power of two from 16"),
    (dict(algorithm="chunked", chunk_size=512), ValueError, "chunk_size must be a power of two from 16 to 256"),
    (dict(algorithm="chunked", chunk_size=16.0), TypeError, "chunk_size must be an int"),
    (dict(algorithm="chunked", start_positions=[0]), ValueError, r"one position per sequence \(2\), got 1"),
    (dict(algorithm="chunked", start_positions=[0, -1]), ValueError, r"start_positions\[1\] must be >= 0"),
    (dict(algorithm="chunked", start_positions=torch.tensor([0.0, 1.0])), TypeError, "1-D integer tensor"),
])
def test_rejects(changes, error, message):
    args, kw = mamba1_positional(mamba1_inputs(2, 5))
    with pytest.raises(error, match=message):
        mamba1_scan(*args, **kw, **changes)
