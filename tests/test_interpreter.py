"""ssm_kernels._interpreter: inside a launch, a @jit helper's call does not patch triton.language
again, and what the kernel computes is what Triton's own interpreter computes."""
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

import ssm_kernels._triton as kt
from ssm_kernels import _interpreter

pytestmark = pytest.mark.skipif(not kt.RUNS_ON_CPU, reason="the kernels are compiled, not interpreted")


@triton.jit
def _twice_plus_one(v):
    return v * 2.0 + 1.0


@triton.jit
def _helper_loop_kernel(x_ptr, y_ptr, CALLS: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    v = tl.load(x_ptr + o)
    for _ in range(CALLS):
        v = _twice_plus_one(v)
    tl.store(y_ptr + o, v)


def run(calls):
    x = torch.arange(8, dtype=torch.float32)
    y = torch.empty_like(x)
    _helper_loop_kernel[(1,)](x, y, calls, 8)
    return x, y


@pytest.fixture
def patches(monkeypatch):
    """How many times Triton's patching walked the language's members (it does several a patching)."""
    count = [0]
    walk = interpreter._patch_builtin

    def counted(*args, **kwargs):
        count[0] += 1
        return walk(*args, **kwargs)

    monkeypatch.setattr(interpreter, "_patch_builtin", counted)
    return count


def test_a_helper_called_in_a_launch_does_not_patch_again(patches):
    run(0)
    once = patches[0]
    assert once > 0
    patches[0] = 0
    run(10)
    assert patches[0] == once, "ten helper calls patched the language again"


def test_results_are_the_interpreters_own():
    x, y = run(3)
    want = x.clone()
    for _ in range(3):
        want = want * 2.0 + 1.0
    assert torch.equal(y, want)


def test_a_helper_called_outside_a_launch_still_patches(patches):
    installed = interpreter._patch_lang
    _interpreter.install()
    assert interpreter._patch_lang is installed, "a second install wrapped the wrapper"
    scope = interpreter._patch_lang(_twice_plus_one.fn)
    scope.restore()
    assert patches[0] > 0
