"""Make a transformers model run this library's kernels; capture SSM states inside a forward pass
and restore them into a transformers cache.

    model = use_ssm_kernels(AutoModelForCausalLM.from_pretrained(...))
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), capture_states(model, positions=[4096]) as snaps:
        model(input_ids, cache=cache, use_cache=True)          # one pass, state at 4096 captured in it
    ...
    restore_states(model, other_cache, snaps.at(4096))         # other_cache now continues from 4096

Positions are absolute token positions of the sequence (the state at p is the one after tokens
[0, p)); a dense batch shares them, so a snapshot is taken for every batch row.
"""
from __future__ import annotations

import functools
import re
import types
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .._common import BACKENDS, check_choice, check_int
from ..layers import Snapshot
from . import hf_cache
from .hf_mixers import FAMILIES, FORWARDS, PassContext, geometry

# The oldest release tested: generate takes the cache as `cache` from 5.24 (`past_key_values` before).
MIN_TRANSFORMERS = "5.24"
_ADAPTER_ATTR = "_ssm_kernels_adapter"
_PASS_ATTR = "_ssm_kernels_pass"
_GENERATE_ATTR = "_ssm_kernels_generate"


@dataclass(frozen=True, repr=False)
class LayerSnapshot(Snapshot):
    """A :class:`ssm_kernels.layers.Snapshot` of one SSM layer of a transformers model, for one
    sequence (batch row): ``layer`` is the layer's index in the model (its cache entry).

    position: the state after tokens [0, position); conv: (conv_dim, conv_kernel - 1) in the
    activations' dtype; ssm: float32, (nheads, headdim, dstate) for Mamba-2 mixers,
    (intermediate, dstate) for Mamba-1 mixers.
    """

    layer: int


class Captured(list):
    """The LayerSnapshots a capture_states block took, in the order taken (pass, layer, offset,
    batch row)."""

    @property
    def positions(self) -> list[int]:
        return sorted({s.position for s in self})

    def __repr__(self) -> str:
        if not self:
            return "Captured(no snapshots)"
        return (f"Captured({len(self)} snapshots at positions {self.positions}, layers "
                f"{sorted({s.layer for s in self})})")

    def at(self, position: int) -> "Captured":
        """The snapshots at one position (every SSM layer, every batch row, in order)."""
        position = check_int("position", position, 0)
        found = Captured(s for s in self if s.position == position)
        if not found:
            raise KeyError(f"no snapshot at position {position}; captured positions: {self.positions}")
        return found


@dataclass
class _Request:
    offsets: list[int] | None
    positions: list[int] | None
    out: Captured
    # id(snapshot) -> the cache its pass ran on (None: a pass without one), for the passes that overtake it
    caches: dict = field(default_factory=dict)


class _Adapter:
    """Model-level state shared by the patched mixers: backend, capture request, positions."""

    def __init__(self, backend: str):
        self.backend = backend
        self.mixers: dict[int, tuple[torch.nn.Module, object, object]] = {}  # layer -> (mixer, family, geometry)
        self.request: _Request | None = None
        # The absolute position each SSM layer of a cache is at, for the caches this adapter ran.
        self._positions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # Per cache, whether every pass since its states began was unpadded (a padded one leaves a
        # row's positions off the pass positions, and a one-token step's mask no longer shows the
        # padding): a bool tensor on the mask's device, read back only where a pass captures.
        self._unpadded: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def note_pass(self, cache, fresh: bool, attention_mask) -> None:
        """Record whether a pass on ``cache`` was padded, without reading the mask back."""
        if fresh:
            self._unpadded.pop(cache, None)
        if attention_mask is None:
            return
        unpadded = torch.all(attention_mask != 0)
        held = self._unpadded.get(cache)
        self._unpadded[cache] = unpadded if held is None else held & unpadded

    def was_padded(self, cache) -> bool:
        """Whether a pass on ``cache`` since its states began was padded (one read back)."""
        held = self._unpadded.get(cache)
        return held is not None and not bool(held)

    def forget_padding(self, cache) -> None:
        self._unpadded.pop(cache, None)

    def position(self, cache, layer_idx):
        """Where SSM layer ``layer_idx`` of ``cache`` is: the layer's own count where the release
        keeps one (a crop moves it back; reading it waits on the device), else what this
        adapter's passes recorded."""
        return self._positions_of(cache, [layer_idx])[0]

    def _positions_of(self, cache, layer_idxs):
        counts = hf_cache.token_counts([hf_cache.linear_layer(cache, i) for i in layer_idxs])
        table = self._positions.get(cache, {})
        return [table.get(i) if count is None else count for i, count in zip(layer_idxs, counts)]

    def cache_position(self, cache):
        """The position every SSM layer of ``cache`` is at (0 when none holds a state yet), or None
        when that is unknown (a pass this adapter did not run, on a release that keeps no count)
        or the layers disagree. The layers' counts are read back in one transfer."""
        try:
            layers = {i: hf_cache.linear_layer(cache, i) for i in self.mixers}
        except (TypeError, ValueError):
            return None
        advanced = [i for i, layer in layers.items() if hf_cache.has_previous(layer)]
        found = set(self._positions_of(cache, advanced)) | ({0} if len(advanced) < len(layers) else set())
        return found.pop() if len(found) == 1 else None

    def set_position(self, cache, layer_idx, position):
        table = self._positions.setdefault(cache, {})
        if position is None:
            table.pop(layer_idx, None)
        else:
            table[layer_idx] = position

    def capture_offsets(self, start, seqlen, layer_idx) -> list[int]:
        request = self.request
        if request is None:
            return []
        if request.offsets is not None:
            past = [k for k in request.offsets if k > seqlen]
            if past:
                raise ValueError(f"capture offsets {past} are past this pass's length {seqlen} (layer {layer_idx})")
            offsets = request.offsets
        elif start is None:
            offsets = request.positions  # where they fall is unknown: refused below
        else:
            offsets = [p - start for p in request.positions if start < p <= start + seqlen or p == start == 0]
        if offsets and start is None:
            raise ValueError(f"cannot capture at layer {layer_idx}: its cache was advanced by a pass the ssm_kernels "
                             "adapter did not run, so the absolute position is unknown (start from a fresh cache, "
                             "or restore_states into it)")
        return offsets

    def add_snapshots(self, cache, layer_idx, start, positions, conv_caps, ssm_caps):
        """Record a pass's snapshots of one layer (a pass from ``start`` on ``cache``). The block's
        earlier snapshots of that layer and cache past ``start``, or at a position the pass captures
        again, are dropped: the sequence went back (a crop of rejected draft tokens, a pass
        repeated without a cache) and they are not its states, or the pass has them anew."""
        request = self.request
        if request is None or start is None:
            return
        overtaken = lambda s: (s.layer == layer_idx and request.caches.get(id(s), request) is cache
                               and (s.position > start or s.position in positions))
        kept = [s for s in request.out if not overtaken(s)]
        if len(kept) < len(request.out):
            request.caches = {id(s): request.caches[id(s)] for s in kept if id(s) in request.caches}
            request.out[:] = kept
        for i, position in enumerate(positions):
            for row in range(conv_caps.shape[1]):
                snap = LayerSnapshot(position, conv_caps[i, row].clone(), ssm_caps[i, row].clone(), layer_idx)
                request.out.append(snap)
                request.caches[id(snap)] = cache


def supported_families() -> dict[str, bool]:
    """{family name: whether the installed transformers has it}."""
    return {f.name: f.mixer_class() is not None for f in FAMILIES}


def _require_transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError(f"the ssm_kernels adapter needs transformers: pip install 'transformers>={MIN_TRANSFORMERS}'"
                          ) from None
    found = tuple(int(part) for part in re.findall(r"\d+", transformers.__version__)[:2])
    if found < tuple(int(part) for part in MIN_TRANSFORMERS.split(".")):
        raise ImportError(f"the ssm_kernels adapter needs transformers >= {MIN_TRANSFORMERS} (its linear-attention "
                          f"cache layers, and generate's `cache` argument); found {transformers.__version__}")


def _discover(model):
    """[(mixer, family)] of a model; raises for an unknown SSM mixer or when there is none."""
    _require_transformers()
    classes = [(f, c) for f in FAMILIES if (c := f.mixer_class()) is not None]
    found, unknown = [], []
    for name, module in model.named_modules():
        family = next((f for f, c in classes if isinstance(module, c)), None)
        if family is not None:
            found.append((module, family))
        elif "A_log" in getattr(module, "_parameters", {}):
            unknown.append(f"{name or '<model>'} ({type(module).__name__})")
    names = ", ".join(f"{f.mixer} ({f.name})" for f in FAMILIES)
    if unknown:
        raise NotImplementedError(f"{type(model).__name__} has SSM mixers the ssm_kernels adapter cannot run: "
                                  f"{', '.join(unknown)}. Supported mixers: {names}")
    if not found:
        raise ValueError(f"{type(model).__name__} has no SSM mixer the ssm_kernels adapter supports. Supported "
                         f"mixers: {names}")
    return found


def use_ssm_kernels(model, *, backend: str = "auto"):
    """Patch every supported Mamba mixer of a transformers model to run this library's kernels.

    Supported mixers: Mamba-2 (Mamba2, Bamba, NemotronH, FalconH1, Zamba2, GraniteMoeHybrid) and
    Mamba-1 (Mamba, FalconMamba, Jamba). The model's own projections, norms and gating stay; the
    conv and the scan become causal_conv1d and mamba2_scan / mamba1_scan (prefill, continuing
    from the cache, with the scans' default algorithm "auto": README.md, section "Semantics and
    exactness") or the decode steps (one token with a cached state). Inference only.
    ``generate`` continues a cache from the position its SSM layers are at (see
    ``_continuing_the_cache``): given the whole sequence so far, it computes only the tokens past
    the cache.

    Args:
        model: a transformers model (any head); patched in place.
        backend: "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch".

    Returns:
        The same model. Raises NotImplementedError for a model with an SSM mixer this adapter
        does not know, ValueError for one without any (nothing is patched then).
    """
    check_choice("backend", backend, BACKENDS)
    found = _discover(model)
    geometries = [geometry(mixer, family) for mixer, family in found]
    layers = [g.layer_idx for g in geometries]
    if len(set(layers)) != len(layers):
        raise ValueError(f"{type(model).__name__} has two SSM mixers with one layer_idx ({sorted(layers)}); their "
                         "cache entries would collide")
    adapter = getattr(model, _ADAPTER_ATTR, None) or _Adapter(backend)
    adapter.backend = backend
    for (mixer, family), geo in zip(found, geometries):
        setattr(mixer, _PASS_ATTR, PassContext(adapter, geo))
        mixer.forward = types.MethodType(FORWARDS[family.kind], mixer)
        adapter.mixers[geo.layer_idx] = (mixer, family, geo)
    setattr(model, _ADAPTER_ATTR, adapter)
    prepare = getattr(type(model), "prepare_inputs_for_generation", None)
    if prepare is not None and _GENERATE_ATTR not in model.__dict__:
        model.prepare_inputs_for_generation = types.MethodType(_continuing_the_cache(prepare), model)
        setattr(model, _GENERATE_ATTR, True)
    return model


def _continuing_the_cache(prepare):
    """transformers' prepare_inputs_for_generation, made to continue a cache of SSM layers only
    from the position its layers are at.

    generate passes the whole sequence so far (from ``inputs_embeds``, the prompt's embeddings and
    then the generated tokens' ids). With attention layers in the cache it feeds the tokens past
    the attention cache's length (which restore_states keeps equal to the SSM position); a cache
    of SSM layers only has no length it can read, so it feeds every token on top of the state.
    Here the tokens the cache already holds are dropped, and a sequence that is not longer than
    the cache's position is refused. The wrapper keeps prepare's signature, which generate reads.
    """
    @functools.wraps(prepare)
    def prepare_inputs_for_generation(self, *args, **kwargs):
        inputs = prepare(self, *args, **kwargs)
        key = "input_ids" if inputs.get("input_ids") is not None else "inputs_embeds"
        fed = inputs.get(key)
        full = (args[0] if args else kwargs.get("input_ids")) if key == "input_ids" else kwargs.get("inputs_embeds")
        cache = inputs.get("cache", inputs.get("past_key_values"))
        if fed is None or full is None or cache is None or not all(getattr(cache, "is_linear", [False])):
            return inputs
        position = _adapter(self).cache_position(cache)
        # Generating from inputs_embeds, the ids are the tokens generated after the prompt's embeddings.
        embeds = kwargs.get("inputs_embeds") if key == "input_ids" else None
        before = 0 if embeds is None else embeds.shape[1]
        start = before + full.shape[1] - fed.shape[1]
        if position is None or start == position:
            return inputs
        if start == 0 and full.shape[1] > position:
            inputs[key] = full[:, position:].clone(memory_format=torch.contiguous_format)
            return inputs
        raise ValueError(f"generate was given {full.shape[1]} tokens and would feed the cache from token {start}, "
                         f"but the cache's SSM layers are at position {position}: pass the whole sequence so far "
                         f"({position} tokens the cache holds, then at least one more); generate then computes "
                         "only the tokens past the cache")
    return prepare_inputs_for_generation


def remove_ssm_kernels(model):
    """Undo use_ssm_kernels: the mixers run transformers' own forward again. Returns the model."""
    for module in model.modules():
        if _PASS_ATTR in module.__dict__:
            del module.__dict__[_PASS_ATTR]
            module.__dict__.pop("forward", None)
    model.__dict__.pop(_ADAPTER_ATTR, None)
    if model.__dict__.pop(_GENERATE_ATTR, None):
        model.__dict__.pop("prepare_inputs_for_generation", None)
    return model


def _adapter(model) -> _Adapter:
    adapter = getattr(model, _ADAPTER_ATTR, None)
    if adapter is None:
        raise ValueError(f"{type(model).__name__} does not run the ssm_kernels adapter: call "
                         "use_ssm_kernels(model) first")
    return adapter


def _non_negative_ints(name, values) -> list[int]:
    try:
        items = list(values)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of ints, got {values!r}") from None
    return sorted({check_int(f"{name}[{i}]", v, 0) for i, v in enumerate(items)})


def _pass_length(args, kwargs):
    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), args[0] if args else None):
        if isinstance(value, torch.Tensor) and value.ndim >= 2:
            return value.shape[1]
    return None


@contextmanager
def capture_states(model, offsets=None, positions=None):
    """Capture the SSM layers' states inside the forward passes run in this block.

    Give exactly one of:
        offsets: offsets into each pass (0 <= k <= pass length; 0 is the state before the
            pass, the length the state after it), captured in every pass of the block;
        positions: absolute positions; a pass covering [start, start + len) captures those in
            (start, start + len] (and 0 when it starts at 0), so a position reached by several
            consecutive passes is captured once.

    Yields a :class:`Captured` list that fills with one LayerSnapshot per SSM layer, batch row
    and captured position. A pass drops the block's snapshots of its cache (or, without a cache,
    of the block's other passes without one) past its start, and those at a position it captures
    again: after a crop (assisted decoding's rejected draft tokens) or a repeated pass, each
    position holds the states of the sequence as it stands. Captures need an unpadded batch and a
    cache that this adapter has run since it was fresh (or restored), so that positions are known.
    """
    adapter = _adapter(model)
    if (offsets is None) == (positions is None):
        raise TypeError("capture_states needs exactly one of offsets= or positions=")
    if adapter.request is not None:
        raise RuntimeError("capture_states blocks cannot be nested")
    request = _Request(None if offsets is None else _non_negative_ints("offsets", offsets),
                       None if positions is None else _non_negative_ints("positions", positions), Captured())

    def check_pass(module, args, kwargs):
        length = _pass_length(args, kwargs)
        if request.offsets and length is not None and request.offsets[-1] > length:
            raise ValueError(f"capture offset {request.offsets[-1]} is past this pass's length {length}")

    hook = model.register_forward_pre_hook(check_pass, with_kwargs=True)
    adapter.request = request
    try:
        yield request.out
    finally:
        adapter.request = None
        hook.remove()


def _ssm_layers(model):
    """{layer_idx: Geometry} of the model's SSM mixers (patched or not)."""
    adapter = getattr(model, _ADAPTER_ATTR, None)
    if adapter is not None:
        return {i: geo for i, (_, _, geo) in adapter.mixers.items()}
    return {g.layer_idx: g for g in (geometry(m, f) for m, f in _discover(model))}


def restore_states(model, cache, snapshots, *, position: int | None = None):
    """Write snapshots into a transformers cache so the next pass continues from their position.

    Args:
        model: the transformers model (patched by use_ssm_kernels or not).
        cache: its cache (``DynamicCache(config=model.config)``), fresh or used.
        snapshots: LayerSnapshots, all at one position: for every SSM layer of the model the
            same number of snapshots, one per batch row in row order (e.g. ``captured.at(p)``).
        position: optional, the position the caller expects (checked).

    Everything is checked before anything is written: every SSM layer present exactly once per
    row and no other layer, each snapshot's shapes and dtypes those of its layer, one position,
    the cache's initialized SSM entries of the same batch size, and, where the cache holds
    attention keys/values (hybrid models), exactly ``position`` tokens in them (restore the SSM
    state to the position the attention cache is at). On any ValueError/TypeError the cache is
    left as it was.
    """
    if position is not None:
        check_int("position", position, 0)
    layers = _ssm_layers(model)
    snapshots = list(snapshots) if not isinstance(snapshots, Snapshot) else [snapshots]
    for i, snap in enumerate(snapshots):
        if not isinstance(snap, LayerSnapshot):
            raise TypeError(f"snapshots[{i}] must be a LayerSnapshot (from capture_states), got {type(snap).__name__}")
        # A bool passes for an int elsewhere: True would restore a state as position 1.
        check_int(f"snapshots[{i}].position", snap.position, 0)
        check_int(f"snapshots[{i}].layer", snap.layer, 0)
    if not snapshots:
        raise ValueError("restore_states needs snapshots, got none")
    by_layer: dict[int, list[LayerSnapshot]] = {}
    for snap in snapshots:
        by_layer.setdefault(snap.layer, []).append(snap)
    unknown = sorted(set(by_layer) - set(layers))
    if unknown:
        raise ValueError(f"snapshots for layers {unknown}, but {type(model).__name__}'s SSM layers are "
                         f"{sorted(layers)}")
    missing = sorted(set(layers) - set(by_layer))
    if missing:
        raise ValueError(f"no snapshot for SSM layers {missing}: every SSM layer ({sorted(layers)}) needs one per row")
    counts = {i: len(s) for i, s in by_layer.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"every SSM layer needs the same number of snapshots (one per batch row), got {counts}")
    batch = next(iter(counts.values()))
    found = sorted({s.position for s in snapshots})
    if len(found) != 1:
        raise ValueError(f"snapshots must all be at one position, got positions {found}")
    at = found[0]
    if position is not None and at != position:
        raise ValueError(f"snapshots are at position {at}, expected position {position}")

    writes = []
    for layer_idx, snaps in sorted(by_layer.items()):
        geo = layers[layer_idx]
        for row, snap in enumerate(snaps):
            _check_snapshot(snap, geo, row)
        layer = hf_cache.linear_layer(cache, layer_idx)
        conv = torch.stack([s.conv for s in snaps])
        ssm = torch.stack([s.ssm for s in snaps])
        if hf_cache.conv_initialized(layer):
            have = tuple(layer.conv_states[0].shape[:2])
            if have != (batch, geo.conv_dim):
                raise ValueError(f"cache layer {layer_idx} holds conv states of shape {have + (geo.conv_kernel,)} "
                                 f"(batch {have[0]}), but the snapshots are for batch {batch}")
            conv = conv.to(layer.conv_states[0].dtype)
        if hf_cache.ssm_initialized(layer) and tuple(layer.recurrent_states[0].shape) != tuple(ssm.shape):
            raise ValueError(f"cache layer {layer_idx} holds an SSM state of shape "
                             f"{tuple(layer.recurrent_states[0].shape)}, the snapshots give {tuple(ssm.shape)}")
        full = torch.cat([conv.new_zeros(batch, geo.conv_dim, 1), conv], dim=-1)  # transformers' unread column
        writes.append((layer_idx, full, ssm))
    lengths = hf_cache.attention_lengths(cache)
    wrong = {i: n for i, n in lengths.items() if n != at}
    if wrong:
        raise ValueError(f"the cache's attention layers hold {sorted(set(lengths.values()))} tokens (layers "
                         f"{sorted(wrong)}), but the snapshots are at position {at}: restore SSM states to the "
                         "position the attention cache is at")

    adapter = getattr(model, _ADAPTER_ATTR, None)
    for layer_idx, full, ssm in writes:
        hf_cache.set_states(cache, layer_idx, full, ssm, at)
        if adapter is not None:
            adapter.set_position(cache, layer_idx, at)
    if adapter is not None:
        adapter.forget_padding(cache)  # snapshots come from unpadded passes only
    return cache


def _check_snapshot(snap: LayerSnapshot, geo, row: int):
    where = f"snapshot for layer {snap.layer} (row {row})"
    for part, got, want in (("conv", snap.conv, (geo.conv_dim, geo.conv_kernel - 1)), ("ssm", snap.ssm, geo.ssm_shape)):
        if not isinstance(got, torch.Tensor):
            raise TypeError(f"{where}: {part} must be a tensor, got {type(got).__name__}")
        if tuple(got.shape) != tuple(want):
            raise ValueError(f"{where}: {part} state has shape {tuple(got.shape)}, but layer {snap.layer} "
                             f"({geo.kind}) needs {tuple(want)}: it was taken from another layer or model")
    if snap.ssm.dtype != torch.float32:
        raise TypeError(f"{where}: the SSM state must be float32, got {snap.ssm.dtype}")
    if not snap.conv.dtype.is_floating_point:
        raise TypeError(f"{where}: the conv state must be floating point, got {snap.conv.dtype}")
