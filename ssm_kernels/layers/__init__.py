"""Mamba mixer layers (transformers-compatible parameters) built on the capture kernels."""
from .common import LayerState, MixerOutput, Snapshot, SSMMixer, per_token
from .mamba1 import Mamba1Mixer
from .mamba2 import GatedRMSNorm, Mamba2Mixer

__all__ = ["GatedRMSNorm", "LayerState", "Mamba1Mixer", "Mamba2Mixer", "MixerOutput", "SSMMixer", "Snapshot",
           "per_token"]
