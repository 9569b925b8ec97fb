"""Runs a validated scan on a resolved backend: the Triton kernel or the PyTorch path."""
from __future__ import annotations

from .problem import ScanProblem
from .torch_kernel import run_torch
from .triton_kernel import run_triton


def run(problem: ScanProblem, backend: str) -> None:
    """Run a validated problem on a resolved backend ('triton' or 'torch')."""
    (run_triton if backend == "triton" else run_torch)(problem)
