"""Mamba mixer layers (transformers-compatible parameters) built on the capture kernels."""
from .common import LayerState, MixerOutput, Snapshot, SSMMixer
from .mamba1 import Mamba1Mixer
from .mamba2 import GatedRMSNorm, Mamba2Mixer
from .rows import exact_linear, exact_rowwise

__all__ = ["GatedRMSNorm", "LayerState", "Mamba1Mixer", "Mamba2Mixer", "MixerOutput", "SSMMixer", "Snapshot",
           "exact_linear", "exact_rowwise"]
