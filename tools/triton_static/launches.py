"""What a call launches: every Triton kernel launch of a Python call, recorded instead of run, and
compiled for a Hopper GPU (sm_90a) exactly as that launch would specialise it, on a machine
without one.

`JITFunction.run` (what `kernel[grid](...)` calls) is replaced while the call runs. The
replacement does what the real `run` does up to the launch: it binds the arguments with the
binder Triton generates for the kernel (`create_function_from_signature`), so each argument gets
the same specialisation as on a GPU (16-byte-aligned pointers and multiples of 16 marked
divisible, integer arguments equal to 1 turned into constants), packs them with the kernel's own
`_pack_args`, and records the launch; `compile_launch` then compiles the recorded
`ASTSource(fn, signature, constexprs, attrs)` for GPUTarget("cuda", 90, 32). Nothing is launched:
the call's outputs stay unwritten.

An `@triton.autotune` kernel is recorded once per config (each a separate `Launch` sharing one
`site`), so a model can pick among them; `@triton.heuristics` needs nothing special (it calls the
wrapped kernel's `run`). While recording, `torch.cuda.device(...)` is a no-op, since libraries
wrap their launches in it and CPU torch cannot enter it. A library whose public functions refuse
CPU tensors for their Triton path needs the caller to lift that around the call (the kernels are
never launched).

The same interception serves the counting run (triton_static.counts), which runs under the Triton
interpreter: there `InterpretedFunction.run` is the one replaced, by a handler of the caller's.
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Callable

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction, create_function_from_signature

TARGET = GPUTarget("cuda", 90, 32)
_BACKEND = make_backend(TARGET)
# Launch options the real `run` adds from the environment before binding (3.9 adds the last).
_RUN_KNOBS = (("instrumentation_mode", "compilation"), ("fpsan_homomorphic_casts", "compilation"))


@dataclass
class Launch:
    """One kernel launch of a call, bound as a real launch would bind it.

    kernel: the kernel's function name; grid: 3 ints; options: the backend options' dict
    (num_warps, num_stages, ...); constexprs: {argument name: value} of every compile-time
    constant (declared constexprs and arguments the binder specialised to constants);
    args: {argument name: description} of the runtime arguments (tensors: shape, strides,
    dtype, element size; scalars: value); site: launches from one autotuned call share it, and
    config/n_configs say which config this one is (None/1 without autotune).
    """

    kernel: str
    fn: JITFunction = field(repr=False)
    grid: tuple[int, int, int]
    options: dict
    constexprs: dict
    args: dict
    site: int
    config: int | None = None
    n_configs: int = 1
    source: ASTSource | None = field(default=None, repr=False)

    @property
    def programs(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def num_warps(self) -> int:
        return self.options["num_warps"]

    @property
    def num_stages(self) -> int:
        return self.options["num_stages"]

    def label(self) -> str:
        return self.kernel if self.config is None else f"{self.kernel}[config {self.config}]"


def describe(value):
    """A JSON-friendly description of a launch argument."""
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "stride": list(value.stride()), "dtype": str(value.dtype),
                "element_size": value.element_size()}
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return repr(value)


def _grid3(grid, bound_args) -> tuple[int, int, int]:
    grid = grid(bound_args) if callable(grid) else grid
    return tuple(int(g) for g in grid) + (1,) * (3 - len(grid))


class _Sites:
    """Which autotuned call site (and config) the launches being recorded come from."""

    def __init__(self):
        self.counter = itertools.count()
        self.current: tuple[int, int, int] | None = None  # (site, config, n_configs)

    def next_site(self) -> tuple[int, int | None, int]:
        if self.current is not None:
            return self.current
        return next(self.counter), None, 1


_binders: dict = {}


def bind(fn: JITFunction, args, kwargs):
    """(bound_args, options, signature, constexprs, attrs) exactly as JITFunction.run computes
    them before compiling: the generated binder, then the kernel's own _pack_args."""
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    for name, group in _RUN_KNOBS:
        if hasattr(getattr(knobs, group), name):
            kwargs[name] = getattr(getattr(knobs, group), name)
    binder = _binders.get(fn)
    if binder is None:
        binder = _binders[fn] = create_function_from_signature(fn.signature, fn.params, _BACKEND)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(_BACKEND, kwargs, bound_args, specialization, options)
    return bound_args, options, signature, constexprs, attrs


_compiled: dict = {}


def compile_launch(launch: Launch):
    """The launch's CompiledKernel for sm_90a (cached per specialisation), in a process that did
    not import Triton under TRITON_INTERPRET=1: there Triton's own @jit functions (tl.zeros,
    tl.sum, ...) are built for the interpreter, and a kernel that calls one cannot compile."""
    if not isinstance(triton.language.standard.sum, JITFunction):
        raise RuntimeError("compile_launch: this process imported Triton under TRITON_INTERPRET=1; compile "
                           "in one that did not (python -m triton_static.specs compile does)")
    src = launch.source
    key = (launch.fn, repr(src.signature), repr(sorted(src.constants.items(), key=repr)), repr(src.attrs),
           repr(sorted(launch.options.items())))
    if key not in _compiled:
        _compiled[key] = triton.compile(src, target=TARGET, options=launch.options)
    return _compiled[key]


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def _autotune_every_config(sites: _Sites):
    """Autotuner.run calls its kernel once per config (pruned as Triton prunes them), each call
    tagged with its config index; pre-hooks (which zero outputs on a GPU) are not run."""

    def run(self, *args, **kwargs):
        self.nargs = dict(zip(self.arg_names, args))
        configs = self.prune_configs(kwargs) if len(self.configs) > 1 else self.configs
        site = next(sites.counter)
        for i, config in enumerate(configs):
            sites.current = (site, i if len(configs) > 1 else None, len(configs))
            try:
                self.fn.run(*args, **kwargs, **config.all_kwargs())
            finally:
                sites.current = None
        self.nargs = None

    with _patched(Autotuner, "run", run):
        yield


def _no_cuda_device():
    """torch.cuda.device as a no-op: libraries enter it around their launches, and CPU torch
    cannot (nothing is launched)."""
    return _patched(torch.cuda, "device", lambda *a, **k: contextlib.nullcontext())


@contextlib.contextmanager
def recording(launches: list[Launch]):
    """Inside, every JIT kernel launch appends a Launch to `launches` instead of running."""
    sites = _Sites()

    def run(self, *args, grid, warmup, **kwargs):
        bound_args, options, signature, constexprs, attrs = bind(self, args, kwargs)
        site, config, n_configs = sites.next_site()
        names = [p.name for p in self.params]
        constants = {names[path[0]]: value for path, value in constexprs.items()}
        launches.append(Launch(
            kernel=self.fn.__name__, fn=self, grid=_grid3(grid, bound_args), options=dict(options.__dict__),
            constexprs=constants,
            args={k: describe(v) for k, v in bound_args.items() if k not in constants},
            site=site, config=config, n_configs=n_configs,
            source=ASTSource(self, signature, constexprs, attrs)))
        return None

    with _patched(JITFunction, "run", run), _autotune_every_config(sites), _no_cuda_device():
        yield


@contextlib.contextmanager
def intercepting_interpreted(handler: Callable):
    """Inside (under TRITON_INTERPRET=1), every kernel launch calls
    handler(fn, args, kwargs, grid, site, config, n_configs) instead of running."""
    from triton.runtime.interpreter import InterpretedFunction
    sites = _Sites()

    def run(self, *args, grid, warmup, **kwargs):
        if warmup:
            return None
        site, config, n_configs = sites.next_site()
        return handler(self, args, kwargs, grid, site, config, n_configs)

    with _patched(InterpretedFunction, "run", run), _autotune_every_config(sites), _no_cuda_device():
        yield
