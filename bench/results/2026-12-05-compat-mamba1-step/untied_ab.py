"""mamba_ssm_compat.selective_state_update's host time on its per-channel (Mamba-1) path: the
one-token recurrent pass through mamba1_step_unchecked on the batch's rows in place (now) against
a checked one-token mamba1_scan and a copy of its final states (as at BEFORE, _untied_update
taken from git); a float32 pool with state_batch_indices and a bfloat16 pool, batch 8, 4 heads
of 16 channels, dstate 16, Triton's launches stubbed (bench.host), alternating blocks in one run.
Run from the repository root:
PYTHONPATH=$PWD:$PWD/tools python bench/results/2026-12-05-compat-mamba1-step/untied_ab.py"""
import contextlib
import subprocess
from unittest import mock

import torch

from bench import host  # chooses the Triton mode first
from ssm_kernels.adapters import mamba_ssm_compat as compat

BEFORE = "441eb61"
BATCH, H, P, N = 8, 4, 16, 16


def untied_before():
    """_untied_update at BEFORE."""
    source = subprocess.run(["git", "show", f"{BEFORE}:ssm_kernels/adapters/mamba_ssm_compat.py"],
                            capture_output=True, text=True, check=True).stdout
    start = source.index("def _untied_update(")
    end = source.find("\n\n\n", start)
    space = dict(vars(compat))
    exec(source[start:end if end > 0 else len(source)], space)
    return space["_untied_update"]


def call(dtype):
    state = torch.randn(4 * BATCH, H, P, N).to(dtype)
    x, dt = torch.randn(BATCH, H, P), torch.rand(BATCH, H, P)  # dt per channel: the per-channel path
    A, B, C = -torch.rand(H, P, N), torch.randn(BATCH, 1, N), torch.randn(BATCH, 1, N)
    slots = torch.arange(BATCH) * 4
    return lambda validate: compat.selective_state_update(state, x, dt, A, B, C, D=torch.ones(H, P),
                                                          dt_softplus=True, state_batch_indices=slots,
                                                          backend="triton")


if __name__ == "__main__":
    torch.set_num_threads(1)
    before = untied_before()
    cases = {"float32 pool": call(torch.float32), "bfloat16 pool": call(torch.bfloat16)}
    host.timed_blocks(cases, {"now": contextlib.nullcontext,
                              BEFORE: lambda: mock.patch.object(compat, "_untied_update", before)},
                      blocks=20, calls=10, warmup=4)
