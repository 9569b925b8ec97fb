"""The prefill ops on CPU tensors: python -m bench.cpu [--rounds N] [--out DIR]

What a layer call of the engine ops costs on the CPU (the vLLM plugin's path on vLLM's CPU build),
at the tiny hybrids of bench.vllm: one 256-token pass of one sequence resuming from its cache slot,
one torch thread. Per op: the recurrent scan by its compiled loop (ssm_kernels/scan/cpu_loop.c) and
by its PyTorch loop, the chunked PyTorch path (Mamba-2 chunk 64 as the model's; Mamba-1 64), and
the conv. Each round times every variant once, in turn (so that a slower or busier stretch of a
shared machine touches all of them); the table gives the median over rounds of each call's CPU
time (time.thread_time) and its ratio to the compiled loop. Results: cpu.json and cpu.md in --out
(default bench/results/<date>-cpu).
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path
from unittest import mock

import torch

from ssm_kernels import cache_ops
from ssm_kernels.scan import cpu_loop

from .common import RESULTS_DIR, cpu_name, git_commit, markdown_table, save_results

TOKENS, CHUNK = 256, 64
# bench.vllm's tiny models: GraniteMoeHybrid's Mamba-2 layer (8 heads of 32, dstate 32, one group),
# Jamba's Mamba-1 layer (256 channels, dstate 16).
MAMBA2 = dict(nheads=8, headdim=32, dstate=32, ngroups=1)
MAMBA1 = dict(dim=256, dstate=16)
WIDTH = 4


def _batch():
    return cache_ops.prefill_batch(torch.tensor([0, TOKENS], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                                   has_initial_state=torch.tensor([True]), start_positions=[TOKENS],
                                   host_cu_seqlens=[0, TOKENS], chunk_size=CHUNK)


def _mamba2_call(algorithm):
    h, p, n, g = MAMBA2.values()
    x, dt = torch.randn(TOKENS, h, p), torch.randn(TOKENS, h)
    B, C = torch.randn(TOKENS, g, n), torch.randn(TOKENS, g, n)
    A, D, dt_bias = -torch.rand(h) - 0.5, torch.randn(h), torch.randn(h)
    cache, out = torch.randn(4, h, p, n), torch.empty(TOKENS, h, p)
    batch = _batch()
    return lambda: cache_ops.mamba2_prefill(batch, x, dt, A, B, C, ssm_state=cache, out=out, D=D, dt_bias=dt_bias,
                                            dt_softplus=True, algorithm=algorithm, chunk_size=CHUNK, validate=False)


def _mamba1_call(algorithm):
    dim, n = MAMBA1.values()
    u, delta = torch.randn(dim, TOKENS), torch.randn(dim, TOKENS)
    B, C = torch.randn(n, TOKENS), torch.randn(n, TOKENS)
    A, D, delta_bias = -torch.rand(dim, n) - 0.5, torch.randn(dim), torch.randn(dim)
    cache, out = torch.randn(4, dim, n), torch.empty(dim, TOKENS)
    batch = _batch()
    return lambda: cache_ops.mamba1_prefill(batch, u, delta, A, B, C, ssm_state=cache, out=out, D=D,
                                            delta_bias=delta_bias, delta_softplus=True, algorithm=algorithm,
                                            chunk_size=CHUNK, validate=False)


def _conv_call():
    dim = MAMBA2["nheads"] * MAMBA2["headdim"] + 2 * MAMBA2["ngroups"] * MAMBA2["dstate"]
    x, weight, bias = torch.randn(dim, TOKENS), torch.randn(dim, WIDTH), torch.randn(dim)
    conv_state, out = torch.randn(4, dim, WIDTH - 1), torch.empty(dim, TOKENS)
    batch = _batch()
    return lambda: cache_ops.conv_prefill(batch, x, weight, bias, conv_state=conv_state, out=out, activation="silu",
                                          validate=False)


def _pytorch_loop(call):
    def run():
        with mock.patch.object(cpu_loop, "library", lambda: None):
            return call()
    return run


def variants() -> list[tuple[str, str, object]]:
    """(op, variant, call) in table order; the first variant of each op is its baseline."""
    rows = []
    for op, make in (("mamba2_prefill", _mamba2_call), ("mamba1_prefill", _mamba1_call)):
        rows += [(op, "recurrent, compiled loop", make("recurrent")),
                 (op, "recurrent, PyTorch loop", _pytorch_loop(make("recurrent"))),
                 (op, f"chunked (PyTorch, chunk {CHUNK})", make("chunked"))]
    rows.append(("conv_prefill", "PyTorch", _conv_call()))
    return rows


def measure(rounds: int) -> list[dict]:
    if cpu_loop.library() is None:
        raise SystemExit("the compiled CPU loop did not build here: nothing to compare")
    calls = variants()
    times = [[] for _ in calls]
    for call in calls:  # warm-up: one-time work (the build, tables) is not counted
        call[2]()
    for _ in range(rounds):
        for i, (_, _, call) in enumerate(calls):
            t = time.thread_time()
            call()
            times[i].append(time.thread_time() - t)
    rows, base = [], {}
    for (op, variant, _), ts in zip(calls, times):
        ms = statistics.median(ts) * 1e3
        base.setdefault(op, ms)
        rows.append({"op": op, "variant": variant, "ms": ms, "ratio": ms / base[op], "rounds": len(ts)})
    return rows


def markdown(rows: list[dict], env: dict) -> str:
    lines = ["# Prefill ops on CPU tensors, per layer call (one 256-token pass, one thread)", "",
             f"- CPU: {env['cpu']}; torch {env['torch']}; commit {env['commit']}; {env['date']}",
             f"- medians over {env['rounds']} rounds of each call's CPU time (time.thread_time); every variant "
             "once a round, in turn; ratio: to the op's first row", "",
             markdown_table(["op", "variant", "ms", "ratio"],
                            [[r["op"], r["variant"], f"{r['ms']:.3f}", f"{r['ratio']:.2f}"] for r in rows])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=21, help="rounds (default 21)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results/<date>-cpu)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = measure(args.rounds)
    env = {"cpu": cpu_name(), "commit": git_commit().get("commit", "unknown")[:12], "torch": torch.__version__,
           "date": datetime.date.today().isoformat(), "rounds": args.rounds}
    out = args.out or RESULTS_DIR / f"{env['date']}-cpu"
    save_results(out, "cpu", {"environment": env, "rows": rows}, markdown(rows, env))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
