"""The one layout both scan backends run.

Mamba-2 heads and Mamba-1 channels are the same recurrence seen through different views:
a tile of rows (a head's headdim rows, or a group's channels) sharing B and C. The public
functions turn their arguments into strided views of this layout without copying, so one Triton
kernel and one PyTorch loop serve mamba2_scan, mamba1_scan and selective_state_update.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .._common import CacheSlots, CaptureTable, Sequences

# The kernels keep a state row of next_power_of_2(dstate) fp32 values per thread block row.
MAX_DSTATE = 256


def check_scan_sizes(rows_name: str, rows: int, ngroups: int, dstate: int, **other_sizes: int) -> None:
    """Sizes every scan needs: all >= 1, rows (heads or channels) split evenly into groups, and
    dstate within the kernels' limit."""
    for name, size in ((rows_name, rows), *other_sizes.items(), ("ngroups", ngroups), ("dstate", dstate)):
        if size < 1:
            raise ValueError(f"{name} must be at least 1, got {size}")
    if rows % ngroups:
        raise ValueError(f"{rows_name} ({rows}) must be a multiple of ngroups ({ngroups})")
    if dstate > MAX_DSTATE:
        raise ValueError(f"dstate {dstate} is beyond the kernel's limit of {MAX_DSTATE}")


@dataclass
class ScanProblem(CacheSlots):
    """A validated scan, its outputs allocated.

    Inputs (views; dtype as given unless noted):
        x, z: (batch, seqlen, nheads, headdim); z may be None.
        dt: (batch, seqlen, nheads, headdim); Mamba-2 expands it along headdim (stride 0).
        A: (nheads, headdim, dstate) float32. With a_per_state False only A[:, :, 0] is read
            (Mamba-2: one decay per head); with True every entry is (Mamba-1).
        B, C: (batch, seqlen, ngroups, dstate); head h uses group h // (nheads // ngroups).
        D, dt_bias: (nheads, headdim) or None.
        state_in: (nslots, nheads, headdim, dstate) float32 (bfloat16 or float16 for a decode
            state pool), or None for zero initial states.
        The cache options (state_index, has_initial, skip_slot) are CacheSlots'; and
        state_out_index: (nseq,) int32/int64 or None: sequence s writes state_out[state_out_index[s]]
            instead (decode into another slot).
    Outputs (written by the backend):
        y: (batch, seqlen, nheads, headdim); state_out: (nslots, nheads, headdim, dstate) float32
            (or state_in's dtype for a decode state pool: stored rounded, computed in float32);
        captured: (ncapture, nheads, headdim, dstate) float32, row captures.row[i] taking
            capture i; an engine passes its cache, rows being slots (stored rounded to its dtype).
    """

    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor | None
    z: torch.Tensor | None
    dt_bias: torch.Tensor | None
    dt_softplus: bool
    dt_min: float
    dt_max: float
    a_per_state: bool
    state_in: torch.Tensor | None
    seqs: Sequences
    captures: CaptureTable
    y: torch.Tensor
    state_out: torch.Tensor
    captured: torch.Tensor
    state_out_index: torch.Tensor | None = None

    @property
    def flags(self) -> dict[str, bool]:
        """Every optional-input flag the scan kernels take, derived from the problem in one place
        (a launcher passes a kernel its own: _triton.flags_for)."""
        return dict(
            HAS_D=self.D is not None, D_PER_HEAD=self.D is not None and self.D.stride(-1) == 0,
            HAS_Z=self.z is not None, HAS_DT_BIAS=self.dt_bias is not None,
            DT_SOFTPLUS=self.dt_softplus, A_PER_STATE=self.a_per_state, HAS_INITIAL_STATE=self.state_in is not None,
            HAS_SLOT_OUT=self.state_out_index is not None, IS_VARLEN=self.seqs.varlen,
            HAS_CAPTURE=self.captures.count > 0, **self.slot_flags)

    def replay_key(self) -> tuple[tuple, tuple]:
        """(op, tensors) for _replay.run: what but the tensors decides a Triton path's launches
        (the scalars, the sequences and captures on the host), and the tensors, each once (a
        state pool updated in place is state_in; cu_seqlens's copy is the call's own)."""
        op = (self.dt_softplus, self.dt_min, self.dt_max, self.a_per_state, self.skip_slot, self.seqs.varlen,
              tuple(self.seqs.lengths), tuple(self.captures.entries))
        state_out = None if self.state_out is self.state_in else self.state_out
        return op, (self.x, self.dt, self.A, self.B, self.C, self.D, self.z, self.dt_bias, self.state_in,
                    self.state_index, self.has_initial, self.state_out_index, self.y, state_out, self.captured,
                    self.seqs.cu_seqlens)

    @property
    def dims(self) -> tuple[int, int, int, int]:
        """(nheads, headdim, dstate, ngroups)."""
        _, _, nheads, headdim = self.x.shape
        return nheads, headdim, self.A.shape[2], self.B.shape[2]
