"""The engine ops' host work per layer call (python -m bench.host): a step's later layers launch
what they must and allocate nothing where the step's first layer built the step's tensors."""
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
    proc = subprocess.run([sys.executable, "-m", "bench.host", "--layers", "3", "--repeats", "5", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| mamba2_prefill chunked |" in (out / "host.md").read_text()
    return {row["op"]: row for row in json.loads((out / "host.json").read_text())["rows"]}


# op: (launches, torch kernels, allocations) of a later layer's call
LATER = {
    "mamba2_prefill recurrent": (2, 1, 1),  # the dt table, allocated per call
    "mamba2_prefill chunked": (5, 0, 0),  # the kernels read and write the slots themselves
    "mamba1_prefill recurrent": (1, 0, 0),
    "mamba1_prefill chunked": (2, 0, 0),  # likewise
    "conv_prefill": (1, 0, 0),
    "mamba2_decode": (1, 0, 0),
}


@pytest.mark.parametrize("op", LATER)
def test_a_later_layers_launches_torch_kernels_and_allocations(rows, op):
    later = rows[op]["later"]
    assert (later["launches"], later["torch_kernels"], later["allocations"]) == LATER[op]
    assert later["us"] > later["binding_us"] >= 0


def test_the_chunked_path_builds_the_steps_tensors_in_its_first_layer(rows):
    assert rows["mamba2_prefill chunked"]["first"]["allocations"] > 0
    assert rows["mamba2_prefill chunked"]["later"]["allocations"] == 0
