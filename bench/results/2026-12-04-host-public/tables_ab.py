"""The public chunked scan's host time per call with and without the recent-tables cache, in one
run: python bench/results/2026-12-04-host-public/tables_ab.py (from the repository root, with
tools/ on PYTHONPATH). bench.host's layer call (`mamba2_scan chunked`, launches stubbed after
binding), and the bench.scan row at Mamba-2 2.7B, 8192 tokens, batch 1, bfloat16 (32 chunks of
256), timed in alternating blocks: "cached", calls after one like them (a model's later
layers); "planned", the same calls with the cache emptied before each, so each plans and copies
its tables, as every call did before the cache."""
import statistics
import time

from bench import host
from ssm_kernels.scan.mamba2_chunked import tables

BLOCKS, CALLS = 20, 10


def timed(call, forget: bool) -> float:
    if forget:
        tables._recent_tables.cache_clear()
    began = time.perf_counter()
    call(False)
    return (time.perf_counter() - began) * 1e6


def main():
    host.torch.set_num_threads(1)
    cases = host.public_cases()
    with host.launches_stubbed():
        for name, call in cases.items():
            times = {"cached": [], "planned": []}
            for _ in range(3):
                call(False)  # warm-up: each kernel's binder
            for _ in range(BLOCKS):
                for mode in times:
                    times[mode] += [timed(call, mode == "planned") for _ in range(CALLS)]
            cached, planned = (statistics.median(times[m]) for m in ("cached", "planned"))
            print(f"{name}: cached {cached:.0f} us, planned {planned:.0f} us, cached / planned {cached / planned:.2f} "
                  f"(medians of {BLOCKS * CALLS} calls each)")


if __name__ == "__main__":
    main()
