"""vLLM's Model Runner V2 on its CPU build, for tests_vllm: .ci/vllm.sh runs the suite a second time
with this folder on PYTHONPATH and VLLM_USE_V2_MODEL_RUNNER=1, and Python imports this module at
start-up in every process (the test process, the engines' child processes, vLLM's workers).

vLLM's CPU build runs V2 only where Triton has a CPU backend (it looks for a backend named "cpu"),
which the package index's triton lacks. Here Triton's interpreter runs V2's Triton kernels on CPU
tensors, and an entry named "cpu" in Triton's backend table lets vLLM take that path; its driver
reports itself inactive, so Triton's own choice of driver is unchanged.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # read when triton's kernels are defined

import triton.backends  # noqa: E402


class _InactiveDriver:
    @staticmethod
    def is_active() -> bool:
        return False


class _InterpretedCPU:
    driver = _InactiveDriver


triton.backends.backends.setdefault("cpu", _InterpretedCPU)
