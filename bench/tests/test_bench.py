"""The benchmarks' reduced mode, as CI runs it: bench/gpu_suite.sh --dry-run into a temporary
folder (the tests it would run on a GPU listed, bench.scan, bench.sweep, bench.ablate and
bench.serve reduced, then the summary), and the pieces it is built from.

On CPU every output must be labelled CPU; on a GPU machine the same run is reduced but labelled
with the GPU (the GPU suite itself leaves this file out: it runs the benchmarks at full size).
"""
import ast
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from bench import gpu_tests
from bench import workloads as wl
from bench.common import REPO_ROOT as ROOT
from bench.common import markdown_table

CUDA = torch.cuda.is_available()
LABEL = "GPU" if CUDA else "CPU"
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # No time budget and every step's limit ten times the GPU's: the test asks for every row, and
    # a budget or a step's limit set for a GPU's few minutes cut rows or timed a step out when other
    # processes shared the cores.
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, SUITE_BUDGET_S="3600", LIMIT_SCALE="10")
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_suite.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    return out, proc


def test_dry_run_succeeds_and_prints_the_short_tables_last(dry_run):
    out, proc = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tail = proc.stdout[proc.stdout.index("=== summary"):]
    assert "suite steps:" in tail and "scan pass ms (a call" in tail and "simulator (modelled)" in tail
    assert f"== bench.scan: {LABEL}" in tail and f"== bench.serve: {LABEL}" in tail


def test_dry_run_writes_every_file(dry_run):
    out, _ = dry_run
    for name in ("scan.json", "scan.md", "serve.json", "serve.md", "logs/steps.tsv", "logs/env.log",
                 "logs/tests.txt", "logs/accuracy.log", "logs/host.log", "host/host.md", "logs/chain.log",
                 "chain/chain.md", "logs/scan.log", "logs/sweep.log", "sweep/sweep.md", "logs/ablate.log",
                 "ablate/ablate.md", "logs/serve.log"):
        assert (out / name).stat().st_size > 0, name
    pngs = ("scan_throughput.png", "scan_decode.png", "serve_policies.png", "serve_measured.png")
    if HAS_MATPLOTLIB:
        for name in pngs:
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    else:
        assert "matplotlib is not installed" in (out / "scan.md").read_text()


def runs_a_kernel(path) -> bool:
    """Whether a test file imports the kernels, layers or model (ssm_kernels, ssm_serving)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return bool(names & {"ssm_kernels", "ssm_serving"})


def test_dry_run_lists_every_test_that_runs_a_kernel(dry_run):
    """The suite's test step as a dry run lists it (pytest --collect-only): not empty, every test
    file that imports a kernel, layer or model there with its tests, the gpu-marked model-size
    tests there too, and what it leaves out pure Python."""
    out, _ = dry_run
    listed = [line for line in (out / "logs" / "tests.txt").read_text().splitlines() if "::" in line]
    files = {line.split("::")[0] for line in listed}
    kernel_files = {f"tests/{p.name}" for p in sorted((ROOT / "tests").glob("test_*.py")) if runs_a_kernel(p)}
    assert len(kernel_files) >= 10 and kernel_files <= files, sorted(kernel_files - files)
    assert set(gpu_tests.selected()) == files
    assert {"tests/test_chunked.py::test_model_size_on_gpu[dtype0]",
            "tests/test_scan_exactness.py::test_model_size_split_is_bitwise_on_gpu"} <= set(listed)
    left_out = [ROOT / "tests" / name for name in gpu_tests.PURE_PYTHON]
    assert all(p.exists() and not runs_a_kernel(p) for p in left_out), left_out


def test_shards_hold_each_selected_file_once():
    files = gpu_tests.selected()
    for n in (1, 3, 8, 100):
        groups = gpu_tests.shards(files, n)
        assert len(groups) == min(n, len(files)) and sorted(f for g in groups for f in g) == sorted(files)
    weights = {f: 1.0 for f in files} | {files[0]: 100.0}
    assert [files[0]] in gpu_tests.shards(files, 2, weights)  # the heavy file alone


def test_scan_json_is_complete_and_labelled(dry_run):
    out, _ = dry_run
    data = json.loads((out / "scan.json").read_text())
    assert data["label"].startswith(LABEL) and data["env"]["label"] == data["label"]
    assert data["env"]["reduced"] is True and data["incomplete"] is None
    for key in ("device_name", "torch", "triton", "commit", "date", "timing"):
        assert key in data["env"], key
    assert data["copy_bandwidth"]["GBps"] > 0
    assert set(data["peers"]) == {"mamba_ssm", "fla", "hf-torch"}
    for section in ("scan", "captures", "inpass_vs_split", "grid_split", "decode"):
        rows = data[section]
        assert rows, section
        assert all(r["status"] in ("ok", "n/a", "skipped", "failed") for r in rows)
        ours_failed = [r for r in rows if r["status"] == "failed" and r.get("impl", "ssm_kernels") == "ssm_kernels"]
        assert not ours_failed, [r.get("note") for r in ours_failed]  # a peer may fail: it is reported
    ours = [r for r in data["scan"] if r["impl"] == "ssm_kernels" and r["status"] == "ok"]
    # every reduced shape, batch 1 and varlen, every seqlen, on each path
    assert {(r["model"], r["batch"], r["seqlen"]) for r in ours} == {
        (s.name, b, n) for s in wl.REDUCED_SHAPES for b in ("1", f"varlen {wl.VARLEN_SEQUENCES}")
        for n in wl.REDUCED_SEQLENS}
    for r in ours:
        assert r["ms"] > 0 and r["bytes"] > 0 and 0 < r["roofline_fraction"]
        assert r["tokens_per_s"] == pytest.approx(r["seqlen"] / (r["ms"] / 1e3))
    if not CUDA:
        assert {r["backend"] for r in ours} == {"torch", "triton-interpreter"}
    for r in (r for r in ours if r.get("check_rel_err_y") is not None):
        assert r["check_rel_err_y"] < 5e-2, r  # chunked and the interpreter against the first path
    hf = [r for r in data["scan"] if r["impl"] == "hf-torch" and r["status"] == "ok"]
    if hf:  # transformers installed: its PyTorch path agrees with ours on the same inputs
        assert all(r["check_rel_err_y"] < 5e-2 and r["check_rel_err_state"] < 5e-2 for r in hf), hf
    caps = {r["captures"] for r in data["captures"] if r["status"] == "ok"}
    assert {0, 1, 8, 64, "8 grid"} <= caps
    assert all(r["ratio"] > 0 for r in data["inpass_vs_split"] if r["status"] == "ok")
    grid = [r for r in data["grid_split"] if r["status"] == "ok"]
    assert {r["backend"] for r in grid} == ({"triton"} if CUDA else {"torch", "triton-interpreter"})
    assert all(r["bitwise"] is True and r["split"] % data["config"]["chunk_size"] == 0 for r in grid), grid
    assert {r["batch"] for r in data["decode"]} == set(wl.REDUCED_DECODE_BATCHES)


def test_serve_json_is_complete_and_labelled(dry_run):
    out, _ = dry_run
    data = json.loads((out / "serve.json").read_text())
    assert data["label"].startswith(LABEL) and data["incomplete"] is None
    policies = {"legacy", "split", "inpass", "free"}
    traces = data["simulator"]["traces"]
    assert {t["name"] for t in traces} == {"chat", "system", "agent"}
    assert all(set(t["policies"]) == policies for t in traces)
    layer = data["layer_plans"]["policies"]
    assert set(layer) == policies and all(p["status"] == "ok" and p["bitwise_warm_equals_cold"] for p in layer.values())
    assert layer["inpass"]["warm_replay_tokens"] < layer["legacy"]["warm_replay_tokens"]
    model = data["hybrid_model"]
    assert model["status"] in ("ok", "not available")
    if model["status"] == "ok":
        assert set(model["policies"]) == policies
        assert all(p["status"] == "ok" and p["bitwise_warm_equals_cold"] for p in model["policies"].values())


def test_a_suite_out_of_time_skips_its_steps_and_still_passes(tmp_path):
    """A budget too short for anything: every benchmark step is recorded as skipped (the test
    listing still runs), the summary says so, and the suite passes: nothing that ran failed."""
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, SUITE_BUDGET_S="1")
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_suite.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [line.split("\t") for line in (tmp_path / "logs" / "steps.tsv").read_text().splitlines()[1:]]
    assert [name for name, status, _ in steps if status != "skipped"] == ["tests-listed"]
    assert [name for name, status, _ in steps if status == "skipped"] == [
        "scan", "ablate", "sweep", "accuracy", "host", "chain", "serve"]
    assert "== bench.scan: skipped" in proc.stdout and "== bench.serve: skipped" in proc.stdout


def test_the_summary_fails_a_step_that_ran_and_left_no_results(dry_run, tmp_path):
    out, _ = dry_run
    (tmp_path / "logs").mkdir()
    (tmp_path / "scan.json").write_text((out / "scan.json").read_text())
    for status, expected in (("skipped", 0), ("0", 1)):
        (tmp_path / "logs" / "steps.tsv").write_text(f"step\tstatus\tseconds\nserve\t{status}\t3\n")
        proc = subprocess.run([sys.executable, "-m", "bench.summary", str(tmp_path)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == expected, (status, proc.stdout[-2000:], proc.stderr[-2000:])


def test_the_summary_takes_a_results_file_that_is_not_an_object_as_unreadable(tmp_path):
    (tmp_path / "scan.json").write_text("[]")
    (tmp_path / "serve.json").write_text('"text"')
    for argv, said in (([], "scan.json missing or unreadable"), (["--readme"], "no full-size GPU scan results")):
        proc = subprocess.run([sys.executable, "-m", "bench.summary", str(tmp_path), *argv], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, (argv, proc.stderr[-2000:])
        assert said in proc.stdout + proc.stderr, (argv, proc.stdout[-2000:], proc.stderr[-2000:])


def test_markdown_is_labelled(dry_run):
    out, _ = dry_run
    assert (out / "scan.md").read_text().startswith(f"# Scan benchmarks: {LABEL}")
    assert (out / "serve.md").read_text().startswith(f"# Serving benchmarks: {LABEL}")


def test_readme_block_refuses_reduced_results(dry_run):
    out, _ = dry_run
    proc = subprocess.run([sys.executable, "-m", "bench.summary", str(out), "--readme"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and not proc.stdout and "GPU results only" in proc.stderr


def test_pass_bytes_formula():
    shape = wl.Mamba2Shape("t", nheads=2, headdim=3, dstate=4, ngroups=1)
    # x, y: 10*2*3*2 each; dt: 10*2*2; B, C: 10*1*4*2 each; A, D, dt_bias: 3*2*4; 2 final states, 1 capture
    expected = 2 * 120 + 40 + 2 * 80 + 24 + 3 * (2 * 3 * 4 * 4)
    assert wl.pass_bytes(shape, 10, 2, 2, ncapture=1) == expected
    assert wl.pass_bytes(shape, 10, 2, 2, ncapture=1, initial_states=True) == expected + 2 * 96
    m1 = wl.Mamba1Shape("t", dim=5, dstate=2)
    # u, delta, y, z: 4*5*2 each; B, C: 4*2*2 each; A: 5*2*4; D, delta_bias: 5*4 each; 1 final state
    assert wl.pass_bytes(m1, 4, 1, 2) == 4 * 40 + 2 * 16 + 40 + 40 + 40
    assert wl.decode_bytes(shape, 3, 2) == 3 * (2 * 96 + 2 * 12 + 4 + 16) + 24


def test_varlen_lengths_mix_and_sum():
    for total in (16, 32, 2048, 32768):
        lengths = wl.varlen_lengths(total)
        assert len(lengths) == wl.VARLEN_SEQUENCES and sum(lengths) == total and min(lengths) >= 1
        assert lengths == wl.varlen_lengths(total)
    big = wl.varlen_lengths(32768)
    assert max(big) > 4 * min(big)  # mixed, not equal
    with pytest.raises(ValueError):
        wl.varlen_lengths(15)


def test_algorithms_follow_the_signature():
    from bench.scan import algorithms

    def old(x, *, backend="auto"):
        pass

    def new(x, *, algorithm="auto", chunk_size=None):
        pass

    assert algorithms(old) == ["recurrent"]
    assert algorithms(new) == ["recurrent", "chunked"]


def test_markdown_table_formats_figures():
    table = markdown_table(["a", "b"], [[1.23456, None], [12345.6, "x"]])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| 1.23 | - |", "| 12346 | x |"]


def test_accuracy_table_meets_the_tolerances(dry_run):
    """bench.accuracy's table: every path within the tests' tolerances (float32 1e-4 covers the
    chunked algorithm; bfloat16 1e-2)."""
    out, _ = dry_run
    rows = [line.split() for line in (out / "logs" / "accuracy.log").read_text().splitlines()
            if line.startswith(("float32 ", "bfloat16 "))]
    assert len(rows) == 8, rows
    for dtype, algorithm, backend, *errors in rows:
        limit = 1e-4 if dtype == "float32" else 1e-2
        assert all(float(e) <= limit for e in errors), (dtype, algorithm, backend, errors)


@pytest.mark.parametrize("argv, message", [(["--sections", "scan,bogus"], "unknown section(s) bogus"),
                                           (["--seqlens", "0"], "a pass length must be >= 1"),
                                           (["--seqlens", "8"], "--seqlens below 16 need --no-varlen"),
                                           (["--time-budget", "nan"], "a time budget is seconds > 0"),
                                           (["--time-budget", "-1"], "a time budget is seconds > 0")])
def test_scan_rejects_bad_flags(argv, message, capsys):
    from bench import scan

    with pytest.raises(SystemExit) as exc:
        scan.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("module, argv, message", [
    ("accuracy", ["--chunk-size", "3"], "--chunk-size: chunk_size must be a power of two"),
    ("chain", ["--lengths", "4", "0"], "--lengths must be >= 1"),
    ("chain", ["--lengths", "4", "4"], "--lengths needs two different lengths"),
    ("chain", ["--repeats", "0"], "--repeats must be >= 1"),
    ("chain", ["--tile", "64", "100"], "--tile must be two powers of two"),
    ("ablate", ["--reduced", "--shapes", "0"], "--shapes must be >= 1"),
    ("sweep", ["--comp"], "unrecognized arguments: --comp"),  # the mode is read from the exact flag
    ("sweep", ["--compile"], "--compile is read when the module is imported"),  # this process interprets
    ("sweep", ["--reduced", "--time-budget", "0"], "a time budget is seconds > 0"),
    ("static_report", ["/nonexistent"], "has no static.json"),
    ("gpu_tests", ["--shards", "2", "--weights", "/nonexistent.json"], "--weights: no such file"),
    ("vllm", ["--rounds", "1"], "--rounds must be at least 2"),
])
def test_bench_tools_refuse_bad_flags(module, argv, message, capsys):
    import importlib

    with pytest.raises(SystemExit) as exc:
        importlib.import_module(f"bench.{module}").main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["bench.static", "--layer", "mamba2:nheads=4"],
    ["bench.static", "--layer", "mamba2:nheads=4,headdim=16,dstate=32,ngroups=3"],
    ["bench.static_lines", "mamba2_scan chunked", "--kernel", "k", "--layer", "mamba1:dim=0,dstate=16"],
])
def test_the_static_model_refuses_a_bad_layer(argv):
    # In a process of its own: the model's modules import the kernels compiled, not interpreted.
    done = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "a layer is mamba2:nheads=H,headdim=P,dstate=N,ngroups=G or mamba1:dim=D,dstate=N" in done.stderr


def test_the_committed_compile_record_names_test_files_that_exist():
    """The GPU suite balances its shards by the record's per-file compile seconds: a renamed test
    file would silently lose its weight."""
    record = ROOT / "bench/results/2026-12-01-compile/compile.json"
    files = json.loads(record.read_text())["per_file"]
    assert files and all((ROOT / f).is_file() for f in files), [f for f in files if not (ROOT / f).is_file()]


def test_kernel_times_sum_per_name_and_run():
    """The profiler's events grouped by name, in ms a run, most time first."""
    from types import SimpleNamespace as NS

    from bench.common import per_name_ms

    def event(name, us):
        return NS(name=name, time_range=NS(elapsed_us=lambda: us))

    events = [event("_chunk_state_kernel", 100), event("_chunk_output_kernel", 300), event("_chunk_state_kernel", 100),
              event("_chunk_output_kernel", 300)]
    assert per_name_ms(events, runs=2) == {"_chunk_output_kernel": 0.3, "_chunk_state_kernel": 0.1}
    assert list(per_name_ms(events, runs=2)) == ["_chunk_output_kernel", "_chunk_state_kernel"]


def test_functions_at_defines_a_module_s_functions_as_a_commit_has_them():
    """An A/B's "before" side (bench/results/*/..._ab.py): the function's source from git, defined
    over the module's names in a namespace of its own."""
    from bench.common import functions_at
    from ssm_kernels.adapters import mamba_ssm_compat as compat
    got = functions_at("HEAD", compat, ("_broadcast_along",))["_broadcast_along"]
    assert got is not compat._broadcast_along
    assert got.__code__.co_code == compat._broadcast_along.__code__.co_code
    assert got.__globals__["_broadcast_along"] is got and compat._broadcast_along is not got
