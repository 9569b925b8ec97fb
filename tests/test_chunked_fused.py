"""The fused chunked pass (mamba2_scan(algorithm="chunked")'s stages 2 to 5 in one launch,
triton_kernel.stage2to5_fused, opt-in): the chunked scan's own tests run again with it on, and
its results against the five stages'.

It runs the five stages' operations, so under the interpreter (one program after another, in
ticket order) it gives their bits, every output; on a GPU its programs run at once and hand
states on through flags, and its results are the five stages' to rounding (two binaries may
contract a multiply and an add differently). The tests re-run here keep its own guarantees:
accuracy against float64, varlen with empty and 1-token sequences, captures anywhere that change
no bit of y or the final states, passes resumed at a chunk-grid point bit-identical to one pass,
a non-finite input reaching only its token and later ones.
"""
import os
import subprocess
import sys

import pytest
import torch

import test_cache_ops_chunked
import test_nonfinite
from helpers import assert_rel_close, mamba2_inputs, mamba2_positional
from ssm_kernels import mamba2_scan
from ssm_kernels.scan.mamba2_chunked import triton_kernel as tk
from test_chunked import captures_for


# The fused pass is a Triton launch: the imported tests' PyTorch cases would repeat their own.
ONLY_BACKEND = "triton"


@pytest.fixture(autouse=True)
def fused():
    """Every pass of this module's tests allocates a fused pass's workspace (the chunked scan's
    tests imported at the end run with it)."""
    with tk.fused_pass():
        yield


def test_mamba2_chunked_prefill_on_an_engines_cache(device):
    """On an engine's cache (slots, a skipped row, fresh rows, captures into slots) the fused pass
    gives the bits of the public scan, itself on the fused pass: this checks the cache's plumbing
    around the fused launch; the tests below check the fused pass against the five stages. On
    the tests' device, which that test takes as torch's default."""
    torch.set_default_device(device)
    try:
        for cache_dtype in (torch.float32, torch.bfloat16):
            test_cache_ops_chunked.test_mamba2_chunked_prefill_matches_public_chunked_scan("triton", cache_dtype, False)
    finally:
        torch.set_default_device(None)  # no default-device mode left behind


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_captures_into_a_cache_of_the_inputs_16_bit_dtype(dtype, device):
    """A 16-bit pass into a cache of its own dtype (a float16 pass multiplies in bfloat16, but C B^T): the
    fused pass's cache and y hold the five stages' bits, an inner capture in a sequence's first
    chunk included, whose slot the final state overwrites, and captures into the skip slot
    declined."""
    kw, cache = test_cache_ops_chunked._mamba2_case(dtype)
    kw = {k: v.to(device=device, dtype=dtype if k in ("x", "B", "C", "z") else v.dtype) for k, v in kw.items()}
    results = []
    for fused in (True, False):
        with torch.device(device):  # the batch's tensors beside the pass's
            batch = test_cache_ops_chunked._batch()
        with tk.fused_pass(fused):
            out, slots = torch.zeros_like(kw["x"][0]), cache.to(device, copy=True)
            test_cache_ops_chunked._mamba2_prefill(batch, kw, slots, out, backend="triton",
                                                   algorithm="chunked", chunk_size=test_cache_ops_chunked.CHUNK)
            results.append((out, slots))
    for what, fused, five in zip(("y", "cache"), *results):
        _same(fused, five, what)


def _same(fused, five, what):
    """Bit for bit under the interpreter; to rounding on a GPU."""
    if fused.device.type == "cpu":
        assert torch.equal(fused, five), what
    else:
        assert_rel_close(fused, five, 1e-5 if fused.dtype == torch.float32 else 1e-3, what)


@pytest.mark.gpu
def test_at_a_layers_size_on_gpu():
    """Mamba-2 2.7B's layer over 8192 tokens with captures: some 14000 programs, far more than the
    GPU holds at once, waiting on one another's flags; against the five stages."""
    args, kw = mamba2_positional(mamba2_inputs(1, 8192, nheads=80, headdim=64, ngroups=1, dstate=128,
                                               dtype=torch.bfloat16, device=torch.device("cuda")))
    kw.update(dt_softplus=True, capture=[(0, 0), (0, 100), (0, 4096), (0, 5000), (0, 8192)])
    results = []
    for fused in (True, False):
        with tk.fused_pass(fused):
            results.append(mamba2_scan(*args, **kw, algorithm="chunked"))
    for name, fused, five in zip(results[0]._fields, *results):
        _same(fused, five, name)


def test_two_launches(device, monkeypatch):
    """The fused pass is two launches: stage 1 and the rest, captures inside a chunk included."""
    launched = []
    monkeypatch.setattr(tk, "launch", lambda kernel, grid, *args, **kw: launched.append(kernel.__name__) or
                        kernel[grid](*args, **kw))
    args, kw = mamba2_positional(mamba2_inputs(1, 40, **DIMS["small"], device=device))
    mamba2_scan(*args, **kw, capture=[(0, 5), (0, 16), (0, 40)], backend="triton", algorithm="chunked",
                chunk_size=16)
    assert launched == ["_dt_cumsum_kernel", "_fused_pass_kernel"]


def test_the_setting_is_read_at_the_first_pass(monkeypatch, device):
    """SSM_KERNELS_FUSED_SSD is read when a pass first allocates a workspace: a bad value is a
    ValueError there, not at import (where a plugin loader would log it and pass over the
    package); "0" runs the five stages."""
    env = dict(os.environ, SSM_KERNELS_FUSED_SSD="yes", TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", "import ssm_kernels, ssm_serving.vllm_plugin"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    args, kw = mamba2_positional(mamba2_inputs(1, 20, **DIMS["small"], device=device))
    call = lambda: mamba2_scan(*args, **kw, backend="triton", algorithm="chunked", chunk_size=16)
    launched = []
    monkeypatch.setattr(tk, "launch", lambda kernel, grid, *args, **kw: launched.append(kernel.__name__) or
                        kernel[grid](*args, **kw))
    was, tk.FUSED_PASS = tk.FUSED_PASS, None  # unread, as after import (restored here, not by a fixture's order)
    try:
        monkeypatch.setenv("SSM_KERNELS_FUSED_SSD", "yes")
        with pytest.raises(ValueError, match="SSM_KERNELS_FUSED_SSD must be 0 or 1, got 'yes'"):
            call()
        monkeypatch.setenv("SSM_KERNELS_FUSED_SSD", "0")
        call()
        assert tk.FUSED_PASS is False and "_chunk_output_kernel" in launched and "_fused_pass_kernel" not in launched
    finally:
        tk.FUSED_PASS = was


# Dims with several chunk programs a head (two P blocks) and, in the five stages, several walk
# blocks a head (80 x 32 state elements: two of 2048).
DIMS = {"small": dict(nheads=4, headdim=16, ngroups=2, dstate=16),
        "two_blocks": dict(nheads=2, headdim=80, ngroups=1, dstate=32)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims, captures", [("small", "everywhere"), ("two_blocks", "everywhere"),
                                            ("small", "sparse")])
def test_the_fused_pass_gives_the_five_stages_results(dims, captures, dtype, device):
    """Captures everywhere, or inside two chunks of a pass whose other chunks have none at their
    start or inside them (those walk their chunk in the plain step)."""
    lengths = [0, 1, 17, 0, 33, 7, 16]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    args, kw = mamba2_positional(mamba2_inputs(1, sum(lengths), **DIMS[dims], nseq=len(lengths), dtype=dtype,
                                               device=device))
    capture = captures_for(lengths) if captures == "everywhere" else [(4, 20), (2, 5), (4, 33)]
    kw.update(dt_softplus=True, cu_seqlens=cu, capture=capture, start_positions=[0, 3, 16, 0, 5, 0, 32])
    results = []
    for fused in (True, False):
        with tk.fused_pass(fused):
            results.append(mamba2_scan(*args, **kw, backend="triton", algorithm="chunked", chunk_size=16))
    for name, fused, five in zip(results[0]._fields, *results):
        _same(fused, five, name)


def test_a_workspace_serves_consecutive_passes(device, monkeypatch):
    """A serving step's layers share one workspace: each pass opens a new generation of flags,
    whose tickets start from 0 again."""
    args, kw = mamba2_positional(mamba2_inputs(2, 40, **DIMS["small"], device=device))
    kw.update(dt_softplus=True, capture=[(0, 5), (1, 16), (0, 40)])
    want = mamba2_scan(*args, **kw, backend="triton", algorithm="chunked", chunk_size=16)
    workspaces, calls = [], []
    new_workspace = tk.new_workspace

    def shared(p, tables):
        calls.append((p, tables))
        if not workspaces:
            workspaces.append(new_workspace(p, tables))
        return workspaces[0]

    monkeypatch.setattr(tk, "new_workspace", shared)
    for _ in range(3):
        got = mamba2_scan(*args, **kw, backend="triton", algorithm="chunked", chunk_size=16)
        for name, u, v in zip(got._fields, got, want):
            _same(u, v, name)
    (ws,) = workspaces
    assert ws.fused and int(ws.counters[0]) == 3, "three generations"
    once = new_workspace(*calls[-1])  # one pass on a fresh workspace: each flag at its producers' count
    tk.run_chunked_triton(*calls[-1], once)
    assert bool((once.flags > 0).all()) and torch.equal(ws.flags, 3 * once.flags), "every flag raised by each pass"


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("j", test_nonfinite.BAD_TOKENS)
@pytest.mark.parametrize("value", list(test_nonfinite.VALUES))
@pytest.mark.parametrize("name", list(test_nonfinite.MAMBA2_CASES))
def test_a_bad_token_reaches_only_itself_and_later(name, value, j):
    """test_nonfinite's Mamba-2 cases on the fused pass, whose output programs keep a non-finite x
    of the diagonal block out of its matmul themselves (the five stages leave that to a fix-up
    launch, which the fused pass does not have)."""
    test_nonfinite._clean.cache_clear()  # the clean passes compared with are the fused pass's too
    try:
        test_nonfinite.test_bad_token_reaches_only_itself_and_later("mamba2", name, value, j, "chunked", "triton")
    finally:
        test_nonfinite._clean.cache_clear()


# The chunked scan's tests, run here with the fused pass (the fixture above), after this module's
# own (a GPU run cut short has run those first).
from test_chunked import (test_all_options_against_float64, test_captures_leave_y_and_final_states_bitwise_unchanged,  # noqa: E402,F401,E501
                          test_duplicate_and_unordered_captures_land_in_their_rows, test_inner_captures_of_16bit_passes,
                          test_model_size_on_gpu, test_one_token_passes_of_16bit_inputs, test_only_empty_sequences,
                          test_variants, test_varlen_with_empty_and_one_token_sequences,
                          test_warm_restore_matches_cold_run)
from test_chunked_grid import (test_passes_on_the_absolute_grid_of_a_sequence_that_starts_off_it,  # noqa: E402,F401
                               test_real_tiles_split_at_the_default_chunk, test_split_at_a_grid_point_is_bit_identical,
                               test_varlen_batch_of_sequences_resumed_at_different_grid_points)
