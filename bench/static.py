"""The static cost report: python -m bench.static [--quick] [--workload NAME] [--shape NAME] ...

Without a GPU. For every public call at the standard shapes (bench.static_workloads), and for
its peer in mamba_ssm when that is installed:

1. the call runs once on untouched CPU tensors with every kernel launch recorded instead of run,
   and each launch is compiled for sm_90a exactly as a real launch specialises it
   (bench.launches); an autotuned kernel is compiled once per config;
2. each binary is read back (bench.sass): registers, spills, shared memory, MMA form, SASS loops;
3. the call's kernels are counted by the Triton interpreter on a sample of their programs at two
   reduced sizes, extrapolated to the real size (bench.counts);
4. each launch gets a modelled time (bench.model); an autotuned site takes its best modelled
   config; the call's time is the sum over its launches.

Results: bench/results/<date>-static/static.json (every figure) and static.md (a table per call),
each labelled "static model, not measured"; a summary is printed last. See bench/README.md.
"""
from __future__ import annotations

from . import use_triton_interpreter

use_triton_interpreter(False)  # the kernels are compiled (never launched); before they are imported

import argparse  # noqa: E402
import datetime  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import linecache  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import triton  # noqa: E402

from . import counts as counting  # noqa: E402
from . import model, sass  # noqa: E402
from .common import git_commit  # noqa: E402
from .launches import TARGET, compile_launch, recording  # noqa: E402
from .static_report import LABEL, markdown, merge, rounded, summary_lines  # noqa: E402
from .static_workloads import (DECODE_BATCHES, PREFILL_TOKENS, SHAPES, WORKLOADS, count_sizes,  # noqa: E402
                               mamba_ssm_ops, parse_layer, run_call, shape_record, shapes_for)
from .workloads import decode_bytes, pass_bytes  # noqa: E402

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


def describe_loop(loop: model.LoopReport | None, size: int, kind: str) -> str:
    """What the hot loop iterates over: iterations per program (per token when that is the pass
    length) and the `for` statement its most frequent source line sits in."""
    if loop is None:
        return "no loop"
    n = loop.iterations_per_program
    if n is None:
        return f"NOT COUNTED (no source line of its SASS was counted): {', '.join(loop.lines[:2])}"
    what = f"{n:.4g} iterations/program"
    if kind == "prefill" and abs(n - size) <= 0.02 * size:
        what += " (one per token)"
    statement = next((s for s in map(enclosing_for, loop.lines) if s), None)
    where = statement or ", ".join(os.path.basename(w) for w in loop.lines[:2])
    return f"{what}: {where}"


def storage_summary(storages: dict) -> dict:
    """{storage: its bytes loaded, stored, atomic (those not 0) and its size}: where a launch's
    re-reads come from."""
    return {name: {k: v for k, v in s.items() if v} for name, s in sorted(storages.items())}


def model_launches(launches, launch_counts, size: int, kind: str) -> list[dict]:
    """One entry per launch: its code, its model, and whether it is its site's chosen config; a
    config that is not chosen keeps its time and bound only (the JSON stays small)."""
    entries = []
    for launch, counted in zip(launches, launch_counts):
        code = sass.read(compile_launch(launch))
        fits = code.shared <= MAX_SHARED_PER_BLOCK
        km = model.model_kernel(code, launch.grid, launch.num_warps, code.mma_form, counted)
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
                "what": describe_loop(loop, size, kind)},
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


def must_move_bytes(workload, shape, size: int) -> int:
    """The bytes the call must move at least: bench.workloads' roofline formula for the scans;
    for the conv, x read and the output written once, the weights and bias read, and the conv
    states written (prefill) or read and written (decode, one state per row), all bf16 but the
    fp32 weights."""
    from .static_workloads import CONV_WIDTH, conv_dim
    if workload.name.startswith("causal_conv1d"):
        states = (1 if workload.kind == "prefill" else 2 * size) * (CONV_WIDTH - 1) * 2
        return conv_dim(shape) * (size * 2 * 2 + states + CONV_WIDTH * 4 + 4)
    if workload.kind == "decode":
        return decode_bytes(shape, size, 2)
    return pass_bytes(shape, size, 1, 2, ncapture=workload.captures)


PEER_COUNTS_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ssm-prefill-bench" / "static-counts"


def peer_counts_file(request: dict) -> Path:
    from importlib.metadata import version
    try:
        peer_version = version("mamba-ssm")
    except Exception:  # noqa: BLE001 - not installed: nothing is cached under it anyway
        peer_version = None
    key = json.dumps([request, peer_version, triton.__version__, Path(counting.__file__).read_text()], sort_keys=True)
    return PEER_COUNTS_DIR / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


class Report:
    def __init__(self, args):
        self.args = args
        self.peer_ops, self.peer_how = (None, "not asked (--no-peers)") if args.no_peers else mamba_ssm_ops()
        self.count_cache: dict = {}

    def record(self, workload: str, shape, size: int, peer: bool):
        launches = []
        with recording(launches):
            run_call(workload, shape, size, peer=peer)
        return launches

    def counts_for(self, jobs):
        """Count every (workload, shape, peer) needed, in one interpreter subprocess; a peer's
        counts are kept on disk (PEER_COUNTS_DIR) for the next run, keyed by the request, the
        peer's and triton's versions and this counting code."""
        todo = []
        for w, shape, size, peer in jobs:
            key = (w.name, shape.name, peer, tuple(count_sizes(w, peer)))
            if key in self.count_cache or key in [k for k, _ in todo]:
                continue
            request = {"workload": w.name, "shape": shape_record(shape), "sizes": list(key[3]), "peer": peer}
            stored = peer_counts_file(request)
            if peer and stored.exists():
                self.count_cache[key] = {int(k): v for k, v in json.loads(stored.read_text()).items()}
            else:
                todo.append((key, request))
        if todo:
            for (key, request), result in zip(todo, counting.count([r for _, r in todo])):
                self.count_cache[key] = result
                if request["peer"]:
                    stored = peer_counts_file(request)
                    stored.parent.mkdir(parents=True, exist_ok=True)
                    stored.write_text(json.dumps(result))

    def call(self, w, shape, size: int, peer: bool) -> dict:
        key = (w.name, shape.name, peer, tuple(count_sizes(w, peer)))
        launch_counts = counting.extrapolate(self.count_cache[key], size)
        launches = self.record(w.name, shape, size, peer)
        seen = [(c["kernel"], c["config"]) for c in launch_counts]
        recorded = [(launch.kernel, launch.config) for launch in launches]
        if seen != recorded:
            raise RuntimeError(f"{w.name} at {shape.name}: the counted launches {seen} differ from the "
                               f"recorded ones {recorded}")
        entries = model_launches(launches, launch_counts, size, w.kind)
        chosen = [e for e in entries if e["chosen"]]
        return {"kernels": entries, "time_ms": sum(e["model"]["time_ms"] for e in chosen),
                "kernels_launched": len(chosen)}


def matches(name: str, filters, names) -> bool:
    """Whether `name` is selected by the filters: a filter equal to one of `names` selects that
    one alone, any other selects the names that contain it (case-insensitive)."""
    if not filters:
        return True
    for f in filters:
        exact = [n for n in names if n.lower() == f.lower()]
        if (name in exact) if exact else f.lower() in name.lower():
            return True
    return False


def plan(args) -> list[tuple]:
    """(workload, shape, size) of every call the report models."""
    jobs = []
    layers = [parse_layer(text) for text in args.layer] if args.layer else list(SHAPES.values())
    for w in WORKLOADS.values():
        if not matches(w.name, args.workload, WORKLOADS):
            continue
        for shape in shapes_for(w, layers):
            if not matches(shape.name, args.shape, [s.name for s in layers]):
                continue
            sizes = (args.tokens or PREFILL_TOKENS) if w.kind == "prefill" else (args.batch or DECODE_BATCHES)
            jobs += [(w, shape, size) for size in sizes]
    return jobs


def peer_result(report: Report, w, shape, size: int, peer_calls: dict) -> dict:
    """The peer's figures for a call; a compiled peer's kernels go to peer_calls once per
    (peer, shape, size), under the key the result names ("ref")."""
    if w.peer is None:
        return {"available": False, "reason": "no peer modelled for this call"}
    if w.peer == "selective_scan_fn":
        m = model.model_selective_scan_fn(size, shape.dim, shape.dstate, shape.ngroups)
        return {"available": True, "name": "mamba_ssm selective_scan_fn", **m}
    if report.peer_ops is None:
        return {"available": False, "reason": f"mamba_ssm: {report.peer_how}"}
    ref = f"{w.peer} | {shape.name} | {size}"
    if ref not in peer_calls:
        peer_calls[ref] = report.call(w, shape, size, peer=True)
    result = peer_calls[ref]
    return {"available": True, "name": f"mamba_ssm {w.peer}", "how": report.peer_how, "ref": ref,
            "time_ms": result["time_ms"], "kernels_launched": result["kernels_launched"]}


def model_version() -> str:
    """A digest of the code that turns kernels into modelled times (counts, SASS reading, model):
    figures of two runs are comparable only when it is the same."""
    here = Path(__file__).resolve().parent
    text = "".join((here / name).read_text() for name in ("counts.py", "sass.py", "model.py"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def run(args) -> dict:
    started = time.time()
    commit = git_commit()
    jobs = plan(args)
    if not jobs:
        raise SystemExit("no call matches the filters")
    report = Report(args)
    needs_peer = [(w, s, n) for w, s, n in jobs if w.peer in ("mamba_chunk_scan_combined", "selective_state_update")
                  and report.peer_ops is not None]
    report.counts_for([(w, s, n, False) for w, s, n in jobs] + [(w, s, n, True) for w, s, n in needs_peer])
    calls, peer_calls = [], {}
    for w, shape, size in jobs:
        ours = report.call(w, shape, size, peer=False)
        peer = peer_result(report, w, shape, size, peer_calls)
        must = must_move_bytes(w, shape, size)
        calls.append({
            "workload": w.name, "doc": w.doc, "kind": w.kind, "shape": shape.name, "shape_dims": shape.describe(),
            "size": size, "size_unit": "tokens" if w.kind == "prefill" else "batch", "must_move_bytes": must,
            "roofline_ms": must / model.HBM_BYTES_PER_S * 1e3, **ours, "peer": peer,
            "ratio_to_peer": ours["time_ms"] / peer["time_ms"] if peer.get("available") else None,
            "commit": commit.get("commit"), "dirty": commit.get("dirty"),
        })
        print(f"  {w.name} | {shape.name} | {size}: {ours['time_ms']:.4g} ms (modelled)", file=sys.stderr, flush=True)
    return {
        "label": LABEL, "date": datetime.date.today().isoformat(), "commit": commit,
        "model_version": model_version(), "triton": triton.__version__, "target": f"{TARGET.backend} sm_{TARGET.arch}a",
        "gpu_model": {"sms": model.SMS, "schedulers_per_sm": model.SCHEDULERS_PER_SM, "clock_hz": model.CLOCK_HZ,
                      "hbm_bytes_per_s": model.HBM_BYTES_PER_S, "l2_bytes_per_s": model.L2_BYTES_PER_S,
                      "l2_reuse_bytes": model.L2_REUSE_BYTES, "tensor_flops": model.TENSOR_FLOPS,
                      "latency_cycles": model.LATENCY, "pipe_slots": model.PIPE_SLOTS},
        "peers": {"mamba_ssm": report.peer_how}, "seconds": round(time.time() - started, 1),
        "argv": sys.argv[1:], "calls": calls, "peer_calls": peer_calls,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="one shape (Mamba-2 2.7B, and Mamba-1 2.8B for Mamba-1 calls), 8192 tokens, batch 64")
    parser.add_argument("--workload", action="append", help="only this call, or the calls whose name contains "
                        "this (repeatable): "
                        + "; ".join(WORKLOADS))
    parser.add_argument("--shape", action="append", help="only this shape, or the shapes whose name contains this "
                        "(repeatable): "
                        + "; ".join(SHAPES))
    parser.add_argument("--layer", action="append", help="a custom layer instead of the standard shapes "
                        "(repeatable): mamba2:nheads=H,headdim=P,dstate=N,ngroups=G or mamba1:dim=D,dstate=N")
    parser.add_argument("--tokens", type=int, action="append",
                        help="prefill tokens (repeatable; multiples of 256 from 2048 on)")
    parser.add_argument("--batch", type=int, action="append", help="decode batch (repeatable)")
    parser.add_argument("--no-peers", action="store_true", help="leave the peers out")
    parser.add_argument("--out", type=Path, help="results folder (default bench/results/<date>-static)")
    parser.add_argument("--update", action="store_true",
                        help="replace the selected calls in the report already in --out and keep its others "
                             "(refused when another version of the model wrote it)")
    args = parser.parse_args(argv)
    if args.quick:
        args.shape = args.shape or ["2.7B", "2.8B"]
        args.tokens = args.tokens or [8192]
        args.batch = args.batch or [64]
    from .static_workloads import CHUNK, CHUNKED_COUNT_TOKENS
    if any(n < CHUNKED_COUNT_TOKENS[0] or n % CHUNK for n in args.tokens or ()):
        parser.error(f"--tokens must be multiples of {CHUNK} from {CHUNKED_COUNT_TOKENS[0]} on (chunked calls are "
                     f"counted at {CHUNKED_COUNT_TOKENS} tokens and extrapolated)")
    if any(n <= 0 for n in args.batch or ()):
        parser.error("--batch must be positive")
    out = args.out or Path("bench/results") / f"{datetime.date.today().isoformat()}-static"
    if args.update and not (out / "static.json").exists():
        parser.error(f"--update: no report at {out}/static.json")
    data = run(args)
    if args.update:
        data = merge(json.loads((out / "static.json").read_text()), data, order=[w for w in WORKLOADS],
                     shapes=list(SHAPES))
    out.mkdir(parents=True, exist_ok=True)
    (out / "static.json").write_text(json.dumps(rounded(data), separators=(",", ":"), default=str) + "\n")
    (out / "static.md").write_text(markdown(data))
    print("\n".join(summary_lines(data)))
    print(f"(written to {out}/static.json and static.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
