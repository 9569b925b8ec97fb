"""The public chunked scan's host time per call with and without the replay of its launches, in one
run: python bench/results/2026-12-04-host-replay-public/replay_ab.py (from the repository root, with
tools/ on PYTHONPATH). bench.host's layer call (`mamba2_scan chunked`, launches stubbed after
binding) and the bench.scan row at Mamba-2 2.7B, 8192 tokens, batch 1, bfloat16, timed in
alternating blocks, every call after three like it (a model's fourth and later layers), its chunk
tables and capture table those of the calls before (tables.recent_pass): "replayed", as the scan
runs; "not replayed", the same calls with the replay bypassed (each runs the stages' host code
and Triton's argument binding), as every call ran before it."""
import contextlib
from unittest import mock

from bench import host
from ssm_kernels.scan import mamba2_chunked

BLOCKS, CALLS = 20, 10


def not_replayed():
    """The public path with its replay bypassed: every call runs the stages."""
    return mock.patch.object(mamba2_chunked._replay, "run", lambda launches, op, tensors, call, fresh=False: call())


def main():
    host.torch.set_num_threads(1)
    cases = host.public_cases()
    # warm-up: a plain call, two recordings, a replay; each kernel's binder
    host.timed_blocks(cases, {"replayed": contextlib.nullcontext, "not replayed": not_replayed}, BLOCKS, CALLS,
                      warmup=4)


if __name__ == "__main__":
    main()
