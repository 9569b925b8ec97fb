"""The plugin in the smallest KV cache vLLM accepts: a request vLLM serves must be served, its
capture blocks given up where they do not fit (vLLM's admission reserves a request's whole block
count; the captures are counted only by the step that takes them)."""
from __future__ import annotations

import random

import pytest
from vllm_child import MODEL_RUNNER, serve

from bench import vllm as bv

# GraniteMoeHybrid, 64-token blocks, max_model_len 1024: one request needs 16 attention blocks and
# 3 Mamba blocks (running state, the previous one, the prompt-tail checkpoint), plus vLLM's null
# block: 20 blocks is the least vLLM starts with.
ENGINE = dict(enable_prefix_caching=True, block_size=64, max_num_batched_tokens=256, max_model_len=1024,
              max_num_seqs=4)
SMALLEST = 20


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    return bv.build_model("granite", tmp_path_factory.mktemp("tight") / "granite")


def test_vllm_refuses_a_smaller_cache(granite):
    res = serve(granite, {**ENGINE, "num_gpu_blocks_override": SMALLEST - 1}, [], timeout=600)
    assert res["error"] and "To serve at least one request" in res["log"], res


def test_plugin_serves_in_the_smallest_cache(granite):
    """A 992-token prompt (every block end but the tail a capture), then a branch of it: served
    with transformers' tokens; with every capture counted at admission the first waited forever."""
    rng = random.Random(0)
    prompt = [rng.randrange(3, bv.VOCAB) for _ in range(992)]
    branch = prompt[:704] + [rng.randrange(3, bv.VOCAB) for _ in range(288)]
    res = serve(granite, {**ENGINE, "num_gpu_blocks_override": SMALLEST}, [prompt, branch], timeout=420)
    assert res["error"] is None, res
    assert res["plugin_status"]["installed"] and res["plugin_status"]["capture_interval"] is None, res
    assert res["model_runner"] == MODEL_RUNNER
    for tokens, served in zip((prompt, branch), res["served"]):
        expected, logprobs = bv.transformers_greedy(granite, tokens, 4)
        assert served["tokens"] == expected
        assert max(abs(a - b) for a, b in zip(served["logprobs"], logprobs)) <= 5e-5
