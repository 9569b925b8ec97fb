"""Short tables from a results folder, and the README block of a GPU run.

    python -m bench.summary DIR            # the steps (from gpu_suite.sh), then the short tables
    python -m bench.summary DIR --readme   # Markdown for the README: the GPU table and plot, with
                                           # their date, GPU, versions and commit (GPU runs only)

Reads only what the benchmarks wrote (scan.json, serve.json, logs/steps.tsv): every figure it
prints was measured by that run, or is labelled modelled.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .common import REPO_ROOT, fmt, markdown_table, text_table
from .report import _ok, scan_grid, scan_short_table, serve_short_table


def _load(path: Path) -> dict | None:
    """A benchmark's JSON object; None where the file is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def step_rows(folder: Path) -> list[list[str]]:
    """logs/steps.tsv's rows (step, exit status or "skipped", seconds); [] without it."""
    path = folder / "logs" / "steps.tsv"
    if not path.exists():
        return []
    return [line.split("\t") for line in path.read_text().splitlines()[1:] if line.strip()]


def steps_table(folder: Path) -> str | None:
    rows = step_rows(folder)
    if not rows:
        return None
    status = lambda rc: "ok" if rc == "0" else ("skipped" if rc == "skipped" else  # noqa: E731
                                                ("TIMED OUT" if rc == "124" else f"FAILED (exit {rc})"))
    return "suite steps:\n" + text_table(["step", "status", "s"], [[r[0], status(r[1]), r[2]] for r in rows])


def readme_block(folder: Path, scan: dict, serve: dict | None) -> str:
    env = scan["env"]
    try:
        where = folder.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        where = folder.as_posix()
    commit = (env.get("commit") or "unknown")[:12] + (" (uncommitted changes)" if env.get("dirty") else "")
    def table(value, fraction):
        header, rows = scan_grid(_ok(scan["scan"]), lambda r: None if r.get(value) is None else
                                 f"{fmt(r[value])} ({100 * r[fraction]:.2g}%)")
        return markdown_table(["model", "batch", "tokens"] + header[3:], rows)

    lines = [f"Latest GPU run: {env['date'][:10]}, {env['device_name']}, torch {env['torch']}, "
             f"triton {env['triton']}, commit `{commit}` ([scan tables]({where}/scan.md)"
             + (f", [serving tables]({where}/serve.md)" if serve else "") + ")."
             + (" Incomplete: it ran out of time, so only the rows shown were measured."
                if scan.get("incomplete") else ""),
             ""]
    if any(r.get("gpu_ms") is not None for r in _ok(scan["scan"])):
        lines += ["Scan pass time in ms, the pass's kernels alone (torch.profiler; fraction of the copy-bandwidth "
                  "roofline), bfloat16:", "", table("gpu_ms", "gpu_roofline_fraction"), ""]
    lines += ["Scan pass time in ms, a call back to back (do_bench; the host's launch work included; fraction of "
              "the copy-bandwidth roofline), bfloat16:", "", table("ms", "roofline_fraction"),
             "", f"![scan throughput]({where}/scan_throughput.png)"]
    if serve and (folder / "serve_policies.png").exists():
        lines += ["", f"![policies]({where}/serve_policies.png)"]
    return "\n".join(lines)


def sweep_line(sweep: dict) -> str:
    """bench.sweep's fastest configuration at each shape, against the default."""
    best: dict[str, dict] = {}
    for row in sweep["rows"]:
        if row.get("vs_default") is not None and row["vs_default"] < best.get(row["shape"], {}).get("vs_default", 2):
            best[row["shape"]] = row
    found = "; ".join(f"{shape}: {r['config']} {r['vs_default']:.3f}x (bit for bit: {'yes' if r['bitwise'] else 'no'})"
                      for shape, r in best.items())
    return f"== bench.sweep, the fastest launch configuration a shape against the default: {found or 'none measured'}"


def ablate_line(ablate: dict) -> str:
    """bench.ablate's output kernel per variant against the unchanged copy, at each shape."""
    shapes: dict[str, list[str]] = {}
    for row in ablate["rows"]:
        if row.get("output_vs_unchanged") is not None and row["config"] != "unchanged":
            name = row["config"].split(" (")[0]
            modelled = [f"{label} {row[key]:.2f}x" for key, label in (("modelled_vs_unchanged", "modelled"),
                                                                        ("serial_vs_unchanged", "serial"))
                        if row.get(key) is not None]
            shapes.setdefault(row["shape"], []).append(f"{name} {row['output_vs_unchanged']:.2f}x"
                                                       + (f" ({', '.join(modelled)})" if modelled else ""))
    found = "; ".join(f"{shape}: {', '.join(parts)}" for shape, parts in shapes.items())
    return f"== bench.ablate, the output kernel without a part against the unchanged copy: {found or 'none measured'}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.summary", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--readme", action="store_true", help="print the README block (GPU results only)")
    args = parser.parse_args(argv)
    scan, serve = _load(args.folder / "scan.json"), _load(args.folder / "serve.json")
    if args.readme:
        if scan is None or scan["env"]["device_type"] != "cuda" or scan["env"].get("reduced"):
            print(f"{args.folder}: no full-size GPU scan results; the README shows GPU results only", file=sys.stderr)
            return 1
        print(readme_block(args.folder, scan, serve))
        return 0
    status = 0
    steps = steps_table(args.folder)
    parts = [steps] if steps else []
    chain = _load(args.folder / "chain" / "chain.json")
    if chain and chain.get("hop_us") is not None:
        parts.append(f"== bench.chain: {chain['hop_us']:.2f} us a state hand-off between programs "
                     f"({chain['environment']['device']})")
    sweep = _load(args.folder / "sweep" / "sweep.json")
    if sweep and sweep["mode"] == "gpu":
        parts.append(sweep_line(sweep))
    ablate = _load(args.folder / "ablate" / "ablate.json")
    if ablate and ablate["mode"] == "gpu":
        parts.append(ablate_line(ablate))
    skipped = {r[0] for r in step_rows(args.folder) if r[1] == "skipped"}
    for name, data, table in (("scan", scan, scan_short_table), ("serve", serve, serve_short_table)):
        if data is None and name in skipped:  # the suite's budget left it no time: nothing failed
            parts.append(f"== bench.{name}: skipped (no time left in the suite's budget)")
        elif data is None:
            parts.append(f"== bench.{name}: no results ({args.folder / (name + '.json')} missing or unreadable)")
            status = 1
        else:
            parts.append(table(data))
            status |= bool(data.get("incomplete"))
    print("\n\n".join(parts))
    return status


if __name__ == "__main__":
    sys.exit(main())
