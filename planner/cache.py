"""A prefix cache of SSM snapshots over a radix tree of full KV blocks.

The tree holds token ids in whole blocks of ``block_size``; edges carry one or more blocks and
split at block boundaries where requests diverge or where a snapshot needs a node. A snapshot
at position p (the state after tokens [0, p), p need not be block-aligned) is valid for any
request that shares tokens [0, p); it hangs on the node whose edge ends with the block holding
token p - 1, so a request reaches it only once its block-floored match covers that block.

The tree keeps every block inserted (the attention KV is modeled as unbounded); only the
snapshots are capped, by ``max_snapshots``, and evicted under ``"lru"`` or ``"utility"``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Hashable, Mapping, NamedTuple, Sequence

from ._checks import check_choice, check_int, check_number, check_optional_int, check_tokens

EVICTION_POLICIES = ("lru", "utility")


class Match(NamedTuple):
    """What :meth:`PrefixCache.lookup` found for a request (unpacks as a tuple).

    ``matched_tokens`` is block-floored and at most ``len(tokens) - 1``; ``restore_point`` is
    the position of the deepest snapshot at or below it and ``snapshot`` its handle (0 and
    None when there is none).
    """

    matched_tokens: int
    restore_point: int
    snapshot: Any


@dataclass(frozen=True)
class InsertResult:
    """What :meth:`PrefixCache.insert` did with the snapshots it was given.

    ``stored``: positions newly held. ``not_stored``: positions it did not take, either in
    the trailing partial block (no match can ever reach them) or already held (the existing
    snapshot is kept). ``evicted``: handles of held snapshots evicted to respect
    ``max_snapshots`` (possibly ones stored by this call). ``freed``: every handle the owner
    may release now: those of ``not_stored`` that the cache does not hold (a handle given again
    for a state it holds is kept), followed by ``evicted``.
    """

    stored: tuple[int, ...]
    not_stored: tuple[int, ...]
    evicted: tuple[Any, ...]
    freed: tuple[Any, ...]


@dataclass
class CacheStats:
    """Running counters of a :class:`PrefixCache`."""

    lookups: int = 0
    hits: int = 0  # lookups that returned a snapshot
    matched_tokens: int = 0
    restored_tokens: int = 0  # sum of restore points returned
    stored: int = 0
    not_stored: int = 0
    evicted: int = 0


@dataclass(eq=False)
class _Node:
    edge: tuple  # tokens on the edge into this node, a whole number of blocks
    end: int  # position after the edge's last token
    parent: _Node | None
    children: dict = field(default_factory=dict)  # first block of the child's edge -> child
    snapshots: dict = field(default_factory=dict)  # position -> _Entry


@dataclass(eq=False)
class _Entry:
    position: int
    handle: Hashable
    nbytes: int
    node: _Node
    pins: int = 0


class PrefixCache:
    """Radix tree of token blocks with SSM snapshots attached, capped at ``max_snapshots``.

    Eviction picks among unpinned snapshots only:

    - ``"lru"``: the least recently inserted or returned by :meth:`lookup`.
    - ``"utility"`` (FLOP-aware, after Marconi, MLSys'25): each snapshot's utility is the
      recompute it saves per byte, ``(p - q) / nbytes``, where q is the position of the next
      snapshot below it on its path (0 if none): without it, a request matching at or past p
      restores at q and computes p - q more tokens (tokens stand in for Marconi's FLOPs: the
      SSM recompute is linear in them). The score blends normalized utility with
      recency, ``utility_weight * utility / max_utility + (1 - utility_weight) * rank / (n - 1)``
      (rank 0 the least recently used of the n candidates), and the lowest score is evicted,
      the least recently used first on ties. ``utility_weight=0`` is LRU.

    A pinned snapshot (see :meth:`pin`) is never evicted. The cache still never holds more
    than ``max_snapshots``: only held snapshots can be pinned, so at most that many are, and
    eviction may take a snapshot the same :meth:`insert` just stored.
    Handles are opaque to the cache but must be hashable and unique among held snapshots.
    """

    def __init__(
        self,
        block_size: int,
        max_snapshots: int | None = None,
        eviction: str = "lru",
        *,
        utility_weight: float = 0.5,
    ) -> None:
        self.block_size = check_int("block_size", block_size, minimum=1)
        self.max_snapshots = check_optional_int("max_snapshots", max_snapshots)
        self.eviction = check_choice("eviction", eviction, EVICTION_POLICIES)
        self.utility_weight = check_number("utility_weight", utility_weight, 0.0, 1.0)
        self.stats = CacheStats()
        self._root = _Node(edge=(), end=0, parent=None)
        # Held snapshots by handle, least recently used first.
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()

    def __len__(self) -> int:
        """The number of snapshots held."""
        return len(self._entries)

    def __contains__(self, handle: object) -> bool:
        """Whether a snapshot with this handle is held."""
        try:
            return handle in self._entries
        except TypeError:  # unhashable: never stored
            return False

    def handles(self) -> list:
        """The handles held, least recently used first."""
        return list(self._entries)

    def lookup(self, tokens: Sequence[Hashable]) -> Match:
        """Longest block-floored prefix of ``tokens`` in the tree (at most ``len - 1``) and the
        deepest snapshot at or below it; counts the lookup and refreshes that snapshot's recency
        (:meth:`find` and :meth:`record` in one)."""
        match = self.find(tokens)
        self.record(match)
        return match

    def find(self, tokens: Sequence[Hashable]) -> Match:
        """What :meth:`lookup` returns, with no change to the cache: neither the stats nor the
        recency order move (an engine that may still refuse the request records it later)."""
        tokens = check_tokens("tokens", tokens)
        limit = max(len(tokens) - 1, 0) // self.block_size * self.block_size
        path, matched, _ = self._descend(tokens, limit)
        # Snapshots on a node lie in (node.end - block_size, node.end], so the deepest node on
        # the matched path that has any holds the deepest usable one.
        for node in reversed(path):
            if node.snapshots:
                entry = node.snapshots[max(node.snapshots)]
                return Match(matched_tokens=matched, restore_point=entry.position, snapshot=entry.handle)
        return Match(matched_tokens=matched, restore_point=0, snapshot=None)

    def record(self, match: Match) -> None:
        """Count a lookup that :meth:`find` answered with ``match`` and refresh its snapshot's
        recency; its snapshot must still be held (no eviction since)."""
        if not isinstance(match, Match):
            raise TypeError(f"match must be a Match (what find returns), got {type(match).__name__}")
        if match.snapshot is not None:
            self._held(match.snapshot)
        self.stats.lookups += 1
        self.stats.matched_tokens += match.matched_tokens
        if match.snapshot is None:
            return
        self._entries.move_to_end(match.snapshot)
        self.stats.hits += 1
        self.stats.restored_tokens += match.restore_point

    def branch_point(self, tokens: Sequence[Hashable]) -> int:
        """The block-floored position where ``tokens`` leave the tree: the number of their full
        blocks the tree already holds, times ``block_size``. A snapshot captured there serves
        every later request that shares the prefix (Marconi admits snapshots at such points)."""
        tokens = check_tokens("tokens", tokens)
        _, matched, _ = self._descend(tokens, len(tokens) // self.block_size * self.block_size)
        return matched

    def insert(
        self,
        tokens: Sequence[Hashable],
        snapshots: Mapping[int, Hashable],
        nbytes: int | Mapping[int, int] = 1,
    ) -> InsertResult:
        """Add the full blocks of ``tokens`` to the tree and attach ``snapshots``.

        ``snapshots`` maps positions in ``1..=len(tokens)`` to handles; ``nbytes`` is each
        snapshot's size (one int for all, or a mapping by position), used by ``"utility"``.
        A position in the trailing partial block is not stored, nor is one already held (the
        held snapshot is kept and its recency refreshed: both states are the same bits, and
        the held one may be pinned), nor a held handle given again for its own state (the same
        position and tokens before it, from any prompt). Evicts down to ``max_snapshots``
        afterwards.
        """
        tokens = check_tokens("tokens", tokens)
        sizes = self._check_snapshots(tokens, snapshots, nbytes)
        full = len(tokens) // self.block_size * self.block_size
        self._add_path(tokens, full)

        stored, not_stored, not_stored_handles = [], [], []
        block_end = {position: -(-position // self.block_size) * self.block_size
                     for position in snapshots
                     if position <= full and snapshots[position] not in self._entries}
        nodes = self._nodes_ending_at(tokens, sorted(set(block_end.values())))
        for position in sorted(snapshots):
            handle = snapshots[position]
            if handle in self._entries:  # the same state (checked above), maybe on another path
                self._entries.move_to_end(handle)
                not_stored.append(position)
                continue
            if position > full:
                not_stored.append(position)
                not_stored_handles.append(handle)
                continue
            node = nodes[block_end[position]]
            held = node.snapshots.get(position)
            if held is not None:
                self._entries.move_to_end(held.handle)
                not_stored.append(position)
                not_stored_handles.append(handle)
                continue
            entry = _Entry(position=position, handle=handle, nbytes=sizes[position], node=node)
            node.snapshots[position] = entry
            self._entries[handle] = entry
            stored.append(position)

        self.stats.stored += len(stored)
        self.stats.not_stored += len(not_stored)
        evicted = self._evict_to_cap()
        return InsertResult(
            stored=tuple(stored),
            not_stored=tuple(not_stored),
            evicted=evicted,
            freed=tuple(not_stored_handles) + evicted,
        )

    def pin(self, handle: Hashable) -> None:
        """Protect a held snapshot from eviction (e.g. while a restore from it is in flight).
        Pins nest: each pin needs its own :meth:`unpin`."""
        self._held(handle).pins += 1

    def unpin(self, handle: Hashable) -> None:
        """Undo one :meth:`pin`."""
        entry = self._held(handle)
        if entry.pins == 0:
            raise ValueError(f"handle {handle!r} is not pinned")
        entry.pins -= 1

    # -- internals ---------------------------------------------------------------------------

    def _held(self, handle: Hashable) -> _Entry:
        if handle not in self:
            raise ValueError(f"handle must be one of the held snapshots, got {handle!r}")
        return self._entries[handle]

    def _check_snapshots(
        self, tokens: tuple, snapshots: Mapping[int, Hashable], nbytes: int | Mapping[int, int]
    ) -> dict[int, int]:
        if not isinstance(snapshots, Mapping):
            raise TypeError(
                f"snapshots must be a mapping of positions to handles, got "
                f"{type(snapshots).__name__}"
            )
        if not isinstance(nbytes, Mapping):
            check_int("nbytes", nbytes, minimum=1)
        sizes, seen = {}, {}
        for position, handle in snapshots.items():
            check_int("snapshots position", position, minimum=1)
            if position > len(tokens):
                raise ValueError(
                    f"snapshots position must be <= len(tokens) ({len(tokens)}), got {position}"
                )
            if handle is None:  # a Match's snapshot None means "no snapshot"
                raise ValueError(f"snapshot handle at position {position} is None; handles must not be None")
            try:
                hash(handle)
            except TypeError:
                raise TypeError(
                    f"snapshot handles must be hashable, got {type(handle).__name__} "
                    f"at position {position}"
                ) from None
            if handle in seen:
                raise ValueError(
                    f"snapshot handle {handle!r} given for positions {seen[handle]} and {position}"
                )
            seen[handle] = position
            held = self._entries.get(handle)
            if held is not None and not self._is_same_snapshot(held, tokens, position):
                raise ValueError(
                    f"snapshot handle {handle!r} given for position {position} is already held "
                    f"by another snapshot (position {held.position}); handles must be unique"
                )
            if isinstance(nbytes, Mapping):
                if position not in nbytes:
                    raise ValueError(f"nbytes has no size for snapshot position {position}")
                sizes[position] = check_int(f"nbytes[{position}]", nbytes[position], minimum=1)
            else:
                sizes[position] = nbytes
        return sizes

    def _is_same_snapshot(self, entry: _Entry, tokens: tuple, position: int) -> bool:
        """Whether ``entry`` holds the state at ``position`` of ``tokens``: the same position and
        the same tokens before it (the tokens after it, in its block, may differ)."""
        if entry.position != position:
            return False
        edges, node = [], entry.node
        while node is not None:
            edges.append(node.edge)
            node = node.parent
        held = tuple(token for edge in reversed(edges) for token in edge)
        return held[:position] == tokens[:position]

    def _descend(self, tokens: tuple, limit: int) -> tuple[list[_Node], int, tuple | None]:
        """Follow ``tokens`` down over at most ``limit`` tokens (a multiple of block_size).

        Returns the nodes whose whole edge matched, the tokens matched, and ``(node, k)`` when
        the match ends ``k`` tokens into ``node``'s edge (else None).
        """
        block = self.block_size
        node, matched, path = self._root, 0, []
        while matched + block <= limit:
            child = node.children.get(tokens[matched : matched + block])
            if child is None:
                break
            length = len(child.edge)
            if matched + length <= limit and tokens[matched : matched + length] == child.edge:
                path.append(child)
                matched += length
                node = child
                continue
            # The match ends inside this edge: count its matching blocks (the first matched).
            k = block
            while (
                matched + k + block <= limit
                and tokens[matched + k : matched + k + block] == child.edge[k : k + block]
            ):
                k += block
            return path, matched + k, (child, k)
        return path, matched, None

    def _split(self, node: _Node, cuts: Sequence[int]) -> list[_Node]:
        """Split ``node``'s edge at the absolute positions ``cuts`` (sorted block multiples
        strictly inside it) in one pass over the edge, however many; returns the new nodes, which
        end at the cuts. ``node`` keeps the edge's last piece, and with it its snapshots (they lie
        in its last block)."""
        block, edge = self.block_size, node.edge
        start = node.end - len(edge)
        parent, made = node.parent, []
        for lower, upper in zip((start, *cuts), cuts):
            piece = _Node(edge=edge[lower - start : upper - start], end=upper, parent=parent)
            parent.children[piece.edge[:block]] = piece
            made.append(piece)
            parent = piece
        node.edge = edge[cuts[-1] - start :]
        node.parent = parent
        parent.children[node.edge[:block]] = node
        return made

    def _add_path(self, tokens: tuple, full: int) -> None:
        path, matched, partial = self._descend(tokens, full)
        if matched == full:
            return
        if partial is not None:
            child, k = partial
            node = self._split(child, [child.end - len(child.edge) + k])[0]
        else:
            node = path[-1] if path else self._root
        leaf = _Node(edge=tokens[matched:full], end=full, parent=node)
        node.children[leaf.edge[: self.block_size]] = leaf

    def _nodes_ending_at(self, tokens: tuple, ends: list[int]) -> dict[int, _Node]:
        """The nodes whose edges end at each of ``ends`` (sorted block multiples) on ``tokens``'
        path, already in the tree, splitting edges where needed: one walk down the path, each
        edge split once at all its cuts (a prompt's thousands of snapshots on one new edge had
        cost a walk from the root and a copy of the edge's rest each)."""
        if not ends:
            return {}
        path, _, partial = self._descend(tokens, ends[-1])
        found, i = {}, 0
        for node in path + ([partial[0]] if partial else []):
            j = i
            while j < len(ends) and ends[j] < node.end:
                j += 1
            if j > i:
                found.update(zip(ends[i:j], self._split(node, ends[i:j])))
            if j < len(ends) and ends[j] == node.end:
                found[node.end] = node
                j += 1
            i = j
        return found

    def _evict_to_cap(self) -> tuple:
        evicted = []
        while self.max_snapshots is not None and len(self._entries) > self.max_snapshots:
            # Non-empty: at most max_snapshots are pinned, since the cache held no more than
            # that before this insert and only held snapshots can be pinned.
            candidates = [entry for entry in self._entries.values() if entry.pins == 0]
            victim = candidates[0] if self.eviction == "lru" else self._lowest_score(candidates)
            del victim.node.snapshots[victim.position]
            del self._entries[victim.handle]
            evicted.append(victim.handle)
        self.stats.evicted += len(evicted)
        return tuple(evicted)

    def _lowest_score(self, candidates: list[_Entry]) -> _Entry:
        """The candidate with the lowest blended utility/recency score (see the class doc). Scores
        within float rounding of the lowest are compared again exactly, so that an exact tie goes
        to the least recently used (in floats, of two equal scores either may come out lower)."""
        below = [self._snapshot_below(entry) for entry in candidates]
        last_rank = max(len(candidates) - 1, 1)

        def scores(number):
            utilities = [number(entry.position - q) / entry.nbytes for entry, q in zip(candidates, below)]
            top = max(utilities) or 1
            weight = number(self.utility_weight)
            return [weight * utility / top + (1 - weight) * number(rank) / last_rank
                    for rank, utility in enumerate(utilities)]

        rough = scores(float)
        lowest = min(rough)
        near = [i for i, score in enumerate(rough) if score <= lowest + 1e-9]
        if len(near) > 1:
            exact = scores(Fraction)
            near = [min(near, key=lambda i: (exact[i], i))]
        return candidates[near[0]]

    def _snapshot_below(self, entry: _Entry) -> int:
        """Position of the next held snapshot below ``entry`` on its path, or 0."""
        lower = [p for p in entry.node.snapshots if p < entry.position]
        if lower:
            return max(lower)
        node = entry.node.parent
        while node is not None:
            if node.snapshots:
                return max(node.snapshots)
            node = node.parent
        return 0

