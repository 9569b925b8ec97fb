"""End to end on vLLM: tiny random hybrid models saved locally, prefix caching on, a token budget
that splits a prefill into several passes; cold, warm, branch and second-turn requests must give
transformers' greedy tokens and log-probs, and the warm and branch requests must hit the cache."""
from __future__ import annotations

import pytest
from vllm_child import MODEL_RUNNER, serve

from bench import vllm as bv

MAX_TOKENS = 8
# Log-probs of the cached requests against the same requests served without prefix caching: a
# hybrid's attention over a cached prefix runs other kernels than over a whole prompt (rounding);
# a model without attention gives the same bits (a float32 state cache, the recurrent scan).
CACHE_TOL = 1e-5
SSM_ONLY = ("mamba",)
# and against transformers in float64. vLLM's float32 forward (attention, matmuls) differs from it
# by up to 1.2e-5 on this traffic with vLLM's own kernels and prefix caching off (the second
# branch's fifth token), so 1e-5 is not attainable for vLLM itself; this bound is 4x that.
TRANSFORMERS_TOL = 5e-5


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {kind: bv.build_model(kind, root / kind) for kind in bv.MODELS}


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


def _served(model, workdir, config="plugin-align"):
    """One round of traffic through the plugin: its requests, each checked against transformers'
    greedy tokens and float64 log-probs."""
    res = bv.run_config(model, config, rounds=1, max_tokens=MAX_TOKENS, workdir=workdir)
    assert res["error"] is None, res.get("traceback") or res["error"]
    assert res["plugin_status"]["installed"], res["plugin_status"]
    assert res["model_runner"] == MODEL_RUNNER
    reqs = res["rounds"][0]
    for name, req in reqs.items():
        tokens, logprobs = bv.transformers_greedy(model, req["prompt"], MAX_TOKENS)
        assert req["tokens"] == tokens, f"{name}: vLLM {req['tokens']} != transformers {tokens}"
        worst = max(abs(a - b) for a, b in zip(req["logprobs"], logprobs))
        assert worst <= TRANSFORMERS_TOL, f"{name}: log-probs differ from transformers' by {worst:.2e}"
    return res


@pytest.mark.parametrize("kind", bv.MODELS)
def test_plugin_serves_transformers_tokens_with_cache_hits(kind, models, workdir):
    res = _served(models[kind], workdir)
    assert res["plugin_status"]["prefill_algorithm"] == "auto"  # on CPU: the recurrent scan
    uncached = bv.run_config(models[kind], "plugin-none", rounds=1, max_tokens=MAX_TOKENS, workdir=workdir)
    assert uncached["error"] is None, uncached.get("traceback") or uncached["error"]
    reqs = res["rounds"][0]
    for name, req in reqs.items():
        tokens = req["tokens"]
        plain = uncached["rounds"][0][name]
        assert plain["tokens"] == tokens and plain["cached"] == 0
        if kind in SSM_ONLY:
            assert req["logprobs"] == plain["logprobs"], f"{name}: log-probs with the cache are not the same bits"
        worst = max(abs(a - b) for a, b in zip(req["logprobs"], plain["logprobs"]))
        assert worst <= CACHE_TOL, f"{name}: log-probs with the cache differ by {worst:.2e} from without"
    assert reqs["cold"]["cached"] == 0 and reqs["cold"]["passes"] >= 4, reqs["cold"]
    # warm: the block-floored prompt tail; branch: the block-floored shared prefix, which lies
    # before the prompt's tail (vLLM alone keeps no state there); turn 2: the tail again.
    assert reqs["warm"]["cached"] == (bv.PROMPT - 1) // bv.BLOCK * bv.BLOCK
    assert reqs["branch"]["cached"] == bv.SHARED // bv.BLOCK * bv.BLOCK
    assert reqs["turn2"]["cached"] == (bv.PROMPT - 1) // bv.BLOCK * bv.BLOCK
    assert reqs["branch2"]["cached"] == bv.SHARED // bv.BLOCK * bv.BLOCK
    assert reqs["branch"]["passes"] < reqs["cold"]["passes"]


@pytest.mark.parametrize("kind", ["granite", "jamba"])
def test_plugin_with_the_chunked_scan(kind, models, workdir, monkeypatch):
    """The chunked prefill scan forced (Mamba-2 with the model's chunk size 64, Mamba-1 with 64;
    blocks of 128, so cache hits resume on the chunk grid): transformers' tokens, the same hits."""
    monkeypatch.setenv("SSM_KERNELS_VLLM_PREFILL_ALGORITHM", "chunked")
    runs = workdir / "chunked"
    runs.mkdir(exist_ok=True)
    res = _served(models[kind], runs)
    assert res["plugin_status"]["prefill_algorithm"] == "chunked", res["plugin_status"]
    reqs = res["rounds"][0]
    assert reqs["cold"]["cached"] == 0 and reqs["cold"]["passes"] >= 4, reqs["cold"]
    assert reqs["warm"]["cached"] == (bv.PROMPT - 1) // bv.BLOCK * bv.BLOCK
    assert reqs["branch"]["cached"] == bv.SHARED // bv.BLOCK * bv.BLOCK


def test_a_bad_capture_interval_fails_the_engine_start(models, workdir, monkeypatch):
    """100 tokens with 128-token blocks: a ValueError naming the setting while the engine starts
    (the Mamba layers' kv-cache spec), not in its first step."""
    monkeypatch.setenv("SSM_KERNELS_VLLM_CAPTURE_INTERVAL", "100")
    res = bv.run_config(models["granite"], "plugin-align", rounds=1, max_tokens=1, workdir=workdir)
    assert res["error"] and "SSM_KERNELS_VLLM_CAPTURE_INTERVAL must be 0 or a positive multiple of the Mamba " \
        "block size 128, got 100" in res["error"], res["error"]
    assert "engine_start_s" not in res and res["rounds"] == []


def test_mamba1_with_lora_fails_the_engine_start(models):
    """LoRA on a Mamba-1 layer runs vLLM's own forward, which writes no block-end capture: with
    captures on, a ValueError naming the settings while the engine starts."""
    engine = dict(enable_prefix_caching=True, block_size=bv.BLOCK, max_num_batched_tokens=bv.BUDGET,
                  max_model_len=1024, max_num_seqs=2, enable_lora=True, max_lora_rank=8)
    res = serve(models["jamba"], engine, [])
    assert res["error"] and "with LoRA a Mamba layer runs vLLM's own forward" in res["log"] and \
        "SSM_KERNELS_VLLM_CAPTURE_INTERVAL=0" in res["log"], res


def test_vllm_policy_alone_misses_the_branch(models, workdir):
    """With vLLM's own capture policy (the prompt tail only; the plugin's kernels, since vLLM's CPU
    scan cannot write a checkpoint) the first branch finds nothing and pays a pass for vLLM's
    junction stop, which serves the second branch: what the block-end captures change."""
    res = bv.run_config(models["granite"], "plugin-align-tail", rounds=1, max_tokens=1, workdir=workdir)
    assert res["error"] is None, res.get("traceback") or res["error"]
    reqs = res["rounds"][0]
    assert reqs["warm"]["cached"] == (bv.PROMPT - 1) // bv.BLOCK * bv.BLOCK
    assert reqs["branch"]["cached"] == 0
    assert reqs["branch"]["passes"] == reqs["cold"]["passes"] + 1
    assert reqs["branch2"]["cached"] == bv.SHARED // bv.BLOCK * bv.BLOCK


def test_sparse_policy_captures_the_junction_in_pass(models, workdir):
    """Every 512 tokens: the branch restores at 512 and, in the same passes (no junction stop),
    leaves the state at the junction (640) for the next branch."""
    res = bv.run_config(models["jamba"], "plugin-align-512", rounds=1, max_tokens=1, workdir=workdir)
    assert res["error"] is None, res.get("traceback") or res["error"]
    reqs = res["rounds"][0]
    assert reqs["branch"]["cached"] == 512
    assert reqs["branch"]["passes"] == 2  # 388 tokens in a 256-token budget
    assert reqs["branch2"]["cached"] == bv.SHARED // bv.BLOCK * bv.BLOCK


def test_plugin_leaves_other_state_layers_to_vllm(workdir, tmp_path):
    """LFM2's short convs share vLLM's Mamba cache manager but run vLLM's own kernels: with the
    plugin installed every request gives vLLM's own tokens, log-prob bits, cache hits and passes.
    (The manager had kept a block at every block end of their group too, which nothing wrote: the
    first branch was served a 640-token hit from it.)"""
    model = bv.build_model("lfm2", tmp_path / "lfm2")
    own = bv.run_config(model, "vllm-align", rounds=1, max_tokens=4, workdir=workdir)
    res = bv.run_config(model, "plugin-align", rounds=1, max_tokens=4, workdir=workdir)
    assert own["error"] is None, own.get("traceback") or own["error"]
    assert res["error"] is None, res.get("traceback") or res["error"]
    assert res["plugin_status"]["installed"] and res["model_runner"] == MODEL_RUNNER
    for name, req in own["rounds"][0].items():
        served = res["rounds"][0][name]
        for key in ("tokens", "logprobs", "cached", "passes"):
            assert served[key] == req[key], f"{name}: {key} {served[key]} with the plugin, {req[key]} without"
    assert own["rounds"][0]["branch2"]["cached"] > 0  # vLLM's own junction state, kept with the plugin too


def test_vllm_cpu_without_the_plugin_fails_where_the_plugin_serves(models, workdir):
    """What vLLM's CPU build does on its own: Mamba-2 prefix caching crashes, Mamba-1 cannot run.
    If a vLLM release fixes these, this test says so (and the README's claim must change)."""
    granite = bv.run_config(models["granite"], "vllm-align", rounds=1, max_tokens=1, workdir=workdir)
    assert granite["error"] and "IndexError" in granite["error"], granite["error"]
    jamba = bv.run_config(models["jamba"], "vllm-none", rounds=1, max_tokens=1, workdir=workdir)
    assert jamba["error"] and "selective_scan_fwd" in jamba["error"], jamba["error"]


def _refused_install(plugin, monkeypatch, caplog) -> int:
    """install() run afresh: refused; the number of its warnings (one record, which the handler
    added here may see a second time through the root logger)."""
    monkeypatch.setitem(plugin._state, "installed", False)
    plugin.logger.addHandler(caplog.handler)  # vLLM's logger tree may not propagate to the root
    try:
        assert plugin.install() is False
    finally:
        plugin.logger.removeHandler(caplog.handler)
    return len({id(r) for r in caplog.records if "leaving vLLM's own Mamba kernels" in r.getMessage()})


def test_plugin_leaves_an_unknown_vllm_alone(monkeypatch, caplog):
    """Another vLLM version: one warning, nothing patched (vLLM's own kernels run)."""
    import vllm
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

    import ssm_serving.vllm_plugin as plugin

    before = MambaMixer2.conv_ssm_forward
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    assert _refused_install(plugin, monkeypatch, caplog) >= 1
    assert "0.99.0" in plugin.status()["reason"]
    assert MambaMixer2.conv_ssm_forward is before


def test_plugin_checks_the_signatures_it_patches():
    import ssm_serving.vllm_plugin as plugin

    assert plugin.check_compatible() is None


def test_plugin_leaves_vllm_alone_when_its_source_differs(monkeypatch, caplog):
    """A supported version whose source lacks something the table lists: nothing patched."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    import ssm_serving.vllm_plugin as plugin
    from ssm_serving.vllm_plugin import compat

    before = MambaManager.get_num_blocks_to_allocate
    missing = compat.Expect("vllm.v1.core.single_type_kv_cache_manager", "MambaManager", attrs=("_gone",))
    monkeypatch.setattr(compat, "EXPECTED", compat.EXPECTED + (missing,))
    assert _refused_install(plugin, monkeypatch, caplog) == 1
    assert "MambaManager no longer has _gone" in plugin.status()["reason"]
    assert MambaManager.get_num_blocks_to_allocate is before


_PATCHED = """
import importlib, json
from ssm_serving.vllm_plugin import compat
import ssm_serving.vllm_plugin as plugin
classes = {}
for module in {e.module for e in compat.EXPECTED}:
    for obj in vars(importlib.import_module(module)).values():
        if isinstance(obj, type) and obj.__module__.startswith("vllm."):
            classes[obj] = dict(vars(obj))
assert plugin.install(), plugin.status()
print(json.dumps(sorted([cls.__name__, name] for cls, before in classes.items()
                        for name, value in vars(cls).items() if before.get(name) is not value)))
"""


def test_every_patch_is_in_the_table():
    """What install() replaces on vLLM's classes is listed in compat.EXPECTED, so the runtime
    guard and CI's source check cover it."""
    import json
    import os
    import subprocess
    import sys

    from ssm_serving.vllm_plugin import compat

    env = {k: v for k, v in os.environ.items() if not k.startswith("SSM_KERNELS_VLLM")}
    out = subprocess.run([sys.executable, "-c", _PATCHED], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    patched = {tuple(p) for p in json.loads(out.stdout.strip().splitlines()[-1])}
    assert ("MambaManager", "get_num_blocks_to_allocate") in patched
    assert patched <= {(e.name, e.method) for e in compat.EXPECTED if e.method}, patched
