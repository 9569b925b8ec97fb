"""The seed's chunk rules: hand-checked values, invariants and bad input."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import (
    inpass_capture_spans,
    is_checkpoint_chunk_end,
    is_prompt_tail_end,
    plan_chunk_len,
    tail_boundary,
    tail_split_point,
)

PROPERTY = settings(max_examples=200, deadline=None)


@pytest.mark.parametrize(
    "total, block_size, boundary, split",
    [
        (32772, 16, 32768, 32752),  # the seed's incident
        (5000, 16, 4992, 4976),
        (32768, 16, 32752, 32736),  # strictly below total: an aligned total steps back
        (33, 16, 32, 16),
        (32, 16, 16, None),  # split point would be token 0
        (17, 16, 16, None),
        (16, 16, None, None),  # total <= block_size
        (1, 16, None, None),
        (0, 16, None, None),
        (3, 1, 2, 1),
    ],
)
def test_tail_points(total, block_size, boundary, split):
    assert tail_boundary(total, block_size) == boundary
    assert tail_split_point(total, block_size) == split


def test_prompt_tail_end():
    assert is_prompt_tail_end(32768, 32772, 16)
    assert is_prompt_tail_end(32752, 32772, 16)
    assert not is_prompt_tail_end(32736, 32772, 16)
    assert not is_prompt_tail_end(32769, 32772, 16)
    assert not is_prompt_tail_end(32772, 32772, 16)
    # No tail points: nothing is a tail end, not even a None-like 0.
    assert not is_prompt_tail_end(0, 16, 16)


def test_checkpoint_chunk_end_uses_floored_block_index():
    # Legacy chunk ends of the incident sit one token past a boundary; 24577 // 16 = 1536,
    # a multiple of 32, so it saved a snapshot.
    for end in (8193, 16385, 24577, 32769):
        assert is_checkpoint_chunk_end(end, 32772, 16, 32)
    assert not is_checkpoint_chunk_end(8193 + 16, 32772, 16, 32)  # block 513
    assert is_checkpoint_chunk_end(512, 32772, 16, 32)  # block 32
    assert not is_checkpoint_chunk_end(15, 32772, 16, 32)  # block 0 never
    assert not is_checkpoint_chunk_end(0, 32772, 16, 1)
    assert is_checkpoint_chunk_end(16, 32772, 16, 1)


def test_checkpoint_chunk_end_interval_zero_keeps_tail_ends_only():
    assert not is_checkpoint_chunk_end(8192, 32772, 16, 0)
    assert is_checkpoint_chunk_end(32752, 32772, 16, 0)
    assert is_checkpoint_chunk_end(32768, 32772, 16, 0)


def test_inpass_capture_spans_is_strict():
    assert inpass_capture_spans(32752, 24576, 8192)
    assert not inpass_capture_spans(32752, 32752, 20)  # at the start
    assert not inpass_capture_spans(32752, 24576, 8176)  # at the end
    assert not inpass_capture_spans(None, 0, 100)


@pytest.mark.parametrize(
    "offset, total, proposed, block_size, split, expected",
    [
        (0, 32772, 8193, 16, 32752, 8192),  # floored to a block boundary
        (24576, 32772, 8192, 16, 32752, 8176),  # cut at the split point
        (32752, 32772, 20, 16, 32752, 20),  # last chunk unchanged
        (0, 5000, 5000, 16, 4976, 5000),  # last chunk unchanged even if it spans the split
        (0, 32772, 8193, None, None, 8193),  # no rules: as proposed
        (10, 100, 5, 16, None, 5),  # floor would not stay above offset
        (10, 100, 30, 16, None, 22),  # end 40 floored to 32
        (10, 100, 30, 16, 20, 10),  # split wins over the block floor
        (5, 100, 0, 16, None, 0),  # empty proposal
    ],
)
def test_plan_chunk_len_examples(offset, total, proposed, block_size, split, expected):
    assert plan_chunk_len(offset, total, proposed, block_size, split) == expected


@PROPERTY
@given(
    total=st.integers(0, 5000),
    data=st.data(),
    block_size=st.one_of(st.none(), st.integers(1, 64)),
    split=st.one_of(st.none(), st.integers(0, 5000)),
)
def test_plan_chunk_len_invariants(total, data, block_size, split):
    offset = data.draw(st.integers(0, total))
    proposed = data.draw(st.integers(1, 6000))
    length = plan_chunk_len(offset, total, proposed, block_size, split)
    assert 1 <= length <= proposed
    end = offset + length
    if offset + proposed >= total:
        assert length == proposed
    elif split is not None and offset < split < offset + proposed:
        assert end == split
    elif block_size:
        aligned = (offset + proposed) // block_size * block_size
        assert end == (aligned if aligned > offset else offset + proposed)
    else:
        assert length == proposed


@PROPERTY
@given(total=st.integers(0, 100_000), block_size=st.integers(1, 512))
def test_tail_points_properties(total, block_size):
    boundary = tail_boundary(total, block_size)
    split = tail_split_point(total, block_size)
    if boundary is None:
        assert total <= block_size
        assert split is None
        return
    assert boundary % block_size == 0
    assert 0 < boundary < total <= boundary + block_size
    assert split == (boundary - block_size if boundary > block_size else None)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: tail_boundary(-1, 16), "total"),
        (lambda: tail_boundary(10, -16), "block_size"),
        (lambda: tail_split_point(-5, 16), "total"),
        (lambda: is_prompt_tail_end(-1, 100, 16), "end_token"),
        (lambda: is_checkpoint_chunk_end(16, 100, 16, -1), "interval"),
        (lambda: inpass_capture_spans(-1, 0, 10), "split"),
        (lambda: inpass_capture_spans(5, -1, 10), "start"),
        (lambda: inpass_capture_spans(5, 0, -10), "count"),
        (lambda: plan_chunk_len(-1, 100, 10), "offset"),
        (lambda: plan_chunk_len(0, -100, 10), "total"),
        (lambda: plan_chunk_len(0, 100, -10), "proposed"),
        (lambda: plan_chunk_len(0, 100, 10, -16), "block_size"),
        (lambda: plan_chunk_len(0, 100, 10, 16, -3), "split"),
        (lambda: plan_chunk_len(101, 100, 10), "offset"),
    ],
)
def test_bad_values_raise_value_error_naming_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.parametrize(
    "call",
    [
        lambda: tail_boundary(100, 0),
        lambda: tail_split_point(100, 0),
        lambda: is_prompt_tail_end(32, 100, 0),
        lambda: is_checkpoint_chunk_end(32, 100, 0, 2),
        lambda: plan_chunk_len(0, 32772, 8193, 0),
    ],
)
def test_block_size_zero_is_refused(call):
    # Every other entry point (plans, the cache, the CLI) refuses 0-token blocks; a rule that
    # answered None for them would pass an impossible size on silently.
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        call()


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: tail_boundary(10.0, 16), "total"),
        (lambda: tail_boundary(10, True), "block_size"),
        (lambda: plan_chunk_len(0, "100", 10), "total"),
        (lambda: inpass_capture_spans("5", 0, 10), "split"),
    ],
)
def test_bad_types_raise_type_error_naming_the_argument(call, name):
    with pytest.raises(TypeError, match=name):
        call()


def test_a_split_one_token_before_the_pass_end_is_spanned():
    """[0, 6) strictly spans 5 (its last token's start): such a non-last pass ends at the split."""
    assert inpass_capture_spans(5, 0, 6)
    assert plan_chunk_len(0, 100, 6, None, 5) == 5
