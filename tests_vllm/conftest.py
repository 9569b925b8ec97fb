"""Tests that need vLLM (its CPU build in CI): run inside the venv .ci/run makes, as
`python -m pytest -q tests_vllm`. The default `pytest` collects only tests/ and never these."""
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)
