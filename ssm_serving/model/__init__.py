"""A small hybrid (Mamba-2 + attention) LM on this library's layers."""
from .blocks import MLP, Attention, KVCache, RMSNorm
from .hybrid import HybridConfig, HybridLM, ModelSnapshot, ModelState, PassOutput

__all__ = ["Attention", "HybridConfig", "HybridLM", "KVCache", "MLP", "ModelSnapshot", "ModelState", "PassOutput",
           "RMSNorm"]
