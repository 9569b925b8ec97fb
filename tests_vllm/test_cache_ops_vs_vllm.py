"""ssm_kernels.cache_ops against vLLM's own CPU ops on vLLM's metadata (chunk tables from its Mamba-2
metadata builder, its slot conventions), and both against the float64 reference."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import assert_rel_close  # noqa: E402

from ssm_kernels import cache_ops  # noqa: E402
from ssm_kernels.scan.reference import mamba2_scan_ref  # noqa: E402

TOL = 1e-5  # float32, RMS-relative


def _prefill_case(lengths, computed):
    """vLLM's prefill metadata for rows of `lengths` new tokens after `computed` cached ones."""
    from vllm.v1.attention.backends.mamba_attn import BaseMambaAttentionMetadataBuilder

    qsl = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    cu_chunk, seq_idx, last_chunk, _ = BaseMambaAttentionMetadataBuilder._compute_chunk_metadata(
        64, len(lengths), torch.tensor(computed), qsl)
    return qsl, torch.tensor(cu_chunk, dtype=torch.int32), torch.tensor(seq_idx, dtype=torch.int32), \
        torch.tensor(last_chunk, dtype=torch.int32)


def test_mamba2_prefill_matches_vllm_cpu_scan():
    from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen

    lengths, computed = [70, 1, 130], [0, 128, 64]
    H, P, G, N, nslots = 8, 16, 1, 32, 10
    slots = torch.tensor([3, 7, 1], dtype=torch.int32)
    has_init = torch.tensor([c > 0 for c in computed])
    qsl, cu_chunk, seq_idx, last_chunk = _prefill_case(lengths, computed)
    T = int(qsl[-1])
    x, dt, A = torch.randn(T, H, P), torch.randn(T, H) * 0.5, -(torch.rand(H) + 0.5)
    B, C, D, dt_bias = torch.randn(T, G, N), torch.randn(T, G, N), torch.randn(H), torch.randn(H) * 0.5
    cache = torch.randn(nslots, H, P, N)
    init = torch.where(has_init[:, None, None, None], cache[slots.long()], 0)

    out_vllm = torch.empty_like(x)
    states_vllm = mamba_chunk_scan_combined_varlen(
        x, dt, A, B, C, chunk_size=64, cu_seqlens=qsl, cu_chunk_seqlens=cu_chunk, last_chunk_indices=last_chunk,
        seq_idx=seq_idx, out=out_vllm, D=D, dt_bias=dt_bias, initial_states=init, dt_softplus=True,
        state_dtype=torch.float32)

    ours = cache.clone()
    out = torch.empty_like(x)
    batch = cache_ops.prefill_batch(qsl, slots, has_initial_state=has_init, capture_seq=torch.tensor([2]),
                                 capture_offset=torch.tensor([64]), capture_slot=torch.tensor([9]))
    cache_ops.mamba2_prefill(batch, x, dt, A, B, C, ssm_state=ours, out=out, D=D, dt_bias=dt_bias, dt_softplus=True)

    ref = mamba2_scan_ref(x[None], dt[None], A, B[None], C[None], D=D, dt_bias=dt_bias, dt_softplus=True,
                          initial_states=init, cu_seqlens=qsl, capture=[(2, 64)])
    assert_rel_close(out, ref.y[0], TOL, "engine y vs float64")
    assert_rel_close(out_vllm, ref.y[0], TOL, "vLLM y vs float64")
    assert_rel_close(out, out_vllm, TOL, "engine y vs vLLM")
    assert_rel_close(ours[slots.long()], states_vllm, TOL, "final states vs vLLM")
    assert_rel_close(ours[9], ref.captured_states[0], TOL, "capture vs float64")


def test_conv_prefill_matches_vllm_cpu_conv():
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_fn_cpu

    dim, width, nslots = 48, 4, 6
    qsl = torch.tensor([0, 9, 11, 44], dtype=torch.int32)  # sequences of 9, 2 and 33 tokens
    slots = torch.tensor([2, -1, 4], dtype=torch.int32)  # the middle row is padding (PAD_SLOT_ID)
    has_init = torch.tensor([True, False, False])
    x = torch.randn(dim, 44)
    weight, bias = torch.randn(dim, width), torch.randn(dim)
    cache_vllm = torch.randn(nslots, width - 1, dim).transpose(1, 2)  # vLLM's layout, as it passes it
    ours = cache_vllm.clone()
    y_vllm = causal_conv1d_fn_cpu(x, weight, bias, cache_vllm, qsl, cache_indices=slots,
                                  has_initial_state=has_init, activation="silu")
    y = torch.full_like(x, float("nan"))
    cache_ops.conv_prefill(cache_ops.prefill_batch(qsl, slots, has_initial_state=has_init), x, weight, bias,
                        conv_state=ours, out=y, activation="silu")
    live = torch.cat([torch.arange(0, 9), torch.arange(11, 44)])
    assert_rel_close(y[:, live], y_vllm[:, live], 1e-6, "conv out")
    assert torch.equal(ours, cache_vllm), "conv states"


@pytest.mark.parametrize("padded", [False, True])
def test_decode_matches_vllm_cpu_ops(padded):
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_update_cpu
    from vllm.model_executor.layers.mamba.ops.cpu.mamba_ssm import selective_state_update

    H, P, G, N, dim, width, nslots = 4, 16, 1, 32, 96, 4, 8
    slots = torch.tensor([5, 0, 2] if padded else [5, 1, 2], dtype=torch.int32)  # 0: NULL_BLOCK_ID
    x, dt = torch.randn(3, H, P), torch.randn(3, H)
    A, B, C = -(torch.rand(H) + 0.5), torch.randn(3, G, N), torch.randn(3, G, N)
    D, dt_bias = torch.randn(H), torch.randn(H)
    state_vllm = torch.randn(nslots, H, P, N)
    ours = state_vllm.clone()
    out_vllm = torch.empty_like(x)
    # vLLM's decode call shapes (mamba_mixer2.py): per-row dt, A, D and dt_bias broadcast over headdim
    selective_state_update(state_vllm, x, dt[:, :, None].expand(3, H, P), A[:, None, None].expand(H, P, N),
                           B, C, D[:, None].expand(H, P), dt_bias=dt_bias[:, None].expand(H, P), dt_softplus=True,
                           state_batch_indices=slots, dst_state_batch_indices=slots, out=out_vllm)
    out = torch.full_like(x, float("nan"))
    batch = cache_ops.decode_batch(slots, skip_slot=cache_ops.NULL_BLOCK_ID)
    cache_ops.mamba2_decode(batch, x, dt, A, B, C, ssm_state=ours, out=out, D=D, dt_bias=dt_bias, dt_softplus=True)
    live = [0, 2] if padded else [0, 1, 2]
    assert_rel_close(out[live], out_vllm[live], TOL, "decode y")
    assert_rel_close(ours, state_vllm, TOL, "decode states")

    xc, weight, bias = torch.randn(3, dim), torch.randn(dim, width), torch.randn(dim)
    conv_vllm = torch.randn(nslots, width - 1, dim).transpose(1, 2)
    conv_ours = conv_vllm.clone()
    y_vllm = causal_conv1d_update_cpu(xc, conv_vllm, weight, bias, "silu", conv_state_indices=slots)
    y = torch.full_like(xc, float("nan"))
    cache_ops.conv_decode(batch, xc, weight, bias, conv_state=conv_ours, out=y, activation="silu")
    assert_rel_close(y[live], y_vllm[live], 1e-6, "conv decode out")
    assert torch.equal(conv_ours, conv_vllm), "conv decode states"
