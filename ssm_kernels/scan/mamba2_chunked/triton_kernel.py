"""Chunked Mamba-2 scan in Triton (the SSD algorithm), with captures at arbitrary offsets.

Per head, with dt' the processed dt, a_i = dt'_i * A and cs the inclusive cumulative sum of a
inside a chunk, the state after token i of a chunk that starts from state S0 is

    S_i = exp(cs_i) * S0 + sum_{j <= i} exp(cs_i - cs_j) * dt'_j * x_j (outer) B_j

so inside a chunk everything is matmuls (tensor cores), and only the chunk-start states are
passed from chunk to chunk. The kernels keep cs in base-2 units (cs * log2(e)), so that every
decay is one exp2. Five stages, each one kernel over a grid fixed by the chunk grid and the
model dimensions, launched by its own function (stage1_dt_cumsum ... stage5_chunk_output, run in
order by run_chunked_triton); the scratch they pass one another (Workspace) is contiguous, laid
out (chunk or capture, head or group, ...):

1. _dt_cumsum_kernel     (chunk, head):               dt', cs and the chunk's decay exp(cs_last).
2. _chunk_cb_kernel      (chunk x group, block on or below the diagonal): C B^T once per (chunk,
   group), the causal blocks only, in the matmul dtype.
3. _chunk_state_kernel   (chunk + capture rows, head, P x N block): each chunk's own
   contribution to its end state, in the matmul dtype (float32 accumulation, rounded once as
   stored: half the bytes of float32 through memory, written here and read by kernel 4), and a
   mark where the chunk's x holds a non-finite entry (`nonfinite`, a (chunk, head, P block) byte);
   the grid rows past the chunks, one per capture inside a chunk (offset j), the contribution of
   its chunk's first j tokens, likewise (`partial`), beside the chunks' programs rather than after
   them.
4. _state_passing_kernel (sequence, head, P*N block): walks a sequence's chunks in order,
   S_{c+1} = decay_c * S_c + own_c, and writes each chunk-start state in the matmul dtype (the
   output kernel's operand), the final state, and the captures: at chunk starts and sequence
   ends straight from the state it holds, inside a chunk as exp(cs_{j-1}) S0 + partial from the
   float32 S0 it holds and the partial (kernel 3). It streams a flat P*N block per program, so
   it is many programs moving memory, not one walk per head; its walk has one step a chunk (one
   per start or inner capture where a chunk has several, ChunkTables.steps), with no loop nested
   in it, and Triton pipelines it: each step's table row and loads are requested two steps ahead.
   A pass with no capture at a chunk's start or inside one walks the chunks without the step
   table (ChunkTables.plain_walk, _walk_chunks): the same operations, a third of the instructions.
   On an engine's cache it reads each row's initial state from its slot and writes the
   final state there, and leaves skipped rows alone (as kernel 5 does their y).
5. _chunk_output_kernel  (M x P block, head, chunk: launched in that order): y = exp(cs) C S0^T + the causal
   (C B^T * decay * dt') x, block by block below the diagonal, then the diagonal block with its
   mask, whose x tile also serves D x; gated by silu(z). Below the diagonal the decay
   exp(cs_i - cs_j) factors through the last token before the row block, r: exp(cs_i - r) per
   row and exp(r - cs_j) per source token, both <= 1 (cs falls along the chunk), so an element
   costs a multiply instead of an exp; the diagonal block takes one exp per element. A program
   reads its chunk's span from the chunk table, or finds it from the chunk's index where each
   sequence starts its own batch row on the grid (ChunkTables.row_chunks). Then its fix-up,
   _nonfinite_output_kernel: the marked (chunk, head, P block)s' y again, with the diagonal
   block's non-finite handling (below), by the same program; a few programs, each of which reads
   its marks and, nearly always, ends there.

The fused pass (opt-in: SSM_KERNELS_FUSED_SSD=1, fused_pass()) runs stages 2 to 5 in one launch
(_fused_pass_kernel, stage2to5_fused) with the same program functions as their kernels: its
programs take tickets in chunk order and wait on one another's flags; a chunk program computes a
block of its chunk's own contribution and then walks the chunk on that block, from the state the
chunk before left (docs/chunked.md, "The fused pass").

The capture work writes only its own buffers, and the walk's extra steps for a chunk's further
captures leave its state as it is, so captures cannot change a bit of y or of the final states;
and every kernel is the same binary with or without captures (their tables are passed either way,
their counts are not specialised on). A capture names its CaptureTable entry, whose row (an
engine's slot; its skip slot declines one) the walk reads on the device. An inner capture costs
its partial in the matmul dtype (written by kernel 3, read by kernel 4) and its own store.

A NaN or inf in one token's inputs reaches that token and later ones only: masks are selects, not
multiplies by zero, and a non-finite x entry of the diagonal block is kept out of its matmul and
marks its column NaN from its row on (NaN where the float64 reference may give +-inf): by the
output kernel's fix-up, for the (chunk, head, P block)s stage 3 marked, so that the output kernel
itself never tests x (the fused pass's output programs test every block).

Matmuls: bfloat16 and float16 inputs multiply in bfloat16 (MATMUL_DTYPES: float16's range is too
small for the chunk-start states and C B^T) with float32 accumulation (tensor cores: wgmma on
Hopper at the tiles of launch_config), but for C B^T, whose operands are the inputs B and C and
multiply in their own dtype (cb_dot_dtype); float32 inputs multiply in IEEE float32
(input_precision="ieee": FMA, not tf32, whose 10-bit mantissa would miss the 1e-4 accuracy).
The state carried from chunk to chunk is float32; each chunk's own contribution to it, and an
inner capture's partial, are rounded once to the matmul dtype on the way (16-bit passes), within
the 1e-2 of every 16-bit result.
"""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..problem import ScanProblem
from ..._triton import (flags_for, INTERPRETED, cast_for_store, discretize_dt, exp2_flush, launch, ptr_or, rounded,
                        row_slots, strides_or_zeros)
from .tables import STEP_WIDTH, ChunkCapture, ChunkRow, ChunkTables, Step

LOG2E = tl.constexpr(1.4426950408889634)
# 2^-160 is 0 in float32 (its least denormal is 2^-149): a decay whose log2 is at most this far
# below zero is zero, however it is computed. A token's log2 decay floored at -ZERO_DECAY_LOG2 minus
# the chunk's positive log decays keeps every decay across it at zero, as it was: the floor
# changes no result, only cs's magnitude.
ZERO_DECAY_LOG2 = tl.constexpr(160.0)
# Row widths of ChunkTables's int64 tables, whose columns the readers below load in tables.py's order.
CHUNK_COLUMNS = tl.constexpr(len(ChunkRow._fields))
INNER_COLUMNS = tl.constexpr(len(ChunkCapture._fields))
STEP_COLUMNS = tl.constexpr(STEP_WIDTH)
# Columns of a step's row that the fused pass's walk reads alone (the rest through _step_row).
STEP_START = tl.constexpr(Step._fields.index("start_entry"))
STEP_INNER = tl.constexpr(Step._fields.index("inner"))
MAX_GRID_Z = 65535  # CUDA's limit on a grid's third axis
# Marks (Workspace.nonfinite) a program of the output kernel's fix-up reads: 80 programs at Mamba-2
# 2.7B's 80 heads and 8192 tokens, one wave at one program an SM. Where every mark is set (every
# chunk's x non-finite), a program computes 32 (chunk, head, P block)s' y one after another.
FIXUP_MARKS = 32
# Flags a C B^T program of the fused pass raises an instruction (one a thread at 4 warps): its group's
# heads' chunk flags, all of them at once up to 128 heads a group.
RAISE_BLOCK = tl.constexpr(128)


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
def _chunk_span(chunks_ptr, i_c):
    """Row i_c of ChunkTables.chunks: ChunkRow's first fields in order (batch row, first token,
    length, sequence), in one request, which a program waits on once (separate loads were issued
    one after the other's wait)."""
    o = tl.arange(0, 4)
    fields = tl.load(chunks_ptr + i_c * CHUNK_COLUMNS + o)
    return tl.sum(tl.where(o == 0, fields, 0)), tl.sum(tl.where(o == 1, fields, 0)), \
        tl.sum(tl.where(o == 2, fields, 0)), tl.sum(tl.where(o == 3, fields, 0))


@triton.jit
def _grid_span(pid_c, row_chunks, seqlen, CHUNK: tl.constexpr):
    """Chunk pid_c's batch row and first token (int64) and length (int32) where every sequence
    starts its own batch row and is cut on the grid into row_chunks > 0 chunks of seqlen tokens each
    (ChunkTables.row_chunks): from the index, in int32 (a chunk's index and tokens fit), with no
    round trip to the table before a program's loads."""
    t0 = pid_c % row_chunks * CHUNK
    return (pid_c // row_chunks).to(tl.int64), t0.to(tl.int64), tl.minimum(seqlen - t0, CHUNK).to(tl.int32)


@triton.jit
def _inner_capture(inner_ptr, i):
    """Row i of ChunkTables.inner, less its entry: (chunk, offset)."""
    p = inner_ptr + i * INNER_COLUMNS
    return tl.load(p + 1), tl.load(p + 2)


@triton.jit
def _pn_block(i_pn, n_nblocks, headdim, dstate, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Offsets and masks (o_p, m_p, o_n, m_n) of block i_pn of a (headdim, dstate) state cut into
    BLOCK_P x BLOCK_N blocks, n_nblocks along dstate."""
    o_p = (i_pn // n_nblocks) * BLOCK_P + tl.arange(0, BLOCK_P)
    o_n = (i_pn % n_nblocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    return o_p, o_p < headdim, o_n, o_n < dstate


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
def _dt_cumsum_kernel(dt_ptr, A_ptr, dt_bias_ptr, chunks_ptr, dt_out_ptr, cs_out_ptr, decay_ptr, counters_ptr,
                      nheads, dt_min, dt_max, s_dt_b, s_dt_t, s_dt_h, s_A_h, s_bias_h,
                      HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, OPENS_FUSED: tl.constexpr,
                      CHUNK: tl.constexpr):
    i_c = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    if OPENS_FUSED:  # the fused pass's next generation of flags, its tickets from 0
        if (i_c == 0) & (i_h == 0):
            tl.atomic_add(counters_ptr, 1)
            tl.store(counters_ptr + 1, 0)
    i_b, t0, n_tok, _ = _chunk_span(chunks_ptr, i_c)
    o_t = tl.arange(0, CHUNK)
    m_t = o_t < n_tok
    b_dt = tl.load(dt_ptr + i_b * s_dt_b + (t0 + o_t) * s_dt_t + i_h * s_dt_h, mask=m_t, other=0.0).to(tl.float32)
    b_bias = 0.0
    if HAS_DT_BIAS:
        b_bias = tl.load(dt_bias_ptr + i_h * s_bias_h).to(tl.float32)
    b_dt = discretize_dt(b_dt, b_bias, dt_min, dt_max, HAS_DT_BIAS, DT_SOFTPLUS)
    b_dt = tl.where(m_t, b_dt, 0.0)  # tokens past the chunk neither decay nor contribute
    b_a = b_dt * (tl.load(A_ptr + i_h * s_A_h).to(tl.float32) * LOG2E)  # log2 of each token's decay
    # A non-finite dt' makes its token's log decay NaN: the NaN reaches that token and the later
    # ones through cs (and dt' is stored as 0, below, so that no zero weight multiplies it).
    finite = tl.abs(b_dt) < float("inf")
    b_a = tl.where(finite, b_a, float("nan"))
    # A token's log decay is raised to the least value that still zeroes every decay across it
    # (see ZERO_DECAY_LOG2): a reset's -1e5 would otherwise leave cs so large that the differences
    # of later tokens' cs lose float32's precision. Selects, not max/min: a NaN token stays NaN
    # and reaches no token before it.
    floor = -ZERO_DECAY_LOG2 - tl.sum(tl.where(b_a > 0.0, b_a, 0.0), axis=0)
    b_cs = tl.cumsum(tl.where(b_a < floor, floor, b_a), axis=0)
    o_scr = (i_c * nheads + i_h) * CHUNK + o_t
    tl.store(dt_out_ptr + o_scr, tl.where(finite, b_dt, 0.0))
    tl.store(cs_out_ptr + o_scr, b_cs)
    # cs past the chunk's last token stays at cs_last: the last element is the chunk's log decay.
    tl.store(decay_ptr + i_c * nheads + i_h, exp2_flush(tl.sum(tl.where(o_t == CHUNK - 1, b_cs, 0.0), axis=0)))


@triton.jit
def _chunk_cb_program(i_c, i_g, i_m, i_k, B_ptr, C_ptr, chunks_ptr, cb_ptr, dstate, ngroups,
                      s_B_b, s_B_t, s_B_g, s_B_n, s_C_b, s_C_t, s_C_g, s_C_n,
                      CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, CB_DOT_DTYPE: tl.constexpr):
    """Stage 2's program for chunk i_c, group i_g and block (i_m, i_k) of C B^T, multiplied in
    CB_DOT_DTYPE (cb_dot_dtype)."""
    if i_k <= i_m:  # blocks above the diagonal are never read
        i_b, t0, n_tok, _ = _chunk_span(chunks_ptr, i_c)
        o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
        o_k = i_k * BLOCK_M + tl.arange(0, BLOCK_M)
        o_d = tl.arange(0, BLOCK_D)
        p_C = C_ptr + (i_b * s_C_b + t0 * s_C_t + i_g * s_C_g) + o_m[:, None] * s_C_t
        p_BT = B_ptr + (i_b * s_B_b + t0 * s_B_t + i_g * s_B_g) + o_k[None, :] * s_B_t
        acc = tl.zeros([BLOCK_M, BLOCK_M], dtype=tl.float32)
        for d0 in range(0, dstate, BLOCK_D):
            m_d = d0 + o_d < dstate
            b_C = tl.load(p_C + (d0 + o_d)[None, :] * s_C_n, mask=(o_m < n_tok)[:, None] & m_d[None, :],
                          other=0.0)  # [BM, BD]
            b_BT = tl.load(p_BT + (d0 + o_d)[:, None] * s_B_n, mask=m_d[:, None] & (o_k < n_tok)[None, :],
                           other=0.0)  # [BD, BK]
            acc += _dot(b_C, b_BT, CB_DOT_DTYPE)
        # Zeros above the diagonal: a NaN in a later token's B must not reach an earlier row
        # through the output kernel's zero decay.
        acc = tl.where((o_m[:, None] >= o_k[None, :]) | (i_k < i_m), acc, 0.0)
        p_cb = cb_ptr + (i_c * ngroups + i_g) * CHUNK * CHUNK + o_m[:, None] * CHUNK + o_k[None, :]
        tl.store(p_cb, cast_for_store(acc, p_cb.dtype.element_ty))


@triton.jit
def _chunk_cb_kernel(B_ptr, C_ptr, chunks_ptr, cb_ptr, dstate, ngroups,
                     s_B_b, s_B_t, s_B_g, s_B_n, s_C_b, s_C_t, s_C_g, s_C_n,
                     CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, CB_DOT_DTYPE: tl.constexpr):
    # Axis 1 numbers the blocks on and below the diagonal row by row: block (i_m, i_k) is
    # i_m (i_m + 1) / 2 + i_k, so i_m counts the rows that end at or before i_t.
    i_t = tl.program_id(1)
    o = tl.arange(0, CHUNK // BLOCK_M)
    i_m = tl.sum(((o + 1) * (o + 2) // 2 <= i_t).to(tl.int32))
    _chunk_cb_program((tl.program_id(0) // ngroups).to(tl.int64), (tl.program_id(0) % ngroups).to(tl.int64),
                      i_m, i_t - i_m * (i_m + 1) // 2, B_ptr, C_ptr, chunks_ptr, cb_ptr, dstate, ngroups,
                      s_B_b, s_B_t, s_B_g, s_B_n, s_C_b, s_C_t, s_C_g, s_C_n, CHUNK, BLOCK_M, BLOCK_D, CB_DOT_DTYPE)


@triton.jit
def _state_row_span(i_row, nchunks, chunks_ptr, inner_ptr):
    """Stage 3's grid row i_row from the tables: a chunk's own contribution (all its tokens), or
    past the chunks an inner capture's partial (its chunk's first j tokens): (chunk, batch row,
    first token, tokens)."""
    if i_row < nchunks:
        i_c = i_row
        i_b, t0, n_tok, _ = _chunk_span(chunks_ptr, i_c)
    else:
        i_c, n_tok = _inner_capture(inner_ptr, i_row - nchunks)
        i_b, t0, _, _ = _chunk_span(chunks_ptr, i_c)
    return i_c, i_b, t0, n_tok


@triton.jit
def _chunk_state_program(i_row, i_h, i_pn, i_c, i_b, t0, n_tok, x_ptr, B_ptr, dt_ptr, cs_ptr, states_ptr, nchunks,
                         partial_ptr, nonfinite_ptr, headdim, dstate, nheads, heads_per_group, n_nblocks,
                         s_x_b, s_x_t, s_x_h, s_x_p, s_B_b, s_B_t, s_B_g, s_B_n,
                         CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, MARK_NONFINITE: tl.constexpr):
    """Stage 3's program for grid row i_row (a chunk, or past the chunks an inner capture: its span
    as _state_row_span gives it), head i_h and P x N block i_pn. With MARK_NONFINITE, a chunk's
    program of the first N block also stores whether the chunk's x holds a non-finite entry in the
    head's P block (Workspace.nonfinite)."""
    o_p, m_p, o_n, m_n = _pn_block(i_pn, n_nblocks, headdim, dstate, BLOCK_P, BLOCK_N)
    o_scr = (i_c * nheads + i_h) * CHUNK
    p_x = x_ptr + i_b * s_x_b + t0 * s_x_t + i_h * s_x_h
    p_B = B_ptr + i_b * s_B_b + t0 * s_B_t + (i_h // heads_per_group) * s_B_g
    acc = _chunk_contribution(p_x, p_B, dt_ptr + o_scr, cs_ptr + o_scr, n_tok, s_x_t, s_x_p, s_B_t, s_B_n,
                              o_p, m_p, o_n, m_n, BLOCK_P, BLOCK_N, BLOCK_K, DOT_DTYPE)
    o_pn = o_p[:, None] * dstate + o_n[None, :]
    m_pn = m_p[:, None] & m_n[None, :]
    # Both in the matmul dtype; the fused pass's `states` are float32 (its walks leave their end
    # states there), so its chunks' contributions are rounded to the matmul dtype as stored here.
    if i_row < nchunks:
        p_own = states_ptr + (i_c * nheads + i_h) * headdim * dstate + o_pn
        tl.store(p_own, cast_for_store(acc, DOT_DTYPE).to(p_own.dtype.element_ty), mask=m_pn)
        if MARK_NONFINITE:
            # A non-finite x_jp makes every element of the contribution's row p non-finite (inf
            # times B's entries and the decay, inf * 0 = NaN, sums with an inf or a NaN), and a sum
            # holding one is non-finite: one reduction of the tile the program holds, not a test
            # of each x. A false mark (B or dt non-finite, or a sum past float32) costs only the
            # fix-up's time (stage5_chunk_output).
            if i_pn % n_nblocks == 0:
                p_mark = nonfinite_ptr + (i_c * nheads + i_h) * tl.cdiv(headdim, BLOCK_P) + i_pn // n_nblocks
                tl.store(p_mark, (~(tl.abs(tl.sum(acc)) < float("inf"))).to(tl.int8))
    else:
        p_part = partial_ptr + ((i_row - nchunks) * nheads + i_h) * headdim * dstate + o_pn
        tl.store(p_part, cast_for_store(acc, p_part.dtype.element_ty), mask=m_pn)


@triton.jit(do_not_specialize=["nchunks", "row_chunks", "seqlen"])
def _chunk_state_kernel(x_ptr, B_ptr, dt_ptr, cs_ptr, chunks_ptr, states_ptr, nchunks, inner_ptr, partial_ptr,
                        nonfinite_ptr, row_chunks, seqlen, headdim, dstate, nheads, heads_per_group, n_nblocks,
                        s_x_b, s_x_t, s_x_h, s_x_p, s_B_b, s_B_t, s_B_g, s_B_n,
                        CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr):
    # A dense pass's chunk span comes from the chunk's index (_grid_span): reading the table first
    # cost two waits on memory, a quarter of a program's latency (modelled). A branch in the kernel,
    # as in _chunk_output_kernel. The chunk's length is int32, and with it its tokens' offsets
    # (run_chunked_triton checks that they fit): in int64 they took an eighth of the program's
    # instructions and a sixth of its latency (modelled).
    i_row = tl.program_id(0).to(tl.int64)
    if (row_chunks > 0) & (i_row < nchunks):
        i_c = i_row
        i_b, t0, n_tok = _grid_span(tl.program_id(0), row_chunks, seqlen, CHUNK)
    else:
        i_c, i_b, t0, n_tok = _state_row_span(i_row, nchunks, chunks_ptr, inner_ptr)
        n_tok = n_tok.to(tl.int32)
    _chunk_state_program(i_row, tl.program_id(1).to(tl.int64), tl.program_id(2), i_c, i_b, t0, n_tok, x_ptr, B_ptr,
                         dt_ptr, cs_ptr, states_ptr, nchunks, partial_ptr, nonfinite_ptr,
                         headdim, dstate, nheads, heads_per_group, n_nblocks, s_x_b, s_x_t, s_x_h, s_x_p,
                         s_B_b, s_B_t, s_B_g, s_B_n, CHUNK, BLOCK_P, BLOCK_N, BLOCK_K, DOT_DTYPE, True)


@triton.jit
def _step_row(steps_ptr, t):
    """Row t of ChunkTables.steps: Step's fields in order (chunk, first, last, start_entry, inner,
    inner_entry, inner_offset), its padding column unread."""
    p = steps_ptr + t * STEP_COLUMNS
    return (tl.load(p), tl.load(p + 1), tl.load(p + 2), tl.load(p + 3), tl.load(p + 4), tl.load(p + 5),
            tl.load(p + 6))


@triton.jit
def _capture_row(capture_rows_ptr, entry, skip_slot, HAS_SKIP: tl.constexpr):
    """The row (an engine's slot) of CaptureTable entry `entry` (-1: none), and whether it is
    written: an engine declines a capture by pointing it at its skip slot."""
    row = tl.load(capture_rows_ptr + tl.maximum(entry, 0))
    keep = (entry >= 0) & (row >= 0)
    if HAS_SKIP:
        keep = keep & (row != skip_slot)
    return row, keep


@triton.jit
def _walk_block(i_blk, headdim, dstate, BLOCK: tl.constexpr):
    """Offsets, mask and (p, n) of block i_blk of a flat (headdim x dstate) state: (o, m, o_p, o_n)."""
    o = i_blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    return o, o < headdim * dstate, o // dstate, o % dstate


@triton.jit
def _initial_state(i_in, starts, i_h, o_p, o_n, m, state_in_ptr, s_in_s, s_in_h, s_in_p, s_in_n,
                   HAS_INITIAL_STATE: tl.constexpr):
    """A sequence's initial state (row i_in of state_in, an engine's slot) on the block of mask m,
    float32: zeros where it starts fresh (not `starts`) or none is given."""
    state = tl.zeros(m.shape, dtype=tl.float32)
    if HAS_INITIAL_STATE:
        p_in = state_in_ptr + i_in * s_in_s + i_h * s_in_h + o_p * s_in_p + o_n * s_in_n
        state = tl.load(p_in, mask=tl.where(starts, m, False), other=0.0).to(tl.float32)
    return state


@triton.jit
def _walk(state, t_begin, t_end, i_h, o, m, p_cap, s_cap_r, states_ptr, decay_ptr, cs_ptr, steps_ptr,
          capture_rows_ptr, partial_ptr, start_ptr, skip_slot, nheads, size, HAS_SKIP: tl.constexpr,
          CHUNK: tl.constexpr, WALK_STAGES: tl.constexpr):
    """Steps [t_begin, t_end) of ChunkTables.steps from `state` (a flat block, offsets o, mask m):
    stores each chunk's start state and the captures on the way; returns the state after them.

    One step a chunk, or one per start or inner capture (ChunkTables.steps): a loop nested in the
    walk would keep the compiler from pipelining it. With WALK_STAGES > 1 Triton's pipeliner requests
    a step's table row and, from it, the step's loads WALK_STAGES - 1 steps ahead: a step's work is far
    shorter than a load, so a walk that waited on each step's loads was bound by their latency."""
    for t in tl.range(t_begin, t_end, num_stages=WALK_STAGES):
        c, first, last, start_entry, i_r, inner_entry, j = _step_row(steps_ptr, t)
        # The chunk's own contribution and decay (stage 3, at its last step). Scalar masks and
        # offsets from one scalar base: per-element flags and 64-bit offsets took most of a
        # step's instructions.
        o_ch = (c * nheads + i_h) * size
        b_own = tl.load(states_ptr + o_ch + o, mask=tl.where(last != 0, m, False), other=0.0).to(tl.float32)
        b_decay = tl.load(decay_ptr + c * nheads + i_h)
        # The chunk's start: its start state for the output stage, and a capture there.
        tl.store(start_ptr + o_ch + o, cast_for_store(state, start_ptr.dtype.element_ty),
                 mask=tl.where(first != 0, m, False))
        # Captures are rare steps: their work is branched around, not masked in every step.
        if start_entry >= 0:
            start_row, start_kept = _capture_row(capture_rows_ptr, start_entry, skip_slot, HAS_SKIP)
            b_cap = cast_for_store(state, p_cap.dtype.element_ty)  # the cache's dtype on the engine path
            tl.store(p_cap + start_row * s_cap_r, b_cap, mask=tl.where(start_kept, m, False))
        if i_r >= 0:
            # An inner capture: exp(cs_{j-1}) S0 + the contribution of the chunk's first j tokens.
            b_part = tl.load(partial_ptr + (i_r * nheads + i_h) * size + o, mask=m, other=0.0)
            b_cs = tl.load(cs_ptr + (c * nheads + i_h) * CHUNK + tl.maximum(j - 1, 0))
            inner_row, inner_kept = _capture_row(capture_rows_ptr, inner_entry, skip_slot, HAS_SKIP)
            b_in = tl.fma(exp2_flush(b_cs), state, b_part.to(tl.float32))
            tl.store(p_cap + inner_row * s_cap_r, cast_for_store(b_in, p_cap.dtype.element_ty),
                     mask=tl.where(inner_kept, m, False))
        # One explicit fused multiply-add: the bits of a chunk-grid state must not depend on
        # how the compiler contracts it in each specialisation.
        state = tl.where(last != 0, tl.fma(b_decay, state, b_own), state)
    return state


@triton.jit
def _walk_chunks(state, c_begin, c_end, i_h, o, m, states_ptr, decay_ptr, start_ptr, nheads, size,
                 WALK_STAGES: tl.constexpr):
    """_walk over chunks [c_begin, c_end) where step t is chunk t, with no capture at a chunk's start
    or inside one (ChunkTables.plain_walk): no step table to read, the same operations as _walk's
    steps (a step reading its row took a third of the walk's instructions)."""
    for c in tl.range(c_begin, c_end, num_stages=WALK_STAGES):
        state = _plain_step(state, c, i_h, o, m, states_ptr, decay_ptr, start_ptr, nheads, size)
    return state


@triton.jit
def _plain_step(state, c, i_h, o, m, states_ptr, decay_ptr, start_ptr, nheads, size):
    """Chunk c's step of _walk_chunks: stores `state` as the chunk's start state and returns its end
    state, with _walk's fused multiply-add."""
    o_ch = (c * nheads + i_h) * size
    b_own = tl.load(states_ptr + o_ch + o, mask=m, other=0.0).to(tl.float32)
    b_decay = tl.load(decay_ptr + c * nheads + i_h)
    tl.store(start_ptr + o_ch + o, cast_for_store(state, start_ptr.dtype.element_ty), mask=m)
    return tl.fma(b_decay, state, b_own)


@triton.jit
def _final_state(state, i_s, i_in, i_h, o_p, o_n, m, p_cap, s_cap_r, state_out_ptr, s_out_s, s_out_h, s_out_p,
                 s_out_n, end_bounds_ptr, end_entries_ptr, capture_rows_ptr, skip_slot, HAS_SKIP: tl.constexpr):
    """Sequence i_s's final state: into row i_in of state_out (its slot) and its end captures."""
    p_out = state_out_ptr + i_in * s_out_s + i_h * s_out_h + o_p * s_out_p + o_n * s_out_n
    tl.store(p_out, cast_for_store(state, p_out.dtype.element_ty), mask=m)
    for e in range(tl.load(end_bounds_ptr + i_s), tl.load(end_bounds_ptr + i_s + 1)):
        row, kept = _capture_row(capture_rows_ptr, tl.load(end_entries_ptr + e), skip_slot, HAS_SKIP)
        tl.store(p_cap + row * s_cap_r, cast_for_store(state, p_cap.dtype.element_ty), mask=tl.where(kept, m, False))


@triton.jit(do_not_specialize=["plain_walk"])
def _state_passing_kernel(states_ptr, decay_ptr, cs_ptr, seq_steps_ptr, steps_ptr, end_bounds_ptr, end_entries_ptr,
                          capture_rows_ptr, partial_ptr, state_in_ptr, slot_in_ptr, has_initial_ptr, start_ptr,
                          state_out_ptr, captured_ptr, skip_slot, plain_walk, headdim, dstate, nheads,
                          s_in_s, s_in_h, s_in_p, s_in_n, s_out_s, s_out_h, s_out_p, s_out_n,
                          s_cap_r, s_cap_h, s_cap_p, s_cap_n,
                          HAS_INITIAL_STATE: tl.constexpr, HAS_SLOT_IN: tl.constexpr,
                          HAS_INITIAL_FLAGS: tl.constexpr, HAS_SKIP: tl.constexpr, CHUNK: tl.constexpr,
                          BLOCK: tl.constexpr, WALK_STAGES: tl.constexpr):
    i_s = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    # An engine's cache: the row's slot, read and written in place; a skipped row does nothing.
    i_in, _, live, starts, _ = row_slots(i_s, 0, slot_in_ptr, slot_in_ptr, has_initial_ptr, skip_slot,
                                         HAS_SLOT_IN, False, HAS_INITIAL_FLAGS, HAS_SKIP)
    if live:
        o, m, o_p, o_n = _walk_block(tl.program_id(2), headdim, dstate, BLOCK)
        state = _initial_state(i_in, starts, i_h, o_p, o_n, m, state_in_ptr, s_in_s, s_in_h, s_in_p, s_in_n,
                               HAS_INITIAL_STATE)
        t_begin, t_end = tl.load(seq_steps_ptr + i_s), tl.load(seq_steps_ptr + i_s + 1)
        # A runtime branch, not a second binary: a pass with captures runs the same kernel. The
        # capture pointers are made where they are used, not held through the plain walk.
        if plain_walk != 0:
            state = _walk_chunks(state, t_begin, t_end, i_h, o, m, states_ptr, decay_ptr, start_ptr, nheads,
                                 headdim * dstate, WALK_STAGES)
        else:
            p_cap = captured_ptr + i_h * s_cap_h + o_p * s_cap_p + o_n * s_cap_n
            state = _walk(state, t_begin, t_end, i_h, o, m, p_cap, s_cap_r, states_ptr, decay_ptr, cs_ptr, steps_ptr,
                          capture_rows_ptr, partial_ptr, start_ptr, skip_slot, nheads, headdim * dstate, HAS_SKIP,
                          CHUNK, WALK_STAGES)
        p_cap = captured_ptr + i_h * s_cap_h + o_p * s_cap_p + o_n * s_cap_n
        _final_state(state, i_s, i_in, i_h, o_p, o_n, m, p_cap, s_cap_r, state_out_ptr, s_out_s, s_out_h, s_out_p,
                     s_out_n, end_bounds_ptr, end_entries_ptr, capture_rows_ptr, skip_slot, HAS_SKIP)


@triton.jit
def _chunk_output_program(i_c, i_h, i_mp, i_b, t0, n_tok, i_s, x_ptr, C_ptr, D_ptr, z_ptr, y_ptr, dt_ptr, cs_ptr,
                          cb_ptr, start_ptr, slot_in_ptr, skip_slot, headdim, dstate, nheads, heads_per_group,
                          n_pblocks,
                          s_x_b, s_x_t, s_x_h, s_x_p, s_C_b, s_C_t, s_C_g, s_C_n, s_D_h, s_D_p,
                          s_z_b, s_z_t, s_z_h, s_z_p, s_y_b, s_y_t, s_y_h, s_y_p,
                          HAS_D: tl.constexpr, D_PER_HEAD: tl.constexpr, HAS_Z: tl.constexpr,
                          HAS_SLOT_IN: tl.constexpr, HAS_SKIP: tl.constexpr, CHUNK: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
                          EVEN_D: tl.constexpr, DOT_DTYPE: tl.constexpr, NONFINITE_X: tl.constexpr):
    """Stage 5's program for chunk i_c, head i_h and M x P block i_mp; the chunk's span (batch row,
    first token, length, sequence) as _chunk_span gives it. NONFINITE_X: the diagonal block's x may
    hold a non-finite entry (below); without it, the block's x goes straight into its matmul, and
    a non-finite entry there would reach the rows above it."""
    i_m = i_mp // n_pblocks
    i_p = i_mp % n_pblocks
    i_g = i_h.to(tl.int32) // heads_per_group
    # A skipped row (an engine's padding) writes no y: its store is masked, so that no wait on its
    # slot comes before the program's other loads.
    _, _, live, _, _ = row_slots(i_s, n_tok, slot_in_ptr, slot_in_ptr, slot_in_ptr, skip_slot, HAS_SLOT_IN, False,
                                 False, HAS_SKIP)
    m0 = i_m * BLOCK_M
    o_m = m0 + tl.arange(0, BLOCK_M)  # output tokens (rows); source blocks have the same size
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    m_p = o_p < headdim
    # What does not depend on the chunk's span is requested with it, before the branch the span
    # decides, so that the program waits on global memory once for both: its rows' log decays
    # (scratch rows hold CHUNK entries, dt' = 0 past the chunk's end: no masks needed) and D.
    p_dt = dt_ptr + (i_c * nheads + i_h) * CHUNK
    p_cs = cs_ptr + (i_c * nheads + i_h) * CHUNK
    b_cs_m = tl.load(p_cs + o_m)  # [BM]
    b_ref = tl.where(m0 > 0, tl.load(p_cs + tl.maximum(m0 - 1, 0)), 0.0)  # cs before the row block
    if HAS_D:
        if D_PER_HEAD:
            b_D = tl.load(D_ptr + i_h * s_D_h).to(tl.float32)
        else:
            b_D = tl.load(D_ptr + i_h * s_D_h + o_p * s_D_p, mask=m_p, other=0.0).to(tl.float32)
    if m0 < n_tok:
        o_j = tl.arange(0, BLOCK_M)
        o_d = tl.arange(0, BLOCK_D)
        m_mp = (o_m < n_tok)[:, None] & m_p[None, :]
        p_x = x_ptr + (i_b * s_x_b + t0 * s_x_t + i_h * s_x_h) + o_p[None, :] * s_x_p
        p_cb = cb_ptr + (i_c * (nheads // heads_per_group) + i_g) * CHUNK * CHUNK + o_m[:, None] * CHUNK

        # Inter-chunk term: the chunk-start state read out by C, decayed to the token before the rows.
        # Rows past the chunk's end read its last row and columns past headdim the last column (their
        # y is never stored): only a dstate tail (not EVEN_D) is masked. The masks' predicates were
        # a tenth of the kernel's instructions.
        p_C = C_ptr + (i_b * s_C_b + t0 * s_C_t + i_g * s_C_g) + tl.minimum(o_m, n_tok - 1)[:, None] * s_C_t
        p_S0T = start_ptr + (i_c * nheads + i_h) * headdim * dstate + tl.minimum(o_p, headdim - 1)[None, :] * dstate
        acc = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
        for d0 in range(0, dstate, BLOCK_D):
            if EVEN_D:
                b_C = tl.load(p_C + (d0 + o_d)[None, :] * s_C_n)
                b_S0T = tl.load(p_S0T + (d0 + o_d)[:, None])  # [BD, BP]
            else:
                m_d = d0 + o_d < dstate
                b_C = tl.load(p_C + (d0 + o_d)[None, :] * s_C_n, mask=m_d[None, :], other=0.0)
                b_S0T = tl.load(p_S0T + (d0 + o_d)[:, None], mask=m_d[:, None], other=0.0)
            acc += _dot(b_C, b_S0T, DOT_DTYPE)
        acc *= exp2_flush(b_ref)

        # Source blocks strictly below the diagonal (every token valid, causal), decayed to the same token.
        for k0 in range(0, m0, BLOCK_M):
            o_k = k0 + o_j
            b_w = tl.load(p_cb + o_k[None, :]).to(tl.float32) \
                * (exp2_flush(b_ref - tl.load(p_cs + o_k)) * tl.load(p_dt + o_k))[None, :]
            b_x = tl.load(p_x + o_k[:, None] * s_x_t, mask=m_p[None, :], other=0.0)  # [BK, BP]
            acc += _dot(b_w, b_x, DOT_DTYPE)
        acc *= exp2_flush(b_cs_m - b_ref)[:, None]
        # The diagonal block: causal mask (C B^T is 0 above the diagonal and dt' is finite, so
        # no NaN there meets the zero decay); its x tile is this block's own x, which also takes
        # D x: through the matmul where D is one per head (D on the weights' diagonal, rounded
        # with them to the matmul dtype: x is not converted to the accumulator's layout, which took
        # 9% of the kernel's instructions), else added in float32. A non-finite x entry is left out
        # of the matmul, where the zero weights of earlier rows would turn it into NaN for them, and
        # marks its column NaN from its row on.
        causal = o_m[:, None] >= o_m[None, :]
        b_w = tl.load(p_cb + o_m[None, :]).to(tl.float32) * tl.load(p_dt + o_m)[None, :] \
            * exp2_flush(tl.where(causal, b_cs_m[:, None] - b_cs_m[None, :], -float("inf")))
        if HAS_D and D_PER_HEAD:
            b_w += tl.where(o_m[:, None] == o_m[None, :], b_D, 0.0)
        b_x = tl.load(p_x + o_m[:, None] * s_x_t, mask=m_mp, other=0.0)  # [BM, BP]
        if NONFINITE_X:
            bad = ~(tl.abs(b_x.to(tl.float32)) < float("inf"))
            acc += _dot(b_w, tl.where(bad, 0.0, b_x), DOT_DTYPE)
            first_bad = tl.min(tl.where(bad, o_m[:, None], CHUNK), axis=0)  # [BP]
            acc = tl.where(o_m[:, None] >= first_bad[None, :], float("nan"), acc)
        else:
            acc += _dot(b_w, b_x, DOT_DTYPE)
        if HAS_D and not D_PER_HEAD:
            acc += b_D[None, :] * b_x.to(tl.float32)
        if HAS_Z:
            p_z = z_ptr + (i_b * s_z_b + t0 * s_z_t + i_h * s_z_h) + o_m[:, None] * s_z_t + o_p[None, :] * s_z_p
            b_z = tl.load(p_z, mask=m_mp, other=0.0).to(tl.float32)
            acc = acc * b_z * tl.sigmoid(b_z)
        p_y = y_ptr + (i_b * s_y_b + t0 * s_y_t + i_h * s_y_h) + o_m[:, None] * s_y_t + o_p[None, :] * s_y_p
        tl.store(p_y, cast_for_store(acc, p_y.dtype.element_ty), mask=tl.where(live, m_mp, False))


@triton.jit(do_not_specialize=["row_chunks", "seqlen"])
def _chunk_output_kernel(x_ptr, C_ptr, D_ptr, z_ptr, y_ptr, dt_ptr, cs_ptr, chunks_ptr, cb_ptr, start_ptr,
                         slot_in_ptr, skip_slot, row_chunks, seqlen, headdim, dstate, nheads, heads_per_group,
                         n_pblocks,
                         s_x_b, s_x_t, s_x_h, s_x_p, s_C_b, s_C_t, s_C_g, s_C_n, s_D_h, s_D_p,
                         s_z_b, s_z_t, s_z_h, s_z_p, s_y_b, s_y_t, s_y_h, s_y_p,
                         HAS_D: tl.constexpr, D_PER_HEAD: tl.constexpr, HAS_Z: tl.constexpr, HAS_SLOT_IN: tl.constexpr,
                         HAS_SKIP: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                         BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, DOT_DTYPE: tl.constexpr):
    # The grid is (M x P block, head, chunk): the programs that re-read a chunk's x, C and C B^T
    # run one after another, while those are still in L2. Index arithmetic that cannot overflow
    # (the chunk's index, the token offsets inside it, the group) is int32 and the tiles' offsets
    # are int32 from int64 base pointers: 64-bit divisions and per-element 64-bit offsets took
    # instructions from this issue-bound kernel.
    pid_c = tl.program_id(2)
    i_c = pid_c.to(tl.int64)
    # A dense pass's chunk span comes from the chunk's index (_grid_span), with no round trip to the
    # table. A branch, not a second binary: every pass runs the same code on its tiles.
    if row_chunks > 0:
        i_b, t0, n_tok = _grid_span(pid_c, row_chunks, seqlen, CHUNK)
        i_s = i_b
    else:
        i_b, t0, n_tok, i_s = _chunk_span(chunks_ptr, i_c)
        n_tok = n_tok.to(tl.int32)
    _chunk_output_program(i_c, tl.program_id(1).to(tl.int64), tl.program_id(0), i_b, t0, n_tok, i_s, x_ptr, C_ptr,
                          D_ptr, z_ptr, y_ptr, dt_ptr, cs_ptr, cb_ptr, start_ptr, slot_in_ptr, skip_slot, headdim,
                          dstate, nheads, heads_per_group, n_pblocks,
                          s_x_b, s_x_t, s_x_h, s_x_p, s_C_b, s_C_t, s_C_g, s_C_n, s_D_h, s_D_p,
                          s_z_b, s_z_t, s_z_h, s_z_p, s_y_b, s_y_t, s_y_h, s_y_p,
                          HAS_D, D_PER_HEAD, HAS_Z, HAS_SLOT_IN, HAS_SKIP, CHUNK, BLOCK_M, BLOCK_P, BLOCK_D, EVEN_D,
                          DOT_DTYPE, False)


@triton.jit(do_not_specialize=["nmarks"])
def _nonfinite_output_kernel(x_ptr, C_ptr, D_ptr, z_ptr, y_ptr, dt_ptr, cs_ptr, chunks_ptr, cb_ptr, start_ptr,
                             nonfinite_ptr, nmarks, slot_in_ptr, skip_slot, headdim, dstate, nheads, heads_per_group,
                             n_pblocks,
                             s_x_b, s_x_t, s_x_h, s_x_p, s_C_b, s_C_t, s_C_g, s_C_n, s_D_h, s_D_p,
                             s_z_b, s_z_t, s_z_h, s_z_p, s_y_b, s_y_t, s_y_h, s_y_p,
                             HAS_D: tl.constexpr, D_PER_HEAD: tl.constexpr, HAS_Z: tl.constexpr,
                             HAS_SLOT_IN: tl.constexpr, HAS_SKIP: tl.constexpr, CHUNK: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                             DOT_DTYPE: tl.constexpr, MARKS: tl.constexpr):
    """Stage 5's fix-up, after _chunk_output_kernel: y again, with the diagonal blocks' non-finite
    handling, for each (chunk, head, P block) that stage 3 marked (Workspace.nonfinite), by the
    same program as the output kernel's. A program reads MARKS marks in one request; one without a
    mark, nearly all of them, ends there."""
    o = tl.program_id(0) * MARKS + tl.arange(0, MARKS)
    if tl.max(tl.load(nonfinite_ptr + o, mask=o < nmarks, other=0)) != 0:
        NM: tl.constexpr = CHUNK // BLOCK_M
        for j in range(MARKS * NM):  # one loop over (mark, row block): nested loops took more registers
            i_mark = tl.program_id(0) * MARKS + j // NM
            if i_mark < nmarks:
                if tl.load(nonfinite_ptr + i_mark) != 0:
                    i_c = (i_mark // (nheads * n_pblocks)).to(tl.int64)
                    i_b, t0, n_tok, i_s = _chunk_span(chunks_ptr, i_c)
                    _chunk_output_program(i_c, (i_mark // n_pblocks % nheads).to(tl.int64),
                                          j % NM * n_pblocks + i_mark % n_pblocks, i_b, t0, n_tok.to(tl.int32), i_s,
                                          x_ptr, C_ptr, D_ptr, z_ptr, y_ptr, dt_ptr, cs_ptr, cb_ptr, start_ptr,
                                          slot_in_ptr, skip_slot, headdim, dstate, nheads, heads_per_group, n_pblocks,
                                          s_x_b, s_x_t, s_x_h, s_x_p, s_C_b, s_C_t, s_C_g, s_C_n, s_D_h, s_D_p,
                                          s_z_b, s_z_t, s_z_h, s_z_p, s_y_b, s_y_t, s_y_h, s_y_p,
                                          HAS_D, D_PER_HEAD, HAS_Z, HAS_SLOT_IN, HAS_SKIP, CHUNK, BLOCK_M, BLOCK_P,
                                          BLOCK_D, EVEN_D, DOT_DTYPE, True)


@triton.jit
def _wait(flag_ptr, producers, counters_ptr):
    """Until every one of the flag's producers has raised it this pass: until it reaches the
    pass's generation (counters_ptr[0]) x producers. The read acquires: what they stored before
    raising it is visible after. The generation is read beside each poll, before it (an acquiring
    read holds back the reads after it): one round trip a poll, and no register kept for it
    through the program's work."""
    while tl.load(counters_ptr) * producers > tl.atomic_add(flag_ptr, 0, sem="acquire"):
        pass


@triton.jit
def _raise(flag_ptr):
    """The flag up by one once every thread's stores are issued (the addition releases)."""
    tl.debug_barrier()
    tl.atomic_add(flag_ptr, 1, sem="release")


@triton.jit
def _raise_heads(flag_ptr, nflags, BLOCK: tl.constexpr):
    """Flags flag_ptr[0 .. nflags) each up by one, as _raise: BLOCK of them an instruction."""
    tl.debug_barrier()
    for f0 in range(0, nflags, BLOCK):
        o = f0 + tl.arange(0, BLOCK)
        tl.atomic_add(flag_ptr + o, 1, mask=o < nflags, sem="release")


@triton.jit
def _chunk_walk(g, i_h, i_p, o_n, m_n, states_ptr, decay_ptr, cs_ptr, chunks_ptr, steps_ptr, chunk_steps_ptr,
                end_bounds_ptr, end_entries_ptr, capture_rows_ptr, partial_ptr, start_ptr, state_in_ptr, slot_in_ptr,
                has_initial_ptr, state_out_ptr, captured_ptr, counters_ptr, flags_ptr, p_partial_flags, skip_slot,
                plain_walk, headdim, dstate, nheads, s_in_s, s_in_h, s_in_p, s_in_n, s_out_s, s_out_h, s_out_p, s_out_n,
                s_cap_r, s_cap_h, s_cap_p, s_cap_n,
                HAS_INITIAL_STATE: tl.constexpr, HAS_SLOT_IN: tl.constexpr, HAS_INITIAL_FLAGS: tl.constexpr,
                HAS_SKIP: tl.constexpr, CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, WALK_ROWS: tl.constexpr,
                N_PN: tl.constexpr, CHUNK_FLAG: tl.constexpr):
    """The fused pass's walk of chunk g on head i_h's P x N block (rows from i_p, columns o_n), after
    its program stored the chunk's own contribution in g's `states` row: from its sequence's initial
    state or the end state the chunk before left in its own row, the chunk's steps of
    ChunkTables.steps as stage 4 runs them (start state, captures, final state), and the end state
    into g's row (over the contribution, which only this walk reads). WALK_ROWS rows at a time: the
    walk's tiles are stage 4's size, whatever the contribution's tile."""
    size = headdim * dstate
    i_c = g.to(tl.int64)
    p_row = chunks_ptr + i_c * CHUNK_COLUMNS
    i_s, index, last = tl.load(p_row + 3), tl.load(p_row + 4), tl.load(p_row + 5)
    i_in, _, live, starts, _ = row_slots(i_s, 0, slot_in_ptr, slot_in_ptr, has_initial_ptr, skip_slot,
                                         HAS_SLOT_IN, False, HAS_INITIAL_FLAGS, HAS_SKIP)
    t_begin = tl.load(chunk_steps_ptr + i_c)
    t_end = tl.load(chunk_steps_ptr + i_c + 1)
    # A chunk of one step with no capture at its start or inside it takes the plain step, in any
    # pass: most chunks of a pass with captures are such chunks.
    plain = plain_walk
    if (plain_walk == 0) & (t_end - t_begin == 1):
        p_step = steps_ptr + t_begin * STEP_COLUMNS
        plain = ((tl.load(p_step + STEP_START) < 0) & (tl.load(p_step + STEP_INNER) < 0)).to(tl.int32)
    # What the walk reads besides its own contribution: its inner captures' partials (a plain step
    # has none) and the state before the chunk (its sequence's initial state, or the previous
    # chunk's end).
    if plain == 0:
        for step in range(t_begin, t_end):
            i_r = tl.load(steps_ptr + step * STEP_COLUMNS + STEP_INNER)
            if i_r >= 0:
                _wait(p_partial_flags + i_r * nheads + i_h, N_PN, counters_ptr)
    if index != 0:
        _wait(flags_ptr + (g - 1) * nheads + i_h, CHUNK_FLAG, counters_ptr)
    for r0 in range(0, BLOCK_P, WALK_ROWS):
        o_p = (i_p + r0 + tl.arange(0, WALK_ROWS))[:, None]
        o = o_p * dstate + o_n[None, :]
        m = (o_p < headdim) & m_n[None, :]
        if index == 0:
            state = _initial_state(i_in, starts, i_h, o_p, o_n[None, :], m, state_in_ptr, s_in_s, s_in_h, s_in_p,
                                   s_in_n, HAS_INITIAL_STATE)
        else:
            state = tl.load(states_ptr + ((i_c - 1) * nheads + i_h) * size + o, mask=m, other=0.0)
        if live:
            p_cap = captured_ptr + i_h * s_cap_h + o_p * s_cap_p + o_n[None, :] * s_cap_n
            if plain != 0:  # one step, the chunk's own: no step table to read (as _state_passing_kernel)
                state = _plain_step(state, i_c, i_h, o, m, states_ptr, decay_ptr, start_ptr, nheads, size)
            else:
                state = _walk(state, t_begin, t_end, i_h, o, m, p_cap, s_cap_r, states_ptr, decay_ptr, cs_ptr,
                              steps_ptr, capture_rows_ptr, partial_ptr, start_ptr, skip_slot, nheads, size,
                              HAS_SKIP, CHUNK, 1)
            if last != 0:
                _final_state(state, i_s, i_in, i_h, o_p, o_n[None, :], m, p_cap, s_cap_r, state_out_ptr, s_out_s,
                             s_out_h, s_out_p, s_out_n, end_bounds_ptr, end_entries_ptr, capture_rows_ptr,
                             skip_slot, HAS_SKIP)
        tl.store(states_ptr + (i_c * nheads + i_h) * size + o, state, mask=m)


@triton.jit(do_not_specialize=["nchunks", "ninner", "plain_walk"])
def _fused_pass_kernel(x_ptr, B_ptr, C_ptr, D_ptr, z_ptr, y_ptr, dt_ptr, cs_ptr, decay_ptr, cb_ptr, states_ptr,
                       partial_ptr, start_ptr, chunks_ptr, inner_ptr, steps_ptr, chunk_steps_ptr, end_bounds_ptr,
                       end_entries_ptr, capture_rows_ptr, state_in_ptr, slot_in_ptr, has_initial_ptr, state_out_ptr,
                       captured_ptr, counters_ptr, flags_ptr, nchunks, ninner, skip_slot, plain_walk,
                       headdim, dstate, nheads, heads_per_group, n_nblocks, n_pblocks,
                       s_x_b, s_x_t, s_x_h, s_x_p, s_B_b, s_B_t, s_B_g, s_B_n, s_C_b, s_C_t, s_C_g, s_C_n,
                       s_D_h, s_D_p, s_z_b, s_z_t, s_z_h, s_z_p, s_y_b, s_y_t, s_y_h, s_y_p,
                       s_in_s, s_in_h, s_in_p, s_in_n, s_out_s, s_out_h, s_out_p, s_out_n,
                       s_cap_r, s_cap_h, s_cap_p, s_cap_n,
                       HAS_D: tl.constexpr, D_PER_HEAD: tl.constexpr, HAS_Z: tl.constexpr,
                       HAS_INITIAL_STATE: tl.constexpr, HAS_SLOT_IN: tl.constexpr, HAS_INITIAL_FLAGS: tl.constexpr,
                       HAS_SKIP: tl.constexpr,
                       CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, CB_BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                       PASS_BLOCK: tl.constexpr, WALK_ROWS: tl.constexpr, N_PN: tl.constexpr, N_PASS: tl.constexpr,
                       N_MP: tl.constexpr, DOT_DTYPE: tl.constexpr, CB_DOT_DTYPE: tl.constexpr):
    """Stages 2 to 5 in one launch (stage2to5_fused). A program takes a ticket and runs the work
    it names, after waiting on the flags of the programs it reads from, all of which took earlier
    tickets and so are running or done: no program waits on one that may never start.

    Tickets: first the inner captures' partials (stage 3's rows past the chunks); then groups of
    (nheads x N_PN) chunk, (nheads x N_MP) output and (ngroups x NM x NM) C B^T programs, group g
    holding chunk g's chunk programs and C B^T and chunk g-1's output, so that what a program
    waits on was mostly done a group before; last, the final states of the empty sequences (N_PASS
    blocks of PASS_BLOCK elements a head). A chunk program computes a P x N block of its chunk's
    own contribution (stage 3), then walks the chunk on that block (_chunk_walk): the contribution
    goes to the walk through L2, not through a launch of its own. Flags count their producers:
    each producer raises its flag by one once a pass, so that a flag holds generation
    (counters_ptr[0], which stage 1 advanced) x its producers once they are all done, and a
    program waits on a flag with one poll whatever the number of its producers."""
    t = tl.atomic_add(counters_ptr + 1, 1, sem="relaxed")  # orders work, publishes nothing: relaxed
    NM: tl.constexpr = CHUNK // BLOCK_M  # C B^T blocks of a chunk along each side
    ngroups = nheads // heads_per_group
    n_chunk = nheads * N_PN
    n_out = nheads * N_MP
    n_cb = ngroups * NM * NM
    group = n_chunk + n_out + n_cb
    n_partial = ninner * n_chunk
    # Flags: (nchunks, nheads) chunks, raised by the chunk's N_PN chunk programs (their walks' end and
    # start states) and by its group's NM x NM C B^T programs (those above the diagonal included), so
    # that an output program waits on one flag; (ninner, nheads) partials (N_PN producers each).
    # Tickets and flags' indices fit int32; state offsets are int64.
    CHUNK_FLAG: tl.constexpr = N_PN + NM * NM
    p_partial_flags = flags_ptr + nchunks * nheads
    if t < n_partial:  # the partial of inner capture t // n_chunk: stage 3's row past the chunks
        i_row = (nchunks + t // n_chunk).to(tl.int64)
        i_c, i_b, t0, n_tok = _state_row_span(i_row, nchunks, chunks_ptr, inner_ptr)
        _chunk_state_program(i_row, ((t % n_chunk) // N_PN).to(tl.int64), t % N_PN, i_c, i_b, t0, n_tok,
                             x_ptr, B_ptr, dt_ptr, cs_ptr, states_ptr, nchunks, partial_ptr,
                             partial_ptr, headdim, dstate, nheads, heads_per_group, n_nblocks, s_x_b, s_x_t, s_x_h,
                             s_x_p, s_B_b, s_B_t, s_B_g, s_B_n, CHUNK, BLOCK_P, BLOCK_N, BLOCK_K, DOT_DTYPE, False)
        _raise(p_partial_flags + t // N_PN)
    elif t < n_partial + (nchunks + 1) * group:
        g = (t - n_partial) // group
        r = (t - n_partial) % group
        if r < n_chunk:
            if g < nchunks:  # chunk g on a P x N block of head r // N_PN: its own contribution, then its walk
                i_h = (r // N_PN).to(tl.int64)
                i_c, i_b, t0, n_tok = _state_row_span(g.to(tl.int64), nchunks, chunks_ptr, inner_ptr)
                _chunk_state_program(i_c, i_h, r % N_PN, i_c, i_b, t0, n_tok, x_ptr,
                                     B_ptr, dt_ptr, cs_ptr, states_ptr, nchunks, partial_ptr, partial_ptr,
                                     headdim, dstate, nheads, heads_per_group, n_nblocks, s_x_b, s_x_t, s_x_h, s_x_p,
                                     s_B_b, s_B_t, s_B_g, s_B_n, CHUNK, BLOCK_P, BLOCK_N, BLOCK_K, DOT_DTYPE, False)
                tl.debug_barrier()  # the contribution, stored in the matmul's layout, read back in the walk's
                o_n = (r % N_PN % n_nblocks) * BLOCK_N + tl.arange(0, BLOCK_N)
                _chunk_walk(g, i_h, (r % N_PN // n_nblocks) * BLOCK_P, o_n, o_n < dstate, states_ptr, decay_ptr,
                            cs_ptr, chunks_ptr, steps_ptr, chunk_steps_ptr, end_bounds_ptr, end_entries_ptr,
                            capture_rows_ptr, partial_ptr, start_ptr, state_in_ptr, slot_in_ptr, has_initial_ptr,
                            state_out_ptr, captured_ptr, counters_ptr, flags_ptr, p_partial_flags, skip_slot,
                            plain_walk, headdim, dstate, nheads, s_in_s, s_in_h, s_in_p, s_in_n, s_out_s, s_out_h,
                            s_out_p, s_out_n, s_cap_r, s_cap_h, s_cap_p, s_cap_n, HAS_INITIAL_STATE, HAS_SLOT_IN,
                            HAS_INITIAL_FLAGS, HAS_SKIP, CHUNK, BLOCK_P, WALK_ROWS, N_PN, CHUNK_FLAG)
                _raise(flags_ptr + g * nheads + i_h)
        elif r < n_chunk + n_out:
            if g >= 1:  # chunk g-1's y, an M x P block of a head, once its start state and C B^T are written
                i_c = (g - 1).to(tl.int64)
                # The chunk's row is the host's, not a producer's: requested before the wait, which
                # holds back the reads after it, so that the two round trips overlap.
                i_b, t0, n_tok, i_s = _chunk_span(chunks_ptr, i_c)
                _wait(flags_ptr + (g - 1) * nheads + (r - n_chunk) // N_MP, CHUNK_FLAG, counters_ptr)
                _chunk_output_program(i_c, ((r - n_chunk) // N_MP).to(tl.int64), (r - n_chunk) % N_MP,
                                      i_b, t0, n_tok, i_s, x_ptr, C_ptr, D_ptr, z_ptr, y_ptr, dt_ptr, cs_ptr, cb_ptr,
                                      start_ptr, slot_in_ptr, skip_slot, headdim, dstate, nheads, heads_per_group,
                                      n_pblocks, s_x_b, s_x_t, s_x_h, s_x_p, s_C_b, s_C_t, s_C_g, s_C_n, s_D_h, s_D_p,
                                      s_z_b, s_z_t, s_z_h, s_z_p, s_y_b, s_y_t, s_y_h, s_y_p,
                                      HAS_D, D_PER_HEAD, HAS_Z, HAS_SLOT_IN, HAS_SKIP, CHUNK, BLOCK_M, BLOCK_P,
                                      BLOCK_D, EVEN_D, DOT_DTYPE, True)
        else:
            if g < nchunks:  # chunk g's C B^T, a block of a group's
                r_cb = r - n_chunk - n_out
                i_mk = r_cb % (NM * NM)
                _chunk_cb_program(g.to(tl.int64), (r_cb // (NM * NM)).to(tl.int64), i_mk // NM, i_mk % NM, B_ptr,
                                  C_ptr, chunks_ptr, cb_ptr, dstate, ngroups, s_B_b, s_B_t, s_B_g, s_B_n,
                                  s_C_b, s_C_t, s_C_g, s_C_n, CHUNK, BLOCK_M, CB_BLOCK_D, CB_DOT_DTYPE)
                _raise_heads(flags_ptr + g * nheads + r_cb // (NM * NM) * heads_per_group, heads_per_group,
                             RAISE_BLOCK)
    else:  # an empty sequence's final state: its initial state
        r = t - n_partial - (nchunks + 1) * group
        n_walk = nheads * N_PASS
        i_row = (nchunks + r // n_walk).to(tl.int64)  # its row of ChunkTables.chunks
        i_h = ((r % n_walk) // N_PASS).to(tl.int64)
        o, m, o_p, o_n = _walk_block(r % N_PASS, headdim, dstate, PASS_BLOCK)
        i_s = tl.load(chunks_ptr + i_row * CHUNK_COLUMNS + 3)
        i_in, _, live, starts, _ = row_slots(i_s, 0, slot_in_ptr, slot_in_ptr, has_initial_ptr, skip_slot,
                                             HAS_SLOT_IN, False, HAS_INITIAL_FLAGS, HAS_SKIP)
        if live:
            p_cap = captured_ptr + i_h * s_cap_h + o_p * s_cap_p + o_n * s_cap_n
            state = _initial_state(i_in, starts, i_h, o_p, o_n, m, state_in_ptr, s_in_s, s_in_h, s_in_p, s_in_n,
                                   HAS_INITIAL_STATE)
            _final_state(state, i_s, i_in, i_h, o_p, o_n, m, p_cap, s_cap_r, state_out_ptr, s_out_s, s_out_h,
                         s_out_p, s_out_n, end_bounds_ptr, end_entries_ptr, capture_rows_ptr, skip_slot, HAS_SKIP)


_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# The matmul dtype of each input dtype. float16 multiplies in bfloat16: C B^T and the chunk-start
# states, stored and multiplied in it, may pass float16's 65504 where y does not.
MATMUL_DTYPES = {torch.float32: torch.float32, torch.bfloat16: torch.bfloat16, torch.float16: torch.bfloat16}


def cb_dot_dtype(p: ScanProblem) -> dict:
    """C B^T's operands, as the kernels take them: in B's and C's own dtype where they share one,
    else in float32. Their products are then exact in the float32 accumulator (stored in the
    matmul dtype, as before). Rounded to bfloat16, float16 inputs lost 3 bits an operand, and a
    dot over dstate that cancels magnifies that: y of a 1-token float16 pass, C B^T its one
    weight, came out 5e-2 RMS-relative off float64."""
    return dict(CB_DOT_DTYPE=_DOT_DTYPES[p.B.dtype if p.B.dtype == p.C.dtype else torch.float32])


@functools.lru_cache(maxsize=None)
def launch_config(headdim: int, dstate: int, chunk_size: int, dtype: torch.dtype) -> dict:
    """Tiles and warps, a function of the model dimensions, chunk size and input dtype alone (never
    of sequence lengths or batch composition, which would change rounding between passes).

    16-bit inputs: 64-row tiles with 4 warps (one warpgroup: Hopper's wgmma takes M = 64 per
    warpgroup), 3 pipeline stages (2 for the output kernel, see below). float32 inputs run IEEE
    FMA dots, whose operands live in registers: smaller K and dstate blocks keep them from
    spilling. tl.dot needs every block >= 16. Made once for each set of arguments and shared by
    every pass that takes it (cached): read it, never change it.
    """
    wide = dtype != torch.float32
    block_n = max(16, triton.next_power_of_2(dstate))
    return dict(
        BLOCK_M=min(chunk_size, 64),  # output rows and source tokens of the output kernel, CB tiles
        BLOCK_P=max(16, min(64, triton.next_power_of_2(headdim))),
        BLOCK_N=min(block_n, 128 if wide else 64),  # dstate block of chunk states and captures
        BLOCK_K=min(chunk_size, 64 if wide else 32),  # source tokens of chunk states and captures
        BLOCK_D=min(block_n, 128 if wide else 32),  # dstate block of the output kernel's C S0^T
        # C B^T's dstate block: at 16 bits two blocks of 64 for dstate 128, pipelined in 32 KB of
        # shared memory where one block of 128 took 64 KB (two stages of one iteration, which gain
        # nothing): 79 registers, six programs an SM where there were three (modelled at
        # Nemotron-H's 8 groups, 8192 tokens: 0.0152 ms against 0.0212, the pass 1.8% less).
        CB_BLOCK_D=min(block_n, 64 if wide else 32),
        PASS_BLOCK=2048,  # state elements per state-passing program (128 heads of 64 x 128: one wave, modelled)
        WALK_STAGES=3,  # the walk's steps in flight: its loads requested two steps ahead (_walk)
        num_warps=4, num_stages=3 if wide else 2,
        # The output kernel: 2 stages and at most 168 registers for 16-bit inputs, so that three
        # programs fit an SM (shared memory and registers); float32 needs 8 warps not to spill.
        output=dict(num_warps=4, num_stages=2, maxnreg=168) if wide else dict(num_warps=8, num_stages=2),
        # Its fix-up (stage5_chunk_output), the same program in a loop over its marks: twice the
        # warps and no register cap, float32 at one pipeline stage (two spilled 112 B under Triton
        # 3.6), so that the loop's registers do not make it spill (few programs, which rarely go
        # past their marks).
        fixup=dict(num_warps=8, num_stages=2) if wide else dict(num_warps=16, num_stages=1),
        # The walk (stage 4): at most 128 registers, as before its capture branches took 151, so that
        # four programs fit an SM: one wave of 128 heads' 4 blocks at 8192 tokens, where three took
        # two (0.033 ms against 0.042 at Granite-4.0-H, modelled; 0.028 against 0.026 at 80 heads).
        walk=dict(num_warps=4, num_stages=3 if wide else 2, maxnreg=128),
        # C B^T: its loop over CB_BLOCK_D-wide dstate blocks (two at dstate 128 and 16 bits) at two
        # stages; a third would only take shared memory.
        cb=dict(num_warps=4, num_stages=2),
        # dt' and its cumulative sum, a chunk's tokens a program and no loop: two warps, so that 32
        # programs share an SM where four warps fit 16 (one wave of a (chunk, head) grid, not two, at
        # 8192 tokens and 80 or 128 heads).
        cumsum=dict(num_warps=2, num_stages=1),
    )


@dataclass(frozen=True)
class Workspace:
    """A pass's launch configuration and the scratch its stages pass one another (module doc)."""

    cfg: dict  # launch_config's
    dt: torch.Tensor  # (nchunks, nheads, chunk) float32: dt', 0 past the chunk's end (stage 1)
    cs: torch.Tensor  # (nchunks, nheads, chunk) float32: cumulative log2 decay, cs_last past the end (stage 1)
    decay: torch.Tensor  # (nchunks, nheads) float32: exp(cs_last) (stage 1)
    cb: torch.Tensor  # (nchunks, ngroups, chunk, chunk) matmul dtype: C B^T on and below the diagonal (stage 2)
    # (nchunks, nheads, headdim, dstate) matmul dtype (float32 on the fused pass): each chunk's own
    # contribution (stage 3)
    states: torch.Tensor
    partial: torch.Tensor  # (ninner, nheads, headdim, dstate) matmul dtype: each inner capture's (stage 3)
    start: torch.Tensor  # (nchunks, nheads, headdim, dstate) matmul dtype: the chunk-start states (stage 4)
    # (nchunks, nheads, P blocks) int8: 1 where the chunk's x holds a non-finite entry in the head's
    # P block, else 0 (stage 3, which may also mark a clean block: below, stage5_chunk_output)
    nonfinite: torch.Tensor
    # The fused pass's (stage2to5_fused), None for the five stages: its generation and next ticket
    # (int32, advanced and reset by stage 1), and its flags (int32 from zeros, each raised by its producers
    # once a pass).
    counters: torch.Tensor | None = None
    flags: torch.Tensor | None = None

    @property
    def fused(self) -> bool:
        return self.flags is not None

    @property
    def launch(self) -> dict:
        """Launch options of the stages without their own (cfg["cumsum"], cfg["cb"], cfg["walk"], cfg["output"],
        cfg["fixup"])."""
        return dict(num_warps=self.cfg["num_warps"], num_stages=self.cfg["num_stages"])

    @property
    def dot(self) -> dict:
        """The matmul dtype, as the kernels take it."""
        return dict(DOT_DTYPE=_DOT_DTYPES[self.cb.dtype])


def workspace_key(p: ScanProblem) -> tuple:
    """What new_workspace's shapes and dtypes take from p beside its tables: the layers of a step
    with the same key share one workspace (cache_ops)."""
    return p.dims, p.x.dtype, fused_pass_enabled()


def new_workspace(p: ScanProblem, tables: ChunkTables) -> Workspace:
    """The workspace of a pass, unwritten (the fused pass's where fused_pass_enabled(): `states` in
    float32, where its walks leave the chunks' end states)."""
    nheads, headdim, dstate, ngroups = p.dims
    chunk, nchunks, ninner = tables.chunk_size, tables.nchunks, tables.inner.shape[0]
    f32, mm = dict(dtype=torch.float32, device=p.x.device), dict(dtype=MATMUL_DTYPES[p.x.dtype], device=p.x.device)
    cfg = launch_config(headdim, dstate, chunk, p.x.dtype)
    counters = flags = None
    fused = fused_pass_enabled()
    if fused:
        counters = torch.zeros(2, dtype=torch.int32, device=p.x.device)
        flags = torch.zeros(fused_counts(cfg, headdim, dstate, chunk).flags(nheads, nchunks, ninner),
                            dtype=torch.int32, device=p.x.device)
    return Workspace(
        cfg, torch.empty(nchunks, nheads, chunk, **f32),
        torch.empty(nchunks, nheads, chunk, **f32), torch.empty(nchunks, nheads, **f32),
        torch.empty(nchunks, ngroups, chunk, chunk, **mm),
        torch.empty(nchunks, nheads, headdim, dstate, **(f32 if fused else mm)),
        torch.empty(ninner, nheads, headdim, dstate, **mm), torch.empty(nchunks, nheads, headdim, dstate, **mm),
        torch.empty(nchunks, nheads, triton.cdiv(headdim, cfg["BLOCK_P"]), dtype=torch.int8, device=p.x.device),
        counters, flags)


def stage1_dt_cumsum(p: ScanProblem, tables: ChunkTables, ws: Workspace) -> None:
    """Stage 1, a program per (chunk, head): ws.dt, ws.cs and ws.decay."""
    nchunks, nheads = tables.nchunks, p.dims[0]
    if not nchunks:
        return
    dt, A = p.dt[..., 0], p.A[:, 0, 0]  # Mamba-2: one dt and one decay per head
    dt_bias = p.dt_bias[:, 0] if p.dt_bias is not None else None
    launch(_dt_cumsum_kernel, (nchunks, nheads),
        dt, A, ptr_or(dt_bias, A), tables.chunks, ws.dt, ws.cs, ws.decay, ptr_or(ws.counters, tables.chunks), nheads,
        p.dt_min, p.dt_max, *dt.stride(), A.stride(0), *strides_or_zeros(dt_bias, 1),
        **flags_for(_dt_cumsum_kernel, p), OPENS_FUSED=ws.fused, CHUNK=tables.chunk_size, **ws.cfg["cumsum"])


def stage2_chunk_cb(p: ScanProblem, tables: ChunkTables, ws: Workspace) -> None:
    """Stage 2, a program per (chunk x group, block on or below the diagonal): ws.cb."""
    _, _, dstate, ngroups = p.dims
    if not tables.nchunks:
        return
    nm = tables.chunk_size // ws.cfg["BLOCK_M"]
    launch(_chunk_cb_kernel, (tables.nchunks * ngroups, nm * (nm + 1) // 2),
        p.B, p.C, tables.chunks, ws.cb, dstate, ngroups, *p.B.stride(), *p.C.stride(),
        CHUNK=tables.chunk_size, BLOCK_M=ws.cfg["BLOCK_M"], BLOCK_D=ws.cfg["CB_BLOCK_D"], **cb_dot_dtype(p),
        **ws.cfg["cb"])


def stage3_chunk_state(p: ScanProblem, tables: ChunkTables, ws: Workspace) -> None:
    """Stage 3, a program per (chunk or inner capture, head, P x N block): ws.states, ws.partial
    and ws.nonfinite, from ws.dt and ws.cs."""
    nheads, headdim, dstate, ngroups = p.dims
    nchunks, ninner = tables.nchunks, tables.inner.shape[0]
    if not nchunks:
        return
    bp, bn = ws.cfg["BLOCK_P"], ws.cfg["BLOCK_N"]
    n_nblocks = triton.cdiv(dstate, bn)
    # The inner-capture arguments are passed, stood in for where there are none (in the matmul
    # dtype): the kernel is the same binary with or without inner captures.
    launch(_chunk_state_kernel, (nchunks + ninner, nheads, triton.cdiv(headdim, bp) * n_nblocks),
        p.x, p.B, ws.dt, ws.cs, tables.chunks, ws.states, nchunks, ptr_or(tables.inner, tables.chunks),
        ptr_or(ws.partial, ws.start), ws.nonfinite, tables.row_chunks,
        p.seqs.lengths[0] if tables.row_chunks else 0, headdim, dstate, nheads, nheads // ngroups, n_nblocks,
        *p.x.stride(), *p.B.stride(),
        CHUNK=tables.chunk_size, BLOCK_P=bp, BLOCK_N=bn, BLOCK_K=ws.cfg["BLOCK_K"], **ws.dot, **ws.launch)


def stage4_state_passing(p: ScanProblem, tables: ChunkTables, ws: Workspace) -> None:
    """Stage 4, a program per (sequence, head, block of PASS_BLOCK state elements): ws.start, the
    final states (p.state_out, or the slots of p.state_index) and p.captured, from ws.states,
    ws.decay, ws.cs and ws.partial."""
    nheads, headdim, dstate, _ = p.dims
    out, captured = p.state_out, p.captured
    if not p.seqs.count:
        return
    block = ws.cfg["PASS_BLOCK"]
    stand_in = tables.chunks  # an int64 tensor for absent tables
    launch(_state_passing_kernel, (p.seqs.count, nheads, triton.cdiv(headdim * dstate, block)),
        ptr_or(ws.states, out), ptr_or(ws.decay, out), ptr_or(ws.cs, out), tables.seq_steps, tables.steps,
        tables.end_bounds, ptr_or(tables.end_entries, stand_in), ptr_or(p.captures.row, stand_in),
        ptr_or(ws.partial, ptr_or(ws.start, out)), ptr_or(p.state_in, out), ptr_or(p.state_index, stand_in),
        ptr_or(p.has_initial, stand_in), ptr_or(ws.start, out), out, ptr_or(captured, out),
        0 if p.skip_slot is None else p.skip_slot, int(tables.plain_walk), headdim, dstate, nheads,
        *strides_or_zeros(p.state_in, 4),
        *out.stride(), *captured.stride(), **flags_for(_state_passing_kernel, p), CHUNK=tables.chunk_size,
        BLOCK=block, WALK_STAGES=ws.cfg["WALK_STAGES"], **ws.cfg["walk"])


def stage5_chunk_output(p: ScanProblem, tables: ChunkTables, ws: Workspace) -> None:
    """Stage 5, a program per (chunk, head, M x P block): p.y (not for skipped rows), from ws.dt,
    ws.cs, ws.cb and ws.start; then its fix-up, y again where ws.nonfinite marks a non-finite x.

    The output kernel takes every diagonal block's x straight into its matmul, where a non-finite
    entry would reach the rows above it through their zero weights; the fix-up computes the marked
    (chunk, head, P block)s' y again, each diagonal block's non-finite x kept out of its matmul and
    marking its column NaN from its row on (the same program with NONFINITE_X). The test and the
    marking took 15% of the output kernel's issue slots and 18% of its latency (modelled) where
    nearly every pass has none; the fix-up is a launch of a few programs that each read their marks
    and end. Every other y is the output kernel's, and on a clean block the two compute the same
    operands the same way."""
    nheads, headdim, dstate, ngroups = p.dims
    nchunks = tables.nchunks
    if not nchunks:
        return
    out = p.state_out  # a stand-in for absent inputs
    bm, bp = ws.cfg["BLOCK_M"], ws.cfg["BLOCK_P"]
    n_pblocks = triton.cdiv(headdim, bp)
    common = (p.x, p.C, ptr_or(p.D, out), ptr_or(p.z, out), p.y)
    dims_strides = (headdim, dstate, nheads, nheads // ngroups, n_pblocks, *p.x.stride(), *p.C.stride(),
                    *strides_or_zeros(p.D, 2), *strides_or_zeros(p.z, 4), *p.y.stride())
    slots = (ptr_or(p.state_index, tables.chunks), 0 if p.skip_slot is None else p.skip_slot)
    tiles = dict(CHUNK=tables.chunk_size, BLOCK_M=bm, BLOCK_P=bp, BLOCK_D=ws.cfg["BLOCK_D"],
                 EVEN_D=dstate % ws.cfg["BLOCK_D"] == 0, **ws.dot)
    # One launch unless a pass has more chunks than a grid's third axis holds; each further launch
    # takes the chunk-indexed tables and scratch from its first chunk on (and the table's spans).
    row_chunks = tables.row_chunks if nchunks <= MAX_GRID_Z else 0
    for c0 in range(0, nchunks, MAX_GRID_Z):
        c = slice(c0, c0 + MAX_GRID_Z)
        launch(_chunk_output_kernel, (tables.chunk_size // bm * n_pblocks, nheads, min(nchunks - c0, MAX_GRID_Z)),
            *common, ws.dt[c], ws.cs[c], tables.chunks[c], ws.cb[c], ws.start[c], *slots,
            row_chunks, p.seqs.lengths[0] if row_chunks else 0, *dims_strides,
            **flags_for(_chunk_output_kernel, p), **tiles, **ws.cfg["output"])
    nmarks = ws.nonfinite.numel()
    launch(_nonfinite_output_kernel, (triton.cdiv(nmarks, FIXUP_MARKS),),
        *common, ws.dt, ws.cs, tables.chunks, ws.cb, ws.start, ws.nonfinite, nmarks, *slots, *dims_strides,
        **flags_for(_nonfinite_output_kernel, p), **tiles, MARKS=FIXUP_MARKS, **ws.cfg["fixup"])


class FusedCounts(NamedTuple):
    """Programs of the fused pass (_fused_pass_kernel) for a chunk: per head, and per group."""

    n_pn: int  # chunk (and partial) programs of a head: P x N blocks
    n_pass: int  # programs of a head for an empty sequence's final state: PASS_BLOCK blocks of its state
    n_mp: int  # output programs of a head: M x P blocks
    nm: int  # C B^T blocks along each side of a chunk: nm^2 programs a group, those above the diagonal idle

    def programs(self, nheads: int, ngroups: int, nchunks: int, ninner: int, nempty: int) -> int:
        """Tickets of a pass (the kernel's docstring orders them)."""
        per_chunk = nheads * (self.n_pn + self.n_mp) + ngroups * self.nm * self.nm
        return nheads * (ninner * self.n_pn + nempty * self.n_pass) + (nchunks + 1) * per_chunk

    def flags(self, nheads: int, nchunks: int, ninner: int) -> int:
        """Flags of a pass: one per (chunk, head) for its chunk programs and its group's C B^T
        programs, one per (inner capture, head) for its partials."""
        return nheads * (nchunks + ninner)


def fused_counts(cfg: dict, headdim: int, dstate: int, chunk: int) -> FusedCounts:
    n_pblocks, nm = triton.cdiv(headdim, cfg["BLOCK_P"]), chunk // cfg["BLOCK_M"]
    return FusedCounts(n_pblocks * triton.cdiv(dstate, cfg["BLOCK_N"]),
                       triton.cdiv(headdim * dstate, cfg["PASS_BLOCK"]), nm * n_pblocks, nm)


def stage2to5_fused(p: ScanProblem, tables: ChunkTables, ws: Workspace) -> None:
    """Stages 2 to 5 in one launch (_fused_pass_kernel): what they write, from ws.dt, ws.cs and
    ws.decay (stage 1, which also opened the pass's generation). Without chunks (empty sequences
    only) stage 4 alone, as the five stages run it."""
    nheads, headdim, dstate, ngroups = p.dims
    if not tables.nchunks:
        stage4_state_passing(p, tables, ws)
        return
    chunk, nchunks, ninner, nempty = tables.chunk_size, tables.nchunks, tables.inner.shape[0], \
        tables.nrows - tables.nchunks
    cfg, out, captured, stand_in = ws.cfg, p.state_out, p.captured, tables.chunks
    counts = fused_counts(cfg, headdim, dstate, chunk)
    programs = counts.programs(nheads, ngroups, nchunks, ninner, nempty)
    launch(_fused_pass_kernel, (programs,),
        p.x, p.B, p.C, ptr_or(p.D, out), ptr_or(p.z, out), p.y, ws.dt, ws.cs, ws.decay, ws.cb, ws.states,
        ptr_or(ws.partial, ws.start), ws.start, tables.chunks, ptr_or(tables.inner, stand_in), tables.steps,
        tables.chunk_steps, tables.end_bounds, ptr_or(tables.end_entries, stand_in), ptr_or(p.captures.row, stand_in),
        ptr_or(p.state_in, out), ptr_or(p.state_index, stand_in), ptr_or(p.has_initial, stand_in), out,
        ptr_or(captured, out), ws.counters, ws.flags, nchunks, ninner,
        0 if p.skip_slot is None else p.skip_slot, int(tables.plain_walk), headdim, dstate, nheads, nheads // ngroups,
        triton.cdiv(dstate, cfg["BLOCK_N"]), triton.cdiv(headdim, cfg["BLOCK_P"]),
        *p.x.stride(), *p.B.stride(), *p.C.stride(), *strides_or_zeros(p.D, 2), *strides_or_zeros(p.z, 4),
        *p.y.stride(), *strides_or_zeros(p.state_in, 4), *out.stride(), *captured.stride(),
        **flags_for(_fused_pass_kernel, p), CHUNK=chunk, BLOCK_M=cfg["BLOCK_M"], BLOCK_P=cfg["BLOCK_P"],
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], BLOCK_D=cfg["BLOCK_D"], CB_BLOCK_D=cfg["CB_BLOCK_D"],
        EVEN_D=dstate % cfg["BLOCK_D"] == 0, PASS_BLOCK=cfg["PASS_BLOCK"],
        WALK_ROWS=min(cfg["BLOCK_P"], max(1, cfg["PASS_BLOCK"] // cfg["BLOCK_N"])),
        N_PN=counts.n_pn, N_PASS=counts.n_pass, N_MP=counts.n_mp, **ws.dot, **cb_dot_dtype(p), **cfg["output"])


STAGES = (stage1_dt_cumsum, stage2_chunk_cb, stage3_chunk_state, stage4_state_passing, stage5_chunk_output)
FUSED_STAGES = (stage1_dt_cumsum, stage2to5_fused)
# The fused pass (stages 2 to 5 in one launch) in place of the five stages: opt-in
# (SSM_KERNELS_FUSED_SSD=1, or fused_pass()) until a GPU has measured it against them. A workspace
# is made for one or the other when it is allocated (new_workspace).
FUSED_SSD = "SSM_KERNELS_FUSED_SSD"


def fused_pass_setting(environ=None) -> bool:
    """Whether SSM_KERNELS_FUSED_SSD in ``environ`` (default os.environ) asks for the fused pass:
    "1", or "0" (the default); ValueError for another value."""
    value = (os.environ if environ is None else environ).get(FUSED_SSD, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{FUSED_SSD} must be 0 or 1, got {value!r}")
    return value == "1"


# None until the first pass reads the environment (not at import: a bad value must not make the
# package unimportable, which a plugin loader would log and pass over); fused_pass() sets it.
FUSED_PASS: bool | None = None


def fused_pass_enabled() -> bool:
    """Whether passes whose workspace is allocated now run the fused pass."""
    global FUSED_PASS
    if FUSED_PASS is None:
        FUSED_PASS = fused_pass_setting()
    return FUSED_PASS


@contextlib.contextmanager
def fused_pass(enabled: bool = True):
    """Within the block, passes whose workspace is allocated there run the fused pass (enabled)
    or the five stages; FUSED_PASS as it was after."""
    global FUSED_PASS
    was, FUSED_PASS = FUSED_PASS, enabled
    try:
        yield
    finally:
        FUSED_PASS = was


def run_chunked_triton(p: ScanProblem, tables: ChunkTables, ws: Workspace | None = None) -> None:
    """The stages in order (the fused pass's where the workspace is the fused pass's); writes p.y,
    p.state_out and p.captured. ws: a workspace of this pass's shapes to reuse (a serving step's
    layers share one), else a new one."""
    assert not p.a_per_state and p.state_out_index is None, "the chunked scan serves mamba2_scan only"
    # The kernels offset a tile's tokens from its chunk's first one in int32.
    stride, name = max((abs(t.stride(1)), name) for name, t in (("x", p.x), ("B", p.B), ("C", p.C), ("y", p.y),
                                                                 ("z", p.z)) if t is not None)
    if tables.chunk_size * stride >= 2 ** 31:
        raise ValueError(f"the chunked scan needs chunk_size x (stride along the sequence) < 2^31; {name}'s stride "
                         f"of {stride} elements is too large for chunk_size={tables.chunk_size}: pass it contiguous")
    ws = ws or new_workspace(p, tables)
    for stage in FUSED_STAGES if ws.fused else STAGES:
        stage(p, tables, ws)
