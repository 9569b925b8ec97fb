"""Mamba-2 mixer with the parameters of Hugging Face transformers' Mamba2Mixer."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .._common import check_choice, check_dt_limit
from ..conv import causal_conv1d, causal_conv1d_update
from ..scan import mamba2_chunked, mamba2_scan, selective_state_update
from .common import SSMMixer, check_mixer_args, dt_bias_init


class GatedRMSNorm(nn.Module):
    """transformers' MambaRMSNormGated: gate first, then RMS-normalise per group of
    ``group_size`` channels: ``weight * norm(x * silu(gate))``, computed in float32.

    Takes one token's row (hidden,) or any (..., hidden); each row is normalised alone.
    """

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-6, *, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.group_size = group_size

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        if gate is not None:
            h = h * F.silu(gate.to(torch.float32))
        groups = h.unflatten(-1, (-1, self.group_size))
        variance = groups.pow(2).mean(-1, keepdim=True)
        h = (groups * torch.rsqrt(variance + self.variance_epsilon)).flatten(-2)
        return self.weight * h.to(input_dtype)


class Mamba2Mixer(SSMMixer):
    """A Mamba-2 mixer whose state_dict is transformers' Mamba2Mixer's (in_proj, conv1d, dt_bias,
    A_log, D, norm, out_proj), computed with mamba2_scan and causal_conv1d.

    in_proj gives [gate z (intermediate), xBC (conv_dim), dt (num_heads)]; xBC goes through the
    depthwise causal conv and silu and splits into x (intermediate), B and C (n_groups *
    state_size each); the scan runs with dt_softplus, dt_limit = time_step_limit and D; the
    output is gated-RMS-normalised with z (gate before norm, group size intermediate // n_groups)
    and projected by out_proj. intermediate = num_heads * head_dim,
    conv_dim = intermediate + 2 * n_groups * state_size.

    ``exact=True`` runs the projections and the norm as batch-invariant row ops (layers.rows), so
    outputs, states and snapshots are bit-identical however a sequence is split into passes;
    ``exact=False`` (default) runs them as plain batched ops (faster; splits agree to rounding).
    ``backend`` goes to the kernels ("auto": Triton on CUDA, PyTorch on CPU); ``algorithm`` and
    ``chunk_size`` to mamba2_scan, with the layer's states' positions as the chunked grid's
    absolute start. The layer's default is "recurrent" (mamba2_scan's is "auto", which picks per
    pass): warm == cold at any split. "chunked" is faster for long GPU prefills; what it and
    "auto" are exact at: README.md, section "Semantics and exactness".
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, state_size: int = 128,
                 n_groups: int = 1, conv_kernel: int = 4, *, use_bias: bool = False,
                 use_conv_bias: bool = True, layer_norm_epsilon: float = 1e-5,
                 time_step_limit: tuple[float, float] = (0.0, math.inf),
                 time_step_min: float = 0.001, time_step_max: float = 0.1, time_step_floor: float = 1e-4,
                 hidden_act: str = "silu", exact: bool = False, backend: str = "auto",
                 algorithm: str = "recurrent", chunk_size: int | None = None, device=None, dtype=None):
        super().__init__()
        hidden_size, num_heads, head_dim, state_size, n_groups, conv_kernel = check_mixer_args(
            dict(hidden_size=hidden_size, num_heads=num_heads, head_dim=head_dim, state_size=state_size,
                 n_groups=n_groups, conv_kernel=conv_kernel),
            dict(use_bias=use_bias, use_conv_bias=use_conv_bias, exact=exact),
            dict(layer_norm_epsilon=layer_norm_epsilon, time_step_min=time_step_min, time_step_max=time_step_max,
                 time_step_floor=time_step_floor),
            hidden_act=hidden_act, backend=backend, dtype=dtype, groups=("num_heads", "n_groups")).values()
        time_step_limit = check_dt_limit(time_step_limit)
        check_choice("algorithm", algorithm, mamba2_chunked.ALGORITHMS)
        if chunk_size is not None:
            mamba2_chunked.check_chunk_size(chunk_size)
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.ssm_state_size = state_size
        self.n_groups = n_groups
        self.conv_kernel = conv_kernel
        self.intermediate_size = num_heads * head_dim
        self.conv_dim = self.intermediate_size + 2 * n_groups * state_size
        self.time_step_limit = time_step_limit
        self.activation = hidden_act
        self.exact = exact
        self.backend = backend
        self.algorithm = algorithm
        self.chunk_size = chunk_size
        factory = dict(device=device, dtype=dtype)

        self.in_proj = nn.Linear(hidden_size, self.intermediate_size + self.conv_dim + num_heads,
                                 bias=use_bias, **factory)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim,
                                padding=conv_kernel - 1, bias=use_conv_bias, **factory)
        self.dt_bias = nn.Parameter(torch.empty(num_heads, **factory))
        self.A_log = nn.Parameter(torch.empty(num_heads, **factory))
        self.D = nn.Parameter(torch.empty(num_heads, **factory))
        self.norm = GatedRMSNorm(self.intermediate_size, self.intermediate_size // n_groups,
                                 eps=layer_norm_epsilon, **factory)
        self.out_proj = nn.Linear(self.intermediate_size, hidden_size, bias=use_bias, **factory)
        self._init_ssm_parameters(time_step_min, time_step_max, time_step_floor)

    @torch.no_grad()
    def _init_ssm_parameters(self, dt_min, dt_max, dt_floor):
        """transformers' initialisation: A = 1..num_heads, D = 1, dt_bias = softplus^-1 of a
        log-uniform dt in [dt_min, dt_max]."""
        self.A_log.copy_(torch.log(torch.arange(1, self.num_heads + 1, dtype=torch.float32)))
        self.D.fill_(1.0)
        self.dt_bias.copy_(dt_bias_init(self.num_heads, dt_min, dt_max, dt_floor))

    @classmethod
    def from_config(cls, config, **kwargs) -> "Mamba2Mixer":
        """Build from a transformers Mamba2Config (or anything with its attribute names)."""
        intermediate = int(config.expand * config.hidden_size)
        if intermediate != config.num_heads * config.head_dim:
            raise ValueError(f"config's intermediate size expand * hidden_size = {intermediate} must equal "
                             f"num_heads * head_dim = {config.num_heads * config.head_dim}")
        return cls(config.hidden_size, config.num_heads, config.head_dim, config.state_size, config.n_groups,
                   config.conv_kernel, use_bias=config.use_bias, use_conv_bias=config.use_conv_bias,
                   layer_norm_epsilon=config.layer_norm_epsilon, time_step_limit=config.time_step_limit,
                   hidden_act=config.hidden_act, **kwargs)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.ssm_state_size)

    def _split_xbc(self, xBC):
        ng_ds = self.n_groups * self.ssm_state_size
        x, B, C = xBC.split([self.intermediate_size, ng_ds, ng_ds], dim=-1)
        return (x.unflatten(-1, (self.num_heads, self.head_dim)),
                B.unflatten(-1, (self.n_groups, self.ssm_state_size)),
                C.unflatten(-1, (self.n_groups, self.ssm_state_size)))

    def _scan_options(self):
        return dict(D=self.D, dt_bias=self.dt_bias, dt_softplus=True, dt_limit=self.time_step_limit,
                    backend=self.backend)

    def _finish(self, y, gate, dtype):
        """Gated norm and out_proj: y, gate (..., intermediate)."""
        y = self._rowwise(self.norm, y, gate)
        return self._linear(self.out_proj, y.to(dtype))

    def _mix(self, hidden_states, state, cu_seqlens, capture):
        proj = self._linear(self.in_proj, hidden_states)  # (batch, seqlen, projection)
        gate, xBC, dt = proj.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        conv = causal_conv1d(xBC.transpose(1, 2), self.conv1d.weight[:, 0], self.conv1d.bias,
                             activation=self.activation, initial_states=state.conv, cu_seqlens=cu_seqlens,
                             capture=capture, backend=self.backend)
        # Token-major and contiguous: a token's rows have the same strides in every pass.
        x, B, C = self._split_xbc(conv.out.transpose(1, 2).contiguous())
        A = -torch.exp(self.A_log.float())
        scan = mamba2_scan(x, dt, A, B, C, initial_states=state.ssm, cu_seqlens=cu_seqlens,
                           capture=capture, algorithm=self.algorithm, chunk_size=self.chunk_size,
                           start_positions=state.positions,  # the chunked scan's grid is absolute
                           **self._scan_options())
        out = self._finish(scan.y.flatten(-2), gate, hidden_states.dtype)
        return out, conv, scan

    def _step(self, hidden_states, state):
        proj = self._linear(self.in_proj, hidden_states)  # (nseq, projection)
        gate, xBC, dt = proj.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        # step() validated the state and the ops' other inputs are this layer's own: no second check.
        xBC = causal_conv1d_update(xBC, state.conv, self.conv1d.weight[:, 0], self.conv1d.bias,
                                   activation=self.activation, validate=False, backend=self.backend)
        x, B, C = self._split_xbc(xBC)
        A = -torch.exp(self.A_log.float())
        y = selective_state_update(state.ssm, x, dt, A, B, C, validate=False, **self._scan_options())
        return self._finish(y.flatten(-2), gate, hidden_states.dtype)
