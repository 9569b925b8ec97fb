"""The trace simulator, its cost model and the trace generators."""

import json
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import planner.traces
from planner import (
    CostModel,
    agentic_branching,
    default_traces,
    multi_turn_chat,
    shared_system_prompts,
    simulate,
)
from planner.traces import DIVERGING_SUFFIX

SEED_SERVE = dict(block_size=16, budget=8192, first_budget=8193, interval=32)


def random_prompt(count, seed):
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(count)]


INCIDENT_PROMPT = random_prompt(32772, seed=0)


@pytest.mark.parametrize(
    "policy, stored, restore, computed, ssm_replay, warm_passes",
    [
        # 32769 lies in the prompt's trailing partial block: legacy keeps only 3 snapshots.
        ("legacy", 3, 24577, 8195, 8191, 2),
        ("split", 4, 32752, 20, 16, 1),
        ("inpass", 5, 32768, 4, 0, 1),
        ("free", 65, 32768, 4, 0, 1),
    ],
)
def test_incident_repeated_byte_identical(policy, stored, restore, computed, ssm_replay,
                                          warm_passes):
    report = simulate([INCIDENT_PROMPT, INCIDENT_PROMPT], policy=policy, **SEED_SERVE)
    cold, warm = report.requests
    assert (cold.restore_point, cold.tokens_computed, cold.passes) == (0, 32772, 5)
    assert cold.extra_passes == 0 and cold.snapshots_stored == stored
    assert warm.matched_tokens == 32768
    assert (warm.restore_point, warm.tokens_computed, warm.ssm_replay_tokens) == (
        restore, computed, ssm_replay)
    assert (warm.passes, warm.extra_passes) == (warm_passes, 0)
    assert report.totals.hits == 1 and report.totals.hit_rate == 0.5


def test_cost_model_reproduces_the_incident():
    report = simulate([INCIDENT_PROMPT, INCIDENT_PROMPT], policy="legacy", **SEED_SERVE)
    assert report.requests[1].modeled_ms == pytest.approx(12_500)
    model = CostModel()
    assert model.per_pass_ms == 868
    assert model.per_token_ms == pytest.approx(1.3135, abs=1e-4)
    assert CostModel(per_token_ms=2, per_pass_ms=10).prefill_ms(100, 3) == 230


@pytest.mark.parametrize(
    "policy, passes, extra, restore, computed",
    [("legacy", 2, 1, 4976, 24), ("split", 2, 1, 4976, 24), ("inpass", 1, 0, 4976, 24),
     ("free", 1, 0, 4992, 8)],
)
def test_5000_token_prompt_twice(policy, passes, extra, restore, computed):
    prompt = random_prompt(5000, seed=1)
    cold, warm = simulate([prompt, prompt], policy=policy, block_size=16, budget=8192).requests
    assert (cold.passes, cold.extra_passes) == (passes, extra)
    assert (warm.matched_tokens, warm.restore_point, warm.tokens_computed) == (
        4992, restore, computed)


def test_free_captures_the_branch_point():
    context = random_prompt(1000, seed=2)
    branches = [context + random_prompt(300, seed=3 + i) for i in range(3)]
    kwargs = dict(block_size=16, budget=8192)
    free = simulate(branches, policy="free", **kwargs).requests
    inpass = simulate(branches, policy="inpass", **kwargs).requests
    # The second branch leaves the tree at 992 (1000 floored) and captures there; the third
    # restores exactly at its match. Without branch captures it restores at a tail point of
    # an earlier branch, which lies past the shared context: nothing.
    assert free[1].branch_point == 992 and free[2].restore_point == 992
    assert free[2].ssm_replay_tokens == 0
    assert inpass[2].restore_point == 0 and inpass[2].ssm_replay_tokens == 992


def test_totals_add_up_and_serialize():
    trace = multi_turn_chat(conversations=2, turns=3, system_tokens=500, seed=4)
    report = simulate(trace, policy="split", max_snapshots=3, eviction="utility", **SEED_SERVE)
    totals = report.totals
    assert totals.requests == len(trace) == 6
    assert totals.prompt_tokens == trace.prompt_tokens
    assert totals.tokens_computed == sum(r.tokens_computed for r in report.requests)
    assert totals.modeled_ms == pytest.approx(sum(r.modeled_ms for r in report.requests))
    assert totals.snapshots_stored - totals.snapshots_evicted == totals.snapshots_held <= 3
    data = json.loads(json.dumps(report.to_dict()))
    assert data["policy"] == "split" and len(data["requests"]) == 6
    assert data["cost_model"]["per_pass_ms"] == 868


def test_default_traces_under_every_policy():
    for trace in default_traces(seed=5):
        reports = {policy: simulate(trace, policy=policy, **SEED_SERVE)
                   for policy in ("legacy", "split", "inpass", "free")}
        assert all(r.extra_passes == 0 for r in reports["free"].requests)
        for report in reports.values():
            for request in report.requests:
                assert request.restore_point <= request.matched_tokens < request.prompt_tokens
        # The same prompts are matched the same way whatever the policy.
        matched = {p: r.totals.matched_tokens for p, r in reports.items()}
        assert len(set(matched.values())) == 1


# -- traces --------------------------------------------------------------------------------

def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_chat_turns_diverge_inside_the_previous_prompt_tail():
    trace = multi_turn_chat(conversations=2, turns=3, seed=6)
    assert len(trace) == 6
    by_conversation = [trace.requests[0::2], trace.requests[1::2]]
    for turns in by_conversation:
        for earlier, later in zip(turns, turns[1:]):
            assert len(later) > len(earlier)
            assert common_prefix(earlier, later) == len(earlier) - DIVERGING_SUFFIX
    assert common_prefix(by_conversation[0][0], by_conversation[1][0]) < 10


def test_system_prompt_trace_shares_few_prefixes():
    trace = shared_system_prompts(requests=20, system_prompts=2, system_tokens=(100, 200),
                                  seed=7)
    assert len(trace) == 20
    assert len({request[:100] for request in trace}) <= 2


def test_agent_branches_share_their_context():
    trace = agentic_branching(contexts=2, branches=3, context_tokens=(500, 500), seed=8)
    assert len(trace) == 6
    groups = {}
    for request in trace:
        groups.setdefault(request[:500], []).append(request)
    assert sorted(len(group) for group in groups.values()) == [3, 3]
    for group in groups.values():
        assert all(common_prefix(group[0], other) >= 500 for other in group[1:])


def test_traces_are_seeded():
    assert multi_turn_chat(seed=1).requests == multi_turn_chat(seed=1).requests
    assert multi_turn_chat(seed=1).requests != multi_turn_chat(seed=2).requests
    assert [len(t) for t in default_traces(scale=2)] == [2 * len(t) for t in default_traces()]


# -- bad input -----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(policy="best"), ValueError, "policy"),
        (dict(block_size=0), ValueError, "block_size"),
        (dict(budget=-1), ValueError, "budget"),
        (dict(first_budget=0), ValueError, "first_budget"),
        (dict(interval=-2), ValueError, "interval"),
        (dict(max_snapshots=-1), ValueError, "max_snapshots"),
        (dict(eviction="random"), ValueError, "eviction"),
        (dict(cost_model={"per_token_ms": 1}), TypeError, "cost_model"),
    ],
)
def test_simulate_rejects_bad_arguments(kwargs, error, name):
    args = {"policy": "split", "block_size": 16, "budget": 64, **kwargs}
    with pytest.raises(error, match=name):
        simulate([[1, 2, 3]], **args)


@pytest.mark.parametrize("trace", [[], [[1, 2, 3]]])
def test_simulate_refuses_budgets_below_the_grid_before_any_request(trace):
    with pytest.raises(ValueError, match=r"first_budget \(8\) must be at least the grid \(16\)"):
        simulate(trace, policy="split", block_size=16, budget=16, first_budget=8, grid=16)


def test_simulate_rejects_bad_requests():
    with pytest.raises(ValueError, match="request 1"):
        simulate([[1, 2], []], policy="split", block_size=16, budget=64)
    with pytest.raises(TypeError, match="request 0"):
        simulate([5], policy="split", block_size=16, budget=64)
    with pytest.raises(ValueError, match="per_pass_ms"):
        CostModel(per_pass_ms=-1)


@pytest.mark.parametrize("fields", [
    dict(per_token_ms=float("nan")),
    dict(per_token_ms=float("inf")),
    dict(per_pass_ms=float("-inf")),
    dict(per_pass_ms=10**400),
    dict(per_token_ms=1e308),  # finite, but a sum of two overflows
])
def test_cost_model_fields_must_be_finite(fields):
    name = next(iter(fields))
    with pytest.raises(ValueError, match=rf"{name} must be a finite number >= 0 and <= 1e\+12"):
        CostModel(**fields)


def test_simulate_rejects_a_missing_trace_and_unhashable_tokens():
    rules = dict(policy="split", block_size=16, budget=64)
    with pytest.raises(TypeError, match="trace must be an iterable of prompts, got NoneType"):
        simulate(None, **rules)
    with pytest.raises(TypeError, match="trace request 1 must hold hashable token ids, got list at index 2"):
        simulate([[1, 2, 3], [1, 2, [3]]], **rules)


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: multi_turn_chat(conversations=10**9), "conversations, turns"),
        (lambda: multi_turn_chat(turns=10**6), "conversations, turns"),
        (lambda: multi_turn_chat(reply_tokens=(1, 10**12)), "conversations, turns"),
        (lambda: shared_system_prompts(requests=1, system_prompts=10**9), "requests, system_prompts"),
        (lambda: shared_system_prompts(user_tokens=(0, 10**12)), "requests, system_prompts"),
        (lambda: agentic_branching(contexts=10**9), "contexts, branches"),
        (lambda: agentic_branching(context_tokens=(1, 10**12)), "contexts, branches"),
        (lambda: default_traces(scale=10**6), "scale"),
    ],
)
def test_trace_generators_refuse_sizes_beyond_the_limit_at_once(make, name):
    began = time.perf_counter()
    with pytest.raises(ValueError, match=rf"more than the limit of 100000000: lower {name}"):
        make()
    assert time.perf_counter() - began < 1.0


@settings(max_examples=100, deadline=None)
@given(
    kind=st.sampled_from(["chat", "system", "agent", "default"]),
    count=st.integers(1, 4),
    other=st.integers(1, 4),
    low=st.integers(0, 30),
    span=st.integers(0, 30),
    limit=st.integers(1, 3000),
)
def test_traces_never_hold_more_than_the_limit(kind, count, other, low, span, limit):
    """With the limit lowered, a trace is either refused or within it: its bound never
    undercounts."""
    sizes = (low, low + span)
    make = {
        "chat": lambda: multi_turn_chat(conversations=count, turns=other, system_tokens=low,
                                        message_tokens=sizes, reply_tokens=sizes),
        "system": lambda: shared_system_prompts(requests=count, system_prompts=other,
                                                system_tokens=sizes, user_tokens=sizes),
        "agent": lambda: agentic_branching(contexts=count, branches=other, context_tokens=sizes,
                                           continuation_tokens=sizes),
        "default": lambda: default_traces(scale=count),
    }[kind]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(planner.traces, "MAX_TRACE_TOKENS", limit * (1000 if kind == "default" else 1))
        try:
            traces = make()
        except ValueError as refused:
            assert "more than the limit of" in str(refused)
            return
    traces = traces if isinstance(traces, list) else [traces]
    assert sum(trace.prompt_tokens for trace in traces) <= limit * (1000 if kind == "default" else 1)


@pytest.mark.parametrize(
    "make, error, name",
    [
        (lambda: multi_turn_chat(turns=0), ValueError, "turns"),
        (lambda: multi_turn_chat(message_tokens=(10, 5)), ValueError, "message_tokens"),
        (lambda: shared_system_prompts(user_tokens=[1, 2]), TypeError, "user_tokens"),
        (lambda: agentic_branching(branches=-1), ValueError, "branches"),
        (lambda: agentic_branching(vocab_size=4), ValueError, "vocab_size"),
        (lambda: default_traces(scale=0), ValueError, "scale"),
    ],
)
def test_trace_generators_reject_bad_sizes(make, error, name):
    with pytest.raises(error, match=name):
        make()


def test_defaults_and_the_smallest_sizes():
    """interval defaults to 0: split stores only the tail split point's snapshot of a 1000-token
    prompt (976; passes end at 256, 512, 768, 976), and its warm repeat restores there, storing
    nothing more. Blocks and budgets of one token are served: 3 tokens cut at the split point 1
    (2 passes); two 2-token prompts at interval 1 hit the snapshot at 1."""
    prompt = list(range(1000))
    report = simulate([prompt, prompt], policy="split", block_size=16, budget=256)
    assert report.totals.snapshots_stored == 1
    assert report.requests[1].restore_point == 976
    assert simulate([[1, 2, 3]], policy="split", block_size=1, budget=4).totals.passes == 2
    assert simulate([[1, 2], [1, 2]], policy="split", block_size=1, budget=1, interval=1).totals.hits == 1
    with pytest.raises(ValueError, match="grid must be >= 1"):
        simulate([], policy="split", block_size=16, budget=256, grid=0)


def test_a_trace_of_exactly_the_limit_is_drawn(monkeypatch):
    """At fixed lengths (each range one value) a chat draws exactly its bound: a limit of its
    tokens is enough, one less is refused. The vocabulary needs one text id past the template's."""
    sizes = dict(conversations=2, turns=3, system_tokens=5, message_tokens=(7, 7), reply_tokens=(11, 11))
    total = multi_turn_chat(**sizes).prompt_tokens
    monkeypatch.setattr(planner.traces, "MAX_TRACE_TOKENS", total)
    assert multi_turn_chat(**sizes).prompt_tokens == total
    monkeypatch.setattr(planner.traces, "MAX_TRACE_TOKENS", total - 1)
    with pytest.raises(ValueError, match="conversations, turns"):
        multi_turn_chat(**sizes)
    first = planner.traces.FIRST_TEXT_ID
    with pytest.raises(ValueError, match=f"vocab_size must be >= {first + 1}"):
        multi_turn_chat(vocab_size=first)
    monkeypatch.setattr(planner.traces, "MAX_TRACE_TOKENS", 10**8)
    texts = [t for r in multi_turn_chat(**sizes, vocab_size=first + 1) for t in r if t >= first]
    assert texts and set(texts) == {first}
