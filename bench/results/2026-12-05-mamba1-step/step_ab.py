"""Mamba1Mixer.step's host time with its scan as an unchecked one-token pass on the state in place
(now) against a checked one-token mamba1_scan and a copy of its final states into the state (as at
BEFORE, its _step taken from git): bench.host's small layer shape (hidden 64, 128 channels, dstate
16), 8 sequences, Triton's launches stubbed (bench.host), alternating blocks in one run. Run from
the repository root: PYTHONPATH=$PWD:$PWD/tools python bench/results/2026-12-05-mamba1-step/step_ab.py"""
import contextlib
import subprocess
import textwrap
from unittest import mock

import torch

from bench import host  # chooses the Triton mode first
from ssm_kernels.layers import Mamba1Mixer, mamba1

BEFORE = "466072c"
SEQS = 8


def step_before():
    """Mamba1Mixer._step at BEFORE."""
    source = subprocess.run(["git", "show", f"{BEFORE}:ssm_kernels/layers/mamba1.py"], capture_output=True, text=True,
                            check=True).stdout
    start = source.index("    def _step(")
    end = source.find("\n\n", start)
    space = dict(vars(mamba1))
    exec(textwrap.dedent(source[start:end if end > 0 else len(source)]), space)
    return space["_step"]


if __name__ == "__main__":
    torch.set_num_threads(1)
    layer = Mamba1Mixer(64, intermediate_size=128, state_size=16, backend="triton")
    hidden, state = torch.randn(SEQS, 64), layer.initial_state(SEQS)
    cases = {"Mamba1Mixer.step": lambda validate: layer.step(hidden, state)}
    before = step_before()
    with torch.no_grad():
        host.timed_blocks(cases, {"now": contextlib.nullcontext,
                                  BEFORE: lambda: mock.patch.object(Mamba1Mixer, "_step", before)},
                          blocks=20, calls=10, warmup=4)
