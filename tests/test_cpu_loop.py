"""The recurrent scan's compiled CPU loop (ssm_kernels/scan/cpu_loop.c) beside its PyTorch loop.

The scan tests run the torch backend through the compiled loop, where it builds (this machine and
CI have a C compiler); test_scan_exactness runs its bitwise checks through both loops. Here: the
loop builds, the two loops agree with each other and with the float64 references on every option
of both layouts and the decode step, the inputs are left as they were, and a machine without a
compiler gets the PyTorch loop and one warning.
"""
import functools

import pytest
import torch

from helpers import TOLERANCE, assert_rel_close, mamba1_inputs, mamba1_positional, mamba2_inputs, mamba2_positional
import ssm_kernels
from ssm_kernels import selective_state_update
from ssm_kernels.scan import cpu_loop
from ssm_kernels.scan.reference import mamba1_scan_ref, mamba2_scan_ref, selective_state_update_ref

mamba2_scan = functools.partial(ssm_kernels.mamba2_scan, algorithm="recurrent", backend="torch")
mamba1_scan = functools.partial(ssm_kernels.mamba1_scan, algorithm="recurrent", backend="torch")
LOOPS_AGREE = 2e-6  # float32, two libms' exp and log1p


def _with_pytorch_loop(monkeypatch, run):
    with monkeypatch.context() as m:
        m.setattr(cpu_loop, "library", lambda: None)
        return run()


def _check(run, reference, monkeypatch, dtype=torch.float32):
    compiled, python, want = run(), _with_pytorch_loop(monkeypatch, run), reference()
    for name, c, p, w in zip(compiled._fields, compiled, python, want):
        if w.numel():
            assert_rel_close(c, p, LOOPS_AGREE if dtype == torch.float32 else TOLERANCE[dtype], f"{name}: loops")
            assert_rel_close(c, w, TOLERANCE[dtype], f"{name}: compiled loop against float64")


def test_the_compiled_loop_builds_here():
    assert cpu_loop.library() is not None, "no C compiler built ssm_kernels/scan/cpu_loop.c (CC, else cc)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dstate", [1, 5, 16])
def test_mamba2_varlen_with_every_option(dtype, dstate, monkeypatch):
    """Sequences of 9, 0, 1 and 6 tokens packed in one row, initial states, captures at 0, 1,
    len - 1 and len, D per head, z, dt_bias, softplus and a dt limit."""
    lengths = [9, 0, 1, 6]
    args, kw = mamba2_positional(mamba2_inputs(1, sum(lengths), nheads=4, headdim=3, dstate=dstate, dtype=dtype,
                                               nseq=len(lengths)))
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    capture = sorted({(s, k) for s, n in enumerate(lengths) for k in (0, 1, n - 1, n) if 0 <= k <= n})
    kw.update(dt_softplus=True, dt_limit=(0.01, 2.0), cu_seqlens=bounds, capture=capture)
    before = [t.clone() for t in (*args, kw["initial_states"])]
    _check(lambda: mamba2_scan(*args, **kw), lambda: mamba2_scan_ref(*args, **kw), monkeypatch, dtype)
    assert all(torch.equal(a, b) for a, b in zip(before, (*args, kw["initial_states"]))), "an input was written"


@pytest.mark.parametrize("ngroups", [None, 2])
def test_mamba1_with_every_option(ngroups, monkeypatch):
    args, kw = mamba1_positional(mamba1_inputs(2, 11, dim=6, dstate=7, ngroups=ngroups))
    kw.update(delta_softplus=True, capture=[(0, 0), (0, 4), (1, 10), (1, 11)])
    _check(lambda: mamba1_scan(*args, **kw), lambda: mamba1_scan_ref(*args, **kw), monkeypatch)


def test_decode_step(monkeypatch):
    kw = mamba2_inputs(3, 1)
    state = kw.pop("initial_states")
    x, dt, B, C, z = (kw[k][:, 0] for k in ("x", "dt", "B", "C", "z"))

    def decode(update):
        pool = state.clone()
        y = update(pool, x, dt, kw["A"], B, C, D=kw["D"], z=z, dt_bias=kw["dt_bias"], dt_softplus=True)
        return y, pool
    compiled = decode(functools.partial(selective_state_update, backend="torch"))
    python = _with_pytorch_loop(monkeypatch, lambda: decode(functools.partial(selective_state_update, backend="torch")))
    want = decode(selective_state_update_ref)
    for c, p, w, name in zip(compiled, python, want, ("y", "state")):
        assert_rel_close(c, p, LOOPS_AGREE, f"{name}: loops")
        assert_rel_close(c, w, TOLERANCE[torch.float32], f"{name}: compiled loop against float64")


def test_without_a_compiler_the_pytorch_loop_runs_after_one_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("SSM_KERNELS_CACHE", str(tmp_path / "cache"))
    cpu_loop.library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="PyTorch loop"):
            assert cpu_loop.library() is None
        args, kw = mamba2_positional(mamba2_inputs(1, 5))
        got, want = mamba2_scan(*args, **kw), mamba2_scan_ref(*args, **kw)
        assert_rel_close(got.y, want.y, TOLERANCE[torch.float32], "y")
    finally:
        cpu_loop.library.cache_clear()


def test_a_compiler_command_with_arguments_builds(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "env cc")  # as CC="ccache gcc" would be
    monkeypatch.setenv("SSM_KERNELS_CACHE", str(tmp_path))
    cpu_loop.library.cache_clear()
    try:
        assert cpu_loop.library() is not None
    finally:
        cpu_loop.library.cache_clear()


def test_a_build_is_kept_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("SSM_KERNELS_CACHE", str(tmp_path))
    first = cpu_loop._build("cc")
    built = first.stat().st_mtime_ns
    assert cpu_loop._build("cc") == first and first.stat().st_mtime_ns == built
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # nothing left from the build
