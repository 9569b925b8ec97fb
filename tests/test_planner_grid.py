"""The planner's grid option: passes, captures and snapshots on multiples of the grid (the chunked
scan's exact points), and the replay that costs."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import POLICIES, plan_prefill, simulate, default_traces

INCIDENT = dict(block_size=16, budget=8192, first_budget=8193, interval=32)


@pytest.mark.parametrize("policy", POLICIES)
def test_grid_one_is_the_plain_plan(policy):
    assert plan_prefill(32772, policy=policy, grid=1, **INCIDENT) == plan_prefill(32772, policy=policy, **INCIDENT)


def test_incident_on_the_grid():
    ends = {policy: plan_prefill(32772, policy=policy, grid=256, **INCIDENT).pass_ends for policy in POLICIES}
    assert ends == {"legacy": (8192, 16384, 24576, 32768, 32772), "split": (8192, 16384, 24576, 32512, 32772),
                    "inpass": (8192, 16384, 24576, 32768, 32772), "free": (8192, 16384, 24576, 32768, 32772)}
    inpass = plan_prefill(32772, policy="inpass", grid=256, **INCIDENT)
    assert inpass.passes[3].captures == (32512,)  # the tail split point one grid step below 32768
    byte_identical = inpass.warm_restore()
    assert (byte_identical.restore_point, byte_identical.replay_tokens,
            byte_identical.grid_replay_tokens) == (32768, 4, 0)
    follow_up = inpass.warm_restore(shared_tokens=32760)  # match 32752, between grid points
    assert (follow_up.match, follow_up.restore_point, follow_up.grid_replay_tokens) == (32752, 32512, 240)
    assert plan_prefill(32772, policy="inpass", **INCIDENT).warm_restore(shared_tokens=32760).grid_replay_tokens == 0


def test_free_takes_no_extra_pass_on_a_grid():
    """The cache-off plan that extra passes count against is on the same grid."""
    (report,) = simulate([list(range(600))], policy="free", block_size=16, budget=300, grid=256).requests
    assert report.passes == 3 and report.extra_passes == 0  # 256, 512, 600: the grid's own pass ends


@pytest.mark.parametrize("budgets", [dict(budget=12), dict(budget=32, first_budget=8)])
def test_budgets_below_the_grid_are_refused(budgets):
    with pytest.raises(ValueError, match=r"budget \(\d+\) must be at least the grid \(16\)"):
        plan_prefill(70, block_size=4, grid=16, **budgets)


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 3000), start_steps=st.integers(0, 20), grid=st.sampled_from([16, 32, 64, 256]),
       extra=st.integers(0, 300), interval=st.integers(0, 8), policy=st.sampled_from(POLICIES),
       branch=st.integers(0, 3000))
def test_everything_lands_on_the_grid(total, start_steps, grid, extra, interval, policy, branch):
    """With a budget of at least one grid step, every pass starts on the grid (the first one at a
    restore point, itself a grid point) and every snapshot is a grid point."""
    start = min(start_steps * grid, total // grid * grid)
    budget = grid + extra
    plan = plan_prefill(total, block_size=16, budget=budget, first_budget=budget + 1, interval=interval,
                        policy=policy, start=start, grid=grid,
                        branch_points=[min(branch, total)] if policy == "free" else ())
    assert all(p.start % grid == 0 for p in plan.passes)
    assert all(position % grid == 0 for position in plan.snapshot_positions)
    assert sum(p.length for p in plan.passes) == total - start
    assert all(p.length >= 1 for p in plan.passes)


def test_simulate_on_the_grid_restores_on_it():
    trace = default_traces(seed=0)[0]
    report = simulate(trace, policy="free", block_size=16, budget=512, interval=4, grid=64)
    assert report.grid == 64
    assert all(r.restore_point % 64 == 0 for r in report.requests)
    assert report.totals.hits > 0


@pytest.mark.parametrize("grid, error", [(0, ValueError), (-4, ValueError), (2.0, TypeError), (True, TypeError)])
def test_bad_grid(grid, error):
    with pytest.raises(error, match="grid"):
        plan_prefill(100, block_size=16, budget=32, grid=grid)
