"""Whole-prompt prefill plans under the four planning policies.

A plan lists the passes that prefill [start, total) of a prompt, the positions each pass
captures in-pass, and which pass ends save a snapshot. Positions are absolute; a capture at p
belongs to the pass with ``pass.start < p <= pass.end`` (p == pass.end is its final state).

Policies (names shared with the kernels, the CLI and the benchmarks):

- ``legacy``: passes as the budget proposes them; only a last chunk that spans the tail split
  point is split into two passes. Snapshots at the non-last pass ends that
  :func:`~planner.rules.is_checkpoint_chunk_end` accepts.
- ``split``: :func:`~planner.rules.plan_chunk_len` with block alignment and the split point;
  a last chunk that spans the split point runs as two passes. Snapshots as in ``legacy``.
- ``inpass``: block-aligned like ``split`` but never cut at the split point; the pass that
  strictly spans the split point captures the state there. Snapshots as in ``legacy`` plus
  that capture.
- ``free``: passes as the budget proposes them (the cache-off plan). Every snapshot is an
  in-pass capture: the tail boundary, the tail split point, every multiple of
  ``interval * block_size`` and every branch point given. No pass-end snapshots.

The ``grid`` option serves an SSM scan that continues bit for bit only from states at multiples
of ``grid`` (the chunked scan: its chunk size; the recurrent scan is exact anywhere, grid 1).
With ``grid > 1`` every position the plan works with is put on the grid: non-last passes end at
multiples of ``grid`` (floored, when that stays above the pass start), the tail points are those
of ``lcm(block_size, grid)``-token steps, and interval and branch points are floored to the grid.
So every snapshot, hence every restore point, and every pass start is a grid point, and a warm
request is bit-identical to the cold one. The cost is replay: a match between grid points
restores at the grid point below it (:attr:`WarmRestore.grid_replay_tokens`).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Iterable

from ._checks import check_choice, check_int, check_iterable, check_optional_int, check_size
from .rules import (
    inpass_capture_spans,
    is_checkpoint_chunk_end,
    is_prompt_tail_end,
    plan_chunk_len,
    tail_boundary,
    tail_split_point,
)

POLICIES = ("legacy", "split", "inpass", "free")
# A plan lists every pass and capture: beyond these counts it is refused rather than built, so that
# an absurd prompt length or rule answers at once instead of running out of time or memory.
MAX_PASSES = 100_000
MAX_CAPTURES = 100_000


@dataclass(frozen=True)
class Pass:
    """One prefill pass over [start, start + length).

    ``captures`` are the absolute positions whose state the pass writes in-pass, each in
    ``(start, start + length]``; ``snapshot_at_end`` says whether its final state is saved as
    a pass-end snapshot.
    """

    start: int
    length: int
    captures: tuple[int, ...] = ()
    snapshot_at_end: bool = False

    @property
    def end(self) -> int:
        """The position after the pass's last token."""
        return self.start + self.length

    @property
    def capture_offsets(self) -> tuple[int, ...]:
        """The captures as offsets into the pass (what a kernel takes: 1..=length)."""
        return tuple(position - self.start for position in self.captures)


@dataclass(frozen=True)
class WarmRestore:
    """Where a follow-up request restores from and what it computes again.

    ``replay_tokens`` counts every token computed from the restore point to the end of the
    follow-up (``request_total - restore_point``), as the seed counts "replayed" tokens;
    ``ssm_replay_tokens`` is the part of it whose KV the prefix cache already held
    (``match - restore_point``), computed only because no snapshot sat at the match;
    ``grid_replay_tokens`` is the part of that the plan's grid forces (the match less the grid
    point at or below it, at most ``ssm_replay_tokens``; 0 with grid 1).
    """

    match: int
    restore_point: int
    replay_tokens: int
    ssm_replay_tokens: int
    grid_replay_tokens: int = 0


@dataclass
class PrefillPlan:
    """The passes that prefill [start, total) of a prompt under one policy.

    ``snapshot_positions`` (derived from ``passes``) holds every captured position and every
    pass end that saves a snapshot, sorted.
    """

    total: int
    start: int
    block_size: int
    policy: str
    passes: list[Pass]
    grid: int = 1
    snapshot_positions: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        positions = set()
        for prefill_pass in self.passes:
            positions.update(prefill_pass.captures)
            if prefill_pass.snapshot_at_end:
                positions.add(prefill_pass.end)
        self.snapshot_positions = tuple(sorted(positions))

    @property
    def pass_ends(self) -> tuple[int, ...]:
        """The end position of every pass, in order."""
        return tuple(prefill_pass.end for prefill_pass in self.passes)

    def restore_point(self, match: int) -> int:
        """The deepest snapshot this plan saves at or below ``match``, or 0 when there is none."""
        check_int("match", match)
        below = [position for position in self.snapshot_positions if position <= match]
        return max(below, default=0)

    def warm_restore(
        self, shared_tokens: int | None = None, request_total: int | None = None
    ) -> WarmRestore:
        """Restore point and replay of a follow-up request served after this plan ran.

        The follow-up has ``request_total`` tokens (default: this prompt's total) and shares
        its first ``shared_tokens`` with this prompt (default: as many as both have, i.e. the
        byte-identical warm request by default). Only this plan's snapshots are considered.
        An empty follow-up (or the warm request of an empty prompt) computes nothing.
        """
        request_total = self.total if request_total is None else request_total
        check_int("request_total", request_total)
        limit = min(self.total, request_total)
        shared_tokens = limit if shared_tokens is None else shared_tokens
        check_int("shared_tokens", shared_tokens)
        if shared_tokens > limit:
            raise ValueError(
                f"shared_tokens must be <= {limit} (the shorter of the prompt, {self.total}, "
                f"and the follow-up, {request_total}), got {shared_tokens}"
            )
        match = block_floored_match(shared_tokens, request_total, self.block_size)
        restore = self.restore_point(match)
        return WarmRestore(
            match=match,
            restore_point=restore,
            replay_tokens=request_total - restore,
            ssm_replay_tokens=match - restore,
            grid_replay_tokens=min(match - restore, match % self.grid),
        )


def block_floored_match(shared_tokens: int, total: int, block_size: int) -> int:
    """A prefix match as the cache reports it: ``min(shared_tokens, total - 1)`` floored to a
    multiple of ``block_size`` (at least one token is always computed), and 0 for an empty
    request."""
    check_int("shared_tokens", shared_tokens)
    check_int("total", total)
    check_int("block_size", block_size, minimum=1)
    usable = max(0, min(shared_tokens, total - 1))
    return usable // block_size * block_size


def check_budgets_on_grid(budget: int, first_budget: int | None, grid: int) -> None:
    """Refuse a pass budget below the grid: such a pass cannot end on it."""
    for name, value in (("budget", budget), ("first_budget", first_budget)):
        if value is not None and value < grid:
            raise ValueError(f"{name} ({value}) must be at least the grid ({grid}), so that passes end on it")


def plan_prefill(
    total: int,
    *,
    block_size: int,
    budget: int,
    first_budget: int | None = None,
    interval: int = 0,
    policy: str = "split",
    branch_points: Iterable[int] = (),
    start: int = 0,
    grid: int = 1,
) -> PrefillPlan:
    """Plan the prefill of tokens [start, total) of a ``total``-token prompt.

    The first pass proposes ``min(first_budget or budget, total - start)`` tokens, later
    passes ``min(budget, remaining)``; ``policy`` (one of :data:`POLICIES`) then decides the
    pass lengths, captures and snapshots as the module docstring describes. All rules use
    absolute positions: block boundaries, tail points and interval multiples are those of the
    whole prompt whatever ``start`` is (a plan after a restore at ``start``).
    ``branch_points`` (positions in [0, total]) are captured under ``free`` only; other policies
    reject them. Captures at or below ``start`` or at or above ``total`` are not taken: the
    state at ``start`` is the one restored and the state at ``total`` is the last pass's end.
    ``total == 0`` (or ``start == total``) gives a plan with no passes. ``grid`` puts passes,
    captures and snapshots on multiples of ``grid`` (module docstring).
    """
    check_int("total", total)
    check_int("block_size", block_size, minimum=1)
    check_int("budget", budget, minimum=1)
    check_optional_int("first_budget", first_budget, minimum=1)
    check_int("interval", interval)
    check_choice("policy", policy, POLICIES)
    check_int("start", start)
    check_int("grid", grid, minimum=1)
    if start > total:
        raise ValueError(f"start must be <= total ({total}), got {start}")
    check_budgets_on_grid(budget, first_budget, grid)
    branch_points = _check_branch_points(branch_points, total)
    if branch_points and policy != "free":
        raise ValueError(
            f"branch_points are captured only under policy 'free', got policy {policy!r} "
            f"with branch_points {list(branch_points)}"
        )

    # Tail points and block alignment in steps that are both KV blocks and grid points.
    step = math.lcm(block_size, grid)
    aligned = grid > 1 or policy in ("split", "inpass")
    _check_plan_size(total, start, block_size, budget, interval, policy, step if aligned else None)
    split = tail_split_point(total, step)
    spans = _pass_spans(total, start, step, budget, first_budget, policy, split, grid)

    if policy == "free":
        wanted = _free_capture_positions(total, start, block_size, step, interval, branch_points, grid)
    elif policy == "inpass" and any(inpass_capture_spans(split, s, n) for s, n in spans):
        wanted = [split]
    else:
        wanted = []

    passes = []
    for pass_start, length in spans:
        end = pass_start + length
        captures = tuple(wanted[bisect.bisect_right(wanted, pass_start):bisect.bisect_right(wanted, end)])
        saves_end = (
            policy != "free"
            and end < total
            and end % grid == 0
            and (is_prompt_tail_end(end, total, step)
                 or is_checkpoint_chunk_end(end, total, block_size, interval))
        )
        passes.append(Pass(pass_start, length, captures, saves_end))
    return PrefillPlan(
        total=total, start=start, block_size=block_size, policy=policy, passes=passes, grid=grid
    )


def _check_plan_size(total: int, start: int, block_size: int, budget: int, interval: int, policy: str,
                     align: int | None) -> None:
    """Refuse a plan that would list more than MAX_PASSES passes or MAX_CAPTURES interval captures,
    from bounds computed without listing them.

    Passes as the budget proposes them (``align`` None: legacy and free without a grid): every
    pass but the first and the last is ``budget`` long. Aligned passes (split and inpass, and
    every policy on a grid; ``align`` the alignment step): a pass is either ``budget`` long or
    ends on a multiple of ``align``, and a pass that starts on one is at least ``budget`` floored
    to whole steps long (``budget`` when that is below one step), so any two passes cover at
    least that; the first pass, the pass cut at the split point and the last add at most three.
    """
    tokens = total - start
    if align is None:
        most_passes = -(-tokens // budget) + 2
    else:
        covered = budget if budget < align else budget // align * align
        most_passes = 2 * -(-tokens // covered) + 3
    check_size(f"the passes of a plan of {tokens} tokens at a budget of {budget}", most_passes, MAX_PASSES,
               "raise budget")
    if policy == "free" and interval > 0:
        step = interval * block_size
        check_size(f"the in-pass captures of interval snapshots every {step} tokens (interval {interval} x "
                   f"block_size {block_size}) over {tokens} tokens", max(0, (total - 1) // step - start // step),
                   MAX_CAPTURES, "raise interval")


def _check_branch_points(branch_points: Iterable[int], total: int) -> tuple[int, ...]:
    checked = []
    for position in check_iterable("branch_points", branch_points, "ints"):
        check_int("branch_points entry", position)
        if position > total:
            raise ValueError(f"branch_points entries must be in [0, {total}], got {position}")
        checked.append(position)
        if len(checked) > MAX_CAPTURES:  # each is an in-pass capture; the iterable may be endless
            raise ValueError(f"branch_points must have at most {MAX_CAPTURES} entries (in-pass captures a plan "
                             f"may list), got more")
    return tuple(checked)


def _pass_spans(
    total: int,
    start: int,
    block_size: int,
    budget: int,
    first_budget: int | None,
    policy: str,
    split: int | None,
    grid: int,
) -> list[tuple[int, int]]:
    """(start, length) of every pass under ``policy``; ``block_size`` here is the alignment
    step, and non-last passes end on the grid where they can."""
    spans: list[tuple[int, int]] = []
    offset = start
    while offset < total:
        cap = first_budget if (not spans and first_budget is not None) else budget
        proposed = min(cap, total - offset)
        if policy == "split":
            length = plan_chunk_len(offset, total, proposed, block_size, split)
        elif policy == "inpass":
            length = plan_chunk_len(offset, total, proposed, block_size)
        else:  # legacy and free run passes as proposed
            length = proposed
        on_grid = (offset + length) // grid * grid
        if offset + length < total and on_grid > offset:
            length = on_grid - offset
        is_last = offset + length >= total
        splits_last = policy in ("legacy", "split")
        if is_last and splits_last and inpass_capture_spans(split, offset, length):
            # No in-pass capture under these policies: the tail snapshot needs a pass end.
            spans.append((offset, split - offset))
            spans.append((split, total - split))
            break
        spans.append((offset, length))
        offset += length
    return spans


def _free_capture_positions(
    total: int, start: int, block_size: int, step: int, interval: int,
    branch_points: tuple[int, ...], grid: int,
) -> list[int]:
    """The positions the cache wants under ``free`` (tail points in ``step``-token steps, the
    rest floored to the grid), restricted to (start, total)."""
    wanted = {tail_boundary(total, step), tail_split_point(total, step)}
    wanted.update(p // grid * grid for p in branch_points)
    if interval > 0:
        every = interval * block_size
        # Generate the multiples directly rather than filter pass ends: any position can be
        # captured in-pass.
        wanted.update(p // grid * grid for p in range((start // every + 1) * every, total, every))
    return sorted(p for p in wanted if p is not None and start < p < total)
