"""The one comparison helper (relative error against float64: ssm_kernels.scan.reference.rel_error),
shared input makers, and a count of an index tensor's reads to the host."""
from __future__ import annotations

import contextlib
from unittest import mock

import torch

from ssm_kernels.scan.reference import rel_error

# RMS-relative error allowed against the float64 reference, per input dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}


def assert_rel_close(actual, expected, tol, name="tensor"):
    """Fail with the error and the first mismatching elements when the RMS-relative error > tol."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if not torch.isfinite(actual).all():
        bad = (~torch.isfinite(actual)).nonzero()[:5].tolist()
        raise AssertionError(f"{name}: non-finite values (unwritten outputs?) at {bad}")
    actual, expected = actual.double().cpu(), expected.double().cpu()  # wherever each is
    err = rel_error(actual, expected)
    if err > tol:
        diff = (actual - expected).abs()
        worst = diff.flatten().topk(min(5, diff.numel())).indices
        report = [(tuple(int(i) for i in torch.unravel_index(w, diff.shape)),
                   actual.flatten()[w].item(), expected.flatten()[w].item()) for w in worst]
        raise AssertionError(f"{name}: RMS-relative error {err:.3e} > {tol:.1e}; worst (index, got, want): {report}")


def mamba2_inputs(batch, seqlen, nheads=4, headdim=8, ngroups=2, dstate=16, *, dtype=torch.float32,
                  device="cpu", D_per_row=False, nseq=None):
    """Random Mamba-2 inputs and all optional tensors, as keyword arguments of mamba2_scan."""
    nseq = batch if nseq is None else nseq
    f = lambda *shape: torch.randn(*shape, device=device).to(dtype)
    return dict(
        x=f(batch, seqlen, nheads, headdim), dt=f(batch, seqlen, nheads) * 0.5,
        A=-(torch.rand(nheads, device=device) + 0.5),
        B=f(batch, seqlen, ngroups, dstate), C=f(batch, seqlen, ngroups, dstate),
        D=torch.randn(nheads, headdim, device=device) if D_per_row else torch.randn(nheads, device=device),
        z=f(batch, seqlen, nheads, headdim), dt_bias=torch.randn(nheads, device=device) * 0.5,
        initial_states=torch.randn(nseq, nheads, headdim, dstate, device=device),
    )


def mamba1_inputs(batch, seqlen, dim=12, dstate=8, ngroups=None, *, dtype=torch.float32, device="cpu", nseq=None):
    """Random Mamba-1 inputs (selective_scan_fn layout) as keyword arguments of mamba1_scan."""
    nseq = batch if nseq is None else nseq
    f = lambda *shape: torch.randn(*shape, device=device).to(dtype)
    bc = (batch, dstate, seqlen) if ngroups is None else (batch, ngroups, dstate, seqlen)
    return dict(
        u=f(batch, dim, seqlen), delta=f(batch, dim, seqlen) * 0.5,
        A=-(torch.rand(dim, dstate, device=device) + 0.5), B=f(*bc), C=f(*bc),
        D=torch.randn(dim, device=device), z=f(batch, dim, seqlen),
        delta_bias=torch.randn(dim, device=device) * 0.5,
        initial_states=torch.randn(nseq, dim, dstate, device=device),
    )


def mamba2_positional(kw):
    """Split mamba2_inputs into (positional tuple, keyword dict)."""
    kw = dict(kw)
    return tuple(kw.pop(k) for k in ("x", "dt", "A", "B", "C")), kw


def mamba1_positional(kw):
    kw = dict(kw)
    return tuple(kw.pop(k) for k in ("u", "delta", "A", "B", "C")), kw


@contextlib.contextmanager
def reads_back(t: torch.Tensor):
    """Inside, counts (the list yielded, one entry a read) the times t's values are read to the
    host by tolist, the one way the library reads an index tensor back: a sync on a GPU."""
    reads, inside, real = [], [], torch.Tensor.tolist

    def tolist(self):
        if self is t and not inside:  # a torch function mode (a default device) calls it again
            reads.append(1)
        inside.append(self)
        try:
            return real(self)
        finally:
            inside.pop()
    with mock.patch.object(torch.Tensor, "tolist", tolist):
        yield reads
