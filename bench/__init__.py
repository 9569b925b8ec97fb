"""Benchmarks of the scan kernels (``python -m bench.scan``), of the planner and serving policies
(``python -m bench.serve``), the static cost report (``python -m bench.static``); run from the
repository root. ``bench/gpu_suite.sh`` runs the measuring ones on a GPU.

Importing bench changes nothing. Whether Triton kernels run compiled or through the interpreter
is fixed, per kernel, when the module defining it is imported (triton.jit reads TRITON_INTERPRET
as it decorates), so each entry point chooses before it imports any kernel, with
`use_triton_interpreter`: the measuring benchmarks choose the interpreter exactly when there is
no CUDA, bench.static compiles (it never launches); its counts run in an interpreter subprocess
(triton_static.counts).
"""
from __future__ import annotations

import os
import sys

KERNEL_PACKAGES = ("ssm_kernels", "mamba_ssm")


def use_triton_interpreter(on: bool | None = None) -> None:
    """Run this process's Triton kernels through the interpreter (on) or compiled (off); None:
    the interpreter exactly when there is no CUDA. Raises RuntimeError if a kernel package was
    already imported under the other choice."""
    if on is None:
        import torch
        on = not torch.cuda.is_available()
    value = "1" if on else "0"
    current = "1" if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes") else "0"
    imported = [name for name in KERNEL_PACKAGES if name in sys.modules]
    if imported and current != value:
        raise RuntimeError(f"{', '.join(imported)} already imported with TRITON_INTERPRET={current}; "
                           f"choose the Triton mode before importing the kernels")
    os.environ["TRITON_INTERPRET"] = value
