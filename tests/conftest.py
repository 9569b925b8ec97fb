"""Test set-up: Triton runs through its interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton is first imported, hence here, at the top.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

import ssm_kernels._common  # noqa: E402
from ssm_kernels.scan.mamba2_chunked import tables as chunk_tables  # noqa: E402


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output a kernel allocates starts as NaN, so an element it never writes fails a test."""
    monkeypatch.setattr(ssm_kernels._common, "POISON_OUTPUTS", True)


@pytest.fixture(autouse=True)
def own_chunk_tables():
    """Each test plans its own passes: a pass's chunk tables and launches, kept for the next pass
    like it (recent_pass), its capture table and cu_seqlens copy, and a public call's launches
    would hide a test's patched planning."""
    chunk_tables._recent_tables.cache_clear()
    ssm_kernels._common._recent_capture_table.cache_clear()
    ssm_kernels._common._recent_ints.cache_clear()
    ssm_kernels._replay._public.clear()


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of token-sized ops: extra threads only spin (badly so on a
    shared 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def device():
    """The tests' device, indexed on a GPU (cuda:0, not cuda), as the tensors made there report it."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _kept(item) -> bool:
    """False for a case of another backend than the one its module runs (ONLY_BACKEND: a module
    that re-runs other modules' tests for one backend's path, whose other cases would repeat
    theirs)."""
    only = getattr(getattr(item, "module", None), "ONLY_BACKEND", None)
    params = getattr(getattr(item, "callspec", None), "params", {})
    return only is None or params.get("backend", only) == only


def pytest_collection_modifyitems(config, items):
    kept, dropped = [], []
    for item in items:
        (kept if _kept(item) else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
