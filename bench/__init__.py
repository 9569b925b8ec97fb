"""Benchmarks of the scan kernels (``python -m bench.scan``) and of the planner and serving
policies (``python -m bench.serve``); ``bench/gpu_suite.sh`` runs everything on a GPU.

Without CUDA every benchmark runs in its reduced mode (small shapes, the PyTorch path and the
Triton interpreter) and labels every output CPU. The interpreter must be chosen before triton is
first imported, hence here, before any submodule imports triton or ssm_kernels.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
