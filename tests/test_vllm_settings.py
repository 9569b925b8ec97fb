"""The vLLM plugin's settings (ssm_serving.vllm_plugin.settings): read and checked at start-up;
no vLLM needed (tests_vllm checks that an engine start applies them)."""
from __future__ import annotations

import pytest

from ssm_serving.vllm_plugin import settings
from ssm_kernels.scan.mamba2_chunked.triton_kernel import FUSED_SSD
from ssm_serving.vllm_plugin.settings import ALGORITHM, ENABLE, INTERVAL, Settings


@pytest.mark.parametrize("env, expected", [
    ({}, Settings(True, None, "auto")),
    ({ENABLE: " 1 ", INTERVAL: "512", ALGORITHM: " chunked "}, Settings(True, 512, "chunked")),
    ({ENABLE: "On", INTERVAL: "0", ALGORITHM: "recurrent"}, Settings(True, 0, "recurrent")),
    ({INTERVAL: "", ALGORITHM: ""}, Settings(True, None, "auto")),
    ({ENABLE: "0", INTERVAL: "oops", ALGORITHM: "ssd"}, Settings(enabled=False)),  # off: the rest unread
    ({ENABLE: "false"}, Settings(enabled=False)),
    ({FUSED_SSD: "1"}, Settings(True, None, "auto")),
])
def test_good_settings(env, expected):
    assert settings.read(env) == expected


@pytest.mark.parametrize("env, message", [
    ({ENABLE: "of"}, f"{ENABLE} must be one of"),
    ({INTERVAL: "64.0"}, f"{INTERVAL} must be an integer number of tokens, got '64.0'"),
    ({INTERVAL: "1_28"}, f"{INTERVAL} must be an integer number of tokens, got '1_28'"),
    ({INTERVAL: "+128"}, f"{INTERVAL} must be an integer number of tokens, got '+128'"),
    ({INTERVAL: "\u0661\u0662\u0668"}, f"{INTERVAL} must be an integer number of tokens"),
    ({INTERVAL: "--1"}, f"{INTERVAL} must be an integer number of tokens"),
    ({INTERVAL: "-64"}, f"{INTERVAL} must be 0 or a positive multiple of the block size, got -64"),
    ({ALGORITHM: "ssd"}, f"{ALGORITHM} must be one of ('recurrent', 'chunked', 'auto'), got 'ssd'"),
    ({FUSED_SSD: "2"}, f"{FUSED_SSD} must be 0 or 1, got '2'"),  # the kernels' own, checked here too
])
def test_bad_settings_name_the_variable(env, message):
    with pytest.raises(ValueError) as err:
        settings.read(env)
    assert message in str(err.value)


def test_interval_against_the_block_size():
    settings.check_block_size(Settings(capture_interval=128), 64)
    settings.check_block_size(Settings(capture_interval=0), 64)
    settings.check_block_size(Settings(), 64)
    with pytest.raises(ValueError, match=f"{INTERVAL} must be 0 or a positive multiple of the Mamba block size 64, "
                                         "got 100"):
        settings.check_block_size(Settings(capture_interval=100), 64)
    assert Settings().interval(64) == 64 and Settings(capture_interval=0).interval(64) == 0


def test_block_end_columns():
    """Column c holds the state after (c + 1) * block_size tokens: those on the interval and
    strictly before num_tokens; interval 0 (vLLM's own policy) takes none."""
    from ssm_serving.vllm_plugin.captures import block_end_columns
    assert block_end_columns(0, 64, 16, 16) == [0, 1, 2]  # 16, 32, 48; not 64
    assert block_end_columns(0, 128, 16, 32) == [1, 3, 5]  # 32, 64, 96
    assert block_end_columns(2, 128, 16, 32) == [3, 5]
    assert block_end_columns(0, 64, 16, 0) == []


def test_the_scheduler_adds_interval_columns_and_the_junction(monkeypatch):
    """Blocks of 16, interval 64, a request of 100 tokens past its first block: column 3 (64
    tokens) on the interval and column 1, the branch junction at 40 floored to 32; not the column
    vLLM reserves for its own checkpoint; none where the policy is vLLM's own (interval 0), nor for
    the cache group of a state layer the plugin does not run (vLLM's kernels would not write them)."""
    from types import SimpleNamespace

    from ssm_serving.vllm_plugin import captures
    interval = {"value": 64}
    monkeypatch.setattr(settings, "current", SimpleNamespace(interval=lambda block_size: interval["value"]))
    spec = SimpleNamespace(mamba_cache_mode="align", num_speculative_blocks=0,
                           mamba_type=SimpleNamespace(name="MAMBA2"))
    mgr = SimpleNamespace(kv_cache_spec=spec, block_size=16, block_pool=SimpleNamespace(hash_block_size=16),
                          _ssm_junctions={"r": 40}, _checkpoints={})
    assert captures._extra_columns(mgr, "r", 1, 100) == [1, 3]
    assert captures._extra_columns(mgr, "r", 2, 100) == [3]  # the junction's block is already there
    for layer in ("SHORT_CONV", "GDN_ATTN", "LINEAR"):
        spec.mamba_type.name = layer
        assert captures._extra_columns(mgr, "r", 1, 100) == []
    spec.mamba_type.name = "MAMBA1"
    mgr._checkpoints["r"] = (None, 3)
    assert captures._extra_columns(mgr, "r", 1, 100) == [1]
    interval["value"] = 0
    assert captures._extra_columns(mgr, "r", 1, 100) == []


def test_the_junction_stop_is_dropped_only_where_every_state_group_captures(monkeypatch):
    """vLLM's scheduler ends a pass at a shared-prefix junction to keep the state there; the plugin
    drops that stop (its groups capture the junction in-pass) only when every group on vLLM's Mamba
    cache manager is one it captures in. A short-conv group beside a Mamba-2 one keeps the stop."""
    from types import SimpleNamespace

    from ssm_serving.vllm_plugin import captures

    monkeypatch.setattr(settings, "current", settings.Settings())
    seen = []

    class Scheduler:
        mamba_shared_prefix_checkpoint = False

        def _mamba_block_aligned_split(self, request, num_new_tokens):
            seen.append(request.shared_prefix_boundary)
            return num_new_tokens

    def manager(layer):
        spec = SimpleNamespace(mamba_cache_mode="align", num_speculative_blocks=0,
                               mamba_type=SimpleNamespace(name=layer))
        return SimpleNamespace(kv_cache_spec=spec, block_size=16, block_pool=SimpleNamespace(hash_block_size=16),
                               _checkpoints={})

    captures.patch_scheduler(Scheduler)
    scheduler, request = Scheduler(), SimpleNamespace(request_id="r", shared_prefix_boundary=40)
    for layers, passed in ((["MAMBA2"], 0), (["MAMBA1", "MAMBA2"], 0), (["MAMBA2", "SHORT_CONV"], 40),
                           (["GDN_ATTN"], 40)):
        managers = [manager(layer) for layer in layers]
        scheduler.kv_cache_manager = SimpleNamespace(coordinator=SimpleNamespace(single_type_managers=managers))
        seen.clear()
        assert scheduler._mamba_block_aligned_split(request, 100) == 100
        assert seen == [passed] and request.shared_prefix_boundary == 40, layers
        junctions = [getattr(m, "_ssm_junctions", {}).get("r") for m in managers]
        assert junctions == [None if passed else 40] * len(layers)
