"""Serving on top of the kernels and the planner: a small hybrid LM, an engine that serves it with
the planner's prefix cache and in-pass captures, the `ssm-prefill` demo, and `vllm_plugin` (vLLM's
Mamba layers on the kernels, registered as a `vllm.general_plugins` entry point; imported by vLLM,
not by this package).

Dependencies go one way: `ssm_kernels` (ops, layers, adapters) and `planner` (pure Python) know
nothing of each other or of this package; this package uses both.
"""
from .engine import Engine, KVBlockStore, ServeResult
from .model import HybridConfig, HybridLM

__all__ = ["Engine", "HybridConfig", "HybridLM", "KVBlockStore", "ServeResult"]
