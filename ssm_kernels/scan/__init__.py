"""Selective scans (recurrent and chunked) with in-pass state capture, and the decode step."""
from .mamba1 import mamba1_scan
from .mamba2 import mamba2_scan, selective_state_update
from .problem import MAX_DSTATE

__all__ = ["mamba2_scan", "mamba1_scan", "selective_state_update", "MAX_DSTATE"]
