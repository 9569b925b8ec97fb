"""The static cost report (python -m bench.static) at a tiny layer: it runs end to end, lists every
kernel the calls launch, reports what ptxas reports, finds the loops, and its counts and model
agree with figures computed here by hand."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
H, P, N, G = 4, 16, 32, 1  # every tile dimension a power of two >= 16: no padded block
TOKENS, BATCH = 3072, 8  # chunked calls are counted at 2048 and 4096 tokens, the others at 64 and 128
LAYER = f"mamba2:nheads={H},headdim={P},dstate={N},ngroups={G}"
WORKLOADS = ("mamba2_scan recurrent", "mamba2_scan chunked + 8 captures", "selective_state_update")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("static")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    cmd = [sys.executable, "-m", "bench.static", "--layer", LAYER, "--tokens", str(TOKENS), "--batch", str(BATCH),
           "--no-peers", "--out", str(out)]
    for w in WORKLOADS:
        cmd += ["--workload", w]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "static.json").read_text()), (out / "static.md").read_text(), proc.stdout


def calls(data, name):
    return [c for c in data["calls"] if c["workload"] == name]


def chosen(call):
    return [e for e in call["kernels"] if e["chosen"]]


def launched_kernels(fn) -> list[str]:
    """Names of the kernels `fn` launches, recorded while it runs through the interpreter here."""
    from triton.runtime.interpreter import InterpretedFunction
    names, run = [], InterpretedFunction.run

    def recording_run(self, *args, **kwargs):
        names.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    InterpretedFunction.run = recording_run
    try:
        fn()
    finally:
        InterpretedFunction.run = run
    return names


def test_every_file_is_labelled_and_the_summary_comes_last(report):
    data, md, stdout = report
    assert data["label"] == "static model, not measured"
    assert "static model, not measured" in md
    summary = stdout[stdout.index("== bench.static: static model, not measured"):]
    assert all(name in summary for name in WORKLOADS) and "written to" in summary.splitlines()[-1]
    assert data["triton"] and data["date"] and "commit" in data["commit"]
    assert sorted({c["workload"] for c in data["calls"]}) == sorted(WORKLOADS)


def test_every_launched_kernel_is_listed(report):
    from ssm_kernels import mamba2_scan, selective_state_update
    data, _, _ = report
    x, dt, B = torch.randn(1, 64, H, P), torch.randn(1, 64, H), torch.randn(1, 64, G, N)
    runs = {
        "mamba2_scan recurrent": lambda: mamba2_scan(x, dt, -torch.rand(H), B, B, D=torch.ones(H), backend="triton"),
        "mamba2_scan chunked + 8 captures": lambda: mamba2_scan(
            x, dt, -torch.rand(H), B, B, capture=[(0, 5)], backend="triton", algorithm="chunked", chunk_size=16),
        "selective_state_update": lambda: selective_state_update(
            torch.zeros(2, H, P, N), x[0, :2], dt[0, :2], -torch.rand(H), B[0, :2], B[0, :2], backend="triton"),
    }
    for name, fn in runs.items():
        (call,) = calls(data, name)
        assert [e["kernel"] for e in chosen(call)] == launched_kernels(fn), name


def test_every_loop_was_counted(report):
    data, _, stdout = report
    for call in data["calls"]:
        for e in call["kernels"]:
            assert all(lp["iterations_per_program"] is not None for lp in e["model"]["loops"]), e["label"]
    assert "WARNING" not in stdout


def test_registers_are_the_binaries_and_ptxas_reports_the_same(report):
    data, _, _ = report
    for call in data["calls"]:
        for e in call["kernels"]:
            assert e["registers"] == e["ptxas_registers"] > 0, e["label"]
            assert e["spill_bytes"] == 0 and e["num_warps"] >= 1, e["label"]


def test_the_recurrent_hot_loop_is_the_token_loop(report):
    data, _, _ = report
    (call,) = calls(data, "mamba2_scan recurrent")
    (scan,) = [e for e in chosen(call) if e["kernel"] == "_scan_kernel"]  # after the dt table
    hot = scan["hot_loop"]
    assert hot["instructions"] > 50 and hot["mix"]["total"] == hot["instructions"]
    assert hot["iterations_per_program"] == pytest.approx(TOKENS / 2, rel=1e-6)  # two tokens an iteration
    assert f"{TOKENS // 2} iterations/program" in hot["what"] and "triton_kernel.py" in hot["what"]
    assert scan["mma"] == "none" and scan["model"]["dot_flops"] == 0


def test_counts_extrapolate_to_what_the_kernels_must_do(report):
    data, _, _ = report
    (call,) = calls(data, "mamba2_scan chunked + 8 captures")
    kernels = {e["kernel"]: e for e in chosen(call)}
    # each chunk's contribution x^T (dt, decay) @ B: 2 P N flops per token and head
    assert kernels["_chunk_state_kernel"]["model"]["dot_flops"] == pytest.approx(2 * P * N * TOKENS * H, rel=1e-9)
    # the capture kernel works on 8 captures whatever the pass length, the first j = 16 (2k + 1)
    # tokens of a chunk each, in whole blocks of BLOCK_K tokens (masked tokens still multiply)
    block = int(kernels["_capture_kernel"]["constexprs"]["BLOCK_K"])
    tokens = sum(-(-16 * (2 * k + 1) // block) * block for k in range(8))
    assert kernels["_capture_kernel"]["model"]["dot_flops"] == pytest.approx(2 * P * N * tokens * H, rel=1e-9)
    (decode,) = calls(data, "selective_state_update")
    (step,) = chosen(decode)
    state_bytes = BATCH * H * P * N * 4
    assert step["model"]["bytes"] >= 2 * state_bytes and step["model"]["unique_bytes"] >= 2 * state_bytes


def test_each_time_is_the_largest_term_and_a_call_sums_its_kernels(report):
    data, _, _ = report
    for call in data["calls"]:
        for e in call["kernels"]:
            m = e["model"]
            terms = {k: m[f"{k}_ms"] for k in ("memory", "tensor", "issue", "latency")}
            assert m["time_ms"] == max(terms.values()) and terms[m["bound"]] == m["time_ms"] > 0
            assert m["memory_ms"] >= m["unique_memory_ms"]
        assert call["time_ms"] == pytest.approx(sum(e["model"]["time_ms"] for e in chosen(call)))
        assert call["peer"]["available"] is False and call["ratio_to_peer"] is None
