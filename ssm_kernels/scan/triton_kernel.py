"""Recurrent selective scan in Triton, with in-pass state capture.

One program owns one (sequence, head, block of headdim rows) tile of the state and walks its
tokens in order, so every token is computed by the same instructions wherever a pass starts or
ends: splitting a sequence, batching it with others or asking for captures cannot change a bit
of its output. Captures are served between token segments: the program advances to the next
requested offset, stores its state tile to the capture buffer, and goes on.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._triton import discretize_dt, ptr_or, sequence_span, strides_or_zeros
from .problem import ScanProblem

# The launch configuration is a function of the model dimensions alone: one that changed with
# sequence length or batch would change the instruction stream and break the bitwise split
# invariance the prefix cache relies on. See launch_config for the choice itself.


@triton.jit
def _advance(state, t_lo, t_hi,
             p_x, p_dt, p_B, p_C, p_z, p_y,
             s_x_t, s_dt_t, s_B_t, s_C_t, s_z_t, s_y_t,
             b_A, b_D, b_dt_bias, dt_min, dt_max, m_p, m_n,
             HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
             DT_SOFTPLUS: tl.constexpr, A_PER_STATE: tl.constexpr):
    """Consume tokens [t_lo, t_hi) of the tile's sequence; return the state after them."""
    for t in range(t_lo, t_hi):
        b_x = tl.load(p_x + t * s_x_t, mask=m_p, other=0.0).to(tl.float32)  # [BP]
        b_dt = tl.load(p_dt + t * s_dt_t, mask=m_p, other=0.0).to(tl.float32)  # [BP]
        b_dt = discretize_dt(b_dt, b_dt_bias, dt_min, dt_max, HAS_DT_BIAS, DT_SOFTPLUS)
        b_B = tl.load(p_B + t * s_B_t, mask=m_n, other=0.0).to(tl.float32)  # [BN]
        b_C = tl.load(p_C + t * s_C_t, mask=m_n, other=0.0).to(tl.float32)  # [BN]
        if A_PER_STATE:
            b_dA = tl.exp(b_dt[:, None] * b_A)  # [BP, BN]
        else:
            b_dA = tl.exp(b_dt * b_A)[:, None]  # [BP, 1]
        state = state * b_dA + (b_dt * b_x)[:, None] * b_B[None, :]
        b_y = tl.sum(state * b_C[None, :], axis=1)  # [BP]
        if HAS_D:
            b_y += b_D * b_x
        if HAS_Z:
            b_z = tl.load(p_z + t * s_z_t, mask=m_p, other=0.0).to(tl.float32)
            b_y = b_y * b_z * tl.sigmoid(b_z)
        tl.store(p_y + t * s_y_t, b_y.to(p_y.dtype.element_ty), mask=m_p)
    return state


@triton.jit
def _scan_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr,
    state_in_ptr, state_out_ptr, state_index_ptr, y_ptr, captured_ptr,
    cu_seqlens_ptr, cap_ptr_ptr, cap_offset_ptr, cap_row_ptr,
    has_initial_ptr, state_out_index_ptr, skip_slot,
    headdim, dstate, heads_per_group, dt_min, dt_max,
    s_x_b, s_x_t, s_x_h, s_x_p,
    s_dt_b, s_dt_t, s_dt_h, s_dt_p,
    s_A_h, s_A_p, s_A_n,
    s_B_b, s_B_t, s_B_g, s_B_n,
    s_C_b, s_C_t, s_C_g, s_C_n,
    s_D_h, s_D_p,
    s_z_b, s_z_t, s_z_h, s_z_p,
    s_bias_h, s_bias_p,
    s_y_b, s_y_t, s_y_h, s_y_p,
    s_in_s, s_in_h, s_in_p, s_in_n,
    s_out_s, s_out_h, s_out_p, s_out_n,
    s_cap_r, s_cap_h, s_cap_p, s_cap_n,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, A_PER_STATE: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, HAS_STATE_INDEX: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_CAPTURE: tl.constexpr,
    HAS_INITIAL_FLAGS: tl.constexpr, HAS_OUT_INDEX: tl.constexpr, HAS_SKIP: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    i_s = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_p = tl.program_id(2)
    i_g = i_h // heads_per_group

    i_b, bos, length = sequence_span(cu_seqlens_ptr, i_s, IS_VARLEN)
    if HAS_STATE_INDEX:
        i_slot = tl.load(state_index_ptr + i_s).to(tl.int64)
    else:
        i_slot = i_s
    i_slot_out = i_slot
    if HAS_OUT_INDEX:
        i_slot_out = tl.load(state_out_index_ptr + i_s).to(tl.int64)
    # A skipped sequence (an engine's padding row) runs no token and stores nothing.
    live = tl.full([], True, tl.int1)  # a scalar flag (the interpreter wants a typed one)
    if HAS_SKIP:
        live = live & (i_slot != skip_slot)
        length = tl.where(live, length, 0)

    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o_n = tl.arange(0, BLOCK_N)
    m_p = o_p < headdim
    m_n = o_n < dstate
    m_pn = m_p[:, None] & m_n[None, :]
    m_store = m_pn & live

    # Pointers to token 0 of this tile's sequence; _advance adds t * stride.
    p_x = x_ptr + i_b * s_x_b + bos * s_x_t + i_h * s_x_h + o_p * s_x_p
    p_dt = dt_ptr + i_b * s_dt_b + bos * s_dt_t + i_h * s_dt_h + o_p * s_dt_p
    p_B = B_ptr + i_b * s_B_b + bos * s_B_t + i_g * s_B_g + o_n * s_B_n
    p_C = C_ptr + i_b * s_C_b + bos * s_C_t + i_g * s_C_g + o_n * s_C_n
    p_z = z_ptr + i_b * s_z_b + bos * s_z_t + i_h * s_z_h + o_p * s_z_p
    p_y = y_ptr + i_b * s_y_b + bos * s_y_t + i_h * s_y_h + o_p * s_y_p

    if A_PER_STATE:
        b_A = tl.load(A_ptr + i_h * s_A_h + o_p[:, None] * s_A_p + o_n[None, :] * s_A_n,
                      mask=m_pn, other=0.0).to(tl.float32)  # [BP, BN]
    else:
        b_A = tl.load(A_ptr + i_h * s_A_h + o_p * s_A_p, mask=m_p, other=0.0).to(tl.float32)  # [BP]
    b_D = tl.zeros([BLOCK_P], dtype=tl.float32)
    if HAS_D:
        b_D = tl.load(D_ptr + i_h * s_D_h + o_p * s_D_p, mask=m_p, other=0.0).to(tl.float32)
    b_dt_bias = tl.zeros([BLOCK_P], dtype=tl.float32)
    if HAS_DT_BIAS:
        b_dt_bias = tl.load(dt_bias_ptr + i_h * s_bias_h + o_p * s_bias_p, mask=m_p, other=0.0).to(tl.float32)

    o_state = o_p[:, None] * s_in_p + o_n[None, :] * s_in_n
    if HAS_INITIAL_STATE:
        m_init = m_store
        if HAS_INITIAL_FLAGS:
            m_init = m_store & (live & (tl.load(has_initial_ptr + i_s) != 0))
        state = tl.load(state_in_ptr + i_slot * s_in_s + i_h * s_in_h + o_state, mask=m_init,
                        other=0.0).to(tl.float32)
    else:
        state = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)

    done = length - length  # tokens consumed so far (int64)
    if HAS_CAPTURE:
        c_lo = tl.load(cap_ptr_ptr + i_s)
        c_hi = tl.load(cap_ptr_ptr + i_s + 1)
        for c in range(c_lo, c_hi):
            offset = tl.load(cap_offset_ptr + c)
            state = _advance(state, done, offset, p_x, p_dt, p_B, p_C, p_z, p_y,
                             s_x_t, s_dt_t, s_B_t, s_C_t, s_z_t, s_y_t,
                             b_A, b_D, b_dt_bias, dt_min, dt_max, m_p, m_n,
                             HAS_D, HAS_Z, HAS_DT_BIAS, DT_SOFTPLUS, A_PER_STATE)
            row = tl.load(cap_row_ptr + c)
            m_cap = m_store
            if HAS_SKIP:  # a capture whose destination is the skip slot is dropped
                m_cap = m_store & (live & (row != skip_slot))
            p_cap = captured_ptr + row * s_cap_r + i_h * s_cap_h + o_p[:, None] * s_cap_p + o_n[None, :] * s_cap_n
            tl.store(p_cap, state.to(captured_ptr.dtype.element_ty), mask=m_cap)
            done = offset
    state = _advance(state, done, length, p_x, p_dt, p_B, p_C, p_z, p_y,
                     s_x_t, s_dt_t, s_B_t, s_C_t, s_z_t, s_y_t,
                     b_A, b_D, b_dt_bias, dt_min, dt_max, m_p, m_n,
                     HAS_D, HAS_Z, HAS_DT_BIAS, DT_SOFTPLUS, A_PER_STATE)
    p_out = state_out_ptr + i_slot_out * s_out_s + i_h * s_out_h + o_p[:, None] * s_out_p + o_n[None, :] * s_out_n
    tl.store(p_out, state.to(state_out_ptr.dtype.element_ty), mask=m_store)


def launch_config(headdim: int, dstate: int) -> tuple[int, int, int]:
    """(BLOCK_P, BLOCK_N, num_warps) for the model dimensions.

    One warp per program: the per-token reduction over dstate then stays inside the warp (no
    barrier in the token loop), and small programs let all of a layer's tiles be resident at
    once: the recurrence is sequential, so a second wave of programs would double a pass. Rows
    per program: at most 32 state elements per thread, and at most 8 rows once dstate >= 32;
    compiled for sm_90 these keep every variant in registers (16 rows at dstate 64 spill),
    and at dstate 128 allow 8 programs (64 rows) per SM: a Mamba-2 2.7B or Granite-4.0-H
    layer (5120 or 8192 rows) fits in one wave on 132 SMs.
    """
    block_n = triton.next_power_of_2(dstate)
    block_p = min(triton.next_power_of_2(headdim), 32 if block_n <= 16 else 8, max(1, 1024 // block_n))
    return block_p, block_n, 1


def run_triton(p: ScanProblem) -> None:
    """Launch the kernel over (sequence, head, headdim block); writes p.y, p.state_out, p.captured."""
    nseq = p.seqs.count
    if nseq == 0:
        return
    nheads, headdim, dstate, ngroups = p.dims
    block_p, block_n, num_warps = launch_config(headdim, dstate)
    grid = (nseq, nheads, triton.cdiv(headdim, block_p))
    cap = p.captures
    out = p.state_out
    _scan_kernel[grid](
        ptr_or(p.x, out), ptr_or(p.dt, out), p.A, ptr_or(p.B, out), ptr_or(p.C, out), ptr_or(p.D, out),
        ptr_or(p.z, out), ptr_or(p.dt_bias, out), ptr_or(p.state_in, out), out,
        ptr_or(p.state_index, p.seqs.cu_seqlens), ptr_or(p.y, out), ptr_or(p.captured, out),
        p.seqs.cu_seqlens, cap.ptr, ptr_or(cap.offset, cap.ptr), ptr_or(cap.row, cap.ptr),
        ptr_or(p.has_initial, cap.ptr), ptr_or(p.state_out_index, cap.ptr),
        p.skip_slot if p.skip_slot is not None else 0,
        headdim, dstate, nheads // ngroups, p.dt_min, p.dt_max,
        *p.x.stride(), *p.dt.stride(), *p.A.stride(), *p.B.stride(), *p.C.stride(),
        *strides_or_zeros(p.D, 2), *strides_or_zeros(p.z, 4), *strides_or_zeros(p.dt_bias, 2), *p.y.stride(),
        *strides_or_zeros(p.state_in, 4), *p.state_out.stride(), *p.captured.stride(),
        HAS_D=p.D is not None, HAS_Z=p.z is not None, HAS_DT_BIAS=p.dt_bias is not None,
        DT_SOFTPLUS=p.dt_softplus, A_PER_STATE=p.a_per_state,
        HAS_INITIAL_STATE=p.state_in is not None, HAS_STATE_INDEX=p.state_index is not None,
        IS_VARLEN=p.seqs.varlen, HAS_CAPTURE=cap.count > 0,
        HAS_INITIAL_FLAGS=p.has_initial is not None, HAS_OUT_INDEX=p.state_out_index is not None,
        HAS_SKIP=p.skip_slot is not None,
        BLOCK_P=block_p, BLOCK_N=block_n,
        num_warps=num_warps,
    )
