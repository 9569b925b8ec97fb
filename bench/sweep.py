"""The chunked Mamba-2 pass under other launch configurations: python -m bench.sweep [--compile |
--reduced] [--time-budget S] [--out DIR]

launch_config (ssm_kernels/scan/mamba2_chunked/triton_kernel.py) sets each stage's tiles, warps,
pipeline stages and register cap from the layer's dimensions alone; the static model chose them.
On the H200 the model's ratios to the peer ran 24-26% low (2026-12-04), and its gains for the
output kernel, two thirds of the pass there, came out about four times what the GPU gave; so here
the alternatives are measured. Each entry of CONFIGS changes a few of launch_config's values (a
stage's own options, such as output's num_stages, merge into its dict; None removes one).

On a GPU (default): at the three Mamba-2 shapes, 8192 tokens, bfloat16, batch 1, per configuration:
each kernel's GPU time in a pass (torch.profiler, common.kernel_times), their sum against the default
configuration's, and whether y and the final states equal the default's bit for bit (tile sizes
change the order of sums; warps, stages and register caps should not). All configurations at one
shape, in CONFIGS' order, before the next shape, within --time-budget; SIGTERM writes what was
measured. --compile (any machine, no GPU needed): each configuration's kernels compiled for sm_90a
as a launch at the first shape binds them (triton_static): registers, spills, shared memory and the
programs an SM holds. --reduced: each configuration's pass at a small shape with two captures (under
the Triton interpreter without a GPU), against the float64 reference.

Triton runs compiled with --compile or on a GPU, else through its interpreter (chosen on import, as
triton.jit reads it when Triton's own functions are decorated). Results:
sweep.json and sweep.md in --out (default bench/results/<date>-sweep, -sweep-compile, -sweep-reduced).
"""
from __future__ import annotations

import sys

from . import use_triton_interpreter

use_triton_interpreter(False if "--compile" in sys.argv[1:] else None)  # before triton is imported

import argparse  # noqa: E402
import datetime  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from . import workloads as wl  # noqa: E402
from .common import (RESULTS_DIR, Budget, Terminated, bench_device, configured, git_commit,  # noqa: E402
                     install_sigterm_handler, kernel_times, markdown_table, save_results,
                     time_budget)
from ssm_kernels.scan.reference import rel_error  # noqa: E402

CONFIGS: dict[str, dict] = {
    "default": {},
    "output: 3 stages": {"output": {"num_stages": 3}},
    "output: 1 stage": {"output": {"num_stages": 1}},
    "output: 8 warps": {"output": {"num_warps": 8, "maxnreg": None}},
    "output and C B^T: 128-row tiles, 8 warps": {"BLOCK_M": 128, "output": {"num_warps": 8, "maxnreg": None},
                                                 "cb": {"num_warps": 8}},
    "output: dstate in blocks of 64": {"BLOCK_D": 64},
    "output: dstate in blocks of 64, 3 stages": {"BLOCK_D": 64, "output": {"num_stages": 3}},
    "C B^T: dstate in one block (128)": {"CB_BLOCK_D": 128},
    "chunk state: 2 stages": {"num_stages": 2},
    "chunk state: 8 warps": {"num_warps": 8},
    "walk: no register cap": {"walk": {"maxnreg": None}},
    "chunk state: 128 source tokens a step": {"BLOCK_K": 128},
    "walk: 1024 state elements a program": {"PASS_BLOCK": 1024},
    "walk: 4096 state elements a program": {"PASS_BLOCK": 4096},
    "walk: 2 steps in flight": {"WALK_STAGES": 2},
    "walk: 4 steps in flight": {"WALK_STAGES": 4},
    "C B^T: 3 stages": {"cb": {"num_stages": 3}},
}
NTOKENS = 8192
REDUCED_NTOKENS, REDUCED_CAPTURES = 300, [(0, 100), (0, 300)]  # two chunks of 256, a capture in each
BOUND = {torch.bfloat16: 1e-2, torch.float32: 1e-5}  # RMS-relative error against float64 (README)


def _scan(inp: dict, capture=None):
    from ssm_kernels import mamba2_scan
    return mamba2_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], D=inp["D"], dt_bias=inp["dt_bias"],
                       dt_softplus=True, capture=capture, backend="triton", algorithm="chunked")


def measure_gpu(configs: dict, shapes, ntokens: int, budget: Budget, rows: list, device=torch.device("cuda"),
                times=kernel_times, within=configured, outputs=None) -> None:
    """Rows (appended as measured): per shape and configuration, the kernels' GPU times (`times`)
    and whether the outputs equal the default configuration's bit for bit (where configs has it,
    first). within(changes): the context a configuration runs in; outputs(shape name, config name,
    its ScanResult): more of the row's fields (bench.ablate's)."""
    for shape in shapes:
        inp = wl.mamba2_inputs(shape, ntokens, device)
        default = None
        for name, changes in configs.items():
            if budget.expired():
                return
            row = {"shape": shape.name, "config": name, "changes": changes}
            try:
                with within(changes):
                    out = _scan(inp)
                    row["kernels_ms"] = times(lambda: _scan(inp))
                    row.update(outputs(shape.name, name, out) if outputs else {})
            except Exception as error:  # a configuration the GPU refuses (shared memory, registers)
                rows.append({**row, "error": f"{type(error).__name__}: {error}"[:300]})
                continue
            row["kernel_ms"] = sum(row["kernels_ms"].values())
            if name == "default":
                default = (out, row["kernel_ms"])
            if default is not None:
                row["vs_default"] = row["kernel_ms"] / default[1]
                row["bitwise"] = torch.equal(out.y, default[0].y) and torch.equal(out.final_states,
                                                                                  default[0].final_states)
                row["rel_err_y"] = rel_error(out.y, default[0].y)
            rows.append(row)


def measure_reduced(configs: dict, rows: list, device: torch.device) -> None:
    """Rows: per configuration, its pass at a small shape against the float64 reference."""
    from ssm_kernels.scan.reference import mamba2_scan_ref
    shape = wl.REDUCED_SHAPES[0]
    inp = wl.mamba2_inputs(shape, REDUCED_NTOKENS, device)
    ref = mamba2_scan_ref(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], D=inp["D"], dt_bias=inp["dt_bias"],
                          dt_softplus=True, capture=REDUCED_CAPTURES)
    for name, changes in configs.items():
        with configured(changes):
            out = _scan(inp, REDUCED_CAPTURES)
        errors = {"rel_err_y": rel_error(out.y, ref.y), "rel_err_final": rel_error(out.final_states, ref.final_states),
                  "rel_err_captured": rel_error(out.captured_states, ref.captured_states)}
        rows.append({"shape": shape.name, "config": name, "changes": changes, **errors,
                     "within_bound": max(errors.values()) <= BOUND[inp["x"].dtype]})


def compiled(configs: dict, shape, ntokens: int, rows: list, within=configured) -> None:
    """Rows: per configuration (run within(changes)), each kernel it launches differently from the
    first's (all five for the first) compiled for sm_90a: registers, spills, shared memory,
    programs an SM."""
    from triton_static import sass
    from triton_static.launches import compile_launch, recording
    from triton_static.model import resident_programs

    from .static_workloads import triton_path_on_cpu

    inp = wl.mamba2_inputs(shape, ntokens, torch.device("cpu"))
    default = None
    for name, changes in configs.items():
        launches = []
        with triton_path_on_cpu(), recording(launches), within(changes):
            _scan(inp)
        keys = {launch.kernel: (launch.options, launch.constexprs, id(launch.fn)) for launch in launches}
        for launch in launches:
            if default is not None and default[launch.kernel] == keys[launch.kernel]:
                continue
            code = sass.read(compile_launch(launch))
            rows.append({"config": name, "kernel": launch.kernel, "num_warps": launch.num_warps,
                         "num_stages": launch.num_stages, "registers": code.registers,
                         "spill_bytes": max(code.spill_stores, code.spill_loads), "shared_bytes": code.shared,
                         **resident_programs(code.registers, code.shared, launch.num_warps)})
        default = default or keys


def markdown(mode: str, rows: list, env: dict) -> str:
    lines = [f"# The chunked Mamba-2 pass under other launch configurations ({mode})", "",
             f"{env['device']}, torch {torch.__version__}, commit {env['commit'] or 'unknown'}, {env['date']}.", ""]
    if mode == "compile":
        lines.append(f"Compiled for sm_90a at {wl.STANDARD_SHAPES[0].name}, {NTOKENS} tokens, bfloat16 (no GPU): "
                     "each configuration's kernels that launch differently from the default's.")
        lines.append("")
        lines.append(markdown_table(["config", "kernel", "warps", "stages", "registers", "spilled B", "shared KB",
                                     "programs an SM", "limited by"],
                                    [[r["config"], r["kernel"], r["num_warps"], r["num_stages"], r["registers"],
                                      r["spill_bytes"], r["shared_bytes"] / 1024, r["programs"], r["limited_by"]]
                                     for r in rows]))
    elif mode == "reduced":
        lines.append(f"{REDUCED_NTOKENS} tokens, captures {REDUCED_CAPTURES}, "
                     "against the float64 reference (RMS-relative); no times.")
        lines.append("")
        lines.append(markdown_table(["config", "y", "final states", "captures", "within bound"],
                                    [[r["config"], r["rel_err_y"], r["rel_err_final"], r["rel_err_captured"],
                                      "yes" if r["within_bound"] else "NO"] for r in rows]))
    else:
        kernels = sorted({k for r in rows for k in r.get("kernels_ms", {})})
        lines.append(f"GPU time per kernel of one pass (torch.profiler), {NTOKENS} tokens, bfloat16, batch 1; "
                     "'vs default' is the pass's kernel time against the default configuration's at the shape; "
                     "'bitwise': y and the final states equal the default's.")
        lines.append("")
        lines.append(markdown_table(
            ["shape", "config", "kernel ms", "vs default", "bitwise", "y against default's"] + kernels + ["error"],
            [[r["shape"], r["config"], r.get("kernel_ms"), r.get("vs_default"),
              {True: "yes", False: "no"}.get(r.get("bitwise"), "-"), r.get("rel_err_y")]
             + [r.get("kernels_ms", {}).get(k) for k in kernels] + [r.get("error", "")] for r in rows]))
    if env.get("incomplete"):
        lines += ["", f"Incomplete: {env['incomplete']}."]
    return "\n".join(lines) + "\n"


def mode_parser(prog: str, doc: str, what: str) -> argparse.ArgumentParser:
    """The command line bench.sweep and bench.ablate share: a GPU run, --compile or --reduced;
    --time-budget, --out."""
    # No abbreviations: the Triton mode is chosen on import from the exact flag "--compile".
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0], allow_abbrev=False)
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--compile", action="store_true", help=f"compile each {what} for sm_90a (no GPU needed)")
    how.add_argument("--reduced", action="store_true", help=f"run each {what} under the interpreter, small")
    parser.add_argument("--time-budget", type=time_budget, default=None, help="seconds for the GPU measurements")
    parser.add_argument("--out", type=Path, default=None)
    return parser


def mode_setup(parser: argparse.ArgumentParser, args, name: str) -> tuple[str, Path, dict]:
    """(mode, results folder, environment) of a mode_parser command line; SIGTERM handled."""
    mode = "compile" if args.compile else "reduced" if args.reduced else "gpu"
    if mode == "gpu" and not torch.cuda.is_available():
        parser.error("no CUDA device: pass --compile or --reduced")
    if mode == "compile" and os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("--compile is read when the module is imported: run it as "
                     f"`{parser.prog} --compile`, not through main() in a process that chose the interpreter")
    install_sigterm_handler()
    date = datetime.date.today().isoformat()
    out = args.out or RESULTS_DIR / (f"{date}-{name}" + ("" if mode == "gpu" else f"-{mode}"))
    env = {"device": torch.cuda.get_device_name() if mode != "compile" and torch.cuda.is_available() else "CPU",
           "date": date, **git_commit()}
    return mode, out, env


def main(argv=None) -> int:
    parser = mode_parser("python -m bench.sweep", __doc__, "configuration")
    parser.add_argument("--only", default="", help="the configurations whose names contain this (and the default)")
    args = parser.parse_args(argv)
    mode, out, env = mode_setup(parser, args, "sweep")
    configs = {name: changes for name, changes in CONFIGS.items() if name == "default" or args.only in name}
    rows: list = []
    try:
        if mode == "compile":
            compiled(configs, wl.STANDARD_SHAPES[0], NTOKENS, rows)
        elif mode == "reduced":
            measure_reduced(configs, rows, bench_device())
        else:
            budget = Budget(args.time_budget)
            measure_gpu(configs, wl.STANDARD_SHAPES[:3], NTOKENS, budget, rows)
            if budget.expired():
                env["incomplete"] = "the time budget ran out"
    except Terminated as stop:
        env["incomplete"] = str(stop)
    save_results(out, "sweep", {"mode": mode, "env": env, "configs": configs, "rows": rows}, markdown(mode, rows, env))
    return 1 if any(r.get("within_bound") is False for r in rows) or "incomplete" in env and mode != "gpu" else 0


if __name__ == "__main__":
    raise SystemExit(main())
