"""Markdown reports, PNG plots and the short console tables of bench.scan and bench.serve.

Everything here reads the result dicts the benchmarks write as JSON, so `python -m bench.summary`
can rebuild the tables from a results folder.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from .common import fmt, header_lines, markdown_table, pyplot, text_table


def _pct(value):
    return None if value is None else f"{100 * value:.3g}%"


def _alg(row) -> str:
    alg = row.get("algorithm", "")
    if alg.startswith("chunked, fused"):
        return "fused"
    return "chunk" if alg.startswith("chunked") else ("rec" if alg.startswith("recurrent") else alg)


def _series(row) -> str:
    """A short name for an implementation: ours by backend/algorithm, peers by name."""
    if row.get("impl", "ssm_kernels") != "ssm_kernels":
        return row["impl"]
    backend = "interp" if row["backend"] == "triton-interpreter" else row["backend"]
    return f"{backend}/{_alg(row)}" if row.get("algorithm") else backend


def _stamp(results, sep=" | ") -> str:
    env = results["env"]
    return f"{results['label']}{sep}{env['date'][:10]} | commit {(env.get('commit') or 'unknown')[:10]}"


def _ok(rows):
    return [r for r in rows if r.get("status") == "ok"]


# ---------------------------------------------------------------------------------------------
# scan
# ---------------------------------------------------------------------------------------------
def write_scan_report(results: dict, out: Path) -> None:
    lines = header_lines(results["env"], "Scan benchmarks")
    bw = results.get("copy_bandwidth")
    if bw:
        lines.append(f"- copy bandwidth: {fmt(bw['GBps'])} GB/s ({bw['what']}, {bw['buffer_bytes'] >> 20} MiB)")
    lines.append("- roofline: bytes the pass must move (formula in bench/workloads.py) / copy bandwidth; "
                 "inputs bfloat16, states float32")
    if results.get("incomplete"):
        lines.append(f"- **incomplete**: {results['incomplete']}")
    lines += ["", "## Scan passes", "",
              markdown_table(["model", "batch", "seqlen", "impl", "backend", "algorithm", "ms", "Mtok/s", "GB/s",
                              "roofline", "note"],
                             [[r["model"], r["batch"], r["seqlen"], r["impl"], r["backend"], r["algorithm"],
                               r.get("ms"), (r["tokens_per_s"] / 1e6) if r.get("tokens_per_s") else None,
                               r.get("GBps"), _pct(r.get("roofline_fraction")), r.get("note", "")]
                              for r in results["scan"]])]
    if results.get("crossover"):
        lines += ["", "## Algorithm crossover (batch 1)", "", _crossover_table(results["crossover"], markdown_table)]
    lines += ["", "## Capture overhead (batch 1)", "",
              markdown_table(["model", "backend", "algorithm", "seqlen", "captures", "ms", "vs none", "us/capture",
                              "note"],
                             [[r["model"], r["backend"], r["algorithm"], r["seqlen"], r["captures"], r.get("ms"),
                               r.get("vs_no_capture"), r.get("us_per_capture"), r.get("note", "")]
                              for r in results["captures"]])]
    lines += ["", "## In-pass capture vs two passes split at the tail split point (batch 1)", "",
              "ratio = two passes / one pass with the capture; the state is handed from the first pass to "
              "the second.", "",
              markdown_table(["model", "backend", "algorithm", "seqlen", "split", "one pass ms", "two passes ms",
                              "ratio", "note"],
                             [[r["model"], r["backend"], r["algorithm"], r["seqlen"], r["split"], r.get("one_pass_ms"),
                               r.get("two_passes_ms"), r.get("ratio"), r.get("note", "")]
                              for r in results["inpass_vs_split"]])]
    lines += ["", "## Decode step (one token per row; latency includes host-side argument handling)", "",
              markdown_table(["model", "batch", "impl", "backend", "us", "GB/s", "roofline", "note"],
                             [[r["model"], r["batch"], r["impl"], r["backend"],
                               r["ms"] * 1e3 if r.get("ms") else None, r.get("GBps"),
                               _pct(r.get("roofline_fraction")), r.get("note", "")] for r in results["decode"]])]
    lines += ["", "## Peers", "",
              markdown_table(["peer", "available", "version", "detail"],
                             [[name, "yes" if p["available"] else "no", p.get("version") or "-", p["reason"]]
                              for name, p in results["peers"].items()])]
    for note in results.get("notes", []):
        lines.append(f"\n- {note}")
    if pyplot() is None:
        lines.append("\n- PNG plots not written: matplotlib is not installed")
    (out / "scan.md").write_text("\n".join(lines) + "\n")
    _plot_scan(results, out)


def _crossover_table(rows, table):
    by_len = defaultdict(dict)
    for r in rows:
        by_len[r["seqlen"]][_alg(r)] = r.get("ms")
    body = []
    for n, t in sorted(by_len.items()):
        rec, chk = t.get("rec"), t.get("chunk")
        faster = None if rec is None or chk is None else ("chunked" if chk < rec else "recurrent")
        body.append([n, rec, chk, faster])
    model = rows[0]["model"] if rows else ""
    return f"{model}, {rows[0]['backend'] if rows else ''}\n\n" + table(
        ["seqlen", "recurrent ms", "chunked ms", "faster"], body)


def crossover_tokens(rows) -> int | None:
    """The smallest measured length from which chunked is faster at every longer length."""
    by_len = defaultdict(dict)
    for r in _ok(rows):
        by_len[r["seqlen"]][_alg(r)] = r["ms"]
    best = None
    for n in sorted(by_len, reverse=True):
        t = by_len[n]
        if "rec" in t and "chunk" in t and t["chunk"] < t["rec"]:
            best = n
        else:
            break
    return best


def _colours(names):
    """One colour per series name, the same in every panel of a figure."""
    palette = [f"C{i}" for i in range(10)] + ["#8c564b", "#17becf", "#bcbd22", "#7f7f7f", "#393b79", "#637939"]
    return {name: palette[i % len(palette)] for i, name in enumerate(sorted(set(names)))}


def _plot_scan(results, out):
    plt = pyplot()
    if plt is None:
        return
    from matplotlib.lines import Line2D

    rows = _ok(results["scan"])
    models = list(dict.fromkeys(r["model"] for r in results["scan"]))
    if rows and models:
        colour = _colours(_series(r) for r in rows)
        kinds = {}  # batch kind -> (series line style, roofline line style)
        cols = 2 if len(models) > 1 else 1
        nrows = (len(models) + cols - 1) // cols
        fig, axes = plt.subplots(nrows, cols, figsize=(6.5 * cols, 4.2 * nrows), squeeze=False)
        for ax, model in zip(axes.flat, models):
            mine = [r for r in rows if r["model"] == model]
            series = defaultdict(list)
            roof = defaultdict(dict)
            for r in mine:
                kind = "batch 1" if r["batch"] == "1" else r["batch"]
                kinds.setdefault(kind, ("-", "-.") if kind == "batch 1" else ("--", ":"))
                series[(_series(r), kind)].append((r["seqlen"], r["tokens_per_s"]))
                roof[kind][r["seqlen"]] = r["tokens"] / (r["roofline_ms"] / 1e3)
            for (name, kind), pts in sorted(series.items()):
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colour[name],
                        linestyle=kinds[kind][0])
            for kind, pts in roof.items():
                xs = sorted(pts)
                ax.plot(xs, [pts[x] for x in xs], color="black", linewidth=1, linestyle=kinds[kind][1])
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(model, fontsize=10)
            ax.set_xlabel("tokens per pass")
            ax.set_ylabel("tokens/s")
            ax.grid(True, which="both", alpha=0.3)
        for ax in list(axes.flat)[len(models):]:
            ax.axis("off")
        # One legend for every panel, below them: colour = implementation, line style = batch.
        ordered = sorted(kinds.items(), key=lambda item: item[0] != "batch 1")
        handles = [Line2D([], [], color=c, marker="o", label=name) for name, c in colour.items()]
        handles += [Line2D([], [], color="grey", linestyle=styles[0], label=kind) for kind, styles in ordered]
        handles += [Line2D([], [], color="black", linewidth=1, linestyle=styles[1], label=f"roofline ({kind})")
                    for kind, styles in ordered]
        per_row = 5 * cols
        fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), per_row), fontsize=7, frameon=False)
        fig.suptitle(f"Scan throughput (bf16) vs roofline at the measured copy bandwidth\n"
                     f"{_stamp(results, chr(10))}", fontsize=9)
        legend_rows = -(-len(handles) // per_row)
        fig.tight_layout(rect=(0, 0.03 + 0.035 * legend_rows / nrows, 1, 1))
        fig.savefig(out / "scan_throughput.png", dpi=110)
        plt.close(fig)
    decode = _ok(results["decode"])
    if decode:
        fig, ax = plt.subplots(figsize=(9, 4.8))
        series = defaultdict(list)
        for r in decode:
            series[(r["model"], _series(r))].append((r["batch"], r["ms"] * 1e3))
        for (model, name), pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{model}: {name}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (one token per row)")
        ax.set_ylabel("step latency, us")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)  # beside the data
        ax.set_title(f"Decode step\n{_stamp(results, chr(10))}", fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "scan_decode.png", dpi=110)
        plt.close(fig)


def _pivot(rows, col, value, scale=1):
    """A text table: one row per (model, implementation), one column per value of `col`."""
    cells, columns = {}, []
    for r in rows:
        if r.get(value) is None:
            continue
        if r[col] not in columns:
            columns.append(r[col])
        cells.setdefault((r["model"], _series(r)), {})[r[col]] = fmt(r[value] * scale)
    if not cells:
        return ""
    columns.sort(key=lambda c: (isinstance(c, str), c))  # numbers, then labels ("8 grid" captures)
    return text_table(["model", "impl"] + [str(c) for c in columns],
                      [[m, i] + [v.get(c, "") for c in columns] for (m, i), v in cells.items()])


def scan_grid(rows: list, cell) -> tuple[list[str], list[list]]:
    """(header, rows) of a table: one row per (model, batch, seqlen), one column per
    implementation, each cell `cell(row)` (rows for which it returns None are left out)."""
    cells, columns = {}, []
    for r in rows:
        text = cell(r)
        if text is None:
            continue
        col = _series(r)
        if col not in columns:
            columns.append(col)
        cells.setdefault((r["model"], r["batch"], r["seqlen"]), {})[col] = text
    return (["model", "batch", "seqlen"] + columns,
            [[m, b, n] + [v.get(c, "") for c in columns] for (m, b, n), v in cells.items()])


def _scan_table(rows: list, value: str) -> str:
    """`value` per (model, batch, seqlen), one column per implementation (else the row's status)."""
    return text_table(*scan_grid(rows, lambda r: fmt(r[value]) if r.get(value) is not None else r.get("status", "-")))


def scan_short_table(results: dict) -> str:
    """Scan ms per (model, batch, seqlen), one column per implementation; then the headline
    figures of the other sections."""
    lines = [f"== bench.scan: {_stamp(results)}"]
    bw = results.get("copy_bandwidth")
    if bw:
        lines.append(f"copy bandwidth {fmt(bw['GBps'])} GB/s")
    lines += ["scan pass ms (a call, host included: do_bench):", _scan_table(results["scan"], "ms")]
    if any(r.get("gpu_ms") is not None for r in results["scan"]):
        lines += ["scan pass ms (its kernels alone: torch.profiler):", _scan_table(results["scan"], "gpu_ms")]
    for title, section, col, value in (
            ("two passes / one pass with an in-pass capture, by seqlen", "inpass_vs_split", "seqlen", "ratio"),
            ("k captures / none, by k", "captures", "captures", "vs_no_capture"),
            ("k captures / none, kernels alone, by k", "captures", "captures", "gpu_vs_no_capture"),
            ("decode step us, by batch", "decode", "batch", "ms")):
        table = _pivot(_ok(results.get(section, [])), col, value, 1e3 if value == "ms" else 1)
        if table:
            lines += [title + ":", table]
    cross = crossover_tokens(results.get("crossover", []))
    modelled = results.get("config", {}).get("auto_chunked_min_tokens_modelled")
    if {_alg(r) for r in _ok(results.get("crossover", []))} >= {"rec", "chunk"}:
        lines.append((f"chunked faster than recurrent from {cross} tokens" if cross
                      else "chunked not faster than recurrent at the lengths measured")
                     + (f" (algorithm='auto' switches at {modelled}, modelled)" if modelled else ""))
    grid = _ok(results.get("grid_split", []))
    if grid:
        lines.append("chunked split at a grid point, bit-identical to one pass: "
                     + ", ".join(f"{r['model']} {r['seqlen']}: {'yes' if r['bitwise'] else 'NO'}" for r in grid))
    if results.get("incomplete"):
        lines.append(f"INCOMPLETE: {results['incomplete']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# serve
# ---------------------------------------------------------------------------------------------
SIM_COLUMNS = ("tokens_computed", "ssm_replay_tokens", "passes", "extra_passes", "snapshots_stored", "hit_rate",
               "modeled_ms")


def _sim_rows(sim):
    return [[t["name"], policy, *(p[c] / 1000 if c == "modeled_ms" else p[c] for c in SIM_COLUMNS)]
            for t in sim["traces"] for policy, p in t["policies"].items()]


def _measured_rows(entry, cold, warm, scale):
    rows = []
    for policy, p in entry["policies"].items():
        if p.get("status") != "ok":
            rows.append([policy, None, None, None, None, None, p.get("note", p.get("status"))])
            continue
        rows.append([policy, p[cold] * scale, p[warm] * scale, p.get("warm_restore_point"),
                     p.get("warm_replayed", p.get("warm_replay_tokens")),
                     "yes" if p.get("bitwise_warm_equals_cold") else "NO", ""])
    return rows


MEASURED_HEADERS = ["policy", "cold ms", "warm ms", "warm restore", "warm replay", "warm bitwise", "note"]


def write_serve_report(results: dict, out: Path) -> None:
    lines = header_lines(results["env"], "Serving benchmarks")
    if results.get("incomplete"):
        lines.append(f"- **incomplete**: {results['incomplete']}")
    sim = results.get("simulator")
    if sim:
        cm = sim["cost_model"]
        lines += ["", "## Simulator: policies on the default traces (modelled, not measured)", "",
                  f"Rules {sim['rules']}; cost model {cm['per_token_ms']:.4f} ms/token + {cm['per_pass_ms']:g} ms/pass "
                  "(planner.simulate).", "",
                  markdown_table(["trace", "policy", "computed", "ssm replay", "passes", "extra passes", "stored",
                                  "hit rate", "modelled s"], _sim_rows(sim))]
    layer = results.get("layer_plans")
    if layer:
        lines += ["", "## One layer's plans (measured)", "", f"{layer['what']}.", "",
                  f"{layer['model']} ({layer['dims']}), {layer['backend']}, {layer['dtype']}; prompt "
                  f"{layer['prompt_tokens']} tokens, rules {layer['rules']}.", "",
                  markdown_table(MEASURED_HEADERS, _measured_rows(layer, "cold_ms", "warm_ms", 1))]
    model = results.get("hybrid_model")
    if model:
        lines += ["", "## Hybrid model (measured)", ""]
        if model.get("status") == "not available":
            lines.append(f"not available: {model['reason']}; would call {model['would_call']}")
        else:
            lines += [f"{model['what']}. Layers {', '.join(model['layers'])}; prompt {model['prompt_tokens']} "
                      f"tokens, rules {model['rules']}.", ""]
            if model.get("note"):
                lines.append(f"{model['note']}\n")
            lines.append(markdown_table(MEASURED_HEADERS, _measured_rows(model, "cold_s", "warm_s", 1e3)))
    if pyplot() is None:
        lines.append("\n- PNG plots not written: matplotlib is not installed")
    (out / "serve.md").write_text("\n".join(lines) + "\n")
    _plot_serve(results, out)


def _plot_serve(results, out):
    plt = pyplot()
    if plt is None:
        return
    sim = results.get("simulator")
    if sim:
        traces = sim["traces"]
        policies = list(traces[0]["policies"]) if traces else []
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        width = 0.8 / max(1, len(policies))
        for ax, key, label, scale in ((axes[0], "ssm_replay_tokens", "SSM replay tokens (KV cached, state not)", 1),
                                      (axes[1], "modeled_ms", "modelled prefill time, s", 1e-3)):
            for i, policy in enumerate(policies):
                xs = [j + (i - (len(policies) - 1) / 2) * width for j in range(len(traces))]
                bars = ax.bar(xs, [t["policies"][policy][key] * scale for t in traces], width, label=policy)
                ax.bar_label(bars, fmt="%.0f", fontsize=5, rotation=90, padding=2)
            ax.set_xticks(range(len(traces)), [t["name"] for t in traces])
            ax.set_ylabel(label)
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"Planner simulator per policy (modelled, not measured)\n{_stamp(results, chr(10))}", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "serve_policies.png", dpi=110)
        plt.close(fig)
    panels = [(results.get("layer_plans"), "cold_ms", "warm_ms", 1, "one layer's scan, ms"),
              (results.get("hybrid_model"), "cold_s", "warm_s", 1e3, "hybrid model, ms")]
    panels = [p for p in panels if p[0] and any(v.get("status") == "ok" for v in p[0].get("policies", {}).values())]
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
        for ax, (entry, cold, warm, scale, label) in zip(axes.flat, panels):
            names = [p for p, v in entry["policies"].items() if v.get("status") == "ok"]
            xs = range(len(names))
            ax.bar([x - 0.2 for x in xs], [entry["policies"][p][cold] * scale for p in names], 0.4, label="cold")
            ax.bar([x + 0.2 for x in xs], [entry["policies"][p][warm] * scale for p in names], 0.4, label="warm")
            ax.set_xticks(list(xs), names)
            ax.set_yscale("log")
            ax.set_ylabel(label)
            ax.set_title(f"{entry['prompt_tokens']}-token prompt", fontsize=9)
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"Measured cold and warm prefill per policy\n{_stamp(results, chr(10))}", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "serve_measured.png", dpi=110)
        plt.close(fig)


def serve_short_table(results: dict) -> str:
    lines = [f"== bench.serve: {_stamp(results)}"]
    sim = results.get("simulator")
    if sim:
        lines += ["simulator (modelled): ssm replay tokens / modelled s",
                  text_table(["trace"] + list(sim["traces"][0]["policies"]),
                             [[t["name"]] + [f"{p['ssm_replay_tokens']} / {p['modeled_ms'] / 1000:.1f}"
                                             for p in t["policies"].values()] for t in sim["traces"]])]
    for key, cold, warm, scale, title in (("layer_plans", "cold_ms", "warm_ms", 1, "one layer's plans (measured)"),
                                          ("hybrid_model", "cold_s", "warm_s", 1e3, "hybrid model (measured)")):
        entry = results.get(key)
        if not entry:
            continue
        if entry.get("status") == "not available":
            lines.append(f"{title}: not available ({entry['reason']})")
            continue
        lines += [f"{title}, {entry['prompt_tokens']}-token prompt:",
                  text_table(MEASURED_HEADERS[:-1], [r[:-1] for r in _measured_rows(entry, cold, warm, scale)])]
    if results.get("incomplete"):
        lines.append(f"INCOMPLETE: {results['incomplete']}")
    return "\n".join(lines)
