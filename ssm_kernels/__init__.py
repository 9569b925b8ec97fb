"""Selective-scan kernels that write the SSM state at any offsets inside a prefill pass.

Set TRITON_INTERPRET=1 before importing this package to run the Triton kernels on CPU tensors.
"""
from . import reference
from ._common import ScanResult
from .scan import MAX_DSTATE, mamba1_scan, mamba2_scan, selective_state_update

__all__ = ["ScanResult", "mamba2_scan", "mamba1_scan", "selective_state_update", "MAX_DSTATE", "reference"]
