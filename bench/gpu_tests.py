"""The GPU suite's tests: every test file under tests/ that runs a kernel, which is all of them but
PURE_PYTHON (files that import no kernel, layer or model: the planner's and the layout's), so a
new or renamed test file is selected unless it is listed here; the gpu-marked tests (the model
sizes) are in the selected files and run only on a GPU.

    python -m bench.gpu_tests                # the selected files, one a line
    python -m bench.gpu_tests --shards N     # the files in N groups (one a line) of about equal weight

Shards run as parallel pytest processes on the GPU machine: what takes the time there is Triton
compiling each file's kernel specialisations, on one CPU core per process. A file's weight is its
compile seconds when a compile record is given (--weights: the JSON of python -m
triton_static.specs compile), else its size.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
PURE_PYTHON = ("test_layout.py", "test_planner_cache.py", "test_planner_cli.py", "test_planner_grid.py",
               "test_planner_plan.py", "test_planner_rules.py", "test_planner_simulate.py")


def selected() -> list[str]:
    """The selected test files, relative to the repository root."""
    return [f"tests/{p.name}" for p in sorted(TESTS.glob("test_*.py")) if p.name not in PURE_PYTHON]


def shards(files: list[str], n: int, weights: dict[str, float] | None = None) -> list[list[str]]:
    """`files` in at most n groups, the heaviest first into the lightest group (greedy). A file the
    weights do not know (one that launched no kernel where they were measured: on CPU, the files
    whose calls take the PyTorch path) weighs their mean."""
    if weights is None:
        weight = {f: (TESTS.parent / f).stat().st_size for f in files}
    else:
        mean = sum(weights.values()) / max(len(weights), 1)
        weight = {f: weights.get(f, mean) for f in files}
    groups: list[tuple[float, list[str]]] = [(0.0, []) for _ in range(max(1, min(n, len(files))))]
    for f in sorted(files, key=lambda f: -weight[f]):
        total, group = min(groups, key=lambda g: g[0])
        groups.remove((total, group))
        groups.append((total + weight[f], group + [f]))
    return [sorted(g) for _, g in groups if g]


def shard_compile_seconds(groups: list[list[str]], record: dict) -> list[float]:
    """Per shard, the compile seconds of the specialisations its files launch (a compile record's
    "specs"): what the shard compiles if no other shard has compiled them first."""
    return [sum(s["compile_s"] for s in record["specs"] if set(s["files"]) & set(g)) for g in groups]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_tests", description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, help="print the files in this many groups, one a line")
    parser.add_argument("--weights", type=Path, help="a compile record (JSON with per_file compile seconds)")
    parser.add_argument("--estimate", action="store_true",
                        help="with --shards and --weights: print each shard's compile seconds instead")
    args = parser.parse_args(argv)
    files = selected()
    if args.shards is None:
        print("\n".join(files))
        return 0
    if args.shards < 1:
        parser.error(f"--shards must be >= 1, got {args.shards}")
    if args.weights and not args.weights.is_file():
        parser.error(f"--weights: no such file: {args.weights}")
    record = json.loads(args.weights.read_text()) if args.weights else None
    weights = {f: v["compile_s"] for f, v in record["per_file"].items()} if record else None
    groups = shards(files, args.shards, weights)
    if args.estimate:
        if record is None:
            parser.error("--estimate needs --weights")
        for g, seconds in zip(groups, shard_compile_seconds(groups, record)):
            print(f"{seconds:7.1f} s  {' '.join(g)}")
        return 0
    print("\n".join(" ".join(g) for g in groups))
    return 0


if __name__ == "__main__":
    sys.exit(main())
