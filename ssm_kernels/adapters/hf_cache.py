"""transformers' cache as the adapters see it, in transformers 5.24 and 5.25.

An SSM layer's entry in a transformers ``Cache`` (``DynamicCache(config=...)``) is a
linear-attention cache layer holding, for state index 0:
    conv_states[0]: (batch, conv_dim, conv_kernel) in the activations' dtype: the last
        conv_kernel conv inputs (zero-padded at the start). Only the newest conv_kernel - 1
        columns are ever read; this library's conv state is exactly those columns.
    recurrent_states[0]: the SSM state, float32 on transformers' PyTorch path.
    has_previous_state[0]: whether the layer holds a state from an earlier pass.
    record_past: whether conv states keep their history for a later crop, and
        recurrent_states_history[0] the SSM states before the last ones, which a crop restores.
    cumulative_length_linear (from 5.25): the tokens the layer has seen, what its get_seq_length
        returns and generate feeds the prompt past; update_conv_state adds a pass's length, and
        cache.increase_count one token of a step that updated the states in place.
Only attributes and methods present in every release from 5.24 are used here, and the count
where a release keeps one.
"""
from __future__ import annotations

import torch


def linear_layer(cache, layer_idx: int):
    """The cache layer of SSM layer ``layer_idx``, checked to be a linear-attention layer."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"the cache is a {type(cache).__name__} without .layers; ssm_kernels needs a transformers "
                        "Cache such as DynamicCache(config=model.config)")
    if not 0 <= layer_idx < len(layers):
        raise ValueError(f"the cache has {len(layers)} layers, so it has no entry for SSM layer {layer_idx}; create "
                         "it with DynamicCache(config=model.config)")
    layer = layers[layer_idx]
    for attr in ("conv_states", "recurrent_states", "has_previous_state"):
        if not hasattr(layer, attr):
            raise TypeError(f"cache layer {layer_idx} is a {type(layer).__name__}, not a linear-attention (SSM) layer; "
                            "create the cache with DynamicCache(config=model.config)")
    return layer


def has_previous(layer) -> bool:
    return bool(layer.has_previous_state.get(0, False))


def record_past(layer) -> bool:
    return bool(getattr(layer, "record_past", False))


def token_counts(layers) -> list[int | None]:
    """The tokens each layer has seen (its position), where the release keeps the count (from
    5.25; a crop moves it back), else None. The counts are 0-d tensors on the states' devices,
    read back in one transfer a device."""
    counts = [getattr(layer, "cumulative_length_linear", None) for layer in layers]
    found: list[int | None] = [None if c is None or isinstance(c, torch.Tensor) else int(c) for c in counts]
    by_device: dict = {}
    for i, c in enumerate(counts):
        if isinstance(c, torch.Tensor):
            by_device.setdefault(c.device, []).append(i)
    for rows in by_device.values():
        for i, value in zip(rows, torch.stack([counts[i].reshape(()) for i in rows]).tolist()):
            found[i] = int(value)
    return found


def keeps_count(layer) -> bool:
    """Whether the release keeps the layer's position itself (token_counts)."""
    return getattr(layer, "cumulative_length_linear", None) is not None


def kept_offsets(cache, layer_idx: int, seqlen: int) -> list[int]:
    """The offsets of a pass's states, besides its final one, that a cache recording its past
    keeps for a later crop (transformers keeps the state after each of the pass's last N tokens:
    assisted decoding rolls back rejected draft tokens); none without a cache or recording."""
    keep = getattr(cache, "get_recurrent_states_to_keep", None)
    n = 0 if keep is None else min(int(keep(layer_idx) or 0), seqlen)
    return list(range(seqlen - n + 1, seqlen))


def conv_initialized(layer) -> bool:
    return bool(layer.is_conv_states_initialized.get(0, False))


def ssm_initialized(layer) -> bool:
    return bool(layer.is_recurrent_states_initialized.get(0, False))


def read_states(layer):
    """(conv_state, ssm_state) of a layer with a previous state, else (None, None)."""
    if not has_previous(layer):
        return None, None
    ssm = layer.recurrent_states[0] if ssm_initialized(layer) else None
    return layer.conv_states[0], ssm


def conv_tail(conv_state: torch.Tensor | None, keep: int, like: torch.Tensor) -> torch.Tensor | None:
    """The newest ``keep`` columns of a transformers conv state, as this library's conv state
    (batch, dim, keep) in ``like``'s dtype, zero-padded on the left if it is shorter."""
    if conv_state is None:
        return None
    tail = conv_state[..., conv_state.shape[-1] - min(keep, conv_state.shape[-1]):]
    if tail.shape[-1] < keep:
        tail = torch.nn.functional.pad(tail, (keep - tail.shape[-1], 0))
    return tail.to(dtype=like.dtype, memory_format=torch.contiguous_format, copy=True)


def write_pass(cache, layer_idx: int, conv_input: torch.Tensor, conv_kernel: int, ssm_state: torch.Tensor,
               kept=()) -> None:
    """Store a prefill pass's states as transformers' own PyTorch path does: the conv cache from
    the pass's conv inputs (batch, conv_dim, seqlen), the SSM state copied in; ``kept``: the
    states before it of those a recording cache keeps (kept_offsets), oldest first."""
    cache.update_conv_state(conv_input, layer_idx, conv_kernel_size=conv_kernel)
    cache.update_recurrent_state([*kept, ssm_state] if len(kept) else ssm_state, layer_idx=layer_idx)


def count_step(cache, layer_idx: int) -> None:
    """A one-token step that updated the layer's states in place, counted as transformers' own
    step counts it (releases that keep no count have no increase_count)."""
    increase = getattr(cache, "increase_count", None)
    if increase is not None:
        increase(layer_idx, 0)


def set_states(cache, layer_idx: int, conv_full: torch.Tensor, ssm_state: torch.Tensor, position: int) -> None:
    """Overwrite a layer's states (restore) with those at ``position``: conv_full (batch, conv_dim,
    conv_kernel), ssm_state; the layer's token count (where the release keeps one) set to position.

    Shapes are checked by the caller; an initialized state is overwritten in place (its address
    stays the same, as transformers keeps it for CUDA graphs).
    """
    layer = linear_layer(cache, layer_idx)
    conv_kernel = conv_full.shape[-1]
    if conv_initialized(layer) and not record_past(layer) and layer.conv_states[0].shape == conv_full.shape:
        layer.conv_states[0].copy_(conv_full)
        layer.has_previous_state[0] = True
    elif conv_initialized(layer) and record_past(layer):
        layer.conv_states[0] = conv_full.to(layer.conv_states[0].dtype).clone()
        layer.has_previous_state[0] = True
    else:
        layer.has_previous_state[0] = False  # so that update_conv_state stores rather than appends
        cache.update_conv_state(conv_full, layer_idx, conv_kernel_size=conv_kernel)
    cache.update_recurrent_state(ssm_state, layer_idx=layer_idx)
    if record_past(layer):  # the states kept for a crop were another sequence's, and before position
        layer.recurrent_states_history[0] = []
    count = getattr(layer, "cumulative_length_linear", None)
    if count is not None:
        count.fill_(position)


def attention_lengths(cache) -> dict[int, int]:
    """Tokens held by each attention (key/value) layer of the cache: {layer index: length}."""
    try:
        from transformers.cache_utils import CacheLayerMixin
    except ImportError:  # pragma: no cover - transformers always has it from 4.56 on
        return {}
    return {i: int(layer.get_seq_length()) for i, layer in enumerate(getattr(cache, "layers", []))
            if isinstance(layer, CacheLayerMixin)}
