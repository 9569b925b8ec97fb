"""Depthwise causal conv in Triton, with the conv state captured at any offsets of the pass.

Each output element is one fixed-order dot over the width taps, accumulated in float32:
`acc = bias; for k in range(width): acc = acc + weight[:, k] * input[t - (width - 1) + k]`.
Every element runs the same instructions wherever its tile, its pass or its batch neighbours
are, so splitting a sequence into passes or packing it with others cannot change a bit. Inputs
before the pass come from the initial state (zeros without one). The program that owns a
sequence's first time tile also copies the conv states (the width - 1 inputs before an offset:
the final state and the requested captures); they are inputs, so they are stored in x's dtype.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._triton import ptr_or, sequence_span, strides_or_zeros
from .problem import ConvProblem

# Tile sizes: fixed constants (the result of an element does not depend on them anyway); 32 x 32
# keeps the width-shifted input tiles in registers when compiled for sm_90 (64 x 64 spills).
BLOCK_T = 32
BLOCK_D = 32


@triton.jit
def _load_inputs(p_x, s_x_t, p_init, s_init_k, pos, m_d, m_pos, m_init,
                 WIDTH: tl.constexpr, HAS_INITIAL_STATE: tl.constexpr):
    """The inputs at sequence positions `pos` [BT] (int64, may be negative: those come from the
    initial state, zeros without one or where m_init is false) of channels `p_x`/`p_init` [BD];
    returns [BD, BT] in x's dtype."""
    m = m_d[:, None] & m_pos[None, :]
    b_x = tl.load(p_x[:, None] + pos[None, :] * s_x_t, mask=m & (pos >= 0)[None, :], other=0.0)
    if HAS_INITIAL_STATE:
        b_init = tl.load(p_init[:, None] + (pos + (WIDTH - 1))[None, :] * s_init_k,
                         mask=m & (pos < 0)[None, :] & m_init, other=0.0)
        b_x = tl.where((pos >= 0)[None, :], b_x, b_init.to(b_x.dtype))
    return b_x


@triton.jit
def _conv_kernel(
    x_ptr, w_ptr, bias_ptr, init_ptr, out_ptr, final_ptr, captured_ptr,
    cu_seqlens_ptr, cap_ptr_ptr, cap_offset_ptr, cap_row_ptr,
    state_index_ptr, has_initial_ptr, skip_slot,
    dim,
    s_x_b, s_x_d, s_x_t,
    s_w_d, s_w_k,
    s_bias_d,
    s_init_s, s_init_d, s_init_k,
    s_out_b, s_out_d, s_out_t,
    s_fin_s, s_fin_d, s_fin_k,
    s_cap_r, s_cap_d, s_cap_k,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_CAPTURE: tl.constexpr,
    HAS_STATE_INDEX: tl.constexpr, HAS_INITIAL_FLAGS: tl.constexpr, HAS_SKIP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_d = tl.program_id(1)
    i_s = tl.program_id(2).to(tl.int64)

    i_b, bos, length = sequence_span(cu_seqlens_ptr, i_s, IS_VARLEN)
    # Engine mode: states live in a pool of slots, read and written in place.
    i_slot = i_s
    if HAS_STATE_INDEX:
        i_slot = tl.load(state_index_ptr + i_s).to(tl.int64)
    live = tl.full([], True, tl.int1)  # a scalar flag (the interpreter wants a typed one)
    if HAS_SKIP:
        live = live & (i_slot != skip_slot)
        length = tl.where(live, length, 0)
    m_init = live
    if HAS_INITIAL_FLAGS:
        m_init = live & (tl.load(has_initial_ptr + i_s) != 0)

    o_d = (i_d * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    m_d = o_d < dim
    p_x = x_ptr + i_b * s_x_b + bos * s_x_t + o_d * s_x_d  # [BD], token 0 of the sequence
    p_init = init_ptr + i_slot * s_init_s + o_d * s_init_d  # [BD]

    # Outputs of this time tile.
    o_t = (i_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    m_t = o_t < length
    acc = tl.zeros([BLOCK_D, BLOCK_T], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + o_d * s_bias_d, mask=m_d, other=0.0).to(tl.float32)[:, None]
    for k in tl.static_range(WIDTH):
        b_w = tl.load(w_ptr + o_d * s_w_d + k * s_w_k, mask=m_d, other=0.0).to(tl.float32)  # [BD]
        b_x = _load_inputs(p_x, s_x_t, p_init, s_init_k, o_t - (WIDTH - 1 - k), m_d, m_t, m_init,
                           WIDTH, HAS_INITIAL_STATE)  # [BD, BT]
        acc = acc + b_w[:, None] * b_x.to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    p_out = out_ptr + i_b * s_out_b + o_d[:, None] * s_out_d + (bos + o_t)[None, :] * s_out_t
    tl.store(p_out, acc.to(out_ptr.dtype.element_ty), mask=m_d[:, None] & m_t[None, :])

    # Conv states: the WIDTH - 1 inputs before an offset, copied in x's dtype.
    if WIDTH > 1:
        if i_t == 0:
            o_w = tl.arange(0, BLOCK_W).to(tl.int64)
            m_w = o_w < WIDTH - 1
            m_dw = m_d[:, None] & m_w[None, :] & live
            b_state = _load_inputs(p_x, s_x_t, p_init, s_init_k, length - (WIDTH - 1) + o_w, m_d, m_w, m_init,
                                   WIDTH, HAS_INITIAL_STATE)  # [BD, BW]
            p_fin = final_ptr + i_slot * s_fin_s + o_d[:, None] * s_fin_d + o_w[None, :] * s_fin_k
            if not HAS_STATE_INDEX:
                tl.store(p_fin, b_state.to(final_ptr.dtype.element_ty), mask=m_dw)
            if HAS_CAPTURE:
                c_lo = tl.load(cap_ptr_ptr + i_s)
                c_hi = tl.load(cap_ptr_ptr + i_s + 1)
                for c in range(c_lo, c_hi):
                    offset = tl.load(cap_offset_ptr + c)
                    row = tl.load(cap_row_ptr + c)
                    b_cap = _load_inputs(p_x, s_x_t, p_init, s_init_k, offset - (WIDTH - 1) + o_w, m_d, m_w,
                                         m_init, WIDTH, HAS_INITIAL_STATE)
                    p_cap = captured_ptr + row * s_cap_r + o_d[:, None] * s_cap_d + o_w[None, :] * s_cap_k
                    m_cap = m_dw
                    if HAS_SKIP:  # a capture whose destination is the skip slot is dropped
                        m_cap = m_dw & (live & (row != skip_slot))
                    tl.store(p_cap, b_cap.to(captured_ptr.dtype.element_ty), mask=m_cap)
            if HAS_STATE_INDEX:
                # In place: the final state overwrites the slot the initial inputs came from, so
                # every read of them (outputs, captures) must be done first.
                tl.debug_barrier()
                tl.store(p_fin, b_state.to(final_ptr.dtype.element_ty), mask=m_dw)


def run_triton(p: ConvProblem) -> None:
    """Launch over (time tile, channel tile, sequence); writes p.out, p.state_out, p.captured."""
    nseq = p.seqs.count
    if nseq == 0:
        return
    dim, width = p.weight.shape
    block_d = min(BLOCK_D, triton.next_power_of_2(dim))
    block_w = triton.next_power_of_2(max(width - 1, 1))
    grid = (max(1, triton.cdiv(max(p.seqs.lengths), BLOCK_T)), triton.cdiv(dim, block_d), nseq)
    cap = p.captures
    w = p.weight  # stands in for absent or empty tensors (never empty itself)
    _conv_kernel[grid](
        ptr_or(p.x, w), w, ptr_or(p.bias, w), ptr_or(p.state_in, w), ptr_or(p.out, w),
        ptr_or(p.state_out, w), ptr_or(p.captured, w),
        p.seqs.cu_seqlens, cap.ptr, ptr_or(cap.offset, cap.ptr), ptr_or(cap.row, cap.ptr),
        ptr_or(p.state_index, cap.ptr), ptr_or(p.has_initial, cap.ptr),
        p.skip_slot if p.skip_slot is not None else 0,
        dim,
        *p.x.stride(), *p.weight.stride(), *strides_or_zeros(p.bias, 1), *strides_or_zeros(p.state_in, 3),
        *p.out.stride(), *p.state_out.stride(), *p.captured.stride(),
        WIDTH=width, HAS_BIAS=p.bias is not None, SILU=p.silu,
        HAS_INITIAL_STATE=p.state_in is not None, IS_VARLEN=p.seqs.varlen, HAS_CAPTURE=cap.count > 0,
        HAS_STATE_INDEX=p.state_index is not None, HAS_INITIAL_FLAGS=p.has_initial is not None,
        HAS_SKIP=p.skip_slot is not None,
        BLOCK_T=BLOCK_T, BLOCK_D=block_d, BLOCK_W=block_w,
        num_warps=4,
    )
