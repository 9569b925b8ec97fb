"""Toy kernels for the tool's tests (no other package needed): a row sum, helpers with a branch (one
in a loop, one decided at compile time), whose source lines (by number: keep them) the tests use.

`row_sum_kernel` follows TRITON_INTERPRET as this module is imported (the counts' subprocess
interprets it); `jit_row_sum_kernel` is the same function as a JITFunction whatever the mode, so
that a process that interprets can record its launch.
"""
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

BLOCK = 64


def _row_sum(x_ptr, out_ptr, n, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + row * stride + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + row, tl.sum(acc, 0))


row_sum_kernel = triton.jit(_row_sum)
jit_row_sum_kernel = JITFunction(_row_sum)


def row_sum(x: torch.Tensor, kernel=row_sum_kernel) -> torch.Tensor:
    out = torch.empty(x.shape[0], dtype=torch.float32)
    kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), BLOCK=BLOCK)
    return out


def run(request: dict, size: int) -> None:
    """triton_static.counts' runner: a row sum of request["rows"] rows of `size` zeros."""
    row_sum(torch.zeros(request["rows"], size))


@triton.jit
def clamp_low(x, low):
    if low > 0:
        x = tl.maximum(x, low)
        x = x + 0
        x = x * 1
        x = x - 0
        x = x + 0
    return x


@triton.jit
def double_every_eighth(x, n):
    for i in range(n):
        x = x + 1
        if i % 8 == 0:
            x = x * 2
    return x


def wait(request: dict, size: int) -> None:
    """A runner that counts nothing for a minute (a parent killed meanwhile must not leave it)."""
    import time
    time.sleep(60)


@triton.jit
def clamp_low_scaled(x, low, k, SCALE: tl.constexpr):
    if low > 0:
        x = tl.maximum(x, low)
        if SCALE:
            x = x * k
    return x


@triton.jit
def sum_if_positive(x_ptr, n, flag):
    total = 0.0
    if flag > 0:
        for i in range(n):
            total += tl.load(x_ptr + i)
    return total
