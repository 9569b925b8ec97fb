"""A call's modelled time from its recorded launches and their counts: each launch compiled and
read back, modelled, an autotuned site's best modelled config chosen, the call's time the sum of
its chosen launches. Every figure is modelled, not measured.

    launches = []
    with recording(launches):
        my_call(...)                                # launches.recording
    counts = extrapolate(count(...)[0], size)      # counts.count at two sizes, or counts.counting
    result = model_call(launches, counts, size, per_token=True)
"""
from __future__ import annotations

import hashlib
import linecache
import os
from pathlib import Path

from . import model, sass
from .launches import compile_launch

MAX_SHARED_PER_BLOCK = 227 * 1024  # larger configs fail to launch (an autotuner skips them)


def hot_loop(entry_loops: list[model.LoopReport]) -> model.LoopReport | None:
    """The loop with the most issue slots over the call (iterations x slots per iteration); a loop
    that was not counted comes first, so that the report shows it."""
    if not entry_loops:
        return None
    uncounted = [lp for lp in entry_loops if lp.iterations_per_program is None]
    if uncounted:
        return max(uncounted, key=lambda lp: lp.instructions)
    return max(entry_loops, key=lambda lp: lp.iterations_per_program * lp.issue_slots_per_iteration)


def enclosing_for(where: str) -> str | None:
    """The nearest `for` statement above a source line ('package/file.py:line') and less
    indented than it, as '`for ...` (file:line)', or None."""
    path, line = sass.local_source(where)
    text = linecache.getline(path, line)
    indent = len(text) - len(text.lstrip())
    for n in range(line, max(line - 200, 0), -1):
        above = linecache.getline(path, n)
        stripped = above.strip()
        if stripped.startswith("for ") and (n == line or len(above) - len(above.lstrip()) < indent):
            return f"`{stripped}` ({os.path.basename(path)}:{n})"
        if stripped.startswith(("def ", "@triton.jit")):
            return None
    return None


def describe_loop(loop: model.LoopReport | None, size: int, per_token: bool) -> str:
    """What the hot loop iterates over: iterations per program (per token when `size` is the
    pass's tokens, per_token, and the loop runs about that often) and the `for` statement its
    most frequent source line sits in."""
    if loop is None:
        return "no loop"
    n = loop.iterations_per_program
    if n is None:
        return f"NOT COUNTED (no source line of its SASS was counted): {', '.join(loop.lines[:2])}"
    what = f"{n:.4g} iterations/program"
    if per_token and abs(n - size) <= 0.02 * size:
        what += " (one per token)"
    statement = next((s for s in map(enclosing_for, loop.lines) if s), None)
    where = statement or ", ".join(os.path.basename(w) for w in loop.lines[:2])
    return f"{what}: {where}"


def storage_summary(storages: dict) -> dict:
    """{storage: its bytes loaded, stored, atomic (those not 0) and its size}: where a launch's
    re-reads come from."""
    return {name: {k: v for k, v in s.items() if v} for name, s in sorted(storages.items())}


def model_launches(launches, launch_counts, size: int, per_token: bool, mixed=frozenset()) -> list[dict]:
    """One entry per launch: its code, its model, and whether it is its site's chosen config; a
    config that is not chosen keeps its time and bound only (the JSON stays small). mixed: names
    of kernels whose programs are of several kinds (model's module doc)."""
    entries = []
    for launch, counted in zip(launches, launch_counts):
        code = sass.read(compile_launch(launch))
        fits = code.shared <= MAX_SHARED_PER_BLOCK
        km = model.model_kernel(code, launch.grid, launch.num_warps, code.mma_form, counted,
                                mixed=launch.kernel in mixed)
        loop = hot_loop(km.loops)
        hot = next((lp for lp in code.loops if loop and lp.start == loop.start), None)
        entries.append({
            "kernel": launch.kernel, "label": launch.label(), "site": launch.site, "config": launch.config,
            "n_configs": launch.n_configs, "fits": fits, "grid": list(launch.grid), "num_warps": launch.num_warps,
            "num_stages": launch.num_stages, "registers": code.registers, "ptxas_registers": code.ptxas_registers,
            "spill_bytes": max(code.spill_stores, code.spill_loads), "shared_bytes": code.shared,
            "mma": code.mma_form, "constexprs": {k: repr(v) for k, v in launch.constexprs.items()},
            "mix": sass.mix(code.instrs),
            "hot_loop": None if loop is None else {
                "instructions": loop.instructions, "iterations_per_program": loop.iterations_per_program,
                "cycles_per_iteration": loop.cycles_per_iteration, "mix": sass.mix(hot.instrs),
                "what": describe_loop(loop, size, per_token)},
            "storages": storage_summary(counted.get("storages", {})),
            "model": {**km.record(), "loops": [{k: v for k, v in vars(lp).items() if k != "lines"}
                                               for lp in km.loops]},
        })
    for site in {e["site"] for e in entries}:
        group = [e for e in entries if e["site"] == site]
        candidates = [e for e in group if e["fits"]] or group
        best = min(candidates, key=lambda e: e["model"]["time_ms"])
        for e in group:
            e["chosen"] = e is best
    brief = ("kernel", "label", "site", "config", "n_configs", "fits", "chosen", "num_warps", "num_stages")
    return [e if e["chosen"] else {**{k: e[k] for k in brief},
                                   "model": {k: e["model"][k] for k in ("time_ms", "bound")}} for e in entries]


def model_call(launches, launch_counts, size: int, per_token: bool, what: str = "the call",
               mixed=frozenset()) -> dict:
    """{"kernels": model_launches' entries, "time_ms": the chosen launches' sum, "kernels_launched"}
    of one call from its recorded launches and its counts (one per launch, in the same order:
    the counted and the recorded launches must be the same kernels and configs)."""
    seen = [(c["kernel"], c["config"]) for c in launch_counts]
    recorded = [(launch.kernel, launch.config) for launch in launches]
    if seen != recorded:
        raise RuntimeError(f"{what}: the counted launches {seen} differ from the recorded ones {recorded}")
    entries = model_launches(launches, launch_counts, size, per_token, mixed)
    chosen = [e for e in entries if e["chosen"]]
    return {"kernels": entries, "time_ms": sum(e["model"]["time_ms"] for e in chosen), "kernels_launched": len(chosen)}


def model_version() -> str:
    """A digest of the code that turns kernels into modelled times (counts, SASS reading, model):
    figures of two runs are comparable only when it is the same."""
    here = Path(__file__).resolve().parent
    text = "".join((here / name).read_text() for name in ("counts.py", "sass.py", "model.py"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def gpu_model() -> dict:
    """The model's GPU constants, for a report's header."""
    return {"sms": model.SMS, "schedulers_per_sm": model.SCHEDULERS_PER_SM, "clock_hz": model.CLOCK_HZ,
            "hbm_bytes_per_s": model.HBM_BYTES_PER_S, "l2_bytes_per_s": model.L2_BYTES_PER_S,
            "l2_reuse_bytes": model.L2_REUSE_BYTES, "tensor_flops": model.TENSOR_FLOPS,
            "latency_cycles": model.LATENCY, "pipe_slots": model.PIPE_SLOTS}
