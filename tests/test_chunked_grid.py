"""The chunked scan's absolute chunk grid: a pass that starts at a multiple of chunk_size (in
absolute positions) gives y, final and captured states bit-identical to one longer pass, on each
backend; a pass that starts off the grid agrees to rounding.
"""
import pytest
import torch

from helpers import assert_rel_close, mamba2_inputs, mamba2_positional
from ssm_kernels import mamba2_scan
from ssm_kernels.scan.reference import mamba2_scan_ref

BACKENDS = ["triton", "torch"]
CHUNK = 16
SMALL = dict(nheads=4, headdim=16, ngroups=2, dstate=16)


def chunked(*args, backend, chunk_size=CHUNK, **kw):
    return mamba2_scan(*args, **kw, backend=backend, algorithm="chunked", chunk_size=chunk_size)


def piece(args, kw, lo, hi=None):
    """The inputs of tokens [lo, hi) of a batch-1 pass (fresh tensors, as a separate pass gets them)."""
    x, dt, A, B, C = args
    cut = lambda t: t[:, lo:hi].clone()  # noqa: E731
    return (cut(x), cut(dt), A, cut(B), cut(C)), dict(kw, z=cut(kw["z"]))


def assert_equal(got, want, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(got, want), \
        f"{what}: not bit-identical (max diff {(got.double() - want.double()).abs().max():.3e})"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split, given", [(32, True), (48, False), (16, True)])
def test_split_at_a_grid_point_is_bit_identical(backend, dtype, split, given, device):
    """One pass of 75 tokens against [0, split) + [split, 75) resumed from the first pass's final
    state; the second pass's absolute start given (start_positions) or not (its own start is a
    grid point either way). Captures on both sides of the split, inside and on chunk edges."""
    n = 75
    args, kw = mamba2_positional(mamba2_inputs(1, n, **SMALL, dtype=dtype, device=device))
    kw.update(dt_softplus=True)
    offsets = [0, 1, 7, split - 1, split, split + 1, split + 9, 64, 74, 75]
    one = chunked(*args, **kw, capture=[(0, k) for k in offsets], backend=backend)
    head_args, head_kw = piece(args, kw, 0, split)
    head = chunked(*head_args, **head_kw, capture=[(0, k) for k in offsets if k <= split], backend=backend)
    rest_args, rest_kw = piece(args, kw, split)
    rest_kw.update(initial_states=head.final_states, capture=[(0, k - split) for k in offsets if k >= split])
    if given:
        rest_kw["start_positions"] = [split]
    rest = chunked(*rest_args, **rest_kw, backend=backend)
    assert_equal(head.y, one.y[:, :split], "first pass y")
    assert_equal(rest.y, one.y[:, split:], "second pass y")
    assert_equal(head.final_states, one.captured_states[offsets.index(split)][None], "state at the split")
    assert_equal(rest.final_states, one.final_states, "final state")
    captured = dict(zip([k for k in offsets if k <= split], head.captured_states))
    captured.update(zip([k for k in offsets if k >= split], rest.captured_states))
    for i, k in enumerate(offsets):
        assert_equal(captured[k], one.captured_states[i], f"capture at {k}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_passes_on_the_absolute_grid_of_a_sequence_that_starts_off_it(backend, device):
    """A sequence whose first token is at absolute position 5: one pass against passes cut at the
    absolute grid points 16 and 48 (offsets 11 and 43), each given its absolute start."""
    n, start = 60, 5
    args, kw = mamba2_positional(mamba2_inputs(1, n, **SMALL, dtype=torch.bfloat16, device=device))
    kw.update(dt_softplus=True)
    one = chunked(*args, **kw, start_positions=[start], capture=[(0, 11), (0, 43), (0, 50)], backend=backend)
    state, ys = kw["initial_states"], []
    for lo, hi in ((0, 11), (11, 43), (43, n)):
        part_args, part_kw = piece(args, kw, lo, hi)
        got = chunked(*part_args, **dict(part_kw, initial_states=state),
                      start_positions=torch.tensor([start + lo]), capture=[(0, 7)] if lo == 43 else None,
                      backend=backend)
        state = got.final_states
        ys.append(got.y)
    assert_equal(torch.cat(ys, dim=1), one.y, "y")
    assert_equal(state, one.final_states, "final state")
    assert_equal(got.captured_states[0], one.captured_states[2], "capture at 50")


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_batch_of_sequences_resumed_at_different_grid_points(backend, device):
    """Three sequences prefilled in one varlen pass, then resumed together in a second varlen pass
    from their captured states at different grid points (and one from its start, one empty tail):
    bit-identical to the first pass."""
    lengths, resume = [40, 70, 33, 16], [16, 48, 0, 16]
    nseq = len(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=device)
    args, kw = mamba2_positional(mamba2_inputs(1, sum(lengths), **SMALL, nseq=nseq, dtype=torch.bfloat16,
                                               device=device))
    kw.update(dt_softplus=True)
    one = chunked(*args, **kw, cu_seqlens=cu, capture=[(s, k) for s, k in enumerate(resume)] + [(1, 60)],
                  backend=backend)
    keep = torch.cat([torch.arange(int(cu[s]) + resume[s], int(cu[s + 1])) for s in range(nseq)]).to(device)
    tails = [n - r for n, r in zip(lengths, resume)]
    cu2 = torch.tensor([0] + torch.tensor(tails).cumsum(0).tolist(), device=device)
    x, dt, A, B, C = args
    pick = lambda t: t[:, keep].clone()  # noqa: E731
    rest = chunked(pick(x), pick(dt), A, pick(B), pick(C),
                   **dict(kw, z=pick(kw["z"]), initial_states=one.captured_states[:nseq]), cu_seqlens=cu2,
                   start_positions=resume, capture=[(1, 12)], backend=backend)
    assert_equal(rest.y, one.y[:, keep], "y")
    assert_equal(rest.final_states, one.final_states, "final states")
    assert_equal(rest.captured_states[0], one.captured_states[nseq], "capture at 60")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_off_the_grid_is_within_tolerance(backend, dtype, device):
    n, split = 50, 21
    args, kw = mamba2_positional(mamba2_inputs(1, n, **SMALL, dtype=dtype, device=device))
    kw.update(dt_softplus=True)
    one = chunked(*args, **kw, capture=[(0, split)], backend=backend)
    rest_args, rest_kw = piece(args, kw, split)
    for positions in (None, [split]):  # the grid from the pass start, or the absolute one
        rest = chunked(*rest_args, **dict(rest_kw, initial_states=one.captured_states), start_positions=positions,
                       backend=backend)
        tol = {torch.float32: 1e-4, torch.bfloat16: 1e-2}[dtype]
        assert_rel_close(rest.y, one.y[:, split:], tol, "y")
        assert_rel_close(rest.final_states, one.final_states, tol, "final state")
        want = mamba2_scan_ref(*args, **kw)
        assert_rel_close(rest.final_states, want.final_states, tol, "final state vs float64")


def test_real_tiles_split_at_the_default_chunk(device):
    """The launch configuration of a real layer (chunk 256, headdim 64, dstate 128, bfloat16):
    accurate against float64, and bit-identical when resumed at 256."""
    n, split = 300, 256
    args, kw = mamba2_positional(mamba2_inputs(1, n, nheads=2, headdim=64, ngroups=1, dstate=128,
                                               dtype=torch.bfloat16, device=device))
    kw.update(dt_softplus=True)
    one = mamba2_scan(*args, **kw, capture=[(0, 100), (0, split)], algorithm="chunked", backend="triton")
    ref = mamba2_scan_ref(*args, **kw, capture=[(0, 100), (0, split)])
    for name, got, want in zip(one._fields, one, ref):
        assert_rel_close(got, want, 1e-2, name)
    rest_args, rest_kw = piece(args, kw, split)
    rest = mamba2_scan(*rest_args, **dict(rest_kw, initial_states=one.captured_states[1:]), start_positions=[split],
                       algorithm="chunked", backend="triton")
    assert_equal(rest.y, one.y[:, split:], "y")
    assert_equal(rest.final_states, one.final_states, "final state")


@pytest.mark.parametrize("value, error, message", [
    ([0, 1], ValueError, r"start_positions must hold one position per sequence \(1\), got 2"),
    ([-3], ValueError, r"start_positions\[0\] must be >= 0, got -3"),
    ([1.5], TypeError, r"start_positions\[0\] must be an int, got float"),
    ([True], TypeError, r"start_positions\[0\] must be an int"),
    (torch.tensor([2.0]), TypeError, "start_positions must be a 1-D integer tensor"),
    (7, TypeError, "start_positions must be a sequence of ints, one per sequence, got int"),
])
def test_bad_start_positions(value, error, message):
    args, kw = mamba2_positional(mamba2_inputs(1, 5, **SMALL))
    for algorithm in ("chunked", "recurrent"):
        with pytest.raises(error, match=message):
            mamba2_scan(*args, **kw, start_positions=value, algorithm=algorithm, backend="torch")
