"""The plugin's start-up decisions, without serving: its settings and the hooks only some vLLM
releases have. Nothing here leaves vLLM patched in the test process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

import ssm_serving.vllm_plugin as plugin


@pytest.fixture
def fresh(monkeypatch, caplog):
    """install() as on a fresh process; the plugin's log in caplog."""
    monkeypatch.setitem(plugin._state, "installed", False)
    plugin.logger.addHandler(caplog.handler)  # vLLM's logger tree may not propagate to the root
    yield caplog
    plugin.logger.removeHandler(caplog.handler)


@pytest.mark.parametrize("name, value", [("SSM_KERNELS_VLLM_PREFILL_ALGORITHM", "ssd"),
                                         ("SSM_KERNELS_VLLM_CAPTURE_INTERVAL", "-64"),
                                         ("SSM_KERNELS_VLLM", "maybe"), ("SSM_KERNELS_FUSED_SSD", "2")])
def test_a_bad_setting_fails_install(monkeypatch, fresh, name, value):
    """The entry point vLLM calls before it builds an engine raises, naming the setting, and
    patches nothing."""
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

    before = MambaMixer2.conv_ssm_forward
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        plugin.install()
    assert MambaMixer2.conv_ssm_forward is before and not plugin.status()["installed"]
    assert name in plugin.status()["reason"]


def test_a_bad_setting_stops_vllm_loading_its_plugins():
    """As vLLM loads plugins before it builds an engine: the entry point raises (vLLM would log an
    exception raised while importing the plugin's package and go on without it)."""
    env = dict(os.environ, SSM_KERNELS_FUSED_SSD="2")
    load = "from vllm.plugins import load_general_plugins; load_general_plugins()"
    run = subprocess.run([sys.executable, "-c", load], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode != 0 and "SSM_KERNELS_FUSED_SSD must be 0 or 1, got '2'" in run.stderr, run.stderr[-2000:]


def test_engine_start_checks_the_capture_interval(monkeypatch):
    """The block-size part, at the Mamba layers' kv-cache spec: prefix caching ("align") only."""
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    from ssm_serving.vllm_plugin import settings

    monkeypatch.setattr(settings, "current", settings.Settings(capture_interval=100))
    config = SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=True, prefix_match_unit=None))
    spec = dict(block_size=64, shapes=((4, 3),), dtypes=(torch.float32,))
    with pytest.raises(ValueError, match="SSM_KERNELS_VLLM_CAPTURE_INTERVAL must be 0 or a positive multiple of "
                                         "the Mamba block size 64, got 100"):
        plugin.check_engine(config, MambaSpec(**spec, mamba_cache_mode="align"))
    plugin.check_engine(config, MambaSpec(**spec, mamba_cache_mode="none"))  # no captures without caching
    monkeypatch.setattr(settings, "current", settings.Settings(capture_interval=128))
    plugin.check_engine(config, MambaSpec(**spec, mamba_cache_mode="align"))


def test_engine_start_refuses_prefix_hits_inside_a_block():
    """prefix_match_unit below the block size: refused (warm requests resuming inside a block gave
    other tokens than cold ones on the CPU build); equal to it, or without prefix caching, served."""
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    spec = MambaSpec(block_size=64, shapes=((4, 3),), dtypes=(torch.float32,), mamba_cache_mode="align")
    config = lambda caching, unit: SimpleNamespace(cache_config=SimpleNamespace(
        enable_prefix_caching=caching, prefix_match_unit=unit))
    with pytest.raises(ValueError, match="prefix_match_unit=16 below the Mamba block size 64 .* SSM_KERNELS_VLLM=0"):
        plugin.check_engine(config(True, 16), spec)
    for caching, unit in ((True, None), (True, 64), (False, 16)):
        plugin.check_engine(config(caching, unit), spec)


@pytest.mark.parametrize("why", ["ReplaySSM", "LoRA"])
def test_engine_start_refuses_a_layer_on_vllms_forward_with_captures(monkeypatch, why):
    """A Mamba layer that runs vLLM's own forward (ReplaySSM on Mamba-2, LoRA on Mamba-1) writes no
    block-end capture: with captures on (the default), refused at engine start; with vLLM's own
    policy (interval 0), or without prefix caching, served."""
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    from ssm_serving.vllm_plugin import settings

    spec = MambaSpec(block_size=64, shapes=((4, 3),), dtypes=(torch.float32,), mamba_cache_mode="align")
    config = lambda caching: SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=caching,
                                                                          prefix_match_unit=None))
    monkeypatch.setattr(settings, "current", settings.Settings())
    with pytest.raises(ValueError, match=f"with {why} a Mamba layer runs vLLM's own forward.*"
                                         "SSM_KERNELS_VLLM_CAPTURE_INTERVAL=0 .* SSM_KERNELS_VLLM=0"):
        plugin.check_engine(config(True), spec, why)
    plugin.check_engine(config(True), spec)  # the plugin's own forward
    plugin.check_engine(config(False), spec, why)
    monkeypatch.setattr(settings, "current", settings.Settings(capture_interval=0))
    plugin.check_engine(config(True), spec, why)


_ALIGNMENT = """
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_mixer import MambaMixer
import ssm_serving.vllm_plugin as plugin
if not hasattr(MambaBase, "get_prefill_checkpoint_alignment"):  # vLLM 0.32: the 0.33 hook, as 0.33 has it
    MambaBase.get_prefill_checkpoint_alignment = lambda self: None
assert plugin.install(), plugin.status()
layer = MambaMixer.__new__(MambaMixer)
answers = []
for lora in (False, True):
    layer.__dict__["is_lora_enabled"] = lora
    answers.append(layer.get_prefill_checkpoint_alignment())
print(answers)
"""


def test_mamba1_answers_checkpoint_alignment_1():
    """vLLM 0.33's MambaBase.get_prefill_checkpoint_alignment(): a Mamba-1 layer on the plugin's
    kernels exports its checkpoint at any token (1), as its kv-cache spec says; with LoRA (vLLM's
    own path) None."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SSM_KERNELS_VLLM")}
    out = subprocess.run([sys.executable, "-c", _ALIGNMENT], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1].replace("None", "null")) == [1, None]
