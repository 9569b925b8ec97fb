"""The kernel specialisations a run launches, and how long they take to compile for sm_90a.

A GPU compiles one binary per specialisation a run launches (the kernel, its constexprs, the
divisibility and alignment of its arguments, its launch options); compiling them can take most
of a short GPU session. Without a GPU:

    python -m triton_static.specs record OUT.pkl -- [pytest arguments]
        runs pytest (in this process: the kernels run through the interpreter, TRITON_INTERPRET=1
        before they are defined) and records each launch's kernel and what of its arguments a
        specialisation depends on (tensors: dtype and 16-byte alignment; the other values);
    python -m triton_static.specs compile OUT.pkl [--jobs N] [--json FILE]
        binds them as a GPU launch would (launches.bind, kernels compiled, not interpreted) and
        compiles each distinct specialisation for sm_90a, into a fresh Triton cache, in N
        processes; prints (or writes) how many and how long, per kernel, per test file that
        launched it, and per specialisation.

The compile time measured this way is this machine's for this Triton: an estimate of a GPU
machine's (other CPUs, and its own Triton).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import pickle
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor


def _describe(value):
    """What a launch argument contributes to its specialisation, in a form that pickles: a tensor
    its dtype and whether its data is 16-byte aligned; anything else itself."""
    import torch
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype).removeprefix("torch."), value.data_ptr() % 16 == 0)
    return value


def _rebuild(value):
    """A stand-in argument with the specialisation `_describe` recorded (a CPU tensor whose data is,
    or is not, 16-byte aligned)."""
    import torch
    if isinstance(value, tuple) and len(value) == 3 and value[0] == "tensor":
        base = torch.empty(64, dtype=getattr(torch, value[1]))
        return base if value[2] else base[1:]
    return value


@contextlib.contextmanager
def recording_specs(launches: dict):
    """Inside (under the interpreter), every launch adds {module, name, args, kwargs (described),
    files (the test files that launched it, under pytest)} to `launches` (keyed by all but files)
    and then runs as usual. The specialisation itself is bound later, in a process that compiles
    (binding needs JITFunctions)."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if not warmup:
            launch = {"module": self.fn.__module__, "name": self.fn.__name__, "jit_kwargs": dict(self.kwargs),
                      "args": [_describe(a) for a in args], "kwargs": {k: _describe(v) for k, v in kwargs.items()}}
            entry = launches.setdefault(repr(launch), {**launch, "files": set()})
            entry["files"].add(os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[0])
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield launches
    finally:
        InterpretedFunction.run = original


def record(out: str, pytest_args: list[str]) -> int:
    import pytest

    os.environ["TRITON_INTERPRET"] = "1"
    launches: dict = {}
    with recording_specs(launches):
        status = pytest.main(pytest_args)
    with open(out, "wb") as f:
        pickle.dump(list(launches.values()), f)
    print(f"{len(launches)} distinct launches recorded to {out} (pytest exit status {status})")
    return int(status)


def _jit_function(launch: dict):
    """The kernel as a JITFunction: the module's attribute of its name (a kernel defined by
    @triton.jit), or the plain function there wrapped as triton.jit wrapped it."""
    from triton.runtime.jit import JITFunction

    fn = getattr(importlib.import_module(launch["module"]), launch["name"])
    return fn if isinstance(fn, JITFunction) else JITFunction(fn, **launch.get("jit_kwargs", {}))


def specialisations(launches: list[dict]) -> list[dict]:
    """The distinct specialisations of recorded launches, bound as launches.bind binds them (in a
    process that does not interpret), each with the test files that launched it."""
    from .launches import bind

    found: dict = {}
    for launch in launches:
        fn = _jit_function(launch)
        _, options, signature, constexprs, attrs = bind(
            fn, [_rebuild(a) for a in launch["args"]], {k: _rebuild(v) for k, v in launch["kwargs"].items()})
        spec = {"module": launch["module"], "name": launch["name"], "jit_kwargs": launch.get("jit_kwargs", {}),
                "signature": dict(signature),
                "constexprs": dict(constexprs), "attrs": dict(attrs), "options": dict(options.__dict__)}
        key = repr([spec[k] for k in ("module", "name", "signature", "constexprs", "attrs")]
                   + [sorted(spec["options"].items(), key=repr)])
        found.setdefault(key, {**spec, "files": set()})["files"] |= launch["files"]
    return list(found.values())


def _compile(spec: dict) -> float:
    """Seconds to compile one specialisation for sm_90a (in a process that does not interpret)."""
    import triton
    from triton.compiler import ASTSource

    from .launches import TARGET

    fn = _jit_function(spec)
    began = time.perf_counter()
    triton.compile(ASTSource(fn, spec["signature"], spec["constexprs"], spec["attrs"]), target=TARGET,
                   options=spec["options"])
    return time.perf_counter() - began


def load_launches(path: str) -> list[dict]:
    """The launches that ``record`` wrote to ``path``; ValueError for a file it did not write."""
    with open(path, "rb") as f:
        try:
            launches = pickle.load(f)
        except Exception as e:  # unpickling a foreign file fails in many ways
            raise ValueError(f"{path} is not a recording of launches (written by record): {e!r}") from None
    if not (isinstance(launches, list) and all(isinstance(x, dict) and "module" in x for x in launches)):
        raise ValueError(f"{path} is not a recording of launches (written by record): it holds a "
                         f"{type(launches).__name__} that is not a list of launches")
    return launches


def compile_all(launches: list[dict], jobs: int) -> dict:
    os.environ["TRITON_INTERPRET"] = "0"  # before the kernels are defined: JITFunctions
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp())  # a cold cache: every one compiles
    specs = specialisations(launches)
    began = time.perf_counter()
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        seconds = list(pool.map(_compile, specs))
    wall = time.perf_counter() - began
    per_kernel: dict = {}
    per_file: dict = {}
    for spec, s in zip(specs, seconds):
        for group, key in [(per_kernel, spec["name"])] + [(per_file, f) for f in sorted(spec["files"])]:
            entry = group.setdefault(key, {"specialisations": 0, "compile_s": 0.0})
            entry["specialisations"] += 1
            entry["compile_s"] += s
    import triton
    return {"specialisations": len(specs), "jobs": jobs, "wall_s": wall, "compile_s": sum(seconds),
            "triton": triton.__version__, "cpus": os.cpu_count(), "per_kernel": per_kernel, "per_file": per_file,
            "specs": [{"kernel": spec["name"], "files": sorted(spec["files"]), "compile_s": s}
                      for spec, s in zip(specs, seconds)]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m triton_static.specs", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run pytest and record the specialisations it launches")
    rec.add_argument("out")
    rec.add_argument("pytest_args", nargs=argparse.REMAINDER)
    comp = sub.add_parser("compile", help="compile recorded specialisations for sm_90a, timed")
    comp.add_argument("specs")
    comp.add_argument("--jobs", type=int, default=1)
    comp.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)
    if args.command == "record":
        return record(args.out, [a for a in args.pytest_args if a != "--"])
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if not os.path.isfile(args.specs):
        parser.error(f"no such file: {args.specs}")
    try:
        launches = load_launches(args.specs)
    except ValueError as e:
        parser.error(str(e))
    result = compile_all(launches, args.jobs)
    text = json.dumps(result, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
