"""The plugin's Mamba-1 mixer against both forms of vLLM's projection `MambaMixer._ssm_transform`:
`(x)` up to 0.33, `(x, batch_start, num_batch_tokens)` from 0.34 (the rows' place in the step's
batch, which vLLM's LoRA path reads). Stand-in layers, no vLLM needed; tests_vllm runs the first
form inside vLLM 0.32."""
from __future__ import annotations

import torch

from ssm_serving.vllm_plugin import mixers


class Before034:
    def _ssm_transform(self, x):
        return ("x only", x)


class From034:
    def _ssm_transform(self, x, batch_start, num_batch_tokens):
        return ("with rows", x, batch_start, num_batch_tokens)


def test_the_projection_is_called_in_the_form_vllm_defines():
    x = torch.zeros(3, 4)
    assert mixers._ssm_transform(Before034(), x, 2, 5) == ("x only", x)
    assert mixers._ssm_transform(From034(), x, 2, 5) == ("with rows", x, 2, 5)
