"""A small hybrid language model: Mamba-2 and attention layers interleaved, each followed by an
MLP, with pre-norm residuals, seeded random weights, and per-pass state capture.

Every op runs so that a token's result never depends on the pass it is in (everything but the
scan one token at a time; see layers.common and model.blocks). With the recurrent scan (the
default) a prefill split into any passes, resumed from any captured snapshot, therefore gives
bit-identical logits to one cold pass. With the chunked scan (``scan_algorithm="chunked"``) that
holds for passes that start at multiples of ``chunk_size`` (``scan_grid``), which is what the
planner's grid option plans.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch
from torch import nn

from ssm_kernels.layers import Mamba2Mixer, Snapshot, per_token
from ssm_kernels.scan.chunked import check_chunk_size

from .blocks import MLP, Attention, KVCache, RMSNorm

LOGITS = ("all", "last", "none")


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
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "mamba_heads",
                     "mamba_head_dim", "state_size", "n_groups", "conv_kernel", "mlp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.attention_every, bool) or not isinstance(self.attention_every, int) \
                or self.attention_every < 0:
            raise ValueError(f"attention_every must be an int >= 0, got {self.attention_every!r}")
        if self.scan_algorithm not in ("recurrent", "chunked"):
            raise ValueError(f"scan_algorithm must be 'recurrent' or 'chunked', got {self.scan_algorithm!r}")
        check_chunk_size(self.chunk_size)

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
                                     layer_norm_epsilon=config.eps, backend=backend, dtype=config.dtype,
                                     algorithm=config.scan_algorithm, chunk_size=config.chunk_size)
        self.norm2 = RMSNorm(config.hidden_size, config.eps, dtype=config.dtype)
        self.mlp = MLP(config.hidden_size, config.mlp_size, dtype=config.dtype)


class HybridLM(nn.Module):
    """Embeddings, interleaved Mamba-2/attention blocks (each with an MLP), a final RMSNorm and an
    LM head, with seeded random weights. Serves one sequence per pass.

    backend: the kernels' backend ("auto": Triton on CUDA, PyTorch on CPU).
    """

    def __init__(self, config: HybridConfig = HybridConfig(), *, backend: str = "auto", device=None):
        super().__init__()
        self.config = config
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
        mamba, attention = iter(snapshot.layers), iter(kv)
        if len(snapshot.layers) != len(self.mamba_layers) or len(kv) != len(self.attention_layers):
            raise ValueError(f"a snapshot of {len(snapshot.layers)} Mamba layers and KV of {len(kv)} attention "
                             f"layers does not fit a model of {len(self.mamba_layers)} and "
                             f"{len(self.attention_layers)}")
        layers = []
        for block in self.blocks:
            if block.kind == "mamba2":
                layers.append(block.mixer.restore(next(mamba)))
            else:
                k, v = next(attention)
                if k.shape[0] != snapshot.position:
                    raise ValueError(f"KV rows ({k.shape[0]}) must cover the snapshot's {snapshot.position} positions")
                layers.append(KVCache.from_rows(k, v))
        return ModelState(snapshot.position, layers)

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
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(-1)
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        capture = [(0, int(k)) for k in capture]
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
            out = per_token(self.lm_head, self.norm(h))
        snapshots = [ModelSnapshot(state.position - ids.numel() + k, tuple(layer[j] for layer in captured))
                     for j, (_, k) in enumerate(capture)]
        return PassOutput(out, state, snapshots)

    def prefill(self, tokens, logits: str = "all") -> torch.Tensor:
        """A cold prefill of ``tokens`` in one pass: the reference a served request must equal."""
        return self.forward_pass(tokens, self.new_state(), logits=logits).logits
