"""Backend choice for the scans: the Triton kernel or the PyTorch path."""
from __future__ import annotations

import torch

from .._common import resolve_backend
from .problem import ScanProblem
from .torch_kernel import run_torch
from .triton_kernel import RUNS_ON_CPU, run_triton


def choose_backend(backend: str, device: torch.device) -> str:
    """Validate `backend` for tensors on `device` and resolve 'auto'."""
    return resolve_backend(backend, device, triton_runs_on_cpu=RUNS_ON_CPU)


def run(problem: ScanProblem, backend: str) -> None:
    """Run a validated problem on a resolved backend ('triton' or 'torch')."""
    (run_triton if backend == "triton" else run_torch)(problem)
