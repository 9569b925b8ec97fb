"""Serving on top of the kernels and the planner: a small hybrid LM, an engine that serves it with
the planner's prefix cache and in-pass captures, and the `ssm-prefill` demo.

Dependencies go one way: `ssm_kernels` (ops, layers, adapters) and `planner` (pure Python) know
nothing of each other or of this package; this package uses both.
"""
from .engine import Engine, KVBlockStore, ServeResult
from .model import HybridConfig, HybridLM

__all__ = ["Engine", "HybridConfig", "HybridLM", "KVBlockStore", "ServeResult"]
