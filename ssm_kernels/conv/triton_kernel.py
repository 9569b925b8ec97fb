"""Depthwise causal conv in Triton, with the conv state captured at any offsets of the pass.

Each output element is one fixed-order dot over the width taps, accumulated in float32:
`acc = bias; for k in range(width): acc = fma(weight[:, k], input[t - (width - 1) + k], acc)`,
compiled without floating-point contraction (EXACT_ROUNDING) so that no variant rounds differently.
Every element runs the same instructions wherever its tile, its pass or its batch neighbours
are, so splitting a sequence into passes or packing it with others cannot change a bit. Inputs
before the pass come from the initial state (zeros without one). The program that owns a
sequence's first time tile also copies the conv states (the width - 1 inputs before an offset:
the final state and the requested captures); they are inputs, so they are stored in x's dtype.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._triton import (EXACT_ROUNDING, flags_for, cast_for_store, launch, ptr_or, row_slots, sequence_span,
                       strides_or_zeros)
from .problem import ConvProblem

# Tile sizes: fixed constants (the result of an element does not depend on them anyway: the tile
# may follow the pass length, unlike the scans'). With
# tokens contiguous a thread owns one vector of tokens of one channel (32 x 32 tiles); with
# channels contiguous it owns a vector of channels at 4 tokens (32 x 128 tiles), so its weights,
# loaded once, serve more outputs. Both keep every tile in registers when compiled for sm_90.
BLOCK_T = 32
BLOCK_T_CHANNEL_VECTORS = 128
BLOCK_D = 32
BLOCK_D_ONE_TOKEN = 256  # passes of at most one token per sequence (decode): one tile per 256 channels


@triton.jit
def _load_inputs(p_x, s_x_t, p_init, s_init_k, pos, m, starts, WIDTH: tl.constexpr, HAS_INITIAL_STATE: tl.constexpr):
    """The inputs at sequence positions `pos` (int64, may be negative: those come from the initial
    state where `starts`, zeros without one) of channels `p_x`/`p_init` (all three broadcastable
    to the tile), where `m`; in x's dtype."""
    b_x = tl.load(p_x + pos * s_x_t, mask=m & (pos >= 0), other=0.0)
    if HAS_INITIAL_STATE:
        m_init = tl.where(starts, m & (pos < 0), False)  # (not m & starts: the interpreter mistypes it)
        b_init = tl.load(p_init + (pos + (WIDTH - 1)) * s_init_k, mask=m_init, other=0.0)
        b_x = tl.where(pos >= 0, b_x, b_init.to(b_x.dtype))
    return b_x


@triton.jit
def _columns(v, VEC: tl.constexpr):
    """The VEC (4 or 8) entries of v's last, in-thread axis [.., .., VEC] as a tuple of [.., ..]
    tensors (splits of registers, no data movement)."""
    a, b = tl.split(tl.reshape(v, [v.shape[0], v.shape[1], VEC // 2, 2]))  # even, odd entries
    if VEC == 4:
        e0, e2 = tl.split(a)
        e1, e3 = tl.split(b)
        out = (e0, e1, e2, e3)
    else:
        a0, a1 = tl.split(tl.reshape(a, [v.shape[0], v.shape[1], 2, 2]))
        b0, b1 = tl.split(tl.reshape(b, [v.shape[0], v.shape[1], 2, 2]))
        e0, e4 = tl.split(a0)
        e2, e6 = tl.split(a1)
        e1, e5 = tl.split(b0)
        e3, e7 = tl.split(b1)
        out = (e0, e1, e2, e3, e4, e5, e6, e7)
    return out


@triton.jit
def _stack(e, VEC: tl.constexpr):
    """The inverse of _columns: a tuple of VEC [.., ..] tensors as [.., .., VEC]."""
    n0: tl.constexpr = e[0].shape[0]
    n1: tl.constexpr = e[0].shape[1]
    if VEC == 4:
        a = tl.join(e[0], e[2])
        b = tl.join(e[1], e[3])
    else:
        a = tl.reshape(tl.join(tl.join(e[0], e[4]), tl.join(e[2], e[6])), [n0, n1, 4])
        b = tl.reshape(tl.join(tl.join(e[1], e[5]), tl.join(e[3], e[7])), [n0, n1, 4])
    return tl.reshape(tl.join(a, b), [n0, n1, VEC])


@triton.jit
def _conv_kernel(
    x_ptr, w_ptr, bias_ptr, init_ptr, out_ptr, final_ptr, captured_ptr,
    cu_seqlens_ptr, cap_ptr_ptr, cap_offset_ptr, cap_row_ptr, state_index_ptr, has_initial_ptr,
    dim, seqlen, skip_slot,
    s_x_b, s_x_d, s_x_t,
    s_w_d, s_w_k,
    s_bias_d,
    s_init_s, s_init_d, s_init_k,
    s_out_b, s_out_d, s_out_t,
    s_fin_s, s_fin_d, s_fin_k,
    s_cap_r, s_cap_d, s_cap_k,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_CAPTURE: tl.constexpr,
    HAS_SLOT_IN: tl.constexpr, HAS_INITIAL_FLAGS: tl.constexpr, HAS_SKIP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr, VEC: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_d = tl.program_id(1)
    i_s = tl.program_id(2).to(tl.int64)

    i_b, bos, length = sequence_span(cu_seqlens_ptr, i_s, seqlen, IS_VARLEN)
    i_slot, _, live, starts, length = row_slots(i_s, length, state_index_ptr, state_index_ptr, has_initial_ptr,
                                               skip_slot, HAS_SLOT_IN, False, HAS_INITIAL_FLAGS, HAS_SKIP)

    # The tile [BLOCK_D channels, BLOCK_T // VEC, VEC] of outputs at o_t = v * VEC + j.
    o_d1 = (i_d * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    o_d = o_d1[:, None, None]
    m_d = o_d < dim
    o_t = (i_t * BLOCK_T + tl.arange(0, BLOCK_T // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]).to(tl.int64)
    o_t = o_t[None, :, :]
    m_t = o_t < length
    p_x = x_ptr + i_b * s_x_b + bos * s_x_t + o_d * s_x_d  # token 0 of the sequence
    p_init = init_ptr + i_slot * s_init_s + o_d * s_init_d
    if VEC > 1:
        # Tokens contiguous: each thread reads its VEC consecutive inputs and the VEC before them
        # as two vector loads, and takes every tap from these registers.
        prev = _load_inputs(p_x, s_x_t, p_init, s_init_k, o_t - VEC, m_d & (o_t - VEC < length), starts, WIDTH,
                            HAS_INITIAL_STATE)
        cur = _load_inputs(p_x, s_x_t, p_init, s_init_k, o_t, m_d & m_t, starts, WIDTH, HAS_INITIAL_STATE)
        window = _columns(prev.to(tl.float32), VEC) + _columns(cur.to(tl.float32), VEC)
        b_bias = tl.zeros([BLOCK_D, BLOCK_T // VEC], dtype=tl.float32)
        if HAS_BIAS:
            b_bias += tl.load(bias_ptr + o_d1[:, None] * s_bias_d, mask=o_d1[:, None] < dim, other=0.0).to(tl.float32)
        outs = ()
        for j in tl.static_range(VEC):
            out = b_bias
            for k in tl.static_range(WIDTH):
                b_w = tl.load(w_ptr + o_d1[:, None] * s_w_d + k * s_w_k, mask=o_d1[:, None] < dim,
                              other=0.0).to(tl.float32)
                out = tl.fma(b_w, window[VEC - (WIDTH - 1) + j + k], out)
            outs = outs + (out,)
        acc = _stack(outs, VEC)
    else:
        # Channels contiguous (or neither): one load per tap, vectors along the channels.
        acc = tl.zeros([BLOCK_D, BLOCK_T // VEC, VEC], dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + o_d * s_bias_d, mask=m_d, other=0.0).to(tl.float32)
        for k in tl.static_range(WIDTH):
            b_w = tl.load(w_ptr + o_d * s_w_d + k * s_w_k, mask=m_d, other=0.0).to(tl.float32)
            b_x = _load_inputs(p_x, s_x_t, p_init, s_init_k, o_t - (WIDTH - 1 - k), m_d & m_t, starts, WIDTH,
                               HAS_INITIAL_STATE)
            acc = tl.fma(b_w, b_x.to(tl.float32), acc)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    p_out = out_ptr + i_b * s_out_b + o_d * s_out_d + (bos + o_t) * s_out_t
    tl.store(p_out, cast_for_store(acc, out_ptr.dtype.element_ty), mask=m_d & m_t)

    # Conv states: the WIDTH - 1 inputs before an offset, copied in x's dtype.
    if WIDTH > 1:
        if i_t == 0:
            o_w = tl.arange(0, BLOCK_W).to(tl.int64)[None, :]
            m_dw = o_d1[:, None] < dim
            m_dw = m_dw & (o_w < WIDTH - 1)
            p_x2 = x_ptr + i_b * s_x_b + bos * s_x_t + o_d1[:, None] * s_x_d
            p_init2 = init_ptr + i_slot * s_init_s + o_d1[:, None] * s_init_d
            b_state = _load_inputs(p_x2, s_x_t, p_init2, s_init_k, length - (WIDTH - 1) + o_w, m_dw, starts,
                                   WIDTH, HAS_INITIAL_STATE)  # [BD, BW]
            p_fin = final_ptr + i_slot * s_fin_s + o_d1[:, None] * s_fin_d + o_w * s_fin_k
            m_fin = tl.where(live, m_dw, False)
            if not HAS_SLOT_IN:
                tl.store(p_fin, cast_for_store(b_state.to(tl.float32), final_ptr.dtype.element_ty), mask=m_fin)
            if HAS_CAPTURE:
                c_lo = tl.load(cap_ptr_ptr + i_s)
                c_hi = tl.load(cap_ptr_ptr + i_s + 1)
                for c in range(c_lo, c_hi):
                    offset = tl.load(cap_offset_ptr + c)
                    row = tl.load(cap_row_ptr + c)
                    b_cap = _load_inputs(p_x2, s_x_t, p_init2, s_init_k, offset - (WIDTH - 1) + o_w, m_dw, starts,
                                         WIDTH, HAS_INITIAL_STATE)
                    p_cap = captured_ptr + row * s_cap_r + o_d1[:, None] * s_cap_d + o_w * s_cap_k
                    keep = live
                    if HAS_SKIP:  # an engine declines a capture by pointing it at the skip slot
                        keep = keep & (row != skip_slot)
                    tl.store(p_cap, cast_for_store(b_cap.to(tl.float32), captured_ptr.dtype.element_ty),
                             mask=tl.where(keep, m_dw, False))
            if HAS_SLOT_IN:
                # In place: the final state overwrites the slot the initial inputs came from, so
                # every read of them (this first time tile's outputs and captures) comes first.
                tl.debug_barrier()
                tl.store(p_fin, cast_for_store(b_state.to(tl.float32), final_ptr.dtype.element_ty), mask=m_fin)


def _time_vector(p: ConvProblem) -> int:
    """Tokens per thread along time: a 128-bit vector where tokens are contiguous and the taps
    reach back less than a vector, else 1 (then the loads vectorize along channels, if at all)."""
    vector = 16 // p.x.element_size()
    return vector if p.x.stride(2) == 1 and p.width - 1 <= vector else 1


def run_triton(p: ConvProblem) -> None:
    """Launch over (time tile, channel tile, sequence); writes p.out, p.state_out, p.captured."""
    nseq = p.seqs.count
    if nseq == 0:
        return
    dim, width = p.weight.shape
    block_w = triton.next_power_of_2(max(width - 1, 1))
    if max(p.seqs.lengths) <= 1:  # decode: one token, many channels per program
        block_d, vec, block_t, num_warps = min(BLOCK_D_ONE_TOKEN, triton.next_power_of_2(dim)), 1, 1, 2
    else:
        block_d, vec, num_warps = min(BLOCK_D, triton.next_power_of_2(dim)), _time_vector(p), 4
        # At least the taps' reach: then only the first time tile reads the initial states, which
        # it overwrites when they are updated in place (an engine's cache).
        block_t = max(BLOCK_T if vec > 1 else BLOCK_T_CHANNEL_VECTORS, block_w)
    grid = (max(1, triton.cdiv(max(p.seqs.lengths), block_t)), triton.cdiv(dim, block_d), nseq)
    cap = p.captures
    w = p.weight  # stands in for absent or empty tensors (never empty itself)
    launch(_conv_kernel, grid,
        ptr_or(p.x, w), w, ptr_or(p.bias, w), ptr_or(p.state_in, w), ptr_or(p.out, w),
        ptr_or(p.state_out, w), ptr_or(p.captured, w),
        ptr_or(p.seqs.cu_seqlens, w), ptr_or(cap.ptr, w), ptr_or(cap.offset, w), ptr_or(cap.row, w),
        ptr_or(p.state_index, w), ptr_or(p.has_initial, w),
        dim, p.x.shape[2], 0 if p.skip_slot is None else p.skip_slot,
        *p.x.stride(), *p.weight.stride(), *strides_or_zeros(p.bias, 1), *strides_or_zeros(p.state_in, 3),
        *p.out.stride(), *p.state_out.stride(), *p.captured.stride(),
        WIDTH=width, **flags_for(_conv_kernel, p),
        BLOCK_T=block_t, BLOCK_D=block_d, BLOCK_W=block_w, VEC=vec,
        num_warps=num_warps, **EXACT_ROUNDING,
    )
