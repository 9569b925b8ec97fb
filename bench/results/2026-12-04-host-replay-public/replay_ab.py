"""The public chunked scan's host time per call with and without the replay of its launches, in one
run: python bench/results/2026-12-04-host-replay-public/replay_ab.py (from the repository root, with
tools/ on PYTHONPATH). bench.host's layer call (`mamba2_scan chunked`, launches stubbed after
binding) and the bench.scan row at Mamba-2 2.7B, 8192 tokens, batch 1, bfloat16, timed in
alternating blocks, every call after three like it (a model's fourth and later layers), its chunk
tables and capture table those of the calls before (tables.recent_pass): "replayed", as the scan
runs; "not replayed", the same calls with the replay bypassed (each runs the stages' host code
and Triton's argument binding), as every call ran before it."""
import statistics
import time
from unittest import mock

from bench import host
from ssm_kernels.scan import mamba2_chunked

BLOCKS, CALLS = 20, 10


def not_replayed():
    """The public path with its replay bypassed: every call runs the stages."""
    return mock.patch.object(mamba2_chunked._replay, "run", lambda launches, op, tensors, call, fresh=False: call())


def timed(call) -> float:
    began = time.perf_counter()
    call(False)
    return (time.perf_counter() - began) * 1e6


def scan_row(algorithm: str):
    """bench.scan's call at Mamba-2 2.7B (80 heads x 64, dstate 128, one group), 8192 tokens."""
    torch = host.torch
    f = dict(dtype=torch.bfloat16)
    x, dt = torch.randn(1, 8192, 80, 64, **f), torch.randn(1, 8192, 80, **f)
    B, C = torch.randn(1, 8192, 1, 128, **f), torch.randn(1, 8192, 1, 128, **f)
    A, D = -torch.rand(80), torch.ones(80)
    return lambda validate: host.mamba2_scan(x, dt, A, B, C, D=D, dt_softplus=True, backend="triton",
                                             algorithm=algorithm)


def main():
    host.torch.set_num_threads(1)
    layer = host.calls(host._step(host.torch.device("cpu")))
    cases = {"bench.host's mamba2_scan chunked": layer["mamba2_scan chunked"],
             "bench.host's mamba2_scan recurrent": layer["mamba2_scan recurrent"],
             "2.7B, 8192 tokens, chunked": scan_row("chunked"), "2.7B, 8192 tokens, recurrent": scan_row("recurrent")}
    with host.launches_stubbed():
        for name, call in cases.items():
            times = {"replayed": [], "not replayed": []}
            for _ in range(4):
                call(False)  # a plain call, two recordings, a replay; each kernel's binder
            for _ in range(BLOCKS):
                for mode in times:
                    if mode == "replayed":
                        times[mode] += [timed(call) for _ in range(CALLS)]
                    else:
                        with not_replayed():
                            times[mode] += [timed(call) for _ in range(CALLS)]
            replayed, plain = (statistics.median(times[m]) for m in times)
            print(f"{name}: replayed {replayed:.0f} us, not replayed {plain:.0f} us, replayed / not replayed "
                  f"{replayed / plain:.2f} (medians of {BLOCKS * CALLS} calls each)")


if __name__ == "__main__":
    main()
