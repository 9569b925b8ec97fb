"""The layer shapes the benchmarks run, their inputs, and the bytes a pass must move.

Roofline. A scan pass cannot be faster than moving the bytes it must read and write once, at the
device's copy bandwidth (measured by the benchmark itself, bytes read + written per second):

    roofline_ms = pass_bytes / copy_bandwidth,   fraction = roofline_ms / measured_ms.

pass_bytes counts every tensor the op must touch once and nothing else (no intermediates):

  Mamba-2 (T tokens over all sequences, H heads, P headdim, G groups, N dstate, e bytes per
  input element, S sequences, K captures):
      read  x: T*H*P*e, dt: T*H*e, B: T*G*N*e, C: T*G*N*e, z (if given): T*H*P*e,
            A: 4H, D: 4H (per head), dt_bias: 4H,
            initial states (if given): S*H*P*N*4
      write y: T*H*P*e, final states: S*H*P*N*4, captured states: K*H*P*N*4
  Mamba-1 (channels Dm, G groups of B and C; the selective_scan_fn layout):
      read  u: T*Dm*e, delta: T*Dm*e, B: T*G*N*e, C: T*G*N*e, z (if given): T*Dm*e,
            A: Dm*N*4, D: 4Dm, delta_bias: 4Dm, initial states (if given): S*Dm*N*4
      write y: T*Dm*e, final states: S*Dm*N*4, captured states: K*Dm*N*4
  Decode step (Mamba-2, batch b, state float32, updated in place):
      read  state: b*H*P*N*4, x: b*H*P*e, dt: b*H*e, B, C: b*G*N*e each, z (if given): b*H*P*e,
            A, D, dt_bias: 4H each
      write state: b*H*P*N*4, y: b*H*P*e

Peers solve the same problem, so they are held to the same bytes (a peer that moves more, e.g.
heads-expanded B and C, shows it as a lower fraction).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from ssm_kernels.layers.common import dt_bias_init

F32 = 4


@dataclass(frozen=True)
class Mamba2Shape:
    """One Mamba-2 layer's scan dimensions."""

    name: str
    nheads: int
    headdim: int
    dstate: int
    ngroups: int
    kind: str = "mamba2"

    def describe(self) -> str:
        return f"nheads {self.nheads}, headdim {self.headdim}, dstate {self.dstate}, ngroups {self.ngroups}"


@dataclass(frozen=True)
class Mamba1Shape:
    """One Mamba-1 layer's scan dimensions (selective_scan_fn layout, B and C shared: ngroups 1)."""

    name: str
    dim: int
    dstate: int
    ngroups: int = 1
    kind: str = "mamba1"

    def describe(self) -> str:
        return f"dim {self.dim}, dstate {self.dstate}"


# The standard shapes (GPU). Layer dimensions from the models' published configs.
STANDARD_SHAPES = (
    Mamba2Shape("Mamba-2 2.7B", nheads=80, headdim=64, dstate=128, ngroups=1),
    Mamba2Shape("Granite-4.0-H", nheads=128, headdim=64, dstate=128, ngroups=1),
    Mamba2Shape("Nemotron-H 8B", nheads=128, headdim=64, dstate=128, ngroups=8),
    Mamba1Shape("Mamba-1 2.8B", dim=5120, dstate=16),
)
STANDARD_SEQLENS = (2048, 8192, 32768)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# The reduced shapes (CPU, CI): the same four layers shrunk so that the PyTorch path and the
# Triton interpreter finish in seconds. Numbers from them say nothing about GPU speed.
REDUCED_SHAPES = (
    Mamba2Shape("Mamba-2 2.7B (reduced)", nheads=2, headdim=8, dstate=16, ngroups=1),
    Mamba2Shape("Granite-4.0-H (reduced)", nheads=4, headdim=8, dstate=16, ngroups=1),
    Mamba2Shape("Nemotron-H 8B (reduced)", nheads=4, headdim=8, dstate=16, ngroups=2),
    Mamba1Shape("Mamba-1 2.8B (reduced)", dim=16, dstate=16),
)
REDUCED_SEQLENS = (32, 64, 128)
REDUCED_DECODE_BATCHES = (1, 2, 4, 8)

VARLEN_SEQUENCES = 16


def varlen_lengths(total: int, count: int = VARLEN_SEQUENCES, seed: int = 0) -> list[int]:
    """`count` mixed sequence lengths (each >= 1) that sum to `total`, fixed by `seed`.

    Weights are drawn as u**2 for u uniform in [0.05, 1), so the batch mixes a few long
    sequences with many short ones, as a prefill batch of a serving engine does.
    """
    if total < count:
        raise ValueError(f"a varlen batch of {count} sequences needs at least {count} tokens, got {total}")
    rng = random.Random(seed)
    weights = [rng.uniform(0.05, 1.0) ** 2 for _ in range(count)]
    scale = (total - count) / sum(weights)
    lengths = [1 + int(w * scale) for w in weights]
    for i in range(total - sum(lengths)):  # hand out the rounding remainder
        lengths[i % count] += 1
    return lengths


def cu_seqlens_of(lengths: list[int], device) -> torch.Tensor:
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def mamba2_inputs(shape: Mamba2Shape, ntokens: int, device, dtype=torch.bfloat16, seed: int = 0) -> dict:
    """Inputs of one Mamba-2 pass over `ntokens` tokens (batch row 0; varlen via cu_seqlens).

    As mamba_ssm's Mamba2 module calls the scan: D per head, dt_bias, dt_softplus=True, no z
    (the gate goes to the gated RMSNorm after the scan).
    """
    g = torch.Generator().manual_seed(seed)
    H, P, N, G = shape.nheads, shape.headdim, shape.dstate, shape.ngroups

    def randn(*size):
        return torch.randn(*size, generator=g).to(device=device, dtype=dtype)

    return dict(
        x=randn(1, ntokens, H, P), dt=randn(1, ntokens, H) * 0.5,
        A=-torch.exp(torch.rand(H, generator=g) * math.log(16.0)).to(device),
        B=randn(1, ntokens, G, N), C=randn(1, ntokens, G, N),
        D=torch.ones(H, device=device), dt_bias=dt_bias_init(H, generator=g).to(device),
    )


def mamba1_inputs(shape: Mamba1Shape, ntokens: int, device, dtype=torch.bfloat16, seed: int = 0) -> dict:
    """Inputs of one Mamba-1 pass (selective_scan_fn layout), as mamba_ssm's Mamba module calls
    it: z, D, delta_bias, delta_softplus=True; A is the S4D-real initialisation."""
    g = torch.Generator().manual_seed(seed)
    Dm, N = shape.dim, shape.dstate

    def randn(*size):
        return torch.randn(*size, generator=g).to(device=device, dtype=dtype)

    return dict(
        u=randn(1, Dm, ntokens), delta=randn(1, Dm, ntokens) * 0.5,
        A=-torch.arange(1, N + 1, dtype=torch.float32).repeat(Dm, 1).to(device),
        B=randn(1, N, ntokens), C=randn(1, N, ntokens), z=randn(1, Dm, ntokens),
        D=torch.ones(Dm, device=device), delta_bias=dt_bias_init(Dm, generator=g).to(device),
    )


def decode_inputs(shape: Mamba2Shape, batch: int, device, dtype=torch.bfloat16, seed: int = 0) -> dict:
    """One decode token per batch row, and a float32 state pool of `batch` slots."""
    g = torch.Generator().manual_seed(seed)
    H, P, N, G = shape.nheads, shape.headdim, shape.dstate, shape.ngroups

    def randn(*size):
        return torch.randn(*size, generator=g).to(device=device, dtype=dtype)

    return dict(
        state=torch.randn(batch, H, P, N, generator=g).to(device) * 0.1,
        x=randn(batch, H, P), dt=randn(batch, H) * 0.5,
        A=-torch.exp(torch.rand(H, generator=g) * math.log(16.0)).to(device),
        B=randn(batch, G, N), C=randn(batch, G, N),
        D=torch.ones(H, device=device), dt_bias=dt_bias_init(H, generator=g).to(device),
    )


def pass_bytes(shape, ntokens: int, nseq: int, elt: int, *, ncapture: int = 0,
               initial_states: bool = False, has_z: bool | None = None) -> int:
    """Bytes one scan pass must move (module docstring). has_z defaults to how the shape's
    module calls the scan (Mamba-2: no z; Mamba-1: z)."""
    if shape.kind == "mamba2":
        H, P, N, G = shape.nheads, shape.headdim, shape.dstate, shape.ngroups
        z = False if has_z is None else has_z
        per_token = (2 + z) * H * P * elt + H * elt + 2 * G * N * elt  # x, y, (z), dt, B, C
        params = 3 * H * F32  # A, D, dt_bias
        state = H * P * N * F32
    else:
        Dm, N, G = shape.dim, shape.dstate, shape.ngroups
        z = True if has_z is None else has_z
        per_token = (3 + z) * Dm * elt + 2 * G * N * elt  # u, delta, y, (z), B, C
        params = Dm * N * F32 + 2 * Dm * F32  # A, D, delta_bias
        state = Dm * N * F32
    states = (nseq * (1 + initial_states) + ncapture) * state
    return ntokens * per_token + params + states


def decode_bytes(shape: Mamba2Shape, batch: int, elt: int, *, has_z: bool = False) -> int:
    """Bytes one decode step must move (module docstring)."""
    H, P, N, G = shape.nheads, shape.headdim, shape.dstate, shape.ngroups
    per_row = 2 * H * P * N * F32 + (2 + has_z) * H * P * elt + H * elt + 2 * G * N * elt
    return batch * per_row + 3 * H * F32
