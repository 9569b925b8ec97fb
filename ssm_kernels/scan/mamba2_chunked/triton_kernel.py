"""Chunked Mamba-2 scan in Triton (the SSD algorithm) in two launches, with captures at arbitrary offsets.

Per head, with dt' the processed dt, a_i = dt'_i * A and cs the inclusive cumulative sum of a
inside a chunk, the state after token i of a chunk that starts from state S0 is

    S_i = exp(cs_i) * S0 + sum_{j <= i} exp(cs_i - cs_j) * dt'_j * x_j (outer) B_j

so inside a chunk everything is matmuls (tensor cores), and only the chunk-start states are
passed from chunk to chunk. The kernels keep cs in base-2 units (cs * log2(e)), so that every
decay is one exp2. Two launches (prepare, then chunk_pass; run in order by run_chunked_triton),
over the rows of ChunkTables.chunks (a chunk each, and a row of length 0 per empty sequence);
the scratch they share (Workspace) is contiguous, laid out (row, head or group, ...):

1. _prepare_kernel (row, head or C B^T block): dt' and cs per (row, head); C B^T once per (row,
   group), the blocks on and below the diagonal only (the causal part), in the matmul dtype. It
   also zeroes the pass's ticket and its sequences' ready counters.
2. _chunk_pass_kernel (row, head, P block), all the rest of a chunk in one program:
   - its own contribution to its end state (float32), needing no other chunk;
   - its start state: the sequence's initial state (read from its cache slot on an engine's
     path), or the end state the chunk before handed on. That is the one serial link: the
     program waits until its sequence's ready counter says the chunk before is done, reads the
     state it left in a ring of two per (sequence, head, P block), and hands its own end state
     on the same way, S_end = exp(cs_last) S0 + own. Programs take their work from a ticket
     counter in row order, so a program only ever waits on programs already running (no
     deadlock whatever order the hardware starts them in; under the interpreter, which runs
     programs one after another in grid order, every wait is already met);
   - the captures: at its start and at the sequence's end straight from the states it holds,
     inside it (offset j) as exp(cs_{j-1}) S0 + the contribution of its first j tokens (a
     matmul over j tokens: O(chunk) work a capture);
   - the final state (its sequence's last chunk), stored to its slot rounded to the state's dtype;
   - y = exp(cs) C S0^T + the causal (C B^T * decay * dt') x, row block by row block: blocks
     below the diagonal, then the diagonal block with its mask, whose x tile also serves D x;
     gated by silu(z). Below the diagonal the decay exp(cs_i - cs_j) factors through the last
     token before the row block, r: exp(cs_i - r) per row and exp(r - cs_j) per source token,
     both <= 1 (cs falls along the chunk), so an element costs a multiply instead of an exp;
     the diagonal block takes one exp per element.

Capture work writes only its own rows and leaves the states it reads as they are, so captures
cannot change a bit of y or of the final states; and the kernels are the same binaries with or
without captures (their tables are passed either way, their counts are not specialised on).

A NaN or inf in one token's inputs reaches that token and later ones only: masks are selects,
not multiplies by zero, and a non-finite x entry of the diagonal block is kept out of its matmul
and marks its column NaN from its row on (NaN where the float64 reference may give +-inf).

Matmuls: bfloat16 and float16 inputs multiply in bfloat16 (MATMUL_DTYPES: float16's range is too
small for the chunk-start states and C B^T) with float32 accumulation (tensor cores: wgmma on
Hopper at the tiles of launch_config); float32 inputs multiply in IEEE float32
(input_precision="ieee": FMA, not tf32, whose 10-bit mantissa would miss the 1e-4 accuracy).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..problem import ScanProblem
from ..._triton import (flags_for, INTERPRETED, cast_for_store, discretize_dt, exp2_flush, ptr_or, rounded,
                        row_slots, strides_or_zeros)
from .tables import ChunkCapture, ChunkRow, ChunkTables

LOG2E = tl.constexpr(1.4426950408889634)
# 2^-160 is 0 in float32 (its least denormal is 2^-149): a decay whose log2 is at most this far
# below zero is zero, however it is computed. A token's log2 decay floored at -ZERO_DECAY_LOG2 minus
# the chunk's positive log decays keeps every decay across it at zero, as it was: the floor
# changes no result, only cs's magnitude.
ZERO_DECAY_LOG2 = tl.constexpr(160.0)
# Row widths of ChunkTables's int64 tables, whose columns the readers below load in tables.py's order.
ROW_COLUMNS = tl.constexpr(len(ChunkRow._fields))
CAPTURE_COLUMNS = tl.constexpr(len(ChunkCapture._fields))


@triton.jit
def _dot(a, b, DOT_DTYPE: tl.constexpr):
    """a @ b, accumulated in fp32, operands (fp32, or already in DOT_DTYPE as loaded: no round
    trip through fp32 registers) rounded to DOT_DTYPE (float32: IEEE, no tf32). The interpreter's
    tl.dot multiplies the raw bits of bfloat16 operands, so there the rounded operands are
    multiplied in fp32: the same products, exact in fp32."""
    if DOT_DTYPE == tl.float32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif INTERPRETED:
        out = tl.dot(rounded(a, DOT_DTYPE), rounded(b, DOT_DTYPE), input_precision="ieee")
    else:
        out = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE))
    return out


@triton.jit
def _chunk_row(chunks_ptr, i_r):
    """Row i_r of ChunkTables.chunks: ChunkRow's fields in order."""
    p = chunks_ptr + i_r * ROW_COLUMNS
    return (tl.load(p), tl.load(p + 1), tl.load(p + 2), tl.load(p + 3), tl.load(p + 4), tl.load(p + 5),
            tl.load(p + 6), tl.load(p + 7))


@triton.jit
def _chunk_capture(captures_ptr, i):
    """Row i of ChunkTables.captures, less its chunk: ChunkCapture's (entry, offset)."""
    p = captures_ptr + i * CAPTURE_COLUMNS
    return tl.load(p), tl.load(p + 2)


@triton.jit
def _chunk_contribution(p_x, p_B, p_dt, p_cs, n_tok, s_x_t, s_x_p, s_B_t, s_B_n, o_p, m_p, o_n, m_n,
                        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_DTYPE: tl.constexpr):
    """sum over the chunk's first n_tok tokens j of exp(cs_{n_tok-1} - cs_j) dt'_j x_j (outer) B_j.

    p_x, p_B point at the chunk's first token (this head / its group); p_dt, p_cs at the chunk's
    scratch rows. Returns a [BLOCK_P, BLOCK_N] fp32 tile (zeros when n_tok is 0)."""
    b_cs_end = tl.load(p_cs + tl.maximum(n_tok - 1, 0))
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, n_tok, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < n_tok
        b_w = exp2_flush(b_cs_end - tl.load(p_cs + o_k, mask=m_k, other=0.0)) * tl.load(p_dt + o_k, mask=m_k, other=0.0)
        b_xT = tl.load(p_x + o_p[:, None] * s_x_p + o_k[None, :] * s_x_t,
                       mask=m_p[:, None] & m_k[None, :], other=0.0).to(tl.float32)  # [BP, BK]
        b_B = tl.load(p_B + o_k[:, None] * s_B_t + o_n[None, :] * s_B_n,
                      mask=m_k[:, None] & m_n[None, :], other=0.0)  # [BK, BN]
        acc += _dot(b_xT * b_w[None, :], b_B, DOT_DTYPE)
    return acc


@triton.jit
def _dt_cumsum(dt_ptr, A_ptr, dt_bias_ptr, dt_out_ptr, cs_out_ptr, i_r, i_h, i_b, t0, n_tok, nheads, dt_min, dt_max,
               s_dt_b, s_dt_t, s_dt_h, s_A_h, s_bias_h,
               HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, CHUNK: tl.constexpr):
    """dt' and cs of row i_r's chunk for head i_h, into the scratch."""
    o_t = tl.arange(0, CHUNK)
    m_t = o_t < n_tok
    b_dt = tl.load(dt_ptr + i_b * s_dt_b + (t0 + o_t) * s_dt_t + i_h * s_dt_h, mask=m_t, other=0.0).to(tl.float32)
    b_bias = 0.0
    if HAS_DT_BIAS:
        b_bias = tl.load(dt_bias_ptr + i_h * s_bias_h).to(tl.float32)
    b_dt = discretize_dt(b_dt, b_bias, dt_min, dt_max, HAS_DT_BIAS, DT_SOFTPLUS)
    b_dt = tl.where(m_t, b_dt, 0.0)  # tokens past the chunk neither decay nor contribute
    b_a = b_dt * (tl.load(A_ptr + i_h * s_A_h).to(tl.float32) * LOG2E)  # log2 of each token's decay
    # A token's log decay is raised to the least value that still zeroes every decay across it
    # (see ZERO_DECAY_LOG2): a reset's -1e5 would otherwise leave cs so large that the differences
    # of later tokens' cs lose float32's precision. Selects, not max/min: a NaN token stays NaN
    # and reaches no token before it.
    floor = -ZERO_DECAY_LOG2 - tl.sum(tl.where(b_a > 0.0, b_a, 0.0), axis=0)
    b_cs = tl.cumsum(tl.where(b_a < floor, floor, b_a), axis=0)
    o_scr = (i_r * nheads + i_h) * CHUNK + o_t
    tl.store(dt_out_ptr + o_scr, b_dt)
    tl.store(cs_out_ptr + o_scr, b_cs)  # past the chunk's last token cs stays at its last value


@triton.jit
def _chunk_cb(B_ptr, C_ptr, cb_ptr, i_r, i_g, i_m, i_k, i_b, t0, n_tok, dstate, ngroups,
              s_B_b, s_B_t, s_B_g, s_B_n, s_C_b, s_C_t, s_C_g, s_C_n,
              CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Block (i_m, i_k) of row i_r's C B^T for group i_g, in the matmul dtype."""
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_k = i_k * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    p_C = C_ptr + i_b * s_C_b + (t0 + o_m)[:, None] * s_C_t + i_g * s_C_g
    p_BT = B_ptr + i_b * s_B_b + (t0 + o_k)[None, :] * s_B_t + i_g * s_B_g
    acc = tl.zeros([BLOCK_M, BLOCK_M], dtype=tl.float32)
    for d0 in range(0, dstate, BLOCK_D):
        m_d = d0 + o_d < dstate
        b_C = tl.load(p_C + (d0 + o_d)[None, :] * s_C_n, mask=(o_m < n_tok)[:, None] & m_d[None, :], other=0.0)
        b_BT = tl.load(p_BT + (d0 + o_d)[:, None] * s_B_n, mask=m_d[:, None] & (o_k < n_tok)[None, :], other=0.0)
        acc += _dot(b_C, b_BT, DOT_DTYPE)
    p_cb = cb_ptr + (i_r * ngroups + i_g) * CHUNK * CHUNK + o_m[:, None] * CHUNK + o_k[None, :]
    tl.store(p_cb, cast_for_store(acc, p_cb.dtype.element_ty))


@triton.jit
def _prepare_kernel(dt_ptr, A_ptr, dt_bias_ptr, B_ptr, C_ptr, chunks_ptr, dt_out_ptr, cs_out_ptr, cb_ptr,
                    ready_ptr, ticket_ptr, nheads, ngroups, n_pblocks, dstate, dt_min, dt_max,
                    s_dt_b, s_dt_t, s_dt_h, s_A_h, s_bias_h,
                    s_B_b, s_B_t, s_B_g, s_B_n, s_C_b, s_C_t, s_C_g, s_C_n,
                    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, CHUNK: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Launch 1, a program per (row, head or C B^T block): dt' and cs per (row, head), with the
    pass's ticket and its sequences' ready counters zeroed; C B^T per (row, group, block on or
    below the diagonal)."""
    i_r = tl.program_id(0).to(tl.int64)
    i_j = tl.program_id(1)
    i_b, t0, n_tok, i_s, index, _, _, _ = _chunk_row(chunks_ptr, i_r)
    if i_j < nheads:
        i_h = i_j.to(tl.int64)
        _dt_cumsum(dt_ptr, A_ptr, dt_bias_ptr, dt_out_ptr, cs_out_ptr, i_r, i_h, i_b, t0, n_tok, nheads,
                   dt_min, dt_max, s_dt_b, s_dt_t, s_dt_h, s_A_h, s_bias_h, HAS_DT_BIAS, DT_SOFTPLUS, CHUNK)
        if index == 0:
            for i_pb in range(0, n_pblocks):
                tl.store(ready_ptr + (i_s * nheads + i_h) * n_pblocks + i_pb, 0)
        if (i_r == 0) & (i_h == 0):
            tl.store(ticket_ptr, 0)
    else:
        nm = CHUNK // BLOCK_M
        i_blk = i_j - nheads
        i_g = i_blk // (nm * nm)
        i_m = (i_blk // nm) % nm
        i_k = i_blk % nm
        if i_k <= i_m:  # blocks above the diagonal are never read
            _chunk_cb(B_ptr, C_ptr, cb_ptr, i_r, i_g, i_m, i_k, i_b, t0, n_tok, dstate, ngroups,
                      s_B_b, s_B_t, s_B_g, s_B_n, s_C_b, s_C_t, s_C_g, s_C_n, CHUNK, BLOCK_M, BLOCK_D, DOT_DTYPE)


@triton.jit
def _wait_ready(p_ready, index):
    """Wait until the chunk before this one in its sequence (index - 1) has handed its end state on."""
    seen = tl.atomic_add(p_ready, 0, sem="acquire")
    while seen < index:
        seen = tl.atomic_add(p_ready, 0, sem="acquire")
    tl.debug_barrier()  # every thread reads the handed state after the wait


@triton.jit
def _hand_on(p_ready):
    """Let the next chunk of the sequence go: every thread's store of the end state comes before."""
    tl.debug_barrier()
    tl.atomic_add(p_ready, 1, sem="release")


@triton.jit
def _chunk_output(x_ptr, C_ptr, D_ptr, z_ptr, y_ptr, p_dt, p_cs, p_cb, b_S0T, i_b, t0, n_tok, i_h, i_g, o_p, m_p,
                  o_n, m_n, s_x_b, s_x_t, s_x_h, s_x_p, s_C_b, s_C_t, s_C_g, s_C_n, s_D_h, s_D_p,
                  s_z_b, s_z_t, s_z_h, s_z_p, s_y_b, s_y_t, s_y_h, s_y_p,
                  HAS_D: tl.constexpr, HAS_Z: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                  DOT_DTYPE: tl.constexpr):
    """y of the chunk's tokens for the P block o_p, row block by row block, from its start state
    (b_S0T: [N, P] in the matmul dtype)."""
    o_j = tl.arange(0, BLOCK_M)
    p_x = x_ptr + i_b * s_x_b + t0 * s_x_t + i_h * s_x_h + o_p[None, :] * s_x_p
    for m0 in range(0, n_tok, BLOCK_M):
        o_m = m0 + o_j  # output tokens (rows); source blocks have the same size
        m_m = o_m < n_tok
        # Scratch rows hold CHUNK entries (dt' = 0 past the chunk's end): no masks needed.
        b_cs_m = tl.load(p_cs + o_m)
        b_ref = tl.where(m0 > 0, tl.load(p_cs + tl.maximum(m0 - 1, 0)), 0.0)  # cs before the row block
        # Inter-chunk term: the start state read out by C, decayed to the token before the rows.
        b_C = tl.load(C_ptr + i_b * s_C_b + (t0 + o_m)[:, None] * s_C_t + i_g * s_C_g + o_n[None, :] * s_C_n,
                      mask=m_m[:, None] & m_n[None, :], other=0.0)
        acc = _dot(b_C, b_S0T, DOT_DTYPE) * exp2_flush(b_ref)
        # Source blocks strictly below the diagonal (every token valid, causal), decayed to the same token.
        for k0 in range(0, m0, BLOCK_M):
            o_k = k0 + o_j
            b_w = tl.load(p_cb + o_m[:, None] * CHUNK + o_k[None, :]).to(tl.float32) \
                * (exp2_flush(b_ref - tl.load(p_cs + o_k)) * tl.load(p_dt + o_k))[None, :]
            b_x = tl.load(p_x + o_k[:, None] * s_x_t, mask=m_p[None, :], other=0.0)  # [BK, BP]
            acc += _dot(b_w, b_x, DOT_DTYPE)
        acc *= exp2_flush(b_cs_m - b_ref)[:, None]
        # The diagonal block: causal, by selects (a NaN above the diagonal must not leak into
        # earlier rows); its x tile is this block's own x, reused for D x. A non-finite x entry
        # is left out of the matmul, where the zero weights of earlier rows would turn it into
        # NaN for them, and marks its column NaN from its row on.
        causal = o_m[:, None] >= o_m[None, :]
        b_decay = exp2_flush(tl.where(causal, b_cs_m[:, None] - b_cs_m[None, :], -float("inf")))
        b_w = tl.where(causal, tl.load(p_cb + o_m[:, None] * CHUNK + o_m[None, :]).to(tl.float32)
                       * tl.load(p_dt + o_m)[None, :] * b_decay, 0.0)
        m_mp = m_m[:, None] & m_p[None, :]
        b_x = tl.load(p_x + o_m[:, None] * s_x_t, mask=m_mp, other=0.0)  # [BM, BP]
        bad = ~(tl.abs(b_x.to(tl.float32)) < float("inf"))
        acc += _dot(b_w, tl.where(bad, 0.0, b_x), DOT_DTYPE)
        first_bad = tl.min(tl.where(bad, o_m[:, None], CHUNK), axis=0)  # [BP]
        acc = tl.where(o_m[:, None] >= first_bad[None, :], float("nan"), acc)
        if HAS_D:
            acc += tl.load(D_ptr + i_h * s_D_h + o_p * s_D_p, mask=m_p, other=0.0).to(tl.float32)[None, :] \
                * b_x.to(tl.float32)
        if HAS_Z:
            b_z = tl.load(z_ptr + i_b * s_z_b + (t0 + o_m)[:, None] * s_z_t + i_h * s_z_h + o_p[None, :] * s_z_p,
                          mask=m_mp, other=0.0).to(tl.float32)
            acc = acc * b_z * tl.sigmoid(b_z)
        p_y = y_ptr + i_b * s_y_b + (t0 + o_m)[:, None] * s_y_t + i_h * s_y_h + o_p[None, :] * s_y_p
        tl.store(p_y, cast_for_store(acc, p_y.dtype.element_ty), mask=m_mp)


@triton.jit
def _chunk_pass_kernel(x_ptr, B_ptr, C_ptr, D_ptr, z_ptr, y_ptr, dt_ptr, cs_ptr, cb_ptr, chunks_ptr, captures_ptr,
                       capture_rows_ptr,
                       ready_ptr, ticket_ptr, handoff_ptr, state_in_ptr, slot_in_ptr, has_initial_ptr,
                       state_out_ptr, captured_ptr, skip_slot, headdim, dstate, nheads, heads_per_group, n_pblocks,
                       s_x_b, s_x_t, s_x_h, s_x_p, s_B_b, s_B_t, s_B_g, s_B_n, s_C_b, s_C_t, s_C_g, s_C_n,
                       s_D_h, s_D_p, s_z_b, s_z_t, s_z_h, s_z_p, s_y_b, s_y_t, s_y_h, s_y_p,
                       s_in_s, s_in_h, s_in_p, s_in_n, s_out_s, s_out_h, s_out_p, s_out_n,
                       s_cap_r, s_cap_h, s_cap_p, s_cap_n,
                       HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_INITIAL_STATE: tl.constexpr,
                       HAS_SLOT_IN: tl.constexpr, HAS_INITIAL_FLAGS: tl.constexpr, HAS_SKIP: tl.constexpr,
                       CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Launch 2, a program per (row, head, P block), in ticket order (module doc)."""
    # Tickets hand out the work in row order: whatever order the hardware starts programs in, a
    # program waits only on rows whose tickets went to programs already running.
    ticket = tl.atomic_add(ticket_ptr, 1, sem="relaxed").to(tl.int64)
    i_r = ticket // (nheads * n_pblocks)
    i_h = ticket % nheads
    i_pb = (ticket // nheads) % n_pblocks
    i_g = i_h // heads_per_group
    i_b, t0, n_tok, i_s, index, last, capture_first, capture_end = _chunk_row(chunks_ptr, i_r)
    i_in, i_out, live, starts, n_tok = row_slots(i_s, n_tok, slot_in_ptr, slot_in_ptr, has_initial_ptr, skip_slot,
                                                 HAS_SLOT_IN, False, HAS_INITIAL_FLAGS, HAS_SKIP)
    if live:
        o_p = i_pb * BLOCK_P + tl.arange(0, BLOCK_P)
        o_n = tl.arange(0, BLOCK_N)
        m_p = o_p < headdim
        m_n = o_n < dstate
        m_pn = m_p[:, None] & m_n[None, :]
        o_pn = o_p[:, None] * dstate + o_n[None, :]
        o_scr = (i_r * nheads + i_h) * CHUNK
        p_dt = dt_ptr + o_scr
        p_cs = cs_ptr + o_scr
        p_x = x_ptr + i_b * s_x_b + t0 * s_x_t + i_h * s_x_h
        p_B = B_ptr + i_b * s_B_b + t0 * s_B_t + i_g * s_B_g
        # The chunk's own contribution to its end state: no other chunk's work needed.
        own = _chunk_contribution(p_x, p_B, p_dt, p_cs, n_tok, s_x_t, s_x_p, s_B_t, s_B_n, o_p, m_p, o_n, m_n,
                                  BLOCK_P, BLOCK_N, BLOCK_K, DOT_DTYPE)
        # The start state: the sequence's initial state, or what the chunk before handed on
        # (through a ring of two per (sequence, head, P block), read past the L1 cache, which
        # another SM's writes do not update).
        p_ready = ready_ptr + (i_s * nheads + i_h) * n_pblocks + i_pb
        p_hand = handoff_ptr + ((i_s * nheads + i_h) * 2) * headdim * dstate + o_pn
        if index > 0:
            _wait_ready(p_ready, index)
            prev = tl.load(p_hand + ((index - 1) % 2) * headdim * dstate, mask=m_pn, other=0.0, cache_modifier=".cg")
        else:
            prev = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
            if HAS_INITIAL_STATE:
                if starts:
                    prev = tl.load(state_in_ptr + i_in * s_in_s + i_h * s_in_h + o_p[:, None] * s_in_p
                                   + o_n[None, :] * s_in_n, mask=m_pn, other=0.0).to(tl.float32)
        # One explicit fused multiply-add: the bits of a chunk-grid state must not depend on how the
        # compiler contracts this line in each specialisation (a pass with and without an initial
        # state, or on an engine's slots).
        state = tl.where(n_tok > 0, tl.fma(exp2_flush(tl.load(p_cs + CHUNK - 1)), prev, own), prev)
        if last == 0:
            tl.store(p_hand + (index % 2) * headdim * dstate, state, mask=m_pn)
            _hand_on(p_ready)
        else:
            p_out = state_out_ptr + i_in * s_out_s + i_h * s_out_h + o_p[:, None] * s_out_p + o_n[None, :] * s_out_n
            tl.store(p_out, cast_for_store(state, p_out.dtype.element_ty), mask=m_pn)
        # Captures: at the chunk's start and end the states held, inside it (offset j)
        # exp(cs_{j-1}) S0 + the contribution of its first j tokens. Rows come from the capture
        # table on the device (an engine's slots; its skip slot declines one).
        p_cap = captured_ptr + i_h * s_cap_h + o_p[:, None] * s_cap_p + o_n[None, :] * s_cap_n
        for i in range(capture_first, capture_end):
            entry, j = _chunk_capture(captures_ptr, i)
            row = tl.load(capture_rows_ptr + entry)
            keep = row >= 0
            if HAS_SKIP:
                keep = keep & (row != skip_slot)
            if keep:
                b_cap = prev
                if j == n_tok:
                    b_cap = state
                elif j > 0:
                    b_cap = tl.fma(exp2_flush(tl.load(p_cs + j - 1)), prev, _chunk_contribution(
                        p_x, p_B, p_dt, p_cs, j, s_x_t, s_x_p, s_B_t, s_B_n, o_p, m_p, o_n, m_n,
                        BLOCK_P, BLOCK_N, BLOCK_K, DOT_DTYPE))
                tl.store(p_cap + row * s_cap_r, cast_for_store(b_cap, captured_ptr.dtype.element_ty), mask=m_pn)
        b_S0T = cast_for_store(tl.trans(prev), DOT_DTYPE)
        p_cb = cb_ptr + (i_r * (nheads // heads_per_group) + i_g) * CHUNK * CHUNK
        _chunk_output(x_ptr, C_ptr, D_ptr, z_ptr, y_ptr, p_dt, p_cs, p_cb, b_S0T, i_b, t0, n_tok, i_h, i_g, o_p, m_p,
                      o_n, m_n, s_x_b, s_x_t, s_x_h, s_x_p, s_C_b, s_C_t, s_C_g, s_C_n, s_D_h, s_D_p,
                      s_z_b, s_z_t, s_z_h, s_z_p, s_y_b, s_y_t, s_y_h, s_y_p, HAS_D, HAS_Z, CHUNK, BLOCK_M, DOT_DTYPE)


_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}
# The matmul dtype of each input dtype. float16 multiplies in bfloat16: C B^T and the chunk-start
# states, stored and multiplied in it, may pass float16's 65504 where y does not.
MATMUL_DTYPES = {torch.float32: torch.float32, torch.bfloat16: torch.bfloat16, torch.float16: torch.bfloat16}


def launch_config(headdim: int, dstate: int, chunk_size: int, dtype: torch.dtype) -> dict:
    """Tiles and warps, a function of the model dimensions, chunk size and input dtype alone (never
    of sequence lengths or batch composition, which would change rounding between passes).

    A chunk-pass program holds a whole (BLOCK_P, dstate) state tile. 16-bit inputs: 64-row tiles
    with 4 warps (one warpgroup: Hopper's wgmma takes M = 64 per warpgroup); float32 inputs run
    IEEE FMA dots, whose operands live in registers: 8 warps and a smaller K block keep them from
    spilling. tl.dot needs every block >= 16.
    """
    wide = dtype != torch.float32
    block_n = max(16, triton.next_power_of_2(dstate))
    return dict(
        BLOCK_M=min(chunk_size, 64),  # output rows and source tokens of y, C B^T tiles
        BLOCK_P=max(16, min(64, triton.next_power_of_2(headdim))),
        BLOCK_N=block_n,  # the state tile's dstate
        BLOCK_K=min(chunk_size, 64 if wide else 32),  # source tokens of chunk states and captures
        BLOCK_D=min(block_n, 128 if wide else 32),  # dstate block of C B^T
        prepare=dict(num_warps=4, num_stages=3 if wide else 2),
        chunk_pass=dict(num_warps=4, num_stages=2) if wide else dict(num_warps=8, num_stages=2),
    )


@dataclass(frozen=True)
class Workspace:
    """A pass's launch configuration and the scratch its launches share (module doc)."""

    cfg: dict  # launch_config's
    dt: torch.Tensor  # (nrows, nheads, chunk) float32: dt', 0 past the chunk's end (launch 1)
    cs: torch.Tensor  # (nrows, nheads, chunk) float32: cumulative log2 decay, cs_last past the end (launch 1)
    cb: torch.Tensor  # (nrows, ngroups, chunk, chunk) matmul dtype: C B^T on and below the diagonal (launch 1)
    ready: torch.Tensor  # (nseq, nheads, P blocks) int32: chunks of the sequence that handed their state on
    ticket: torch.Tensor  # (1,) int32: the next chunk-pass program's work
    handoff: torch.Tensor  # (nseq, nheads, 2, headdim, dstate) float32: the ring of handed-on states

    @property
    def dot(self) -> dict:
        """The matmul dtype, as the kernels take it."""
        return dict(DOT_DTYPE=_DOT_DTYPES[self.cb.dtype])

    @property
    def n_pblocks(self) -> int:
        return self.ready.shape[2]


def new_workspace(p: ScanProblem, tables: ChunkTables) -> Workspace:
    """The workspace of a pass, unwritten."""
    nheads, headdim, dstate, ngroups = p.dims
    chunk, nrows, nseq = tables.chunk_size, tables.nrows, p.seqs.count
    cfg = launch_config(headdim, dstate, chunk, p.x.dtype)
    device = p.x.device
    f32, mm = dict(dtype=torch.float32, device=device), dict(dtype=MATMUL_DTYPES[p.x.dtype], device=device)
    i32 = dict(dtype=torch.int32, device=device)
    return Workspace(
        cfg, torch.empty(nrows, nheads, chunk, **f32), torch.empty(nrows, nheads, chunk, **f32),
        torch.empty(nrows, ngroups, chunk, chunk, **mm),
        torch.empty(nseq, nheads, triton.cdiv(headdim, cfg["BLOCK_P"]), **i32), torch.empty(1, **i32),
        torch.empty(nseq, nheads, 2, headdim, dstate, **f32))


def prepare(p: ScanProblem, tables: ChunkTables, ws: Workspace) -> None:
    """Launch 1, a program per (row, head or C B^T block): ws.dt, ws.cs, ws.cb; ws.ticket and
    ws.ready zeroed."""
    _, _, dstate, ngroups = p.dims
    nheads = p.dims[0]
    nm = tables.chunk_size // ws.cfg["BLOCK_M"]
    dt, A = p.dt[..., 0], p.A[:, 0, 0]  # Mamba-2: one dt and one decay per head
    dt_bias = p.dt_bias[:, 0] if p.dt_bias is not None else None
    _prepare_kernel[(tables.nrows, nheads + ngroups * nm * nm)](
        dt, A, ptr_or(dt_bias, A), p.B, p.C, tables.chunks, ws.dt, ws.cs, ws.cb, ws.ready, ws.ticket,
        nheads, ngroups, ws.n_pblocks, dstate, p.dt_min, p.dt_max,
        *dt.stride(), A.stride(0), *strides_or_zeros(dt_bias, 1), *p.B.stride(), *p.C.stride(),
        **flags_for(_prepare_kernel, p), CHUNK=tables.chunk_size, BLOCK_M=ws.cfg["BLOCK_M"],
        BLOCK_D=ws.cfg["BLOCK_D"], **ws.dot, **ws.cfg["prepare"])


def chunk_pass(p: ScanProblem, tables: ChunkTables, ws: Workspace) -> None:
    """Launch 2, a program per (row, head, P block): p.y, the final states (p.state_out, or the
    slots of p.state_index) and p.captured, from ws.dt, ws.cs and ws.cb."""
    nheads, headdim, dstate, ngroups = p.dims
    out = p.state_out  # a stand-in for absent inputs
    _chunk_pass_kernel[(tables.nrows * nheads * ws.n_pblocks,)](
        p.x, p.B, p.C, ptr_or(p.D, out), ptr_or(p.z, out), ptr_or(p.y, out), ws.dt, ws.cs, ws.cb, tables.chunks,
        ptr_or(tables.captures, tables.chunks), ptr_or(p.captures.row, tables.chunks), ws.ready, ws.ticket,
        ws.handoff, ptr_or(p.state_in, out),
        ptr_or(p.state_index, tables.chunks), ptr_or(p.has_initial, tables.chunks), out, ptr_or(p.captured, out),
        0 if p.skip_slot is None else p.skip_slot, headdim, dstate, nheads, nheads // ngroups, ws.n_pblocks,
        *p.x.stride(), *p.B.stride(), *p.C.stride(), *strides_or_zeros(p.D, 2), *strides_or_zeros(p.z, 4),
        *p.y.stride(), *strides_or_zeros(p.state_in, 4), *out.stride(), *p.captured.stride(),
        **flags_for(_chunk_pass_kernel, p), CHUNK=tables.chunk_size, BLOCK_M=ws.cfg["BLOCK_M"],
        BLOCK_P=ws.cfg["BLOCK_P"], BLOCK_N=ws.cfg["BLOCK_N"], BLOCK_K=ws.cfg["BLOCK_K"], **ws.dot,
        **ws.cfg["chunk_pass"])


LAUNCHES = (prepare, chunk_pass)


def run_chunked_triton(p: ScanProblem, tables: ChunkTables, ws: Workspace | None = None) -> None:
    """The two launches in order; writes p.y, the final states and p.captured. ws: a workspace of
    this pass's shapes to reuse (a serving step's layers share one), else a new one."""
    assert not p.a_per_state and p.state_out_index is None, "the chunked scan serves mamba2_scan only"
    if not tables.nrows:
        return
    ws = ws or new_workspace(p, tables)
    for launch in LAUNCHES:
        launch(p, tables, ws)
