"""Replay a serving trace through the planner and the prefix cache, and cost it.

For each request, in order: look the prompt up in the cache (block-floored match, deepest
snapshot at or below it), plan the prefill of [restore point, total) under the policy, insert
the prompt and the plan's snapshots, and count what it cost. Requests run one at a time; the
snapshot restored from is pinned until the request's own snapshots are inserted.

Cost model defaults, from the seed engine's numbers (its doc page and the project's design
notes quote no other measurements):

- ``per_pass_ms = 868``: measured, the seed engine's median time of the extra pass that
  splitting a last chunk at the tail split point adds. The split computes the same tokens in
  one more pass, so that time is taken as the fixed cost of a pass.
- ``per_token_ms = (12500 - 2 * 868) / 8195 = 1.3135``: derived. In the seed's incident the
  byte-identical warm request restored at 24577 and took 12.5 s for the 8195 tokens to 32772;
  under the legacy rules that is two passes (8193 + 2 tokens), whose fixed cost is removed.

The model reproduces the incident's 12.5 s by construction. An extra pass then pays off when
it saves more than 868 / 1.3135 = 661 replayed tokens (derived); the seed engine measured
about 1374 ms of replay saved against the 868 ms pass. The model overstates short passes: the
seed quotes "~0.2 s" for the 20-token warm request of the fixed plan, which this model puts at
868 + 20 * 1.3135 = 894 ms. Use it to rank policies on a trace, not to predict latency.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Hashable, Iterable, Sequence

from ._checks import check_choice, check_int, check_iterable, check_number, check_optional_int, check_tokens
from .cache import EVICTION_POLICIES, PrefixCache
from .plan import POLICIES, check_budgets_on_grid, plan_prefill

DEFAULT_PER_PASS_MS = 868.0
MAX_COST_MS = 1e12  # a bound on either cost that keeps every trace's sums of them finite
DEFAULT_PER_TOKEN_MS = (12_500.0 - 2 * DEFAULT_PER_PASS_MS) / 8195


@dataclass(frozen=True)
class CostModel:
    """Modeled prefill time: ``per_token_ms`` per computed token plus ``per_pass_ms`` per
    pass (defaults and their derivation in the module docstring)."""

    per_token_ms: float = DEFAULT_PER_TOKEN_MS
    per_pass_ms: float = DEFAULT_PER_PASS_MS

    def __post_init__(self) -> None:
        for name in ("per_token_ms", "per_pass_ms"):
            check_number(name, getattr(self, name), 0.0, MAX_COST_MS)

    def prefill_ms(self, tokens: int, passes: int) -> float:
        """Modeled time of a prefill computing ``tokens`` tokens in ``passes`` passes."""
        return tokens * self.per_token_ms + passes * self.per_pass_ms


@dataclass(frozen=True)
class RequestReport:
    """What one request cost.

    ``tokens_computed`` = total - restore point. ``ssm_replay_tokens`` = match - restore point:
    tokens the KV cache held but the SSM had to recompute. ``extra_passes`` = passes minus
    those of the cache-off plan (budget and grid alone) over the same range: never negative, 0 under
    ``free``, and under ``inpass`` positive only where block alignment adds a pass.
    ``branch_point`` is where the prompt left the tree (captured under ``free`` only).
    """

    index: int
    prompt_tokens: int
    matched_tokens: int
    restore_point: int
    branch_point: int
    tokens_computed: int
    ssm_replay_tokens: int
    passes: int
    extra_passes: int
    snapshots_stored: int
    snapshots_evicted: int
    modeled_ms: float


@dataclass(frozen=True)
class Totals:
    """Sums over a trace; ``hit_rate`` is the fraction of requests that restored a snapshot,
    ``snapshots_held`` the cache's size at the end."""

    requests: int
    prompt_tokens: int
    matched_tokens: int
    tokens_computed: int
    ssm_replay_tokens: int
    passes: int
    extra_passes: int
    snapshots_stored: int
    snapshots_evicted: int
    snapshots_held: int
    hits: int
    hit_rate: float
    modeled_ms: float


@dataclass(frozen=True)
class SimulationReport:
    """Per-request and total costs of one trace under one configuration."""

    policy: str
    eviction: str
    block_size: int
    budget: int
    first_budget: int | None
    interval: int
    max_snapshots: int | None
    cost_model: CostModel
    totals: Totals
    grid: int = 1
    requests: list[RequestReport] = field(default_factory=list)

    def to_dict(self) -> dict:
        """Plain dicts, lists and numbers, ready for ``json.dumps``."""
        return asdict(self)


def simulate(
    trace: Iterable[Sequence[Hashable]],
    *,
    policy: str,
    block_size: int,
    budget: int,
    first_budget: int | None = None,
    interval: int = 0,
    max_snapshots: int | None = None,
    eviction: str = "lru",
    cost_model: CostModel | None = None,
    grid: int = 1,
) -> SimulationReport:
    """Serve ``trace`` (prompts as sequences of token ids, in arrival order) with a fresh
    :class:`~planner.cache.PrefixCache` and report what each request and the whole trace cost.

    Snapshot handles are ints numbered from 0 in insertion order. Under ``free`` each
    request's branch point (where it leaves the tree) is captured in-pass. ``grid`` is
    :func:`~planner.plan.plan_prefill`'s: plans (and so snapshots) on multiples of it.
    """
    check_iterable("trace", trace, "prompts")
    check_choice("policy", policy, POLICIES)
    check_int("block_size", block_size, minimum=1)
    check_int("budget", budget, minimum=1)
    check_optional_int("first_budget", first_budget, minimum=1)
    check_int("interval", interval)
    check_optional_int("max_snapshots", max_snapshots)
    check_choice("eviction", eviction, EVICTION_POLICIES)
    check_int("grid", grid, minimum=1)
    check_budgets_on_grid(budget, first_budget, grid)  # here too, for a trace that never plans
    if cost_model is None:
        cost_model = CostModel()
    elif not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")

    cache = PrefixCache(block_size, max_snapshots=max_snapshots, eviction=eviction)
    rules = dict(block_size=block_size, budget=budget, first_budget=first_budget)
    reports: list[RequestReport] = []
    next_handle = 0
    for index, request in enumerate(trace):
        tokens = _check_request(index, request)
        total = len(tokens)
        match = cache.lookup(tokens)
        restore = match.restore_point
        branch = cache.branch_point(tokens)
        if match.snapshot is not None:
            cache.pin(match.snapshot)  # the restore is in flight until this request is done

        plan = plan_prefill(
            total, start=restore, interval=interval, policy=policy, grid=grid,
            branch_points=(branch,) if policy == "free" else (), **rules,
        )
        cache_off = plan_prefill(total, start=restore, policy="free", grid=grid, **rules)

        handles = range(next_handle, next_handle + len(plan.snapshot_positions))
        next_handle += len(handles)
        inserted = cache.insert(tokens, dict(zip(plan.snapshot_positions, handles)))
        if match.snapshot is not None:
            cache.unpin(match.snapshot)

        computed = total - restore
        reports.append(RequestReport(
            index=index,
            prompt_tokens=total,
            matched_tokens=match.matched_tokens,
            restore_point=restore,
            branch_point=branch,
            tokens_computed=computed,
            ssm_replay_tokens=match.matched_tokens - restore,
            passes=len(plan.passes),
            extra_passes=len(plan.passes) - len(cache_off.passes),
            snapshots_stored=len(inserted.stored),
            snapshots_evicted=len(inserted.evicted),
            modeled_ms=cost_model.prefill_ms(computed, len(plan.passes)),
        ))

    return SimulationReport(
        policy=policy,
        eviction=eviction,
        block_size=block_size,
        budget=budget,
        first_budget=first_budget,
        interval=interval,
        max_snapshots=max_snapshots,
        cost_model=cost_model,
        grid=grid,
        totals=_totals(reports, len(cache)),
        requests=reports,
    )


def _check_request(index: int, request: Sequence[Hashable]) -> tuple:
    tokens = check_tokens(f"trace request {index}", request)
    if not tokens:
        raise ValueError(f"trace request {index} must have at least 1 token, got 0")
    return tokens


def _totals(reports: list[RequestReport], held: int) -> Totals:
    def total_of(name: str):
        return sum(getattr(report, name) for report in reports)

    hits = sum(1 for report in reports if report.restore_point > 0)
    return Totals(
        requests=len(reports),
        prompt_tokens=total_of("prompt_tokens"),
        matched_tokens=total_of("matched_tokens"),
        tokens_computed=total_of("tokens_computed"),
        ssm_replay_tokens=total_of("ssm_replay_tokens"),
        passes=total_of("passes"),
        extra_passes=total_of("extra_passes"),
        snapshots_stored=total_of("snapshots_stored"),
        snapshots_evicted=total_of("snapshots_evicted"),
        snapshots_held=held,
        hits=hits,
        hit_rate=hits / len(reports) if reports else 0.0,
        modeled_ms=total_of("modeled_ms"),
    )
