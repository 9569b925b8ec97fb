"""The seed's incident, end to end, on the small hybrid model.

A 32772-token prompt is prefilled cold under each planning policy (block 16, first chunk 8193,
later chunks 8192, interval snapshots every 32 blocks), then the byte-identical request is
served warm from the prefix cache. The table shows the passes, the in-pass captures, where the
warm request restored and how many tokens it replayed, the wall times, and whether every
logit of the cold and warm runs is bit-identical to one cold pass of the prompt (torch.equal).
The seed: legacy restored at 24577 and replayed 8195 tokens; the fix (split) restores at 32752
and replays 20; in-pass capture (inpass, free) restores at 32768 and replays 4.

By default the incident is scaled down 8x (budget 1024, total 4100, interval 4) so that it runs
in seconds on a CPU; the relations that made the incident stay: the first chunk is one token past
a block boundary, and under legacy the tail split point falls inside the second-to-last chunk.
``--full`` runs it at full size (minutes on a CPU).
Batch-invariant projections and norms throughout, and two scans (PyTorch on CPU, Triton on CUDA):
the recurrent one, exact at any split, and the chunked one (chunk 256, less at small scales),
exact at multiples of its chunk size, so its engine plans on that grid (planner's grid option):
its warm requests restore at a grid point and are bit-identical too. Its table shows the replay
that grid costs.

    python -m ssm_serving.demo [--scale N | --full] [--layers L] [--hidden H] ...
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from planner import POLICIES, plan_prefill
from planner.cli import int_argument
from ssm_kernels import MAX_DSTATE

from .engine import Engine
from .model import HybridConfig, HybridLM

# The seed's incident at full size.
FULL_BUDGET, BLOCK_SIZE, FULL_INTERVAL = 8192, 16, 32
DEFAULT_SCALE = 8
# The budget must stay at least two blocks, so that the tail split point (one block below the
# last boundary) falls strictly inside a chunk rather than on a chunk end.
MAX_SCALE = FULL_BUDGET // (2 * BLOCK_SIZE)
SEED_RESULT = {"legacy": (24577, 8195), "split": (32752, 20), "inpass": (32768, 4), "free": (32768, 4)}
SCANS = ("recurrent", "chunked")
CHUNK_SIZE = 256  # the chunked scan's default; smaller when the budget is (passes end on its grid)


@dataclass(frozen=True)
class Incident:
    """The incident's serving rules at 1/scale of its size."""

    scale: int

    @property
    def budget(self) -> int:
        return FULL_BUDGET // self.scale

    @property
    def first_budget(self) -> int:
        return self.budget + 1  # prefill budget + max batch size 1

    @property
    def total(self) -> int:
        return 4 * self.budget + 4  # 32772 at full size

    @property
    def interval(self) -> int:
        return max(1, FULL_INTERVAL // self.scale)

    def rules(self) -> dict:
        return dict(block_size=BLOCK_SIZE, budget=self.budget, first_budget=self.first_budget,
                    interval=self.interval)


def _scale(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int, got {text!r}") from None
    if value < 1 or value > MAX_SCALE or value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two from 1 to {MAX_SCALE}, got {value}")
    return value


_positive = int_argument(1)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--scale", type=_scale, default=None,
                      help="divide the incident's budget (and prompt) by this power of two (default 8: "
                           "budget 1024, 4100 tokens)")
    size.add_argument("--full", action="store_true", help="the incident at full size (32772 tokens; minutes on a CPU)")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES), metavar="POLICY",
                        help=f"policies to run (default: all of {', '.join(POLICIES)})")
    parser.add_argument("--scans", nargs="+", choices=SCANS, default=list(SCANS), metavar="SCAN",
                        help=f"Mamba scans to serve with (default: both of {', '.join(SCANS)})")
    parser.add_argument("--layers", type=_positive, default=4, help="model layers (default 4)")
    parser.add_argument("--attention-every", type=int_argument(0), default=2,
                        help="every n-th layer is attention, the rest Mamba-2 (default 2; 0: none)")
    parser.add_argument("--hidden", type=_positive, default=64, help="model width, a multiple of 16 (default 64)")
    parser.add_argument("--state-size", type=int_argument(1, MAX_DSTATE), default=16,
                        help=f"Mamba-2 state size, at most {MAX_DSTATE} (default 16)")
    parser.add_argument("--vocab", type=_positive, default=256, help="vocabulary size (default 256)")
    parser.add_argument("--seed", type=int_argument(0), default=0,
                        help="seed of the weights and the prompt (default 0)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda when available (default)")
    parser.add_argument("--threads", type=int_argument(1, os.cpu_count() or 1), default=1,
                        help="CPU threads for torch, at most the CPUs (default 1: the model's ops are token-sized, "
                             "and extra threads only spin, badly so on a shared machine)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


def build_parser() -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(
        prog="python -m ssm_serving.demo", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter))


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.policies, args.scans = list(dict.fromkeys(args.policies)), list(dict.fromkeys(args.scans))  # a row each
    if args.hidden % 16:
        parser.error(f"argument --hidden: must be a multiple of 16 (2 * hidden channels in Mamba heads of 32), "
                     f"got {args.hidden}")
    try:  # the model's own checks, its size limits among them, before anything is built
        _configs(args)
    except (TypeError, ValueError) as error:
        parser.error(f"model: {error}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("argument --device: cuda is not available")


def _lengths(passes) -> str:
    return "+".join(str(length) for _, length in passes)


def run(args: argparse.Namespace, out=None) -> int:
    """Run the demo for parsed arguments; print the table to ``out``; 0 when every check holds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, sys.stdout if out is None else out)
    finally:
        torch.set_num_threads(threads)


def chunk_size_for(budget: int) -> int:
    """The chunked scan's chunk size at a budget: CHUNK_SIZE, or the largest power of two that
    fits the budget (at least 16), so that passes can end on its grid."""
    return max(16, min(CHUNK_SIZE, 1 << (budget.bit_length() - 1)))


def _incident(args: argparse.Namespace) -> Incident:
    return Incident(1 if args.full else args.scale or DEFAULT_SCALE)


def _configs(args: argparse.Namespace) -> dict[str, HybridConfig]:
    """The model's config per scan."""
    chunk = chunk_size_for(_incident(args).budget)
    return {scan: HybridConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                               attention_every=args.attention_every, mamba_heads=args.hidden * 2 // 32,
                               mamba_head_dim=32, state_size=args.state_size, mlp_size=2 * args.hidden,
                               seed=args.seed, scan_algorithm=scan, chunk_size=chunk if scan == "chunked" else None)
            for scan in args.scans}


def _run(args: argparse.Namespace, out) -> int:
    incident = _incident(args)
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    chunk = chunk_size_for(incident.budget)
    configs = _configs(args)
    rng = random.Random(args.seed)
    prompt = [rng.randrange(args.vocab) for _ in range(incident.total)]
    rules = incident.rules()

    def warm_estimate(policy, grid):
        return plan_prefill(incident.total, policy=policy, grid=grid, **rules).warm_restore().replay_tokens

    bar = tqdm(total=sum(incident.total * (1 + len(args.policies)) + sum(warm_estimate(p, c.scan_grid)
                                                                          for p in args.policies)
                         for c in configs.values()),
               unit="tok", desc="prefill", file=sys.stderr, disable=args.no_progress, dynamic_ncols=True)
    began = time.perf_counter()
    tables = {}
    for scan, config in configs.items():
        model = HybridLM(config, device=device)
        bar.set_postfix_str(f"{scan}: one cold pass (reference)")
        reference = model.prefill(prompt)
        bar.update(incident.total)
        rows = tables[scan] = []
        for policy in args.policies:
            engine = Engine(model, policy=policy, **rules)
            bar.set_postfix_str(f"{scan} {policy}: cold")
            cold = engine.serve(prompt, on_tokens=bar.update)
            bar.set_postfix_str(f"{scan} {policy}: warm")
            warm = engine.serve(prompt, on_tokens=bar.update)
            exact = torch.equal(cold.logits, reference) and torch.equal(warm.logits, reference[warm.restore_point:])
            rows.append((policy, _lengths(cold.passes), str(len(cold.captures)), str(len(cold.snapshots)),
                         str(warm.restore_point), str(warm.replayed), _lengths(warm.passes),
                         f"{cold.wall_s:.2f}", f"{warm.wall_s:.3f}", "yes" if exact else "NO"))
    bar.close()
    elapsed = time.perf_counter() - began

    config = next(iter(configs.values()))
    layers = ", ".join(config.layer_types)
    print(f"incident{'' if incident.scale == 1 else f' at 1/{incident.scale} scale'}: {incident.total} tokens, "
          f"block {BLOCK_SIZE}, first chunk {incident.first_budget}, budget {incident.budget}, "
          f"interval {incident.interval} blocks", file=out)
    print(f"model: {config.num_layers} layers ({layers}), hidden {config.hidden_size}, vocab {config.vocab_size}, "
          f"{str(config.dtype).replace('torch.', '')}, {device.type} "
          f"({'Triton' if device.type == 'cuda' else 'PyTorch'} kernels)", file=out)
    print("warm = the byte-identical request served after the cold one; bitwise = every logit of both runs "
          "equals one cold pass (torch.equal)", file=out)
    header = ("policy", "cold passes", "captures", "snapshots", "warm restore", "replayed", "warm passes",
              "cold s", "warm s", "bitwise")
    titles = {"recurrent": "recurrent scan: exact at any split",
              "chunked": f"chunked scan, chunk {chunk}: exact at multiples of {chunk}, so passes and snapshots "
                         f"are planned on that grid"}
    for scan, rows in tables.items():
        print(f"\n{titles[scan]}", file=out)
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        for line in (header, *rows):
            print("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
                  .rstrip(), file=out)
    print("\nseed at full size: " + "; ".join(f"{p} restores at {r} and replays {n}"
                                             for p, (r, n) in SEED_RESULT.items())
          + f"\ndemo wall time {elapsed:.1f} s", file=out)
    return 0 if all(r[-1] == "yes" for rows in tables.values() for r in rows) else 1


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
