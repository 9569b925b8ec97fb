"""The static cost report (python -m bench.static) at a tiny layer: it runs end to end, lists every
kernel the calls launch, reports what ptxas reports, finds the loops, and its counts and model
(the two-level memory term included) agree with figures computed here by hand. The model's own
rules are tested on their own in tools/triton_static/tests."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.common import REPO_ROOT as ROOT
from bench.static_workloads import model_selective_scan_fn
from bench.workloads import Mamba2Shape, decode_bytes

H, P, N, G = 4, 16, 32, 1  # every tile dimension a power of two >= 16: no padded block
E = 2  # bytes per bfloat16 input element
HBM, L2 = 4.3e12, 10e12  # bytes per second the model assumes (triton_static/model.py)
TOKENS, BATCH = 3072, 8  # chunked calls are counted at 2048 and 4096 tokens, the others at 64 and 128
LAYER = f"mamba2:nheads={H},headdim={P},dstate={N},ngroups={G}"
ABLATION = "ablation: no blocks below the diagonal (their loads, weights and matmuls)"
WORKLOADS = ("mamba2_scan recurrent", "mamba2_scan chunked + 8 captures", "selective_state_update", ABLATION)


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


def test_an_ablated_output_kernel_is_modelled_as_its_variant(report):
    """bench.output_variants' variant stands in for the output kernel: its loops are counted (the
    test above: the counting subprocess and the compiler read it from one path), it multiplies
    less than the real one, and the other kernels are the plain pass's binaries."""
    data, _, _ = report
    (ablated,) = calls(data, ABLATION)
    (plain,) = calls(data, "mamba2_scan chunked + 8 captures")
    kernels = lambda call: {e["kernel"]: e for e in chosen(call)}
    ours, real = kernels(ablated), kernels(plain)
    assert ours.keys() == real.keys()
    assert 0 < ours["_chunk_output_kernel"]["model"]["dot_flops"] < real["_chunk_output_kernel"]["model"]["dot_flops"]
    binary = lambda e: (e["registers"], e["spill_bytes"], e["shared_bytes"], e["mma"])
    assert all(binary(e) == binary(real[name]) for name, e in ours.items() if name != "_chunk_output_kernel")


def test_ablations_are_modelled_only_when_named():
    code = ("import argparse; from bench.static import plan; "
            "ask = lambda w: {j[0].name for j in plan(argparse.Namespace(workload=w, layer=None, shape=['2.7B'], "
            "tokens=[8192], batch=[64]))}; "
            "print(any(n.startswith('ablation') for n in ask(None)), all(n.startswith('ablation') for n in "
            "ask(['ablation'])), len(ask(['ablation'])))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    from bench.output_variants import VARIANTS
    edited = sum(1 for edits in VARIANTS.values() if edits)  # "unchanged" is the real kernel's row
    assert out.stdout.split() == ["False", "True", str(edited)], out.stderr[-2000:]


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


def test_a_loop_of_statements_over_several_lines_counts_its_iterations(report):
    """The output kernel's loop over the source blocks below the diagonal (its statements span
    lines, which Python reports again after each call) runs i_m times in row block i_m of a chunk:
    0..3 at chunk 256 and 64-row blocks, over the 4 programs per chunk and head of the grid's first axis."""
    data, _, _ = report
    (call,) = calls(data, "mamba2_scan chunked + 8 captures")
    (output,) = [e for e in chosen(call) if e["kernel"] == "_chunk_output_kernel"]
    chunks = TOKENS // 256
    assert output["grid"] == [4, H, chunks]
    assert "for k0 in range(0, m0, BLOCK_M)" in output["hot_loop"]["what"]
    assert output["hot_loop"]["iterations_per_program"] == pytest.approx(6 / 4, rel=1e-4)


def test_counts_extrapolate_to_what_the_kernels_must_do(report):
    data, _, _ = report
    (call,) = calls(data, "mamba2_scan chunked + 8 captures")
    kernels = {e["kernel"]: e for e in chosen(call)}
    # each chunk's contribution x^T (dt, decay) @ B: 2 P N flops per token and head; then the 8
    # captures' partial contributions whatever the pass length, the first j = 16 (2k + 1) tokens
    # of a chunk each, in whole blocks of BLOCK_K tokens (masked tokens still multiply)
    block = int(kernels["_chunk_state_kernel"]["constexprs"]["BLOCK_K"])
    tokens = TOKENS + sum(-(-16 * (2 * k + 1) // block) * block for k in range(8))
    assert kernels["_chunk_state_kernel"]["model"]["dot_flops"] == pytest.approx(2 * P * N * tokens * H, rel=1e-9)
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
            assert m["memory_ms"] == max(m["hbm_ms"], m["l2_ms"])
            assert m["hbm_ms"] == pytest.approx(m["hbm_bytes"] / HBM * 1e3, rel=1e-4)
            assert m["l2_ms"] == pytest.approx(m["bytes"] / L2 * 1e3, rel=1e-4)
            # at this size every re-read fits in L2: HBM moves each storage once, per kind of access
            once = sum(min(s.get("loaded", 0), s["size"]) + min(s.get("stored", 0), s["size"])
                       for s in e["storages"].values())
            assert m["l2_hit"] == 1 and m["hbm_bytes"] == pytest.approx(once, rel=1e-4) == m["unique_bytes"]
        assert call["time_ms"] == pytest.approx(sum(e["model"]["time_ms"] for e in chosen(call)), rel=1e-4)
        assert call["peer"]["available"] is False and call["ratio_to_peer"] is None


def test_memory_of_the_decode_step_by_hand(report):
    """HBM moves what the step must move (the state read and written, x, dt, B, C, y, the per-head
    parameters); L2 serves that plus B and C read again by every program of a row but the first,
    and A, D, dt_bias read by every program."""
    data, _, _ = report
    (call,) = calls(data, "selective_state_update")
    (step,) = chosen(call)
    m, grid = step["model"], step["grid"]
    must = decode_bytes(Mamba2Shape("tiny", H, P, N, G), BATCH, E)
    per_row = grid[1] * grid[2]  # programs per batch row
    requested = must + 2 * (per_row - 1) * BATCH * G * N * E + 3 * (m["programs"] - H) * 4
    assert m["hbm_bytes"] == pytest.approx(must, rel=1e-4)
    assert m["bytes"] == pytest.approx(requested, rel=1e-4)
    assert m["memory_ms"] == pytest.approx(max(must / HBM, requested / L2) * 1e3, rel=1e-4)


def test_memory_of_the_recurrent_scan_by_hand(report):
    """Every program reads all of its group's B and C, once per token: L2 serves each of them
    programs x (T x N) elements, HBM moves each once (the programs that share them are neighbours
    in launch order: heads on grid axis 1 after an axis 0 of 1); x is read and y written once,
    but for the loads ahead of the pass's end."""
    data, _, _ = report
    (call,) = calls(data, "mamba2_scan recurrent")
    (scan,) = [e for e in chosen(call) if e["kernel"] == "_scan_kernel"]
    m, storages = scan["model"], scan["storages"]
    size = TOKENS * G * N * E
    ahead = 4  # loads two iterations (4 tokens) ahead read the last token again at the end (unused)
    for name in ("B_ptr", "C_ptr"):
        assert storages[name]["loaded"] == pytest.approx(m["programs"] * (TOKENS + ahead) * N * E, rel=1e-4)
        assert storages[name]["size"] == pytest.approx(size, rel=1e-4)
    assert storages["x_ptr"]["loaded"] == pytest.approx((TOKENS + ahead) * H * P * E, rel=1e-4)
    assert storages["y_ptr"]["stored"] == pytest.approx(TOKENS * H * P * E, rel=1e-4)
    assert scan["grid"][0] == 1 and storages["B_ptr"]["reuse_stride"] == storages["C_ptr"]["reuse_stride"] == 1
    assert m["l2_hit"] == 1 and m["reread_far_bytes"] == 0
    # the last token read again: B, C by every program, x, and the dt table's fp32 pair per head
    again = ahead * (2 * m["programs"] * N * E + H * P * E + H * 2 * 4)
    assert m["bytes"] - m["hbm_bytes"] == pytest.approx(2 * (m["programs"] - 1) * size + again, rel=1e-4)


def test_the_mamba1_peer_by_the_same_rule():
    """mamba_ssm's selective_scan_fn, modelled from its algorithm at Mamba-1 2.8B (dim 5120, dstate
    16) and 8192 tokens: every channel's block reads B and C whole (from L2); HBM moves u, delta, z,
    B, C, A, D and delta_bias once and writes out, out_z and each 2048-token chunk's running state
    (float2 per channel and state entry)."""
    dim, n, t = 5120, 16, 8192
    chunks = t // 2048
    row = t * E
    unique = 3 * dim * row + 2 * n * row + dim * n * 4 + 2 * dim * 4 + 2 * dim * row + dim * chunks * n * 8
    requested = unique + 2 * (dim - 1) * n * row + dim * n * 4 * (chunks - 1)
    m = model_selective_scan_fn(t, dim, n)
    assert m["memory"]["hbm_bytes"] == pytest.approx(unique) and m["memory"]["bytes"] == pytest.approx(requested)
    assert m["terms_ms"]["memory"] == pytest.approx(max(unique / HBM, requested / L2) * 1e3)
    assert m["time_ms"] == max(m["terms_ms"].values())


def test_calibration_sets_each_measured_call_beside_the_model(tmp_path):
    """A GPU run's batch-1 passes against the report's calls (ours and the peer's), and against a
    report of the measured commit's kernels where there is one: the errors and the ratio to the
    peer, measured and modelled, by the model's time and by the serial estimate (each chosen
    launch's issue and latency terms added; a peer's configuration the model did not choose left
    out)."""
    from bench import static_calibration as sc

    def row(impl, algorithm, gpu_ms, ms, **kw):
        return dict(section="scan", status="ok", batch="1", model="Mamba-2 2.7B", kind="mamba2", seqlen=8192,
                    impl=impl, algorithm=algorithm, gpu_ms=gpu_ms, ms=ms, **kw)

    run = tmp_path / "2026-11-30-gpu"
    run.mkdir()
    (run / "scan.json").write_text(json.dumps({
        "label": "GPU: NVIDIA H200", "env": {"reduced": False, "commit": "1680d6f6c374"}, "captures": [
            dict(row("ssm_kernels", "chunked (chunk default)", 0.5, 0.6), section="captures", captures="8 grid")],
        "scan": [row("ssm_kernels", "recurrent", 4.0, 4.1), row("ssm_kernels", "chunked (chunk default)", 0.3, 0.5),
                 row("mamba_ssm", "chunked (SSD, chunk 256)", 0.4, 0.45), row("fla", "chunked (simple GLA)", 0.3, 0.3),
                 dict(row("ssm_kernels", "recurrent", 9.0, 9.0), batch="varlen 16")]}))

    def launch(serial, chosen=True):
        return {"kernel": "k", "chosen": chosen, "model": {"time_ms": serial / 2, "issue_ms": serial / 4,
                                                           "latency_ms": 3 * serial / 4}}

    def report(commit, recurrent, chunked, peer, serial):
        def call(workload, ms, peer_ms=None):
            return {"workload": workload, "shape": "Mamba-2 2.7B", "size": 8192, "time_ms": ms, "commit": commit,
                    "kernels": [launch(serial[0] / 2), launch(serial[0] / 2)],
                    "peer": {"available": peer_ms is not None, "time_ms": peer_ms, "ref": "peer"}}
        return {"calls": [call("mamba2_scan recurrent", recurrent), call("mamba2_scan chunked", chunked, peer),
                          call("mamba2_scan chunked + 8 grid captures", chunked * 2, peer)],
                "peer_calls": {"peer": {"kernels": [launch(serial[1]), launch(5.0, chosen=False)]}}}

    then = tmp_path / "2026-12-01-static-1680d6f"
    then.mkdir()
    (then / "static.json").write_text(json.dumps(report("1680d6f6c374aaaa", 3.0, 0.15, 0.2, (0.3, 0.32))))
    rows = {(r["workload"], r["peer"]): r for r in sc.rows(report("5e0f218", 2.0, 0.1, 0.2, (0.24, 0.32)), tmp_path)}
    assert set(rows) == {("mamba2_scan recurrent", False), ("mamba2_scan chunked", False),
                         ("mamba2_scan chunked", True), ("mamba2_scan chunked + 8 grid captures", False)}
    rec = rows["mamba2_scan recurrent", False]
    assert (rec["kernel_ms"], rec["call_ms"], rec["commit"], rec["run"]) == (4.0, 4.1, "1680d6f", "2026-11-30-gpu")
    assert rec["error"] == pytest.approx(2.0 / 4.0) and rec["error_then"] == pytest.approx(3.0 / 4.0)
    assert rows["mamba2_scan chunked", True]["error"] == pytest.approx(0.2 / 0.4)
    assert rows["mamba2_scan chunked + 8 grid captures", False]["error"] == pytest.approx(0.2 / 0.5)
    assert rows["mamba2_scan chunked", False]["serial_ms"] == pytest.approx(0.24)
    assert rows["mamba2_scan chunked", False]["serial_then_ms"] == pytest.approx(0.3)
    assert rows["mamba2_scan chunked", True]["serial_ms"] == pytest.approx(0.32)
    (ratio,) = sc.ratios(list(rows.values()))
    # measured; modelled then, / measured; report, / measured; serial then, / measured; report, / measured
    assert ratio[4:] == ["0.75", "0.75", "1", "0.5", "0.667", "0.938", "1.25", "0.75", "1"]
    assert ratio[3] == "1680d6f (2026-11-30-gpu, NVIDIA H200)"  # the GPU from the run's label
    now = report("5e0f218", 2.0, 0.1, 0.2, (0.24, 0.32))
    assert "measured at" in sc.table(now, tmp_path)
    assert "(no run recorded each kernel's time yet)" in sc.table(now, tmp_path)


def test_calibration_per_kernel(tmp_path):
    """A run that recorded each kernel's time (gpu_kernels) is set kernel by kernel beside the
    model's kernels, ours and the peer's (at the configuration the model chose), at the measured
    commit's report and at this one; copies and kernels the report does not model are left out."""
    from bench import static_calibration as sc

    run = tmp_path / "2026-12-05-gpu"
    run.mkdir()
    row = dict(section="scan", status="ok", batch="1", model="Mamba-2 2.7B", kind="mamba2", seqlen=8192)
    (run / "scan.json").write_text(json.dumps({
        "label": "GPU: NVIDIA H200", "env": {"reduced": False, "commit": "abc1234"}, "scan": [
            dict(row, impl="ssm_kernels", algorithm="chunked (chunk default)", gpu_ms=0.3, ms=0.4,
                 gpu_kernels={"_chunk_output_kernel": 0.2, "_chunk_state_kernel": 0.08, "Memcpy HtoD": 0.02}),
            dict(row, impl="mamba_ssm", algorithm="chunked (SSD, chunk 256)", gpu_ms=0.25, ms=0.3,
                 gpu_kernels={"_chunk_scan_fwd_kernel": 0.25})]}))

    def launch(name, ms, memory=1, chosen=True):
        return {"kernel": name, "chosen": chosen, "model": {"time_ms": ms, "issue_ms": ms, "latency_ms": ms,
                                                            "memory_ms": memory * ms}}

    def report(commit, output_ms, state_ms):
        # the chunk-state kernel's memory term above its issue and latency terms' sum: the serial estimate takes it
        kernels = [launch("_chunk_output_kernel", output_ms), launch("_chunk_state_kernel", state_ms, memory=3)]
        return {"calls": [{"workload": "mamba2_scan chunked", "shape": "Mamba-2 2.7B", "size": 8192, "commit": commit,
                           "time_ms": output_ms + state_ms, "kernels": kernels,
                           "peer": {"available": True, "time_ms": 0.1, "ref": "peer"}}],
                "peer_calls": {"peer": {"kernels": [launch("_chunk_scan_fwd_kernel", 0.1),
                                                    launch("_chunk_scan_fwd_kernel", 9.0, chosen=False)]}}}

    then = tmp_path / "2026-12-05-static-abc1234"
    then.mkdir()
    (then / "static.json").write_text(json.dumps(report("abc1234", 0.1, 0.04)))
    rows = sc.kernel_rows(report("def5678", 0.05, 0.04), tmp_path)
    # kernel, measured; modelled then, / measured; report, / measured; serial then, / measured; report, / measured
    assert [r[4:] for r in rows] == [
        ["`_chunk_output_kernel`", "0.2", "0.1", "0.5", "0.05", "0.25", "0.2", "1", "0.1", "0.5"],
        ["`_chunk_state_kernel`", "0.08", "0.04", "0.5", "0.04", "0.5", "0.12", "1.5", "0.12", "1.5"],
        ["`_chunk_scan_fwd_kernel`", "0.25", "0.1", "0.4", "0.1", "0.4", "0.2", "0.8", "0.2", "0.8"]]
    assert rows[-1][0] == "`mamba2_scan chunked` peer (mamba_ssm)"
    assert "`_chunk_output_kernel`" in sc.table(report("def5678", 0.05, 0.04), tmp_path)


def test_one_launch_floor_by_hand():
    """The chunked pass as one launch, at best: stage 1's time, the walk left out, every other
    kernel's programs x latency cycles a program over (the output kernel's residency x SMs), and
    the ratio to the peer; a call without a peer figure is left out."""
    from bench.static_report import one_launch_floor

    def kernel(name, programs, cycles, time_ms, resident=3):
        return {"kernel": name, "chosen": True, "model": {
            "programs": programs, "latency_cycles_per_program": cycles, "time_ms": time_ms,
            "occupancy": {"programs": resident}}}

    kernels = [kernel("_dt_cumsum_kernel", 10, 1e9, 0.004), kernel("_chunk_cb_kernel", 20, 1000.0, 1.0),
               kernel("_chunk_state_kernel", 40, 2000.0, 1.0), kernel("_state_passing_kernel", 8, 1e9, 1.0),
               kernel("_chunk_output_kernel", 80, 3000.0, 1.0)]
    call = {"workload": "mamba2_scan chunked", "shape": "S", "size": 8192, "time_ms": 0.5, "kernels": kernels,
            "peer": {"available": True, "time_ms": 0.25}}
    data = {"gpu_model": {"sms": 2, "clock_hz": 1e9}, "model_version": "m", "calls": [
        call, {**call, "size": 32768, "peer": {"available": False}}, {**call, "workload": "mamba2_scan recurrent"}]}
    slots = 3 * 2
    output = 80 * 3000 / slots / 1e9 * 1e3
    total = 0.004 + (20 * 1000 + 40 * 2000) / slots / 1e9 * 1e3 + output
    (row,) = one_launch_floor(data).splitlines()[2:]
    assert row.split() == ["S", "8192", "0.5", f"{total:.3g}", f"{total / 0.25:.3g}", f"{output:.3g}",
                           f"{output / 0.25:.3g}", "0.25"]


def test_captures_block_by_hand():
    """What captures cost: each capture kind's added time as a share of its path's pass and over
    8 states' bytes at HBM bandwidth (float32 for mamba2_scan, bfloat16 into the engine's cache);
    a kind the report lacks is "-"."""
    from bench.static_report import captures_block
    from bench.static_workloads import SHAPES

    shape = "Mamba-2 2.7B"
    dims = SHAPES[shape]
    state_bytes = 8 * dims.nheads * dims.headdim * dims.dstate
    hbm = 1e12
    peer = {"available": True, "time_ms": 1.0}

    def call(workload, ms):
        return {"workload": workload, "shape": shape, "size": 8192, "time_ms": ms, "peer": peer}

    fp32_ms, bf16_ms = state_bytes * 4 / hbm * 1e3, state_bytes * 2 / hbm * 1e3
    data = {"gpu_model": {"hbm_bytes_per_s": hbm}, "date": "d", "commit": {"commit": "abc"}, "model_version": "m",
            "calls": [call("mamba2_scan chunked", 0.5), call("mamba2_scan chunked + 8 captures", 0.5 + 2 * fp32_ms),
                      call("mamba2_scan chunked + 8 grid captures", 0.5 + fp32_ms),
                      call("mamba2_prefill chunked, bf16 cache", 0.4),
                      call("mamba2_prefill chunked, bf16 cache + 8 captures", 0.4 + 3 * bf16_ms)]}
    rows = [line.split(" | ") for line in captures_block(data).splitlines()[4:]]
    assert [r[2:6] for r in rows] == [
        ["`mamba2_scan chunked`", "0.5", f"{0.5 + 2 * fp32_ms:.3g} (+{200 * fp32_ms / 0.5:.1f}%; 2x)",
         f"{0.5 + fp32_ms:.3g} (+{100 * fp32_ms / 0.5:.1f}%; 1x)"],
        ["`mamba2_prefill chunked, bf16 cache`", "0.4", f"{0.4 + 3 * bf16_ms:.3g} (+{300 * bf16_ms / 0.4:.1f}%; 3x)",
         "-"]]
    assert [r[6] for r in rows] == [f"{fp32_ms * 1e3:.3g}", f"{bf16_ms * 1e3:.3g}"]


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _running(pid: int) -> bool:
    """Whether pid is a live process (not gone, not a zombie left unreaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads process children from Linux's /proc")
def test_a_killed_report_ends_its_counting_subprocess(tmp_path):
    """bench.static counts in a subprocess: a `kill` (SIGTERM) of the report must end that one
    too, not leave it counting on for minutes. The report's own run is a count that waits."""
    toy = ROOT / "tools" / "triton_static" / "tests"
    script = ("import sys; from unittest import mock; import bench.static as S; from triton_static import counts\n"
              f"with mock.patch.object(S, 'run', lambda args: counts.count([{{'sizes': [1]}}], 'toy_kernels:wait', "
              f"cwd={str(toy)!r})):\n    S.main(['--no-peers', '--out', {str(tmp_path)!r}])\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    report = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 120
        while not _children(report.pid):
            assert time.monotonic() < deadline and report.poll() is None, "no counting subprocess started"
            time.sleep(0.1)
        (child,) = _children(report.pid)
        time.sleep(2)  # the subprocess is in its runner
        assert _running(child)
        report.terminate()
        assert report.wait(timeout=30) != 0
        deadline = time.monotonic() + 15
        while _running(child):
            assert time.monotonic() < deadline, "the counting subprocess outlived the report"
            time.sleep(0.2)
    finally:
        report.kill()
        report.wait()
