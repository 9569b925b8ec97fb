"""What both causal-conv backends run: a validated pass, its outputs allocated."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .._common import CacheSlots, CaptureTable, Sequences


class ConvResult(NamedTuple):
    """What causal_conv1d returns.

    out: (batch, dim, seqlen), x's dtype.
    final_states: (nseq, dim, width - 1), x's dtype: the last width - 1 inputs of each sequence
        (from initial_states where the sequence is shorter than that).
    captured_states: (ncapture, dim, width - 1), x's dtype: the width - 1 inputs before each
        requested offset, in the order given.

    Conv states are inputs, copied bit for bit: no rounding, so x's dtype loses nothing.
    """

    out: torch.Tensor
    final_states: torch.Tensor
    captured_states: torch.Tensor


@dataclass
class ConvProblem(CacheSlots):
    """A validated depthwise causal conv pass (a conv state is the last width - 1 inputs).

    x: (batch, dim, seqlen); weight: (dim, width); bias: (dim,) or None.
    state_in: (nseq, dim, width - 1) in x's dtype, or None for zeros.
    out: like x; state_out: (nseq, dim, width - 1); captured: (ncapture, dim, width - 1).
    The cache options are CacheSlots'.
    """

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    silu: bool
    state_in: torch.Tensor | None
    seqs: Sequences
    captures: CaptureTable
    out: torch.Tensor
    state_out: torch.Tensor
    captured: torch.Tensor

    @property
    def flags(self) -> dict[str, bool]:
        """Every optional-input flag of the conv kernel, derived from the problem in one place."""
        return dict(HAS_BIAS=self.bias is not None, SILU=self.silu, HAS_INITIAL_STATE=self.state_in is not None,
                    IS_VARLEN=self.seqs.varlen, HAS_CAPTURE=self.captures.count > 0, **self.slot_flags)

    def replay_key(self) -> tuple[tuple, tuple]:
        """(op, tensors) for _replay.run: what but the tensors decides the launch (the flags'
        scalars, the sequences and captures on the host), and the tensors, each once (a state
        pool updated in place is state_in)."""
        op = (self.silu, self.skip_slot, self.seqs.varlen, tuple(self.seqs.lengths), tuple(self.captures.entries))
        state_out = None if self.state_out is self.state_in else self.state_out
        return op, (self.x, self.weight, self.bias, self.state_in, self.state_index, self.has_initial, self.out,
                    state_out, self.captured, self.seqs.cu_seqlens)

    @property
    def width(self) -> int:
        return self.weight.shape[1]
