"""Where the chunked Mamba-2 output kernel's time goes: python -m bench.ablate [--compile |
--reduced] [--shapes N] [--time-budget S] [--out DIR]

On the H200 (2026-12-04) the output kernel took 0.213 of the pass's 0.315 ms at Mamba-2 2.7B,
8192 tokens: about four times what its bytes take at HBM bandwidth, and more than twice the static
model's figure for it, whose gains for that kernel came out about four times what the GPU gave.
So its parts are timed on the GPU by taking them out: bench.output_variants makes the variants
(the kernel with lines of `_chunk_output_program` replaced, standing in for the real one in stage
5), and "unchanged", a copy that must give the real kernel's bits; two variants build the kernel
another way, at 128 registers (four programs an SM where it fits three: what that is worth is for
the GPU to say, the model's latency term credits no overlap between an SM's programs), and one
adds L2 prefetch hints, which must leave the real kernel's bits too and which the model does not
see at all. The static model times the same variants: `python -m bench.static --workload
ablation` (bench/README.md).

On a GPU (default): at Mamba-2 2.7B (--shapes 3: the three Mamba-2 shapes), 8192 tokens,
bfloat16, batch 1, each kernel's GPU time per variant (bench.sweep.measure_gpu), and the output
kernel's against the unchanged copy's, within --time-budget. --compile (no GPU needed): each
variant's output kernel compiled for sm_90a (registers, spills, shared memory, programs an SM).
--reduced: each variant's pass under the Triton interpreter at a small shape (its y against the
real kernel's, bit for bit, which SAME_BITS must match; no times). Results: ablate.json and ablate.md in --out
(default bench/results/<date>-ablate, -ablate-compile or -ablate-reduced).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from . import use_triton_interpreter

use_triton_interpreter(False if "--compile" in sys.argv[1:] else None)  # before triton is imported

import torch  # noqa: E402

from . import sweep  # noqa: E402
from . import workloads as wl  # noqa: E402
from .common import RESULTS_DIR, Budget, Terminated, bench_device, markdown_table, save_results  # noqa: E402
from .output_variants import KERNEL, SAME_BITS, VARIANTS, ablated  # noqa: E402
from .static_calibration import serial_ms  # noqa: E402

NTOKENS = 8192
# The static model of the same variants (python -m bench.static --workload "mamba2_scan chunked"
# --workload ablation --shape 2.7B --tokens 8192), set beside what the GPU measures.
MODELLED = RESULTS_DIR / "2026-12-05-static-d-fold" / "static.json"


def modelled_ratios(path: Path = MODELLED, serial: bool = False) -> dict[str, float]:
    """Each variant's output kernel time against the real kernel's, modelled at Mamba-2 2.7B and
    NTOKENS tokens (serial: by the serial estimate, bench.static_calibration): {variant: ratio} in
    VARIANTS' order, for those the report models, "unchanged" 1; {} without the report (the
    measurement stands alone)."""
    if not path.exists():
        return {}
    time = (lambda k: serial_ms([k])) if serial else (lambda k: k["model"]["time_ms"])  # noqa: E731
    # each variant's call by its name; the report's plain pass is the real kernel ("unchanged")
    names = {"mamba2_scan chunked": "unchanged", **{f"ablation: {name}": name for name in VARIANTS}}
    times = {names[c["workload"]]: next(time(k) for k in c["kernels"] if k["kernel"] == KERNEL and k["chosen"])
             for c in json.loads(path.read_text())["calls"]
             if c["shape"] == wl.STANDARD_SHAPES[0].name and c["size"] == NTOKENS and c["workload"] in names}
    return {name: times[name] / times["unchanged"] for name in VARIANTS if name in times}


def measure_reduced(rows: list, device: torch.device) -> None:
    """Rows: each variant's y at a small shape against the real kernel's (bit for bit or not)."""
    inp = wl.mamba2_inputs(wl.REDUCED_SHAPES[0], sweep.REDUCED_NTOKENS, device)
    real = sweep._scan(inp, sweep.REDUCED_CAPTURES)
    for name in VARIANTS:
        with ablated(name):
            out = sweep._scan(inp, sweep.REDUCED_CAPTURES)
        rows.append({"shape": wl.REDUCED_SHAPES[0].name, "variant": name,
                     "bitwise": torch.equal(out.y, real.y) and torch.equal(out.final_states, real.final_states)})


def markdown(mode: str, rows: list, env: dict) -> str:
    lines = [f"# Where the chunked Mamba-2 output kernel's time goes ({mode})", "",
             f"{env['device']}, torch {torch.__version__}, commit {env['commit'] or 'unknown'}, {env['date']}.", ""]
    if mode == "compile":
        lines += [f"The output kernel of each variant compiled for sm_90a at {wl.STANDARD_SHAPES[0].name}, {NTOKENS} "
                  "tokens, bfloat16 (no GPU).", "",
                  markdown_table(["variant", "registers", "spilled B", "shared KB", "programs an SM"],
                                 [[r["config"], r["registers"], r["spill_bytes"], r["shared_bytes"] / 1024,
                                   r["programs"]] for r in rows if r["kernel"] == KERNEL])]
    elif mode == "reduced":
        lines += [f"{sweep.REDUCED_NTOKENS} tokens under the interpreter: each variant's y against the real "
                  f"kernel's (only {' and '.join(SAME_BITS)} must match); no times.", "",
                  markdown_table(["variant", "bitwise"], [[r["variant"], "yes" if r["bitwise"] else "no"]
                                                          for r in rows])]
    else:
        lines += [f"GPU time of one pass's output kernel (torch.profiler), {NTOKENS} tokens, bfloat16, batch 1, "
                  "per variant; 'vs unchanged': against the unchanged copy's at the shape; 'modelled': the "
                  f"static model's ratio at {wl.STANDARD_SHAPES[0].name} ({MODELLED.parent.name}), by its time "
                  "and by the serial estimate (bench/static_calibration.py). A variant without a part computes a "
                  f"wrong y: its time only; {' and '.join(SAME_BITS)} must give the real kernel's bits.", "",
                  markdown_table(["shape", "variant", "output kernel ms", "vs unchanged", "vs unchanged, modelled",
                                  "vs unchanged, serial", "pass kernel ms", "the real kernel's bits", "error"],
                                 [[r["shape"], r["config"], r.get("kernels_ms", {}).get(KERNEL),
                                   r.get("output_vs_unchanged"), r.get("modelled_vs_unchanged"),
                                   r.get("serial_vs_unchanged"), r.get("kernel_ms"),
                                   {True: "yes", False: "no"}.get(r.get("copy_bitwise"), "-"), r.get("error", "")]
                                  for r in rows])]
    if env.get("incomplete"):
        lines += ["", f"Incomplete: {env['incomplete']}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = sweep.mode_parser("python -m bench.ablate", __doc__, "variant")
    parser.add_argument("--shapes", type=int, default=1, help="how many of the Mamba-2 shapes (GPU)")
    args = parser.parse_args(argv)
    if args.shapes < 1:
        parser.error(f"--shapes must be >= 1, got {args.shapes}")
    mode, out, env = sweep.mode_setup(parser, args, "ablate")
    rows: list = []
    try:
        if mode == "compile":
            sweep.compiled({name: name for name in VARIANTS}, wl.STANDARD_SHAPES[0], NTOKENS, rows, within=ablated)
        elif mode == "reduced":
            measure_reduced(rows, bench_device())
        else:
            budget = Budget(args.time_budget)
            device = torch.device("cuda")
            real = {shape.name: sweep._scan(wl.mamba2_inputs(shape, NTOKENS, device))
                    for shape in wl.STANDARD_SHAPES[:args.shapes]}
            sweep.measure_gpu({name: name for name in VARIANTS}, wl.STANDARD_SHAPES[:args.shapes], NTOKENS, budget,
                              rows, within=ablated, outputs=lambda shape, name, got: {
                                  "copy_bitwise": torch.equal(got.y, real[shape].y)} if name in SAME_BITS else {})
            unchanged = {r["shape"]: r["kernels_ms"][KERNEL] for r in rows if r["config"] == "unchanged"
                         and "kernels_ms" in r}
            modelled, serial = modelled_ratios(), modelled_ratios(serial=True)
            for r in rows:
                if r["shape"] in unchanged and "kernels_ms" in r:
                    r["output_vs_unchanged"] = r["kernels_ms"][KERNEL] / unchanged[r["shape"]]
                if r["shape"] == wl.STANDARD_SHAPES[0].name:
                    r["modelled_vs_unchanged"] = modelled.get(r["config"])
                    r["serial_vs_unchanged"] = serial.get(r["config"])
            if budget.expired():
                env["incomplete"] = "the time budget ran out"
    except Terminated as stop:
        env["incomplete"] = str(stop)
    save_results(out, "ablate", {"mode": mode, "env": env, "variants": VARIANTS, "rows": rows},
                 markdown(mode, rows, env))
    copy_ok = all(r.get("bitwise", True) for r in rows if r.get("variant") in SAME_BITS) and all(
        r.get("copy_bitwise", True) for r in rows)
    return 0 if copy_ok and ("incomplete" not in env or mode == "gpu") else 1


if __name__ == "__main__":
    raise SystemExit(main())
