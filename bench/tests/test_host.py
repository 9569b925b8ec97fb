"""The engine ops' host work per layer call (python -m bench.host): a step's later layers replay
the launches its first two recorded, and run nothing else: no torch kernel, view or allocation.
The public chunked scan's later layers take the chunk tables its first layer made; the public
calls' later layers replay the launches their second and third recorded."""
import json
import os
import subprocess
import sys

import pytest

from bench.common import REPO_ROOT as ROOT


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("host")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "bench.host", "--layers", "5", "--repeats", "5", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| mamba2_prefill chunked |" in (out / "host.md").read_text()
    return {row["op"]: row for row in json.loads((out / "host.json").read_text())["rows"]}


# op: launches of a layer's call
LAUNCHES = {
    "mamba2_prefill recurrent": 2,  # the dt table, then the scan
    "mamba2_prefill chunked": 6,  # five stages and the output kernel's fix-up, reading and writing the slots
    "mamba1_prefill recurrent": 1,
    "mamba1_prefill chunked": 2,  # likewise
    "conv_prefill": 1,
    "mamba2_decode": 1,
}


@pytest.mark.parametrize("op", LAUNCHES)
def test_a_later_layer_launches_and_runs_nothing_else(rows, op):
    for part in ("first", "second", "later"):
        assert rows[op][part]["launches"] == LAUNCHES[op], part
    later = rows[op]["later"]
    assert (later["torch_kernels"], later["views"], later["allocations"]) == (0, 0, 0)
    assert rows[op]["second"]["allocations"] == 0  # what a layer needs beyond its outputs is the step's
    assert rows[op]["first"]["us"] > later["us"] >= later["first_launch_us"] > 0


def test_the_chunked_path_builds_the_steps_tensors_in_its_first_layer(rows):
    assert rows["mamba2_prefill chunked"]["first"]["allocations"] > 0
    assert rows["mamba2_prefill chunked"]["later"]["allocations"] == 0


def test_the_public_chunked_scan_plans_in_its_first_layer_and_replays_from_its_fourth(rows):
    """The first layer's call plans and copies the chunk tables (their views of the one copy); the
    second and third record their launches; the later layers' calls replay them: their outputs
    and a new workspace allocated (as many allocations as a call that runs the stages), no other
    torch kernel, and fewer views than a recording call."""
    chunked = rows["mamba2_scan chunked"]
    assert all(chunked[part]["launches"] == 6 for part in ("first", "second", "third", "later"))
    assert chunked["first"]["views"] > chunked["third"]["views"] > chunked["later"]["views"]
    later = chunked["later"]
    assert later["allocations"] == chunked["third"]["allocations"] == later["torch_kernels"]
    assert later["us"] < chunked["third"]["us"]


@pytest.mark.parametrize("op", ["mamba2_scan recurrent", "mamba1_scan chunked", "selective_state_update",
                                "causal_conv1d_update"])
def test_the_other_public_calls_replay_from_their_fourth(rows, op):
    """The recurrent, Mamba-1 chunked and conv kernels' public calls record in their second and third
    layers and replay in the later ones: their outputs (and a prefill's scratch) allocated, no other
    torch kernel, no more views, less time."""
    row = rows[op]
    assert all(row[part]["launches"] == (2 if "scan" in op else 1) for part in ("first", "second", "third", "later"))
    later = row["later"]
    assert row["third"]["views"] >= later["views"]
    assert later["allocations"] == row["third"]["allocations"] == later["torch_kernels"]
    assert later["us"] < row["third"]["us"]
