"""Pieces the Triton kernels and their launchers share."""
from __future__ import annotations

import threading

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from . import _interpreter


@triton.jit
def cast_for_store(v, dtype: tl.constexpr):
    """fp32 `v` cast to `dtype`, to nearest even. Under the interpreter, whose fp32 -> bfloat16
    cast truncates, bfloat16 is rounded by bit arithmetic first, as the GPU rounds."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        v = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def rounded(v, dtype: tl.constexpr):
    """`v` rounded to `dtype` as cast_for_store rounds it, kept in fp32 (unchanged for fp32)."""
    if dtype == tl.float32:
        out = v.to(tl.float32)
    else:
        out = cast_for_store(v.to(tl.float32), dtype).to(tl.float32)
    return out


@triton.jit
def as_f32(v, PAIRS: tl.constexpr, IS_BF16: tl.constexpr):
    """A loaded tile in fp32. With PAIRS, `v` holds 32-bit words of two adjacent 16-bit elements
    (bfloat16 with IS_BF16, else float16) along its last axis (rank 3 or 5): unpacked by bit operations into a
    last axis twice as long, in registers (one instruction per element for bfloat16, where 16-bit
    loads convert less directly)."""
    if PAIRS:
        if IS_BF16:
            lo = (v << 16).to(tl.float32, bitcast=True)
            hi = ((v >> 16) << 16).to(tl.float32, bitcast=True)
        else:
            lo = (v & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            hi = (v >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        pairs = tl.join(lo, hi)
        if len(v.shape) == 3:
            out = tl.reshape(pairs, [v.shape[0], v.shape[1], 2 * v.shape[2]])
        else:
            out = tl.reshape(pairs, [v.shape[0], v.shape[1], v.shape[2], v.shape[3], 2 * v.shape[4]])
    else:
        out = v.to(tl.float32)
    return out


@triton.jit
def exp2_flush(v):
    """2^v in fp32, results below 2^-126 flushed to zero: one MUFU.EX2 on the GPU (tl.exp2 adds a
    range check and two multiplies per element to keep denormal results); tl.exp2 under the
    interpreter."""
    if INTERPRETED:
        out = tl.exp2(v)
    else:
        out = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [v], dtype=tl.float32,
                                        is_pure=True, pack=1)
    return out


@triton.jit
def halves(x):
    """x [A, B, C, K] (K even) as its even and its odd k's, each [A, B, C, K / 2]."""
    return tl.split(tl.reshape(x, [x.shape[0], x.shape[1], x.shape[2], x.shape[3] // 2, 2]))


@triton.jit
def fma_chain(acc, s, c):
    """acc + the sum over k of s[..., k] c[..., k] (s, c [A, B, C, K], K a power of 2) as one
    chain of K fused multiply-adds: the even k's, then the odd k's, each half in this order."""
    if s.shape[3] == 1:
        acc = tl.fma(tl.sum(s, axis=3), tl.sum(c, axis=3), acc)
    else:
        s_even, s_odd = halves(s)
        c_even, c_odd = halves(c)
        acc = fma_chain(fma_chain(acc, s_even, c_even), s_odd, c_odd)
    return acc


@triton.jit
def softplus(v):
    """log(1 + exp(v)) in fp32, as max(v, 0) + log1p(e) with e = exp(-|v|) in (0, 1] and log1p on
    [0, 1] a degree-10 polynomial e * P(e) (Chebyshev fit, relative error below 2e-7 in fp32):
    one MUFU and a dozen FMAs where a libdevice log costs three times as many instructions.
    Above 20 the sum rounds to v itself (PyTorch's threshold); below about -87, e flushes to
    zero and so does the result (the true value is below 2^-126)."""
    e = exp2_flush(-tl.abs(v) * 1.4426950408889634)
    p = -0.003214113414287567
    p = tl.fma(p, e, 0.019649622961878777)
    p = tl.fma(p, e, -0.05643612518906593)
    p = tl.fma(p, e, 0.10533368587493896)
    p = tl.fma(p, e, -0.15251556038856506)
    p = tl.fma(p, e, 0.19651539623737335)
    p = tl.fma(p, e, -0.24947820603847504)
    p = tl.fma(p, e, 0.3332909941673279)
    p = tl.fma(p, e, -0.4999985098838806)
    p = tl.fma(p, e, 1.0)
    return tl.fma(e, p, tl.maximum(v, 0.0))


@triton.jit
def discretize_dt(dt, dt_bias, dt_min, dt_max, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr):
    """dt' = clamp(softplus(dt + dt_bias) if DT_SOFTPLUS else dt + dt_bias, dt_min, dt_max), fp32
    (dt_bias read only with HAS_DT_BIAS). A NaN stays NaN, as in torch.clamp (the default min and
    max return the other operand: a NaN dt would become dt_min, a finite decay)."""
    if HAS_DT_BIAS:
        dt += dt_bias
    if DT_SOFTPLUS:
        dt = softplus(dt)
    dt = tl.maximum(dt, dt_min, propagate_nan=tl.PropagateNan.ALL)
    return tl.minimum(dt, dt_max, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def sequence_span(cu_seqlens_ptr, i_s, seqlen, IS_VARLEN: tl.constexpr):
    """(batch row, first token, length) of sequence i_s, all int64: from cu_seqlens, the bounds
    of a varlen batch, or batch row i_s of a dense one (cu_seqlens unread)."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens_ptr + i_s)
        length = tl.load(cu_seqlens_ptr + i_s + 1) - bos
        i_b = i_s - i_s
    else:
        i_b = i_s
        bos = i_s - i_s
        length = bos + seqlen
    return i_b, bos, length


@triton.jit
def row_slots(i_s, length, slot_in_ptr, slot_out_ptr, has_initial_ptr, skip_slot, HAS_SLOT_IN: tl.constexpr,
              HAS_SLOT_OUT: tl.constexpr, HAS_INITIAL_FLAGS: tl.constexpr, HAS_SKIP: tl.constexpr):
    """Where row i_s's states live in a pool of slots (an engine's cache, read and written in
    place): (slot read, slot written, live, starts, length). A row on the skip slot (an engine's
    padding) is not live: it reads and writes nothing and its length becomes 0; `starts` says
    whether the row reads its initial state."""
    i_in = i_s
    if HAS_SLOT_IN:
        i_in = tl.load(slot_in_ptr + i_s).to(tl.int64)
    i_out = i_in
    if HAS_SLOT_OUT:
        i_out = tl.load(slot_out_ptr + i_s).to(tl.int64)
    live = i_s == i_s
    if HAS_SKIP:
        live = i_in != skip_slot
        length = tl.where(live, length, 0)
    starts = live
    if HAS_INITIAL_FLAGS:
        starts = live & (tl.load(has_initial_ptr + i_s) != 0)
    return i_in, i_out, live, starts, length




# Kernels defined while TRITON_INTERPRET=1 was set run through the interpreter, on CPU tensors.
# Launch option of the kernels whose bits are promised equal across launches of different
# specialisations (a 1-token pass and a longer one, with and without captures or varlen, the
# decode step): with floating-point contraction the compiler (LLVM, then ptxas) fuses a multiply
# and an add wherever a variant's code lets it, so the same source rounds differently in
# different binaries. Without it each operation rounds as written (as under the interpreter),
# and the kernels write their fused multiply-adds explicitly (tl.fma).
EXACT_ROUNDING = dict(enable_fp_fusion=False)

RUNS_ON_CPU = isinstance(softplus, InterpretedFunction)
if RUNS_ON_CPU:
    _interpreter.install()
INTERPRETED = tl.constexpr(RUNS_ON_CPU)  # read by jitted helpers when they compile


def strides_or_zeros(t, ndim: int) -> tuple[int, ...]:
    """t's strides, or zeros for an absent optional tensor."""
    return t.stride() if t is not None else (0,) * ndim


def ptr_or(t, stand_in):
    """`t`, or `stand_in` where `t` is absent or empty (its constexpr flag or length keeps it
    unread; an empty CUDA tensor has no address to pass)."""
    return stand_in if t is None or t.numel() == 0 else t


_PARAMETERS: dict = {}


def flags_for(kernel, problem) -> dict[str, bool]:
    """The problem's optional-input flags (problem.flags) that `kernel` takes as parameters."""
    names = _PARAMETERS.get(kernel)
    if names is None:
        names = _PARAMETERS[kernel] = frozenset(kernel.arg_names)
    return {name: value for name, value in problem.flags.items() if name in names}


class _Recording(threading.local):
    """Per thread: the recorder of the op being recorded (_replay.py), which then
    makes the thread's launches, or None."""

    recorder = None


recording = _Recording()


def launch(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs): every kernel of the library is launched here, where a
    serving step's recorder sees it."""
    recorder = recording.recorder
    if recorder is None:
        kernel[grid](*args, **kwargs)
    else:
        recorder.launch(kernel, grid, args, kwargs)
