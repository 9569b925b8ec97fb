"""Pure-Python planning for chunked prefill of hybrid attention + SSM models.

- :mod:`planner.rules`: the seed engine's chunk rules (tail points, chunk lengths, which chunk
  ends save a snapshot, which pass captures in-pass).
- :mod:`planner.plan`: whole-prompt plans under the ``legacy``, ``split``, ``inpass`` and
  ``free`` policies, and the warm restore of a follow-up request.
- :mod:`planner.cache`: a radix-tree prefix cache of SSM snapshots with LRU or utility eviction.
- :mod:`planner.simulate` and :mod:`planner.traces`: serve synthetic traces and compare policies.

Standard library and tqdm only; no torch.
"""

from .cache import EVICTION_POLICIES, CacheStats, InsertResult, Match, PrefixCache
from .plan import (
    POLICIES,
    Pass,
    PrefillPlan,
    WarmRestore,
    block_floored_match,
    plan_prefill,
)
from .rules import (
    inpass_capture_spans,
    is_checkpoint_chunk_end,
    is_prompt_tail_end,
    plan_chunk_len,
    tail_boundary,
    tail_split_point,
)
from .simulate import CostModel, RequestReport, SimulationReport, Totals, simulate
from .traces import Trace, agentic_branching, default_traces, multi_turn_chat, shared_system_prompts

__all__ = [
    "EVICTION_POLICIES",
    "POLICIES",
    "CacheStats",
    "CostModel",
    "InsertResult",
    "Match",
    "Pass",
    "PrefillPlan",
    "PrefixCache",
    "RequestReport",
    "SimulationReport",
    "Totals",
    "Trace",
    "WarmRestore",
    "agentic_branching",
    "block_floored_match",
    "default_traces",
    "inpass_capture_spans",
    "is_checkpoint_chunk_end",
    "is_prompt_tail_end",
    "multi_turn_chat",
    "plan_chunk_len",
    "plan_prefill",
    "shared_system_prompts",
    "simulate",
    "tail_boundary",
    "tail_split_point",
]
