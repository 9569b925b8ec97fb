"""mamba_ssm_compat.selective_state_update's host time on its per-channel (Mamba-1) path: the
one-token recurrent pass on the state's batch slots in place in the state's own dtype (now)
against the pass on a float32 copy of the batch's rows written back by index_copy_ (as at
BEFORE, selective_state_update and _untied_update taken from git); a float32 pool with
state_batch_indices and a bfloat16 pool, batch 8, 4 heads of 16 channels, dstate 16, Triton's
launches stubbed (bench.host), alternating blocks in one run. Run from the repository root:
PYTHONPATH=$PWD:$PWD/tools python bench/results/2026-12-05-compat-in-place/in_place_ab.py"""
import contextlib
from unittest import mock

import torch

from bench import host  # chooses the Triton mode first
from bench.common import functions_at
from ssm_kernels.adapters import mamba_ssm_compat as compat
from ssm_kernels.scan.mamba1 import mamba1_step_unchecked
from ssm_kernels.scan.mamba2 import STATE_DTYPES

BEFORE = "d969bf4"
BATCH, H, P, N = 8, 4, 16, 16


def call(dtype, update):
    state = torch.randn(4 * BATCH, H, P, N).to(dtype)
    x, dt = torch.randn(BATCH, H, P), torch.rand(BATCH, H, P)  # dt per channel: the per-channel path
    A, B, C = -torch.rand(H, P, N), torch.randn(BATCH, 1, N), torch.randn(BATCH, 1, N)
    slots = torch.arange(BATCH) * 4
    return lambda validate: update()(state, x, dt, A, B, C, D=torch.ones(H, P), dt_softplus=True,
                                     state_batch_indices=slots, backend="triton")


if __name__ == "__main__":
    torch.set_num_threads(1)
    before = functions_at(BEFORE, compat, ("selective_state_update", "_untied_update"),
                          mamba1_step_unchecked=mamba1_step_unchecked,
                          STATE_DTYPES=STATE_DTYPES)["selective_state_update"]
    chosen = {"update": compat.selective_state_update}
    update = lambda: chosen["update"]  # noqa: E731

    @contextlib.contextmanager
    def using(function):
        with mock.patch.dict(chosen, update=function):
            yield

    cases = {"float32 pool": call(torch.float32, update), "bfloat16 pool": call(torch.bfloat16, update)}
    host.timed_blocks(cases, {"now": lambda: using(compat.selective_state_update), BEFORE: lambda: using(before)},
                      blocks=20, calls=10, warmup=4)
