"""What handing a state from one program to the next costs on the GPU: python -m bench.chain

A one-pass (fused) chunked scan passes each chunk's end state to the next chunk's program inside
the kernel: the program stores its state tile, then raises a flag; the next one waits on the flag,
then loads the tile. The chain of those hand-offs is serial, so its latency per hop decides whether
such a pass can beat the five-kernel pipeline (docs/chunked.md, "Designs tried and left"); the
static model cannot measure it. Here, per chain length L, one launch runs `--chains` independent
chains (a chain a head) of L programs each; a program takes a ticket (an atomic counter, so that a
program only ever waits on one that took an earlier ticket and is running or done), waits for its
predecessor's flag (an acquiring atomic read), loads its fp32 state tile (64 x 128 by default, a
Mamba-2 head's headdim x dstate), updates it (state * decay + 1), stores it, and raises its own
flag (a releasing atomic exchange after a barrier). The kernel time over L fits a line whose slope
is the cost of one hop.

On a GPU: CUDA-event kernel time (median of --repeats) per L, the fitted hop in microseconds, and
the chain's values checked against the recurrence. With --reduced (forced without a GPU, where the
Triton interpreter runs them): short chains, their values checked only; no time is reported.
Results: chain.json and chain.md in --out (default bench/results/<date>-gpu-chain, -gpu-reduced-chain
or -cpu-reduced-chain).
"""
from __future__ import annotations

from . import use_triton_interpreter

use_triton_interpreter(None)  # the interpreter only without a GPU; before triton is imported

import argparse  # noqa: E402
import datetime  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from .common import RESULTS_DIR, git_commit, markdown_table, save_results  # noqa: E402

DECAY = 0.5


@triton.jit
def _chain_kernel(states, flags, ticket, nchains, length, decay, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.atomic_add(ticket, 1)
    link, chain = t // nchains, t % nchains
    offs = tl.arange(0, BLOCK_P)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    here = chain * length + link
    state = tl.full((BLOCK_P, BLOCK_N), 1.0, tl.float32)
    if link > 0:
        while tl.atomic_add(flags + here - 1, 0, sem="acquire") == 0:
            pass
        state = tl.load(states + (here - 1) * (BLOCK_P * BLOCK_N) + offs) * decay + 1.0
    tl.store(states + here * (BLOCK_P * BLOCK_N) + offs, state)
    tl.debug_barrier()  # every thread's part of the tile stored before the flag goes up
    tl.atomic_xchg(flags + here, 1, sem="release")


def _buffers(nchains: int, length: int, block_p: int, block_n: int, device) -> tuple[torch.Tensor, ...]:
    """A launch's states (nchains, length, block_p, block_n), flags and ticket counter (both zero)."""
    return (torch.empty(nchains, length, block_p, block_n, device=device),
            torch.zeros(nchains * length, dtype=torch.int32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device))


def _launch(buffers: tuple[torch.Tensor, ...]) -> None:
    """One launch: a program per (chain, link) of the states buffer."""
    states, flags, ticket = buffers
    nchains, length, block_p, block_n = states.shape
    _chain_kernel[(nchains * length,)](states, flags, ticket, nchains, length, DECAY, BLOCK_P=block_p,
                                      BLOCK_N=block_n, num_warps=4)


def run_chains(nchains: int, length: int, block_p: int, block_n: int, device) -> torch.Tensor:
    """One launch: (nchains, length) programs; the states (nchains, length, block_p, block_n)."""
    buffers = _buffers(nchains, length, block_p, block_n, device)
    _launch(buffers)
    return buffers[0]


def expected(length: int) -> list[float]:
    """The value every element of link k holds: s_0 = 1, s_k = s_{k-1} * DECAY + 1 (exact in fp32)."""
    values = [1.0]
    for _ in range(length - 1):
        values.append(values[-1] * DECAY + 1.0)
    return values


def check(states: torch.Tensor) -> None:
    want = torch.tensor(expected(states.shape[1]), device=states.device)[None, :, None, None].expand_as(states)
    if not torch.equal(states, want):
        bad = (states != want).nonzero()[:5].tolist()
        raise AssertionError(f"a chain's states differ from the recurrence at (chain, link, row, col) {bad}")


def time_chain(nchains: int, length: int, block_p: int, block_n: int, repeats: int) -> float:
    """Median kernel time of one launch in ms (CUDA events; the buffers made outside the timing)."""
    times = []
    for _ in range(repeats + 1):  # the first compiles
        buffers = _buffers(nchains, length, block_p, block_n, "cuda")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _launch(buffers)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        check(buffers[0])
    return statistics.median(times[1:])


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares line through (length, ms): (ms per hop, ms at length 0)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return slope, my - slope * mx


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chains", type=int, default=80, help="chains a launch (default 80, Mamba-2 2.7B's heads)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--tile", type=int, nargs=2, default=[64, 128], metavar=("ROWS", "COLS"),
                        help="the state tile a program hands on, fp32 (default 64 128)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--reduced", action="store_true", help="check the values only (forced without a GPU)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    for name, values in (("--chains", [args.chains]), ("--lengths", args.lengths), ("--repeats", [args.repeats])):
        if min(values) < 1:
            parser.error(f"{name} must be >= 1, got {min(values)}")
    if len(set(args.lengths)) < 2:
        parser.error(f"--lengths needs two different lengths at least (a line is fitted), got {args.lengths}")
    if any(n < 1 or n & (n - 1) for n in args.tile):
        parser.error(f"--tile must be two powers of two (a Triton block), got {args.tile[0]} {args.tile[1]}")
    on_gpu = torch.cuda.is_available()
    reduced = args.reduced or not on_gpu
    block_p, block_n = args.tile
    env = {"device": torch.cuda.get_device_name() + (" (reduced)" if reduced else "") if on_gpu
           else "cpu (Triton interpreter)",
           "torch": torch.__version__, "triton": triton.__version__,
           "commit": git_commit().get("commit", "unknown")[:12], "date": datetime.date.today().isoformat(),
           "chains": args.chains, "tile": [block_p, block_n], "reduced": reduced}
    rows = []
    if reduced:  # short chains, values only (on CPU through the interpreter)
        for length in (1, 3):
            check(run_chains(2, length, 4, 8, "cuda" if on_gpu else "cpu"))
            rows.append({"length": length, "ms": None})
    else:
        for length in args.lengths:
            rows.append({"length": length, "ms": time_chain(args.chains, length, block_p, block_n, args.repeats)})
    hop = fit([(r["length"], r["ms"]) for r in rows]) if not reduced else None
    lines = [f"# State hand-off along a chain of programs ({env['device']}; triton {env['triton']}; "
             f"commit {env['commit']}; {env['date']})", ""]
    if reduced:
        lines.append(f"Reduced ({'compiled' if on_gpu else 'Triton interpreter'}): 2 chains of 1 and of 3 programs, "
                     "a 4 x 8 tile, their values checked against the recurrence; no times.")
    else:
        lines += [f"{args.chains} chains a launch, an fp32 {block_p} x {block_n} tile a hop; every chain's values "
                  "checked against the recurrence.", "",
                  markdown_table(["chain length", "kernel ms"], [[r["length"], f"{r['ms']:.4f}"] for r in rows]), "",
                  f"Fitted: {hop[0] * 1e3:.2f} us a hop, {hop[1] * 1e3:.1f} us at length 0."]
    kind = ("gpu" if on_gpu else "cpu") + ("-reduced" if reduced else "")
    out = args.out or RESULTS_DIR / f"{env['date']}-{kind}-chain"
    save_results(out, "chain", {"environment": env, "rows": rows, "hop_us": hop[0] * 1e3 if hop else None,
                                "base_us": hop[1] * 1e3 if hop else None}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
