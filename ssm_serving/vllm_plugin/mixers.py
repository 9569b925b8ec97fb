"""vLLM's Mamba mixers' conv + SSM step on ssm_kernels.cache_ops.

`mamba2_conv_ssm_forward` replaces `MambaMixer2.conv_ssm_forward` and `mamba1_forward_impl`
replaces `MambaMixer.forward_impl`: the same inputs, outputs and cache tensors as vLLM's own, but
the conv and the scan are this library's, writing the states in place into vLLM's cache blocks,
with every capture the step asks for (vLLM's prompt-tail checkpoint and the block ends of
captures.py) written in the same pass. Anything these do not cover (speculative decoding,
ReplaySSM, the profile run) goes to vLLM's own method.

Prefill scans run the engine's algorithm SSM_KERNELS_VLLM_PREFILL_ALGORITHM names (settings.py):
"auto" (default: the chunked scan on CUDA from mamba2_chunked.AUTO_CHUNKED_MIN_TOKENS tokens, modelled several
times faster than the recurrent one at long passes; the recurrent scan on CPU, where PyTorch's
chunked path measured slower at the plugin's shapes), "chunked" or "recurrent". The chunked
scan's grid sits at each request's computed-token count, with the model's chunk size for Mamba-2
(the engine's default, 64, for Mamba-1).
"""
from __future__ import annotations

import functools
import inspect

import torch

from ssm_kernels import cache_ops
from ssm_kernels.scan import mamba2_chunked

from . import captures, settings

# vLLM's own methods, set by install() before these are bound.
ORIGINAL: dict[str, object] = {}


def prefill_algorithm() -> str:
    """The prefill scans' algorithm, as read at start-up."""
    return settings.current.prefill_algorithm


def _chunk_size(md):
    """vLLM's Mamba-2 chunk size where the chunked scan takes it, else None (its default)."""
    try:
        return mamba2_chunked.check_chunk_size(getattr(md, "chunk_size", None))
    except (TypeError, ValueError):
        return None


def _layer_metadata(prefix: str):
    from vllm.forward_context import get_forward_context

    md = get_forward_context().attn_metadata
    return md.get(prefix) if isinstance(md, dict) else None


def _conv_state(layer):
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    # (nblocks, dim, width - 1), whichever layout vLLM keeps (the other is a transpose view).
    return layer.kv_cache[0] if is_conv_state_dim_first() else layer.kv_cache[0].transpose(-1, -2)


def mamba2_vllm_forward(layer) -> str | None:
    """Why a Mamba-2 layer runs vLLM's own forward at every step (its configuration), or None."""
    return "ReplaySSM" if layer.use_replayssm else None


def mamba1_vllm_forward(layer) -> str | None:
    """Why a Mamba-1 layer runs vLLM's own forward at every step (its configuration), or None."""
    return "LoRA" if layer.is_lora_enabled else None


@functools.cache
def _takes_batch_rows(ssm_transform) -> bool:
    return "batch_start" in inspect.signature(ssm_transform).parameters


def _ssm_transform(layer, x: torch.Tensor, batch_start: int, num_batch_tokens: int):
    """vLLM's Mamba-1 projection of the conv output (tokens, dim) to dt (dim, tokens), B and C
    (tokens, dstate). vLLM 0.34 also takes the rows' place in the step's batch (read by its LoRA
    path only; LoRA layers run vLLM's own forward)."""
    if _takes_batch_rows(type(layer)._ssm_transform):
        return layer._ssm_transform(x, batch_start, num_batch_tokens)
    return layer._ssm_transform(x)


def _validate(t: torch.Tensor) -> bool:
    """Validate batches on the host only where that costs no device sync."""
    return t.device.type == "cpu"


def _prefill_batch(md):
    """The step's PrefillBatch, built once and shared by every layer of the KV-cache group."""
    batch = getattr(md, "_ssm_prefill_batch", None)
    if batch is None:
        seq, offset, slot = captures.step_captures(md)
        positions = getattr(md, "_ssm_start_positions", None) if prefill_algorithm() != "recurrent" else None
        if positions is not None:
            # The chunked scan plans on the host from vLLM's host metadata: nothing is read back,
            # and the step's tables (captures, Mamba-2 chunks) go to the device in one copy.
            batch = cache_ops.prefill_batch(md.query_start_loc_p, md.state_indices_tensor_p,
                                         has_initial_state=md.has_initial_states_p, capture_seq=seq,
                                         capture_offset=offset, capture_slot=slot,
                                         skip_slot=cache_ops.PAD_SLOT_ID, validate=False, start_positions=positions,
                                         host_cu_seqlens=md._ssm_prefill_bounds, chunk_size=_chunk_size(md))
        else:
            batch = cache_ops.prefill_batch(md.query_start_loc_p, md.state_indices_tensor_p,
                                         has_initial_state=md.has_initial_states_p, capture_seq=seq,
                                         capture_offset=offset, capture_slot=slot, skip_slot=cache_ops.PAD_SLOT_ID,
                                         validate=_validate(md.query_start_loc_p))
        md._ssm_prefill_batch = batch
    return batch


def _first_layer(md, kind: str) -> bool:
    """True for the step's first layer call of this kind: it validates its arguments; the step's
    other layers take tensors laid out alike and skip the checks (host time per layer)."""
    seen = md.__dict__.setdefault("_ssm_validated", set())
    first = kind not in seen
    seen.add(kind)
    return first


def _decode_batch(md):
    batch = getattr(md, "_ssm_decode_batch", None)
    if batch is None:
        slots = md.state_indices_tensor_d[:, 0]
        # Padded decode rows carry NULL_BLOCK_ID (block 0 is never a request's state).
        batch = cache_ops.decode_batch(slots, skip_slot=cache_ops.NULL_BLOCK_ID, validate=_validate(slots))
        md._ssm_decode_batch = batch
    return batch


def mamba2_conv_ssm_forward(self, projected_states: torch.Tensor, output: torch.Tensor):
    md = _layer_metadata(self.prefix)
    if md is None or mamba2_vllm_forward(self) or self.num_spec > 0:
        return ORIGINAL["mamba2"](self, projected_states, output)
    hidden_states_B_C, dt = torch.split(projected_states[..., self.tped_intermediate_size:],
                                        [self.tped_conv_size, self.tped_dt_size], dim=-1)
    conv_state, ssm_state = _conv_state(self), self.kv_cache[1]
    nd, npf = md.num_decode_tokens, md.num_prefill_tokens
    xbc_d, xbc_p = torch.split(hidden_states_B_C[:nd + npf], [nd, npf], dim=0)
    dt_d, dt_p = torch.split(dt[:nd + npf], [nd, npf], dim=0)
    out_d, out_p = torch.split(output[:nd + npf], [nd, npf], dim=0)
    nheads, ngroups = self.num_heads // self.tp_size, self.n_groups // self.tp_size

    def scan_inputs(xbc, rows):
        x, B, C = self.split_hidden_states_B_C_fn(xbc)
        return x.view(rows, nheads, self.head_dim), B.view(rows, ngroups, -1), C.view(rows, ngroups, -1)

    if md.num_prefills > 0:
        batch, check = _prefill_batch(md), _first_layer(md, "mamba2 prefill")
        conv_out = torch.empty_like(xbc_p)  # (tokens, conv_dim); the engine writes its transpose view
        cache_ops.conv_prefill(batch, xbc_p.t(), self.conv_weights, self.conv1d.bias, conv_state=conv_state,
                            out=conv_out.t(), activation=self.activation, validate=check)
        x, B, C = scan_inputs(conv_out, npf)
        cache_ops.mamba2_prefill(batch, x, dt_p, self.A, B, C, ssm_state=ssm_state,
                              out=out_p.view(npf, nheads, self.head_dim), D=self.D, dt_bias=self.dt_bias,
                              dt_softplus=True, dt_limit=(0.0, float("inf")), algorithm=prefill_algorithm(),
                              chunk_size=_chunk_size(md), validate=check)
    if md.num_decodes > 0:
        batch, check = _decode_batch(md), _first_layer(md, "mamba2 decode")
        conv_out = torch.empty_like(xbc_d)
        cache_ops.conv_decode(batch, xbc_d, self.conv_weights, self.conv1d.bias, conv_state=conv_state,
                           out=conv_out, activation=self.activation, validate=check)
        x, B, C = scan_inputs(conv_out, nd)
        cache_ops.mamba2_decode(batch, x, dt_d, self.A, B, C, ssm_state=ssm_state,
                             out=out_d.view(nd, nheads, self.head_dim), D=self.D, dt_bias=self.dt_bias,
                             dt_softplus=True, dt_limit=(0.0, float("inf")), validate=check)


def mamba1_forward_impl(self, hidden_states: torch.Tensor, output: torch.Tensor):
    md = _layer_metadata(self.prefix)
    if md is None or mamba1_vllm_forward(self):
        return ORIGINAL["mamba1"](self, hidden_states, output)
    conv_state, ssm_state = _conv_state(self), self.kv_cache[1]
    projected = self.in_proj(hidden_states)[0].transpose(-2, -1)  # (2 * dim, tokens)
    xbc, gate = projected.chunk(2, dim=-2)
    weights = self.conv1d.weight.view(self.conv1d.weight.size(0), self.conv1d.weight.size(2))
    nd, npf = md.num_decode_tokens, md.num_prefill_tokens
    dim = xbc.shape[0]
    time_bias = self._time_proj_bias()
    # Decode rows first, then prefill rows, as vLLM orders them: one (tokens, dim) output whose rows
    # out_proj takes as they are (vLLM's CPU linear needs a contiguous last axis).
    y = torch.empty(nd + npf, dim, dtype=xbc.dtype, device=xbc.device)
    if md.num_decodes > 0:
        batch, check = _decode_batch(md), _first_layer(md, "mamba1 decode")
        conv_out = torch.empty(nd, dim, dtype=xbc.dtype, device=xbc.device)
        cache_ops.conv_decode(batch, xbc[:, :nd].t(), weights, self.conv1d.bias, conv_state=conv_state,
                           out=conv_out, activation=self.activation, validate=check)
        dt, B, C = _ssm_transform(self, conv_out, 0, hidden_states.shape[0])  # dt: (dim, nd); B, C: (nd, dstate)
        cache_ops.mamba1_decode(batch, conv_out, dt.t(), self.A, B, C, ssm_state=ssm_state, out=y[:nd], D=self.D,
                             z=gate[:, :nd].t(), delta_bias=time_bias, delta_softplus=True, validate=check)
    if md.num_prefills > 0:
        batch, check = _prefill_batch(md), _first_layer(md, "mamba1 prefill")
        xbc_p = xbc[:, nd:nd + npf]
        conv_out = torch.empty(npf, dim, dtype=xbc.dtype, device=xbc.device).t()  # (dim, tokens)
        cache_ops.conv_prefill(batch, xbc_p, weights, self.conv1d.bias, conv_state=conv_state, out=conv_out,
                            activation=self.activation, validate=check)
        # dt: (dim, tokens); B, C: (tokens, dstate)
        dt, B, C = _ssm_transform(self, conv_out.transpose(-2, -1), nd, hidden_states.shape[0])
        cache_ops.mamba1_prefill(batch, conv_out, dt, self.A, B.t(), C.t(), ssm_state=ssm_state, out=y[nd:].t(),
                              D=self.D, z=gate[:, nd:nd + npf], delta_bias=time_bias, delta_softplus=True,
                              algorithm=prefill_algorithm(), validate=check)
    output[:nd + npf] = self.out_proj(y)[0]
