"""The prefix cache: matches, snapshots, eviction, pins, checked against a simple model."""

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import Match, PrefixCache


PROPERTY = settings(max_examples=200, deadline=None)


def tokens_of(count, seed):
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(count)]


A = tokens_of(64, seed=1)


def test_match_is_block_floored_and_below_the_prompt_length():
    cache = PrefixCache(16)
    cache.insert(A, {})
    assert cache.lookup(A).matched_tokens == 48  # at most 63, floored
    assert cache.lookup(A + [5]).matched_tokens == 64
    assert cache.lookup(A[:40] + [-1] * 30).matched_tokens == 32
    assert cache.lookup([-1] + A[1:]).matched_tokens == 0
    assert cache.lookup([]).matched_tokens == 0


def test_restore_is_the_deepest_snapshot_at_or_below_the_match():
    cache = PrefixCache(16)
    result = cache.insert(A[:48], {20: "s20", 40: "s40"})  # unaligned positions
    assert result.stored == (20, 40)
    # Match 32: the snapshot at 40 needs block [32, 48) and is never returned.
    assert cache.lookup(A[:48]) == (32, 20, "s20")
    assert cache.lookup(A[:49]) == (48, 40, "s40")
    assert cache.lookup(A[:33]) == (32, 20, "s20")
    assert cache.lookup(A[:32]) == (16, 0, None)


def test_partial_block_positions_are_not_stored():
    cache = PrefixCache(16)
    result = cache.insert(A[:40], {32: "full", 33: "partial", 40: "end"})
    assert result.stored == (32,)
    assert result.not_stored == (33, 40)
    assert result.freed == ("partial", "end")
    assert len(cache) == 1 and "partial" not in cache and "full" in cache


def test_diverging_prompts_share_the_common_blocks():
    cache = PrefixCache(16)
    cache.insert(A, {16: "a16", 64: "a64"})
    b = A[:40] + tokens_of(24, seed=2)
    assert cache.branch_point(b) == 32
    cache.insert(b, {48: "b48"})
    assert cache.lookup(b + [0]) == (64, 48, "b48")
    assert cache.lookup(A + [0]) == (64, 64, "a64")
    assert cache.lookup(A[:32] + [-1] * 40) == (32, 16, "a16")
    assert cache.branch_point(b) == 64
    assert cache.branch_point(A[:20]) == 16
    assert cache.branch_point([-1] * 40) == 0


def test_reinsert_keeps_the_held_snapshot():
    cache = PrefixCache(16)
    cache.insert(A, {32: "first"})
    result = cache.insert(A, {32: "second", 48: "new"})
    assert result.stored == (48,) and result.not_stored == (32,)
    assert result.freed == ("second",)
    assert cache.lookup(A[:33]).snapshot == "first"
    # The same handle again is not reported as freed.
    assert cache.insert(A, {32: "first"}).freed == ()
    # Nor from a prompt whose trailing partial block holds its position: the same state.
    result = cache.insert(A[:40], {34: "partial"})
    result = cache.insert(A[:47], {32: "first", 34: "partial"})
    assert result.not_stored == (32, 34) and result.freed == ("partial",) and "first" in cache
    cache.insert(A, {34: "a34"})
    result = cache.insert(A[:40], {34: "a34"})
    assert result.not_stored == (34,) and result.freed == () and "a34" in cache
    with pytest.raises(ValueError, match="already held"):
        cache.insert(A[:33] + [-1] * 7, {34: "a34"})  # another token before it: another state
    # From a prompt whose full block holds other tokens after it (another tree node): the same
    # state, kept where it is, not freed, and not attached to the other node.
    other = A[:34] + [-1] * 30
    result = cache.insert(other, {34: "a34", 64: "o64"})
    assert result.stored == (64,) and result.not_stored == (34,) and result.freed == ()
    assert cache.lookup(other[:49]) == (48, 32, "first")
    assert sorted(cache.handles()) == ["a34", "first", "new", "o64"]


def test_lru_evicts_the_least_recently_used_and_reports_it():
    cache = PrefixCache(16, max_snapshots=2)
    x, y, z = tokens_of(40, 3), tokens_of(40, 4), tokens_of(40, 5)
    cache.insert(x, {32: "x"})
    cache.insert(y, {32: "y"})
    cache.lookup(x)  # x is now more recent than y
    result = cache.insert(z, {32: "z"})
    assert result.evicted == ("y",) and result.freed == ("y",)
    assert cache.lookup(y) == (32, 0, None)
    assert sorted(cache.handles()) == ["x", "z"]
    assert cache.stats.evicted == 1


def test_pinned_snapshot_is_never_evicted():
    cache = PrefixCache(16, max_snapshots=1)
    x, y = tokens_of(40, 3), tokens_of(40, 4)
    cache.insert(x, {32: "x"})
    cache.pin("x")
    cache.pin("x")
    assert cache.insert(y, {32: "y"}).evicted == ("y",)  # the only unpinned one
    cache.unpin("x")
    assert cache.insert(y, {32: "y2"}).evicted == ("y2",)  # still pinned once
    cache.unpin("x")
    assert cache.insert(y, {32: "y3"}).evicted == ("x",)
    with pytest.raises(ValueError, match="not pinned"):
        cache.unpin("y3")
    with pytest.raises(ValueError, match="handle"):
        cache.pin("x")


def utility_scenario(eviction, x1=2048, **options):
    """Snapshots x1 at 2048 and x2 at 2064 on one path, y at 1024 on another, cap 2.

    Recompute saved: x1 2048, x2 only 16 (x1 sits right below it), y 1024. LRU order x1,
    x2, y. Scores at weight 0.5: x1 0.5, x2 0.25 + 0.5 * 16 / 2048 = 0.254, y 0.75.
    """
    cache = PrefixCache(16, max_snapshots=2, eviction=eviction, **options)
    cache.insert(tokens_of(2080, 6), {x1: "x1", 2064: "x2"})
    return cache.insert(tokens_of(1040, 7), {1024: "y"}).evicted


def test_utility_evicts_the_snapshot_that_saves_least():
    assert utility_scenario("lru") == ("x1",)
    assert utility_scenario("utility") == ("x2",)
    assert utility_scenario("utility", utility_weight=0.0) == ("x1",)  # recency only
    # x1 at 2050 shares x2's block: x2 still saves only 14 tokens.
    assert utility_scenario("utility", x1=2050) == ("x2",)


def test_utility_counts_bytes():
    # Utility per byte: a (4096 tokens, 1024 bytes) 4; b (16 tokens, 1 byte) 16; c like a.
    # LRU order b, a, c; scores b 0.5, a 0.125 + 0.25 = 0.375, c 0.625: a goes, LRU takes b.
    for eviction, victim in (("utility", "a"), ("lru", "b")):
        cache = PrefixCache(16, max_snapshots=2, eviction=eviction)
        cache.insert(tokens_of(32, 8), {16: "b"}, nbytes=1)
        cache.insert(tokens_of(4112, 9), {4096: "a"}, nbytes=1024)
        assert cache.insert(tokens_of(4112, 10), {4096: "c"}, nbytes={4096: 1024}).evicted \
            == (victim,)


def test_stats_count_lookups_hits_and_insertions():
    cache = PrefixCache(16)
    cache.insert(A, {16: "a", 40: "b"})
    cache.lookup(A)
    cache.lookup([-1] * 30)
    stats = cache.stats
    assert (stats.lookups, stats.hits, stats.stored, stats.not_stored) == (2, 1, 2, 0)
    assert (stats.matched_tokens, stats.restored_tokens) == (48, 40)


def test_find_changes_nothing_and_record_counts_what_it_found():
    cache = PrefixCache(16)
    cache.insert(A, {16: "a", 40: "b"})
    cache.insert([-1] * 20, {16: "c"})
    order = cache.handles()
    match = cache.find(A)
    assert match == (48, 40, "b") and cache.stats.lookups == 0 and cache.handles() == order
    cache.record(match)
    assert cache.handles()[-1] == "b"
    assert (cache.stats.lookups, cache.stats.hits, cache.stats.restored_tokens) == (1, 1, 40)
    cache.record(cache.find([-2] * 30))  # a miss counts as a lookup only
    assert (cache.stats.lookups, cache.stats.hits) == (2, 1)
    with pytest.raises(ValueError, match="held snapshots"):
        cache.record(Match(matched_tokens=16, restore_point=16, snapshot="gone"))
    with pytest.raises(TypeError, match="match must be a Match"):
        cache.record((16, 16, "a"))
    assert (cache.stats.lookups, cache.stats.hits) == (2, 1)  # refused records count nothing


def test_a_prompt_s_many_snapshots_take_one_walk():
    # 20000 snapshots on one new edge, one a block: each had cost a walk from the root down the
    # edges the earlier ones split, and a copy of the edge's rest (about 100 s; now well under 1).
    n = 20_000
    tokens = tuple(range(n))
    cache = PrefixCache(1)
    began = time.perf_counter()
    result = cache.insert(tokens, {position: position for position in range(1, n)})
    assert time.perf_counter() - began < 10
    assert len(result.stored) == n - 1
    for position in (1, 2, 9_999, n - 1):
        match = cache.lookup(tokens[:position] + (-1,))
        assert (match.matched_tokens, match.restore_point, match.snapshot) == (
            position, position, position)


# -- model-based check ---------------------------------------------------------------------

BLOCK = 2


class Model:
    """The cache's contract, written plainly: every inserted sequence, every held snapshot
    as (the full blocks it needs, position), LRU order and pin counts."""

    def __init__(self, cap):
        self.cap = cap
        self.sequences = []
        self.held = {}
        self.order = []
        self.pins = {}

    def touch(self, handle):
        self.order.remove(handle)
        self.order.append(handle)

    def lookup(self, tokens):
        limit = max(len(tokens) - 1, 0) // BLOCK * BLOCK
        match = 0
        for seq in self.sequences:
            m = 0
            while (m + BLOCK <= min(limit, len(seq) // BLOCK * BLOCK)
                   and seq[m:m + BLOCK] == tokens[m:m + BLOCK]):
                m += BLOCK
            match = max(match, m)
        usable = [(position, handle) for handle, (prefix, position) in self.held.items()
                  if len(prefix) <= match and tokens[:len(prefix)] == prefix]
        if not usable:
            return match, 0, None
        position, handle = max(usable)
        self.touch(handle)
        return match, position, handle

    def insert(self, tokens, snapshots):
        self.sequences.append(tokens)
        full = len(tokens) // BLOCK * BLOCK
        stored, not_stored, freed = [], [], []
        for position in sorted(snapshots):
            key = (tokens[:-(-position // BLOCK) * BLOCK], position)
            same = [handle for handle, value in self.held.items() if value == key]
            if position > full or same:
                not_stored.append(position)
                freed.append(snapshots[position])
                if same:
                    self.touch(same[0])
                continue
            self.held[snapshots[position]] = key
            self.order.append(snapshots[position])
            stored.append(position)
        return stored, not_stored, freed

    def lru_victims(self):
        victims = []
        while self.cap is not None and len(self.held) - len(victims) > self.cap:
            victims.append(next(h for h in self.order
                                if self.pins.get(h, 0) == 0 and h not in victims))
        return victims

    def evict(self, handle):
        assert self.pins.get(handle, 0) == 0, "a pinned snapshot was evicted"
        del self.held[handle]
        self.order.remove(handle)


token_lists = st.lists(st.integers(0, 2), max_size=12).map(tuple)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), token_lists, st.sets(st.integers(1, 12), max_size=4)),
        st.tuples(st.just("lookup"), token_lists, st.just(None)),
        st.tuples(st.just("pin"), st.integers(0, 50), st.just(None)),
        st.tuples(st.just("unpin"), st.integers(0, 50), st.just(None)),
    ),
    max_size=30,
)


@PROPERTY
@given(ops=operations, cap=st.one_of(st.none(), st.integers(0, 4)),
       eviction=st.sampled_from(["lru", "utility"]))
def test_cache_agrees_with_the_model(ops, cap, eviction):
    cache, model = PrefixCache(BLOCK, max_snapshots=cap, eviction=eviction), Model(cap)
    next_handle = 0
    for kind, arg, positions in ops:
        if kind == "insert":
            snapshots = {}
            for position in sorted(p for p in positions if p <= len(arg)):
                snapshots[position] = next_handle
                next_handle += 1
            expected_victims = None
            stored, not_stored, freed = model.insert(arg, snapshots)
            if eviction == "lru":
                expected_victims = model.lru_victims()
            result = cache.insert(arg, snapshots)
            assert (list(result.stored), list(result.not_stored)) == (stored, not_stored)
            if expected_victims is not None:
                assert list(result.evicted) == expected_victims
            for handle in result.evicted:
                assert handle in model.held  # only held snapshots are evicted
                model.evict(handle)
            assert list(result.freed) == freed + list(result.evicted)
        elif kind == "lookup":
            match = cache.lookup(arg)
            assert match.restore_point <= match.matched_tokens
            assert tuple(match) == model.lookup(arg)
        elif kind == "pin" and model.held:
            handle = sorted(model.held)[arg % len(model.held)]
            cache.pin(handle)
            model.pins[handle] = model.pins.get(handle, 0) + 1
        elif kind == "unpin":
            pinned = sorted(h for h, count in model.pins.items() if count and h in model.held)
            if pinned:
                handle = pinned[arg % len(pinned)]
                cache.unpin(handle)
                model.pins[handle] -= 1
        assert sorted(cache.handles()) == sorted(model.held)
        assert cap is None or len(cache) <= cap


# -- bad input -----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(block_size=0), ValueError, "block_size"),
        (dict(block_size=16, max_snapshots=-1), ValueError, "max_snapshots"),
        (dict(block_size=16, eviction="fifo"), ValueError, "eviction"),
        (dict(block_size=16, utility_weight=1.5), ValueError, "utility_weight"),
        (dict(block_size=16, utility_weight="high"), TypeError, "utility_weight"),
        (dict(block_size="16"), TypeError, "block_size"),
    ],
)
def test_constructor_rejects_bad_input(kwargs, error, name):
    with pytest.raises(error, match=name):
        PrefixCache(**kwargs)


@pytest.mark.parametrize(
    "tokens, snapshots, nbytes, error, match",
    [
        (A, {0: "h"}, 1, ValueError, "position"),
        (A, {65: "h"}, 1, ValueError, "position"),
        (A, {16: "h", 32: "h"}, 1, ValueError, "handle"),
        (A, {16: ["h"]}, 1, TypeError, "snapshot handles must be hashable, got list at position 16"),
        (A, {16: None}, 1, ValueError, "snapshot handle at position 16 is None"),  # a Match's "no snapshot"
        (A, [16], 1, TypeError, "snapshots"),
        (A, {16: "h"}, 0, ValueError, "nbytes"),
        (A, {16: "h"}, {16: 0}, ValueError, r"nbytes\[16\] must be >= 1"),
        (A, {16: "h"}, {32: 8}, ValueError, "nbytes"),
        ("some text", {}, 1, TypeError, "tokens"),
        (iter(A), {}, 1, TypeError, "tokens"),
    ],
)
def test_insert_rejects_bad_input(tokens, snapshots, nbytes, error, match):
    cache = PrefixCache(16)
    with pytest.raises(error, match=match):
        cache.insert(tokens, snapshots, nbytes=nbytes)
    assert len(cache) == 0 and cache.lookup(A).matched_tokens == 0  # nothing half-inserted


@pytest.mark.parametrize("call", [
    lambda cache, tokens: cache.insert(tokens, {}),
    lambda cache, tokens: cache.lookup(tokens),
    lambda cache, tokens: cache.branch_point(tokens),
])
def test_unhashable_tokens_are_refused_by_index(call):
    cache = PrefixCache(2)
    with pytest.raises(TypeError, match=r"tokens must hold hashable token ids, got list at index 1"):
        call(cache, [7, [1], 8, 9])
    with pytest.raises(TypeError, match=r"tokens must hold hashable token ids, got set at index 0"):
        call(cache, ({1}, 2, 3))
    assert len(cache) == 0 and cache.lookup([1, 2, 3]).matched_tokens == 0


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), -0.5, 10**400])
def test_utility_weight_must_be_finite_and_in_range(weight):
    with pytest.raises(ValueError, match=r"utility_weight must be"):
        PrefixCache(16, utility_weight=weight)


def test_a_held_handle_cannot_name_another_snapshot():
    cache = PrefixCache(16)
    cache.insert(A, {16: "h"})
    with pytest.raises(ValueError, match="already held"):
        cache.insert(tokens_of(64, 11), {16: "h"})
    with pytest.raises(ValueError, match="already held"):
        cache.insert(A, {32: "h"})
    with pytest.raises(TypeError, match="tokens"):
        cache.lookup(None)
    with pytest.raises(TypeError, match="tokens"):
        cache.branch_point(5)


def test_the_deepest_snapshot_of_a_block_is_restored():
    """33 and 40 hang on the same node (block [32, 48)); a 49-token request matches 48."""
    cache = PrefixCache(16)
    tokens = list(range(64))
    cache.insert(tokens, {33: "a", 40: "b"})
    assert cache.lookup(tokens[:49]) == (48, 40, "b")


def test_nested_prompts_match_the_longest():
    cache = PrefixCache(16)
    tokens = list(range(128))
    for n in (32, 64, 96):
        cache.insert(tokens[:n], {n: n})
    assert cache.lookup(tokens[:97]) == (96, 96, 96)


def test_blocks_of_one_token_match_at_most_all_but_the_last():
    cache = PrefixCache(1)
    cache.insert([1, 2, 3], {3: "s", 1: "t"})
    assert cache.lookup([1, 2, 3]) == (2, 1, "t")
    assert cache.lookup([1, 2, 3, 4]) == (3, 3, "s")


def test_utility_eviction_by_the_class_formula():
    """Utilities (p - q) / nbytes: a 1024, b 16, c 3056; normalised by the largest and blended
    half and half with recency ranks 0, 1/2, 1 (insertion order): a 0.168, b 0.253, c 1.0, so
    a goes, though b saves far less (its recency outweighs it)."""
    cache = PrefixCache(16, max_snapshots=2, eviction="utility")
    result = cache.insert(list(range(5000)), {1024: "a", 1040: "b", 4096: "c"})
    assert result.evicted == ("a",)
    assert sorted(cache.handles()) == ["b", "c"]


def test_utility_ties_go_to_the_least_recently_used():
    """Utilities a 5, b 2 (a below it), c 6; ranks 0, 1/2, 1 (insertion order): a and b both score
    exactly 5/12 at weight 1/2, and a, the least recently used, goes. In floats b's score came out
    one unit in the last place lower, and b went."""
    cache = PrefixCache(1, max_snapshots=2, eviction="utility", utility_weight=0.5)
    cache.insert([0] * 8, {5: "a", 7: "b"})
    assert cache.insert([1] * 8, {6: "c"}).evicted == ("a",)
