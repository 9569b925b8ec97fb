"""Command line: ``ssm-planner`` / ``python -m planner``.

``plan`` prints the passes, captures and snapshots of one prompt under one or all policies,
and where a warm follow-up restores. ``simulate`` serves synthetic traces under each policy
and prints a comparison table (``--json`` for machine-readable output).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import asdict
from typing import Callable, Iterable, Iterator, Sequence

from tqdm import tqdm

from .cache import EVICTION_POLICIES
from .plan import POLICIES, PrefillPlan, plan_prefill
from .rules import tail_boundary, tail_split_point
from .simulate import DEFAULT_PER_PASS_MS, DEFAULT_PER_TOKEN_MS, MAX_COST_MS, CostModel, simulate
from .traces import default_traces

# The seed engine's dense serve: 16-token KV blocks, prefill budget 8192, first chunk
# 8192 + max batch size 1, a snapshot every 32 blocks.
DEFAULTS = dict(block_size=16, budget=8192, first_budget=8193, interval=32)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a usage error)."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        if args.first_budget == 0:
            args.first_budget = None
        return args.run(args, args.parser)
    except SystemExit as stop:  # argparse's usage errors and --help
        return stop.code if isinstance(stop.code, int) else 1
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, as a filter does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit's flush
        return 1


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ssm-planner",
        description="Plan chunked prefill with SSM snapshots and compare policies on traces.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{plan,simulate}")

    plan = commands.add_parser(
        "plan", help="passes, captures and warm restore of one prompt",
        description="Print the prefill passes of one prompt, their in-pass captures and "
        "snapshots, and where a warm follow-up request restores, per policy.",
    )
    plan.add_argument("--total", type=int_argument(0), required=True, help="prompt tokens")
    _add_rule_arguments(plan)
    plan.add_argument("--policy", choices=(*POLICIES, "all"), default="all")
    plan.add_argument("--start", type=int_argument(0), default=0,
                      help="plan [start, total), as after a restore at start (default 0)")
    plan.add_argument("--branch-point", type=int_argument(0), action="append", default=[],
                      metavar="POSITION",
                      help="capture here under 'free' (repeatable; other policies "
                      "cannot capture there)")
    plan.add_argument("--shared-tokens", type=int_argument(0), default=None,
                      help="tokens the follow-up shares with this prompt (default: all)")
    plan.add_argument("--request-total", type=int_argument(1), default=None,
                      help="the follow-up's length (default: this prompt's)")
    plan.add_argument("--json", action="store_true", help="print JSON instead of tables")
    plan.set_defaults(run=_run_plan, parser=plan)

    sim = commands.add_parser(
        "simulate", help="compare policies on synthetic serving traces",
        description="Serve synthetic traces through the prefix cache under each policy and "
        "compare tokens computed, replay, passes, snapshots and modeled time.",
    )
    _add_rule_arguments(sim)
    sim.add_argument("--policy", choices=(*POLICIES, "all"), default="all")
    sim.add_argument("--trace", choices=("chat", "system", "agent", "all"), default="all")
    sim.add_argument("--seed", type=int_argument(0), default=0)
    sim.add_argument("--scale", type=int_argument(1), default=1,
                     help="multiply the number of requests per trace (default 1)")
    sim.add_argument("--max-snapshots", type=int_argument(0), default=None,
                     help="cap on cached snapshots (default: unbounded)")
    sim.add_argument("--eviction", choices=EVICTION_POLICIES, default="lru")
    sim.add_argument("--per-token-ms", type=_cost_ms, default=DEFAULT_PER_TOKEN_MS,
                     help=f"cost model (default {DEFAULT_PER_TOKEN_MS:.4f}, see planner.simulate)")
    sim.add_argument("--per-pass-ms", type=_cost_ms, default=DEFAULT_PER_PASS_MS,
                     help=f"cost model (default {DEFAULT_PER_PASS_MS:g})")
    sim.add_argument("--json", action="store_true", help="print JSON instead of tables")
    sim.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    sim.set_defaults(run=_run_simulate, parser=sim)
    return parser


def _add_rule_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-size", type=int_argument(1), default=DEFAULTS["block_size"],
                        help="KV block size in tokens (default %(default)s)")
    parser.add_argument("--budget", type=int_argument(1), default=DEFAULTS["budget"],
                        help="prefill budget per pass (default %(default)s)")
    parser.add_argument("--first-budget", type=int_argument(0),
                        default=DEFAULTS["first_budget"],
                        help="budget of the first pass, 0 for the plain budget "
                        "(default %(default)s)")
    parser.add_argument("--interval", type=int_argument(0), default=DEFAULTS["interval"],
                        help="snapshot every this many blocks, 0 for none (default %(default)s)")
    parser.add_argument("--grid", type=int_argument(1), default=1,
                        help="put passes and snapshots on multiples of this (the chunked scan's "
                        "chunk size, whose restores are exact only there; default 1: anywhere)")


def _in_flags(message: str, parser: argparse.ArgumentParser) -> str:
    """An API error in the command line's terms: its parameter names (the first word, and any
    name with an underscore) as the flags that set them."""
    flags = {action.dest: action.option_strings[0] for action in parser._actions
             if action.option_strings and action.dest != "help"}
    flags["branch_points"] = "--branch-point"
    return re.sub(r"^[a-z]+\b|\b[a-z]+(?:_[a-z]+)+\b",
                  lambda word: flags.get(word.group(), word.group()), message)


# -- plan ------------------------------------------------------------------------------------

def _run_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    policies = POLICIES if args.policy == "all" else (args.policy,)
    if args.total == 0 and (args.shared_tokens is not None or args.request_total is not None):
        parser.error("--shared-tokens and --request-total describe a warm follow-up of the prompt: "
                     "they need --total > 0")
    if args.branch_point and "free" not in policies:
        parser.error(f"--branch-point applies to policy 'free' only, got --policy {args.policy}")
    rules = dict(block_size=args.block_size, budget=args.budget,
                 first_budget=args.first_budget, start=args.start, grid=args.grid)
    try:
        plans = {
            policy: plan_prefill(
                args.total, interval=args.interval, policy=policy,
                branch_points=args.branch_point if policy == "free" else (), **rules,
            )
            for policy in policies
        }
        cache_off = plan_prefill(args.total, policy="free", **rules)
        warm = {
            policy: plan.warm_restore(args.shared_tokens, args.request_total)
            if args.total > 0 else None
            for policy, plan in plans.items()
        }
    except (TypeError, ValueError) as error:
        parser.error(_in_flags(str(error), parser))

    step = math.lcm(args.block_size, args.grid)  # the plan's tail points are in these steps
    if args.json:
        print(json.dumps({
            "total": args.total, "start": args.start, "interval": args.interval, "grid": args.grid,
            "block_size": args.block_size, "budget": args.budget,
            "first_budget": args.first_budget,
            "tail_boundary": tail_boundary(args.total, step),
            "tail_split_point": tail_split_point(args.total, step),
            "policies": {
                policy: {
                    "passes": [asdict(p) for p in plan.passes],
                    "extra_passes": len(plan.passes) - len(cache_off.passes),
                    "snapshot_positions": list(plan.snapshot_positions),
                    "warm": asdict(warm[policy]) if warm[policy] else None,
                }
                for policy, plan in plans.items()
            },
        }, indent=2))
        return 0

    print(f"prompt {args.total} tokens from {args.start}: block {args.block_size}, "
          f"budget {args.budget}, first budget {args.first_budget or args.budget}, "
          f"interval {args.interval}" + (f", grid {args.grid}" if args.grid > 1 else ""))
    print(f"tail boundary {tail_boundary(args.total, step)}, tail split point {tail_split_point(args.total, step)}"
          + (f" (steps of {step} tokens: blocks on the grid)" if step != args.block_size else ""))
    first_warm = next(iter(warm.values()))  # the match is the same under every policy
    if first_warm is not None:
        follow_up = args.total if args.request_total is None else args.request_total
        shared = min(args.total, follow_up) if args.shared_tokens is None else args.shared_tokens
        kind = "byte-identical" if (shared, follow_up) == (args.total, args.total) else "follow-up"
        print(f"warm request: {kind}, {_count(follow_up, 'token', 'tokens')} sharing "
              f"{shared}, block-floored match {first_warm.match}")
    for policy, plan in plans.items():
        print()
        _print_plan(policy, plan, warm[policy])
    if len(plans) > 1:
        print()
        print("summary (extra: passes beyond the cache-off plan; replay: tokens computed "
              "from the restore point)")
        rows = []
        for policy, plan in plans.items():
            restore = warm[policy].restore_point if warm[policy] else "-"
            replay = warm[policy].replay_tokens if warm[policy] else "-"
            rows.append([policy, len(plan.passes), len(plan.passes) - len(cache_off.passes),
                         _positions(plan.pass_ends, keep=3, sep=" "),
                         len(plan.snapshot_positions), restore, replay])
        _print_table(["policy", "passes", "extra", "pass ends", "snapshots", "restore",
                      "replay"], rows)
    return 0


def _print_plan(policy: str, plan: PrefillPlan, warm) -> None:
    print(f"{policy}: {_count(len(plan.passes), 'pass', 'passes')}, "
          f"{_count(len(plan.snapshot_positions), 'snapshot', 'snapshots')}")
    rows = [
        [number, p.start, p.end, p.length, _positions(p.captures, keep=2),
         "yes" if p.snapshot_at_end else "-"]
        for number, p in enumerate(plan.passes, start=1)
    ]
    if rows:
        _print_table(["pass", "start", "end", "length", "captures", "snapshot at end"], rows,
                     indent="  ")
    print(f"  snapshots: {_positions(plan.snapshot_positions)}")
    if warm is not None:
        print(f"  warm: restore at {warm.restore_point}, replay {warm.replay_tokens} "
              f"({warm.ssm_replay_tokens} cached tokens recomputed"
              + (f", {warm.grid_replay_tokens} of them for the grid)" if plan.grid > 1 else ")"))


# -- simulate --------------------------------------------------------------------------------

def _run_simulate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    policies = POLICIES if args.policy == "all" else (args.policy,)
    try:
        traces = [trace for trace in default_traces(seed=args.seed, scale=args.scale)
                  if args.trace in ("all", trace.name)]
    except ValueError as error:  # a scale beyond the traces' size limit
        parser.error(f"argument --scale: {error}")
    cost_model = CostModel(per_token_ms=args.per_token_ms, per_pass_ms=args.per_pass_ms)
    config = dict(block_size=args.block_size, budget=args.budget,
                  first_budget=args.first_budget, interval=args.interval,
                  max_snapshots=args.max_snapshots, eviction=args.eviction, grid=args.grid)
    results = []
    with tqdm(total=sum(len(t) for t in traces) * len(policies), unit="request",
              file=sys.stderr, delay=1.0, disable=True if args.no_progress else None) as bar:
        try:  # simulate checks its arguments before its first request
            for trace in traces:
                reports = {
                    policy: simulate(_counted(trace, bar.update), policy=policy,
                                     cost_model=cost_model, **config)
                    for policy in policies
                }
                results.append((trace, reports))
        except (TypeError, ValueError) as error:
            parser.error(_in_flags(str(error), parser))

    if args.json:
        print(json.dumps({
            "config": {**config, "seed": args.seed, "scale": args.scale,
                       "cost_model": asdict(cost_model)},
            "traces": [
                {"name": trace.name, "description": trace.description,
                 "requests": len(trace), "prompt_tokens": trace.prompt_tokens,
                 "policies": {policy: report.to_dict() for policy, report in reports.items()}}
                for trace, reports in results
            ],
        }, indent=2))
        return 0

    first = args.first_budget or args.budget
    cap = "unbounded" if args.max_snapshots is None else f"at most {args.max_snapshots}"
    print(f"block {args.block_size}, budget {args.budget}, first budget {first}, interval "
          f"{args.interval}" + (f", grid {args.grid}" if args.grid > 1 else "")
          + f"; snapshots {cap} ({args.eviction}); cost model "
          f"{cost_model.per_token_ms:.4f} ms/token + {cost_model.per_pass_ms:g} ms/pass")
    print("computed: tokens prefilled; ssm replay: of those, tokens the KV cache held but the "
          "SSM state lacked;\nextra: passes beyond the cache-off plan; stored/evicted: "
          "snapshots; hit rate: requests that restored one")
    for trace, reports in results:
        print()
        print(f"trace {trace.name} ({trace.description}): {len(trace)} requests, "
              f"{trace.prompt_tokens} prompt tokens")
        rows = [
            [policy, t.tokens_computed, t.ssm_replay_tokens, t.passes, t.extra_passes,
             t.snapshots_stored, t.snapshots_evicted, f"{t.hit_rate:.2f}",
             f"{t.modeled_ms / 1000:.1f}"]
            for policy, t in ((policy, report.totals) for policy, report in reports.items())
        ]
        _print_table(["policy", "computed", "ssm replay", "passes", "extra", "stored",
                      "evicted", "hit rate", "modeled s"], rows)
    return 0


def _counted(requests: Iterable, advance: Callable[[int], object]) -> Iterator:
    for request in requests:
        yield request
        advance(1)


# -- formatting and argument types -----------------------------------------------------------

def _print_table(headers: list[str], rows: list[list], indent: str = "") -> None:
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [max(len(text) for text in column) for column in zip(headers, *cells)]
    # Numbers right-aligned, text left-aligned, judged by the first row.
    numeric = [isinstance(cell, (int, float)) or str(cell).replace(".", "").isdigit()
               for cell in (rows[0] if rows else headers)]

    def line(texts: list[str]) -> str:
        padded = [text.rjust(width) if is_number else text.ljust(width)
                  for text, width, is_number in zip(texts, widths, numeric)]
        return (indent + "  ".join(padded)).rstrip()

    print(line(headers))
    for row in cells:
        print(line(row))


def _positions(values: Sequence[int], keep: int = 4, sep: str = ", ") -> str:
    """Positions as text, the middle elided when there are more than ``2 * keep``."""
    if not values:
        return "-"
    if len(values) <= 2 * keep:
        return sep.join(map(str, values))
    head = sep.join(map(str, values[:keep]))
    tail = sep.join(map(str, values[-keep:]))
    return f"{head}{sep}...{sep}{tail} ({len(values)})"


def _count(number: int, one: str, many: str) -> str:
    return f"{number} {one if number == 1 else many}"


def int_argument(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an int in [low, high] (no upper bound when high is None)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}" if high is None
                                             else f"must be from {low} to {high}, got {value}")
        return value

    return parse


def _cost_ms(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value <= MAX_COST_MS:  # also rejects nan
        raise argparse.ArgumentTypeError(f"expected a number from 0 to {MAX_COST_MS:g}, got {text}")
    return value
