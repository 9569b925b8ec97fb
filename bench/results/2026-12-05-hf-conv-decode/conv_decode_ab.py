"""A transformers model's decode step on the library's kernels (ssm_kernels.adapters) with the
conv state updated in place (now) against through a copy, a cat and a copy back (as at BEFORE,
its _decode_conv taken from git): the adapter tests' tiny Mamba-2 and Mamba configs, batch 2, one
token a step after a 24-token prompt, PyTorch backend on CPU, alternating blocks in one run. Run
from the repository root: PYTHONPATH=$PWD:$PWD/tools python bench/results/2026-12-05-hf-conv-decode/conv_decode_ab.py"""
import contextlib
import inspect
import statistics
import subprocess
import time
from unittest import mock

import torch
import transformers

from ssm_kernels.adapters import hf_mixers, use_ssm_kernels

BEFORE = "187af63"


def decode_conv_before():
    """_decode_conv at BEFORE, which returned the new state for its caller to copy in."""
    source = subprocess.run(["git", "show", f"{BEFORE}:ssm_kernels/adapters/hf_mixers.py"], capture_output=True,
                            text=True, check=True).stdout
    space = dict(vars(hf_mixers))
    start = source.index("def _decode_conv(")
    exec(source[start:source.index("\n\n\n", start)], space)
    old = space["_decode_conv"]

    def decode_conv(conv, x, conv_state, offsets):
        out, new, caps = old(conv, x, conv_state, offsets)
        conv_state.copy_(new)
        return out, caps
    return decode_conv


def model(name: str):
    torch.manual_seed(0)
    if name == "Mamba2":
        config = transformers.Mamba2Config(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_heads=8,
                                           head_dim=8, expand=2, state_size=16, n_groups=2, conv_kernel=4,
                                           chunk_size=8, use_bias=True)
        m = transformers.Mamba2ForCausalLM(config)
    else:
        config = transformers.MambaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, state_size=16,
                                          expand=2, conv_kernel=4)
        m = transformers.MambaForCausalLM(config)
    return use_ssm_kernels(m.eval())


def step_times(m, blocks: int = 20, steps: int = 10) -> dict:
    ids = torch.randint(0, 100, (2, 24))
    modes = {"now": contextlib.nullcontext, BEFORE: lambda: mock.patch.object(hf_mixers, "_decode_conv",
                                                                              decode_conv_before())}
    times = {mode: [] for mode in modes}
    cache = transformers.DynamicCache(config=m.config)
    params = inspect.signature(m.forward).parameters
    name = next(k for k in ("cache", "past_key_values", "cache_params") if k in params)
    with torch.no_grad():
        m(input_ids=ids, use_cache=True, **{name: cache})
        token = ids[:, -1:]
        for _ in range(blocks):
            for mode, within in modes.items():
                with within():
                    for _ in range(steps):
                        start = time.perf_counter()
                        m(input_ids=token, use_cache=True, **{name: cache})
                        times[mode].append((time.perf_counter() - start) * 1e6)
    return {mode: statistics.median(t) for mode, t in times.items()}


if __name__ == "__main__":
    torch.set_num_threads(1)
    for name in ("Mamba2", "Mamba"):
        t = step_times(model(name))
        print(f"{name} decode step: now {t['now']:.0f} us, {BEFORE} {t[BEFORE]:.0f} us, "
              f"now / {BEFORE} {t['now'] / t[BEFORE]:.2f}")
