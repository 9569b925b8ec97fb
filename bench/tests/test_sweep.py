"""bench.sweep: its configurations merge into launch_config as documented, each runs a correct pass,
and its GPU measurement's bookkeeping (run here under the interpreter, with a stand-in timer)."""
import pytest
import torch

from bench import sweep
from bench import workloads as wl
from bench.common import Budget, configured, merged

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # Triton's tensors


def test_a_configuration_merges_into_launch_config():
    base = {"BLOCK_M": 64, "output": {"num_warps": 4, "num_stages": 2, "maxnreg": 168}}
    assert merged(base, {"output": {"num_warps": 8, "maxnreg": None}}) == {
        "BLOCK_M": 64, "output": {"num_warps": 8, "num_stages": 2}}
    assert merged(base, {"BLOCK_M": 128})["BLOCK_M"] == 128
    assert base["output"]["num_warps"] == 4  # unchanged
    with pytest.raises(KeyError, match="NO_SUCH"):
        merged(base, {"NO_SUCH": 1})
    from ssm_kernels.scan.mamba2_chunked.triton_kernel import launch_config
    for changes in sweep.CONFIGS.values():  # every configuration names launch_config's keys
        merged(launch_config(64, 128, 256, torch.bfloat16), changes)


def test_a_configuration_reaches_the_pass():
    from ssm_kernels.scan.mamba2_chunked import triton_kernel
    seen, real = [], triton_kernel.new_workspace

    def spy(p, tables):
        ws = real(p, tables)
        seen.append(ws.cfg)
        return ws
    with configured({"PASS_BLOCK": 1024}), pytest.MonkeyPatch.context() as m:
        m.setattr(triton_kernel, "new_workspace", spy)
        sweep._scan(wl.mamba2_inputs(wl.REDUCED_SHAPES[0], 40, DEVICE))
    assert [cfg["PASS_BLOCK"] for cfg in seen] == [1024]


def test_every_configuration_runs_a_pass_within_its_bound(tmp_path):
    assert sweep.main(["--reduced", "--out", str(tmp_path)]) == 0
    rows = __import__("json").loads((tmp_path / "sweep.json").read_text())["rows"]
    assert [r["config"] for r in rows] == list(sweep.CONFIGS)
    assert all(r["within_bound"] for r in rows), rows


def test_the_gpu_measurement_compares_each_configuration_with_the_default():
    configs = {"default": {}, "walk: 2 steps in flight": {"WALK_STAGES": 2}, "refused": {"NO_SUCH": 1},
               "output and C B^T: 128-row tiles": {"BLOCK_M": 128}}
    def times(call):  # a stand-in for kernel_times: runs the pass, reports fixed times
        call()
        return {"_chunk_output_kernel": 2.0, "_chunk_cb_kernel": 1.0}
    rows = []
    sweep.measure_gpu(configs, wl.REDUCED_SHAPES[:1], 300, Budget(None), rows, device=DEVICE, times=times)
    by = {r["config"]: r for r in rows}
    assert list(by) == list(configs)
    assert by["default"]["kernel_ms"] == 3.0 and by["default"]["vs_default"] == 1.0 and by["default"]["bitwise"]
    assert by["walk: 2 steps in flight"]["bitwise"]  # the walk's arithmetic does not depend on its pipelining
    assert "KeyError" in by["refused"]["error"] and "kernel_ms" not in by["refused"]
    assert by["output and C B^T: 128-row tiles"]["rel_err_y"] < 1e-2
    rows = []
    sweep.measure_gpu(configs, wl.REDUCED_SHAPES[:1], 300, Budget(0), rows, device=DEVICE)
    assert rows == []  # nothing starts once the budget is spent


def test_the_suites_summary_names_the_fastest_configuration_a_shape():
    from bench.summary import sweep_line
    rows = [{"shape": "A", "config": "default", "vs_default": 1.0, "bitwise": True},
            {"shape": "A", "config": "faster", "vs_default": 0.9, "bitwise": False},
            {"shape": "A", "config": "slower", "vs_default": 1.1, "bitwise": True},
            {"shape": "B", "config": "default", "vs_default": 1.0, "bitwise": True},
            {"shape": "B", "config": "refused", "error": "OutOfResources"}]
    assert sweep_line({"rows": rows}).endswith(
        "A: faster 0.900x (bit for bit: no); B: default 1.000x (bit for bit: yes)")
