"""The prefill ops' chunked algorithm: the chunked scans of mamba2_scan and mamba1_scan on an
engine's batch, with states read from and written to the cache by slot.

On Triton the kernels read each row's initial state from its slot, write its final state and its
captures into their slots (rounded to the cache's dtype to nearest even, as the recurrent kernels
store them) and leave skipped rows alone, on the batch's own tables: no torch op around them, and
nothing read back (a batch built from host data, prefill_batch's host_cu_seqlens, reads nothing
at all). The step's tables go to the device in one copy, sent by its first layer, and a workspace
is allocated by its first layer of each shape (workspace_key), both kept on the batch.

The PyTorch path (for CPU) plans with the slots on the host (read back once a step where the
batch came from host data) around the public chunked pipelines: it gathers the rows' initial
states from their slots (zeros where a row starts fresh), runs the chunked scan on the packed
pass with the chunk grid at the rows' absolute start positions, then stores the final states
into their slots rounded as above; captures go straight into their slots.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .._common import NO_CAPTURES, CaptureTable, Sequences, capture_lists, int_tables
from ..scan import mamba1_chunked
from ..scan.mamba1_chunked import triton_kernel as mamba1_triton
from ..scan.algorithm import ALGORITHMS, ChunkedRules
from ..scan.mamba2_chunked import make_chunk_tables, run_chunked_torch
from ..scan.mamba2_chunked.triton_kernel import new_workspace, run_chunked_triton, workspace_key
from ..scan.mamba2 import mamba2_problem
from .batch import PrefillBatch, host_indices, per_step, step_chunk_tables, step_scratch


@dataclass(frozen=True)
class ChunkedStep:
    """A step's device tables for the chunked path (see HostStep).

    gather: (nseq,) slot each row's initial state is read from (0 for rows that read none);
    fresh: rows that start from zeros (no initial state, or skipped);
    seqs, captures: the pass for the chunked scan, each capture's row its slot;
    final_rows, final_slots: live rows and the slots their final states go to;
    live_tokens: token indices of the live rows when a skipped row has tokens, else None (the
        scan then writes `out` directly).
    """

    gather: torch.Tensor
    fresh: torch.Tensor
    seqs: Sequences
    captures: CaptureTable
    final_rows: torch.Tensor
    final_slots: torch.Tensor
    live_tokens: torch.Tensor | None


def _step(batch: PrefillBatch) -> ChunkedStep:
    return per_step(batch, "step", lambda: _build_step(batch))


def _build_step(batch: PrefillBatch) -> ChunkedStep:
    host = host_indices(batch)
    device = batch.seqs.cu_seqlens.device
    live = [s for s, slot in enumerate(host.slots) if slot != batch.skip_slot]
    reads = [slot != batch.skip_slot and h for slot, h in zip(host.slots, host.has_initial)]
    seqs = batch.seqs  # varlen, with the true lengths on the host (read back for start_positions)
    bounds = [0]
    for length in seqs.lengths:
        bounds.append(bounds[-1] + length)
    skipped_tokens = any(n for n, slot in zip(seqs.lengths, host.slots) if slot == batch.skip_slot)
    entries, *capture_tables = capture_lists(host.captures, seqs.count)
    gather, fresh, final_rows, final_slots, live_tokens, *capture_tables = int_tables(  # one copy
        device, [slot if r else 0 for slot, r in zip(host.slots, reads)], [s for s, r in enumerate(reads) if not r],
        live, [host.slots[s] for s in live], [t for s in live for t in range(bounds[s], bounds[s + 1])],
        *capture_tables)
    return ChunkedStep(
        gather=gather, fresh=fresh, seqs=seqs,
        captures=CaptureTable(*capture_tables, entries) if entries else NO_CAPTURES,
        final_rows=final_rows, final_slots=final_slots, live_tokens=live_tokens if skipped_tokens else None)


def resolve(algorithm, batch: PrefillBatch, device, rules: ChunkedRules) -> str:
    """The algorithm to run, "recurrent" or "chunked": "auto" as the public scans decide, and
    recurrent for a batch without start positions (the chunked grid needs them)."""
    if batch.host is None and algorithm in ALGORITHMS:
        if algorithm == "chunked":
            raise ValueError("algorithm='chunked' needs each row's absolute start position: build the batch with "
                             "prefill_batch(..., start_positions=...)")
        return "recurrent"
    return rules.resolve_algorithm(algorithm, device, batch.seqs)


def _select(batch: PrefillBatch, name: str, source: torch.Tensor, dim: int, index: torch.Tensor,
            dtype: torch.dtype) -> torch.Tensor:
    """source.index_select(dim, index).to(dtype), into the step's scratch (the cast rounds to
    nearest even, as .to does)."""
    shape = list(source.shape)
    shape[dim] = index.numel()
    picked = torch.index_select(source, dim, index, out=step_scratch(batch, name, shape, source.dtype, source.device))
    if dtype == source.dtype:
        return picked
    return step_scratch(batch, name + " as " + str(dtype), shape, dtype, source.device).copy_(picked)


def _initial_states(batch: PrefillBatch, step: ChunkedStep, cache: torch.Tensor) -> torch.Tensor:
    """The rows' float32 initial states: their slots' states, zeros where a row starts fresh."""
    return _select(batch, "initial states", cache, 0, step.gather, torch.float32).index_fill_(0, step.fresh, 0.0)


def _store_final(batch: PrefillBatch, step: ChunkedStep, cache, final) -> None:
    cache.index_copy_(0, step.final_slots, _select(batch, "final states", final, 0, step.final_rows, cache.dtype))


def _staged(batch: PrefillBatch, step: ChunkedStep, out: torch.Tensor) -> torch.Tensor:
    return out if step.live_tokens is None else step_scratch(batch, "y", out.shape, out.dtype, out.device)


def _unstage(batch: PrefillBatch, step: ChunkedStep, out, y, token_dim: int) -> None:
    if y is not out:
        out.index_copy_(token_dim, step.live_tokens, _select(batch, "live y", y, token_dim, step.live_tokens, y.dtype))


def run_mamba2(batch: PrefillBatch, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, ssm_state, out,
                   backend: str, chunk_size: int) -> None:
    """mamba2_prefill's chunked algorithm; arguments validated (x: (ntokens, nheads, headdim))."""
    u = lambda t: None if t is None else t.unsqueeze(0)
    inputs = (u(x), u(dt), A, u(B), u(C), D, u(z), dt_bias, bool(dt_softplus), dt_limit)
    if backend == "triton":
        # The kernels read and write the slots themselves and leave skipped rows (and their
        # captures) alone: the batch's own tables serve, nothing is read back.
        tables = step_chunk_tables(batch, chunk_size)
        problem = mamba2_problem(*inputs, ssm_state, batch.state_indices, batch.seqs, batch.captures, u(out),
                                 ssm_state, ssm_state, has_initial=batch.has_initial, skip_slot=batch.skip_slot)
        workspace = per_step(batch, ("workspace", chunk_size, workspace_key(problem)),
                             lambda: new_workspace(problem, tables))
        run_chunked_triton(problem, tables, workspace)
        return
    step = _step(batch)
    nheads, headdim, dstate = ssm_state.shape[1:]
    tables = per_step(batch, ("mamba2", chunk_size), lambda: make_chunk_tables(
        step.seqs, step.captures, chunk_size, batch.host.start_positions, x.device))
    final = step_scratch(batch, "final", (step.seqs.count, nheads, headdim, dstate), torch.float32, x.device)
    y = _staged(batch, step, out)
    run_chunked_torch(mamba2_problem(*inputs, _initial_states(batch, step, ssm_state), None, step.seqs,
                                     step.captures, u(y), final, ssm_state), tables)
    _unstage(batch, step, out, y, 0)
    _store_final(batch, step, ssm_state, final)


def run_mamba1(batch: PrefillBatch, make_problem, out, ssm_state, ngroups: int, backend: str,
               chunk_size: int, slot_fields: dict) -> None:
    """mamba1_prefill's chunked algorithm; arguments validated. make_problem(y, **fields) builds
    the layer's ScanProblem writing y (a (dim, ntokens) tensor) with the given state fields;
    slot_fields are those of the scan in place in the cache, by the batch's slots."""
    positions = batch.host.start_positions
    if backend == "triton":  # the kernel reads and writes the slots itself, as for Mamba-2
        problem = make_problem(out, **slot_fields)
        key = ("mamba1 workspace", chunk_size, mamba1_triton.workspace_key(problem))
        mamba1_triton.run_triton(problem, chunk_size, positions, per_step(
            batch, key, lambda: mamba1_triton.new_workspace(problem, chunk_size, positions)))
        return
    step = _step(batch)
    dim, dstate = ssm_state.shape[1:]
    final = step_scratch(batch, "final", (step.seqs.count, dim, dstate), torch.float32, out.device)
    y = _staged(batch, step, out)
    grouped = lambda t: t.unflatten(1, (ngroups, -1))
    problem = make_problem(y, state_in=grouped(_initial_states(batch, step, ssm_state)), state_index=None,
                           seqs=step.seqs, captures=step.captures, state_out=grouped(final),
                           captured=grouped(ssm_state))
    mamba1_chunked.run(problem, backend, chunk_size, positions)
    _unstage(batch, step, out, y, 1)
    _store_final(batch, step, ssm_state, final)
