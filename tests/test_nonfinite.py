"""A NaN or +inf in one token's inputs reaches only that token's outputs and later ones.

Every algorithm and backend of both scans, as the recurrence and the float64 reference: y of
the tokens before the bad one, and the states captured before it, are finite and the bits of
the clean pass; the bad token's y (where the input enters it) and the states after it (where the
input feeds them) are not finite. The bad token sits inside a chunk, so a chunked path that
multiplies masks instead of selecting (0 * NaN) leaks to the tokens before it.
"""
from __future__ import annotations

import functools

import pytest
import torch

from helpers import mamba1_inputs, mamba2_inputs
from ssm_kernels import mamba1_scan, mamba2_scan

# The interpreter's numpy warns at every NaN or inf it computes with, which is the point here.
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

SEQLEN, CHUNK = 40, 16
BAD_TOKENS = (18, 21)  # inside the second chunk, one even and one odd (the recurrent kernel pairs tokens)
VALUES = {"nan": float("nan"), "inf": float("inf")}
PATHS = [("recurrent", "torch"), ("recurrent", "triton"), ("chunked", "torch"), ("chunked", "triton")]
HEAD, COL, GROUP, ENTRY = 1, 3, 1, 5  # where the bad value goes (Mamba-2: head 1 reads group 1)
CHANNEL = 7  # Mamba-1


def _captures(j):
    """Offsets around the bad token and the chunk grid: states before it (<= j) and just after."""
    return sorted({0, 7, CHUNK, CHUNK + 1, j - 1, j, j + 1, 2 * CHUNK, SEQLEN})


# Per input: where the bad value goes, the part of y[:, j] it enters, the part of the states it
# feeds (None: the states do not read it). Mamba-2 y (batch, seqlen, H, P), states (.., H, P, N).
MAMBA2_CASES = {
    "x": ((0, None, HEAD, COL), (HEAD, COL), (HEAD, COL)),
    "dt": ((0, None, HEAD), (HEAD,), (HEAD,)),
    "B": ((0, None, GROUP, ENTRY), (HEAD,), (HEAD, slice(None), ENTRY)),
    "C": ((0, None, GROUP, ENTRY), (HEAD,), None),
    "z": ((0, None, HEAD, COL), (HEAD, COL), None),
}
# Mamba-1 y (batch, dim, seqlen), states (.., dim, N); B and C are shared by every channel.
MAMBA1_CASES = {
    "u": ((0, CHANNEL, None), (CHANNEL,), (CHANNEL,)),
    "delta": ((0, CHANNEL, None), (CHANNEL,), (CHANNEL,)),
    "B": ((0, ENTRY, None), (), (slice(None), ENTRY)),
    "C": ((0, ENTRY, None), (), None),
    "z": ((0, CHANNEL, None), (CHANNEL,), None),
}


def _run_mamba2(inputs, algorithm, backend, j):
    return mamba2_scan(**inputs, dt_softplus=True, capture=[(0, k) for k in _captures(j)],
                       backend=backend, algorithm=algorithm, chunk_size=CHUNK)


def _run_mamba1(inputs, algorithm, backend, j):
    return mamba1_scan(**inputs, delta_softplus=True, capture=[(0, k) for k in _captures(j)],
                       backend=backend, algorithm=algorithm, chunk_size=CHUNK)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # backend="triton" needs CUDA tensors there
SCANS = {
    "mamba2": (lambda: mamba2_inputs(1, SEQLEN, nheads=2, headdim=16, ngroups=2, dstate=16, device=DEVICE),
               _run_mamba2, MAMBA2_CASES, 1),
    "mamba1": (lambda: mamba1_inputs(1, SEQLEN, dim=16, dstate=16, device=DEVICE), _run_mamba1, MAMBA1_CASES, -1),
}


@functools.lru_cache(maxsize=None)
def _clean(scan, algorithm, backend, j):
    """The inputs of a scan (fixed by their own seed) and its clean pass on a path."""
    make, run, _, _ = SCANS[scan]
    torch.manual_seed(1)
    inputs = make()
    return inputs, run(inputs, algorithm, backend, j)


def _at(index, j):
    """The index with the time axis (None) set to token j."""
    return tuple(j if i is None else i for i in index)


def _case_ids():
    for scan, (_, _, cases, _) in SCANS.items():
        for name in cases:
            for value in VALUES:
                for j in BAD_TOKENS:
                    for algorithm, backend in PATHS:
                        yield pytest.param(scan, name, value, j, algorithm, backend,
                                           id=f"{scan}-{algorithm}-{backend}-{name}-{value}-t{j}")


@pytest.mark.parametrize("scan, name, value, j, algorithm, backend", list(_case_ids()))
def test_bad_token_reaches_only_itself_and_later(scan, name, value, j, algorithm, backend):
    _, run, cases, time_axis = SCANS[scan]
    where, y_part, state_part = cases[name]
    inputs, clean = _clean(scan, algorithm, backend, j)
    bad_inputs = dict(inputs, **{name: inputs[name].clone()})
    bad_inputs[name][_at(where, j)] = VALUES[value]
    bad = run(bad_inputs, algorithm, backend, j)

    before = lambda y: y.narrow(time_axis % y.ndim, 0, j)
    assert torch.isfinite(before(bad.y)).all(), f"non-finite y before token {j}"
    assert torch.equal(before(bad.y), before(clean.y)), f"y before token {j} differs from the clean pass"
    y_j = bad.y.select(time_axis % bad.y.ndim, j)[0]
    assert not torch.isfinite(y_j[y_part]).any(), f"y at token {j} is finite where {name} enters it"

    offsets = _captures(j)
    for k, state, clean_state in zip(offsets, bad.captured_states, clean.captured_states):
        if k <= j or state_part is None:  # before the bad token, or an input the states never read
            assert torch.equal(state, clean_state), f"captured state at offset {k} differs from the clean pass"
        elif k == j + 1:
            assert not torch.isfinite(state[state_part]).any(), f"state after token {j} is finite where {name} feeds it"
    if state_part is None:
        assert torch.equal(bad.final_states, clean.final_states), f"final state differs though {name} feeds no state"
    else:
        assert not torch.isfinite(bad.final_states[0][state_part]).any(), f"final state is finite where {name} feeds it"
