"""Serving the hybrid model with the planner: prefix-cache lookup, restore, chunked prefill by
the plan with in-pass captures, snapshot insertion.

Per request: look the prompt up in the planner's PrefixCache (block-floored match, deepest
snapshot at or below it); restore the Mamba snapshots at the restore point and the attention
KV of positions [0, restore point) from the KV block store; plan [restore point, total) under
the policy; run its passes, capturing the Mamba states the plan asks for inside the passes (and
at pass ends that save a snapshot); insert the prompt's blocks and the new snapshots. Tokens
between the restore point and the match are replayed: the SSM needs them, and their KV is
recomputed bit for bit.

A model on the chunked scan continues bit for bit only from multiples of its chunk size: the
engine plans with that grid (``HybridConfig.scan_grid``), so passes start and snapshots sit on it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from planner import PrefixCache, plan_prefill

from .model import HybridLM, ModelSnapshot
from .model.hybrid import check_int, check_tokens

LOGITS = ("all", "last")


class KVBlockStore:
    """Attention keys and values of token blocks, in a trie keyed by the blocks' tokens (a block's
    KV depends on every token before it, so a block is found by its whole prefix). A block may
    hold only its first rows: on the chunked scan only the rows below the last grid point a pass
    reached are the bits any pass computes, and a snapshot there can sit inside a block.
    Blocks are never evicted, as the planner's cache tree models KV as unbounded."""

    def __init__(self, block_size: int):
        self.block_size = check_int("block_size", block_size, 1)
        self._root: dict = {}
        self.blocks = 0

    def insert(self, tokens: Sequence[int], kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
               end: int | None = None) -> None:
        """Store the KV of positions [0, end) (default: every full block of ``tokens``) in the
        blocks that ``tokens`` fill; kv: per attention layer, (k, v) rows of at least those
        positions. A block held with fewer rows gets the rest (the rows it holds are kept)."""
        bs = self.block_size
        full = len(tokens) // bs * bs
        end = full if end is None else check_int("end", end, 0, len(tokens))
        short = next((t for pair in kv for t in pair if t.shape[0] < end), None)
        if short is not None:
            raise ValueError(f"kv must hold rows of positions [0, {end}), got a tensor of {short.shape[0]} rows")
        node = self._root
        for start in range(0, min(end, full), bs):
            key, rows = tuple(tokens[start:start + bs]), min(bs, end - start)
            block = node.get(key)
            if block is None:
                block = node[key] = _Block([(k[start:start + rows].clone(), v[start:start + rows].clone())
                                            for k, v in kv], rows)
                self.blocks += 1
            elif block.rows < rows:
                more = slice(start + block.rows, start + rows)
                block.kv = [(torch.cat([bk, k[more]]), torch.cat([bv, v[more]]))
                            for (bk, bv), (k, v) in zip(block.kv, kv)]
                block.rows = rows
            node = block.children

    def gather(self, tokens: Sequence[int], end: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per attention layer, (k, v) of positions [0, end) of ``tokens``; None when a block
        holding one of them is missing or holds too few rows."""
        check_int("end", end, 0)
        node, bs = self._root, self.block_size
        blocks = []
        for start in range(0, end, bs):
            block = node.get(tuple(tokens[start:start + bs]))
            if block is None or block.rows < min(bs, end - start):
                return None
            blocks.append(block.kv)
            node = block.children
        if not blocks:
            return []
        return [(torch.cat([b[i][0] for b in blocks])[:end], torch.cat([b[i][1] for b in blocks])[:end])
                for i in range(len(blocks[0]))]


@dataclass
class _Block:
    """A KVBlockStore block: per attention layer, (k, v) of its first ``rows`` positions."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    rows: int
    children: dict = field(default_factory=dict)


@dataclass
class ServeResult:
    """What serving one request did.

    matched: the block-floored prefix match; restore_point: where the state was restored (0:
    cold); replayed: tokens computed (total - restore_point), of which ssm_replayed
    (matched - restore_point) had cached KV; passes: (start, length) of each pass; captures:
    positions captured in-pass (inside or at the end of a pass); snapshots: positions of the
    snapshots this request took; logits: (computed tokens, vocab) for positions
    [restore_point, total) (or the last token's, per the engine's ``logits``); wall_s: seconds.
    """

    total: int
    matched: int
    restore_point: int
    replayed: int
    ssm_replayed: int
    passes: list[tuple[int, int]]
    captures: list[int]
    snapshots: list[int]
    logits: torch.Tensor | None
    wall_s: float


class Engine:
    """Serves prompts one at a time with a PrefixCache of Mamba snapshots and a KVBlockStore.

    policy, block_size, budget, first_budget, interval: as planner.plan_prefill; under "free"
    each request's branch point (where it leaves the cache tree) is captured as well.
    max_snapshots, eviction: as planner.PrefixCache. logits: "all" or "last", what serve returns.
    grid: planner.plan_prefill's grid; None (default) is the model's scan grid, with which every
    warm request is bit-identical to a cold one.
    """

    def __init__(self, model: HybridLM, *, policy: str, block_size: int, budget: int,
                 first_budget: int | None = None, interval: int = 0, max_snapshots: int | None = None,
                 eviction: str = "lru", logits: str = "all", grid: int | None = None):
        if not isinstance(model, HybridLM):
            raise TypeError(f"model must be a HybridLM, got {type(model).__name__}")
        model.check_ready()
        if logits not in LOGITS:
            raise ValueError(f"logits must be one of {LOGITS} (what serve returns), got {logits!r}")
        self.model = model
        self.policy = policy
        grid = model.config.scan_grid if grid is None else grid
        self.rules = dict(block_size=block_size, budget=budget, first_budget=first_budget, grid=grid)
        self.interval = interval
        self.logits = logits
        self.cache = PrefixCache(block_size, max_snapshots=max_snapshots, eviction=eviction)
        self.kv = KVBlockStore(block_size)
        self.snapshots: dict[int, ModelSnapshot] = {}  # handle -> snapshot held by the cache
        self._next_handle = 0
        plan_prefill(0, policy=policy, interval=interval, **self.rules)  # validates the rules now

    def serve(self, tokens: Sequence[int], on_tokens: Callable[[int], None] | None = None) -> ServeResult:
        """Prefill one prompt (a sequence of token ids); ``on_tokens(n)`` after each pass of n."""
        began = time.perf_counter()
        tokens = tuple(check_tokens(tokens, self.model.config.vocab_size))
        if not tokens:
            raise ValueError("a prompt must have at least 1 token")
        if on_tokens is not None and not callable(on_tokens):
            raise TypeError(f"on_tokens must be a function of the pass length or None, got {type(on_tokens).__name__}")
        total = len(tokens)
        # Found and planned before the cache records the lookup: a plan refused (too many
        # passes) leaves the cache's stats and recency order as they were.
        match = self.cache.find(tokens)
        branch = self.cache.branch_point(tokens)
        plan = plan_prefill(total, start=match.restore_point, interval=self.interval, policy=self.policy,
                            branch_points=(branch,) if self.policy == "free" else (), **self.rules)
        self.cache.record(match)
        snapshot = None if match.snapshot is None else self.snapshots[match.snapshot]
        kv = self.kv.gather(tokens, match.restore_point) if snapshot is not None else []
        if kv is None:  # unreachable while KV blocks are never evicted
            raise RuntimeError(f"the KV of positions [0, {match.restore_point}) is not in the block store")
        if snapshot is not None:
            self.cache.pin(match.snapshot)  # the restore is in flight until this request is done
        try:
            state = self.model.restore(snapshot, kv)
            taken: dict[int, ModelSnapshot] = {}
            logits = []
            for p in plan.passes:
                offsets = sorted(set(p.capture_offsets) | ({p.length} if p.snapshot_at_end else set()))
                last = p.end == total
                want = self.logits if (self.logits == "all" or last) else "none"
                out = self.model.forward_pass(tokens[p.start:p.end], state, capture=offsets, logits=want)
                taken.update((s.position, s) for s in out.snapshots)
                if out.logits is not None:
                    logits.append(out.logits)
                if on_tokens is not None:
                    on_tokens(p.length)
            # On the chunked scan a token's outputs (so the KV of every layer after a Mamba layer)
            # depend on the pass's length while its chunk is only partly filled: on its grid, only
            # the rows below the last grid point the prompt reached are the bits any pass
            # computes, and restores (grid points) never need the others.
            grid = self.rules["grid"]
            self.kv.insert(tokens, self.model.kv_rows(state), end=total // grid * grid)
            handles = {}
            for position, snap in sorted(taken.items()):
                handles[position] = self._next_handle
                self.snapshots[self._next_handle] = snap
                self._next_handle += 1
            sizes = {position: max(1, taken[position].nbytes) for position in handles}
            inserted = self.cache.insert(tokens, handles, nbytes=sizes)
            for handle in inserted.freed:
                self.snapshots.pop(handle, None)
        finally:
            if snapshot is not None:
                self.cache.unpin(match.snapshot)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)  # wall_s counts the request's GPU work, its last pass's too
        return ServeResult(
            total=total, matched=match.matched_tokens, restore_point=match.restore_point,
            replayed=total - match.restore_point, ssm_replayed=match.matched_tokens - match.restore_point,
            passes=[(p.start, p.length) for p in plan.passes],
            captures=[c for p in plan.passes for c in p.captures], snapshots=sorted(taken),
            logits=torch.cat(logits) if logits else None, wall_s=time.perf_counter() - began)
