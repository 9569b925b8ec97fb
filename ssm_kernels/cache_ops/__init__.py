"""Entry points for serving engines: the scans, the conv and the decode step writing states in
place into an engine's cache tensors by slot, with in-pass captures as device index tensors.

    batch = prefill_batch(cu_seqlens, state_indices, has_initial_state=...,
                          capture_seq=..., capture_offset=..., capture_slot=...)   # once per step
    conv_prefill(batch, xBC, weight, bias, conv_state=conv_cache, out=xBC_out, activation="silu")
    mamba2_prefill(batch, x, dt, A, B, C, ssm_state=ssm_cache, out=y, D=D, dt_bias=dt_bias, dt_softplus=True)

Per-layer calls with the recurrent scan (the default) allocate nothing but the Mamba-2 scan's dt
table ((tokens, nheads, 2) float32); the prefill scans' chunked algorithm (algorithm="chunked" or
"auto", with prefill_batch(..., start_positions=...)) builds its tables and scratch in a step's
first layer. On Triton a step's later layers replay the launches its first two layers recorded
(ssm_kernels/_replay.py): no host work but the launches, no allocation (python -m bench.host counts them). With
validate=False and no start_positions the batch builders read nothing back from the device (CUDA
graphs, asynchronous scheduling); with start_positions they read the step's indices back once. Imports nothing of any
serving engine.
"""
from .batch import NULL_BLOCK_ID, PAD_SLOT_ID, DecodeBatch, PrefillBatch, decode_batch, prefill_batch
from .ops import conv_decode, conv_prefill, mamba1_decode, mamba1_prefill, mamba2_decode, mamba2_prefill

__all__ = ["PAD_SLOT_ID", "NULL_BLOCK_ID", "PrefillBatch", "DecodeBatch", "prefill_batch", "decode_batch",
           "mamba2_prefill", "mamba2_decode", "mamba1_prefill", "mamba1_decode", "conv_prefill", "conv_decode"]
