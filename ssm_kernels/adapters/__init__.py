"""Adapters: transformers models on this library's kernels, and mamba_ssm-compatible entry points.

- :func:`use_ssm_kernels` patches the Mamba mixers of a transformers model (Mamba2, Bamba,
  NemotronH, FalconH1, Zamba2, GraniteMoeHybrid, Mamba, FalconMamba, Jamba);
  :func:`capture_states` takes SSM snapshots inside its forward passes and
  :func:`restore_states` writes them into a transformers cache.
- :mod:`ssm_kernels.adapters.mamba_ssm_compat`: ``selective_scan_fn``,
  ``mamba_chunk_scan_combined``, ``selective_state_update`` with mamba_ssm's signatures.

transformers is imported only when a model is patched (it is not a dependency of the kernels).
"""
from .hf import (Captured, LayerSnapshot, capture_states, remove_ssm_kernels, restore_states, supported_families,
                 use_ssm_kernels)
from .mamba_ssm_compat import mamba_chunk_scan_combined, selective_scan_fn, selective_state_update

__all__ = ["Captured", "LayerSnapshot", "capture_states", "mamba_chunk_scan_combined", "remove_ssm_kernels",
           "restore_states", "selective_scan_fn", "selective_state_update", "supported_families", "use_ssm_kernels"]
