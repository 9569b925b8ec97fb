"""A small hybrid language model: Mamba-2 and attention layers interleaved, each followed by an
MLP, with pre-norm residuals, seeded random weights, and per-pass state capture.

Every op runs so that a token's result never depends on the pass it is in (projections and norms
as batch-invariant row ops, see ssm_kernels.layers.rows and model.blocks; the Mamba layers with
exact=True). With the recurrent scan (the default) a prefill split into any passes, resumed from
any captured snapshot, therefore gives bit-identical logits to one cold pass. With the chunked scan
(``scan_algorithm="chunked"``) that holds for passes that start at multiples of ``chunk_size``
(``scan_grid``), which is what the planner's grid option plans.
"""
from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass, field
from collections.abc import Mapping, Set as AbstractSet
from typing import Iterable, NamedTuple, Sequence

import torch
from torch import nn

from ssm_kernels import MAX_DSTATE
from ssm_kernels._common import resolve_backend
from ssm_kernels.layers import Mamba2Mixer, Snapshot, exact_linear
from ssm_kernels.scan.mamba2_chunked import check_chunk_size

from .blocks import MLP, Attention, KVCache, RMSNorm

LOGITS = ("all", "last", "none")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Every weight is allocated when the model is built (on the CPU first), and every layer is a few
# Python modules: sizes past these are refused, not attempted. 2**31 float32 weights are 8 GiB.
MAX_PARAMETERS = 2**31
MAX_LAYERS = 1024
MAX_SEED = 2**64 - 1  # torch.manual_seed's range


def check_int(name: str, value, minimum: int, maximum: int | None = None) -> int:
    """``value`` if it is an int (not a bool: TypeError) in [minimum, maximum] (no upper bound when
    None; ValueError), naming ``name``."""
    expected = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int {expected}, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be an int {expected}, got {value!r}")
    return value


def _check_iterable(name: str, value, items: str):
    """``value`` if it is an iterable other than a string (whose characters are no ``items``)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a sequence of {items}, got {type(value).__name__}")
    return value


def check_tokens(tokens, vocab_size: int) -> list[int]:
    """Token ids as a list of ints: a sequence (or other ordered iterable, e.g. a 1-D NumPy array)
    of ints, not bools or floats, or a 1-D integer tensor; each in [0, vocab_size)."""
    if isinstance(tokens, torch.Tensor):
        if tokens.ndim != 1 or tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise TypeError(f"tokens must be a 1-D integer tensor or a sequence of ints, got a tensor of shape "
                            f"{tuple(tokens.shape)} and dtype {tokens.dtype}")
        if tokens.device.type == "meta":
            raise ValueError("tokens is on the meta device, which holds no values")
        ids = tokens.tolist()
    else:
        if isinstance(tokens, (AbstractSet, Mapping)) or getattr(tokens, "ndim", 1) != 1:  # no order, or not 1-D
            shape = f" of shape {tuple(tokens.shape)}" if hasattr(tokens, "shape") else ""
            raise TypeError(f"tokens must be a sequence of ints or a 1-D integer tensor, got "
                            f"{type(tokens).__name__}{shape}")
        ids = []
        for i, token in enumerate(_check_iterable("tokens", tokens, "ints or a 1-D integer tensor")):
            try:
                if isinstance(token, bool):
                    raise TypeError
                ids.append(operator.index(token))
            except TypeError:
                raise TypeError(f"tokens[{i}] must be an int token id, got {token!r} "
                                f"({type(token).__name__})") from None
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token ids must be in [0, {vocab_size}), got tokens[{bad}] = {ids[bad]}")
    return ids


@dataclass(frozen=True)
class HybridConfig:
    """Sizes of the hybrid model. Layer i is attention when attention_every > 0 and
    (i + 1) % attention_every == 0, else Mamba-2 (mamba_heads * mamba_head_dim channels).
    scan_algorithm and chunk_size go to the Mamba layers' mamba2_scan ("recurrent" or "chunked";
    chunk_size None: the scan's default)."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 4
    attention_every: int = 2
    num_attention_heads: int = 4
    mamba_heads: int = 4
    mamba_head_dim: int = 32
    state_size: int = 16
    n_groups: int = 1
    conv_kernel: int = 4
    mlp_size: int = 128
    eps: float = 1e-5
    seed: int = 0
    dtype: torch.dtype = torch.float32
    scan_algorithm: str = "recurrent"
    chunk_size: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_attention_heads", "mamba_heads", "mamba_head_dim",
                     "state_size", "n_groups", "conv_kernel", "mlp_size"):
            check_int(name, getattr(self, name), 1)
        check_int("num_layers", self.num_layers, 1, MAX_LAYERS)
        check_int("attention_every", self.attention_every, 0)
        check_int("seed", self.seed, 0, MAX_SEED)
        if isinstance(self.eps, bool) or not isinstance(self.eps, numbers.Real) or not 0 < self.eps < math.inf:
            raise ValueError(f"eps must be a positive finite number, got {self.eps!r}")
        if self.dtype not in DTYPES:
            raise TypeError(f"dtype must be one of {', '.join(map(str, DTYPES))} (the kernels' activation dtypes), "
                            f"got {self.dtype!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                             f"({self.num_attention_heads})")
        if self.mamba_heads % self.n_groups:
            raise ValueError(f"mamba_heads ({self.mamba_heads}) must be a multiple of n_groups ({self.n_groups})")
        if self.state_size > MAX_DSTATE:
            raise ValueError(f"state_size {self.state_size} is beyond the kernels' limit of {MAX_DSTATE}")
        if self.scan_algorithm not in ("recurrent", "chunked"):
            raise ValueError(f"scan_algorithm must be 'recurrent' or 'chunked', got {self.scan_algorithm!r}")
        check_chunk_size(self.chunk_size)
        if self.num_parameters > MAX_PARAMETERS:
            embeddings = 2 * self.vocab_size * self.hidden_size
            raise ValueError(f"a model of these sizes would have {self.num_parameters} parameters (2 x vocab_size "
                             f"{self.vocab_size} x hidden_size {self.hidden_size} in the embeddings and the LM head, "
                             f"{self.num_parameters - embeddings} in the rest), more than the limit of "
                             f"{MAX_PARAMETERS} (all are allocated when the model is built): lower the sizes")

    @property
    def num_parameters(self) -> int:
        """The model's parameter count, from the sizes alone."""
        h, heads = self.hidden_size, self.mamba_heads
        inner = heads * self.mamba_head_dim
        conv = inner + 2 * self.n_groups * self.state_size  # the conv's channels: x, B and C
        # in_proj (z, xBC, dt), the depthwise conv with its bias, dt_bias/A_log/D, the gated norm, out_proj.
        mamba = h * (inner + conv + heads) + conv * (self.conv_kernel + 1) + 3 * heads + inner + inner * h
        attention = 4 * h * h  # qkv and o_proj
        block = 2 * h + 3 * h * self.mlp_size  # two norms and the SwiGLU MLP
        attentions = self.layer_types.count("attention")
        layers = self.num_layers * block + attentions * attention + (self.num_layers - attentions) * mamba
        return 2 * self.vocab_size * h + h + layers  # embeddings, LM head, final norm

    @property
    def scan_grid(self) -> int:
        """The positions a pass may start at for bit-identical results: anywhere (1) with the
        recurrent scan, multiples of the chunk size with the chunked one."""
        return check_chunk_size(self.chunk_size) if self.scan_algorithm == "chunked" else 1

    @property
    def layer_types(self) -> tuple[str, ...]:
        every = self.attention_every
        return tuple("attention" if every and (i + 1) % every == 0 else "mamba2" for i in range(self.num_layers))


@dataclass(frozen=True, eq=False)
class ModelSnapshot:
    """The Mamba layers' states at an absolute position (attention KV lives in a block store)."""

    position: int
    layers: tuple[Snapshot, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.layers)


@dataclass
class ModelState:
    """One sequence's running state: a LayerState per Mamba layer and a KVCache per attention
    layer (in layer order), at ``position`` (tokens consumed)."""

    position: int
    layers: list = field(default_factory=list)


def _check_offsets(capture, length: int) -> list[int]:
    """Capture offsets of a pass of ``length`` tokens: ints in [0, length]."""
    offsets = []
    for i, k in enumerate(_check_iterable("capture", capture, "int offsets")):
        if isinstance(k, bool) or not isinstance(k, (int, numbers.Integral)):
            raise TypeError(f"capture[{i}] must be an int offset, got {k!r} ({type(k).__name__})")
        if not 0 <= k <= length:
            raise ValueError(f"capture[{i}] = {k} is outside this pass's offsets 0..{length}")
        offsets.append(int(k))
    return offsets


class PassOutput(NamedTuple):
    """logits: (T, vocab) for "all", (1, vocab) for "last", None for "none"; state: the state
    after the pass (the same object, advanced); snapshots: one per capture, in order."""

    logits: torch.Tensor | None
    state: ModelState
    snapshots: list[ModelSnapshot]


class _Block(nn.Module):
    def __init__(self, config: HybridConfig, kind: str, backend: str):
        super().__init__()
        self.kind = kind
        self.norm1 = RMSNorm(config.hidden_size, config.eps, dtype=config.dtype)
        if kind == "attention":
            self.mixer = Attention(config.hidden_size, config.num_attention_heads, dtype=config.dtype)
        else:
            self.mixer = Mamba2Mixer(config.hidden_size, config.mamba_heads, config.mamba_head_dim,
                                     config.state_size, config.n_groups, config.conv_kernel,
                                     layer_norm_epsilon=config.eps, exact=True, backend=backend,
                                     dtype=config.dtype, algorithm=config.scan_algorithm,
                                     chunk_size=config.chunk_size)
        self.norm2 = RMSNorm(config.hidden_size, config.eps, dtype=config.dtype)
        self.mlp = MLP(config.hidden_size, config.mlp_size, dtype=config.dtype)


class HybridLM(nn.Module):
    """Embeddings, interleaved Mamba-2/attention blocks (each with an MLP), a final RMSNorm and an
    LM head, with seeded random weights. Serves one sequence per pass.

    backend: the kernels' backend ("auto": Triton on CUDA, PyTorch on CPU).
    """

    def __init__(self, config: HybridConfig = HybridConfig(), *, backend: str = "auto", device=None):
        # Checked before any weight is built (the Mamba layers check backend as they are built).
        if not isinstance(config, HybridConfig):
            raise TypeError(f"config must be a HybridConfig, got {type(config).__name__}")
        if device is not None:
            try:
                device = torch.device(device)
            except (RuntimeError, TypeError) as error:
                raise ValueError(f"device must be a torch device or its name, got {device!r} ({error})") from None
            if device.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device is {device}, but this torch has no CUDA device")
        super().__init__()
        self.config = config
        self.backend = backend
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            self.embed = nn.Embedding(config.vocab_size, config.hidden_size, dtype=config.dtype)
            self.blocks = nn.ModuleList(_Block(config, kind, backend) for kind in config.layer_types)
            self.norm = RMSNorm(config.hidden_size, config.eps, dtype=config.dtype)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=config.dtype)
        self.requires_grad_(False)
        self.eval()
        if device is not None:
            self.to(device)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def check_ready(self) -> None:
        """Refuse to compute on the meta device (the weights have shapes but no values), with a
        backend that cannot run on the model's device (Triton on CPU without its interpreter), or
        with weights moved to a dtype other than the config's (the states and KV are the config's)."""
        if self.device.type == "meta":
            raise ValueError("the model is on the meta device, which holds shapes but no weights: build it on a real "
                             "device (HybridLM(config, device=...)) or load weights into it first")
        resolve_backend(self.backend, self.device)
        if self.embed.weight.dtype != self.config.dtype:
            raise TypeError(f"the model's weights are {self.embed.weight.dtype}, its config's dtype "
                            f"{self.config.dtype}: build it with HybridConfig(dtype=...) rather than moving it")

    @property
    def mamba_layers(self) -> list[Mamba2Mixer]:
        return [b.mixer for b in self.blocks if b.kind == "mamba2"]

    @property
    def attention_layers(self) -> list[Attention]:
        return [b.mixer for b in self.blocks if b.kind == "attention"]

    # -- states -----------------------------------------------------------------------------
    def new_state(self) -> ModelState:
        """The state before token 0."""
        dtype, device = self.config.dtype, self.device
        return ModelState(0, [b.mixer.initial_state(dtype=dtype, device=device) if b.kind == "mamba2"
                              else b.mixer.new_cache(dtype=dtype, device=device) for b in self.blocks])

    def restore(self, snapshot: ModelSnapshot | None, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> ModelState:
        """The state at ``snapshot.position`` (0 when None) from its Mamba snapshots and the
        attention layers' keys and values of positions [0, position) (one (k, v) pair of
        (position, heads, head_dim) tensors per attention layer)."""
        if snapshot is None:
            return self.new_state()
        if not isinstance(snapshot, ModelSnapshot):
            raise TypeError(f"snapshot must be a ModelSnapshot or None, got {type(snapshot).__name__}")
        kv = list(_check_iterable("kv", kv, "(keys, values) pairs"))
        mamba, attention = iter(snapshot.layers), iter(enumerate(kv))
        if len(snapshot.layers) != len(self.mamba_layers) or len(kv) != len(self.attention_layers):
            raise ValueError(f"a snapshot of {len(snapshot.layers)} Mamba layers and KV of {len(kv)} attention "
                             f"layers does not fit a model of {len(self.mamba_layers)} and "
                             f"{len(self.attention_layers)}")
        for i, layer in enumerate(snapshot.layers):
            if isinstance(layer, Snapshot) and layer.position != snapshot.position:
                raise ValueError(f"snapshot.layers[{i}] is at position {layer.position}, the snapshot at "
                                 f"{snapshot.position}: a snapshot's layers are taken at one position")
        layers = []
        for block in self.blocks:
            if block.kind == "mamba2":
                layers.append(block.mixer.restore(next(mamba)))
            else:
                j, pair = next(attention)
                if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                    raise TypeError(f"kv[{j}] must be a (keys, values) pair, got {type(pair).__name__}")
                k, v = pair
                want = (snapshot.position, block.mixer.num_heads, block.mixer.head_dim)
                for name, t in (("keys", k), ("values", v)):
                    if not isinstance(t, torch.Tensor):
                        raise TypeError(f"KV {name} must be tensors, got {type(t).__name__}")
                    if tuple(t.shape) != want:
                        raise ValueError(f"KV {name} of shape {tuple(t.shape)} must be (position, heads, head_dim) = "
                                         f"{want}: rows for the snapshot's {snapshot.position} positions")
                    if t.dtype != self.config.dtype or t.device != self.device:
                        raise TypeError(f"KV {name} must be {self.config.dtype} on {self.device}, got {t.dtype} on "
                                        f"{t.device}")
                layers.append(KVCache.from_rows(k, v))
        return ModelState(snapshot.position, layers)

    def _check_state(self, state) -> None:
        """Refuse, before a layer advances, a state that is not one of this model's layers' states
        all at ``state.position`` (a pass updates it layer by layer, in place)."""
        if not isinstance(state, ModelState):
            raise TypeError(f"state must be a ModelState (new_state() or restore()), got {type(state).__name__}")
        check_int("state.position", state.position, 0)
        if not isinstance(state.layers, list) or len(state.layers) != len(self.blocks):
            got = len(state.layers) if isinstance(state.layers, list) else type(state.layers).__name__
            raise ValueError(f"state.layers must be a list of one state per layer ({len(self.blocks)}), got {got}")
        dtype = self.config.dtype
        for i, (block, layer) in enumerate(zip(self.blocks, state.layers)):
            if block.kind == "mamba2":
                try:
                    block.mixer._check_state(layer, 1, dtype, self.device)
                except (TypeError, ValueError) as error:
                    raise type(error)(f"state.layers[{i}] (a Mamba layer): {error}") from None
                at = layer.positions[0]
            else:
                want = (block.mixer.num_heads, block.mixer.head_dim)
                if not isinstance(layer, KVCache):
                    raise TypeError(f"state.layers[{i}] must be a KVCache (an attention layer), got "
                                    f"{type(layer).__name__}")
                if tuple(layer.k.shape[1:]) != want or layer.k.dtype != dtype or layer.k.device != self.device:
                    raise ValueError(f"state.layers[{i}] holds keys of (heads, head_dim) {tuple(layer.k.shape[1:])}, "
                                     f"{layer.k.dtype} on {layer.k.device}; the layer needs {want}, {dtype} on "
                                     f"{self.device}")
                at = layer.length
            if at != state.position:
                raise ValueError(f"state.layers[{i}] is at position {at}, the state at {state.position}: a state's "
                                 "layers advance together")

    def kv_rows(self, state: ModelState) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The attention layers' keys and values of positions [0, state.position)."""
        return [layer.rows() for layer in state.layers if isinstance(layer, KVCache)]

    # -- passes -----------------------------------------------------------------------------
    @torch.no_grad()
    def forward_pass(self, tokens, state: ModelState, capture: Sequence[int] = (),
                     logits: str = "all") -> PassOutput:
        """Consume ``tokens`` (T,) after ``state`` (advanced in place) and capture the Mamba states
        at the pass ``capture`` offsets (0..T; absolute position state.position + offset)."""
        if logits not in LOGITS:
            raise ValueError(f"logits must be one of {LOGITS}, got {logits!r}")
        self.check_ready()
        ids = torch.tensor(check_tokens(tokens, self.config.vocab_size), dtype=torch.long, device=self.device)
        self._check_state(state)
        capture = [(0, k) for k in _check_offsets(capture, ids.numel())]
        h = self.embed(ids)  # (T, hidden)
        captured = []
        for i, block in enumerate(self.blocks):
            x = block.norm1(h)
            if block.kind == "mamba2":
                result = block.mixer(x.unsqueeze(0), state.layers[i], capture=capture)
                state.layers[i] = result.state
                captured.append(result.snapshots)
                x = result.out[0]
            else:
                x = block.mixer(x, state.layers[i])
            h = h + x
            h = h + block.mlp(block.norm2(h))
        state.position += ids.numel()
        out = None
        if logits == "last":
            h = h[-1:]
        if logits != "none":
            out = exact_linear(self.lm_head, self.norm(h))
        snapshots = [ModelSnapshot(state.position - ids.numel() + k, tuple(layer[j] for layer in captured))
                     for j, (_, k) in enumerate(capture)]
        return PassOutput(out, state, snapshots)

    def prefill(self, tokens, logits: str = "all") -> torch.Tensor:
        """A cold prefill of ``tokens`` in one pass: the reference a served request must equal."""
        return self.forward_pass(tokens, self.new_state(), logits=logits).logits
