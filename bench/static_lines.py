"""Where one kernel's modelled latency goes, source line by source line (static model, not measured):
python -m bench.static_lines WORKLOAD --kernel NAME [--shape NAME | --layer SPEC] [--size N] [--top K] [--per-program]

The workload's launches are recorded and the kernel's first launch compiled for sm_90a as
bench.static does; its SASS is then replayed for one warp by the model's latency rule
(triton_static.model.replay_steps, a global load at the HBM miss's latency): the straight-line
code once, each loop's body three times, of which the third pass is kept (a loop's steady state,
whose sum is the loop's cycles per iteration in the report). Each source line (the innermost of an
inlined chain) gets the cycles its instructions add, its instructions and its MUFU ones; most
cycles first. A line's cycles are mostly its first instruction's wait on a load issued earlier:
where to look when bench.static calls a kernel latency-bound.

With --per-program the parts are what the report's latency term counts for one program: the
call is counted by the interpreter first (as bench.static counts it: minutes for the fused pass),
the straight-line code is the path most programs take (a mixed kernel's: every instruction's step
weighed by the share of programs that ran its line) and each loop's steady-state iteration (the
instructions that run in at least half its iterations) is weighed by its iterations a program,
with the global load's latency at the kernel's modelled HBM miss rate; the parts then add up to
the report's latency a program, printed beside them.
"""
from __future__ import annotations

from . import use_triton_interpreter

use_triton_interpreter(False)  # the kernels are compiled (never launched); before they are imported

import argparse  # noqa: E402
import linecache  # noqa: E402
import sys  # noqa: E402
from collections import defaultdict  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from triton_static import counts as counting  # noqa: E402
from triton_static import model, sass  # noqa: E402
from triton_static.launches import compile_launch, recording  # noqa: E402

from .common import REPO_ROOT  # noqa: E402
from .static_workloads import (LAYER_FORMS, MIXED_KERNELS, SHAPES, UNALIKE_AXES, WORKLOADS, count_sizes,  # noqa: E402
                               layer_arg, parse_layer, run_call, shape_record, triton_path_on_cpu)


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
    # the text from this checkout's copy: a cubin from Triton's cache names the checkout that compiled it
    rows = [Line(f"{path.rsplit('/', 1)[-1]}:{line}",
                 linecache.getline(*sass.local_source(sass.source_key(path, line))).strip(), *cost)
            for (path, line), cost in by.items()]
    return sorted(rows, key=lambda r: -r.cycles)


def loop_steps(body: list[sass.Instr], global_load: float = model.LATENCY["HBM"]) -> list[float]:
    """Each instruction's step in the third of three passes of a loop body: its steady state, the
    iteration model.replay_cycles times (their sum is the report's cycles per iteration)."""
    return model.replay_steps(body * 3, global_load)[2 * len(body):]


def kernel_lines(workload: str, shape, size: int, kernel: str, per_program: bool = False) -> dict:
    """The kernel's straight-line code and loops as parts, each (title, line_costs), with its
    registers and spills; per_program: as the report's latency term counts one program (module
    doc), with that latency ("latency")."""
    launches = []
    with triton_path_on_cpu(), recording(launches):
        run_call(workload, shape, size)
    index = next((k for k, launch in enumerate(launches) if launch.kernel == kernel), None)
    if index is None:
        raise SystemExit(f"{workload} launches no {kernel}; it launches: "
                         f"{', '.join(dict.fromkeys(launch.kernel for launch in launches))}")
    launch = launches[index]
    code = sass.read(compile_launch(launch))
    found = dict(kernel=launch.label(), registers=code.registers, spill_bytes=code.spill_stores)
    if not per_program:
        straight = code.straight
        parts = [("straight-line code, once", line_costs(straight, model.replay_steps(straight)))]
        parts += [(f"loop at {loop.start:#x} ({len(loop.instrs)} instructions), an iteration",
                   line_costs(loop.instrs, loop_steps(loop.instrs))) for loop in code.loops]
        return {**found, "parts": parts}
    request = {"workload": workload, "shape": shape_record(shape), "sizes": count_sizes(WORKLOADS[workload]),
               "peer": False}
    counts = counting.extrapolate(counting.count([request], "bench.static_workloads:count_call", UNALIKE_AXES,
                                                 cwd=REPO_ROOT)[0], size)[index]
    return {**found, **program_parts(code, launch, counts, launch.kernel in MIXED_KERNELS)}


def program_parts(code: sass.Code, launch, counts: dict, mixed: bool) -> dict:
    """One program's modelled latency as the model counts it (triton_static.model.model_kernel),
    per source line: {"parts": [(title, line_costs)], "latency": the model's cycles a program}."""
    programs = launch.grid[0] * launch.grid[1] * launch.grid[2]
    km = model.model_kernel(code, launch.grid, launch.num_warps, code.mma_form, counts, mixed=mixed)
    load = km.global_load_cycles
    reached, lines = counts.get("reached", {}), counts.get("lines", {})
    straight = code.straight
    shares = model.straight_shares(code, reached, programs)
    if mixed:  # the average program: every step weighed by its share
        steps = [share * step for share, step in zip(shares, model.replay_steps(straight, load))]
    else:  # the path most programs take
        straight = [i for i, share in zip(straight, shares) if share >= 0.5]
        steps = model.replay_steps(straight, load)
    parts = [("straight-line code, a program", line_costs(straight, steps))]
    for loop in [lp for lp in code.loops if lp.instrs and lp.end > lp.start]:
        executions, _ = model._executions(loop, lines)
        runs = (programs if executions is None else executions) / max(programs, 1)
        # the path most iterations take, as the model replays it
        body = [i for i, share in zip(loop.instrs, model._loop_shares(loop, lines, executions)) if share >= 0.5]
        parts.append((f"loop at {loop.start:#x} ({len(loop.instrs)} instructions), {runs:.4g} iterations a program",
                      line_costs(body, [runs * step for step in loop_steps(body, load)])))
    return {"parts": parts, "latency": km.latency_cycles_per_program}


def table(lines: list[Line], top: int) -> list[str]:
    out = [f"  {'cycles':>8} {'instr':>6} {'MUFU':>5}  line"]
    out += [f"  {r.cycles:8.0f} {r.instructions:6d} {r.mufu:5d}  {r.where}  {r.text[:90]}" for r in lines[:top]]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.static_lines", description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=list(WORKLOADS), metavar="WORKLOAD", help="; ".join(WORKLOADS))
    parser.add_argument("--kernel", required=True, help="the kernel's function name, e.g. _chunk_output_kernel")
    place = parser.add_mutually_exclusive_group()
    place.add_argument("--shape", choices=list(SHAPES), default="Mamba-2 2.7B", help="; ".join(SHAPES))
    place.add_argument("--layer", type=layer_arg, help=f"a custom layer: {LAYER_FORMS}")
    parser.add_argument("--size", type=int, default=8192, help="prefill tokens, or the decode batch")
    parser.add_argument("--top", type=int, default=15, help="lines shown per part (default 15)")
    parser.add_argument("--per-program", action="store_true",
                        help="as the report's latency term counts one program (counts the call first; module doc)")
    args = parser.parse_args(argv)
    shape = parse_layer(args.layer) if args.layer else SHAPES[args.shape]
    found = kernel_lines(args.workload, shape, args.size, args.kernel, args.per_program)
    print(f"== {found['kernel']}: {args.workload} at {shape.name}, {args.size} "
          f"(static model, not measured): {found['registers']} registers, {found['spill_bytes']} B spilled")
    if args.per_program:
        print(f"the report's latency a program: {found['latency']:.0f} cycles, the sum of these parts")
    for title, lines in found["parts"]:
        print(f"{title}: {sum(r.cycles for r in lines):.0f} cycles")
        print("\n".join(table(lines, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
