"""The static report's files: the Markdown, the printed summary and the README block (from the JSON
bench.static writes), merging a partial run into a report, and the JSON's rounding.

    python -m bench.static_report DIR --readme        # the README's table of modelled times, from DIR/static.json
    python -m bench.static_report DIR --calibration   # the model against the GPU runs (bench.static_calibration)
    python -m bench.static_report DIR --write-md      # static.md again from static.json
    python -m bench.static_report DIR --one-launch-floor  # the chunked pass in one launch, at best
    python -m bench.static_report DIR --captures      # the README's table of what captures cost
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from . import static_calibration
from .common import fmt, markdown_table, text_table
from .static_workloads import SHAPES

LABEL = "static model, not measured"

KERNEL_HEADERS = ["kernel", "grid", "warps", "stages", "regs", "spill B", "smem KB", "MMA", "hot loop instr",
                  "hot loop", "occupancy", "waves", "HBM ms", "L2 ms", "tensor ms", "issue ms", "latency ms",
                  "modelled ms", "bound"]
README_SIZES = {"prefill": 8192, "decode": 64}


def kernel_row(e: dict) -> list:
    m = e["model"]
    hot = e["hot_loop"] or {}
    occ = m["occupancy"]
    name = e["label"] + ("" if e["chosen"] or e["config"] is None else " (not chosen)")
    if not e["fits"]:
        name += " (does not fit: shared memory)"
    return [name, "x".join(map(str, e["grid"])), e["num_warps"], e["num_stages"], e["registers"], e["spill_bytes"],
            round(e["shared_bytes"] / 1024, 1), e["mma"], hot.get("instructions"), hot.get("what", "no loop"),
            f"{occ['programs']}/SM ({occ['limited_by']})", m["waves"], m["hbm_ms"], m["l2_ms"],
            m["tensor_ms"], m["issue_ms"], m["latency_ms"], m["time_ms"], m["bound"]]


def call_title(c: dict) -> str:
    return f"{c['workload']} | {c['shape']} | {c['size']} {c['size_unit']}"


def peer_text(c: dict) -> str:
    p = c["peer"]
    if not p.get("available"):
        return f"peer: absent ({p.get('reason')})"
    text = f"peer {p['name']}: {fmt(p['time_ms'])} ms modelled"
    if "bound" in p:
        m = p["memory"]
        text += (f", {p['bound']}-bound, {p['how']}; its memory: {fmt(m['bytes'] / 1e6)} MB requested (L2 "
                 f"{fmt(m['l2_ms'])} ms), {fmt(m['hbm_bytes'] / 1e6)} MB to HBM (HBM {fmt(m['hbm_ms'])} ms), "
                 f"mufu {fmt(p['terms_ms']['mufu'])} ms, fp32 {fmt(p['terms_ms']['fp32'])} ms")
    else:
        text += f" ({p['kernels_launched']} launches; best modelled config per autotuned kernel)"
    return text + f"; ratio ours / peer = {fmt(c['ratio_to_peer'])}"


def dominant(kernels: list[dict]) -> dict:
    chosen = [e for e in kernels if e["chosen"]]
    return max(chosen, key=lambda e: e["model"]["time_ms"])


def commits(data: dict) -> str:
    """The commits the calls were modelled at (a merged report may hold several)."""
    seen = {}
    for c in data["calls"]:
        key = (c.get("commit") or data["commit"].get("commit") or "?")[:12] + (" (dirty)" if c.get("dirty") else "")
        seen[key] = seen.get(key, 0) + 1
    if len(seen) == 1:
        return f"commit {next(iter(seen))}"
    return "commits " + ", ".join(f"{k} ({n} calls)" for k, n in seen.items())


def markdown(data: dict) -> str:
    g = data["gpu_model"]
    lines = [f"# Static cost report ({LABEL})", "",
             f"{data['date']}, {commits(data)}, model {data.get('model_version')}, triton {data['triton']}, compiled "
             f"for {data['target']}; H200 model: {g['sms']} SMs x {g['schedulers_per_sm']} schedulers at "
             f"{g['clock_hz'] / 1e9:.2g} GHz, HBM {g['hbm_bytes_per_s'] / 1e12:.2g} TB/s, L2 "
             f"{g['l2_bytes_per_s'] / 1e12:.2g} TB/s holding {g['l2_reuse_bytes'] / 1e6:.0f} MB for reuse. Every "
             "time below is modelled (bench/model.py), none is measured; `python -m bench.static` regenerates "
             "this file.", "",
             "Columns: registers per thread (cubin), spilled bytes per thread (ptxas -v), shared memory per "
             "program, MMA form from the SASS; hot loop = the SASS loop with the most issue slots, its instructions "
             "per iteration and iterations per program (interpreter counts); HBM = the bytes that must come from or "
             "go to HBM (each storage moved once, plus re-reads that do not fit in L2) / HBM bandwidth; L2 = every "
             "byte the kernel requests (each read counted) / L2 bandwidth; memory = the larger of the two; tensor = "
             "dot FLOPs / the MMA form's rate; issue = the busiest scheduler's issue slots / clock; latency = waves "
             "x one warp's in-order time (bench/README.md has the model and its assumptions). Modelled = the "
             "largest term; the call's time is the sum over its launches (an autotuned kernel counts its best "
             "modelled config). mamba_ssm's selective_scan_fn is modelled from its algorithm with the same memory "
             "rule.", ""]
    lines += ["## Summary", "", "```", *summary_lines(data), "```", ""]
    lines += ["## Calibration: the model against the GPU runs", "", static_calibration.table(data), ""]
    for c in data["calls"]:
        lines += [f"## {call_title(c)}", "", f"{c['doc']}; {c['shape_dims']}. Modelled {fmt(c['time_ms'])} ms over "
                  f"{c['kernels_launched']} launches; must-move roofline {fmt(c['roofline_ms'])} ms "
                  f"({fmt(c['must_move_bytes'] / 1e6)} MB). {peer_text(c)}.", "",
                  markdown_table(KERNEL_HEADERS, [kernel_row(e) for e in c["kernels"] if e["chosen"]]), ""]
        peer = c["peer"]
        if peer.get("ref"):
            kernels = data["peer_calls"][peer["ref"]]["kernels"]
            lines += [f"Peer ({peer['name']}), chosen configs:", "",
                      markdown_table(KERNEL_HEADERS, [kernel_row(e) for e in kernels if e["chosen"]]), ""]
    return "\n".join(lines) + "\n"


def serial(data: dict, c: dict) -> tuple[float | None, float | None]:
    """The call's serial estimate and its ratio to the peer's (bench.static_calibration.serial_ms;
    None where the peer is not modelled kernel by kernel)."""
    ours, peer = (static_calibration.call_serial(data, c, peer) for peer in (False, True))
    return ours, ours / peer if ours is not None and peer else None


def summary_lines(data: dict) -> list[str]:
    rows = []
    for c in data["calls"]:
        top = dominant(c["kernels"])
        peer = c["peer"]
        rows.append([c["workload"], c["shape"], c["size"], c["time_ms"], f"{top['kernel']} ({top['model']['bound']})",
                     c["roofline_ms"], peer["time_ms"] if peer.get("available") else None, c["ratio_to_peer"],
                     *serial(data, c)])
    lines = [f"== bench.static: {LABEL} (triton {data['triton']}, {data['target']})",
             text_table(["call", "shape", "size", "modelled ms", "largest kernel (bound)", "must-move ms", "peer ms",
                         "ours/peer", "serial ms", "ours/peer serial"], rows)]
    kernels = [e for c in data["calls"] for e in c["kernels"]]
    kernels += [e for p in data.get("peer_calls", {}).values() for e in p["kernels"]]
    uncounted = sorted({e["label"] for e in kernels
                        if any(lp["iterations_per_program"] is None for lp in e["model"].get("loops", []))})
    if uncounted:
        lines.append(f"WARNING: loops whose iterations were not counted (modelled as run once per program): "
                     f"{', '.join(uncounted)}")
    return lines


def readme_block(data: dict) -> str:
    """The README's table: every call at 8192 tokens (decode: batch 64), ours against the peer."""
    rows = []
    for c in data["calls"]:
        if c["size"] != README_SIZES[c["kind"]]:
            continue
        top = dominant(c["kernels"])
        peer = c["peer"]
        serial_ms, serial_ratio = serial(data, c)
        rows.append([f"`{c['workload']}`", c["shape"], fmt(c["time_ms"]), f"{top['model']['bound']} ({top['kernel']})",
                     fmt(c["roofline_ms"]), f"{fmt(peer['time_ms'])} ({peer['name'].removeprefix('mamba_ssm ')})"
                     if peer.get("available") else "-", fmt(c["ratio_to_peer"]) if c["ratio_to_peer"] else "-",
                     fmt(serial_ms) if serial_ms is not None else "-", fmt(serial_ratio) if serial_ratio else "-"])
    return "\n".join([
        f"Modelled on an H200 ({LABEL}; {data['date']}, {commits(data)}, model {data.get('model_version')}), "
        f"bfloat16, batch 1, {README_SIZES['prefill']} tokens (decode: batch {README_SIZES['decode']}); "
        "32768 tokens, batches 128 and 256 and every kernel's figures are in `static.md`. Serial: each "
        "kernel's issue and latency terms added, or its memory or tensor term where larger "
        "(bench/static_calibration.py):", "",
        markdown_table(["call", "shape", "ms", "bound (largest kernel)", "must-move ms", "peer ms (mamba_ssm)",
                        "ours / peer", "serial ms", "ours / peer, serial"], rows)])


# The chunked Mamba-2 paths whose captures the README's capture table weighs: each path's call
# without captures and the bytes of a captured state's element (mamba2_scan stores float32; the
# engine op stores into a bfloat16 cache).
CAPTURE_PATHS = (("mamba2_scan chunked", 4), ("mamba2_prefill chunked, bf16 cache", 2),
                 ("mamba2_scan chunked, fused", 4))


def captures_block(data: dict) -> str:
    """The README's table of what captures cost: for each chunked path, shape and size its time
    without captures, with 8 inside chunks and with 8 at chunk starts, each capture kind's added
    time as a share of the pass and as a multiple of its own bytes' time at HBM bandwidth (a
    captured state written once: the floor no design beats)."""
    calls = {(c["workload"], c["shape"], c["size"]): c for c in data["calls"]}
    hbm = data["gpu_model"]["hbm_bytes_per_s"]
    rows = []
    for (shape, dims), size, (path, element_bytes) in itertools.product(
            SHAPES.items(), sorted({c["size"] for c in data["calls"]}), CAPTURE_PATHS):
        base = calls.get((path, shape, size))
        if base is None:
            continue
        floor_ms = 8 * dims.nheads * dims.headdim * dims.dstate * element_bytes / hbm * 1e3

        def added(suffix):
            c = calls.get((f"{path} + {suffix}", shape, size))
            if c is None:
                return "-"
            extra = c["time_ms"] - base["time_ms"]
            return (f"{fmt(c['time_ms'])} (+{100 * extra / base['time_ms']:.1f}%; "
                    f"{fmt(extra / floor_ms)}x)")

        peer = base["peer"]
        rows.append([shape, size, f"`{path}`", fmt(base["time_ms"]), added("8 captures"),
                     added("8 grid captures"), fmt(floor_ms * 1e3), fmt(peer["time_ms"]) if peer.get("available")
                     else "-"])
    return "\n".join([
        f"Captures on the chunked path ({LABEL}; {data['date']}, {commits(data)}, model {data.get('model_version')}); "
        "bfloat16, batch 1; `mamba2_scan` stores captures in float32, the engine op `mamba2_prefill` into a "
        "bfloat16 state cache; inner captures at offsets 16, 48, ..., 240 into 8 chunks, grid captures at the same "
        "chunks' starts. Each figure: ms, the share of the pass it adds, and the added time over its bytes' time "
        "at HBM bandwidth (a captured state written once):", "",
        markdown_table(["shape", "tokens", "path", "ms", "+ 8 captures", "+ 8 grid captures",
                        "8 states' bytes at HBM bandwidth, us", "peer ms (mamba_chunk_scan_combined)"], rows)])


# The five-stage chunked Mamba-2 pass: stage 1 stays a launch of its own in any one-launch design
# (docs/chunked.md, "Stage 1 apart"); the walk is what such a design changes; the output kernel's
# residency is the one launch's (its register cap).
FLOOR_WORKLOAD, STAGE1, WALK, OUTPUT = ("mamba2_scan chunked", "_dt_cumsum_kernel", "_state_passing_kernel",
                                        "_chunk_output_kernel")


def one_launch_floor(data: dict) -> str:
    """The five-stage pass's stages 2 to 5 as one launch whose programs each cost what they cost
    in their own kernels (the model's latency a program), with the walk, the hand-offs between
    chunks, the tickets and the waits free: stage 1's time plus the C B^T, chunk-state and output
    programs' cycles spread over the output kernel's residency on every SM. A pass that hands
    its states on in one launch cannot be modelled faster unless these programs cost less."""
    gpu = data["gpu_model"]
    rows = []
    for c in data["calls"]:
        if c["workload"] != FLOOR_WORKLOAD or not c["peer"].get("available"):
            continue
        kernels = {e["kernel"]: e["model"] for e in c["kernels"] if e["chosen"]}
        slots = kernels[OUTPUT]["occupancy"]["programs"] * gpu["sms"]
        ms = {name: m["time_ms"] if name == STAGE1 else
              m["programs"] * m["latency_cycles_per_program"] / slots / gpu["clock_hz"] * 1e3
              for name, m in kernels.items() if name != WALK}
        total, peer = sum(ms.values()), c["peer"]["time_ms"]
        rows.append([c["shape"], c["size"], fmt(c["time_ms"]), fmt(total), fmt(total / peer), fmt(ms[OUTPUT]),
                     fmt(ms[OUTPUT] / peer), fmt(peer)])
    return "\n".join([
        f"== the chunked pass in one launch, at best ({LABEL}; model {data.get('model_version')}): stages 2 to 5 "
        f"as one launch of the five stages' programs at the output kernel's residency, the walk, hand-offs, "
        f"tickets and waits free",
        text_table(["shape", "tokens", "five stages ms", "one launch ms", "/ peer", "output programs ms", "/ peer",
                    "peer ms"], rows)])


def call_key(c: dict) -> tuple:
    return c["workload"], c["shape"], c["size"]


def merge(old: dict, new: dict, order: list[str], shapes: list[str]) -> dict:
    """`old` with the calls (and peer calls) of `new` replacing or joining its own, in the report's
    order; refused unless one version of the model wrote both."""
    if old.get("model_version") != new["model_version"]:
        raise SystemExit(f"--update: the report was written by model {old.get('model_version')}, this is model "
                         f"{new['model_version']}: run every call again instead")
    calls = {call_key(c): c for c in old["calls"]} | {call_key(c): c for c in new["calls"]}

    def rank(c):
        shape = shapes.index(c["shape"]) if c["shape"] in shapes else len(shapes)
        return order.index(c["workload"]), shape, c["shape"], c["size"]

    used = {c["peer"]["ref"] for c in calls.values() if c["peer"].get("ref")}
    peer_calls = {k: v for k, v in (old.get("peer_calls", {}) | new.get("peer_calls", {})).items() if k in used}
    return {**new, "calls": sorted(calls.values(), key=rank),
            "peer_calls": peer_calls}


def rounded(value, digits: int = 5):
    """Floats to `digits` significant digits, whole ones (counts) to ints, through lists and
    dicts (a compact JSON)."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v, digits) for v in value]
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.static_report", description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="a results folder of python -m bench.static")
    parser.add_argument("--readme", action="store_true", help="print the README's table (else the summary)")
    parser.add_argument("--calibration", action="store_true",
                        help="print the model against every GPU-measured call (else the summary)")
    parser.add_argument("--write-md", action="store_true",
                        help="rewrite DIR/static.md from DIR/static.json (after a GPU run or a report of a measured "
                             "commit was added: its calibration)")
    parser.add_argument("--one-launch-floor", action="store_true",
                        help="print what the chunked pass would take in one launch of the five stages' programs "
                             "(one_launch_floor)")
    parser.add_argument("--captures", action="store_true",
                        help="print the README's table of what captures cost on the chunked paths (captures_block)")
    args = parser.parse_args(argv)
    if not (args.dir / "static.json").is_file():
        parser.error(f"{args.dir} has no static.json (a results folder of python -m bench.static)")
    data = json.loads((args.dir / "static.json").read_text())
    if args.write_md:
        (args.dir / "static.md").write_text(markdown(data))
        print(f"(written to {args.dir}/static.md)")
    elif args.calibration:
        print(static_calibration.table(data))
    elif args.one_launch_floor:
        print(one_launch_floor(data))
    elif args.captures:
        print(captures_block(data))
    else:
        print(readme_block(data) if args.readme else "\n".join(summary_lines(data)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
