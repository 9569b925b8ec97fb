"""What a call's kernels do, counted by running them through the Triton interpreter on a sample
of their programs at reduced sizes: bytes loaded and stored (masked-off elements excluded), dot
FLOPs, transcendental evaluations (exp, log, ... : the MUFU work) and how many times each source
line ran, per chain of call sites (a helper called from two places counts apart for each, as the
SASS inlines it twice).

Run in a subprocess with TRITON_INTERPRET=1 (`count(requests)` starts it; `python -m
bench.counts` is its entry point, JSON in and out). Every launch of the call is intercepted
(bench.launches.intercepting_interpreted) and, instead of running its whole grid, runs the
programs at the two ends of each grid axis longer than two (all of a shorter axis), and weighs
each by the number of programs it stands for. The two ends give the exact mean of anything that
varies linearly along an axis (a causal block loop, a ragged last chunk weighs as it should only
when it is one of two). Totals are for the whole grid.

A call is counted at two reduced sizes (tokens of a prefill, or a decode batch) and every total is
extrapolated linearly to the real size: per-program work of these kernels is constant or linear
in the size (a loop over tokens or chunks), and grids grow linearly with it. The counting sizes
are multiples of the chunk size (256) so that chunk and tile grids are full at both sizes, as at
the real ones. `extrapolate` checks that the two sizes launched the same kernels in the same order.
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from collections import Counter

TRANSCENDENTALS = ("create_exp", "create_exp2", "create_log", "create_log2", "create_sqrt", "create_rsqrt",
                   "create_precise_sqrt", "create_sin", "create_cos", "create_erf", "create_fdiv",
                   "create_precise_divf")


def sample_axis(n: int) -> list[int]:
    """Program indices sampled along an axis of n: both ends (all of n <= 2)."""
    return list(range(n)) if n <= 2 else [0, n - 1]


class _Counter:
    """Accumulates one launch's counts while its sampled programs run."""

    def __init__(self, ranges):
        self.weight = 1.0
        self.totals = Counter()
        self.lines = Counter()
        self.ranges = ranges  # (first byte, end) of each tensor argument's storage, distinct
        self.per_storage = Counter()

    def add(self, key, amount):
        self.totals[key] += amount * self.weight

    def add_access(self, kind, ptrs, mask, elem_bytes):
        """Bytes of a masked load/store, in total and per storage (by the address it starts at).
        An address that several elements of one access share (a tile broadcast over some of its
        axes) counts once: the warps' lanes ask for it in the same instruction."""
        import numpy as np
        active = np.unique(np.asarray(ptrs.data)[np.broadcast_to(mask.data, np.shape(ptrs.data))])
        amount = int(np.size(active)) * elem_bytes
        if not amount:
            return
        self.add(f"bytes_{kind}", amount)
        first = int(np.min(active))
        storage = next((r for r in self.ranges if r[0] <= first < r[1]), None)
        self.per_storage[storage, kind] += amount * self.weight

    def unique_bytes(self) -> float:
        """Bytes each storage must move at least: what was loaded from it, at most its size, and
        what was stored to it, at most its size (an access outside every argument's storage counts
        in full)."""
        return float(sum(amount if r is None else min(amount, r[1] - r[0])
                         for (r, _), amount in self.per_storage.items()))


def _install_counting(counter: _Counter):
    """Wrap the interpreter builder's memory, dot and transcendental ops so that they add to
    `counter`, and count the lines the kernels' (rewritten) code runs; returns a function that
    undoes it."""
    import numpy as np
    from triton.runtime import interpreter

    from .sass import source_key

    builder = interpreter.interpreter_builder
    originals = {}

    def wrap(name, count):
        original = getattr(builder, name)
        originals[name] = original

        def counted(*args, **kwargs):
            count(*args, **kwargs)
            return original(*args, **kwargs)

        setattr(builder, name, counted)

    def elem_bytes(ptrs):
        return ptrs.get_element_ty().primitive_bitwidth // 8

    wrap("create_masked_load", lambda ptrs, mask, *a, **k: counter.add_access(
        "loaded", ptrs, mask, elem_bytes(ptrs)))
    wrap("create_masked_store", lambda ptrs, value, mask, *a, **k: counter.add_access(
        "stored", ptrs, mask, elem_bytes(ptrs)))
    wrap("create_atomic_rmw", lambda op, ptrs, val, mask, *a, **k: counter.add(
        "bytes_atomic", 2 * int(np.count_nonzero(mask.data)) * elem_bytes(ptrs)))

    def dot(a, b, d, *args, **kwargs):
        m, k_ = a.data.shape[-2:]
        n = b.data.shape[-1]
        batch = int(np.prod(a.data.shape[:-2])) if a.data.ndim > 2 else 1
        counter.add("dot_flops", 2 * m * n * k_ * batch)

    wrap("create_dot", dot)
    for name in TRANSCENDENTALS:
        if hasattr(builder, name):
            wrap(name, lambda arg, *a, **k: counter.add("transcendentals", int(np.size(arg.data))))

    rewritten = interpreter.InterpretedFunction.rewritten_fn  # filled as kernels and helpers are first called
    kernel_code, known = set(), [0]

    def where(frame) -> str:
        """'file:line<caller file:line<...' over the kernel frames (bench.sass.Instr.where)."""
        keys = []
        while frame is not None:
            if frame.f_code in kernel_code:
                keys.append(source_key(frame.f_code.co_filename, frame.f_lineno))
            frame = frame.f_back
        return "<".join(keys)

    def tracer(frame, event, arg):
        if frame.f_code not in kernel_code:
            if len(rewritten) == known[0]:
                return None
            kernel_code.update(f.__code__ for f in rewritten.values())
            known[0] = len(rewritten)
            if frame.f_code not in kernel_code:
                return None

        def on_line(frame, event, arg):
            if event == "line":
                counter.lines[where(frame)] += counter.weight
            return on_line

        return on_line

    sys.settrace(tracer)

    def undo():
        sys.settrace(None)
        for name, original in originals.items():
            setattr(builder, name, original)

    return undo


def _run_sampled(fn, args, kwargs, grid) -> dict:
    """Run the sampled programs of one launch of InterpretedFunction `fn`; return its counts."""
    from triton.runtime import interpreter

    executor = interpreter.GridExecutor(fn.rewrite(), fn.arg_names, grid)
    argspec = inspect.getfullargspec(executor.fn)
    kwargs = {k: v for k, v in kwargs.items() if k in argspec.args or k in argspec.kwonlyargs}
    args_hst, kwargs_hst = executor._init_args_hst(args, kwargs)
    storages = {(t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
                for t in list(args_hst) + list(kwargs_hst.values()) if hasattr(t, "untyped_storage")}
    counter = _Counter(sorted(storages))
    scope = interpreter._patch_lang(executor.fn)
    try:
        call_args = inspect.getcallargs(executor.fn, *args_hst, **kwargs_hst)
        call_args = {name: arg if name in executor.constexprs else interpreter._implicit_cvt(arg)
                     for name, arg in call_args.items()}
        grid = grid(call_args) if callable(grid) else grid
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        interpreter.interpreter_builder.set_grid_dim(*grid)
        samples = [sample_axis(n) for n in grid]
        counter.weight = 1.0
        for n, s in zip(grid, samples):
            counter.weight *= n / len(s) if s else 0.0
        undo = _install_counting(counter)
        try:
            for x in samples[0]:
                for y in samples[1]:
                    for z in samples[2]:
                        interpreter.interpreter_builder.set_grid_idx(x, y, z)
                        executor.fn(**call_args)
        finally:
            undo()
    finally:
        scope.restore()
    executor._restore_args_dev(args, args_hst, kwargs, kwargs_hst)
    return {"kernel": fn.fn.__name__, "grid": list(grid), "sampled": [len(s) for s in samples],
            **{k: float(v) for k, v in counter.totals.items()}, "bytes_unique": counter.unique_bytes(),
            "lines": dict(counter.lines)}


def count_here(workload: str, shape, size: int, peer: bool) -> list[dict]:
    """Counts of every launch of one workload call at one size (in this process, which must run
    the interpreter)."""
    import numpy as np

    from .launches import intercepting_interpreted
    from .static_workloads import run_call

    counted = []

    def handler(fn, args, kwargs, grid, site, config, n_configs):
        counted.append({**_run_sampled(fn, args, kwargs, grid), "site": site, "config": config,
                        "n_configs": n_configs})

    with np.errstate(all="ignore"), intercepting_interpreted(handler):
        run_call(workload, shape, size, peer=peer, fill="zeros")
    return counted


def count(requests: list[dict]) -> list[dict[int, list[dict]]]:
    """For each request {workload, shape (a shape record), sizes, peer}: {size: counts of each
    launch}, counted in one interpreter subprocess."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "bench.counts"], input=json.dumps(requests), capture_output=True,
                          text=True, env=env, cwd=root)
    if proc.returncode:
        raise RuntimeError(f"counting failed:\n{proc.stderr[-3000:]}")
    return [{int(k): v for k, v in result.items()} for result in json.loads(proc.stdout.splitlines()[-1])]


def extrapolate(by_size: dict[int, list[dict]], size: int) -> list[dict]:
    """Each launch's totals at `size`, linear in the size through the two counted ones (or the
    counted one itself when `size` was counted)."""
    if size in by_size:
        return by_size[size]
    (s1, c1), (s2, c2) = sorted(by_size.items())[:2]
    names1, names2 = [c["kernel"] for c in c1], [c["kernel"] for c in c2]
    if names1 != names2:
        raise ValueError(f"sizes {s1} and {s2} launch different kernels ({names1} vs {names2}): "
                         "cannot extrapolate")
    t = (size - s1) / (s2 - s1)
    out = []
    for a, b in zip(c1, c2):
        numbers = {k: a.get(k, 0.0) + (b.get(k, 0.0) - a.get(k, 0.0)) * t
                   for k in set(a) | set(b) if isinstance(a.get(k, b.get(k)), float)}
        lines = {k: a["lines"].get(k, 0.0) + (b["lines"].get(k, 0.0) - a["lines"].get(k, 0.0)) * t
                 for k in set(a["lines"]) | set(b["lines"])}
        out.append({**a, **numbers, "lines": lines, "grid": None, "sampled": None})
    return out


def main() -> int:
    from .static_workloads import shape_from_record

    results = []
    for r in json.loads(sys.stdin.read()):
        shape = shape_from_record(r["shape"])
        results.append({size: count_here(r["workload"], shape, size, r["peer"]) for size in r["sizes"]})
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
