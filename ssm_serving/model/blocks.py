"""The non-SSM parts of the hybrid model: RMSNorm, a SwiGLU MLP, and causal self-attention over a
KV cache. Projections and norms run as batch-invariant row ops (ssm_kernels.layers.rows), so a
token's result never depends on how many tokens share its pass.

Attention is split-invariant by construction: query t attends to the cached keys [0, t] with
operations whose shapes depend on t alone (one query row over a contiguous key prefix), never on
how many tokens share its pass.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ssm_kernels.layers import exact_linear, exact_rowwise


class RMSNorm(nn.Module):
    """weight * x / sqrt(mean(x^2) + eps), in float32, each row alone."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def _row(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exact_rowwise(self._row, x)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype=None):
        super().__init__()
        self.gate_up = nn.Linear(hidden_size, 2 * intermediate_size, bias=False, dtype=dtype)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = exact_linear(self.gate_up, x).chunk(2, dim=-1)
        return exact_linear(self.down, exact_rowwise(lambda g, u: F.silu(g) * u, gate, up))


class KVCache:
    """One sequence's keys and values for one attention layer: rows [0, length) of growable
    (capacity, heads, head_dim) buffers. A prefix of rows is always one contiguous block at the
    buffer's start, so query t sees its keys with the same layout whatever the capacity."""

    def __init__(self, num_heads: int, head_dim: int, *, dtype, device, capacity: int = 64):
        self.k = torch.zeros(capacity, num_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    @classmethod
    def from_rows(cls, k: torch.Tensor, v: torch.Tensor) -> "KVCache":
        cache = cls(k.shape[1], k.shape[2], dtype=k.dtype, device=k.device, capacity=max(64, k.shape[0]))
        cache.append(k, v)
        return cache

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add rows k, v (n, heads, head_dim)."""
        need = self.length + k.shape[0]
        if need > self.k.shape[0]:
            capacity = max(need, 2 * self.k.shape[0])
            for name in ("k", "v"):
                old = getattr(self, name)
                grown = old.new_zeros(capacity, *old.shape[1:])
                grown[:self.length] = old[:self.length]
                setattr(self, name, grown)
        self.k[self.length:need] = k
        self.v[self.length:need] = v
        self.length = need

    def rows(self, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, end) (default: all), views."""
        end = self.length if end is None else end
        return self.k[:end], self.v[:end]


class Attention(nn.Module):
    """Causal multi-head self-attention without positional encoding (the SSM layers carry
    position, as in Jamba), with a KV cache; one query row at a time."""

    def __init__(self, hidden_size: int, num_heads: int, *, dtype=None):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of num_attention_heads ({num_heads})")
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False, dtype=dtype)

    def new_cache(self, *, dtype, device) -> KVCache:
        return KVCache(self.num_heads, self.head_dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """x (T, hidden): the tokens following the cache's rows; appends their keys and values."""
        qkv = exact_linear(self.qkv, x).unflatten(-1, (3, self.num_heads, self.head_dim))
        start = cache.length
        cache.append(qkv[:, 1], qkv[:, 2])
        scale = 1.0 / math.sqrt(self.head_dim)
        rows = []
        for i in range(x.shape[0]):
            k, v = cache.rows(start + i + 1)  # (n, heads, head_dim), contiguous prefix
            q = qkv[i, 0].clone() * scale  # (heads, head_dim)
            scores = torch.einsum("hd,nhd->hn", q, k)
            probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
            rows.append(torch.einsum("hn,nhd->hd", probs, v).flatten())
        out = torch.stack(rows) if rows else x.new_zeros(0, x.shape[-1])
        return exact_linear(self.o_proj, out)
