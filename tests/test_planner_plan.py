"""Whole-prompt plans: the seed's incident, the 5000-token prompt, and properties."""

import time

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import planner.plan
from planner import POLICIES, Pass, WarmRestore, block_floored_match, plan_prefill

PROPERTY = settings(max_examples=200, deadline=None)
INCIDENT = dict(block_size=16, budget=8192, first_budget=8193, interval=32)


def incident(policy):
    return plan_prefill(32772, policy=policy, **INCIDENT)


# -- the seed's incident: numbers from the seed's text -------------------------------------

def test_incident_legacy():
    plan = incident("legacy")
    assert plan.pass_ends == (8193, 16385, 24577, 32769, 32772)
    assert all(p.captures == () for p in plan.passes)
    # 32769 saves a snapshot too, but it lies past the warm request's match.
    assert plan.snapshot_positions == (8193, 16385, 24577, 32769)
    warm = plan.warm_restore()
    assert (warm.match, warm.restore_point, warm.replay_tokens) == (32768, 24577, 8195)
    assert warm.ssm_replay_tokens == 8191


def test_incident_split():
    plan = incident("split")
    assert plan.pass_ends == (8192, 16384, 24576, 32752, 32772)
    assert all(p.captures == () for p in plan.passes)
    assert plan.snapshot_positions == (8192, 16384, 24576, 32752)
    warm = plan.warm_restore()
    assert (warm.match, warm.restore_point, warm.replay_tokens) == (32768, 32752, 20)


def test_incident_inpass():
    plan = incident("inpass")
    assert plan.pass_ends == (8192, 16384, 24576, 32768, 32772)
    assert [p.captures for p in plan.passes] == [(), (), (), (32752,), ()]
    assert plan.passes[3].capture_offsets == (32752 - 24576,)
    assert plan.snapshot_positions == (8192, 16384, 24576, 32752, 32768)
    warm = plan.warm_restore()
    assert (warm.match, warm.restore_point, warm.replay_tokens) == (32768, 32768, 4)
    assert warm.ssm_replay_tokens == 0


def test_incident_free():
    plan = incident("free")
    assert plan.pass_ends == (8193, 16385, 24577, 32769, 32772)  # none added
    assert not any(p.snapshot_at_end for p in plan.passes)
    # Interval captures every 32 blocks (512 tokens), not only at pass ends.
    assert plan.passes[0].captures == tuple(range(512, 8193, 512))
    assert plan.passes[3].captures == tuple(range(25088, 32752, 512)) + (32752, 32768)
    assert plan.passes[4].captures == ()
    assert len(plan.snapshot_positions) == 64 + 1  # 512 .. 32768, and the split point 32752
    warm = plan.warm_restore()
    assert (warm.match, warm.restore_point, warm.replay_tokens) == (32768, 32768, 4)


def test_5000_token_prompt_split_and_inpass():
    split = plan_prefill(5000, block_size=16, budget=8192, policy="split")
    assert [(p.start, p.end) for p in split.passes] == [(0, 4976), (4976, 5000)]
    assert split.snapshot_positions == (4976,)
    inpass = plan_prefill(5000, block_size=16, budget=8192, policy="inpass")
    assert inpass.passes == [Pass(0, 5000, (4976,), False)]
    legacy = plan_prefill(5000, block_size=16, budget=8192, policy="legacy")
    assert legacy.pass_ends == (4976, 5000)


def test_plan_after_a_restore_uses_absolute_positions():
    # The warm legacy request: restore at 24577, first pass proposes the first budget.
    plan = plan_prefill(32772, start=24577, policy="legacy", **INCIDENT)
    assert [(p.start, p.end) for p in plan.passes] == [(24577, 32770), (32770, 32772)]
    # Under split the tail rules still apply to absolute positions.
    plan = plan_prefill(32772, start=16384, policy="split", **INCIDENT)
    assert plan.pass_ends == (24576, 32752, 32772)
    # Captures at or below start are not taken: the state there is the one restored.
    plan = plan_prefill(32772, start=32752, policy="free", **INCIDENT)
    assert plan.snapshot_positions == (32768,)


def test_free_branch_points_and_limits():
    plan = plan_prefill(1000, block_size=16, budget=300, policy="free",
                        branch_points=(0, 480, 700, 1000), start=100)
    assert plan.pass_ends == (400, 700, 1000)
    # 0 and 100-or-below are not after start; 1000 is the final state; 976/992 are tail points.
    assert plan.snapshot_positions == (480, 700, 976, 992)
    assert plan.passes[1].captures == (480, 700)  # 700 is that pass's final state


def test_empty_plans():
    assert plan_prefill(0, block_size=16, budget=8).passes == []
    plan = plan_prefill(64, block_size=16, budget=8, start=64)
    assert plan.passes == [] and plan.snapshot_positions == ()


def test_warm_restore_of_an_empty_plan_and_of_a_shorter_follow_up():
    # Nothing to compute: the byte-identical request of an empty prompt replays nothing.
    assert plan_prefill(0, block_size=16, budget=8).warm_restore() == WarmRestore(0, 0, 0, 0, 0)
    plan = plan_prefill(100, block_size=16, budget=16, interval=1)  # a snapshot every block
    assert plan.warm_restore(request_total=0) == WarmRestore(0, 0, 0, 0, 0)
    # A shorter follow-up shares all its tokens by default (the prompt's first 50).
    assert plan.warm_restore(request_total=50) == plan.warm_restore(shared_tokens=50, request_total=50)
    assert plan.warm_restore(request_total=50) == WarmRestore(48, 48, 2, 0)


def test_restore_point_and_follow_up():
    plan = incident("split")
    assert plan.restore_point(32751) == 24576
    assert plan.restore_point(100) == 0
    # A next turn of 40000 tokens sharing the prompt up to 32768 (its template diverges).
    warm = plan.warm_restore(shared_tokens=32768, request_total=40000)
    assert (warm.match, warm.restore_point, warm.replay_tokens) == (32768, 32752, 40000 - 32752)
    warm = plan.warm_restore(shared_tokens=32760, request_total=40000)
    assert (warm.match, warm.restore_point) == (32752, 32752)


@pytest.mark.parametrize(
    "shared, total, block_size, expected",
    [(32772, 32772, 16, 32768), (32768, 32772, 16, 32768), (32768, 32768, 16, 32752),
     (10, 5, 4, 4), (0, 100, 16, 0), (5, 0, 16, 0), (15, 100, 16, 0)],
)
def test_block_floored_match(shared, total, block_size, expected):
    assert block_floored_match(shared, total, block_size) == expected


# -- properties ----------------------------------------------------------------------------

@st.composite
def plan_args(draw):
    total = draw(st.integers(0, 6000))
    return dict(
        total=total,
        block_size=draw(st.integers(1, 64)),
        budget=draw(st.integers(1, 3000)),
        first_budget=draw(st.one_of(st.none(), st.integers(1, 3000))),
        interval=draw(st.integers(0, 8)),
        start=draw(st.integers(0, total)),
    )


def tail_points(total, block_size):
    """Tail boundary and split point, computed here from their definitions."""
    boundaries = [m for m in range(block_size, total, block_size)]
    boundary = boundaries[-1] if boundaries else None
    split = boundary - block_size if boundary and boundary - block_size > 0 else None
    return boundary, split


def budget_spans(total, start, budget, first_budget, block_size=None):
    """Passes as the budget proposes them, optionally with non-last ends floored to blocks."""
    spans, offset = [], start
    while offset < total:
        cap = first_budget if (not spans and first_budget) else budget
        end = min(offset + cap, total)
        if block_size and end < total and end // block_size * block_size > offset:
            end = end // block_size * block_size
        spans.append((offset, end - offset))
        offset = end
    return spans


@PROPERTY
@given(args=plan_args(), policy=st.sampled_from(POLICIES))
def test_passes_tile_the_range_within_budget(args, policy):
    plan = plan_prefill(policy=policy, **args)
    total, start = args["total"], args["start"]
    first_cap = args["first_budget"] or args["budget"]
    offset = start
    for index, p in enumerate(plan.passes):
        assert p.start == offset and p.length >= 1
        offset = p.end
    assert offset == max(total, start)
    _, split = tail_points(total, args["block_size"])
    for index, p in enumerate(plan.passes):
        cap = first_cap if index == 0 else args["budget"]
        is_split_tail = (
            policy in ("legacy", "split") and index == len(plan.passes) - 1 and index > 0
            and p.start == split
            and plan.passes[index - 1].start
            + (first_cap if index == 1 else args["budget"]) >= total
        )
        if is_split_tail:  # the two halves of one last chunk share its budget
            prev_cap = first_cap if index == 1 else args["budget"]
            assert plan.passes[index - 1].length + p.length <= prev_cap
        else:
            assert p.length <= cap


@PROPERTY
@given(args=plan_args(), policy=st.sampled_from(POLICIES))
def test_captures_and_snapshots_follow_the_policy(args, policy):
    plan = plan_prefill(policy=policy, **args)
    total, block_size, interval = args["total"], args["block_size"], args["interval"]
    boundary, split = tail_points(total, block_size)
    for p in plan.passes:
        assert all(p.start < c <= p.end and args["start"] < c < total for c in p.captures)
    last_end = plan.passes[-1].end if plan.passes else None
    for p in plan.passes:
        index = p.end // block_size
        expected = (
            policy != "free" and p.end != last_end
            and (p.end in (boundary, split) or (interval > 0 and index >= 1
                                                  and index % interval == 0))
        )
        assert p.snapshot_at_end == expected
    captures = sorted(c for p in plan.passes for c in p.captures)
    spanning = [p for p in plan.passes if split is not None and p.start < split < p.end]
    if policy == "split":
        assert captures == [] and spanning == []
    elif policy == "legacy":  # a non-last pass may span it: the incident
        assert captures == [] and all(p is not plan.passes[-1] for p in spanning)
    elif policy == "inpass":
        assert len(spanning) <= 1
        assert captures == ([split] if spanning else [])
    ends = {p.end for p in plan.passes if p.snapshot_at_end}
    assert list(plan.snapshot_positions) == sorted(set(captures) | ends)


@PROPERTY
@given(args=plan_args())
def test_split_cuts_no_non_last_pass_across_the_split_point(args):
    plan = plan_prefill(policy="split", **args)
    _, split = tail_points(args["total"], args["block_size"])
    for index, p in enumerate(plan.passes[:-1]):
        assert not (split is not None and p.start < split < p.end)
        cap = (args["first_budget"] or args["budget"]) if index == 0 else args["budget"]
        # On a block boundary, at the split point, or as proposed when flooring to a block
        # would not stay above its start.
        assert p.end % args["block_size"] == 0 or p.end == split or p.length == cap


@PROPERTY
@given(args=plan_args())
def test_free_adds_no_pass_and_captures_what_the_cache_wants(args):
    plan = plan_prefill(policy="free", branch_points=(args["total"] // 3,), **args)
    total, start, block_size = args["total"], args["start"], args["block_size"]
    expected_spans = budget_spans(total, start, args["budget"], args["first_budget"])
    assert [(p.start, p.length) for p in plan.passes] == expected_spans
    wanted = set(tail_points(total, block_size)) | {total // 3}
    if args["interval"]:
        step = args["interval"] * block_size
        wanted |= {m for m in range(step, total, step)}
    assert list(plan.snapshot_positions) == sorted(
        p for p in wanted if p is not None and start < p < total)


@PROPERTY
@given(args=plan_args())
def test_inpass_has_the_block_aligned_plan_passes(args):
    plan = plan_prefill(policy="inpass", **args)
    aligned = budget_spans(args["total"], args["start"], args["budget"], args["first_budget"],
                           args["block_size"])
    assert [(p.start, p.length) for p in plan.passes] == aligned
    cache_off = budget_spans(args["total"], args["start"], args["budget"], args["first_budget"])
    assert len(plan.passes) >= len(cache_off)


@PROPERTY
@given(args=plan_args(), policy=st.sampled_from(POLICIES), shared=st.integers(0, 6000))
def test_warm_restore_is_at_or_below_the_match(args, policy, shared):
    assume(args["total"] >= 1)
    plan = plan_prefill(policy=policy, **args)
    warm = plan.warm_restore(shared_tokens=min(shared, args["total"]))
    assert warm.match % args["block_size"] == 0 and warm.match <= args["total"] - 1
    assert warm.restore_point <= warm.match
    assert warm.restore_point == max(
        [p for p in plan.snapshot_positions if p <= warm.match], default=0)
    assert warm.replay_tokens == args["total"] - warm.restore_point


def test_astronomical_plans_answer_at_once_or_are_refused():
    began = time.perf_counter()
    with pytest.raises(ValueError, match=r"every 512 tokens .* would be up to 195312499999999999, "
                                         r"more than the limit of 100000: raise interval"):
        plan_prefill(10**20, block_size=16, budget=10**20, interval=32, policy="free")
    with pytest.raises(ValueError, match=r"passes .* would be up to 12500000000000000003, "
                                         r"more than the limit of 100000"):
        plan_prefill(10**20, block_size=16, budget=16, policy="split")
    plan = plan_prefill(10**20, block_size=16, budget=10**20, interval=0, policy="free")
    assert [(p.start, p.length) for p in plan.passes] == [(0, 10**20)]
    assert plan.snapshot_positions == (10**20 - 32, 10**20 - 16)
    assert len(plan_prefill(10**20, block_size=16, budget=10**19, policy="inpass").passes) == 10
    with pytest.raises(ValueError, match=r"branch_points must have at most 100000 entries"):
        plan_prefill(10**20, block_size=16, budget=10**20, policy="free", branch_points=range(10**20))
    assert time.perf_counter() - began < 2.0


@PROPERTY
@given(args=plan_args(), policy=st.sampled_from(POLICIES), limit=st.integers(1, 40))
def test_no_plan_lists_more_than_the_limits(args, policy, limit):
    """With the limits lowered, a plan is either refused or within them: the bounds it is checked
    against never undercount."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(planner.plan, "MAX_PASSES", limit)
        patch.setattr(planner.plan, "MAX_CAPTURES", limit)
        try:
            plan = plan_prefill(policy=policy, **args)
        except ValueError as refused:
            assert "more than the limit of" in str(refused)
            return
    assert len(plan.passes) <= limit
    step = args["interval"] * args["block_size"]
    interval_captures = [c for p in plan.passes for c in p.captures if step and c % step == 0]
    assert len(interval_captures) <= limit



# -- bad input -----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(total=-1), ValueError, "total"),
        (dict(block_size=0), ValueError, "block_size"),
        (dict(budget=0), ValueError, "budget"),
        (dict(first_budget=0), ValueError, "first_budget"),
        (dict(interval=-1), ValueError, "interval"),
        (dict(start=101), ValueError, "start"),
        (dict(policy="fast"), ValueError, "policy"),
        (dict(branch_points=(101,), policy="free"), ValueError, "branch_points"),
        (dict(branch_points=(-1,), policy="free"), ValueError, "branch_points"),
        (dict(branch_points=(50,), policy="split"), ValueError, "branch_points"),
        (dict(branch_points=5, policy="free"), TypeError, "branch_points"),
        (dict(budget=8.0), TypeError, "budget"),
    ],
)
def test_plan_prefill_rejects_bad_input(kwargs, error, name):
    args = {"total": 100, "block_size": 16, "budget": 32, **kwargs}
    with pytest.raises(error, match=name):
        plan_prefill(**args)


def test_policy_error_lists_the_policies():
    with pytest.raises(ValueError, match="'legacy', 'split', 'inpass', 'free'"):
        plan_prefill(100, block_size=16, budget=32, policy="fast")


def test_warm_restore_and_helpers_reject_bad_input():
    plan = incident("split")
    with pytest.raises(ValueError, match="shared_tokens"):
        plan.warm_restore(shared_tokens=32773)
    with pytest.raises(ValueError, match="shared_tokens"):
        plan.warm_restore(shared_tokens=200, request_total=100)
    with pytest.raises(ValueError, match="request_total"):
        plan.warm_restore(request_total=-1)
    with pytest.raises(ValueError, match="match"):
        plan.restore_point(-1)
    with pytest.raises(ValueError, match="block_size"):
        block_floored_match(10, 20, 0)
    with pytest.raises(ValueError, match="shared_tokens"):
        block_floored_match(-1, 20, 16)
    with pytest.raises(TypeError, match="total"):
        block_floored_match(1, None, 16)


def test_grid_replay_is_the_match_past_its_grid_point_when_no_snapshot_is_near():
    """split at grid 256 saves only the tail split point, 32512 (the tail boundary of 256-token
    steps is 32768): a follow-up sharing 20000 tokens restores at 0 and replays 20000, of which
    20000 % 256 = 32 the grid forces."""
    plan = plan_prefill(32772, block_size=16, budget=8192, policy="split", grid=256)
    assert plan.snapshot_positions == (32512,)
    restore = plan.warm_restore(shared_tokens=20000)
    assert (restore.restore_point, restore.ssm_replay_tokens, restore.grid_replay_tokens) == (0, 20000, 32)


def test_a_plan_built_by_hand_has_grid_1():
    plan = planner.plan.PrefillPlan(total=100, start=0, block_size=5, policy="split", passes=[Pass(0, 100)])
    assert plan.grid == 1 and plan.warm_restore(shared_tokens=37).grid_replay_tokens == 0


def test_split_on_a_grid_snapshots_interval_ends_and_the_tail_split_point():
    """Interval 32 x 16 tokens: pass ends at multiples of 512 save snapshots; the tail split point
    of 256-token steps (lcm of block and grid), 32512, ends a pass and saves one too."""
    plan = plan_prefill(32772, block_size=16, budget=8192, interval=32, policy="split", grid=256)
    assert plan.pass_ends == (8192, 16384, 24576, 32512, 32772)
    assert plan.snapshot_positions == (8192, 16384, 24576, 32512)


@pytest.mark.parametrize("args, ends", [
    # 9 floored to the grid; the last pass does not span the split point (6)
    (dict(total=10, block_size=1, budget=9, grid=2), (8, 10)),
    # the split point (80) lies in the first pass, not the last
    (dict(total=100, block_size=16, budget=99), (99, 100)),
])
def test_legacy_pass_ends_near_the_end(args, ends):
    assert plan_prefill(**args, policy="legacy").pass_ends == ends


def test_free_floors_branch_and_interval_points_to_the_grid():
    """Grid 64, blocks of 16: tail points of 64-token steps (960 and 896), branch point 300 at
    256; interval 5 x 16 = 80: multiples of 80 floored to multiples of 64."""
    plan = plan_prefill(1000, block_size=16, budget=1000, policy="free", grid=64, branch_points=(300,))
    assert plan.snapshot_positions == (256, 896, 960)
    plan = plan_prefill(1000, block_size=16, budget=1000, policy="free", grid=64, interval=5)
    assert plan.snapshot_positions == (64, 128, 192, 320, 384, 448, 512, 640, 704, 768, 832, 896, 960)


def test_the_size_limits_at_their_bounds():
    """Passes: at most ceil(tokens / budget) + 2 as the budget proposes them, so 99998 one-token
    passes are the most a legacy plan at budget 1 may list; on a grid every pass may end early,
    so 299994 tokens at budget 3, grid 2 (149997 passes of 2) are refused. Interval captures under
    free only, those past start only; at most MAX_CAPTURES branch points."""
    assert len(plan_prefill(99998, block_size=1, budget=1, policy="legacy").passes) == 99998
    with pytest.raises(ValueError, match="raise budget"):
        plan_prefill(99999, block_size=1, budget=1, policy="legacy")
    with pytest.raises(ValueError, match="raise budget"):
        plan_prefill(299994, block_size=1, budget=3, grid=2, policy="legacy")
    assert len(plan_prefill(60000, block_size=1, budget=1, policy="legacy").passes) == 60000
    # legacy snapshots only at pass ends: interval 1 over 1e9 tokens lists nothing; the last pass
    # is cut at the tail split point, 1e9 - 2
    assert plan_prefill(10**9, block_size=1, budget=10**9, interval=1, policy="legacy").pass_ends == (10**9 - 2,
                                                                                                   10**9)
    late = plan_prefill(200000, block_size=1, budget=200000, interval=1, policy="free", start=150000)
    assert late.snapshot_positions == tuple(range(150001, 200000))
    most = plan_prefill(10**6, block_size=16, budget=10**6, policy="free",
                        branch_points=range(planner.plan.MAX_CAPTURES))
    assert len(most.snapshot_positions) == planner.plan.MAX_CAPTURES - 1 + 2  # 0 is not taken; the two tail points
