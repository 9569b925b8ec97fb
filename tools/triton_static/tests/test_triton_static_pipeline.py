"""A toy kernel through the whole tool (toy_pipeline.py, in a process that does not interpret, as
bench.static runs): its launch recorded and bound as a real launch binds it, compiled for sm_90a
and read back, counted through the interpreter in a subprocess at two sizes, extrapolated, and
modelled."""
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import toy_kernels
from toy_pipeline import ROWS, SIZE, SIZES

HERE = Path(__file__).resolve().parent


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**env, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]), **extra}


@pytest.fixture(scope="module")
def pipeline():
    run = subprocess.run([sys.executable, str(HERE / "toy_pipeline.py")], env=_env(), capture_output=True,
                         text=True, timeout=600, cwd=HERE)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def test_a_launch_is_recorded_as_a_real_launch_binds_it(pipeline):
    launch = pipeline["launch"]
    assert launch["kernel"] == "_row_sum" and launch["grid"] == [ROWS, 1, 1] and launch["config"] is None
    assert launch["constexprs"]["BLOCK"] == toy_kernels.BLOCK
    assert launch["args"]["n"] == SIZE and launch["args"]["x_ptr"]["shape"] == [ROWS, SIZE]
    # 16-byte aligned storage, multiples of 16
    assert launch["divisible"] == sorted(["x_ptr", "out_ptr", "n", "stride"])


def test_the_launch_compiles_for_sm90_and_reads_back(pipeline):
    code = pipeline["code"]
    assert code["registers"] == code["ptxas_registers"] > 0 and code["spill_stores"] == code["spill_loads"] == 0
    assert code["mma_form"] == "none" and code["global_loads"] >= 1 and code["loop_loads"] >= 1


def test_compiling_in_a_process_that_interprets_is_refused():
    """Under TRITON_INTERPRET=1 Triton's own @jit functions (tl.zeros, tl.sum) are built for the
    interpreter; compiling a kernel that calls one would fail inside Triton, or pass only where
    Triton's cache already holds the kernel. compile_launch says why instead."""
    code = ("import toy_kernels, torch\n"
            "from triton_static.launches import compile_launch, recording\n"
            "launches = []\n"
            "with recording(launches):\n"
            "    toy_kernels.row_sum(torch.zeros(2, 64), kernel=toy_kernels.jit_row_sum_kernel)\n"
            "compile_launch(launches[0])\n")
    run = subprocess.run([sys.executable, "-c", code], env=_env(TRITON_INTERPRET="1"), capture_output=True,
                         text=True, timeout=600, cwd=HERE)
    assert run.returncode != 0 and "imported Triton under TRITON_INTERPRET=1" in run.stderr, run.stderr[-3000:]


def test_counts_are_exact_at_each_size_and_extrapolate(pipeline):
    for size in SIZES:
        (c,) = pipeline["counted"][str(size)]
        assert c["kernel"] == "_row_sum" and c["sampled"] == [2, 1, 1]  # the two ends of 8 programs
        assert c["bytes_loaded"] == ROWS * size * 4 and c["bytes_stored"] == ROWS * 4
        assert c["storages"]["x_ptr"]["size"] == ROWS * size * 4
    (c,) = pipeline["extrapolated"]
    assert c["bytes_loaded"] == pytest.approx(ROWS * SIZE * 4) and c["bytes_stored"] == pytest.approx(ROWS * 4)


def test_a_call_is_modelled_from_its_launches_and_counts(pipeline):
    result = pipeline["model"]
    (entry,) = result["kernels"]
    assert entry["chosen"] and result["kernels_launched"] == 1 and result["time_ms"] == entry["model"]["time_ms"]
    hot = entry["hot_loop"]
    assert hot["iterations_per_program"] == pytest.approx(SIZE / toy_kernels.BLOCK)
    assert "for start in range(0, n, BLOCK)" in hot["what"]
    m = entry["model"]
    assert m["time_ms"] == max(m[f"{k}_ms"] for k in ("memory", "tensor", "issue", "latency")) > 0
    assert "differ from the recorded ones" in pipeline["launched_twice"]


def test_specialisations_of_a_test_run_are_recorded_and_compiled(tmp_path):
    """`python -m triton_static.specs`: a pytest run's launches under the interpreter, recorded per
    test file, then bound and compiled for sm_90a: two row widths of one alignment share a
    specialisation unless one is not a multiple of 16."""
    test = tmp_path / "test_toy.py"
    test.write_text("import torch\nimport toy_kernels\n\n\ndef test_rows():\n"
                    "    for n in (64, 128, 100):\n        toy_kernels.row_sum(torch.zeros(4, n))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "TRITON_DEFAULT_FP_FUSION": "1"}
    run = lambda *args: subprocess.run([sys.executable, "-m", "triton_static.specs", *args], env=env,  # noqa: E731
                                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    recorded = run("record", str(tmp_path / "specs.pkl"), "--", "-q", "-p", "no:cacheprovider", str(test))
    assert recorded.returncode == 0 and "3 distinct launches" in recorded.stdout, recorded.stdout + recorded.stderr
    compiled = run("compile", str(tmp_path / "specs.pkl"), "--json", str(tmp_path / "c.json"))
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    result = json.loads((tmp_path / "c.json").read_text())
    assert result["specialisations"] == 2 and set(result["per_kernel"]) == {"_row_sum"}
    assert result["per_kernel"]["_row_sum"]["compile_s"] > 0
    assert {f.rsplit("/", 1)[-1] for f in result["per_file"]} == {"test_toy.py"}


def test_specs_compile_refuses_a_file_it_did_not_record(tmp_path):
    (tmp_path / "text.pkl").write_text("not a pickle")
    (tmp_path / "dict.pkl").write_bytes(pickle.dumps({"a": 1}))
    for name, said in (("text.pkl", "is not a recording of launches"), ("dict.pkl", "holds a dict")):
        proc = subprocess.run([sys.executable, "-m", "triton_static.specs", "compile", str(tmp_path / name)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
