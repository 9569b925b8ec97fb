"""Count what Triton kernels do under the interpreter: tl.dot FLOPs and global memory bytes.

    with count_kernel_work() as work:
        mamba2_scan(..., backend="triton")
    work.dot_flops, work.bytes_loaded, work.bytes_stored

Every tl.dot counts 2 * M * N * K (the whole tile, masked rows included: the tensor cores do
that work); every tl.load / tl.store counts the elements its mask lets through times their size
(what the kernel asks of global memory; caches are not modelled). Needs TRITON_INTERPRET=1.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
from triton.runtime import interpreter


@dataclass
class KernelWork:
    dot_flops: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0

    @property
    def bytes_moved(self) -> int:
        return self.bytes_loaded + self.bytes_stored


def _element_bytes(ptrs) -> int:
    return ptrs.get_element_ty().primitive_bitwidth // 8


@contextlib.contextmanager
def count_kernel_work():
    builder = interpreter.InterpreterBuilder
    originals = {name: getattr(builder, name) for name in ("create_masked_load", "create_masked_store", "create_dot")}
    work = KernelWork()

    def load(self, ptrs, mask, *args, **kwargs):
        work.bytes_loaded += int(np.count_nonzero(mask.data)) * _element_bytes(ptrs)
        return originals["create_masked_load"](self, ptrs, mask, *args, **kwargs)

    def store(self, ptrs, value, mask, *args, **kwargs):
        work.bytes_stored += int(np.count_nonzero(mask.data)) * _element_bytes(ptrs)
        return originals["create_masked_store"](self, ptrs, value, mask, *args, **kwargs)

    def dot(self, a, b, *args, **kwargs):
        *_, m, k = a.data.shape
        work.dot_flops += 2 * m * k * b.data.shape[-1]
        return originals["create_dot"](self, a, b, *args, **kwargs)

    builder.create_masked_load, builder.create_masked_store, builder.create_dot = load, store, dot
    try:
        yield work
    finally:
        for name, fn in originals.items():
            setattr(builder, name, fn)
