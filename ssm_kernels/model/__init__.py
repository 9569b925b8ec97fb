"""A small hybrid (Mamba-2 + attention) LM served with the planner's prefix cache."""
from .blocks import MLP, Attention, KVCache, RMSNorm
from .engine import Engine, KVBlockStore, ServeResult
from .hybrid import HybridConfig, HybridLM, ModelSnapshot, ModelState, PassOutput

__all__ = ["Attention", "Engine", "HybridConfig", "HybridLM", "KVBlockStore", "KVCache", "MLP", "ModelSnapshot",
           "ModelState", "PassOutput", "RMSNorm", "ServeResult"]
