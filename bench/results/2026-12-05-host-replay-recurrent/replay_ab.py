"""The public calls' host time with and without the replay of their launches, in one run: python
bench/results/2026-12-05-host-replay-recurrent/replay_ab.py (from the repository root, with tools/
on PYTHONPATH). bench.host's layer calls (`mamba2_scan` chunked and recurrent, a
`selective_state_update` decode step; launches stubbed after binding) and the bench.scan rows at
Mamba-2 2.7B, 8192 tokens, batch 1, bfloat16, timed in alternating blocks, every call after three
like it (a model's fourth and later layers): "replayed", as the calls run; "not replayed", the
same calls with the replay bypassed (each runs its host code and Triton's argument binding), as
every recurrent call ran before."""
import contextlib
from unittest import mock

from bench import host
from ssm_kernels import _replay

BLOCKS, CALLS = 20, 10


def not_replayed():
    """The public calls with their replay bypassed: every call runs its host code."""
    return mock.patch.object(_replay, "run", lambda launches, op, tensors, call, fresh=False: call())


def main():
    host.torch.set_num_threads(1)
    cases = host.public_cases()
    # warm-up: a plain call, two recordings, a replay; each kernel's binder
    host.timed_blocks(cases, {"replayed": contextlib.nullcontext, "not replayed": not_replayed}, BLOCKS, CALLS,
                      warmup=4)


if __name__ == "__main__":
    main()
