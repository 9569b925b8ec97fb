"""Recurrent selective scan in Triton, with in-pass state capture; also the decode step.

One program owns one (sequence, head, block of rows) tile of the state and walks its tokens in
order, so every token is computed by the same instructions wherever a pass starts or ends:
splitting a sequence, batching it with others or asking for captures cannot change a bit of its
output. Captures are served between token segments: the program advances to the next requested
offset, stores its state tile to the capture buffer, and goes on (one token loop in the code).

The tile is a [R, J, PL, L, V] view of R * PL rows x J * L * V state columns: each thread owns R
rows and J runs of V columns (a 128-bit load of B and C each, shared by its rows), L lanes share a
row, so the per-token dot with C sums a thread's columns in registers and then over L lanes (a
few shuffles). The token loop takes two tokens an iteration from registers loaded an iteration
or two earlier, so no load waits on the sequential chain, and each token's lane sum and output
run after the next token's update.

Mamba-2 (one dt and one A per head): a pass first fills a table of dt' and exp(dt' A) per (token,
head) (_dt_table_kernel), so the token loop loads two scalars instead of computing a softplus and
an exp in every program of the head; a pass of one token (a decode step) computes them in the
kernel with the same code (discretize_dt, then exp), which gives the same bits. Mamba-1 (dt per
channel, A per state entry) discretizes per row inside the loop.

Options for an engine's cache (ScanProblem): states read and written by slot, in the cache's dtype
(fp32 arithmetic, rounded on store), a separate destination slot, per-row initial-state flags and
a skip slot for padding rows.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .._triton import (flags_for, EXACT_ROUNDING, as_f32, cast_for_store, discretize_dt, exp2_flush, fma_chain, halves,
                       launch, ptr_or, row_slots, sequence_span, strides_or_zeros)
from .problem import ScanProblem

# The launch configuration is a function of the model dimensions and input dtype alone: one
# that changed with sequence length or batch would change the instruction stream and break the
# bitwise split invariance the prefix cache relies on. See launch_config for the choice itself.
# The specialisations that do vary with a pass (a 1-token pass, captures, varlen, prefetch depth)
# change no arithmetic: the kernels compile without floating-point contraction (EXACT_ROUNDING).


@triton.jit
def _dt_table_kernel(dt_ptr, A_ptr, dt_bias_ptr, table_ptr, seqlen, nheads, dt_min, dt_max,
                     s_dt_b, s_dt_t, s_dt_h, s_A_h, s_bias_h,
                     HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """table[b, t, h] = (dt', exp(dt' A[h])) in fp32, for every token of a Mamba-2 pass."""
    i_t = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    o_t = (i_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    o_h = tl.arange(0, BLOCK_H)
    m_h = o_h < nheads
    m = (o_t < seqlen)[:, None] & m_h[None, :]
    b_dt = tl.load(dt_ptr + i_b * s_dt_b + o_t[:, None] * s_dt_t + o_h[None, :] * s_dt_h,
                   mask=m, other=0.0).to(tl.float32)  # [BT, BH]
    b_bias = tl.zeros([BLOCK_H], dtype=tl.float32)
    if HAS_DT_BIAS:
        b_bias = tl.load(dt_bias_ptr + o_h * s_bias_h, mask=m_h, other=0.0).to(tl.float32)
    b_dt = discretize_dt(b_dt, b_bias[None, :], dt_min, dt_max, HAS_DT_BIAS, DT_SOFTPLUS)
    b_A = tl.load(A_ptr + o_h * s_A_h, mask=m_h, other=0.0).to(tl.float32)
    p_tab = table_ptr + ((i_b * seqlen + o_t[:, None]) * nheads + o_h[None, :]) * 2
    tl.store(p_tab, b_dt, mask=m)
    tl.store(p_tab + 1, tl.exp(b_dt * b_A[None, :]), mask=m)


@triton.jit
def _load(p, mask, valid):
    """tl.load of a full tile (mask None), or zeros where `valid` (a scalar, or None: true) and
    `mask` are not both true."""
    if mask is None:
        if valid is None:
            v = tl.load(p)
        else:
            v = tl.load(p, mask=tl.where(valid, tl.full(p.shape, True, tl.int1), False), other=0)
    else:
        if valid is not None:
            mask = tl.where(valid, mask, False)
        v = tl.load(p, mask=mask, other=0)
    return v


@triton.jit
def _rows(v, ROW_PAIRS: tl.constexpr, IS_BF16: tl.constexpr):
    """Per-row values [R, 1, PL, 1, 1] in fp32. With ROW_PAIRS, `v` [R // 2, 1, PL, 1, 1] holds
    32-bit words of a thread's adjacent 16-bit rows (2w, 2w + 1), unpacked where they are used: a
    loaded word stays as loaded until then (16-bit values would be unpacked into registers of their
    own at the end of the loop iteration that loads them, waiting for the load)."""
    if ROW_PAIRS:
        w: tl.constexpr = v.shape[0]
        pairs = as_f32(tl.reshape(v, [w, v.shape[2], 1]), True, IS_BF16)  # [w, PL, 2]
        out = tl.reshape(tl.permute(pairs, (0, 2, 1)), [2 * w, 1, v.shape[2], 1, 1])
    else:
        out = v.to(tl.float32)
    return out


@triton.jit
def _load_token(t, valid, p_x, p_z, p_dt, p_B, p_C, s_x_t, s_z_t, s_dt_t, s_B_t, s_C_t, m_row, m_col,
                HAS_Z: tl.constexpr, A_PER_STATE: tl.constexpr, DT_TABLE: tl.constexpr):
    """Token t's inputs: x, z [R, 1, PL, 1, 1] in their dtype; dt and dA (the table's dt' and
    exp(dt' A) with DT_TABLE, else dt as stored: a scalar for Mamba-2, per row for Mamba-1); B, C
    [1, J, PL, L, V] (or their 32-bit words). Zeros unless `valid` (None: known valid); m_row,
    m_col mask rows and columns (None: all valid)."""
    b_x = _load(p_x + t * s_x_t, m_row, valid)
    b_z = b_x
    if HAS_Z:
        b_z = _load(p_z + t * s_z_t, m_row, valid)
    if A_PER_STATE:
        b_dt = _load(p_dt + t * s_dt_t, m_row, valid)
        b_dA = b_dt
    else:
        b_dt = _load(p_dt + t * s_dt_t, None, valid)
        b_dA = b_dt
        if DT_TABLE:
            b_dA = _load(p_dt + t * s_dt_t + 1, None, valid)
    b_B = _load(p_B + t * s_B_t, m_col, valid)
    b_C = _load(p_C + t * s_C_t, m_col, valid)
    return b_x, b_z, b_dt, b_dA, b_B, b_C


@triton.jit
def _update(state, b_x, b_dt, b_dA, b_B, b_C, b_A, b_dt_bias, dt_min, dt_max,
            HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, A_PER_STATE: tl.constexpr,
            DT_TABLE: tl.constexpr, PAIRS: tl.constexpr, IS_BF16: tl.constexpr,
            ROW_PAIRS: tl.constexpr, IS_BF16_X: tl.constexpr):
    """One token: the state after it and its lanes' partial sums of y [R, 1, PL, L, 1] (a sum
    over each thread's columns, in registers: each run of V, then the J runs)."""
    if A_PER_STATE:  # Mamba-1: dt' per row, a decay per state entry (b_A is log2(e) A)
        b_dt = discretize_dt(b_dt.to(tl.float32), b_dt_bias, dt_min, dt_max, HAS_DT_BIAS, DT_SOFTPLUS)
        b_dA = exp2_flush(b_dt * b_A)  # [R, J, PL, L, V]
    elif not DT_TABLE:  # Mamba-2 decode: dt' and the decay of the head, as _dt_table_kernel
        b_dt = discretize_dt(b_dt.to(tl.float32), b_dt_bias, dt_min, dt_max, HAS_DT_BIAS, DT_SOFTPLUS)
        b_dA = tl.exp(b_dt * b_A)
    state = tl.fma(state, b_dA, (b_dt * _rows(b_x, ROW_PAIRS, IS_BF16_X)) * as_f32(b_B, PAIRS, IS_BF16))
    return state, _row_dot(state, as_f32(b_C, PAIRS, IS_BF16))


@triton.jit
def _row_dot(state, b_C):
    """A thread's partial sums of y [R, 1, PL, L, 1]: its J * V products of each row (state
    [R, J, PL, L, V], C [1, J, PL, L, V]) summed in the same order for every row, as two chains
    of fused multiply-adds (even and odd columns) and one add: a tree of sums takes a multiply
    and an add for half the products, one chain twice the dependent steps."""
    s = tl.permute(state, (0, 2, 3, 1, 4))  # [R, PL, L, J, V]: the thread's columns last
    c = tl.broadcast_to(tl.permute(b_C, (0, 2, 3, 1, 4)), s.shape)
    k: tl.constexpr = s.shape[3] * s.shape[4]
    s = tl.reshape(s, [s.shape[0], s.shape[1], s.shape[2], k])
    c = tl.reshape(c, s.shape)
    acc = tl.full([s.shape[0], s.shape[1], s.shape[2]], -0.0, tl.float32)  # fma(a, b, -0) = a b
    if k == 1:
        acc = fma_chain(acc, s, c)
    else:
        s_even, s_odd = halves(s)
        c_even, c_odd = halves(c)
        acc = fma_chain(acc, s_even, c_even) + fma_chain(acc, s_odd, c_odd)
    return tl.expand_dims(tl.expand_dims(acc, 1), 4)


@triton.jit
def _y_terms(b_x, b_z, b_D, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, ROW_PAIRS: tl.constexpr,
             IS_BF16_X: tl.constexpr):
    """A token's terms of y that need no state, D x and the gate silu(z) [R, 1, PL, 1, 1] in fp32,
    computed beside its update: its output, a token later, then waits on no load (the loaded x
    and z would otherwise be copied to a third buffer at the end of the iteration loading them)."""
    b_dx = b_D
    if HAS_D:
        b_dx = b_D * _rows(b_x, ROW_PAIRS, IS_BF16_X)
    b_gate = b_dx
    if HAS_Z:
        b_z = _rows(b_z, ROW_PAIRS, IS_BF16_X)
        b_gate = b_z * tl.sigmoid(b_z)
    return b_dx, b_gate


@triton.jit
def _finish(b_yp, b_dx, b_gate, p_y, m_y, valid, HAS_D: tl.constexpr, HAS_Z: tl.constexpr):
    """Store one token's y: the lanes' partial sums b_yp [R, 1, PL, L, 1] summed over the row's
    lanes (shuffles; every lane of the row ends with the sum), + D x, times the gate (_y_terms).
    m_y [R, 1, PL, L, 1] keeps one lane per row; nothing is stored unless `valid` (None: true)."""
    b_y = tl.sum(b_yp, axis=3, keep_dims=True)
    if HAS_D:
        b_y += b_dx
    if HAS_Z:
        b_y = b_y * b_gate
    b_y = tl.broadcast_to(b_y, b_yp.shape)
    if valid is not None:
        m_y = tl.where(valid, m_y, False)
    tl.store(p_y, cast_for_store(b_y, p_y.dtype.element_ty), mask=m_y)


@triton.jit
def _advance(state, t_lo, t_hi, p_x, p_z, p_dt, p_B, p_C, p_y, s_x_t, s_z_t, s_dt_t, s_B_t, s_C_t, s_y_t,
             b_A, b_D, b_dt_bias, dt_min, dt_max, m_p, m_n, m_y,
             HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
             DT_SOFTPLUS: tl.constexpr, A_PER_STATE: tl.constexpr, DT_TABLE: tl.constexpr,
             PAIRS: tl.constexpr, IS_BF16: tl.constexpr, ROW_PAIRS: tl.constexpr, IS_BF16_X: tl.constexpr,
             DEEP: tl.constexpr):
    """Consume tokens [t_lo, t_hi) of the tile's sequence; return the state after them.

    Two tokens a loop iteration (buffers a and b), each from registers loaded before the
    iteration: the compiler places a loop body's loads at its end, so a token loaded for the next
    iteration would be waited for at its start; with DEEP the loads run an iteration further
    ahead (buffers c and d move into a and b: register copies, no waiting). An odd last token
    runs after the loop. Token t's sum over its row's lanes and its output run after token
    t + 1's update. Loads ahead of the segment's end read its last token again (never used): no
    predicates."""
    n = t_hi - t_lo
    last = t_hi - 1
    ax, az, adt, adA, aB, aC = _load_token(t_lo, n > 0, p_x, p_z, p_dt, p_B, p_C, s_x_t, s_z_t, s_dt_t, s_B_t,
                                           s_C_t, m_p, m_n, HAS_Z, A_PER_STATE, DT_TABLE)
    bx, bz, bdt, bdA, bB, bC = _load_token(t_lo + 1, n > 1, p_x, p_z, p_dt, p_B, p_C, s_x_t, s_z_t,
                                           s_dt_t, s_B_t, s_C_t, m_p, m_n, HAS_Z, A_PER_STATE, DT_TABLE)
    if DEEP:  # two more tokens in flight
        cx, cz, cdt, cdA, cB, cC = _load_token(t_lo + 2, n > 2, p_x, p_z, p_dt, p_B, p_C, s_x_t, s_z_t,
                                               s_dt_t, s_B_t, s_C_t, m_p, m_n, HAS_Z, A_PER_STATE, DT_TABLE)
        dx, dz, ddt, ddA, dB, dC = _load_token(t_lo + 3, n > 3, p_x, p_z, p_dt, p_B, p_C, s_x_t, s_z_t,
                                               s_dt_t, s_B_t, s_C_t, m_p, m_n, HAS_Z, A_PER_STATE, DT_TABLE)
    # The previous token's lane partials and y terms (none before t_lo: its store is masked).
    b_yp = tl.zeros([state.shape[0], 1, state.shape[2], state.shape[3], 1], dtype=tl.float32)
    pdx = b_D * 0.0
    pgate = pdx
    for t in tl.range(t_lo, last, 2, num_stages=1):
        state, yp = _update(state, ax, adt, adA, aB, aC, b_A, b_dt_bias, dt_min, dt_max,
                            HAS_DT_BIAS, DT_SOFTPLUS, A_PER_STATE, DT_TABLE, PAIRS, IS_BF16, ROW_PAIRS, IS_BF16_X)
        _finish(b_yp, pdx, pgate, p_y + (t - 1) * s_y_t, m_y, t > t_lo, HAS_D, HAS_Z)
        b_yp = yp
        pdx, pgate = _y_terms(ax, az, b_D, HAS_D, HAS_Z, ROW_PAIRS, IS_BF16_X)
        state, yp = _update(state, bx, bdt, bdA, bB, bC, b_A, b_dt_bias, dt_min, dt_max,
                            HAS_DT_BIAS, DT_SOFTPLUS, A_PER_STATE, DT_TABLE, PAIRS, IS_BF16, ROW_PAIRS, IS_BF16_X)
        _finish(b_yp, pdx, pgate, p_y + t * s_y_t, m_y, None, HAS_D, HAS_Z)
        b_yp = yp
        pdx, pgate = _y_terms(bx, bz, b_D, HAS_D, HAS_Z, ROW_PAIRS, IS_BF16_X)
        if DEEP:
            ax, az, adt, adA, aB, aC = cx, cz, cdt, cdA, cB, cC
            bx, bz, bdt, bdA, bB, bC = dx, dz, ddt, ddA, dB, dC
            cx, cz, cdt, cdA, cB, cC = _load_token(tl.minimum(t + 4, last), None, p_x, p_z, p_dt, p_B, p_C, s_x_t,
                                                   s_z_t, s_dt_t, s_B_t, s_C_t, m_p, m_n, HAS_Z, A_PER_STATE, DT_TABLE)
            dx, dz, ddt, ddA, dB, dC = _load_token(tl.minimum(t + 5, last), None, p_x, p_z, p_dt, p_B, p_C, s_x_t,
                                                   s_z_t, s_dt_t, s_B_t, s_C_t, m_p, m_n, HAS_Z, A_PER_STATE, DT_TABLE)
        else:
            ax, az, adt, adA, aB, aC = _load_token(tl.minimum(t + 2, last), None, p_x, p_z, p_dt, p_B, p_C, s_x_t,
                                                   s_z_t, s_dt_t, s_B_t, s_C_t, m_p, m_n, HAS_Z, A_PER_STATE, DT_TABLE)
            bx, bz, bdt, bdA, bB, bC = _load_token(tl.minimum(t + 3, last), None, p_x, p_z, p_dt, p_B, p_C, s_x_t,
                                                   s_z_t, s_dt_t, s_B_t, s_C_t, m_p, m_n, HAS_Z, A_PER_STATE, DT_TABLE)
    # An odd count leaves one token, in buffer a (otherwise its update is dropped).
    odd = n % 2 == 1
    tail, yp = _update(state, ax, adt, adA, aB, aC, b_A, b_dt_bias, dt_min, dt_max,
                       HAS_DT_BIAS, DT_SOFTPLUS, A_PER_STATE, DT_TABLE, PAIRS, IS_BF16, ROW_PAIRS, IS_BF16_X)
    state = tl.where(odd, tail, state)
    _finish(b_yp, pdx, pgate, p_y + (last - odd) * s_y_t, m_y, n > 1, HAS_D, HAS_Z)
    adx, agate = _y_terms(ax, az, b_D, HAS_D, HAS_Z, ROW_PAIRS, IS_BF16_X)
    _finish(yp, adx, agate, p_y + last * s_y_t, m_y, odd, HAS_D, HAS_Z)
    return state


@triton.jit
def _scan_kernel(
    x_ptr, dt_ptr, table_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr,
    state_in_ptr, state_out_ptr, slot_in_ptr, slot_out_ptr, has_initial_ptr, y_ptr, captured_ptr,
    cu_seqlens_ptr, cap_ptr_ptr, cap_offset_ptr, cap_row_ptr,
    seqlen, nheads, headdim, dstate, heads_per_group, dt_min, dt_max, skip_slot,
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
    DT_SOFTPLUS: tl.constexpr, A_PER_STATE: tl.constexpr, DT_TABLE: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, HAS_SLOT_IN: tl.constexpr, HAS_SLOT_OUT: tl.constexpr,
    HAS_INITIAL_FLAGS: tl.constexpr, HAS_SKIP: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_CAPTURE: tl.constexpr,
    R: tl.constexpr, J: tl.constexpr, PL: tl.constexpr, L: tl.constexpr, V: tl.constexpr,
    EVEN_P: tl.constexpr, EVEN_N: tl.constexpr, PAIRS: tl.constexpr, IS_BF16: tl.constexpr,
    OFFSETS_32: tl.constexpr, ROW_PAIRS: tl.constexpr, IS_BF16_X: tl.constexpr, DEEP: tl.constexpr,
):
    i_s = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_p = tl.program_id(2)
    i_g = i_h // heads_per_group

    i_b, bos, length = sequence_span(cu_seqlens_ptr, i_s, seqlen, IS_VARLEN)
    i_in, i_out, live, starts, length = row_slots(i_s, length, slot_in_ptr, slot_out_ptr, has_initial_ptr, skip_slot,
                                                  HAS_SLOT_IN, HAS_SLOT_OUT, HAS_INITIAL_FLAGS, HAS_SKIP)

    # The tile [R, J, PL, L, V]: rows o_p = l_p * R + r, state columns o_n = (j * L + l) * V + v
    # (lanes hold PL rows x L column runs; a thread R adjacent rows x J runs of V columns).
    o_pl = tl.arange(0, PL)[None, None, :, None, None]
    o_p = i_p * (R * PL) + o_pl * R + tl.arange(0, R)[:, None, None, None, None]
    o_l = tl.arange(0, L)[None, None, None, :, None]
    o_run = tl.arange(0, J)[None, :, None, None, None] * L + o_l
    o_n = o_run * V + tl.arange(0, V)[None, None, None, None, :]
    zero_pl = o_pl * 0
    m_p = o_p < headdim
    m_n = o_n < dstate
    m_pn = m_p & m_n
    m_y = m_p & (o_l == 0)  # one lane per row stores y

    # Pointers to token 0 of this tile's sequence; _advance adds t * stride.
    p_x = x_ptr + i_b * s_x_b + bos * s_x_t + i_h * s_x_h
    p_z = z_ptr + i_b * s_z_b + bos * s_z_t + i_h * s_z_h
    if ROW_PAIRS:  # a thread's rows as 32-bit words of two (see _rows)
        o_pair = (i_p * (R * PL) + o_pl * R) // 2 + tl.arange(0, R // 2)[:, None, None, None, None]
        p_x = p_x.to(tl.pointer_type(tl.uint32)) + o_pair
        p_z = p_z.to(tl.pointer_type(tl.uint32)) + o_pair
        m_x = o_pair * 2 < headdim
        s_x_t = s_x_t // 2
        s_z_t = s_z_t // 2
    else:
        p_x += o_p * s_x_p
        p_z += o_p * s_z_p
        m_x = m_p
    p_y = y_ptr + i_b * s_y_b + bos * s_y_t + i_h * s_y_h + o_p * s_y_p + o_l * 0
    if DT_TABLE:  # (dt', exp(dt' A)) of the head per token
        p_dt = table_ptr + ((i_b * seqlen + bos) * nheads + i_h) * 2
        s_dt_t = 2 * nheads
    else:
        p_dt = dt_ptr + i_b * s_dt_b + bos * s_dt_t + i_h * s_dt_h
        if A_PER_STATE:
            p_dt += o_p * s_dt_p
    # B and C pointers span the lanes' rows with stride 0, so the loads take the state's layout
    # ([1, J, PL, L, V]: one copy per thread, broadcast over its R rows in registers).
    p_B = B_ptr + i_b * s_B_b + bos * s_B_t + i_g * s_B_g
    p_C = C_ptr + i_b * s_C_b + bos * s_C_t + i_g * s_C_g
    if PAIRS:  # 16-bit B and C read as 32-bit words of two columns (see as_f32)
        o_w = o_run * (V // 2) + tl.arange(0, V // 2)[None, None, None, None, :]
        p_B = p_B.to(tl.pointer_type(tl.uint32)) + o_w + zero_pl
        p_C = p_C.to(tl.pointer_type(tl.uint32)) + o_w + zero_pl
        m_bc = o_w * 2 < dstate
        s_B_t = s_B_t // 2
        s_C_t = s_C_t // 2
    else:
        p_B += o_n * s_B_n + zero_pl
        p_C += o_n * s_C_n + zero_pl
        m_bc = m_n

    if A_PER_STATE:  # as log2(e) A: a decay per state entry is then one MUFU (exp2_flush)
        b_A = tl.load(A_ptr + i_h * s_A_h + o_p * s_A_p + o_n * s_A_n, mask=m_pn, other=0.0).to(tl.float32)
        b_A = b_A * 1.4426950408889634
    else:
        b_A = tl.load(A_ptr + i_h * s_A_h).to(tl.float32)
    b_D = tl.zeros([R, 1, PL, 1, 1], dtype=tl.float32)
    if HAS_D:
        b_D = tl.load(D_ptr + i_h * s_D_h + o_p * s_D_p, mask=m_p, other=0.0).to(tl.float32)
    b_dt_bias = tl.zeros([R, 1, PL, 1, 1], dtype=tl.float32)
    if HAS_DT_BIAS:
        if A_PER_STATE:
            b_dt_bias = tl.load(dt_bias_ptr + i_h * s_bias_h + o_p * s_bias_p, mask=m_p, other=0.0).to(tl.float32)
        else:
            b_dt_bias = tl.load(dt_bias_ptr + i_h * s_bias_h).to(tl.float32)

    if HAS_INITIAL_STATE:
        p_in = state_in_ptr + i_in * s_in_s + i_h * s_in_h + o_p * s_in_p + o_n * s_in_n
        state = tl.load(p_in, mask=tl.where(starts, m_pn, False), other=0.0).to(tl.float32)
    else:
        state = tl.zeros([R, J, PL, L, V], dtype=tl.float32)

    if OFFSETS_32:  # token offsets t * stride fit in 32 bits: cheaper address arithmetic
        length = length.to(tl.int32)
    # The pass as segments ending at its captures (sorted by offset), then at its end: one token
    # loop in the code, whatever is captured.
    c_lo = 0
    n_cap = 0
    if HAS_CAPTURE:
        c_lo = tl.load(cap_ptr_ptr + i_s)
        n_cap = tl.load(cap_ptr_ptr + i_s + 1) - c_lo
    done = length - length  # tokens consumed so far
    for c in range(0, n_cap + 1):
        end = length
        if HAS_CAPTURE:  # a skipped row's length is 0: its declined captures walk none of its tokens
            end = tl.minimum(tl.load(cap_offset_ptr + c_lo + c, mask=c < n_cap, other=length).to(length.dtype), length)
        state = _advance(state, done, end, p_x, p_z, p_dt, p_B, p_C, p_y, s_x_t, s_z_t, s_dt_t, s_B_t, s_C_t, s_y_t,
                         b_A, b_D, b_dt_bias, dt_min, dt_max, None if EVEN_P else m_x, None if EVEN_N else m_bc,
                         m_y, HAS_D, HAS_Z, HAS_DT_BIAS, DT_SOFTPLUS, A_PER_STATE, DT_TABLE, PAIRS, IS_BF16, ROW_PAIRS,
                         IS_BF16_X, DEEP)
        if HAS_CAPTURE:
            row = tl.load(cap_row_ptr + c_lo + c, mask=c < n_cap, other=0)
            p_cap = captured_ptr + row * s_cap_r + i_h * s_cap_h + o_p * s_cap_p + o_n * s_cap_n
            keep = c < n_cap
            if HAS_SKIP:  # an engine declines a capture by pointing it at the skip slot
                keep = keep & live & (row != skip_slot)
            tl.store(p_cap, cast_for_store(state, captured_ptr.dtype.element_ty), mask=tl.where(keep, m_pn, False))
        done = end
    p_out = state_out_ptr + i_out * s_out_s + i_h * s_out_h + o_p * s_out_p + o_n * s_out_n
    tl.store(p_out, cast_for_store(state, state_out_ptr.dtype.element_ty), mask=tl.where(live, m_pn, False))


@functools.lru_cache(maxsize=None)
def launch_config(headdim: int, dstate: int, input_bits: int, a_per_state: bool = False,
                  gated: bool = False) -> tuple[int, int, int, int, int]:
    """(R, J, PL, L, V) of a one-warp program (num_warps=1) for the model dimensions, the bits of B and C's dtype and
    the layout (a_per_state: Mamba-1; gated: y gated by z): tiles of R * PL rows x J * L * V state
    columns. A row's arithmetic does not depend on R.

    A thread owns R adjacent rows and ROW_RUN state columns of each: J runs of V columns, V being
    a 128-bit load of B and C (loaded once, shared by its rows). L = next_power_of_2(dstate) /
    ROW_RUN lanes share a row, so the sum over a row's columns is in registers, then log2(L)
    shuffles; PL = 32 / L rows sit side by side in the warp. One warp per program: the
    per-token reduction stays inside the warp (shuffles, no shared memory), and a layer's tiles
    are all resident at once: the recurrence is sequential, so a second wave would double a
    pass. ROWS_PER_THREAD = 4 (16 rows a warp at dstate 128): a 2.7B layer's 5120 rows make 320
    warps, at most one on each of an H200's 528 schedulers (8-row warps put two on some), and B
    and C's conversions are shared by more rows. Mamba-1 keeps ROWS_PER_THREAD_NARROW = 2: an exp
    per state entry makes its rows costlier, and its 5120 channels would make only 40 warps; so
    does a gated pass, whose z buffers would not fit in registers beside 4 rows' state.
    """
    block_n = triton.next_power_of_2(dstate)
    v = min(128 // input_bits, ROW_RUN, block_n)  # elements of B and C in one 128-bit load
    run = min(ROW_RUN, block_n)
    lanes = block_n // run
    pl = min(triton.next_power_of_2(headdim), max(1, 32 // lanes))
    r = min(triton.next_power_of_2(headdim) // pl, ROWS_PER_THREAD_NARROW if a_per_state or gated else ROWS_PER_THREAD)
    return r, run // v, pl, lanes, v


ROW_RUN = 16
ROWS_PER_THREAD = 4
ROWS_PER_THREAD_NARROW = 2
DT_TABLE_BLOCK_T = 32


def dt_table_shape(p: ScanProblem) -> tuple[int, int, int, int]:
    batch, seqlen, nheads, _ = p.x.shape
    return batch, seqlen, nheads, 2


def dt_table(p: ScanProblem, table: torch.Tensor | None = None) -> torch.Tensor:
    """The (batch, seqlen, nheads, 2) fp32 table of dt' and exp(dt' A) of a Mamba-2 pass, written
    into `table` (a contiguous tensor of that shape, e.g. an engine step's scratch) or a new one."""
    batch, seqlen, nheads, _ = p.x.shape
    if table is None:
        table = torch.empty(dt_table_shape(p), dtype=torch.float32, device=p.x.device)
    if table.numel() == 0:
        return table
    dt, bias = p.dt[..., 0], None if p.dt_bias is None else p.dt_bias[:, 0]
    launch(_dt_table_kernel, (triton.cdiv(seqlen, DT_TABLE_BLOCK_T), batch),
        dt, p.A, ptr_or(bias, dt), table, seqlen, nheads, p.dt_min, p.dt_max,
        *dt.stride(), p.A.stride(0), 0 if bias is None else bias.stride(0),
        HAS_DT_BIAS=bias is not None, DT_SOFTPLUS=p.dt_softplus,
        BLOCK_T=DT_TABLE_BLOCK_T, BLOCK_H=triton.next_power_of_2(nheads), num_warps=4, **EXACT_ROUNDING)
    return table


def deep_prefetch(p: ScanProblem, pairs: bool) -> bool:
    """Whether the token loop loads two iterations ahead (_advance's DEEP): where the registers
    allow it without spilling (16-bit B and C read in pairs, Mamba-2, no z, no captures). Only
    where loads are issued changes, not the arithmetic: a pass's bits are the same either way."""
    return pairs and not p.a_per_state and p.z is None and p.captures.count == 0


def _reads_pairs(a: torch.Tensor, b: torch.Tensor, dim: int = 3) -> bool:
    """Whether 16-bit a and b (same dtype) can be read as 32-bit words of two elements adjacent
    along `dim` (B and C's state columns, or x and z's rows)."""
    return (a.dtype == b.dtype and a.element_size() == 2 and a.shape[dim] % 2 == 0
            and all(t.stride(dim) == 1 and t.data_ptr() % 4 == 0
                    and all(s % 2 == 0 for d, s in enumerate(t.stride()) if d != dim) for t in (a, b)))


def _token_offsets_fit_32_bits(p: ScanProblem) -> bool:
    """Whether t * (stride along time) fits in int32 for every token t of the pass and every
    input read per token (the sequence starts are added in 64 bits)."""
    seqlen, nheads = p.x.shape[1], p.x.shape[2]
    strides = [t.stride(1) for t in (p.x, p.dt, p.B, p.C, p.y, p.z) if t is not None] + [2 * nheads]
    return seqlen * max(abs(s) for s in strides) < 2 ** 31


def run_triton(p: ScanProblem, table: torch.Tensor | None = None) -> None:
    """Launch the kernel over (sequence, head, row block); writes p.y, p.state_out, p.captured.

    Mamba-2 passes read dt' and exp(dt' A) from a table filled first (in `table` where given,
    see dt_table); a pass of one token per sequence (a decode step) computes them in the kernel
    instead, with the same code."""
    nseq = p.seqs.count
    if nseq == 0:
        return
    nheads, headdim, dstate, ngroups = p.dims
    r, j, pl, lanes, v = launch_config(headdim, dstate, p.B.element_size() * 8, p.a_per_state, p.z is not None)
    block_p = r * pl
    pairs = _reads_pairs(p.B, p.C)
    use_table = not p.a_per_state and p.x.shape[1] > 1
    table = dt_table(p, table) if use_table else None
    grid = (nseq, nheads, triton.cdiv(headdim, block_p))
    cap = p.captures
    out = p.state_out
    launch(_scan_kernel, grid,
        ptr_or(p.x, out), ptr_or(p.dt, out), ptr_or(table, out), p.A, ptr_or(p.B, out), ptr_or(p.C, out),
        ptr_or(p.D, out), ptr_or(p.z, out), ptr_or(p.dt_bias, out), ptr_or(p.state_in, out), out,
        ptr_or(p.state_index, out), ptr_or(p.state_out_index, out), ptr_or(p.has_initial, out), ptr_or(p.y, out),
        ptr_or(p.captured, out),
        ptr_or(p.seqs.cu_seqlens, out), ptr_or(cap.ptr, out), ptr_or(cap.offset, out), ptr_or(cap.row, out),
        p.x.shape[1], nheads, headdim, dstate, nheads // ngroups, p.dt_min, p.dt_max,
        0 if p.skip_slot is None else p.skip_slot,
        *p.x.stride(), *p.dt.stride(), *p.A.stride(), *p.B.stride(), *p.C.stride(),
        *strides_or_zeros(p.D, 2), *strides_or_zeros(p.z, 4), *strides_or_zeros(p.dt_bias, 2), *p.y.stride(),
        *strides_or_zeros(p.state_in, 4), *p.state_out.stride(), *p.captured.stride(),
        **flags_for(_scan_kernel, p), DT_TABLE=use_table,
        R=r, J=j, PL=pl, L=lanes, V=v, EVEN_P=headdim % block_p == 0, EVEN_N=dstate == j * lanes * v,
        PAIRS=pairs, IS_BF16=p.B.dtype == torch.bfloat16,
        OFFSETS_32=_token_offsets_fit_32_bits(p),
        ROW_PAIRS=r % 2 == 0 and not p.a_per_state and _reads_pairs(p.x, p.z if p.z is not None else p.x, dim=3),
        IS_BF16_X=p.x.dtype == torch.bfloat16,
        DEEP=deep_prefetch(p, pairs),
        num_warps=1, **EXACT_ROUNDING,
    )
