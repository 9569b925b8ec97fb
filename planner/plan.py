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
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterable

from ._checks import check_choice, check_int, check_optional_int
from .rules import (
    inpass_capture_spans,
    is_checkpoint_chunk_end,
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
    (``match - restore_point``), computed only because no snapshot sat at the match.
    """

    match: int
    restore_point: int
    replay_tokens: int
    ssm_replay_tokens: int


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
        its first ``shared_tokens`` with this prompt (default: all of them, i.e. the
        byte-identical warm request). Only this plan's snapshots are considered.
        """
        request_total = self.total if request_total is None else request_total
        check_int("request_total", request_total, minimum=1)
        shared_tokens = self.total if shared_tokens is None else shared_tokens
        check_int("shared_tokens", shared_tokens)
        limit = min(self.total, request_total)
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
    ``total == 0`` (or ``start == total``) gives a plan with no passes.
    """
    check_int("total", total)
    check_int("block_size", block_size, minimum=1)
    check_int("budget", budget, minimum=1)
    check_optional_int("first_budget", first_budget, minimum=1)
    check_int("interval", interval)
    check_choice("policy", policy, POLICIES)
    check_int("start", start)
    if start > total:
        raise ValueError(f"start must be <= total ({total}), got {start}")
    branch_points = _check_branch_points(branch_points, total)
    if branch_points and policy != "free":
        raise ValueError(
            f"branch_points are captured only under policy 'free', got policy {policy!r} "
            f"with branch_points {list(branch_points)}"
        )

    _check_plan_size(total, start, block_size, budget, interval, policy)
    split = tail_split_point(total, block_size)
    spans = _pass_spans(total, start, block_size, budget, first_budget, policy, split)

    if policy == "free":
        wanted = _free_capture_positions(total, start, block_size, interval, branch_points)
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
            and is_checkpoint_chunk_end(end, total, block_size, interval)
        )
        passes.append(Pass(pass_start, length, captures, saves_end))
    return PrefillPlan(
        total=total, start=start, block_size=block_size, policy=policy, passes=passes
    )


def _check_plan_size(total: int, start: int, block_size: int, budget: int, interval: int, policy: str) -> None:
    """Refuse a plan that would list more than MAX_PASSES passes or MAX_CAPTURES interval captures,
    from bounds computed without listing them.

    Under legacy and free every pass but the first and the last is ``budget`` long. Under split
    and inpass a pass is either ``budget`` long or ends on a block boundary, and a pass that
    starts on a boundary is at least ``budget`` floored to whole blocks long (``budget`` when
    that is below one block), so any two passes cover at least that; the first pass, the pass cut
    at the split point and the last add at most three.
    """
    tokens = total - start
    if policy in ("legacy", "free"):
        most_passes = -(-tokens // budget) + 2
    else:
        covered = budget if budget < block_size else budget // block_size * block_size
        most_passes = 2 * -(-tokens // covered) + 3
    if most_passes > MAX_PASSES:
        raise ValueError(f"prefilling {tokens} tokens at a budget of {budget} could take up to {most_passes} passes, "
                         f"more than the {MAX_PASSES} a plan may list: raise budget")
    if policy == "free" and interval > 0:
        step = interval * block_size
        captures = max(0, (total - 1) // step - start // step)
        if captures > MAX_CAPTURES:
            raise ValueError(f"interval snapshots every {step} tokens (interval {interval} x block_size {block_size}) "
                             f"over {tokens} tokens would be {captures} in-pass captures, more than the "
                             f"{MAX_CAPTURES} a plan may list: raise interval")


def _check_branch_points(branch_points: Iterable[int], total: int) -> tuple[int, ...]:
    if isinstance(branch_points, (str, bytes)) or not isinstance(branch_points, Iterable):
        raise TypeError(
            f"branch_points must be an iterable of ints, got {branch_points!r} "
            f"({type(branch_points).__name__})"
        )
    checked = []
    for position in branch_points:
        check_int("branch_points entry", position)
        if position > total:
            raise ValueError(f"branch_points entries must be in [0, {total}], got {position}")
        checked.append(position)
    return tuple(checked)


def _pass_spans(
    total: int,
    start: int,
    block_size: int,
    budget: int,
    first_budget: int | None,
    policy: str,
    split: int | None,
) -> list[tuple[int, int]]:
    """(start, length) of every pass under ``policy``."""
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
    total: int, start: int, block_size: int, interval: int, branch_points: tuple[int, ...]
) -> list[int]:
    """The positions the cache wants under ``free``, restricted to (start, total)."""
    wanted = {tail_boundary(total, block_size), tail_split_point(total, block_size)}
    wanted.update(branch_points)
    if interval > 0:
        step = interval * block_size
        # Generate the multiples directly rather than filter pass ends: any position can be
        # captured in-pass.
        wanted.update(range((start // step + 1) * step, total, step))
    return sorted(p for p in wanted if p is not None and start < p < total)
