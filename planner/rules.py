"""The chunk rules of the seed engine's prefill planner.

Positions are absolute token indices; "the state at p" is the SSM state after tokens [0, p).
A later request's prefix match is floored to a multiple of ``block_size`` and is at most
``total - 1``, so a snapshot can only be restored if it sits at or below that floor. These rules
decide where prefill chunks end so that the snapshots a warm request needs exist.

``block_size`` is at least 1 everywhere: the seed's ``block_size == 0`` ("no KV blocks") is
refused like every other impossible size; :func:`plan_chunk_len` takes ``None`` for no block
alignment.
"""

from __future__ import annotations

from ._checks import check_int, check_optional_int


def tail_boundary(total: int, block_size: int) -> int | None:
    """The last multiple of ``block_size`` strictly below ``total``.

    Returns None when ``total <= block_size`` (the multiple would be 0). A byte-identical warm
    request's match (at most ``total - 1``, block-floored) lands here.
    """
    check_int("total", total)
    check_int("block_size", block_size, minimum=1)
    if total <= block_size:
        return None
    return (total - 1) // block_size * block_size


def tail_split_point(total: int, block_size: int) -> int | None:
    """The tail split point: one block below :func:`tail_boundary`.

    Returns None when there is no tail boundary or the point is not above token 0. A warm next
    turn's block-floored match lands at the tail boundary or one block below it, so a snapshot
    here is restorable by both.
    """
    boundary = tail_boundary(total, block_size)
    if boundary is None or boundary - block_size <= 0:
        return None
    return boundary - block_size


def is_prompt_tail_end(end_token: int, total: int, block_size: int) -> bool:
    """Whether a chunk ending at ``end_token`` is a prompt-tail checkpoint.

    True at the tail boundary and at the tail split point of a ``total``-token prompt.
    """
    check_int("end_token", end_token)
    return end_token in (tail_boundary(total, block_size), tail_split_point(total, block_size))


def is_checkpoint_chunk_end(end_token: int, total: int, block_size: int, interval: int) -> bool:
    """Whether a non-last chunk ending at ``end_token`` saves an SSM snapshot.

    True at a prompt-tail end (:func:`is_prompt_tail_end`), or when the block index
    ``end_token // block_size`` is a positive multiple of ``interval``. The block index is taken
    by floor division, so an end one token past a block boundary still counts (the seed's
    legacy plans saved snapshots at 8193, 16385, ... this way). Block 0 never counts, and
    ``interval == 0`` turns interval snapshots off.
    """
    check_int("interval", interval)
    if is_prompt_tail_end(end_token, total, block_size):
        return True
    if interval == 0:
        return False
    block_index = end_token // block_size
    return block_index >= 1 and block_index % interval == 0


def inpass_capture_spans(split: int | None, start: int, count: int) -> bool:
    """Whether the pass [start, start + count) strictly spans ``split``.

    Such a pass must capture the state at ``split`` in-pass (or be cut there): the split point
    lies strictly inside it, so neither its start nor its end state is the state at ``split``.
    ``split=None`` (no split point) never spans.
    """
    check_optional_int("split", split)
    check_int("start", start)
    check_int("count", count)
    return split is not None and start < split < start + count


def plan_chunk_len(
    offset: int,
    total: int,
    proposed: int,
    block_size: int | None = None,
    split: int | None = None,
) -> int:
    """Length of the prefill chunk at ``offset`` of a ``total``-token prompt.

    ``proposed`` is the budget-capped length. A last chunk (``offset + proposed >= total``)
    keeps ``proposed`` unchanged. A non-last chunk that strictly spans ``split`` ends there;
    otherwise, with a ``block_size`` (None: no alignment), its end is floored to a block
    boundary when that stays above ``offset``; otherwise it keeps ``proposed``. For
    ``proposed >= 1`` the result is in ``1..=proposed``.
    """
    check_int("offset", offset)
    check_int("total", total)
    check_int("proposed", proposed)
    check_optional_int("block_size", block_size, minimum=1)
    check_optional_int("split", split)
    if offset > total:
        raise ValueError(f"offset must be <= total ({total}), got {offset}")
    end = offset + proposed
    if end >= total:
        return proposed
    if inpass_capture_spans(split, offset, proposed):
        return split - offset
    if block_size is not None:
        aligned_end = end // block_size * block_size
        if aligned_end > offset:
            return aligned_end - offset
    return proposed
