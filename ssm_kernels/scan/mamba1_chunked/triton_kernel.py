"""Mamba-1 scan parallel in time, in Triton: chunks on the absolute-position grid, an associative
scan inside each chunk, the state carried from chunk to chunk.

Per channel d and state entry n the recurrence h_t = a_t h_{t-1} + b_t (a_t = exp(dt'_t A[d, n]),
b_t = dt'_t u_t B[n, t]) is linear, so the pairs (a_t, b_t) compose associatively:
(a1, b1) then (a2, b2) is (a1 a2, a2 b1 + b2). One program owns one (sequence, BLOCK_D channels)
tile and walks its sequence chunk by chunk; inside a chunk, the CHUNK tokens' pairs are scanned
in parallel (tl.associative_scan over the time axis: in registers, then across lanes) with the
chunk's start state h0 folded into its first pair (b_0 -> a_0 h0 + b_0), giving h_t directly.
The next chunk starts from the state at the chunk's last position.

Chunks sit at the multiples of CHUNK of absolute positions (the pass's first token is at
start_positions[s]); tokens outside the pass are identities (a = 1, b = 0), which leave every
prefix exactly as it is. A chunk is therefore computed by the same operations from the same
state whichever pass it falls in, as long as passes start at grid points: splitting a sequence
there gives bit-identical results. Captures at any offset store h at that token, so they never
change a bit of y or the final states.
"""
from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..._common import CaptureTable, recent_ints
from ..._triton import (flags_for, EXACT_ROUNDING, as_f32, cast_for_store, discretize_dt, exp2_flush, fma_chain,
                        launch, ptr_or, row_slots, sequence_span, strides_or_zeros)
from ..problem import ScanProblem


@triton.jit
def _compose(a1, b1, a2, b2):
    """(a1, b1) then (a2, b2): h -> a2 (a1 h + b1) + b2."""
    return a1 * a2, tl.fma(a2, b1, b2)


@triton.jit
def _at_token(h, at):
    """h [NR, NL, CHUNK] at position `at` of the chunk, [NR, NL] (a masked sum: adding zeros is
    exact). The carried state and every capture are taken by this one function so that they are
    the same bits: a compiler may compute the scan twice in two layouts (Triton 3.6 does when the
    captures are stored from h's own layout), and two scans round differently."""
    o_t = tl.arange(0, h.shape[2])[None, None, :]
    return tl.sum(tl.where(o_t == at, h, 0.0), axis=2)


@triton.jit
def _y_of_states(h, b_C):
    """sum over the state entries of h * C, [NR, NL, CHUNK] -> [CHUNK]: each thread's NR entries
    as a chain of fused multiply-adds (the kernel compiles without contraction), then over the NL
    lanes."""
    NR: tl.constexpr = h.shape[0]
    hs = tl.reshape(tl.permute(h, (1, 2, 0)), [1, h.shape[1], h.shape[2], NR])
    cs = tl.reshape(tl.permute(b_C, (1, 2, 0)), [1, h.shape[1], h.shape[2], NR])
    acc = fma_chain(tl.full([1, h.shape[1], h.shape[2]], -0.0, tl.float32), hs, cs)  # fma(a, b, -0) = a b
    return tl.sum(tl.reshape(acc, [h.shape[1], h.shape[2]]), axis=0)


@triton.jit
def _stage_bc_kernel(B_ptr, C_ptr, stage_ptr, cu_seqlens_ptr, phases_ptr, seqlen, dstate, ngroups, nchunks,
                     s_B_b, s_B_t, s_B_g, s_B_n, s_C_b, s_C_t, s_C_g, s_C_n,
                     IS_VARLEN: tl.constexpr, HAS_POSITIONS: tl.constexpr,
                     BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """stage[s, k, g] = (B, C) of chunk k of sequence s, group g: [2, BLOCK_N, CHUNK] in the
    chunk's positions (zeros outside the pass). The chunk kernel then reads every chunk from an
    aligned address, so its loads (and the layout Triton derives from them, which fixes the
    order of the in-chunk scan) are the same for dense and varlen passes and any start."""
    i_k = tl.program_id(0).to(tl.int64)  # the chunk on the first axis: CUDA caps the others at 65535
    i_s = tl.program_id(1).to(tl.int64)
    i_g = tl.program_id(2).to(tl.int64)
    i_b, bos, length = sequence_span(cu_seqlens_ptr, i_s, seqlen, IS_VARLEN)
    phase = length - length
    if HAS_POSITIONS:
        phase += tl.load(phases_ptr + i_s)
    o_n = tl.arange(0, BLOCK_N)[:, None]
    o_j = tl.arange(0, CHUNK)[None, :]
    o_seq = i_k * CHUNK - phase + o_j
    m = (o_n < dstate) & (o_seq >= 0) & (o_seq < length)
    b_B = tl.load(B_ptr + i_b * s_B_b + (bos + o_seq) * s_B_t + i_g * s_B_g + o_n * s_B_n, mask=m, other=0.0)
    b_C = tl.load(C_ptr + i_b * s_C_b + (bos + o_seq) * s_C_t + i_g * s_C_g + o_n * s_C_n, mask=m, other=0.0)
    p_st = stage_ptr + (((i_s * nchunks + i_k) * ngroups + i_g) * 2 * BLOCK_N + o_n) * CHUNK + o_j
    tl.store(p_st, b_B.to(stage_ptr.dtype.element_ty))
    tl.store(p_st + BLOCK_N * CHUNK, b_C.to(stage_ptr.dtype.element_ty))


@triton.jit
def _kept(row, skip_slot, HAS_SKIP: tl.constexpr):
    """Whether a capture is written: an engine declines one by pointing it at the skip slot. (Masks
    take it through tl.where: the interpreter mistypes a tensor mask & a scalar one.)"""
    keep = row == row
    if HAS_SKIP:
        keep = row != skip_slot
    return keep


@triton.jit
def _next_offset(cap_offset_ptr, c, c_hi, none):
    """The offset of capture entry c, or `none` (beyond every chunk) where the sequence has no more."""
    return tl.load(cap_offset_ptr + c, mask=c < c_hi, other=none)


@triton.jit
def _store_capture(state, row, captured_ptr, i_g, i_p, o_n2, m_n2, skip_slot, s_cap_r, s_cap_g, s_cap_p, s_cap_n,
                   HAS_SKIP: tl.constexpr):
    """Capture row `row` takes `state` [NR, NL], in the capture buffer's dtype."""
    p_cap = captured_ptr + row * s_cap_r + i_g * s_cap_g + i_p * s_cap_p
    tl.store(p_cap + o_n2 * s_cap_n, cast_for_store(state, p_cap.dtype.element_ty),
             mask=tl.where(_kept(row, skip_slot, HAS_SKIP), m_n2, False))


@triton.jit
def _mamba1_chunk_kernel(
    x_ptr, dt_ptr, A_ptr, stage_ptr, D_ptr, z_ptr, dt_bias_ptr,
    state_in_ptr, state_out_ptr, y_ptr, captured_ptr, slot_in_ptr, has_initial_ptr,
    cu_seqlens_ptr, phases_ptr, cap_ptr_ptr, cap_offset_ptr, cap_row_ptr,
    seqlen, dstate, ngroups, nchunks, dt_min, dt_max, skip_slot,
    s_x_b, s_x_t, s_x_g, s_x_p,
    s_dt_b, s_dt_t, s_dt_g, s_dt_p,
    s_A_g, s_A_p, s_A_n,
    s_D_g, s_D_p,
    s_z_b, s_z_t, s_z_g, s_z_p,
    s_bias_g, s_bias_p,
    s_y_b, s_y_t, s_y_g, s_y_p,
    s_in_s, s_in_g, s_in_p, s_in_n,
    s_out_s, s_out_g, s_out_p, s_out_n,
    s_cap_r, s_cap_g, s_cap_p, s_cap_n,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, HAS_SLOT_IN: tl.constexpr, HAS_INITIAL_FLAGS: tl.constexpr,
    HAS_SKIP: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_POSITIONS: tl.constexpr,
    HAS_CAPTURE: tl.constexpr, CAPTURE_STEPS: tl.constexpr, CAPTURE_LOOP: tl.constexpr, NR: tl.constexpr,
    NL: tl.constexpr, CHUNK: tl.constexpr, PAIRS: tl.constexpr, IS_BF16: tl.constexpr,
):
    i_s = tl.program_id(0).to(tl.int64)
    i_g = tl.program_id(1).to(tl.int64)
    i_p = tl.program_id(2).to(tl.int64)
    i_b, bos, length = sequence_span(cu_seqlens_ptr, i_s, seqlen, IS_VARLEN)
    # An engine's cache: the row's slot, read and written in place; a skipped row does nothing.
    i_in, i_out, live, starts, length = row_slots(i_s, length, slot_in_ptr, slot_in_ptr, has_initial_ptr, skip_slot,
                                                  HAS_SLOT_IN, False, HAS_INITIAL_FLAGS, HAS_SKIP)
    phase = length - length  # the pass's first token's place in its chunk
    if HAS_POSITIONS:
        phase += tl.load(phases_ptr + i_s)

    # One channel; tile [NR, NL, CHUNK] of state entries n = r * NL + l and tokens. Per-token
    # channel values are [CHUNK] vectors.
    o_n2 = tl.arange(0, NR)[:, None] * NL + tl.arange(0, NL)[None, :]  # [NR, NL]
    o_n = o_n2[:, :, None]
    o_c = tl.arange(0, CHUNK)
    o_t = o_c[None, None, :]
    m_n2 = o_n2 < dstate
    m_n = o_n < dstate

    p_x = x_ptr + i_b * s_x_b + bos * s_x_t + i_g * s_x_g + i_p * s_x_p
    p_dt = dt_ptr + i_b * s_dt_b + bos * s_dt_t + i_g * s_dt_g + i_p * s_dt_p
    p_z = z_ptr + i_b * s_z_b + bos * s_z_t + i_g * s_z_g + i_p * s_z_p
    p_y = y_ptr + i_b * s_y_b + bos * s_y_t + i_g * s_y_g + i_p * s_y_p
    # This (sequence, group)'s staged chunks of B and C: [nchunks, (ngroups,) 2, NR * NL, CHUNK].
    p_stage = stage_ptr + (i_s * nchunks * ngroups + i_g) * 2 * NR * NL * CHUNK
    if PAIRS:  # 16-bit B and C read as 32-bit words of two tokens (see as_f32)
        p_stage = p_stage.to(tl.pointer_type(tl.uint32))
    W: tl.constexpr = CHUNK // 2 if PAIRS else CHUNK  # loaded elements per row of a chunk
    p_bc = p_stage + o_n * W + tl.arange(0, W)[None, None, :]

    # exp(dt' A) as exp2(dt' A log2(e)): one multiply per element fewer.
    b_A = tl.load(A_ptr + i_g * s_A_g + i_p * s_A_p + o_n * s_A_n, mask=m_n, other=0.0) * 1.4426950408889634
    b_D = 0.0
    if HAS_D:
        b_D = tl.load(D_ptr + i_g * s_D_g + i_p * s_D_p).to(tl.float32)
    b_bias = 0.0
    if HAS_DT_BIAS:
        b_bias = tl.load(dt_bias_ptr + i_g * s_bias_g + i_p * s_bias_p).to(tl.float32)

    h0 = tl.zeros([NR, NL], dtype=tl.float32)
    if HAS_INITIAL_STATE:
        p_h0 = state_in_ptr + i_in * s_in_s + i_g * s_in_g + i_p * s_in_p + o_n2 * s_in_n
        h0 = tl.load(p_h0, mask=tl.where(starts, m_n2, False), other=0.0).to(tl.float32)

    # Captures, in offset order: entry c is the next, at offset nxt (past every chunk once none is left).
    c = 0
    c_hi = 0
    nxt = 0
    if HAS_CAPTURE:
        c = tl.load(cap_ptr_ptr + i_s)
        c_hi = tl.where(live, tl.load(cap_ptr_ptr + i_s + 1), c)  # a skipped row captures nothing
        nxt = _next_offset(cap_offset_ptr, c, c_hi, length + CHUNK)
        while nxt == 0:  # offset 0: the initial state
            _store_capture(h0, tl.load(cap_row_ptr + c), captured_ptr, i_g, i_p, o_n2, m_n2, skip_slot,
                           s_cap_r, s_cap_g, s_cap_p, s_cap_n, HAS_SKIP)
            c += 1
            nxt = _next_offset(cap_offset_ptr, c, c_hi, length + CHUNK)

    # Triton's software pipeline loads the next chunks' inputs while one is computed.
    for k in tl.range(0, tl.where(length > 0, tl.cdiv(phase + length, CHUNK), 0), num_stages=3):
        lo = k * CHUNK - phase  # the sequence offset of the chunk's position 0
        o_seq = lo + o_c  # [CHUNK]
        m_c = (o_seq >= 0) & (o_seq < length)
        b_x = tl.load(p_x + o_seq * s_x_t, mask=m_c, other=0.0).to(tl.float32)
        b_dt = tl.load(p_dt + o_seq * s_dt_t, mask=m_c, other=0.0).to(tl.float32)
        b_dt = discretize_dt(b_dt, b_bias, dt_min, dt_max, HAS_DT_BIAS, DT_SOFTPLUS)
        b_dt = tl.where(m_c, b_dt, 0.0)  # outside the pass: a = exp(0) = 1, b = 0, the identity
        b_B = as_f32(tl.load(p_bc + k * (ngroups * 2 * NR * NL * W)), PAIRS, IS_BF16)
        b_a = exp2_flush(b_dt[None, None, :] * b_A)  # [NR, NL, CHUNK]
        b_b = (b_dt * b_x)[None, None, :] * b_B
        # The chunk's start state enters at position 0: (a_0, b_0) -> (a_0, a_0 h0 + b_0). Before
        # the pass's first token the pairs are identities, which carry h0 to it unchanged.
        b_b = tl.where(o_t == 0, b_a * h0[:, :, None] + b_b, b_b)
        _, h = tl.associative_scan((b_a, b_b), axis=2, combine_fn=_compose)  # the state after each token
        b_C = as_f32(tl.load(p_bc + k * (ngroups * 2 * NR * NL * W) + NR * NL * W), PAIRS, IS_BF16)
        b_y = _y_of_states(h, b_C)  # [CHUNK]
        if HAS_D:
            b_y += b_D * b_x
        if HAS_Z:
            b_z = tl.load(p_z + o_seq * s_z_t, mask=m_c, other=0.0).to(tl.float32)
            b_y = b_y * b_z * tl.sigmoid(b_z)
        tl.store(p_y + o_seq * s_y_t, cast_for_store(b_y, y_ptr.dtype.element_ty), mask=m_c)
        # Captures after this chunk's tokens: the state after offset o is h at token o - 1.
        if CAPTURE_STEPS > 0:
            # At most CAPTURE_STEPS of them, in unrolled steps: a loop nested here would keep
            # Triton from pipelining the chunk loop's loads. A chunk without one only compares.
            for _ in tl.static_range(CAPTURE_STEPS):
                if nxt <= lo + CHUNK:
                    _store_capture(_at_token(h, nxt - 1 - lo), tl.load(cap_row_ptr + c), captured_ptr, i_g, i_p,
                                   o_n2, m_n2, skip_slot, s_cap_r, s_cap_g, s_cap_p, s_cap_n, HAS_SKIP)
                    c += 1
                    nxt = _next_offset(cap_offset_ptr, c, c_hi, length + CHUNK)
        if CAPTURE_LOOP:  # any number of them
            while nxt <= lo + CHUNK:
                _store_capture(_at_token(h, nxt - 1 - lo), tl.load(cap_row_ptr + c), captured_ptr, i_g, i_p,
                               o_n2, m_n2, skip_slot, s_cap_r, s_cap_g, s_cap_p, s_cap_n, HAS_SKIP)
                c += 1
                nxt = _next_offset(cap_offset_ptr, c, c_hi, length + CHUNK)
        h0 = _at_token(h, CHUNK - 1)  # past the pass's end the tokens are identities: the final state

    p_out = state_out_ptr + i_out * s_out_s + i_g * s_out_g + i_p * s_out_p + o_n2 * s_out_n
    tl.store(p_out, cast_for_store(h0, p_out.dtype.element_ty), mask=tl.where(live, m_n2, False))



# A chunk takes up to this many captures in unrolled steps; a pass with more in one chunk takes
# them in a loop, which keeps Triton from pipelining the chunk loop (docs/chunked.md, Mamba-1).
MAX_CAPTURE_STEPS = 4


def capture_steps(captures: CaptureTable, chunk: int, start_positions: list[int]) -> tuple[int, bool]:
    """(CAPTURE_STEPS, CAPTURE_LOOP) of a pass: the most captures after one chunk's tokens (offset
    0, the initial state, is taken before the chunks), as a power of two up to MAX_CAPTURE_STEPS;
    (0, True), the loop, beyond it or where the offsets are on the device only."""
    if any(entry is None for entry in captures.entries):
        return 0, True
    per_chunk = Counter((s, (start_positions[s] % chunk + offset - 1) // chunk)
                        for s, offset, _ in captures.entries if offset > 0)
    most = max(per_chunk.values(), default=0)
    if most > MAX_CAPTURE_STEPS:
        return 0, True
    return (triton.next_power_of_2(most) if most else 0), False


@functools.lru_cache(maxsize=None)
def launch_config(dstate: int, chunk: int, input_bits: int) -> tuple[int, int]:
    """(NR, NL) of a program, which is one warp per channel (num_warps=1); a thread holds a 128-bit run of tokens for NR
    state entries, the chunk's tokens spread over the lanes and NL lanes share the state
    entries. Small programs keep many warps of a layer in flight."""
    block_n = triton.next_power_of_2(dstate)
    time_lanes = max(1, min(32, chunk // (128 // input_bits)))
    nl = min(block_n, max(1, 32 // time_lanes))
    return block_n // nl, nl


@dataclass(frozen=True)
class Workspace:
    """A pass's launch configuration and scratch: each sequence's phase on the chunk grid (None
    when every sequence starts on it) and B and C staged per chunk."""

    nr: int
    nl: int
    nchunks: int
    phases: torch.Tensor | None  # (nseq,) int64
    stage: torch.Tensor  # (nseq, nchunks, ngroups, 2, NR * NL, chunk): B and C, in B's dtype or float32


def workspace_key(p: ScanProblem) -> tuple:
    """What new_workspace's shapes and dtypes take from p beside the pass's sequences and chunk:
    the layers of a step with the same key share one workspace (cache_ops)."""
    return p.A.shape[2], p.x.shape[2], p.B.dtype, p.C.dtype


def new_workspace(p: ScanProblem, chunk: int, start_positions: list[int]) -> Workspace:
    """The workspace of a pass, unwritten (a serving step's layers share one)."""
    nr, nl = launch_config(p.A.shape[2], chunk, p.B.element_size() * 8)
    phases = [position % chunk for position in start_positions]
    nchunks = max((triton.cdiv(phase + n, chunk) if n else 0 for n, phase in zip(p.seqs.lengths, phases)), default=0)
    stage_dtype = p.B.dtype if p.B.dtype == p.C.dtype else torch.float32
    return Workspace(nr, nl, nchunks,
                     recent_ints(tuple(phases), p.x.device) if any(phases) else None,  # one copy for like calls
                     torch.empty(len(phases), nchunks, p.x.shape[2], 2, nr * nl, chunk, dtype=stage_dtype,
                                 device=p.x.device))


def run_triton(p: ScanProblem, chunk: int, start_positions: list[int], ws: Workspace | None = None) -> None:
    """Stage B and C per chunk, then launch over (sequence, group, channel); writes p.y,
    p.state_out, p.captured (by slot on an engine's cache: p.state_index, has_initial and
    skip_slot as the recurrent kernel takes them). ws: a workspace of this pass's shapes to reuse,
    else a new one."""
    nseq = p.seqs.count
    if nseq == 0:
        return
    _, _, ngroups, rows = p.x.shape
    dstate = p.A.shape[2]
    ws = ws or new_workspace(p, chunk, start_positions)
    nr, nl, nchunks, phases, stage = ws.nr, ws.nl, ws.nchunks, ws.phases, ws.stage
    stage_dtype = stage.dtype
    out = p.state_out
    cap = p.captures
    steps, loop = capture_steps(cap, chunk, start_positions)
    if nchunks:
        launch(_stage_bc_kernel, (nchunks, nseq, ngroups),
            p.B, p.C, stage, ptr_or(p.seqs.cu_seqlens, out), ptr_or(phases, out), p.x.shape[1], dstate, ngroups,
            nchunks, *p.B.stride(), *p.C.stride(), **flags_for(_stage_bc_kernel, p), HAS_POSITIONS=phases is not None,
            BLOCK_N=nr * nl, CHUNK=chunk, num_warps=4, **EXACT_ROUNDING)
    launch(_mamba1_chunk_kernel, (nseq, ngroups, rows),
        ptr_or(p.x, out), ptr_or(p.dt, out), p.A, ptr_or(stage, out), ptr_or(p.D, out),
        ptr_or(p.z, out), ptr_or(p.dt_bias, out), ptr_or(p.state_in, out), out, ptr_or(p.y, out),
        ptr_or(p.captured, out), ptr_or(p.state_index, out), ptr_or(p.has_initial, out),
        ptr_or(p.seqs.cu_seqlens, out), ptr_or(phases, out), ptr_or(cap.ptr, out), ptr_or(cap.offset, out),
        ptr_or(cap.row, out), p.x.shape[1], dstate, ngroups, nchunks, p.dt_min, p.dt_max,
        0 if p.skip_slot is None else p.skip_slot,
        *p.x.stride(), *p.dt.stride(), *p.A.stride(),
        *strides_or_zeros(p.D, 2), *strides_or_zeros(p.z, 4), *strides_or_zeros(p.dt_bias, 2), *p.y.stride(),
        *strides_or_zeros(p.state_in, 4), *p.state_out.stride(), *p.captured.stride(),
        **flags_for(_mamba1_chunk_kernel, p), HAS_POSITIONS=phases is not None,
        CAPTURE_STEPS=steps, CAPTURE_LOOP=loop, NR=nr, NL=nl, CHUNK=chunk, PAIRS=stage_dtype != torch.float32,
        IS_BF16=stage_dtype == torch.bfloat16,
        num_warps=1, **EXACT_ROUNDING,
    )
