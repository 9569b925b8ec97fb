"""The vLLM plugin's table of expectations and its source checker (ssm_serving.vllm_plugin.compat),
on small source trees written here: no vLLM needed (tests_vllm checks the installed vLLM)."""
from __future__ import annotations

import textwrap

import pytest

from ssm_serving.vllm_plugin import compat
from ssm_serving.vllm_plugin.compat import Expect, SourceTree

FILES = {
    "vllm/__init__.py": "",
    "vllm/_version.py": "__version__ = version = '0.33.0'\n",
    "vllm/base.py": """
        from dataclasses import dataclass
        from typing import Generic, TypeVar
        M = TypeVar("M")

        class Base(Generic[M]):
            kv_cache: tuple

            def __init__(self, prefix):
                self.prefix = prefix
                self.register_buffer("weights", None)

            def hook(self):
                return None

        @dataclass
        class BaseMeta:
            num_prefills: int
        """,
    "vllm/layer.py": """
        from typing import TYPE_CHECKING
        from .base import Base, BaseMeta
        if TYPE_CHECKING:
            FLAG: bool = False

        class Layer(Base[int]):
            def forward(self, hidden_states, output, *, fast=False, **kwargs):
                self.A, (self.B, self.C) = 1, (2, 3)
                return self.flag_reader.shared_prefix_boundary

            @classmethod
            def mask(cls, start, end):
                return None

        class Meta(BaseMeta):
            chunk_size: int = 0

        def helper(data, device=None):
            return data

        PAD = -1
        NULL: int = 0
        SIZE = 2 * 8
        """,
    "vllm/reexport.py": "from vllm.layer import Layer as Renamed, helper\n",
}


@pytest.fixture
def tree(tmp_path):
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    return SourceTree.at(tmp_path)


@pytest.mark.parametrize("expect", [
    Expect("vllm.layer", "Layer", "forward", ("self", "hidden_states", "output", "fast", "**kwargs"),
           attrs=("prefix", "kv_cache", "weights", "A", "B", "C", "hook", "mask"), uses=("shared_prefix_boundary",)),
    Expect("vllm.layer", "Layer", "mask", ("cls", "start", "end")),
    Expect("vllm.layer", "Layer", "hook", ("self",)),  # inherited
    Expect("vllm.layer", "Layer", "not_yet", ("self",), optional=True),  # a hook a newer release adds
    Expect("vllm.layer", "Meta", attrs=("num_prefills", "chunk_size")),  # dataclass fields, inherited too
    Expect("vllm.layer", "helper", params=("data", "device")),
    Expect("vllm.layer", "helper", params=("data",), other_params=(("x",), ("data", "device"))),  # another release's
    Expect("vllm.layer", "FLAG"),  # declared under `if TYPE_CHECKING:`
    Expect("vllm.reexport", "Renamed", "forward", attrs=("prefix",)),  # through `import ... as`
    Expect("vllm.reexport", "helper", params=("data", "device")),
    Expect("vllm.layer", "PAD", value=-1),  # a constant's literal
    Expect("vllm.layer", "NULL", value=0),
])
def test_what_the_source_has_passes(tree, expect):
    assert tree.check(expect) is None


@pytest.mark.parametrize("expect, message", [
    (Expect("vllm.layer", "Layer", "forward", ("self", "hidden_states", "out", "fast", "**kwargs")),
     "parameters (self, hidden_states, output, fast, **kwargs), expected (self, hidden_states, out, fast, **kwargs)"),
    (Expect("vllm.layer", "Layer", "forward", ("self", "hidden_states", "output")), "parameters"),
    (Expect("vllm.layer", "Layer", "forward", attrs=("prefix", "conv_weights", "D")), "no longer has conv_weights, D"),
    (Expect("vllm.layer", "Layer", "forward", uses=("num_computed_tokens",)), "no longer reads num_computed_tokens"),
    (Expect("vllm.layer", "Layer", "backward"), "no such method"),
    (Expect("vllm.layer", "Meta", attrs=("checkpoint_meta",)), "no longer has checkpoint_meta"),
    (Expect("vllm.layer", "Gone"), "Gone is not defined in vllm.layer"),
    (Expect("vllm.moved", "Layer"), "Layer is not defined in vllm.moved"),
    (Expect("vllm.layer", "helper", params=("data",)), "parameters (data, device)"),
    (Expect("vllm.layer", "helper", params=("data",), other_params=(("device", "data"),)), "parameters (data, device)"),
    (Expect("vllm.layer", "FLAG", params=()), "not a function"),
    (Expect("vllm.layer", "PAD", value=0), "no longer the literal 0"),
    (Expect("vllm.layer", "SIZE", value=16), "no longer the literal 16"),  # not a literal: unknown
    (Expect("vllm.layer", "helper", value=1), "no longer the literal 1"),
])
def test_each_difference_is_named(tree, expect, message):
    problem = tree.check(expect)
    assert problem is not None and message in problem, problem


def test_version_gate(tree, monkeypatch):
    monkeypatch.setattr(compat, "EXPECTED", ())
    assert tree.version() == "0.33.0"
    assert compat.problems(tree, "0.33.0") == [] and compat.problems(tree, "0.32.1") == []
    assert compat.problems(tree, "0.34.0") == []
    assert "0.35.0 is not a version" in compat.problems(tree, "0.35.0")[0]
    assert "0.3.0 is not a version" in compat.problems(tree, "0.3.0")[0]
    assert "None is not a version" in compat.problems(tree, None)[0]


def test_cli_fails_on_a_mismatch(tree, tmp_path, monkeypatch, capsys):
    forward = Expect("vllm.layer", "Layer", "forward", ("self", "hidden_states", "output", "fast", "**kwargs"))
    monkeypatch.setattr(compat, "EXPECTED", (forward,))
    assert compat.main([str(tmp_path)]) == 0
    assert "vLLM 0.33.0: 1 expectations, 0 mismatches" in capsys.readouterr().out
    monkeypatch.setattr(compat, "EXPECTED", compat.EXPECTED + (Expect("vllm.layer", "Layer", attrs=("gone",)),))
    assert compat.main([str(tmp_path)]) == 1
    assert "MISMATCH vllm.layer.Layer: Layer no longer has gone" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        compat.main([str(tmp_path / "vllm")])  # no vllm/ under it


def test_the_table_lists_each_patch_once():
    keys = [(e.module, e.name, e.method) for e in compat.EXPECTED]
    assert len(keys) == len(set(keys))
