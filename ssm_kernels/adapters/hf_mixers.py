"""The forwards that replace transformers' Mamba mixers: same parameters, same math as
transformers' PyTorch path, this library's causal_conv1d / mamba2_scan / mamba1_scan /
selective_state_update underneath.

Each forward keeps the mixer's own projections, norms and gating (it calls ``in_proj``,
``x_proj``, ``dt_proj``, ``norm``, ``out_proj`` of the transformers module) and replaces only the
conv and the scan. Prefill passes (any number of tokens, continuing from the cache) run
causal_conv1d and the scan with the cache's states as initial states and write the new states
back the way transformers does; one-token passes with a cached state run the decode steps in
place on the cache. A pass can write snapshots (see ``hf.capture_states``).
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass

import torch

from ..conv import causal_conv1d, causal_conv1d_update
from ..scan import mamba1_scan, mamba2_scan, selective_state_update
from ..scan import MAX_DSTATE
from . import hf_cache

CONV_ACTIVATIONS = ("silu", "swish")
# Packed-sequence keyword arguments (flash-attention style); transformers' PyTorch path ignores
# them and scans across the sequence boundaries, so the adapter refuses them rather than guess.
PACKED_KWARGS = ("seq_idx", "cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k")


@dataclass(frozen=True)
class Family:
    """A transformers mixer class this module can run: kind is "mamba2" or "mamba1"."""

    name: str
    module: str
    mixer: str
    kind: str

    def mixer_class(self):
        """The transformers class, or None when the installed transformers lacks it."""
        try:
            return getattr(importlib.import_module(f"transformers.models.{self.module}"), self.mixer, None)
        except ImportError:
            return None


FAMILIES = (
    Family("Mamba2", "mamba2.modeling_mamba2", "Mamba2Mixer", "mamba2"),
    Family("Bamba", "bamba.modeling_bamba", "BambaMixer", "mamba2"),
    Family("NemotronH", "nemotron_h.modeling_nemotron_h", "NemotronHMamba2Mixer", "mamba2"),
    Family("FalconH1", "falcon_h1.modeling_falcon_h1", "FalconH1Mixer", "mamba2"),
    Family("Zamba2", "zamba2.modeling_zamba2", "Zamba2MambaMixer", "mamba2"),
    Family("GraniteMoeHybrid", "granitemoehybrid.modeling_granitemoehybrid", "GraniteMoeHybridMambaLayer", "mamba2"),
    Family("Mamba", "mamba.modeling_mamba", "MambaMixer", "mamba1"),
    Family("FalconMamba", "falcon_mamba.modeling_falcon_mamba", "FalconMambaMixer", "mamba1"),
    Family("Jamba", "jamba.modeling_jamba", "JambaMambaMixer", "mamba1"),
)


# ---------------------------------------------------------------------------------------------
# Per-mixer geometry, checked once when a model is patched
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Geometry:
    """What a patched mixer's states look like (per sequence)."""

    kind: str
    layer_idx: int
    conv_dim: int
    conv_kernel: int
    ssm_shape: tuple[int, ...]


def geometry(mixer, family: Family) -> Geometry:
    """Check that a transformers mixer has the structure its family's forward assumes."""
    where = f"{type(mixer).__name__} (layer {getattr(mixer, 'layer_idx', '?')})"
    layer_idx = getattr(mixer, "layer_idx", None)
    if not isinstance(layer_idx, int):
        raise ValueError(f"{where} has no integer layer_idx, so its cache entry cannot be found")
    conv = mixer.conv1d
    if conv.groups != conv.in_channels or conv.in_channels != conv.out_channels:
        raise ValueError(f"{where}: conv1d must be depthwise (groups = channels), got groups={conv.groups}")
    width = int(conv.kernel_size[0])
    if getattr(mixer, "conv_kernel_size", width) != width:
        raise ValueError(f"{where}: conv_kernel_size {mixer.conv_kernel_size} != conv1d kernel {width}")
    if family.kind == "mamba2":
        nh, hd, ds, ng = mixer.num_heads, mixer.head_dim, mixer.ssm_state_size, mixer.n_groups
        if nh * hd != mixer.intermediate_size:
            raise ValueError(f"{where}: num_heads * head_dim = {nh * hd} != intermediate_size "
                             f"{mixer.intermediate_size}")
        if mixer.conv_dim != mixer.intermediate_size + 2 * ng * ds or conv.in_channels != mixer.conv_dim:
            raise ValueError(f"{where}: conv_dim {mixer.conv_dim} != intermediate + 2 * n_groups * state_size")
        if nh % ng:
            raise ValueError(f"{where}: num_heads ({nh}) must be a multiple of n_groups ({ng})")
        shape = (nh, hd, ds)
    else:
        ds = mixer.ssm_state_size
        if conv.in_channels != mixer.intermediate_size:
            raise ValueError(f"{where}: conv1d channels {conv.in_channels} != intermediate_size "
                             f"{mixer.intermediate_size}")
        shape = (mixer.intermediate_size, ds)
    if ds > MAX_DSTATE:
        raise ValueError(f"{where}: state size {ds} is beyond the kernels' limit of {MAX_DSTATE}")
    return Geometry(family.kind, layer_idx, conv.in_channels, width, shape)


# ---------------------------------------------------------------------------------------------
# Shared plumbing
# ---------------------------------------------------------------------------------------------
def _split_call(args, kwargs):
    """(cache, attention_mask, extra kwargs) from a mixer call in any transformers 5.x spelling."""
    kwargs = dict(kwargs)
    cache = None
    for name in ("cache", "cache_params", "past_key_values"):
        if name in kwargs:
            value = kwargs.pop(name)
            cache = value if value is not None else cache
    attention_mask = kwargs.pop("attention_mask", None)
    args = list(args)
    if args:
        cache = args.pop(0) if cache is None else cache
    if args:
        attention_mask = args.pop(0) if attention_mask is None else attention_mask
    if args:
        raise TypeError(f"unexpected positional arguments after (hidden_states, cache, attention_mask): {len(args)}")
    for name in PACKED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"ssm_kernels adapter: packed sequences ({name}=...) are not supported; "
                                      "transformers' PyTorch path would scan across their boundaries. Pass one "
                                      "sequence per batch row (padding with attention_mask is supported).")
    return cache, attention_mask, kwargs


def _mask_fn(mixer):
    """transformers' own apply_mask_to_padding_states from the mixer's module (it differs
    between releases), or the plain version."""
    fn = getattr(importlib.import_module(type(mixer).__module__), "apply_mask_to_padding_states", None)
    if fn is not None:
        return fn

    def apply(hidden_states, attention_mask):
        if attention_mask is None:
            return hidden_states
        return (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    return apply


def _pass_mask(attention_mask, batch, seqlen):
    """The 2D padding mask of this pass: (batch, seqlen), or None.

    A longer mask (the whole sequence so far, as transformers' Mamba-1 models pass it) is cut to
    its last seqlen columns, as transformers' create_recurrent_attention_mask does for Mamba-2.
    """
    if attention_mask is None:
        return None
    if attention_mask.ndim != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] < seqlen:
        raise ValueError(f"attention_mask must be a 2D padding mask (batch, >= seqlen) = ({batch}, >= {seqlen}), got "
                         f"shape {tuple(attention_mask.shape)}")
    return attention_mask[:, attention_mask.shape[1] - seqlen:]


def _check_inference(mixer, hidden_states):
    """Refuse a pass that autograd would need a backward of: its input, or any of the mixer's
    parameters (A_log, D, dt_bias, the conv, a projection's adapter weights), needing a gradient."""
    if torch.is_grad_enabled() and (hidden_states.requires_grad
                                    or any(p.requires_grad for p in mixer.parameters())):
        raise RuntimeError("the ssm_kernels adapter is inference-only (its kernels have no backward): run the "
                           "model under torch.no_grad() or torch.inference_mode(), or remove_ssm_kernels(model) "
                           "to train")


class _Conv:
    """The conv of one pass, in this library's layout (conv state = last width - 1 inputs)."""

    def __init__(self, mixer, backend):
        self.weight = mixer.conv1d.weight[:, 0]
        self.bias = mixer.conv1d.bias
        self.width = self.weight.shape[1]
        act = mixer.activation
        self.activation = "silu" if act in CONV_ACTIVATIONS else None
        # any other activation runs after a plain conv
        self.post = None if act in CONV_ACTIVATIONS or act is None else mixer.act
        self.backend = backend

    def finish(self, out):
        return out if self.post is None else self.post(out)


class PassContext:
    """What the model-level adapter tells a mixer about the current pass (see hf.py)."""

    def __init__(self, adapter, geometry: Geometry):
        self.adapter = adapter
        self.geometry = geometry

    def begin(self, cache, layer, batch, seqlen, attention_mask):
        """(start position or None, sorted capture offsets) of this layer's pass."""
        fresh = cache is None or not hf_cache.has_previous(layer)
        adapter, layer_idx = self.adapter, self.geometry.layer_idx
        if fresh:
            start = 0
        elif adapter.request is None and hf_cache.keeps_count(layer):
            start = None  # not needed: no capture, and the layer keeps its position (reading it waits on the device)
        else:
            start = adapter.position(cache, layer_idx)
        offsets = adapter.capture_offsets(start, seqlen, layer_idx)
        if cache is not None:
            adapter.note_pass(cache, fresh, attention_mask)
        if offsets and (adapter.was_padded(cache) if cache is not None else
                        attention_mask is not None and not bool(torch.all(attention_mask != 0))):
            raise ValueError("captures need an unpadded batch: this pass or an earlier one on its cache has padding "
                             "(attention_mask has zeros), so a row's token positions are not the pass positions")
        return start, offsets

    def end(self, cache, start, seqlen, offsets, conv_caps, ssm_caps):
        """Record the snapshots (conv_caps/ssm_caps: (len(offsets), batch, ...)) and the new position."""
        if self.adapter.request is not None:
            self.adapter.add_snapshots(cache, self.geometry.layer_idx, start, [start + k for k in offsets], conv_caps,
                                       ssm_caps)
        if cache is not None:
            self.adapter.set_position(cache, self.geometry.layer_idx, None if start is None else start + seqlen)


def _pairs(offsets, batch):
    return [(b, k) for k in offsets for b in range(batch)]


def _by_offset(captured, offsets, batch):
    return captured.reshape(len(offsets), batch, *captured.shape[1:])


def _split_kept(captured, offsets, kept, batch):
    """A pass's SSM states captured at ``offsets`` then at ``kept`` (kept_offsets): (the captures,
    the states a recording cache keeps), each by offset."""
    states = _by_offset(captured, [*offsets, *kept], batch)
    return states[:len(offsets)], states[len(offsets):]


def _prefill_conv(conv: _Conv, x, init, offsets):
    """x (batch, dim, seqlen) -> (activated out, captured conv states (noff, batch, dim, width-1))."""
    batch = x.shape[0]
    res = causal_conv1d(x, conv.weight, conv.bias, activation=conv.activation, initial_states=init,
                        capture=_pairs(offsets, batch) or None, backend=conv.backend)
    return conv.finish(res.out), _by_offset(res.captured_states, offsets, batch)


def _decode_conv(conv: _Conv, x, conv_state, offsets):
    """One token x (batch, dim) against transformers' conv state (batch, dim, width), updated in
    place as transformers' causal_conv1d_update updates it: cat(state[..., 1:], x), whose first
    column is never read. Returns (out, captures at 0 and 1)."""
    keep = conv.width - 1
    # Where the cache holds x's dtype and `width` columns, the kernel updates its newest `keep`
    # columns in place (a strided view), the first taking the second's value as the cat gives it;
    # otherwise it updates a copy, which goes back with the cat.
    in_place = keep and conv_state.dtype == x.dtype and conv_state.shape[-1] == conv.width
    tail = conv_state[..., 1:] if in_place else hf_cache.conv_tail(conv_state, keep, x)
    before = tail.clone() if 0 in offsets else None
    if in_place:
        conv_state[..., 0] = conv_state[..., 1]
    out = causal_conv1d_update(x, tail, conv.weight, conv.bias, activation=conv.activation, backend=conv.backend)
    if not in_place:
        conv_state.copy_(torch.cat([conv_state[..., -keep:][..., :1].to(x.dtype), tail], dim=-1) if keep
                         else x.unsqueeze(-1))
    return conv.finish(out), _decode_caps(offsets, before, tail)


def _decode_caps(offsets, before, after):
    """Captures of a one-token pass: offset 0 is the state before it, offset 1 the one after."""
    caps = [before if k == 0 else after.clone() for k in offsets]
    return torch.stack(caps) if caps else None


def _begin_pass(mixer, hidden_states, args, kwargs):
    """What every patched mixer forward starts with: the pass context, the cache and this layer's entry,
    the pass's attention mask and the function applying it, the pass start and capture offsets,
    and the cached conv and SSM states (None without a cache)."""
    ctx: PassContext = mixer._ssm_kernels_pass
    cache, attention_mask, _ = _split_call(args, kwargs)
    _check_inference(mixer, hidden_states)
    batch, seqlen, _ = hidden_states.shape
    attention_mask = _pass_mask(attention_mask, batch, seqlen)
    layer = None if cache is None else hf_cache.linear_layer(cache, mixer.layer_idx)
    start, offsets = ctx.begin(cache, layer, batch, seqlen, attention_mask)
    conv_state, ssm_state = (None, None) if layer is None else hf_cache.read_states(layer)
    return ctx, cache, layer, attention_mask, _mask_fn(mixer), start, offsets, conv_state, ssm_state


# ---------------------------------------------------------------------------------------------
# Mamba-2 family: Mamba2, Bamba, NemotronH, FalconH1, Zamba2, GraniteMoeHybrid
# ---------------------------------------------------------------------------------------------
def mamba2_forward(self, hidden_states, *args, **kwargs):
    """transformers' Mamba-2 mixer forward (PyTorch path) on this library's kernels."""
    ctx, cache, layer, attention_mask, mask, start, offsets, conv_state, ssm_state = _begin_pass(
        self, hidden_states, args, kwargs)
    batch, seqlen, _ = hidden_states.shape
    dtype = hidden_states.dtype
    nh, hd, ds, ng, inter = self.num_heads, self.head_dim, self.ssm_state_size, self.n_groups, self.intermediate_size

    hidden_states = mask(hidden_states, attention_mask)
    ssm_in = getattr(self, "ssm_in_multiplier", None)  # FalconH1's muP multipliers
    if ssm_in is not None:
        hidden_states = hidden_states * ssm_in
    projected = self.in_proj(hidden_states)
    mup = getattr(self, "mup_vector", None)
    if mup is not None:
        projected = projected * mup
    extra = (projected.shape[-1] - 2 * inter - 2 * ng * ds - nh) // 2  # mamba_ssm's optional MLP part
    if extra > 0:
        projected = projected[..., 2 * extra:]
    gate, xBC, dt = projected.split([inter, self.conv_dim, nh], dim=-1)
    A = -torch.exp(self.A_log.float())
    backend = ctx.adapter.backend
    conv = _Conv(self, backend)
    # FalconH1 without its gated norm gates the scan output with silu(gate) directly.
    gate_in_scan = hasattr(self, "mamba_rms_norm") and not self.mamba_rms_norm
    ssm_opts = dict(D=self.D, dt_bias=self.dt_bias, dt_softplus=True, backend=backend)

    decode = conv_state is not None and ssm_state is not None and seqlen == 1
    if decode and not hf_cache.record_past(layer):
        xBC, conv_caps = _decode_conv(conv, xBC[:, 0], conv_state, offsets)
        xBC = mask(xBC.unsqueeze(1), attention_mask)[:, 0]
        x, B, C = xBC.split([inter, ng * ds, ng * ds], dim=-1)
        state = _as_f32(ssm_state)
        before = state.clone() if 0 in offsets else None
        # transformers' decode step does not clamp dt (its prefill clamps to time_step_limit).
        y = selective_state_update(state, x.reshape(batch, nh, hd), dt[:, 0], A, B.reshape(batch, ng, ds),
                                   C.reshape(batch, ng, ds),
                                   z=gate[:, 0].reshape(batch, nh, hd) if gate_in_scan else None, **ssm_opts)
        if state is not ssm_state:
            ssm_state.copy_(state)
        hf_cache.count_step(cache, self.layer_idx)
        ssm_caps = _decode_caps(offsets, before, state)
        y = y.reshape(batch, 1, inter)
    else:
        x_in = xBC.transpose(1, 2)
        init_conv = hf_cache.conv_tail(conv_state, conv.width - 1, x_in)
        xBC, conv_caps = _prefill_conv(conv, x_in, init_conv, offsets)
        xBC = mask(xBC.transpose(1, 2), attention_mask).contiguous()
        x, B, C = xBC.split([inter, ng * ds, ng * ds], dim=-1)
        # transformers clamps dt to time_step_limit in prefill but not in its one-token step (taken
        # here too when the cache records its past).
        limit = (0.0, math.inf) if decode else (getattr(self, "time_step_limit", None) or (0.0, math.inf))
        kept = hf_cache.kept_offsets(cache, self.layer_idx, seqlen)
        result = mamba2_scan(x.unflatten(-1, (nh, hd)), dt, A, B.unflatten(-1, (ng, ds)), C.unflatten(-1, (ng, ds)),
                             z=gate.unflatten(-1, (nh, hd)) if gate_in_scan else None, dt_limit=limit,
                             initial_states=None if ssm_state is None else _as_f32(ssm_state).contiguous(),
                             capture=_pairs([*offsets, *kept], batch) or None, **ssm_opts)
        ssm_caps, kept_states = _split_kept(result.captured_states, offsets, kept, batch)
        if cache is not None:
            hf_cache.write_pass(cache, self.layer_idx, x_in, conv.width, result.final_states, kept_states)
        y = result.y.reshape(batch, seqlen, inter)
    ctx.end(cache, start, seqlen, offsets, conv_caps, ssm_caps)

    if not gate_in_scan:
        if seqlen == 1:  # one token as (batch, intermediate): some releases' FalconH1 norm mis-shapes (batch, 1, n)
            y = self.norm(y[:, 0], gate[:, 0]).unsqueeze(1)
        else:
            y = self.norm(y, gate)
    return self.out_proj(y.to(dtype))


def _as_f32(state):
    return state if state.dtype == torch.float32 else state.float()


# ---------------------------------------------------------------------------------------------
# Mamba-1 family: Mamba, FalconMamba, Jamba
# ---------------------------------------------------------------------------------------------
def mamba1_forward(self, hidden_states, *args, **kwargs):
    """transformers' Mamba-1 mixer forward (PyTorch path) on this library's kernels.

    Unlike transformers' PyTorch path, a multi-token pass that continues from the cache starts
    its scan from the cached SSM state (transformers' selective scan has no initial state and
    restarts from zeros), so chunked prefill gives the logits of a single full pass.
    """
    ctx, cache, layer, attention_mask, mask, start, offsets, conv_state, ssm_state = _begin_pass(
        self, hidden_states, args, kwargs)
    batch, seqlen, _ = hidden_states.shape
    dtype = hidden_states.dtype

    projected = self.in_proj(mask(hidden_states, attention_mask)).transpose(1, 2)
    x_in, gate = projected.chunk(2, dim=1)  # (batch, intermediate, seqlen) each
    A = -torch.exp(self.A_log.float())
    backend = ctx.adapter.backend
    conv = _Conv(self, backend)
    step = conv_state is not None and ssm_state is not None and seqlen == 1 and not hf_cache.record_past(layer)
    if step:
        x, conv_caps = _decode_conv(conv, x_in[..., 0], conv_state, offsets)
        x = x.unsqueeze(-1)
    else:
        init_conv = hf_cache.conv_tail(conv_state, conv.width - 1, x_in)
        x, conv_caps = _prefill_conv(conv, x_in, init_conv, offsets)
    x = mask(x.transpose(1, 2), attention_mask)  # (batch, seqlen, intermediate)
    time_step, B, C = torch.split(self.x_proj(x), [self.time_step_rank, self.ssm_state_size, self.ssm_state_size],
                                  dim=-1)
    if getattr(self, "dt_layernorm", None) is not None:  # FalconMamba and Jamba normalise dt, B and C
        time_step, B, C = self.dt_layernorm(time_step), self.b_layernorm(B), self.c_layernorm(C)
    if hasattr(getattr(self, "config", None), "_is_quantized"):
        time_step = (self.dt_proj(time_step) - self.dt_proj.bias).transpose(1, 2)
    else:
        time_step = self.dt_proj.weight @ time_step.transpose(1, 2)
    delta_bias = self.dt_proj.bias.float() if self.dt_proj.bias is not None else None

    state = None if ssm_state is None else _as_f32(ssm_state).contiguous()
    kept = [] if step else hf_cache.kept_offsets(cache, self.layer_idx, seqlen)
    result = mamba1_scan(x.transpose(1, 2), time_step, A, B.transpose(1, 2), C.transpose(1, 2), D=self.D.float(),
                         z=gate, delta_bias=delta_bias, delta_softplus=True, initial_states=state,
                         capture=_pairs([*offsets, *kept], batch) or None, backend=backend)
    ssm_caps, kept_states = _split_kept(result.captured_states, offsets, kept, batch)
    if step:  # its conv state already updated in place
        ssm_state.copy_(result.final_states)
        hf_cache.count_step(cache, self.layer_idx)
    elif cache is not None:
        hf_cache.write_pass(cache, self.layer_idx, x_in, conv.width, result.final_states, kept_states)
    ctx.end(cache, start, seqlen, offsets, conv_caps, ssm_caps)
    return self.out_proj(result.y.transpose(1, 2).to(dtype))


FORWARDS = {"mamba2": mamba2_forward, "mamba1": mamba1_forward}
