"""The incident demo: `ssm-prefill demo` / `python -m ssm_serving.demo` with tiny flags."""
import os
import re
import subprocess
import sys

import pytest
import torch

from ssm_serving import cli, demo

TINY = ["--scale", "256", "--layers", "2", "--hidden", "32", "--state-size", "8", "--vocab", "64"]


def table_rows(text, scan="recurrent"):
    """The rows of one scan's table, by policy."""
    rows, section = {}, None
    for line in text.splitlines():
        cells = line.split()
        if line.startswith(("recurrent scan", "chunked scan")):
            section = cells[0]
        elif cells and cells[0] in ("legacy", "split", "inpass", "free") and section == scan:
            rows[cells[0]] = cells
    return rows


def test_demo_reproduces_the_incident_shape(capsys):
    assert demo.main(TINY + ["--no-progress"]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert "132 tokens, block 16, first chunk 33, budget 32" in out
    # policy: cold passes, warm restore point, replayed tokens, bitwise (budget 32, total 132):
    # the seed's 8193+8192+..., 24577/8195, 32752/20 and 32768/4 at 1/256 scale.
    assert {p: (r[1], r[4], r[5], r[-1]) for p, r in rows.items()} == {
        "legacy": ("33+32+32+32+3", "97", "35", "yes"),
        "split": ("32+32+32+16+20", "112", "20", "yes"),
        "inpass": ("32+32+32+32+4", "128", "4", "yes"),
        "free": ("33+32+32+32+3", "128", "4", "yes"),
    }
    assert rows["inpass"][2] == "1"  # the split point, captured inside the fourth pass
    # The chunked scan (chunk 32 at this budget) plans on its grid: every policy's passes end on
    # multiples of 32, the warm request restores at the match, 128, and every logit is bitwise.
    assert "chunked scan, chunk 32: exact at multiples of 32" in out
    chunked = table_rows(out, "chunked")
    assert {p: (r[1], r[4], r[5], r[-1]) for p, r in chunked.items()} == {
        p: ("32+32+32+32+4", "128", "4", "yes") for p in ("legacy", "split", "inpass", "free")}


def test_cli_demo_subcommand_with_some_policies(capsys):
    threads = torch.get_num_threads()
    assert cli.main(["demo", *TINY, "--policies", "split", "free", "split", "--no-progress", "--attention-every", "0",
                     "--scans", "recurrent"]) == 0  # a policy given twice runs once
    assert torch.get_num_threads() == threads  # restored
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert sorted(rows) == ["free", "split"] and rows["free"][4:6] == ["128", "4"]
    assert sum(line.split()[:1] == ["split"] for line in out.splitlines()) == 1
    assert "chunked scan" not in out


def test_module_entry_point_shows_progress_on_stderr():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-m", "ssm_serving.demo", *TINY, "--policies", "inpass"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert table_rows(done.stdout)["inpass"][4:6] == ["128", "4"]
    assert "prefill" in done.stderr and "tok" in done.stderr


@pytest.mark.parametrize("argv, message", [
    (["--scale", "3"], "must be a power of two from 1 to 256"),
    (["--scale", "512"], "must be a power of two from 1 to 256"),
    (["--scale", "x"], "must be an int"),
    (["--scale", "8", "--full"], "not allowed with argument"),
    (["--policies", "eager"], "invalid choice"),
    (["--scans", "auto"], "invalid choice"),
    (["--layers", "0"], "must be >= 1"),
    (["--hidden", "30"], "must be a multiple of 16"),
    (["--attention-every", "-1"], "must be >= 0"),
    (["--state-size", "1000"], "argument --state-size: must be from 1 to 256, got 1000"),
    (["--state-size", "0"], "argument --state-size: must be from 1 to 256"),
    (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    # Sizes beyond the machine: usage errors before anything is built.
    (["--threads", "100000"], rf"argument --threads: must be from 1 to {os.cpu_count()}, got 100000"),
    (["--vocab", str(10**12)], "2 x vocab_size 1000000000000 x hidden_size 64 .* more than the limit"),
    (["--hidden", str(2**20)], "parameters .* more than the limit"),
    (["--layers", "100000"], "num_layers must be an int from 1 to 1024"),
    (["--seed", str(2**64)], "seed must be an int from 0 to"),
    (["--bogus"], "unrecognized arguments"),
])
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err
    assert re.search(message, err), err


def test_cli_demo_refuses_threads_beyond_the_machine(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--threads", "100000"])
    assert exit_info.value.code == 2
    assert "argument --threads: must be from 1 to" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--state-size", "1000"], "argument --state-size: must be from 1 to 256, got 1000"),
    (["--hidden", "8"], "argument --hidden: must be a multiple of 16")])
def test_cli_demo_bad_values_are_the_demo_s_usage_errors(argv, message, capsys):
    """Those checked after parsing too: the demo's usage line, not the console script's."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("usage: ssm-prefill demo")


def test_cli_needs_a_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2 and "usage: ssm-prefill" in capsys.readouterr().err
