"""Where the chunked Mamba-2 output kernel's time goes: python -m bench.ablate [--compile |
--reduced] [--shapes N] [--time-budget S] [--out DIR]

On the H200 (2026-12-04) the output kernel took 0.213 of the pass's 0.315 ms at Mamba-2 2.7B,
8192 tokens: about four times what its bytes take at HBM bandwidth, and more than twice the static
model's figure for it, whose gains for that kernel came out about four times what the GPU gave.
So its parts are timed on the GPU by taking them out. Each VARIANTS entry is the kernel module's
source with lines of `_chunk_output_program` replaced (each edit must match there once), loaded as
a module of its own, whose output kernel stands in for the real one (stage 5 launches it; the
other four stages are unchanged). A variant without a part computes a wrong y: only its time
counts. "unchanged" has no edit: a copy of the kernel that must give the real one's bits.

On a GPU (default): at Mamba-2 2.7B (--shapes 3: the three Mamba-2 shapes), 8192 tokens,
bfloat16, batch 1, each kernel's GPU time per variant (bench.sweep.measure_gpu), and the output
kernel's against the unchanged copy's, within --time-budget. --compile (no GPU needed): each
variant's output kernel compiled for sm_90a (registers, spills, shared memory, programs an SM).
--reduced: each variant's pass under the Triton interpreter at a small shape (the unchanged copy's
y against the real kernel's, bit for bit; no times). Results: ablate.json and ablate.md in --out
(default bench/results/<date>-ablate, -ablate-compile or -ablate-reduced).
"""
from __future__ import annotations

import sys

from . import use_triton_interpreter

use_triton_interpreter(False if "--compile" in sys.argv[1:] else None)  # before triton is imported

import atexit  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import importlib.util  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest import mock  # noqa: E402

import torch  # noqa: E402

from . import sweep  # noqa: E402
from . import workloads as wl  # noqa: E402
from .common import Budget, Terminated, bench_device, markdown_table, save_results  # noqa: E402

KERNEL = "_chunk_output_kernel"
PROGRAM = "_chunk_output_program"
NONFINITE = ('''        bad = ~(tl.abs(b_x.to(tl.float32)) < float("inf"))
        acc += _dot(b_w, tl.where(bad, 0.0, b_x), DOT_DTYPE)
        first_bad = tl.min(tl.where(bad, o_m[:, None], CHUNK), axis=0)  # [BP]
        acc = tl.where(o_m[:, None] >= first_bad[None, :], float("nan"), acc)''',
             "        acc += _dot(b_w, b_x, DOT_DTYPE)")
INTER = ("for d0 in range(0, dstate, BLOCK_D):", "for d0 in range(0, 0, BLOCK_D):")
BELOW = ("for k0 in range(0, m0, BLOCK_M):", "for k0 in range(0, 0, BLOCK_M):")
DIAGONAL_EXP = ('exp2_flush(tl.where(causal, b_cs_m[:, None] - b_cs_m[None, :], -float("inf")))',
                "tl.where(causal, 1.0, 0.0)")
# name: (old, new) edits of _chunk_output_program's source
VARIANTS: dict[str, list[tuple[str, str]]] = {
    "unchanged": [],
    "no non-finite marking (the diagonal block's x straight into its matmul)": [NONFINITE],
    "no inter-chunk term (C S0^T: its loads and matmul)": [INTER],
    "no blocks below the diagonal (their loads, weights and matmuls)": [BELOW],
    "no exp in the diagonal block's weights": [DIAGONAL_EXP],
    "only the diagonal block (all four out)": [NONFINITE, INTER, BELOW, DIAGONAL_EXP],
}
NTOKENS = 8192


def variant_source(edits: list[tuple[str, str]]) -> str:
    """The kernel module's source with `edits` applied inside _chunk_output_program, its relative
    imports made absolute (the copy is loaded from elsewhere)."""
    from ssm_kernels.scan.mamba2_chunked import triton_kernel
    source = Path(triton_kernel.__file__).read_text()
    start = source.index(f"def {PROGRAM}(")
    end = source.index("\n@triton.jit", start)
    program = source[start:end]
    for old, new in edits:
        if program.count(old) != 1:
            raise ValueError(f"{PROGRAM} holds {program.count(old)} copies of {old!r}, not one")
        program = program.replace(old, new)
    source = source[:start] + program + source[end:]
    package = triton_kernel.__package__
    return re.sub(r"^from (\.+\w*(?:\.\w+)*) import", lambda m: f"from {importlib.util.resolve_name(m[1], package)} "
                  "import", source, flags=re.M)


@functools.cache
def _variants_dir() -> Path:
    """Where the variant modules are written, removed at exit."""
    path = Path(tempfile.mkdtemp(prefix="ablate-"))
    atexit.register(shutil.rmtree, path, True)
    return path


@functools.cache
def variant(name: str):
    """VARIANTS[name] as a module of its own (a file, as Triton reads a kernel's source)."""
    slug = re.sub(r"\W+", "_", name).strip("_")
    path = _variants_dir() / f"ablated_{slug}.py"
    path.write_text(variant_source(VARIANTS[name]))
    spec = importlib.util.spec_from_file_location(f"ablated_{slug}", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def ablated(name: str):
    """Within, stage 5 of every chunked Mamba-2 pass launches VARIANTS[name]'s output kernel. The
    recent passes' recorded launches are dropped on the way in and out, as bench.sweep's are."""
    from ssm_kernels.scan.mamba2_chunked import tables, triton_kernel
    kernel = getattr(variant(name), KERNEL)
    tables._recent_tables.cache_clear()
    try:
        with mock.patch.object(triton_kernel, KERNEL, kernel):
            yield
    finally:
        tables._recent_tables.cache_clear()


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
                  "kernel's (only the unchanged copy must match); no times.", "",
                  markdown_table(["variant", "bitwise"], [[r["variant"], "yes" if r["bitwise"] else "no"]
                                                          for r in rows])]
    else:
        lines += [f"GPU time of one pass's output kernel (torch.profiler), {NTOKENS} tokens, bfloat16, batch 1, "
                  "per variant; 'vs unchanged': against the unchanged copy's at the shape. A variant "
                  "without a part computes a wrong y: its time only.", "",
                  markdown_table(["shape", "variant", "output kernel ms", "vs unchanged", "pass kernel ms",
                                  "unchanged copy bitwise", "error"],
                                 [[r["shape"], r["config"], r.get("kernels_ms", {}).get(KERNEL),
                                   r.get("output_vs_unchanged"), r.get("kernel_ms"),
                                   {True: "yes", False: "no"}.get(r.get("copy_bitwise"), "-"), r.get("error", "")]
                                  for r in rows])]
    if env.get("incomplete"):
        lines += ["", f"Incomplete: {env['incomplete']}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = sweep.mode_parser("python -m bench.ablate", __doc__, "variant")
    parser.add_argument("--shapes", type=int, default=1, help="how many of the Mamba-2 shapes (GPU)")
    args = parser.parse_args(argv)
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
                                  "copy_bitwise": torch.equal(got.y, real[shape].y)} if name == "unchanged" else {})
            unchanged = {r["shape"]: r["kernels_ms"][KERNEL] for r in rows if r["config"] == "unchanged"
                         and "kernels_ms" in r}
            for r in rows:
                if r["shape"] in unchanged and "kernels_ms" in r:
                    r["output_vs_unchanged"] = r["kernels_ms"][KERNEL] / unchanged[r["shape"]]
            if budget.expired():
                env["incomplete"] = "the time budget ran out"
    except Terminated as stop:
        env["incomplete"] = str(stop)
    save_results(out, "ablate", {"mode": mode, "env": env, "variants": VARIANTS, "rows": rows},
                 markdown(mode, rows, env))
    copy_ok = all(r.get("bitwise", True) for r in rows if r.get("variant") == "unchanged") and all(
        r.get("copy_bitwise", True) for r in rows)
    return 0 if copy_ok and ("incomplete" not in env or mode == "gpu") else 1


if __name__ == "__main__":
    raise SystemExit(main())
