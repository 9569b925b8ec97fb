"""Which states a prefill step captures, and the cache blocks they go to (vLLM's align mode).

vLLM keeps one Mamba state per request per step: the running state at the chunk end, plus one
in-pass checkpoint at the prompt's block-floored tail. The states at the other block ends a pass
crosses are never materialised (their block-table entries are the null block), so a request that
shares a prefix but leaves it before the tail finds nothing to restore. With in-pass captures
those states cost no extra pass, only a cache block each. The scheduler decides, the worker
follows the block table, so the two never disagree:

- MambaManager (scheduler side) gives a real block instead of the null block to the block ends
  the policy keeps, counts them in admission, and lets the prefix cache keep them (retention
  mask);
- the Mamba metadata builders (worker side) propose a capture at every block end strictly inside
  each prefill row's chunk, plus vLLM's own tail checkpoint (which Mamba-1 layers get too: their
  kv-cache spec asks for it, as vLLM's Mamba-2 layer does), into that column's block-table entry;
  an entry left null becomes the skip slot and the kernels drop that capture (no host round trip);
- the scheduler no longer ends a pass at a shared-prefix junction (vLLM's Marconi-style stop,
  which costs a pass to save the state there): the manager keeps the junction's block end and
  the pass captures it (where every state group is one the plugin captures in).

Memory policy: a state every `interval` tokens (settings.py: SSM_KERNELS_VLLM_CAPTURE_INTERVAL, a
multiple of the block size; default the block size: every block end; 0: vLLM's own policy, the
tail and junction only), plus the block-floored junction vLLM detects for a request. Captured
blocks are ordinary prefix-cache blocks: once the pass has written them and the request has moved
past them they return to the free pool with their hash (evicted least-recently-used, like
attention pages), so they never hold memory a running request needs. While a step runs, a
request holds at most ceil(chunk / interval) + 1 more blocks per Mamba cache group than vLLM's
own; admission and vLLM's reservations for running prefills count none of them, and a step whose
capture blocks do not fit runs without them (vLLM's own blocks), so the plugin never keeps a
request waiting that vLLM alone would serve: in a tight cache it captures less. Off (vLLM's
behaviour) with speculative decoding, with hash blocks finer than cache blocks, outside align
mode, and for the cache groups of vLLM's other state layers (PLUGIN_LAYERS).
"""
from __future__ import annotations

import torch

from . import settings


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_end_columns(first_col: int, num_tokens: int, block_size: int, interval: int) -> list[int]:
    """Block-table columns, from first_col on, whose block end lies strictly before num_tokens
    and on the capture interval (column c holds the state after (c + 1) * block_size tokens)."""
    if interval <= 0:
        return []
    return [c for c in range(first_col, _cdiv(num_tokens, block_size) - 1)
            if ((c + 1) * block_size) % interval == 0]


# The cache groups whose layers the plugin runs. vLLM's other state layers (gated delta net,
# short conv, linear attention) share MambaManager but keep their own kernels, which write only
# vLLM's own states: no block of theirs may be kept for a capture.
PLUGIN_LAYERS = ("MAMBA1", "MAMBA2")


def _spec_active(spec) -> bool:
    return spec.mamba_type.name in PLUGIN_LAYERS and spec.mamba_cache_mode == "align" and \
        spec.num_speculative_blocks == 0


# ---------------------------------------------------------------------------------------------
# Scheduler side: MambaManager
# ---------------------------------------------------------------------------------------------
def manager_active(mgr) -> bool:
    return _spec_active(mgr.kv_cache_spec) and mgr.block_pool.hash_block_size == mgr.block_size


def _manager_interval(mgr) -> int:
    if not manager_active(mgr) or getattr(mgr, "_ssm_suspended", False):
        return 0
    return settings.current.interval(mgr.block_size)


def _extra_columns(mgr, request_id: str, prev_len: int, num_tokens: int) -> list[int]:
    """The null columns this step appends that the policy turns into real blocks."""
    bs, interval = mgr.block_size, _manager_interval(mgr)
    if not interval:
        return []  # vLLM's own policy
    cols = set(block_end_columns(prev_len, num_tokens, bs, interval))
    junction = getattr(mgr, "_ssm_junctions", {}).get(request_id, 0) // bs * bs
    if junction and prev_len <= junction // bs - 1 < _cdiv(num_tokens, bs) - 1:
        cols.add(junction // bs - 1)
    checkpoint = mgr._checkpoints.get(request_id)  # vLLM reserves a real block there itself
    return sorted(c for c in cols if checkpoint is None or c != checkpoint[1])


def patch_manager(MambaManager) -> None:
    get_num = MambaManager.get_num_blocks_to_allocate
    allocate = MambaManager.allocate_new_blocks
    mask = MambaManager.reachable_block_mask.__func__

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                                   num_local_computed_tokens, num_tokens_main_model, apply_admission_cap=False,
                                   prefill_end=0):
        n = get_num(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                    num_local_computed_tokens, num_tokens_main_model, apply_admission_cap=apply_admission_cap,
                    prefill_end=prefill_end)
        # Admission and in-flight reservations (the whole sequence) count vLLM's blocks only: the
        # captures are a step's, counted by the step that takes them.
        if apply_admission_cap or n > self.block_pool.num_gpu_blocks or not manager_active(self):
            return n  # also vLLM's "not now" answer, or the policy off
        prev_len = len(self.req_to_blocks[request_id]) + len(new_computed_blocks)
        extra = len(_extra_columns(self, request_id, prev_len, num_tokens_main_model))
        self._ssm_counted = getattr(self, "_ssm_counted", 0) + extra
        return n + extra

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        blocks = allocate(self, request_id, num_tokens, num_tokens_main_model)
        if not blocks or not manager_active(self):
            return blocks
        req_blocks = self.req_to_blocks[request_id]
        start = len(req_blocks) - len(blocks)
        # The returned blocks are the tail of the request's row (the worker appends them); any
        # other shape (a copy-on-write hand-off) is left as vLLM made it.
        if start < 0 or any(req_blocks[start + i] is not b for i, b in enumerate(blocks)):
            return blocks
        cols = [c for c in _extra_columns(self, request_id, start, num_tokens_main_model)
                if c >= start and req_blocks[c].is_null]
        if cols:
            for c, block in zip(cols, self.block_pool.get_new_blocks(len(cols))):
                req_blocks[c] = block
                blocks[c - start] = block
        return blocks

    def reachable_block_mask(cls, start_block, end_block, alignment_tokens, kv_cache_spec, *args, **kwargs):
        result = mask(cls, start_block, end_block, alignment_tokens, kv_cache_spec, *args, **kwargs)
        if result is None or not _spec_active(kv_cache_spec):
            return result
        interval = settings.current.interval(kv_cache_spec.block_size)
        if interval:
            for i in range(start_block, end_block):
                if ((i + 1) * kv_cache_spec.block_size) % interval == 0:
                    result[i - start_block] = True
        return result

    free = MambaManager.pop_blocks_for_free

    def pop_blocks_for_free(self, request_id):
        getattr(self, "_ssm_junctions", {}).pop(request_id, None)
        return free(self, request_id)

    MambaManager.pop_blocks_for_free = pop_blocks_for_free
    MambaManager.get_num_blocks_to_allocate = get_num_blocks_to_allocate
    MambaManager.allocate_new_blocks = allocate_new_blocks
    MambaManager.reachable_block_mask = classmethod(reachable_block_mask)


def patch_kv_cache_manager(KVCacheManager) -> None:
    """A step whose capture blocks do not fit runs without them, with vLLM's own blocks, rather
    than wait for blocks that may never come free (a tight cache)."""
    allocate_slots = KVCacheManager.allocate_slots

    def allocate_slots_or_fewer_captures(self, request, *args, **kwargs):
        managers = [m for m in self.coordinator.single_type_managers if hasattr(m, "_checkpoints")]
        for m in managers:
            m._ssm_counted = 0
        blocks = allocate_slots(self, request, *args, **kwargs)
        managers = [m for m in managers if m._ssm_counted]
        if blocks is not None or not managers:
            return blocks
        # allocate_slots changed nothing that a second call does not redo the same way (it frees
        # skipped blocks, idempotently, and records vLLM's checkpoint column), so ask again.
        for m in managers:
            m._ssm_suspended = True
        try:
            return allocate_slots(self, request, *args, **kwargs)
        finally:
            for m in managers:
                m._ssm_suspended = False

    KVCacheManager.allocate_slots = allocate_slots_or_fewer_captures


# ---------------------------------------------------------------------------------------------
# Worker side: the metadata builders
# ---------------------------------------------------------------------------------------------
def _builder_active(builder) -> bool:
    spec = builder.kv_cache_spec
    return _spec_active(spec) and builder.vllm_config.cache_config.hash_block_size == spec.block_size


def _tail_checkpoint(builder, md, common, rows):
    """vLLM's prompt-tail checkpoint: the Mamba-2 builder makes it; for Mamba-1 it is made here,
    by vLLM's own rule, since the plugin gives Mamba-1 layers the same spec."""
    if hasattr(md, "checkpoint_meta"):
        return md.checkpoint_meta
    if not builder.kv_cache_spec.num_prefill_checkpoint_blocks:
        return None
    from vllm.model_executor.layers.mamba.checkpoint import MambaPrefillCheckpointBuilder

    ckpt_builder = getattr(builder, "_ssm_checkpoint_builder", None)
    if ckpt_builder is None:
        ckpt_builder = builder._ssm_checkpoint_builder = MambaPrefillCheckpointBuilder(
            builder.vllm_config, builder.kv_cache_spec)
    return ckpt_builder.build(common, rows)


def attach_start_positions(md, common) -> None:
    """Each prefill row's computed-token count (its absolute start position), from vLLM's host
    metadata (seq_lens_cpu_upper_bound is exact for prefill rows): the chunked scan's grid; and
    the prefill rows' cu_seqlens on the host (query_start_loc_p's values)."""
    md._ssm_start_positions = md._ssm_prefill_bounds = None
    if md.num_prefills == 0:
        return
    rows = range(common.num_reqs - md.num_prefills, common.num_reqs)
    seq_lens, starts = common.seq_lens_cpu_upper_bound.tolist(), common.query_start_loc_cpu.tolist()
    md._ssm_start_positions = [seq_lens[r] - (starts[r + 1] - starts[r]) for r in rows]
    md._ssm_prefill_bounds = [starts[r] - starts[rows[0]] for r in rows] + [starts[rows[-1] + 1] - starts[rows[0]]]


def attach_captures(builder, md, common) -> None:
    """List the step's captures on `md`: rows (prefill row), offsets, block-table (request row,
    column) pairs, and the gathered slots."""
    md._ssm_capture = None
    if md.num_prefills == 0 or builder.kv_cache_spec.mamba_cache_mode != "align":
        return
    bs = builder.kv_cache_spec.block_size
    rows = list(range(common.num_reqs - md.num_prefills, common.num_reqs))
    seq_lens = common.seq_lens_cpu_upper_bound.tolist()
    interval = bs if _builder_active(builder) else 0  # propose every block end; the scheduler picks
    entries = {}  # (prefill row, offset) -> (request row, column)
    for i, (r, computed) in enumerate(zip(rows, md._ssm_start_positions)):
        seq_len = seq_lens[r]
        for c in block_end_columns(_cdiv(computed, bs), seq_len, bs, interval):
            entries[(i, (c + 1) * bs - computed)] = (r, c)
    checkpoint = _tail_checkpoint(builder, md, common, rows)
    if checkpoint is not None and checkpoint.offsets is not None:
        for i, offset in enumerate(checkpoint.offsets):
            if offset > 0:
                entries.setdefault((i, offset), (rows[i], _cdiv(seq_lens[rows[i]], bs) - 2))
    if not entries:
        return
    from vllm.utils.torch_utils import async_tensor_h2d

    device = common.block_table_tensor.device
    keys = sorted(entries)
    # Built on pinned host memory and copied without blocking, as vLLM builds its own metadata.
    tensor = lambda values: async_tensor_h2d(values, dtype=torch.int64, device=device)
    req_rows, cols = tensor([entries[k][0] for k in keys]), tensor([entries[k][1] for k in keys])
    md._ssm_capture = ([i for i, _ in keys], [k for _, k in keys], req_rows, cols)


def step_captures(md):
    """(capture_seq, capture_offset, capture_slot) for the step's prefill rows, or Nones: the
    sequences and offsets as host lists, the slots on the device."""
    cap = getattr(md, "_ssm_capture", None)
    slots = getattr(md, "_ssm_capture_slots", None)
    if cap is None or slots is None:
        return None, None, None
    return cap[0], cap[1], slots


def gather_slots(md, block_table: torch.Tensor) -> None:
    """The proposed captures' block-table entries; a null entry (NULL_BLOCK_ID, 0: the
    scheduler kept no state there) becomes PAD_SLOT_ID, which the kernels skip."""
    cap = getattr(md, "_ssm_capture", None)
    if cap is None:
        md._ssm_capture_slots = None
        return
    slots = block_table[cap[2], cap[3]].long()
    md._ssm_capture_slots = torch.where(slots == 0, torch.full_like(slots, -1), slots)


def patch_builder(builder_cls) -> None:
    build = builder_cls.build
    update_block_table = builder_cls.update_block_table

    def build_with_captures(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        md = build(self, common_prefix_len, common_attn_metadata, *args, **kwargs)
        attach_start_positions(md, common_attn_metadata)
        attach_captures(self, md, common_attn_metadata)
        gather_slots(md, common_attn_metadata.block_table_tensor)
        return md

    def update_block_table_with_captures(self, metadata, blk_table, slot_mapping):
        new = update_block_table(self, metadata, blk_table, slot_mapping)
        # Another KV-cache group with the same spec: its own blocks for the same columns.
        new._ssm_capture = getattr(metadata, "_ssm_capture", None)
        new._ssm_start_positions = getattr(metadata, "_ssm_start_positions", None)
        new._ssm_prefill_bounds = getattr(metadata, "_ssm_prefill_bounds", None)
        gather_slots(new, blk_table)
        return new

    builder_cls.build = build_with_captures
    builder_cls.update_block_table = update_block_table_with_captures


# ---------------------------------------------------------------------------------------------
# Scheduler: no pass cut at a shared-prefix junction
# ---------------------------------------------------------------------------------------------
def patch_scheduler(Scheduler) -> None:
    split = Scheduler._mamba_block_aligned_split

    def mamba_block_aligned_split(self, request, num_new_tokens, *args, **kwargs):
        junction = request.shared_prefix_boundary
        managers = [m for m in self.kv_cache_manager.coordinator.single_type_managers if hasattr(m, "_checkpoints")]
        # vLLM stops a pass at the block-floored junction unless it is configured to stop at the
        # exact (sub-block) junction; the managers here keep that block end's state in-pass, if
        # each of them captures (a group the plugin leaves to vLLM still needs vLLM's stop).
        if not junction or not managers or not all(map(_manager_interval, managers)) or \
                self.mamba_shared_prefix_checkpoint:
            return split(self, request, num_new_tokens, *args, **kwargs)
        for m in managers:
            if not hasattr(m, "_ssm_junctions"):
                m._ssm_junctions = {}
            m._ssm_junctions[request.request_id] = junction
        request.shared_prefix_boundary = 0
        try:
            return split(self, request, num_new_tokens, *args, **kwargs)
        finally:
            request.shared_prefix_boundary = junction

    Scheduler._mamba_block_aligned_split = mamba_block_aligned_split
