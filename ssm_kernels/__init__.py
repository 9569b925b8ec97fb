"""Selective-scan kernels that write the SSM state at any offsets inside a prefill pass.

Set TRITON_INTERPRET=1 before importing this package to run the Triton kernels on CPU tensors.
Subpackages beyond the names below: `ssm_kernels.adapters` (transformers models and
mamba_ssm-compatible entry points), `ssm_kernels.scan.mamba2_chunked` (the chunked algorithm's settings),
`ssm_kernels.scan.reference` and `ssm_kernels.conv.reference` (the float64 references),
`ssm_kernels.cache_ops` (entry points for serving engines: states in place in a cache by slot).
This package imports nothing of `planner` or `ssm_serving`, which sit above it.
Forward only: no op records an autograd graph (gradients are not part of the interface), so with
grad mode on an input that requires grad is refused.
"""
from ._common import ScanResult
from .conv import ConvResult, causal_conv1d, causal_conv1d_update
from .layers import LayerState, Mamba1Mixer, Mamba2Mixer, Snapshot
from .scan import MAX_DSTATE, mamba1_scan, mamba2_scan, selective_state_update

__all__ = ["ScanResult", "mamba2_scan", "mamba1_scan", "selective_state_update", "MAX_DSTATE", "ConvResult",
           "causal_conv1d", "causal_conv1d_update", "LayerState", "Mamba1Mixer", "Mamba2Mixer", "Snapshot"]
