"""The command line, through main() and once through ``python -m planner``."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from planner.cli import main

INCIDENT_ARGS = ["plan", "--total", "32772", "--block-size", "16", "--budget", "8192",
                 "--first-budget", "8193", "--interval", "32"]


def summary_rows(output):
    """The summary table's rows by policy, as lists of cells."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("policy"))
    return {line.split()[0]: line.split() for line in lines[start + 1:] if line.strip()}


def test_plan_prints_the_incident_for_all_policies(capsys):
    assert main(INCIDENT_ARGS) == 0
    out = capsys.readouterr().out
    rows = summary_rows(out)
    # policy, passes, extra, five pass ends, snapshots, restore, replay
    assert rows["legacy"][3:8] == ["8193", "16385", "24577", "32769", "32772"]
    assert rows["legacy"][-2:] == ["24577", "8195"]
    assert rows["split"][3:8] == ["8192", "16384", "24576", "32752", "32772"]
    assert rows["split"][-2:] == ["32752", "20"]
    assert rows["inpass"][3:8] == ["8192", "16384", "24576", "32768", "32772"]
    assert rows["inpass"][-2:] == ["32768", "4"]
    assert rows["free"][3:8] == ["8193", "16385", "24577", "32769", "32772"]
    assert rows["free"][-2:] == ["32768", "4"]
    assert all(row[2] == "0" for row in rows.values())  # no extra passes here
    assert "24576  32768    8192  32752" in out  # inpass: the fourth pass captures 32752


def test_plan_json_for_one_policy(capsys):
    assert main(["plan", "--total", "5000", "--policy", "inpass", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    passes = data["policies"]["inpass"]["passes"]
    assert [(p["start"], p["length"], p["captures"]) for p in passes] == [(0, 5000, [4976])]
    assert data["policies"]["inpass"]["warm"]["restore_point"] == 4976
    assert list(data["policies"]) == ["inpass"]


def test_plan_follow_up_and_branch_points(capsys):
    assert main(["plan", "--total", "1000", "--policy", "free", "--interval", "0",
                 "--branch-point", "480", "--shared-tokens", "490", "--request-total",
                 "2000"]) == 0
    out = capsys.readouterr().out
    assert "restore at 480, replay 1520" in out


def test_plan_shorter_follow_up_shares_all_its_tokens_by_default(capsys):
    assert main(["plan", "--total", "1000", "--policy", "split", "--interval", "1",
                 "--request-total", "500"]) == 0
    out = capsys.readouterr().out
    assert "warm request: follow-up, 500 tokens sharing 500, block-floored match 496" in out


def test_simulate_refuses_a_scale_beyond_the_trace_limit_at_once(capsys):
    began = time.perf_counter()
    assert main(["simulate", "--scale", "1000000", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "Traceback" not in err
    assert "default traces at scale 1000000" in err and "lower scale" in err
    assert time.perf_counter() - began < 1.0


def test_simulate_json(capsys):
    assert main(["simulate", "--trace", "chat", "--policy", "inpass", "--json",
                 "--max-snapshots", "8", "--no-progress"]) == 0
    data = json.loads(capsys.readouterr().out)
    (trace,) = data["traces"]
    assert trace["name"] == "chat"
    report = trace["policies"]["inpass"]
    assert report["totals"]["requests"] == trace["requests"] == len(report["requests"])
    assert report["totals"]["snapshots_held"] <= 8


def test_simulate_table(capsys):
    assert main(["simulate", "--trace", "agent", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "trace agent" in out
    assert [line.split()[0] for line in out.splitlines()[-4:]] == [
        "legacy", "split", "inpass", "free"]
    assert "snapshots unbounded (lru)" in out


def test_plan_on_a_grid_reports_the_tail_points_it_uses(capsys):
    assert main(INCIDENT_ARGS + ["--grid", "256", "--policy", "inpass", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    captures = [c for p in report["policies"]["inpass"]["passes"] for c in p["captures"]]
    assert report["tail_split_point"] == 32512 and captures == [32512]


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["plan"],  # --total is required
        ["plan", "--total", "-5"],
        ["plan", "--total", "abc"],
        ["plan", "--total", "100", "--block-size", "0"],
        ["plan", "--total", "100", "--policy", "fast"],
        ["plan", "--total", "100", "--branch-point", "200", "--policy", "free"],
        ["plan", "--total", "100", "--branch-point", "50", "--policy", "split"],
        ["plan", "--total", "100", "--start", "200"],
        ["plan", "--total", "100", "--shared-tokens", "200"],
        ["simulate", "--eviction", "fifo"],
        ["simulate", "--per-pass-ms", "-1"],
        ["simulate", "--per-pass-ms", "inf"],
        ["simulate", "--per-token-ms", "1e308"],  # its sums would overflow to inf
        ["simulate", "--scale", "0"],
        ["simulate", "--grid", "16", "--budget", "8", "--no-progress"],
        ["simulate", "--grid", "16384", "--budget", "16384", "--no-progress"],  # the first budget, 8193, below it
        ["plan", "--total", "0", "--shared-tokens", "5"],  # no prompt to follow up
        ["plan", "--total", "0", "--request-total", "3"],
        ["frobnicate"],
    ],
)
def test_bad_arguments_are_usage_errors(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, usage, message", [
    (["plan", "--total", "10", "--start", "11"], "usage: ssm-planner plan", "--start must be <= total (10)"),
    (["plan", "--total", "100", "--grid", "64", "--first-budget", "32"], "usage: ssm-planner plan",
     "--first-budget (32) must be at least the grid (64)"),
    (["simulate", "--grid", "16", "--budget", "8", "--no-progress"], "usage: ssm-planner simulate",
     "--budget (8) must be at least the grid (16)"),
])
def test_errors_found_after_parsing_speak_of_the_subcommand_s_flags(argv, usage, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert usage in err and f"error: {message}" in err


def test_python_dash_m_planner():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-m", "planner", *INCIDENT_ARGS], cwd=root, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "restore at 24577, replay 8195" in done.stdout
    assert "restore at 32752, replay 20" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "planner", "plan"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage:" in bad.stderr


def test_planner_imports_neither_torch_nor_numpy():
    root = Path(__file__).resolve().parents[1]
    code = ("import sys, planner, planner.cli; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
