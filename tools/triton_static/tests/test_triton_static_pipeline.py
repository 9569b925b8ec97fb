"""A toy kernel through the whole tool: its launch recorded and bound as a real launch binds it,
compiled for sm_90a and read back, counted through the interpreter in a subprocess at two sizes,
extrapolated, and modelled."""
from pathlib import Path

import pytest
import torch

import toy_kernels
from triton_static import calls, counts, sass
from triton_static.launches import compile_launch, recording

HERE = Path(__file__).resolve().parent
ROWS, SIZES, SIZE = 8, (256, 512), 1024


@pytest.fixture(scope="module")
def launch():
    launches = []
    with recording(launches):
        toy_kernels.row_sum(torch.zeros(ROWS, SIZE), kernel=toy_kernels.compiled_row_sum_kernel)
    (launch,) = launches
    return launch


@pytest.fixture(scope="module")
def counted():
    (by_size,) = counts.count([{"rows": ROWS, "sizes": list(SIZES)}], "toy_kernels:run", cwd=HERE)
    return by_size


def test_a_launch_is_recorded_as_a_real_launch_binds_it(launch):
    assert launch.kernel == "_row_sum" and launch.grid == (ROWS, 1, 1) and launch.config is None
    assert launch.constexprs["BLOCK"] == toy_kernels.BLOCK
    assert launch.args["n"] == SIZE and launch.args["x_ptr"]["shape"] == [ROWS, SIZE]
    divisible = {launch.fn.arg_names[path[0]] for path, attrs in launch.source.attrs.items()
                 if ["tt.divisibility", 16] in [list(a) for a in attrs]}
    assert divisible == {"x_ptr", "out_ptr", "n", "stride"}  # 16-byte aligned storage, multiples of 16


def test_the_launch_compiles_for_sm90_and_reads_back(launch):
    code = sass.read(compile_launch(launch))
    assert code.registers == code.ptxas_registers > 0 and code.spill_stores == code.spill_loads == 0
    assert code.mma_form == "none" and sass.mix(code.instrs)["global load"] >= 1
    assert code.loops and any(i.base == "LDG" for loop in code.loops for i in loop.instrs)


def test_counts_are_exact_at_each_size_and_extrapolate(counted):
    for size in SIZES:
        (c,) = counted[size]
        assert c["kernel"] == "_row_sum" and c["sampled"] == [2, 1, 1]  # the two ends of 8 programs
        assert c["bytes_loaded"] == ROWS * size * 4 and c["bytes_stored"] == ROWS * 4
        assert c["storages"]["x_ptr"]["size"] == ROWS * size * 4
    (c,) = counts.extrapolate(counted, SIZE)
    assert c["bytes_loaded"] == pytest.approx(ROWS * SIZE * 4) and c["bytes_stored"] == pytest.approx(ROWS * 4)


def test_a_call_is_modelled_from_its_launches_and_counts(launch, counted):
    result = calls.model_call([launch], counts.extrapolate(counted, SIZE), SIZE, per_token=False)
    (entry,) = result["kernels"]
    assert entry["chosen"] and result["kernels_launched"] == 1 and result["time_ms"] == entry["model"]["time_ms"]
    hot = entry["hot_loop"]
    assert hot["iterations_per_program"] == pytest.approx(SIZE / toy_kernels.BLOCK)
    assert "for start in range(0, n, BLOCK)" in hot["what"]
    m = entry["model"]
    assert m["time_ms"] == max(m[f"{k}_ms"] for k in ("memory", "tensor", "issue", "latency")) > 0
    with pytest.raises(RuntimeError, match="differ from the recorded ones"):
        calls.model_call([launch, launch], counts.extrapolate(counted, SIZE), SIZE, per_token=False)


def test_specialisations_of_a_test_run_are_recorded_and_compiled(tmp_path):
    """`python -m triton_static.specs`: a pytest run's launches under the interpreter, recorded per
    test file, then bound and compiled for sm_90a: two row widths of one alignment share a
    specialisation unless one is not a multiple of 16."""
    import json
    import os
    import subprocess
    import sys

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
