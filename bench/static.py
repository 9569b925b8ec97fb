"""The static cost report: python -m bench.static [--quick] [--workload NAME] [--shape NAME] ...

Without a GPU. For every public call at the standard shapes (bench.static_workloads), and for
its peer in mamba_ssm when that is installed:

1. the call runs once on untouched CPU tensors with every kernel launch recorded instead of run,
   and each launch is compiled for sm_90a exactly as a real launch specialises it
   (triton_static.launches); an autotuned kernel is compiled once per config;
2. each binary is read back (triton_static.sass): registers, spills, shared memory, MMA form,
   SASS loops;
3. the call's kernels are counted by the Triton interpreter on a sample of their programs at two
   reduced sizes, extrapolated to the real size (triton_static.counts);
4. each launch gets a modelled time (triton_static.model); an autotuned site takes its best
   modelled config; the call's time is the sum over its launches (triton_static.calls).

This module is the client: the workloads are bench.static_workloads, the files bench.static_report.

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
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import triton  # noqa: E402
from triton_static import counts as counting  # noqa: E402
from triton_static.calls import gpu_model, model_call, model_version  # noqa: E402
from triton_static.launches import TARGET, recording  # noqa: E402
from triton_static.model import HBM_BYTES_PER_S  # noqa: E402

from .common import REPO_ROOT, git_commit, install_sigterm_handler  # noqa: E402
from .static_report import LABEL, markdown, merge, rounded, summary_lines  # noqa: E402
from .static_workloads import (DECODE_BATCHES, LAYER_FORMS, MIXED_KERNELS, PREFILL_TOKENS, SHAPES,  # noqa: E402
                               UNALIKE_AXES, WORKLOADS, count_sizes, layer_arg, mamba_ssm_ops,
                               model_selective_scan_fn, parse_layer, run_call, shape_record, shapes_for,
                               triton_path_on_cpu)
from .workloads import decode_bytes, pass_bytes  # noqa: E402


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
        with triton_path_on_cpu(), recording(launches):
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
            results = counting.count([r for _, r in todo], "bench.static_workloads:count_call", UNALIKE_AXES,
                                     cwd=REPO_ROOT)
            for (key, request), result in zip(todo, results):
                self.count_cache[key] = result
                if request["peer"]:
                    stored = peer_counts_file(request)
                    stored.parent.mkdir(parents=True, exist_ok=True)
                    stored.write_text(json.dumps(result))

    def call(self, w, shape, size: int, peer: bool) -> dict:
        key = (w.name, shape.name, peer, tuple(count_sizes(w, peer)))
        launch_counts = counting.extrapolate(self.count_cache[key], size)
        launches = self.record(w.name, shape, size, peer)
        return model_call(launches, launch_counts, size, per_token=w.kind == "prefill",
                          what=f"{w.name} at {shape.name}", mixed=MIXED_KERNELS)


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
        if not matches(w.name, args.workload, WORKLOADS) or (w.ablation and not args.workload):
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
        m = model_selective_scan_fn(size, shape.dim, shape.dstate, shape.ngroups)
        return {"available": True, "name": "mamba_ssm selective_scan_fn", **m}
    if report.peer_ops is None:
        return {"available": False, "reason": f"mamba_ssm: {report.peer_how}"}
    ref = f"{w.peer} | {shape.name} | {size}"
    if ref not in peer_calls:
        peer_calls[ref] = report.call(w, shape, size, peer=True)
    result = peer_calls[ref]
    return {"available": True, "name": f"mamba_ssm {w.peer}", "how": report.peer_how, "ref": ref,
            "time_ms": result["time_ms"], "kernels_launched": result["kernels_launched"]}


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
            "roofline_ms": must / HBM_BYTES_PER_S * 1e3, **ours, "peer": peer,
            "ratio_to_peer": ours["time_ms"] / peer["time_ms"] if peer.get("available") else None,
            "commit": commit.get("commit"), "dirty": commit.get("dirty"),
        })
        print(f"  {w.name} | {shape.name} | {size}: {ours['time_ms']:.4g} ms (modelled)", file=sys.stderr, flush=True)
    return {
        "label": LABEL, "date": datetime.date.today().isoformat(), "commit": commit,
        "model_version": model_version(), "triton": triton.__version__, "target": f"{TARGET.backend} sm_{TARGET.arch}a",
        "gpu_model": gpu_model(),
        "peers": {"mamba_ssm": report.peer_how}, "seconds": round(time.time() - started, 1),
        "argv": sys.argv[1:], "calls": calls, "peer_calls": peer_calls,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.static", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="one shape (Mamba-2 2.7B, and Mamba-1 2.8B for Mamba-1 calls), 8192 tokens, batch 64")
    parser.add_argument("--workload", action="append", help="only this call, or the calls whose name contains "
                        "this (repeatable): "
                        + "; ".join(WORKLOADS))
    parser.add_argument("--shape", action="append", help="only this shape, or the shapes whose name contains this "
                        "(repeatable): "
                        + "; ".join(SHAPES))
    parser.add_argument("--layer", action="append", type=layer_arg,
                        help=f"a custom layer instead of the standard shapes (repeatable): {LAYER_FORMS}")
    parser.add_argument("--tokens", type=int, action="append",
                        help="prefill tokens (repeatable; multiples of 256 from 2048 on)")
    parser.add_argument("--batch", type=int, action="append", help="decode batch (repeatable)")
    parser.add_argument("--no-peers", action="store_true", help="leave the peers out")
    parser.add_argument("--out", type=Path, help="results folder (default bench/results/<date>-static)")
    parser.add_argument("--update", action="store_true",
                        help="replace the selected calls in the report already in --out and keep its others "
                             "(refused when another version of the model wrote it)")
    args = parser.parse_args(argv)
    install_sigterm_handler()  # a `kill` unwinds: subprocess.run then ends the counting subprocess too
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
