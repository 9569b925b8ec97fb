"""The host time the output kernel's fix-up launch adds to a public chunked Mamba-2 call, in one
run: python bench/results/2026-12-05-host-fixup/fixup_ab.py (from the repository root, with
tools/ on PYTHONPATH). bench.host's layer call (`mamba2_scan chunked`) and the bench.scan row at
Mamba-2 2.7B, 8192 tokens, launches stubbed after binding, timed in alternating blocks
(bench.host.timed_blocks), every call after three like it: with the fix-up launched, as the scan
runs, and with it left out (stage 5's output kernel alone, as before the fix-up; y would be wrong
on a non-finite x, which these inputs do not hold). Once with the launches replayed (each mode
records and replays its own) and once with the replay bypassed (each call binds every launch)."""
import contextlib
from unittest import mock

import torch

from bench import host
from ssm_kernels import _replay as replay
from ssm_kernels.scan.mamba2_chunked import triton_kernel

REAL_RUN = replay.run
SIDE: dict = {}  # the recorded launches of the pass without the fix-up, by the real pass's record


def without_fixup():
    """The pass without the fix-up's launch, its replays recorded apart from the real pass's."""
    launch = triton_kernel.launch

    def launch_but_fixup(kernel, grid, *args, **kwargs):
        if kernel is not triton_kernel._nonfinite_output_kernel:
            launch(kernel, grid, *args, **kwargs)

    def run_apart(launches, op, tensors, call, fresh=False):
        REAL_RUN(SIDE.setdefault(id(launches), {}), op, tensors, call, fresh)

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(triton_kernel, "launch", launch_but_fixup))
    stack.enter_context(mock.patch.object(replay, "run", run_apart))
    return stack


def bypassed():
    return mock.patch.object(replay, "run", lambda launches, op, tensors, call, fresh=False: call())


def bypassed_without_fixup():
    stack = without_fixup()
    stack.enter_context(bypassed())
    return stack


if __name__ == "__main__":
    torch.set_num_threads(1)
    cases = {k: v for k, v in host.public_cases().items() if k in ("bench.host's mamba2_scan chunked",
                                                                   "2.7B, 8192 tokens, chunked")}
    print("replayed:")
    host.timed_blocks(cases, {"with the fix-up": contextlib.nullcontext, "without": without_fixup}, 20, 10, warmup=4)
    print("replay bypassed:")
    host.timed_blocks(cases, {"with the fix-up": bypassed, "without": bypassed_without_fixup}, 20, 10, warmup=4)
