"""What a call's kernels do, counted by running them through the Triton interpreter: bytes
loaded, stored and updated atomically (masked-off elements excluded), per storage and in total,
dot FLOPs, transcendental evaluations (exp, log, ... : the MUFU work), how many times each source
line ran and in how many programs, per chain of call sites (a helper called from two places
counts apart for each, as the SASS inlines it twice).

Bytes: an access counts the distinct addresses its unmasked elements ask for times their size (an
address that several elements of one load share, a tile broadcast over some axes, counts once:
the lanes ask for it in the same instruction); each access counts, so a tile re-read per program
counts per program. Per storage (each tensor argument's underlying storage, named by the
arguments that point into it, the first three: "state_ptr/out_ptr") the counts show the re-reads: a storage
needs at most its size loaded and its size stored from HBM (triton_static.model.traffic).

`counting(sample=...)` counts the launches of whatever runs inside it, in this process (which
must have defined the kernels under TRITON_INTERPRET=1). With sample=False every program runs;
with sample=True each launch runs only the programs at the two ends of each grid axis longer
than two (all of a shorter axis, and all of an axis the caller names in `unalike_axes`, whose
programs differ in kind), each weighed by the number of programs it stands for: the two ends
give the exact mean of anything that varies linearly along an axis (a causal block loop; a
ragged last chunk weighs as it should only when it is one of two).
`count(requests, runner)` counts calls in an interpreter subprocess (`python -m
triton_static.counts`, JSON in and out): `runner` ("module:function", importable from the
working folder) is called as runner(request, size) for each request and size. Totals are for
the whole grid.

A caller that models a real size from reduced ones counts a call at two sizes and extrapolates
every total linearly (`extrapolate`), storage sizes included: valid where per-program work is
constant or linear in the size (a loop over tokens or chunks) and grids and tensors grow linearly
with it; counting sizes should fill the kernels' tiles and chunks as the real size does.
`extrapolate` checks that the two sizes launched the same kernels in the same order.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import json
import os
import subprocess
import sys
from collections import Counter, defaultdict

TRANSCENDENTALS = ("create_exp", "create_exp2", "create_log", "create_log2", "create_sqrt", "create_rsqrt",
                   "create_precise_sqrt", "create_sin", "create_cos", "create_erf", "create_fdiv",
                   "create_precise_divf")
OUTSIDE = "(no argument)"  # accesses outside every tensor argument's storage (none expected)
CACHE_LINE = 128  # bytes: programs share data when they touch a common line



def sample_axis(n: int) -> list[int]:
    """Program indices sampled along an axis of n: both ends (all of n <= 2)."""
    return list(range(n)) if n <= 2 else [0, n - 1]


class _Counter:
    """Accumulates one launch's counts while its programs run."""

    def __init__(self, storages: dict[tuple[int, int], str], grid: tuple[int, int, int]):
        self.weight = 1.0
        self.totals = Counter()
        self.lines = Counter()
        self.reached = Counter()  # per line: the programs that ran it at least once
        self.seen = set()  # the lines the running program has run
        self.storages = storages  # (first byte, end) of each argument's storage -> its name
        self.per_storage = defaultdict(Counter)
        self.grid = grid
        self.ends = [set(sample_axis(n)) for n in grid]
        self.program = None  # the running program's (x, y, z) while it is one at the ends of every axis
        self.touched = defaultdict(list)  # (program, storage) -> arrays of the cache lines it touched

    def run_program(self, x: int, y: int, z: int):
        self.seen = set()
        at_ends = x in self.ends[0] and y in self.ends[1] and z in self.ends[2]
        self.program = (x, y, z) if at_ends else None

    def add(self, key, amount):
        self.totals[key] += amount * self.weight

    def add_access(self, kind: str, ptrs, mask, elem_bytes: int, factor: int = 1):
        """Bytes of a masked access (module doc), in total and per storage (by the address it
        starts at); an atomic read-modify-write counts its bytes twice (factor 2)."""
        import numpy as np
        active = np.unique(np.asarray(ptrs.data)[np.broadcast_to(mask.data, np.shape(ptrs.data))])
        amount = int(np.size(active)) * elem_bytes * factor
        if not amount:
            return
        self.add(f"bytes_{kind}", amount)
        first = int(np.min(active))
        start, name = next(((lo, n) for (lo, hi), n in self.storages.items() if lo <= first < hi), (0, OUTSIDE))
        self.per_storage[name][kind] += amount * self.weight
        if self.program is not None:
            # Lines from the storage's start: a CUDA allocation is aligned to at least 256 bytes,
            # a CPU one here may be to 64 only, which would make lines (and sharing) vary by run.
            self.touched[self.program, name].append(np.unique((active - start) // CACHE_LINE))

    def reuse_stride(self, name: str) -> int | None:
        """How far apart, in launch order (x fastest, then y, then z), programs that read common
        data of a storage are: the stride of the fastest grid axis along which two programs at
        its two ends (the other coordinates equal) touch a common cache line; None when no axis
        shares (data re-read inside a program, or by neighbours only)."""
        import numpy as np
        lines = {prog: np.unique(np.concatenate(arrays)) for (prog, n), arrays in self.touched.items() if n == name}
        for axis in range(3):
            last = self.grid[axis] - 1
            for prog, mine in lines.items():
                if prog[axis] != 0 or last == 0:
                    continue
                other = lines.get(prog[:axis] + (last,) + prog[axis + 1:])
                if other is not None and np.intersect1d(mine, other, assume_unique=True).size:
                    return int(np.prod(self.grid[:axis]))
        return None

    def storage_counts(self) -> dict[str, dict[str, float]]:
        """{storage name: {"loaded", "stored", "atomic": bytes, "size": its bytes, "reuse_stride":
        programs (absent when None)}}."""
        sizes = {name: hi - lo for (lo, hi), name in self.storages.items()}
        out = {}
        for name, c in self.per_storage.items():
            stride = self.reuse_stride(name)
            out[name] = {"loaded": float(c["loaded"]), "stored": float(c["stored"]), "atomic": float(c["atomic"]),
                         **({"size": float(sizes[name])} if name in sizes else {}),
                         **({"reuse_stride": float(stride)} if stride is not None else {})}
        return out


@functools.lru_cache(maxsize=None)
def statement_spans(path: str) -> dict[int, tuple[int, int]]:
    """Each line of a source file -> the lines of the statement it belongs to (of a compound
    statement, its header: the statements of its body are their own)."""
    try:
        tree = ast.parse(open(path).read())
    except (OSError, SyntaxError):
        return {}
    spans = {}
    for node in ast.walk(tree):  # outer statements first: an inner one takes its own lines
        if isinstance(node, ast.stmt):
            body = getattr(node, "body", None)
            end = body[0].lineno - 1 if isinstance(body, list) and body else node.end_lineno
            span = (node.lineno, max(node.lineno, end))
            spans.update({line: span for line in range(span[0], span[1] + 1)})
    return spans


def _install_counting(counter: _Counter, lines: bool):
    """Wrap the interpreter builder's memory, dot and transcendental ops so that they add to
    `counter`, and (lines) count the lines the kernels' (rewritten) code runs, which takes most
    of the time; returns a function that undoes it."""
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
    wrap("create_atomic_rmw", lambda op, ptrs, val, mask, *a, **k: counter.add_access(
        "atomic", ptrs, mask, elem_bytes(ptrs), factor=2))

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
        """'file:line<caller file:line<...' over the kernel frames (sass.Instr.where)."""
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

        # Python reports a line again when a statement spread over several lines comes back to
        # it (after a call on the next line, say): a line counts once per run of its statement.
        statement = {"span": None, "lines": set()}

        def on_line(frame, event, arg):
            if event == "line":
                span = statement_spans(frame.f_code.co_filename).get(frame.f_lineno)
                if span is None or span != statement["span"]:
                    statement["span"], statement["lines"] = span, set()
                elif frame.f_lineno in statement["lines"]:
                    return on_line
                statement["lines"].add(frame.f_lineno)
                key = where(frame)
                counter.lines[key] += counter.weight
                if key not in counter.seen:
                    counter.seen.add(key)
                    counter.reached[key] += counter.weight
            return on_line

        return on_line

    if lines:
        sys.settrace(tracer)

    def undo():
        sys.settrace(None)
        for name, original in originals.items():
            setattr(builder, name, original)

    return undo


def _run_counted(fn, args, kwargs, grid, sample: bool, lines: bool, unalike: tuple[int, ...]) -> dict:
    """Run one launch of InterpretedFunction `fn` (its sampled programs, or all); its counts."""
    from triton.runtime import interpreter

    executor = interpreter.GridExecutor(fn.rewrite(), fn.arg_names, grid)
    argspec = inspect.getfullargspec(executor.fn)
    kwargs = {k: v for k, v in kwargs.items() if k in argspec.args or k in argspec.kwonlyargs}
    args_hst, kwargs_hst = executor._init_args_hst(args, kwargs)
    scope = interpreter._patch_lang(executor.fn)
    try:
        call_args = inspect.getcallargs(executor.fn, *args_hst, **kwargs_hst)
        storages = {}
        for name, arg in call_args.items():
            if hasattr(arg, "untyped_storage"):
                storage = arg.untyped_storage()
                storages.setdefault((storage.data_ptr(), storage.data_ptr() + storage.nbytes()), []).append(name)
        call_args = {name: arg if name in executor.constexprs else interpreter._implicit_cvt(arg)
                     for name, arg in call_args.items()}
        grid = grid(call_args) if callable(grid) else grid
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        counter = _Counter({bounds: "/".join(names[:3] + ["..."] * (len(names) > 3))
                            for bounds, names in storages.items()}, grid)
        interpreter.interpreter_builder.set_grid_dim(*grid)
        samples = [sample_axis(n) if sample and axis not in unalike else list(range(n))
                   for axis, n in enumerate(grid)]
        for n, s in zip(grid, samples):
            counter.weight *= n / len(s) if s else 0.0
        undo = _install_counting(counter, lines)
        try:
            for x in samples[0]:
                for y in samples[1]:
                    for z in samples[2]:
                        interpreter.interpreter_builder.set_grid_idx(x, y, z)
                        counter.run_program(x, y, z)
                        executor.fn(**call_args)
        finally:
            undo()
    finally:
        scope.restore()
    executor._restore_args_dev(args, args_hst, kwargs, kwargs_hst)
    totals = {k: float(counter.totals[k]) for k in ("bytes_loaded", "bytes_stored", "bytes_atomic", "dot_flops",
                                                    "transcendentals")}
    return {"kernel": fn.fn.__name__, "grid": list(grid), "sampled": [len(s) for s in samples], **totals,
            "storages": counter.storage_counts(), "lines": dict(counter.lines),
            "reached": dict(counter.reached)}


@contextlib.contextmanager
def counting(sample: bool = True, lines: bool = True, unalike_axes: dict[str, tuple[int, ...]] | None = None):
    """Inside, every Triton kernel launch runs through the interpreter with its work counted (all
    its programs, or with sample=True those at the ends of each grid axis, weighed, but every
    program along the axes unalike_axes names for the kernel: {kernel name: axes}), and its
    counts are appended to the list this yields: {"kernel", "grid", "sampled", "bytes_loaded",
    "bytes_stored", "bytes_atomic", "dot_flops", "transcendentals", "storages", "lines" and
    "reached" (per source line: its runs, and the programs that ran it; empty unless lines=True),
    "site", "config", "n_configs"}. An autotuned kernel runs once per config.
    The kernels must have been defined under TRITON_INTERPRET=1."""
    import numpy as np
    from triton import knobs

    from .launches import intercepting_interpreted

    if not knobs.runtime.interpret:
        raise RuntimeError("counting runs kernels through the Triton interpreter: set TRITON_INTERPRET=1 before "
                           "the kernels are imported")
    counted = []

    def handler(fn, args, kwargs, grid, site, config, n_configs):
        unalike = (unalike_axes or {}).get(fn.fn.__name__, ())
        counted.append({**_run_counted(fn, args, kwargs, grid, sample, lines, unalike), "site": site,
                        "config": config, "n_configs": n_configs})

    with np.errstate(all="ignore"), intercepting_interpreted(handler):
        yield counted


def total(launches: list[dict], key: str) -> float:
    """The sum of one count over launches ("bytes_loaded", "dot_flops", ...)."""
    return sum(launch.get(key, 0.0) for launch in launches)


def count(requests: list[dict], runner: str, unalike_axes: dict | None = None, cwd=None) -> list[dict[int, list[dict]]]:
    """For each request {"sizes": [...], ...}: {size: counts of each launch (sampled)}, counted in
    one interpreter subprocess that calls `runner` ("module:function") as runner(request, size);
    `cwd`: where the subprocess runs (the runner's module must import from there)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # before the subprocess defines any kernel
    job = {"runner": runner, "unalike_axes": unalike_axes or {}, "requests": requests}
    proc = subprocess.run([sys.executable, "-m", "triton_static.counts"], input=json.dumps(job), capture_output=True,
                          text=True, cwd=cwd, env=env)
    if proc.returncode:
        raise RuntimeError(f"counting failed:\n{proc.stderr[-3000:]}")
    return [{int(k): v for k, v in result.items()} for result in json.loads(proc.stdout.splitlines()[-1])]


def _lerp(a, b, t: float):
    """a + (b - a) t over numbers and (nested) dicts of numbers; a key missing on one side is 0,
    but a storage's reuse stride missing on either side stays missing (no sharing seen)."""
    if isinstance(a, dict) or isinstance(b, dict):
        a, b = a or {}, b or {}
        keys = (set(a) | set(b)) - ({"reuse_stride"} - (set(a) & set(b)))
        return {k: _lerp(a.get(k), b.get(k), t) for k in keys}
    a, b = a or 0.0, b or 0.0
    return a + (b - a) * t


def extrapolate(by_size: dict[int, list[dict]], size: int) -> list[dict]:
    """Each launch's counts at `size`, linear in the size through the two counted ones (or the
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
        scaled = {k: _lerp(a.get(k), b.get(k), t) for k in set(a) | set(b)
                  if isinstance(a.get(k, b.get(k)), (float, dict))}
        out.append({**a, **scaled, "grid": None, "sampled": None})
    return out


def main() -> int:
    import importlib

    job = json.loads(sys.stdin.read())
    module, _, name = job["runner"].partition(":")
    runner = getattr(importlib.import_module(module), name)
    unalike = {k: tuple(v) for k, v in job["unalike_axes"].items()}
    results = []
    for request in job["requests"]:
        by_size = {}
        for size in request["sizes"]:
            with counting(sample=True, unalike_axes=unalike) as counted:
                runner(request, size)
            by_size[size] = counted
        results.append(by_size)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
