"""What every benchmark shares: timing, the environment record, time budgets, result writers, and
the chunked Mamba-2 pass under another launch configuration (`configured`).

Timing: on CUDA, ``triton.testing.do_bench`` with ``return_mode="median"`` (it flushes L2 between
runs; its rep grows to five times one call for slow functions, capped); on CPU, the median of a
few wall-clock runs. The method is recorded with every figure.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from unittest import mock

import torch
import triton
import triton.testing

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent
CPU_LABEL = "CPU (reduced mode: small shapes, PyTorch path and Triton interpreter; not GPU numbers)"


class Terminated(BaseException):
    """SIGTERM arrived (e.g. from `timeout`): stop measuring and write what was measured.
    A BaseException, so that no `except Exception` on the way (ours, or a library's that wraps
    errors) swallows it."""


def install_sigterm_handler() -> None:
    def handler(signum, frame):
        raise Terminated(f"terminated by signal {signum}")
    signal.signal(signal.SIGTERM, handler)


def ignore_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


# ---------------------------------------------------------------------------------------------
# Device and environment
# ---------------------------------------------------------------------------------------------
def bench_device() -> torch.device:
    """CUDA when present. On CPU, torch gets one thread: the reduced runs share small machines
    (CI, two cores) with other work, and a multi-threaded op on an oversubscribed CPU times
    its spin-waits, not itself."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    torch.set_num_threads(1)
    return torch.device("cpu")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_label(device: torch.device) -> str:
    """The label every output carries: the GPU's name, or CPU_LABEL."""
    if device.type == "cuda":
        return f"GPU: {torch.cuda.get_device_name(device)}"
    return CPU_LABEL


def functions_at(commit: str, module, names: tuple[str, ...], **missing) -> dict:
    """The module-level functions `names` of `module`'s source as at `commit` (from git), defined
    over the module's present namespace plus `missing` (names they used then that it no longer
    has): an A/B's "before" side, in one process with the present code."""
    path = Path(module.__file__).resolve().relative_to(REPO_ROOT)
    source = subprocess.run(["git", "show", f"{commit}:{path}"], capture_output=True, text=True, check=True,
                            cwd=REPO_ROOT).stdout
    space = {**vars(module), **missing}
    for name in names:
        start = source.index(f"def {name}(")
        end = source.find("\n\n\n", start)
        exec(source[start:end if end > 0 else len(source)], space)
    return {name: space[name] for name in names}


def git_commit() -> dict:
    """The commit the tree is at (BENCH_COMMIT overrides, for copies without .git) and whether the
    tree differs from it (untracked files included, bench/results excluded). Read-only git calls;
    None where git or .git is absent."""
    commit, dirty = os.environ.get("BENCH_COMMIT") or None, None
    if commit is None:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                    text=True, timeout=10).stdout.strip() or None
            if commit:
                # untracked files count (new code may not be committed yet); results do not
                status = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain", "--",
                                         ".", ":(exclude)bench/results"], cwd=REPO_ROOT,
                                        capture_output=True, text=True, timeout=10)
                dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            commit = None
    return {"commit": commit, "dirty": dirty}


def environment(device: torch.device, *, reduced: bool, quick: bool) -> dict:
    env = {
        "label": device_label(device),
        "device_type": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "reduced": reduced,
        "quick": quick,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        **git_commit(),
    }
    env["timing"] = ("triton.testing.do_bench, median" if device.type == "cuda"
                     else "wall-clock median (time.perf_counter)")
    return env


# ---------------------------------------------------------------------------------------------
# Time budget and timing
# ---------------------------------------------------------------------------------------------
class Budget:
    """A soft deadline: measurements check it before they start, never in the middle."""

    def __init__(self, seconds: float | None):
        self.start = time.monotonic()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return math.inf if self.seconds is None else self.seconds - self.elapsed()

    def expired(self) -> bool:
        return self.left() <= 0


@dataclass
class Timing:
    ms: float
    samples: int
    method: str
    gpu_ms: float | None = None  # the call's kernels alone (the sum of gpu_kernels); CUDA only
    host_ms: float | None = None  # the host's part of a call (host_ms); CUDA only
    gpu_kernels: dict[str, float] | None = None  # ms a call per kernel or copy name (kernel_times); CUDA only
    wall_s: float | None = None  # seconds the measurement took, the first call (compile, autotune) included


@dataclass
class TimingOptions:
    """do_bench warmup/rep (ms) on CUDA; runs on CPU (warm-up call first unless single_cpu_run)."""

    warmup_ms: float = 10.0
    rep_ms: float = 50.0
    max_rep_ms: float = 1000.0
    cpu_runs: int = 3


def time_fn(fn: Callable[[], object], device: torch.device, opts: TimingOptions,
            *, single_cpu_run: bool = False) -> tuple[Timing, object]:
    """Time `fn`; return (Timing, what the first call returned). The first call compiles and
    autotunes (CUDA) and is never part of the figure, except in a single CPU run."""
    began = time.perf_counter()
    if device.type == "cuda":
        result = fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        estimate = max(start.elapsed_time(end), 1e-3)
        rep = min(max(opts.rep_ms, 5 * estimate), opts.max_rep_ms)
        warmup = min(opts.warmup_ms, rep)
        ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
        samples = max(1, int(rep / estimate))
        kernels = kernel_times(fn)
        return Timing(float(ms), samples, f"do_bench median (warmup {warmup:g} ms, rep {rep:.0f} ms)",
                      sum(kernels.values()), host_ms(fn), kernels, time.perf_counter() - began), result
    if single_cpu_run:
        t0 = time.perf_counter()
        result = fn()
        return Timing((time.perf_counter() - t0) * 1e3, 1, "wall clock, single run (no warm-up)",
                      wall_s=time.perf_counter() - began), result
    result = fn()
    times = []
    for _ in range(opts.cpu_runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return Timing(statistics.median(times), len(times), f"wall-clock median of {len(times)} runs",
                  wall_s=time.perf_counter() - began), result


KERNEL_TIME_RUNS = 10


def host_ms(fn: Callable[[], object], runs: int = KERNEL_TIME_RUNS) -> float:
    """Host time of one call of `fn` (argument checks, planning, launches; kernels run
    asynchronously): the median wall time of `runs` calls, each started on an idle GPU and not
    waiting for it. A call that waits for the GPU itself (a copy to the host) counts that wait."""
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def kernel_times(fn: Callable[[], object], runs: int = KERNEL_TIME_RUNS) -> dict[str, float]:
    """GPU time of one call of `fn` per kernel (or copy) name, host gaps excluded: the durations
    torch.profiler records, averaged over `runs` calls (warm: after time_fn's first call). Their
    sum is the call's kernel time; do_bench's figure also counts the GPU waiting for the host
    between launches, which for passes of a few hundred microseconds can be most of it. Per
    kernel, they are what a calibration of the static model needs stage by stage."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    return per_name_ms([e for e in prof.events() if e.device_type == DeviceType.CUDA], runs)


def per_name_ms(events, runs: int) -> dict[str, float]:
    """{name: ms a run} of profiler events (each with .name and .time_range), most time first."""
    total: dict[str, float] = {}
    for e in events:
        total[e.name] = total.get(e.name, 0.0) + e.time_range.elapsed_us() / runs / 1e3
    return dict(sorted(total.items(), key=lambda kv: -kv[1]))


def copy_bandwidth(device: torch.device, opts: TimingOptions) -> dict:
    """Device-to-device copy bandwidth: bytes read + written per second by `dst.copy_(src)` of
    1 GiB on a GPU (32 MiB on the CPU)."""
    nbytes = (1 << 30) if device.type == "cuda" else (32 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    timing, _ = time_fn(lambda: dst.copy_(src), device, opts)
    moved = 2 * nbytes
    src = dst = None  # free the buffers before the caller allocates again
    return {"buffer_bytes": nbytes, "bytes_moved": moved, "ms": timing.ms,
            "GBps": moved / (timing.ms * 1e6), "method": timing.method,
            "what": "dst.copy_(src) on one device; bytes read + written"}


def release_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Command line and output folder
# ---------------------------------------------------------------------------------------------
def time_budget(text: str) -> float:
    """argparse type of --time-budget: finite seconds > 0 (nan would never expire)."""
    seconds = float(text)
    if not 0 < seconds < math.inf:
        raise argparse.ArgumentTypeError(f"a time budget is seconds > 0, got {text}")
    return seconds


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reduced", action="store_true",
                        help="small shapes (forced on CPU, where the PyTorch path and the Triton "
                             "interpreter run)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: bench/results/<date>-<gpu|cpu>)")
    parser.add_argument("--quick", action="store_true", help="fewer shapes and shorter timing")
    parser.add_argument("--time-budget", type=time_budget, default=None, metavar="SECONDS",
                        help="soft limit: measurements not started by then are recorded as skipped")


def output_dir(args, device: torch.device) -> Path:
    """--out, or bench/results/<UTC date>-gpu, -gpu-reduced or -cpu-reduced."""
    if args.out is not None:
        out = args.out
    else:
        date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
        kind = "gpu" if device.type == "cuda" else "cpu"
        reduced = args.reduced or device.type != "cuda"
        out = RESULTS_DIR / f"{date}-{kind}{'-reduced' if reduced else ''}"
    out.mkdir(parents=True, exist_ok=True)
    return out


# ---------------------------------------------------------------------------------------------
# Writers
# ---------------------------------------------------------------------------------------------
def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def save_results(out: Path, name: str, data: dict, text: str) -> None:
    """A benchmark's results in `out` (made if need be): name.json (data), name.md (text, also printed)."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"{name}.json", data)
    (out / f"{name}.md").write_text(text)
    print(text)


def fmt(value) -> str:
    """A figure for a table: 3 significant digits (whole numbers below a million), '-' for missing."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 1000:
            return f"{value:.3g}" if abs(value) >= 1e6 else f"{value:.0f}"
        return f"{value:.3g}"
    return str(value)


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(headers: list[str], rows: list[list]) -> str:
    cells = [headers] + [[fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def header_lines(env: dict, title: str) -> list[str]:
    """The first lines of every Markdown report: what, where, when, which commit."""
    commit = env.get("commit") or "unknown"
    if env.get("dirty"):
        commit += " (with uncommitted changes)"
    return [
        f"# {title}: {env['label']}", "",
        f"- device: {env['device_name']}; torch {env['torch']}, triton {env['triton']}, "
        f"CUDA {env['cuda'] or '-'}, Python {env['python']}",
        f"- date: {env['date']}; commit: {commit}",
        f"- timing: {env['timing']}; reduced: {env['reduced']}; quick: {env['quick']}",
    ]


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def run_benchmark(argv, *, prog: str, doc: str, make_bench, write_report, short_table, add_args=None,
                  check_args=None) -> int:
    """The `main` of a benchmark module: parse the common flags (and the module's own, added by
    `add_args(parser)`; `check_args(parser, args)` refuses what they cannot take together), run
    `make_bench(args, device)`,
    and whatever happens (a SIGTERM from the suite's timeout included) save what was measured,
    write the report and print the short table. Exit status 1 when stopped early."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    add_common_args(parser)
    if add_args is not None:
        add_args(parser)
    args = parser.parse_args(argv)
    if check_args is not None:
        check_args(parser, args)
    install_sigterm_handler()
    device = bench_device()
    began = time.monotonic()
    bench = make_bench(args, device)
    print(f"{prog.split()[-1]}: {bench.env['label']} -> {bench.out}", file=sys.stderr)
    status = 0
    try:
        bench.run()
        bench.results["incomplete"] = None
    except (Terminated, KeyboardInterrupt) as exc:
        bench.results["incomplete"] = f"stopped early: {exc or type(exc).__name__}"
        status = 1
    finally:
        ignore_sigterm()  # let the results be written (the suite's timeout kills 15 s later)
        bench.results["elapsed_s"] = time.monotonic() - began
        bench.save()
        write_report(bench.results, bench.out)
    print(short_table(bench.results))
    return status


def merged(base: dict, changes: dict) -> dict:
    """launch_config's dict `base` with `changes`: a dict value merges into the stage's own options
    (None removes a key), any other value replaces base's."""
    cfg = dict(base)
    for key, value in changes.items():
        if key not in base:
            raise KeyError(f"launch_config has no {key!r}")
        cfg[key] = ({k: v for k, v in {**base[key], **value}.items() if v is not None}
                    if isinstance(value, dict) else value)
    return cfg


@contextlib.contextmanager
def configured(changes: dict):
    """Within, every chunked Mamba-2 pass runs launch_config's configuration with `changes`. The
    recent passes' recorded launches are dropped on the way in and out (tables.recent_pass): a
    replay would launch the configuration it was recorded with."""
    from ssm_kernels.scan.mamba2_chunked import tables, triton_kernel
    base = triton_kernel.launch_config
    tables._recent_tables.cache_clear()
    try:
        with mock.patch.object(triton_kernel, "launch_config", lambda *args: merged(base(*args), changes)):
            yield
    finally:
        tables._recent_tables.cache_clear()
