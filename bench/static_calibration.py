"""The static model against the GPU: beside every call a GPU run has measured (bench/results/
*-gpu*/scan.json, batch 1 at a size the report models), the measured kernel time (torch.profiler)
and call time (do_bench), the commit they were measured at, and the model's error: modelled /
measured kernel time (the call time where a run measured no kernel time, marked so). The model
is read from the report itself (its commit: the kernels may have changed since the measurement)
and, where one exists, from a static report of the measured commit's kernels
(bench/static_at.sh COMMIT bench/results/<date>-static-<commit>).

Beside the model's time (each kernel's largest term: HBM, L2, tensor, issue or latency), the
serial estimate: each kernel's issue and latency terms added, as if no program issued while
another waited on memory (its memory or tensor term where that is larger: bytes still take their
bandwidth). On the H200 runs of 2026-11-30 and 2026-12-04 the chunked Mamba-2
pipelines, ours and mamba_ssm's, took 1.06-1.17x their serial estimate, at both commits and all
three shapes, where the model's time ran 1.5-2.2x low and moved with the kernels' changes. Where
a program's loop carries a serial chain (the recurrent scan, the fused pass) its instructions
issue under the chain's waits: there the serial estimate ran 9-13% and 27-29% high, and the
model's time 19-22% and 13% low (bench/README.md, "Modelled figures").

    python -m bench.static_report DIR --calibration
"""
from __future__ import annotations

import json
from pathlib import Path

from .common import RESULTS_DIR, fmt, markdown_table

OURS = {"recurrent": "recurrent", "chunked (chunk default)": "chunked", "chunked (chunk 256)": "chunked"}
HEADERS = ["call", "shape", "tokens", "measured kernel ms", "measured call ms", "measured at", "modelled ms (then)",
           "error (then)", "modelled ms (report)", "error (report)", "serial ms (then)", "error (then)",
           "serial ms (report)", "error (report)"]


def _workload(row: dict) -> tuple[str, bool] | None:
    """(static workload, peer?) of a measured row, or None when the report has no such call."""
    kind = row.get("kind") or ("mamba1" if row["model"].startswith("Mamba-1") else "mamba2")
    if row.get("impl", "ssm_kernels") == "mamba_ssm" and kind == "mamba2":
        return f"{kind}_scan chunked", True
    if row.get("impl", "ssm_kernels") != "ssm_kernels" or row["algorithm"] not in OURS:
        return None
    name = f"{kind}_scan {OURS[row['algorithm']]}"
    suffix = {0: "", 8: " + 8 captures", "8 grid": " + 8 grid captures"}.get(row.get("captures") or 0)
    return None if suffix is None else (name + suffix, False)


def measurements(results: Path = RESULTS_DIR) -> list[dict]:
    """Every GPU-measured batch-1 pass (scan and captures sections) of the GPU runs under `results`."""
    out = []
    for path in sorted(results.glob("*-gpu*/scan.json")):
        data = json.loads(path.read_text())
        if not data["label"].startswith("GPU") or data["env"].get("reduced"):
            continue
        for row in data.get("scan", []) + data.get("captures", []):
            if row.get("status") != "ok" or str(row.get("batch")) != "1":
                continue
            if row["section"] == "captures" and row.get("captures") not in (8, "8 grid"):
                continue  # the passes without captures are the scan section's
            match = _workload(row)
            if match is None:
                continue
            out.append({"workload": match[0], "peer": match[1], "shape": row["model"], "tokens": row["seqlen"],
                        "kernel_ms": row.get("gpu_ms"), "call_ms": row["ms"], "run": path.parent.name,
                        "device": data["env"].get("device_name") or data["label"].removeprefix("GPU: "),
                        "kernels": row.get("gpu_kernels"),
                        "commit": (data["env"].get("commit") or "?")[:7],
                        "captures_placed": "evenly" if row.get("captures") == 8 else None})
    return out


def measured_at(m: dict) -> str:
    """Where a measurement was made: its commit, run and GPU (the model is an H200's: another GPU's
    times, and less so its ratios, differ for reasons the model does not hold)."""
    return f"{m['commit']} ({m['run']}, {m['device']})"


def _call(data: dict, m: dict) -> dict | None:
    return next((c for c in data["calls"] if (c["workload"], c["shape"], c["size"]) == (m["workload"], m["shape"],
                                                                                         m["tokens"])), None)


def _modelled(data: dict, m: dict) -> float | None:
    c = _call(data, m)
    if c is None:
        return None
    if m["peer"]:
        return c["peer"]["time_ms"] if c["peer"].get("available") else None
    return c["time_ms"]


def _cells(value: float | None, measured: float, mark: str = "") -> list[str]:
    """A modelled figure and its error against the measured one, or two dashes without it."""
    return [fmt(value), f"{fmt(value / measured)}{mark}"] if value else ["-", "-"]


def serial_ms(kernels: list[dict]) -> float | None:
    """The serial estimate of a call's kernels (module doc): each chosen launch's issue and
    latency terms added, or its memory or tensor term where that is larger (an autotuned peer's
    kernels at the configuration the model chose); None where a launch has no such terms."""
    total = 0.0
    for k in kernels:
        if k.get("chosen", True) is False:
            continue
        m = k.get("model")
        if not isinstance(m, dict) or "issue_ms" not in m:
            return None
        total += max(m["issue_ms"] + m["latency_ms"], m.get("memory_ms", 0.0), m.get("tensor_ms", 0.0))
    return total


def call_kernels(data: dict | None, c: dict | None, peer: bool = False) -> list[dict] | None:
    """A report's launches of call `c`, or of its peer's call (peer_calls), or None without them."""
    if data is None or c is None:
        return None
    if peer:
        c = data.get("peer_calls", {}).get(c["peer"].get("ref"))
    return None if c is None else c.get("kernels")


def call_serial(data: dict, c: dict, peer: bool = False) -> float | None:
    """The serial estimate of call `c` (or its peer's) in report `data`."""
    kernels = call_kernels(data, c, peer)
    return None if kernels is None else serial_ms(kernels)


def _serial(data: dict, m: dict) -> float | None:
    """The serial estimate of the call (or its peer's) measured in `m`, from report `data`."""
    c = _call(data, m)
    return None if c is None else call_serial(data, c, m["peer"])


def _modelled_kernels(data: dict | None, m: dict, serial: bool = False) -> dict[str, float]:
    """{kernel name: modelled ms} of the measured call's kernels in a report, ours or the peer's at
    the configurations the model chose (their launches summed); serial: their serial estimates
    (module doc)."""
    out: dict[str, float] = {}
    for k in call_kernels(data, None if data is None else _call(data, m), m["peer"]) or []:
        if k.get("chosen", True) and isinstance(k.get("model"), dict):
            t = serial_ms([k]) if serial else k["model"]["time_ms"]
            if t is not None:
                out[k["kernel"]] = out.get(k["kernel"], 0.0) + t
    return out


def kernel_rows(data: dict, results: Path = RESULTS_DIR) -> list[list]:
    """Per kernel, ours and the peer's, where a run measured each kernel's time (gpu_kernels):
    measured ms, and the model's ms and error at the measured commit's kernels ("then") and at the
    report's. A stage whose error moves between runs is where the model credits a change the GPU
    did not give; a peer's stage whose error differs from ours is where it misjudges one design."""
    out = []
    for m in measurements(results):
        if not m["kernels"]:
            continue
        then_report = next((r for r in reports_at(m["commit"], results, data.get("model_version")) if _call(r, m)),
                           None)
        estimates = [_modelled_kernels(report, m, serial) for serial in (False, True) for report in (then_report, data)]
        for name, measured in m["kernels"].items():
            if all(name not in e for e in estimates):
                continue  # a copy or another library's kernel
            out.append([f"`{m['workload']}`" + (" peer (mamba_ssm)" if m["peer"] else ""), m["shape"], m["tokens"],
                        measured_at(m), f"`{name}`", fmt(measured),
                        *(cell for e in estimates for cell in _cells(e.get(name), measured))])
    return out


def reports_at(commit: str, results: Path = RESULTS_DIR, model_version: str | None = None) -> list[dict]:
    """Static reports every call of which was modelled at `commit` (a prefix), those of
    `model_version` first."""
    found = []
    for path in sorted(results.glob("*static*/static.json")):
        data = json.loads(path.read_text())
        commits = {(c.get("commit") or "") for c in data["calls"]}
        if commits and all(c.startswith(commit) for c in commits):
            found.append(data)
    return sorted(found, key=lambda r: r.get("model_version") != model_version)


def rows(data: dict, results: Path = RESULTS_DIR) -> list[dict]:
    """One row per measurement with a counterpart in the report (`data`). "then": the first static
    report of the measured commit's kernels, under the report's model version where one is."""
    out = []
    for m in measurements(results):
        now = _modelled(data, m)
        if now is None:
            continue
        then_reports = reports_at(m["commit"], results, data.get("model_version"))
        then = next((t for t in (_modelled(r, m) for r in then_reports) if t is not None), None)
        serial_then = next((t for t in (_serial(r, m) for r in then_reports) if t is not None), None)
        measured = m["kernel_ms"] or m["call_ms"]
        out.append({**m, "modelled_ms": now, "error": now / measured, "modelled_then_ms": then,
                    "error_then": then / measured if then else None, "serial_ms": _serial(data, m),
                    "serial_then_ms": serial_then, "against": "kernel" if m["kernel_ms"] else "call"})
    return out


def ratios(calibration: list[dict]) -> list[list]:
    """Ours / the peer, measured (kernel times of one run) and modelled, per run, shape and size."""
    out = []
    for r in calibration:
        if r["peer"] or r["against"] != "kernel" or r["captures_placed"]:
            continue
        peer = next((p for p in calibration if p["peer"] and p["against"] == "kernel" and p["workload"] == r["workload"]
                     and (p["run"], p["shape"], p["tokens"]) == (r["run"], r["shape"], r["tokens"])), None)
        if peer is None:
            continue
        measured = r["kernel_ms"] / peer["kernel_ms"]
        ratio = lambda key: r[key] / peer[key] if r[key] and peer[key] else None  # noqa: E731
        out.append([f"`{r['workload']}`", r["shape"], r["tokens"], measured_at(r), fmt(measured),
                    *(cell for key in ("modelled_then_ms", "modelled_ms", "serial_then_ms", "serial_ms")
                      for cell in _cells(ratio(key), measured))])
    return out


def table(data: dict, results: Path = RESULTS_DIR) -> str:
    calibration = rows(data, results)
    if not calibration:
        return "No GPU run has measured a call of this report."
    ratio_rows = ratios(calibration)
    per_kernel = kernel_rows(data, results)
    body = []
    for r in calibration:
        name = f"`{r['workload']}`" + (" peer (mamba_ssm)" if r["peer"] else "")
        if r["captures_placed"]:
            name += " (measured: captures evenly spaced)"
        mark = "" if r["against"] == "kernel" else " (call)"
        body.append([name, r["shape"], r["tokens"], fmt(r["kernel_ms"]) if r["kernel_ms"] else "-", fmt(r["call_ms"]),
                     measured_at(r), fmt(r["modelled_then_ms"]) if r["modelled_then_ms"] else "-",
                     f"{fmt(r['error_then'])}{mark}" if r["error_then"] else "-", fmt(r["modelled_ms"]),
                     f"{fmt(r['error'])}{mark}", *_cells(r["serial_then_ms"], r["kernel_ms"] or r["call_ms"], mark),
                     *_cells(r["serial_ms"], r["kernel_ms"] or r["call_ms"], mark)])
    return "\n".join([
        "Modelled (static model of an H200, not measured) against measured on the GPU each row names. Error = "
        "modelled / measured kernel "
        "time ((call): against the call time, where the run measured no kernel time). \"then\": the model of "
        "the measured commit's kernels (bench/static_at.sh); \"report\": this report's kernels, which may have "
        "changed since. \"serial\": each kernel's issue and latency terms added (bench/static_calibration.py "
        "says why).", "",
        markdown_table(HEADERS, body), "",
        "Ours / mamba_ssm's peer, kernel times of one run against the model's ratio:", "",
        markdown_table(["call", "shape", "tokens", "measured at", "measured ratio", "modelled (then)",
                        "modelled / measured (then)", "modelled (report)", "modelled / measured (report)",
                        "serial (then)", "serial / measured (then)", "serial (report)", "serial / measured (report)"],
                       ratio_rows)
        if ratio_rows else "(no run measured both kernel times)", "",
        "Per kernel (runs that recorded each kernel's time), modelled against measured:", "",
        markdown_table(["call", "shape", "tokens", "measured at", "kernel", "measured ms", "modelled ms (then)",
                        "error (then)", "modelled ms (report)", "error (report)", "serial ms (then)", "error (then)",
                        "serial ms (report)", "error (report)"], per_kernel)
        if per_kernel else "(no run recorded each kernel's time yet)"])
