"""A layer's decode step (Mixer.step) host time with its conv and scan ops called unchecked, as
now (the layer checks the state and hidden states itself), against those ops checking their
arguments again (validate=True forced, as before): bench.host's small layer shape, 8 sequences,
Triton's launches stubbed (bench.host), alternating blocks in one run. Run from the repository root:
PYTHONPATH=$PWD:$PWD/tools python bench/results/2026-12-05-layer-step-checks/step_checks_ab.py"""
import contextlib
from unittest import mock

import torch

from bench import host  # chooses the Triton mode first
from ssm_kernels import causal_conv1d_update, selective_state_update
from ssm_kernels.layers import Mamba1Mixer, Mamba2Mixer, mamba1, mamba2

SEQS = 8


def checked(op):
    return lambda *args, **kwargs: op(*args, **{**kwargs, "validate": True})


@contextlib.contextmanager
def ops_checked_again():
    with mock.patch.object(mamba2, "causal_conv1d_update", checked(causal_conv1d_update)), \
            mock.patch.object(mamba2, "selective_state_update", checked(selective_state_update)), \
            mock.patch.object(mamba1, "causal_conv1d_update", checked(causal_conv1d_update)):
        yield


def step_call(layer):
    hidden = torch.randn(SEQS, layer.hidden_size)
    state = layer.initial_state(SEQS)
    return lambda validate: layer.step(hidden, state)


if __name__ == "__main__":
    torch.set_num_threads(1)
    cases = {"Mamba2Mixer.step": step_call(Mamba2Mixer(64, num_heads=4, head_dim=16, state_size=16, backend="triton")),
             "Mamba1Mixer.step": step_call(Mamba1Mixer(64, intermediate_size=128, state_size=16, backend="triton"))}
    with torch.no_grad():
        host.timed_blocks(cases, {"now": contextlib.nullcontext, "ops checked again": ops_checked_again},
                          blocks=20, calls=10, warmup=4)
