"""Depthwise causal conv with in-pass conv-state capture, and its decode step."""
from .conv1d import causal_conv1d, causal_conv1d_update
from .problem import ConvResult
from .reference import causal_conv1d_ref

__all__ = ["ConvResult", "causal_conv1d", "causal_conv1d_update", "causal_conv1d_ref"]
