"""selective_state_update's host time, validated, with check_decode_slots as it is against as it
was at BEFORE (taken from git), and unvalidated: batches of 4, 64 and 256 rows, without slot
indices, with state_indices, and with dst_state_indices equal to them; launches stubbed
(bench.host), alternating blocks in one run. Run from the repository root:
PYTHONPATH=$PWD:$PWD/tools python bench/results/2026-12-05-decode-checks/decode_checks_ab.py"""
import contextlib
import math
import subprocess
import timeit
from unittest import mock

import torch

from bench import host  # chooses the Triton mode first
from ssm_kernels import _common, selective_state_update
from ssm_kernels.scan import mamba2

BEFORE = "d3b3243"
VALIDATE = {"on": True}  # the calls' `validate`, switched by the modes below


def check_before():
    """check_decode_slots from ssm_kernels/_common.py at BEFORE."""
    source = subprocess.run(["git", "show", f"{BEFORE}:ssm_kernels/_common.py"], capture_output=True, text=True,
                            check=True).stdout
    space = dict(vars(_common))
    start = source.index("def check_decode_slots(")
    exec(source[start:source.index("\n\n\n", start)], space)
    return space["check_decode_slots"]


def decode_call(batch: int, **indices):
    """A layer's decode step at bench.host's small shape, its `validate` switched by the modes."""
    H, P, N = 4, 16, 16
    state = torch.zeros(batch, H, P, N)
    x, dt, A = torch.randn(batch, H, P), torch.rand(batch, H), -torch.rand(H)
    B, C, D, bias = torch.randn(batch, 1, N), torch.randn(batch, 1, N), torch.ones(H), torch.zeros(H)
    return lambda validate: selective_state_update(state, x, dt, A, B, C, D=D, dt_bias=bias, dt_softplus=True,
                                                   backend="triton", validate=VALIDATE["on"], **indices)


def cases() -> dict:
    out = {}
    for batch in (4, 64, 256):
        rows = torch.arange(batch)
        out[f"batch {batch}, no indices"] = decode_call(batch)
        out[f"batch {batch}, state_indices"] = decode_call(batch, state_indices=rows)
        out[f"batch {batch}, both indices, in place"] = decode_call(batch, state_indices=rows,
                                                                    dst_state_indices=rows.clone())
    return out


@contextlib.contextmanager
def unvalidated():
    VALIDATE["on"] = False
    try:
        yield
    finally:
        VALIDATE["on"] = True


def each_check() -> None:
    """What each of the call's checks takes alone at batch 4, no indices (timeit)."""
    b, H, P, N = 4, 4, 16, 16
    state, x, dt, A = torch.zeros(b, H, P, N), torch.randn(b, H, P), torch.rand(b, H), -torch.rand(H)
    B, C, D, bias = torch.randn(b, 1, N), torch.randn(b, 1, N), torch.ones(H), torch.zeros(H)
    read = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=None, dt_bias=bias, state_indices=None, dst_state_indices=None)
    checks = {
        "check_mamba2_args": lambda: mamba2.check_mamba2_args(x, dt, A, B, C, D, None, bias, token_dims=("batch",)),
        "check_written": lambda: _common.check_written(dict(state=state), read),
        "check_same_device": lambda: _common.check_same_device(state=state, **read),
        "check_dt_limit": lambda: _common.check_dt_limit((0.0, math.inf)),
        "check_decode_slots": lambda: _common.check_decode_slots(None, None, None, b, b),
        "check_tensor (state)": lambda: _common.check_tensor("state", state, [("nslots", None), ("nheads", H),
                                                                            ("headdim", P), ("dstate", N)]),
    }
    for name, check in checks.items():
        print(f"{name}: {min(timeit.repeat(check, number=2000, repeat=5)) / 2000 * 1e6:.1f} us")


if __name__ == "__main__":
    torch.set_num_threads(1)
    before = check_before()
    print(f"validated, check_decode_slots now against as it was at {BEFORE}:")
    host.timed_blocks(cases(), {"now": contextlib.nullcontext,
                                BEFORE: lambda: mock.patch.object(mamba2, "check_decode_slots", before)},
                      blocks=20, calls=10, warmup=4)
    print("now, validated against validate=False:")
    host.timed_blocks(cases(), {"validated": contextlib.nullcontext, "unvalidated": unvalidated},
                      blocks=20, calls=10, warmup=4)
    print("each check alone, batch 4, no indices:")
    each_check()
