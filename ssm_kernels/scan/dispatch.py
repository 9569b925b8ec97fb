"""Runs a validated scan on a resolved backend: the Triton kernel or the PyTorch path; and the
steps every prefill pass of mamba2_scan and mamba1_scan shares once its arguments are checked
(captures, backend, algorithm and chunk grid resolved, outputs allocated, the path run)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _replay
from .._common import CaptureTable, ScanResult, Sequences, make_capture_table, new_output, resolve_backend
from .algorithm import check_start_positions
from .problem import ScanProblem
from .torch_kernel import run_torch
from .triton_kernel import run_triton


def run(problem: ScanProblem, backend: str, dt_table: torch.Tensor | None = None) -> None:
    """Run a validated problem on a resolved backend ('triton' or 'torch'); dt_table: where the
    Triton kernel's Mamba-2 table goes (triton_kernel.dt_table), else a new tensor."""
    if backend == "triton":
        run_triton(problem, dt_table)
    else:
        run_torch(problem)


def run_public(problem: ScanProblem, backend: str) -> None:
    """run(problem, backend) for a public call (mamba2_scan or mamba1_scan recurrent,
    selective_state_update): on Triton, from a layout's fourth call on, the kernel's launches
    replayed (_replay.run_public)."""
    if backend != "triton":
        run_torch(problem)
        return
    _replay.run_public(("scan",), problem, lambda: run_triton(problem))


@dataclass(frozen=True)
class PrefillPass:
    """A prefill pass with its settings resolved and its outputs allocated (ScanResult's fields)."""

    captures: CaptureTable
    backend: str
    algorithm: str
    chunk_size: int
    start_positions: list[int]
    y: torch.Tensor
    final_states: torch.Tensor
    captured: torch.Tensor


def prepare_pass(x: torch.Tensor, seqs: Sequences, state_dims: tuple[int, ...], chunked, *, capture, backend,
                 algorithm, chunk_size, start_positions) -> PrefillPass:
    """Resolve a checked pass's settings and allocate y (like x), the final states (nseq,
    *state_dims) and the captured states (ncapture, *state_dims), float32. `chunked` is the
    algorithm's chunked path (mamba2_chunked or mamba1_chunked): its rules and runner."""
    device = x.device
    captures = make_capture_table(capture, seqs, device)
    states = lambda count, name: new_output(count, *state_dims, dtype=torch.float32, device=device, name=name)
    return PrefillPass(
        captures=captures, backend=resolve_backend(backend, device),
        algorithm=chunked.resolve_algorithm(algorithm, device, seqs),
        chunk_size=chunked.check_chunk_size(chunk_size),
        start_positions=check_start_positions(start_positions, seqs),
        y=new_output(*x.shape, dtype=x.dtype, device=device, name="y"),
        final_states=states(seqs.count, "final_states"), captured=states(captures.count, "captured_states"))


def run_pass(prepared: PrefillPass, problem: ScanProblem, chunked) -> ScanResult:
    """Run a prepared pass's problem on its algorithm and backend; its outputs as a ScanResult."""
    if prepared.algorithm == "chunked":
        chunked.run(problem, prepared.backend, prepared.chunk_size, prepared.start_positions)
    else:
        run_public(problem, prepared.backend)
    return ScanResult(prepared.y, prepared.final_states, prepared.captured)
