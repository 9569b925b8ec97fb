"""Chunked Mamba-2 scan in Triton (the SSD algorithm), with captures at arbitrary offsets.

Per head, with dt' the processed dt, a_i = dt'_i * A and cs the inclusive cumulative sum of a
inside a chunk, the state after token i of a chunk that starts from state S0 is

    S_i = exp(cs_i) * S0 + sum_{j <= i} exp(cs_i - cs_j) * dt'_j * x_j (outer) B_j

so inside a chunk everything is matmuls (tensor cores), and only the chunk-start states are
passed from chunk to chunk. Five kernels, each over a grid fixed by the chunk grid and the model
dimensions:

1. _dt_cumsum_kernel     (chunk, head):              dt' and cs of every token, to scratch.
2. _chunk_state_kernel   (chunk, head, P block):     each chunk's own contribution to its end state.
3. _state_passing_kernel (sequence, head, P block):  walks a sequence's chunks in order, turning
   the contributions into chunk-start states in place, and writes the final state.
4. _chunk_output_kernel  (chunk, head, M x P block): y = C S0 decayed + the causal intra-chunk
   term + D x, gated by silu(z).
5. _capture_kernel       (capture, head, P block):   the state at offset j inside chunk c, from
   the stored start state of c: exp(cs_{j-1}) S0 + the first j tokens' contribution. It only
   reads what kernels 1-3 wrote, so asking for captures cannot change a bit of y or the final
   states. Captures at a sequence's end are copies of its final state (launcher).

Rounding depends on the chunk grid: unlike the recurrent kernel, results are not bit-identical
across different splits of a sequence into passes (see ssm_kernels.scan.chunked).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..problem import ScanProblem
from ..._triton import RUNS_ON_CPU, discretize_dt, ptr_or, strides_or_zeros
from .plan import ChunkPlan


@triton.jit
def _emulated_round(a, DOT_DTYPE: tl.constexpr):
    """fp32 `a` rounded to DOT_DTYPE (to nearest even), kept in fp32. For bfloat16 by bit
    arithmetic: the interpreter's fp32 -> bfloat16 cast truncates, the GPU's rounds to nearest."""
    if DOT_DTYPE == tl.bfloat16:
        bits = a.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        out = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    else:
        out = a.to(DOT_DTYPE).to(tl.float32)
    return out


@triton.jit
def _dot(a, b, DOT_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """a @ b of two fp32 tiles, accumulated in fp32, operands rounded to DOT_DTYPE (float32: full
    precision, no tf32).

    EMULATE (under the interpreter, whose tl.dot multiplies the raw bits of bfloat16 operands)
    rounds the operands to DOT_DTYPE and multiplies them in fp32: the same products, exact in fp32."""
    if DOT_DTYPE == tl.float32:
        out = tl.dot(a, b, input_precision="ieee")
    elif EMULATE:
        out = tl.dot(_emulated_round(a, DOT_DTYPE), _emulated_round(b, DOT_DTYPE), input_precision="ieee")
    else:
        out = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE))
    return out


@triton.jit
def _chunk_span(chunks_ptr, i_c):
    """(batch row, first token, length) of chunk i_c, from the ChunkPlan's (nchunks, 3) table."""
    return tl.load(chunks_ptr + i_c * 3), tl.load(chunks_ptr + i_c * 3 + 1), tl.load(chunks_ptr + i_c * 3 + 2)


@triton.jit
def _chunk_contribution(p_x, p_B, p_dt, p_cs, n_tok, s_x_t, s_x_p, s_B_t, s_B_n, o_p, m_p, o_n, m_n,
                        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """sum over the chunk's first n_tok tokens j of exp(cs_{n_tok-1} - cs_j) dt'_j x_j (outer) B_j.

    p_x, p_B point at the chunk's first token (this head / its group); p_dt, p_cs at the chunk's
    scratch rows. Returns a [BLOCK_P, BLOCK_N] fp32 tile (zeros when n_tok is 0)."""
    b_cs_end = tl.load(p_cs + tl.maximum(n_tok - 1, 0))
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, n_tok, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < n_tok
        b_w = tl.exp(b_cs_end - tl.load(p_cs + o_k, mask=m_k, other=0.0)) * tl.load(p_dt + o_k, mask=m_k, other=0.0)
        b_xT = tl.load(p_x + o_p[:, None] * s_x_p + o_k[None, :] * s_x_t,
                       mask=m_p[:, None] & m_k[None, :], other=0.0).to(tl.float32)  # [BP, BK]
        b_B = tl.load(p_B + o_k[:, None] * s_B_t + o_n[None, :] * s_B_n,
                      mask=m_k[:, None] & m_n[None, :], other=0.0).to(tl.float32)  # [BK, BN]
        acc += _dot(b_xT * b_w[None, :], b_B, DOT_DTYPE, EMULATE)
    return acc


@triton.jit
def _dt_cumsum_kernel(dt_ptr, A_ptr, dt_bias_ptr, chunks_ptr, dt_out_ptr, cs_out_ptr,
                      nheads, dt_min, dt_max, s_dt_b, s_dt_t, s_dt_h, s_A_h, s_bias_h,
                      HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, CHUNK: tl.constexpr):
    i_c = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_b, t0, n_tok = _chunk_span(chunks_ptr, i_c)
    o_t = tl.arange(0, CHUNK)
    m_t = o_t < n_tok
    b_dt = tl.load(dt_ptr + i_b * s_dt_b + (t0 + o_t) * s_dt_t + i_h * s_dt_h, mask=m_t, other=0.0).to(tl.float32)
    b_bias = 0.0
    if HAS_DT_BIAS:
        b_bias = tl.load(dt_bias_ptr + i_h * s_bias_h).to(tl.float32)
    b_dt = discretize_dt(b_dt, b_bias, dt_min, dt_max, HAS_DT_BIAS, DT_SOFTPLUS)
    b_dt = tl.where(m_t, b_dt, 0.0)  # tokens past the chunk neither decay nor contribute
    b_cs = tl.cumsum(b_dt * tl.load(A_ptr + i_h * s_A_h).to(tl.float32), axis=0)
    o_scr = (i_c * nheads + i_h) * CHUNK + o_t
    tl.store(dt_out_ptr + o_scr, b_dt)
    tl.store(cs_out_ptr + o_scr, b_cs)


@triton.jit
def _chunk_state_kernel(x_ptr, B_ptr, dt_ptr, cs_ptr, chunks_ptr, states_ptr,
                        headdim, dstate, nheads, heads_per_group,
                        s_x_b, s_x_t, s_x_h, s_x_p, s_B_b, s_B_t, s_B_g, s_B_n,
                        s_st_c, s_st_h, s_st_p, s_st_n,
                        CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    i_c = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_p = tl.program_id(2)
    i_g = i_h // heads_per_group
    i_b, t0, n_tok = _chunk_span(chunks_ptr, i_c)
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o_n = tl.arange(0, BLOCK_N)
    m_p = o_p < headdim
    m_n = o_n < dstate
    o_scr = (i_c * nheads + i_h) * CHUNK
    acc = _chunk_contribution(x_ptr + i_b * s_x_b + t0 * s_x_t + i_h * s_x_h,
                              B_ptr + i_b * s_B_b + t0 * s_B_t + i_g * s_B_g,
                              dt_ptr + o_scr, cs_ptr + o_scr, n_tok, s_x_t, s_x_p, s_B_t, s_B_n,
                              o_p, m_p, o_n, m_n, BLOCK_P, BLOCK_N, BLOCK_K, DOT_DTYPE, EMULATE)
    p_st = states_ptr + i_c * s_st_c + i_h * s_st_h + o_p[:, None] * s_st_p + o_n[None, :] * s_st_n
    tl.store(p_st, acc, mask=m_p[:, None] & m_n[None, :])


@triton.jit
def _state_passing_kernel(states_ptr, cs_ptr, chunks_ptr, seq_chunks_ptr, state_in_ptr, state_out_ptr,
                          headdim, dstate, nheads,
                          s_st_c, s_st_h, s_st_p, s_st_n, s_in_s, s_in_h, s_in_p, s_in_n,
                          s_out_s, s_out_h, s_out_p, s_out_n,
                          HAS_INITIAL_STATE: tl.constexpr, CHUNK: tl.constexpr,
                          BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    i_s = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_p = tl.program_id(2)
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o_n = tl.arange(0, BLOCK_N)
    m_pn = (o_p < headdim)[:, None] & (o_n < dstate)[None, :]
    if HAS_INITIAL_STATE:
        state = tl.load(state_in_ptr + i_s * s_in_s + i_h * s_in_h + o_p[:, None] * s_in_p + o_n[None, :] * s_in_n,
                        mask=m_pn, other=0.0)
    else:
        state = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    c_lo = tl.load(seq_chunks_ptr + i_s)
    c_hi = tl.load(seq_chunks_ptr + i_s + 1)
    for c in range(c_lo, c_hi):
        p_st = states_ptr + c * s_st_c + i_h * s_st_h + o_p[:, None] * s_st_p + o_n[None, :] * s_st_n
        b_own = tl.load(p_st, mask=m_pn, other=0.0)  # the chunk's own contribution (kernel 2)
        tl.store(p_st, state, mask=m_pn)  # replaced by the state at the chunk's start
        n_tok = tl.load(chunks_ptr + c * 3 + 2)
        b_cs_end = tl.load(cs_ptr + (c * nheads + i_h) * CHUNK + n_tok - 1)
        state = tl.exp(b_cs_end) * state + b_own
    tl.store(state_out_ptr + i_s * s_out_s + i_h * s_out_h + o_p[:, None] * s_out_p + o_n[None, :] * s_out_n,
             state, mask=m_pn)


@triton.jit
def _chunk_output_kernel(x_ptr, B_ptr, C_ptr, D_ptr, z_ptr, y_ptr, dt_ptr, cs_ptr, chunks_ptr, states_ptr,
                         headdim, dstate, nheads, heads_per_group, n_pblocks,
                         s_x_b, s_x_t, s_x_h, s_x_p, s_B_b, s_B_t, s_B_g, s_B_n,
                         s_C_b, s_C_t, s_C_g, s_C_n, s_D_h, s_D_p,
                         s_z_b, s_z_t, s_z_h, s_z_p, s_y_b, s_y_t, s_y_h, s_y_p,
                         s_st_c, s_st_h, s_st_p, s_st_n,
                         HAS_D: tl.constexpr, HAS_Z: tl.constexpr, CHUNK: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
                         BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    i_c = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_m = tl.program_id(2) // n_pblocks
    i_p = tl.program_id(2) % n_pblocks
    i_g = i_h // heads_per_group
    i_b, t0, n_tok = _chunk_span(chunks_ptr, i_c)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)  # output tokens (rows) of this program
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o_n = tl.arange(0, BLOCK_N)
    m_m = o_m < n_tok
    m_p = o_p < headdim
    m_n = o_n < dstate
    p_dt = dt_ptr + (i_c * nheads + i_h) * CHUNK
    p_cs = cs_ptr + (i_c * nheads + i_h) * CHUNK
    p_x = x_ptr + i_b * s_x_b + t0 * s_x_t + i_h * s_x_h
    p_B = B_ptr + i_b * s_B_b + t0 * s_B_t + i_g * s_B_g

    b_cs_m = tl.load(p_cs + o_m, mask=m_m, other=0.0)  # [BM]
    b_C = tl.load(C_ptr + i_b * s_C_b + (t0 + o_m)[:, None] * s_C_t + i_g * s_C_g + o_n[None, :] * s_C_n,
                  mask=m_m[:, None] & m_n[None, :], other=0.0).to(tl.float32)  # [BM, BN]
    # Inter-chunk term: the chunk-start state read out by C, decayed to each token.
    b_S0T = tl.load(states_ptr + i_c * s_st_c + i_h * s_st_h + o_n[:, None] * s_st_n + o_p[None, :] * s_st_p,
                    mask=m_n[:, None] & m_p[None, :], other=0.0)  # [BN, BP]
    acc = _dot(b_C, b_S0T, DOT_DTYPE, EMULATE) * tl.exp(b_cs_m)[:, None]  # [BM, BP]
    # Intra-chunk term: causal (C B^T * decay * dt) @ x over the source tokens up to this block.
    for k0 in range(0, tl.minimum((i_m + 1) * BLOCK_M, n_tok), BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < n_tok
        b_BT = tl.load(p_B + o_k[None, :] * s_B_t + o_n[:, None] * s_B_n,
                       mask=m_n[:, None] & m_k[None, :], other=0.0).to(tl.float32)  # [BN, BK]
        b_cs_k = tl.load(p_cs + o_k, mask=m_k, other=0.0)
        b_dt_k = tl.load(p_dt + o_k, mask=m_k, other=0.0)
        causal = o_m[:, None] >= o_k[None, :]
        b_decay = tl.exp(tl.where(causal, b_cs_m[:, None] - b_cs_k[None, :], -float("inf")))  # [BM, BK]
        b_w = _dot(b_C, b_BT, DOT_DTYPE, EMULATE) * b_decay * b_dt_k[None, :]
        b_x = tl.load(p_x + o_k[:, None] * s_x_t + o_p[None, :] * s_x_p,
                      mask=m_k[:, None] & m_p[None, :], other=0.0).to(tl.float32)  # [BK, BP]
        acc += _dot(b_w, b_x, DOT_DTYPE, EMULATE)
    m_mp = m_m[:, None] & m_p[None, :]
    if HAS_D:
        b_x_m = tl.load(p_x + o_m[:, None] * s_x_t + o_p[None, :] * s_x_p, mask=m_mp, other=0.0).to(tl.float32)
        acc += tl.load(D_ptr + i_h * s_D_h + o_p * s_D_p, mask=m_p, other=0.0).to(tl.float32)[None, :] * b_x_m
    if HAS_Z:
        b_z = tl.load(z_ptr + i_b * s_z_b + (t0 + o_m)[:, None] * s_z_t + i_h * s_z_h + o_p[None, :] * s_z_p,
                      mask=m_mp, other=0.0).to(tl.float32)
        acc = acc * b_z * tl.sigmoid(b_z)
    p_y = y_ptr + i_b * s_y_b + (t0 + o_m)[:, None] * s_y_t + i_h * s_y_h + o_p[None, :] * s_y_p
    tl.store(p_y, acc.to(p_y.dtype.element_ty), mask=m_mp)


@triton.jit
def _capture_kernel(x_ptr, B_ptr, dt_ptr, cs_ptr, chunks_ptr, states_ptr, inner_ptr, captured_ptr,
                    headdim, dstate, nheads, heads_per_group,
                    s_x_b, s_x_t, s_x_h, s_x_p, s_B_b, s_B_t, s_B_g, s_B_n,
                    s_st_c, s_st_h, s_st_p, s_st_n, s_cap_r, s_cap_h, s_cap_p, s_cap_n,
                    CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    i_r = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_p = tl.program_id(2)
    i_g = i_h // heads_per_group
    row = tl.load(inner_ptr + i_r * 3)
    i_c = tl.load(inner_ptr + i_r * 3 + 1)
    j = tl.load(inner_ptr + i_r * 3 + 2)  # tokens of chunk i_c consumed, 0 <= j < its length
    i_b, t0, _ = _chunk_span(chunks_ptr, i_c)
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o_n = tl.arange(0, BLOCK_N)
    m_p = o_p < headdim
    m_n = o_n < dstate
    m_pn = m_p[:, None] & m_n[None, :]
    o_scr = (i_c * nheads + i_h) * CHUNK
    b_S0 = tl.load(states_ptr + i_c * s_st_c + i_h * s_st_h + o_p[:, None] * s_st_p + o_n[None, :] * s_st_n,
                   mask=m_pn, other=0.0)
    acc = _chunk_contribution(x_ptr + i_b * s_x_b + t0 * s_x_t + i_h * s_x_h,
                              B_ptr + i_b * s_B_b + t0 * s_B_t + i_g * s_B_g,
                              dt_ptr + o_scr, cs_ptr + o_scr, j, s_x_t, s_x_p, s_B_t, s_B_n,
                              o_p, m_p, o_n, m_n, BLOCK_P, BLOCK_N, BLOCK_K, DOT_DTYPE, EMULATE)
    # j = 0: scale 1 and no contribution, so the stored chunk-start state comes out unchanged.
    b_scale = tl.where(j > 0, tl.exp(tl.load(cs_ptr + o_scr + tl.maximum(j - 1, 0))), 1.0)
    tl.store(captured_ptr + row * s_cap_r + i_h * s_cap_h + o_p[:, None] * s_cap_p + o_n[None, :] * s_cap_n,
             b_scale * b_S0 + acc, mask=m_pn)


_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def launch_config(headdim: int, dstate: int, chunk_size: int) -> dict:
    """Block sizes and warps, a function of the model dimensions and chunk size alone (never of
    sequence lengths or batch composition). tl.dot needs every block >= 16. Chosen so that no
    kernel spills registers when compiled for sm_90 (bf16 and fp32, dstate up to 256, chunk 256:
    tests/compile_for_gpu.py checks it); speed is not tuned on a GPU yet."""
    block_n = max(16, triton.next_power_of_2(dstate))
    return dict(
        BLOCK_N=block_n, BLOCK_P=max(16, min(32, triton.next_power_of_2(headdim))),
        BLOCK_M=min(chunk_size, 32), BLOCK_K=min(chunk_size, 32),
        # state passing has no dot: its tile only has to fit the registers.
        PASS_BLOCK_P=max(1, min(triton.next_power_of_2(headdim), 4096 // block_n)),
        # 2 pipeline stages: with fp32 operands and dstate 256 a third stage of the K loop's
        # tiles would approach the shared memory of smaller GPUs.
        num_warps=8, num_stages=2,
    )


def run_chunked_triton(p: ScanProblem, plan: ChunkPlan) -> None:
    """Launch the five kernels; writes p.y, p.state_out and p.captured."""
    assert not p.a_per_state and p.state_index is None, "the chunked scan serves mamba2_scan only"
    nheads, headdim, dstate, ngroups = p.dims
    chunk, nchunks, nseq = plan.chunk_size, plan.nchunks, p.seqs.count
    cfg = launch_config(headdim, dstate, chunk)
    bp, bn, bk, bm = cfg["BLOCK_P"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["BLOCK_M"]
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    dot = dict(DOT_DTYPE=_DOT_DTYPES[p.x.dtype], EMULATE=RUNS_ON_CPU)
    device = p.x.device
    # Scratch, fp32: dt' and cs per (chunk, head, token); the states per (chunk, head): first each
    # chunk's own contribution, then (state passing, in place) the state at the chunk's start.
    dt_s = torch.empty(nchunks, nheads, chunk, dtype=torch.float32, device=device)
    cs_s = torch.empty_like(dt_s)
    states = torch.empty(nchunks, nheads, headdim, dstate, dtype=torch.float32, device=device)
    out = p.state_out
    dt, A = p.dt[..., 0], p.A[:, 0, 0]  # Mamba-2: one dt and one decay per head
    dt_bias = p.dt_bias[:, 0] if p.dt_bias is not None else None
    x_strides, B_strides = p.x.stride(), p.B.stride()
    st_strides = states.stride()
    heads_per_group = nheads // ngroups
    n_pblocks = triton.cdiv(headdim, bp)
    if nchunks:
        _dt_cumsum_kernel[(nchunks, nheads)](
            dt, A, ptr_or(dt_bias, A), plan.chunks, dt_s, cs_s, nheads, p.dt_min, p.dt_max,
            *dt.stride(), A.stride(0), dt_bias.stride(0) if dt_bias is not None else 0,
            HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=p.dt_softplus, CHUNK=chunk, **launch)
        _chunk_state_kernel[(nchunks, nheads, n_pblocks)](
            p.x, p.B, dt_s, cs_s, plan.chunks, states, headdim, dstate, nheads, heads_per_group,
            *x_strides, *B_strides, *st_strides,
            CHUNK=chunk, BLOCK_P=bp, BLOCK_N=bn, BLOCK_K=bk, **dot, **launch)
    if nseq:
        pass_bp = cfg["PASS_BLOCK_P"]
        _state_passing_kernel[(nseq, nheads, triton.cdiv(headdim, pass_bp))](
            ptr_or(states, out), ptr_or(cs_s, out), ptr_or(plan.chunks, plan.seq_chunks), plan.seq_chunks,
            ptr_or(p.state_in, out), out, headdim, dstate, nheads,
            *st_strides, *strides_or_zeros(p.state_in, 4), *out.stride(),
            HAS_INITIAL_STATE=p.state_in is not None, CHUNK=chunk, BLOCK_P=pass_bp, BLOCK_N=bn,
            **launch)
    if nchunks:
        _chunk_output_kernel[(nchunks, nheads, triton.cdiv(chunk, bm) * n_pblocks)](
            p.x, p.B, p.C, ptr_or(p.D, out), ptr_or(p.z, out), p.y, dt_s, cs_s, plan.chunks, states,
            headdim, dstate, nheads, heads_per_group, n_pblocks,
            *x_strides, *B_strides, *p.C.stride(), *strides_or_zeros(p.D, 2), *strides_or_zeros(p.z, 4), *p.y.stride(),
            *st_strides, HAS_D=p.D is not None, HAS_Z=p.z is not None, CHUNK=chunk,
            BLOCK_M=bm, BLOCK_K=bk, BLOCK_P=bp, BLOCK_N=bn, **dot, **launch)
    if plan.inner_list:
        _capture_kernel[(len(plan.inner_list), nheads, n_pblocks)](
            p.x, p.B, dt_s, cs_s, plan.chunks, states, plan.inner, p.captured,
            headdim, dstate, nheads, heads_per_group,
            *x_strides, *B_strides, *st_strides, *p.captured.stride(),
            CHUNK=chunk, BLOCK_P=bp, BLOCK_N=bn, BLOCK_K=bk, **dot, **launch)
    if plan.final_rows.numel():
        p.captured[plan.final_rows] = out[plan.final_seqs]
