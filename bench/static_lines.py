"""Where one kernel's modelled latency goes, source line by source line (static model, not measured):
python -m bench.static_lines WORKLOAD --kernel NAME [--shape NAME | --layer SPEC] [--size N] [--top K]

The workload's launches are recorded and the kernel's first launch compiled for sm_90a as
bench.static does; its SASS is then replayed for one warp by the model's latency rule
(triton_static.model.replay_steps, a global load at the HBM miss's latency): the straight-line
code once, each loop's body twice, of which the second pass is kept (a loop's steady state, whose
sum is the loop's cycles per iteration in the report). Each source line (the innermost of an
inlined chain) gets the cycles its instructions add, its instructions and its MUFU ones; most
cycles first. A line's cycles are mostly its first instruction's wait on a load issued earlier:
where to look when bench.static calls a kernel latency-bound.
"""
from __future__ import annotations

from . import use_triton_interpreter

use_triton_interpreter(False)  # the kernels are compiled (never launched); before they are imported

import argparse  # noqa: E402
import linecache  # noqa: E402
import sys  # noqa: E402
from collections import defaultdict  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from triton_static import model, sass  # noqa: E402
from triton_static.launches import compile_launch, recording  # noqa: E402

from .static_workloads import SHAPES, WORKLOADS, parse_layer, run_call, triton_path_on_cpu  # noqa: E402


@dataclass
class Line:
    """What one source line adds to a replay."""

    where: str  # file.py:line
    text: str  # the line's source, stripped
    cycles: float
    instructions: int
    mufu: int


def line_costs(instrs: list[sass.Instr], steps: list[float]) -> list[Line]:
    """The replay's steps (one per instruction) summed per source line, most cycles first."""
    by: dict[tuple[str, int], list] = defaultdict(lambda: [0.0, 0, 0])
    for instr, step in zip(instrs, steps):
        path, line = instr.source or ("?", 0)
        cost = by[(path, line)]
        cost[0] += step
        cost[1] += 1
        cost[2] += instr.base == "MUFU"
    rows = [Line(f"{path.rsplit('/', 1)[-1]}:{line}", linecache.getline(path, line).strip(), *cost)
            for (path, line), cost in by.items()]
    return sorted(rows, key=lambda r: -r.cycles)


def loop_steps(body: list[sass.Instr]) -> list[float]:
    """Each instruction's step in the second of two passes of a loop body (its steady state)."""
    return model.replay_steps(body + body)[len(body):]


def kernel_lines(workload: str, shape, size: int, kernel: str) -> dict:
    """The kernel's straight-line code and loops, each as line_costs, with its registers and spills."""
    launches = []
    with triton_path_on_cpu(), recording(launches):
        run_call(workload, shape, size)
    chosen = [launch for launch in launches if launch.kernel == kernel]
    if not chosen:
        raise SystemExit(f"{workload} launches no {kernel}; it launches: "
                         f"{', '.join(dict.fromkeys(launch.kernel for launch in launches))}")
    code = sass.read(compile_launch(chosen[0]))
    straight = code.straight
    return dict(kernel=chosen[0].label(), registers=code.registers, spill_bytes=code.spill_stores,
                straight=line_costs(straight, model.replay_steps(straight)),
                loops=[dict(start=loop.start, instructions=len(loop.instrs),
                            lines=line_costs(loop.instrs, loop_steps(loop.instrs))) for loop in code.loops])


def table(lines: list[Line], top: int) -> list[str]:
    out = [f"  {'cycles':>8} {'instr':>6} {'MUFU':>5}  line"]
    out += [f"  {r.cycles:8.0f} {r.instructions:6d} {r.mufu:5d}  {r.where}  {r.text[:90]}" for r in lines[:top]]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=list(WORKLOADS), metavar="WORKLOAD", help="; ".join(WORKLOADS))
    parser.add_argument("--kernel", required=True, help="the kernel's function name, e.g. _chunk_output_kernel")
    place = parser.add_mutually_exclusive_group()
    place.add_argument("--shape", choices=list(SHAPES), default="Mamba-2 2.7B", help="; ".join(SHAPES))
    place.add_argument("--layer", help="a custom layer: mamba2:nheads=H,headdim=P,dstate=N,ngroups=G or "
                       "mamba1:dim=D,dstate=N")
    parser.add_argument("--size", type=int, default=8192, help="prefill tokens, or the decode batch")
    parser.add_argument("--top", type=int, default=15, help="lines shown per part (default 15)")
    args = parser.parse_args(argv)
    shape = parse_layer(args.layer) if args.layer else SHAPES[args.shape]
    found = kernel_lines(args.workload, shape, args.size, args.kernel)
    print(f"== {found['kernel']}: {args.workload} at {shape.name}, {args.size} "
          f"(static model, not measured): {found['registers']} registers, {found['spill_bytes']} B spilled")
    parts = [("straight-line code, once", found["straight"])]
    parts += [(f"loop at {loop['start']:#x} ({loop['instructions']} instructions), an iteration", loop["lines"])
              for loop in found["loops"]]
    for title, lines in parts:
        print(f"{title}: {sum(r.cycles for r in lines):.0f} cycles")
        print("\n".join(table(lines, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
