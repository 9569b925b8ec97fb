"""The plugin's settings: environment variables, read and checked once at start-up.

- `SSM_KERNELS_VLLM`: the plugin on (`1`, the default; also true/yes/on) or off (`0`; false/no/off).
- `SSM_KERNELS_VLLM_CAPTURE_INTERVAL`: tokens between captured states, `0` (vLLM's own policy:
  the prompt's tail and the junction only) or a positive multiple of the Mamba block size
  (default: the block size, every block end).
- `SSM_KERNELS_VLLM_PREFILL_ALGORITHM`: `auto` (default), `chunked` or `recurrent`.
- `SSM_KERNELS_FUSED_SSD`: the kernels' own (`0`, the default, or `1`: the fused chunked pass),
  checked here too, so that a bad value stops the engine's start rather than a step.

A bad value is a ValueError naming the variable, raised while vLLM starts its engine: from the
plugin's entry point, which vLLM calls before it builds one, or, for what needs the block size,
from the Mamba layers' kv-cache spec at each worker's start. Steps only read the values stored
here (`current`), so they never raise over a setting.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ssm_kernels.scan.algorithm import ALGORITHMS
from ssm_kernels.scan.mamba2_chunked.triton_kernel import fused_pass_setting

ENABLE = "SSM_KERNELS_VLLM"
INTERVAL = "SSM_KERNELS_VLLM_CAPTURE_INTERVAL"
ALGORITHM = "SSM_KERNELS_VLLM_PREFILL_ALGORITHM"
_SWITCH = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


@dataclass(frozen=True)
class Settings:
    enabled: bool = True
    capture_interval: int | None = None  # None: the block size
    prefill_algorithm: str = "auto"

    def interval(self, block_size: int) -> int:
        """Tokens between captured states with blocks of `block_size` tokens (0: none)."""
        return block_size if self.capture_interval is None else self.capture_interval


def read(environ=None) -> Settings:
    """The settings `environ` (default os.environ) holds; ValueError for a bad one. With the
    plugin off the others are not read."""
    env = os.environ if environ is None else environ
    get = lambda name: env.get(name, "").strip()
    switch = get(ENABLE).lower() or "1"
    if switch not in _SWITCH:
        raise ValueError(f"{ENABLE} must be one of {sorted(_SWITCH)}, got {env[ENABLE]!r}")
    if not _SWITCH[switch]:
        return Settings(enabled=False)
    interval = get(INTERVAL) or None
    if interval is not None:
        if not (interval.isascii() and interval.removeprefix("-").isdigit()):  # int() also takes "+1_28", "١٢٨"
            raise ValueError(f"{INTERVAL} must be an integer number of tokens, got {env[INTERVAL]!r}")
        interval = int(interval)
        if interval < 0:
            raise ValueError(f"{INTERVAL} must be 0 or a positive multiple of the block size, got {interval}")
    algorithm = get(ALGORITHM) or "auto"
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{ALGORITHM} must be one of {ALGORITHMS}, got {env[ALGORITHM]!r}")
    fused_pass_setting(env)
    return Settings(True, interval, algorithm)


def check_block_size(settings: Settings, block_size: int) -> None:
    """The capture interval against the Mamba block size (engine start, prefix caching on)."""
    interval = settings.capture_interval
    if interval and interval % block_size:
        raise ValueError(f"{INTERVAL} must be 0 or a positive multiple of the Mamba block size {block_size}, "
                         f"got {interval}")


# What install() read; the steps use these values.
current = Settings()
