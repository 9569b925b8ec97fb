"""Triton's interpreter without its repeated patching, for kernels that call @jit helpers.

Under TRITON_INTERPRET=1 a launch patches triton.language to the interpreter's semantics once
(GridExecutor), and then every call of a @jit helper patches it again (InterpretedFunction.__call__),
walking the language modules' members each time: some 2 ms a call, most of an interpreted scan's
time where helpers are called per token (fma_chain, _update). Inside a launch the language is
already patched, so a helper's call skips the patching when its modules are among those the launch
(or an earlier helper in it) patched; outside a launch, and for a module not yet patched, Triton's
own patching runs as before. The patches are the same attributes set to the same values, so what
a kernel computes does not change.
"""
from __future__ import annotations

import inspect
import threading

import triton.language as tl
from triton.runtime import interpreter


class _Launch(threading.local):
    """Per thread: the language modules the running launch has patched, or None between launches."""

    patched: frozenset | None = None


_launch = _Launch()
_languages: dict = {}


def _language_modules(fn) -> frozenset:
    """The language modules visible from `fn`'s globals, as Triton's patching finds them."""
    found = _languages.get(fn)
    if found is None:
        found = _languages[fn] = frozenset(
            id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is tl.core))
    return found


def install() -> None:
    """Wrap Triton's interpreter (once; a Triton without these internals is left as it is)."""
    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or executor is None or getattr(patch_lang, "_patches_once", False):
        return
    launch_call = executor.__call__

    def _patch_lang(fn):
        modules = _language_modules(fn)
        patched = _launch.patched
        if patched is not None and modules <= patched:
            return None  # a helper's call inside a launch, which ignores the scope returned
        scope = patch_lang(fn)
        if patched is not None:
            _launch.patched = patched | modules
        return scope

    def __call__(self, *args, **kwargs):
        outer = _launch.patched
        _launch.patched = frozenset()
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            _launch.patched = outer

    _patch_lang._patches_once = True
    interpreter._patch_lang = _patch_lang
    executor.__call__ = __call__
