"""Mamba-1 mixer with the parameters of Hugging Face transformers' MambaMixer."""
from __future__ import annotations

import math

import torch
from torch import nn

from ..conv import causal_conv1d, causal_conv1d_update
from ..scan import mamba1_scan
from ..scan.mamba1 import mamba1_step_unchecked
from .common import SSMMixer, check_mixer_args, dt_bias_init


class Mamba1Mixer(SSMMixer):
    """A Mamba-1 mixer whose state_dict is transformers' MambaMixer's (in_proj, conv1d, x_proj,
    dt_proj, A_log, D, out_proj), computed with mamba1_scan and causal_conv1d.

    in_proj gives [x, gate z] (intermediate each); x goes through the causal conv and silu;
    x_proj gives [dt (time_step_rank), B, C (state_size each)]; dt_proj.weight maps dt to
    intermediate channels and dt_proj.bias is the scan's delta_bias (softplus on); the scan
    output, gated by silu(z) in the scan, is projected by out_proj. ``exact`` and ``backend`` as
    in Mamba2Mixer. A decode step runs the recurrent scan's one-token pass on the state in place
    (scan.mamba1.mamba1_step_unchecked, after step()'s checks: Mamba-1's per-channel A has no
    selective_state_update layout).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, state_size: int = 16, conv_kernel: int = 4,
                 time_step_rank: int | None = None, *, use_bias: bool = False, use_conv_bias: bool = True,
                 time_step_min: float = 0.001, time_step_max: float = 0.1, time_step_floor: float = 1e-4,
                 hidden_act: str = "silu", exact: bool = False, backend: str = "auto", device=None, dtype=None):
        super().__init__()
        sizes = dict(hidden_size=hidden_size, intermediate_size=intermediate_size, state_size=state_size,
                     conv_kernel=conv_kernel)
        if time_step_rank is not None:
            sizes["time_step_rank"] = time_step_rank
        sizes = check_mixer_args(sizes, dict(use_bias=use_bias, use_conv_bias=use_conv_bias, exact=exact),
                                 dict(time_step_min=time_step_min, time_step_max=time_step_max,
                                      time_step_floor=time_step_floor),
                                 hidden_act=hidden_act, backend=backend, dtype=dtype)
        hidden_size, intermediate_size, state_size, conv_kernel = (
            sizes[k] for k in ("hidden_size", "intermediate_size", "state_size", "conv_kernel"))
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.ssm_state_size = state_size
        self.conv_kernel = conv_kernel
        self.conv_dim = intermediate_size
        self.time_step_rank = sizes.get("time_step_rank", math.ceil(hidden_size / 16))
        self.activation = hidden_act
        self.exact = exact
        self.backend = backend
        factory = dict(device=device, dtype=dtype)

        self.conv1d = nn.Conv1d(intermediate_size, intermediate_size, conv_kernel, groups=intermediate_size,
                                padding=conv_kernel - 1, bias=use_conv_bias, **factory)
        self.in_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=use_bias, **factory)
        self.x_proj = nn.Linear(intermediate_size, self.time_step_rank + 2 * state_size, bias=False, **factory)
        self.dt_proj = nn.Linear(self.time_step_rank, intermediate_size, bias=True, **factory)
        self.A_log = nn.Parameter(torch.empty(intermediate_size, state_size, **factory))
        self.D = nn.Parameter(torch.empty(intermediate_size, **factory))
        self.out_proj = nn.Linear(intermediate_size, hidden_size, bias=use_bias, **factory)
        self._init_ssm_parameters(time_step_min, time_step_max, time_step_floor)

    @torch.no_grad()
    def _init_ssm_parameters(self, dt_min, dt_max, dt_floor):
        """transformers' initialisation: A[:, n] = n + 1, D = 1, dt_proj.bias = softplus^-1 of a
        log-uniform dt in [dt_min, dt_max]."""
        A = torch.arange(1, self.ssm_state_size + 1, dtype=torch.float32).expand(self.intermediate_size, -1)
        self.A_log.copy_(torch.log(A))
        self.D.fill_(1.0)
        self.dt_proj.bias.copy_(dt_bias_init(self.intermediate_size, dt_min, dt_max, dt_floor))

    @classmethod
    def from_config(cls, config, **kwargs) -> "Mamba1Mixer":
        """Build from a transformers MambaConfig (or anything with its attribute names)."""
        return cls(config.hidden_size, config.intermediate_size, config.state_size, config.conv_kernel,
                   config.time_step_rank, use_bias=config.use_bias, use_conv_bias=config.use_conv_bias,
                   hidden_act=config.hidden_act, **kwargs)

    @property
    def ssm_state_shape(self) -> tuple[int, int]:
        return (self.intermediate_size, self.ssm_state_size)

    def _ssm_inputs(self, u):
        """(..., intermediate) conv outputs -> dt (..., intermediate), B, C (..., state_size)."""
        dt, B, C = self._linear(self.x_proj, u).split(
            [self.time_step_rank, self.ssm_state_size, self.ssm_state_size], dim=-1)
        dt = self._linear(self.dt_proj, dt, bias=False)  # its bias is the scan's delta_bias
        return dt, B, C

    def _scan_args(self, u, dt, B, C, gate):
        """mamba1_scan's arguments (positional, keyword) from token-major (batch, seqlen, channels)
        tensors."""
        t = lambda v: v.transpose(1, 2)
        return ((t(u), t(dt), -torch.exp(self.A_log.float()), t(B), t(C)),
                dict(D=self.D.float(), z=t(gate), delta_bias=self.dt_proj.bias.float(), delta_softplus=True,
                     backend=self.backend))

    def _scan(self, u, dt, B, C, gate, initial_states, cu_seqlens=None, capture=None):
        """mamba1_scan on token-major tensors. Recurrent: the layer's passes continue each other
        bit for bit at any split ("auto" picks per pass)."""
        args, kwargs = self._scan_args(u, dt, B, C, gate)
        return mamba1_scan(*args, **kwargs, initial_states=initial_states, cu_seqlens=cu_seqlens, capture=capture,
                           algorithm="recurrent")

    def _mix(self, hidden_states, state, cu_seqlens, capture):
        x, gate = self._linear(self.in_proj, hidden_states).chunk(2, dim=-1)
        conv = causal_conv1d(x.transpose(1, 2), self.conv1d.weight[:, 0], self.conv1d.bias,
                             activation=self.activation, initial_states=state.conv, cu_seqlens=cu_seqlens,
                             capture=capture, backend=self.backend)
        u = conv.out.transpose(1, 2).contiguous()  # token-major: the same strides in every pass
        dt, B, C = self._ssm_inputs(u)
        scan = self._scan(u, dt, B, C, gate, state.ssm, cu_seqlens, capture)
        out = self._linear(self.out_proj, scan.y.transpose(1, 2).to(hidden_states.dtype))
        return out, conv, scan

    def _step(self, hidden_states, state):
        x, gate = self._linear(self.in_proj, hidden_states).chunk(2, dim=-1)
        u = causal_conv1d_update(x, state.conv, self.conv1d.weight[:, 0], self.conv1d.bias,
                                 activation=self.activation, validate=False, backend=self.backend)  # step() checked
        one = lambda v: v.unsqueeze(1)  # a one-token pass per sequence
        dt, B, C = self._ssm_inputs(one(u))
        args, kwargs = self._scan_args(one(u), dt, B, C, one(gate))
        y = mamba1_step_unchecked(state.ssm, *args, **kwargs)  # in place, as the recurrent scan's pass
        return self._linear(self.out_proj, y[:, :, 0].to(hidden_states.dtype))
