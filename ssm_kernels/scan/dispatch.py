"""Runs a validated scan on a resolved backend: the Triton kernel or the PyTorch path."""
from __future__ import annotations

from .problem import ScanProblem
from .torch_kernel import run_torch
from .triton_kernel import run_triton


def run(problem: ScanProblem, backend: str, *, decode: bool = False) -> None:
    """Run a validated problem on a resolved backend ('triton' or 'torch'). `decode`: a decode
    step (one token per sequence; the Triton kernel computes dt' in place of a table pass)."""
    if backend == "triton":
        run_triton(problem, dt_inline=decode)
    else:
        run_torch(problem)
