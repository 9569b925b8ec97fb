"""The static report's Markdown and its printed summary (from the JSON bench.static writes)."""
from __future__ import annotations

from .common import fmt, markdown_table, text_table

LABEL = "static model, not measured"

KERNEL_HEADERS = ["kernel", "grid", "warps", "stages", "regs", "spill B", "smem KB", "MMA", "hot loop instr",
                  "hot loop", "occupancy", "waves", "memory ms", "(unique ms)", "tensor ms", "issue ms",
                  "latency ms", "modelled ms", "bound"]


def kernel_row(e: dict) -> list:
    m = e["model"]
    hot = e["hot_loop"] or {}
    occ = m["occupancy"]
    name = e["label"] + ("" if e["chosen"] or e["config"] is None else " (not chosen)")
    if not e["fits"]:
        name += " (does not fit: shared memory)"
    return [name, "x".join(map(str, e["grid"])), e["num_warps"], e["num_stages"], e["registers"], e["spill_bytes"],
            round(e["shared_bytes"] / 1024, 1), e["mma"], hot.get("instructions"), hot.get("what", "no loop"),
            f"{occ['programs']}/SM ({occ['limited_by']})", m["waves"], m["memory_ms"], m["unique_memory_ms"],
            m["tensor_ms"], m["issue_ms"], m["latency_ms"], m["time_ms"], m["bound"]]


def call_title(c: dict) -> str:
    return f"{c['workload']} | {c['shape']} | {c['size']} {c['size_unit']}"


def peer_text(c: dict) -> str:
    p = c["peer"]
    if not p.get("available"):
        return f"peer: absent ({p.get('reason')})"
    text = f"peer {p['name']}: {fmt(p['time_ms'])} ms modelled"
    if "bound" in p:
        text += f", {p['bound']}-bound, {p['how']}"
    else:
        text += f" ({p['kernels_launched']} launches; best modelled config per autotuned kernel)"
    return text + f"; ratio ours / peer = {fmt(c['ratio_to_peer'])}"


def dominant(kernels: list[dict]) -> dict:
    chosen = [e for e in kernels if e["chosen"]]
    return max(chosen, key=lambda e: e["model"]["time_ms"])


def markdown(data: dict) -> str:
    lines = [f"# Static cost report ({LABEL})", "",
             f"{data['date']}, commit {data['commit'].get('commit')}{' (dirty)' if data['commit'].get('dirty') else ''}, "
             f"triton {data['triton']}, compiled for {data['target']}; H200 model: {data['gpu_model']['sms']} SMs x "
             f"{data['gpu_model']['schedulers_per_sm']} schedulers at {data['gpu_model']['clock_hz'] / 1e9:.2g} GHz, "
             f"HBM {data['gpu_model']['hbm_bytes_per_s'] / 1e12:.2g} TB/s. Every time below is modelled "
             "(bench/model.py), none is measured; `python -m bench.static` regenerates this file.", "",
             "Columns: registers per thread (cubin), spilled bytes per thread (ptxas -v), shared memory per "
             "program, MMA form from the SASS; hot loop = the SASS loop with the most issue slots, its instructions "
             "per iteration and iterations per program (interpreter counts); memory = bytes requested (each read "
             "counted) / HBM bandwidth, (unique) = each storage moved once; tensor = dot FLOPs / the MMA form's "
             "rate; issue = the busiest scheduler's issue slots / clock; latency = waves x one warp's in-order "
             "time (bench/README.md has the model and its assumed latencies). "
             "Modelled = the largest term; the call's time is the sum over its launches (an autotuned kernel "
             "counts its best modelled config).", ""]
    lines += ["## Summary", "", "```", *summary_lines(data), "```", ""]
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


def summary_lines(data: dict) -> list[str]:
    rows = []
    for c in data["calls"]:
        top = dominant(c["kernels"])
        peer = c["peer"]
        rows.append([c["workload"], c["shape"], c["size"], c["time_ms"], f"{top['kernel']} ({top['model']['bound']})",
                     peer["time_ms"] if peer.get("available") else None, c["ratio_to_peer"]])
    lines = [f"== bench.static: {LABEL} (triton {data['triton']}, {data['target']})",
             text_table(["call", "shape", "size", "modelled ms", "largest kernel (bound)", "peer ms", "ours/peer"],
                        rows)]
    kernels = [e for c in data["calls"] for e in c["kernels"]]
    kernels += [e for p in data.get("peer_calls", {}).values() for e in p["kernels"]]
    uncounted = sorted({e["label"] for e in kernels
                        if any(lp["iterations_per_program"] is None for lp in e["model"]["loops"])})
    if uncounted:
        lines.append(f"WARNING: loops whose iterations were not counted (modelled as run once per program): "
                     f"{', '.join(uncounted)}")
    return lines
