"""causal_conv1d (a prefill pass with conv-state captures) and causal_conv1d_update (one decode
token): validation and dispatch to the Triton kernel or the PyTorch path."""
from __future__ import annotations

import torch

from .. import _replay
from .._common import (FLOAT_DTYPES, NO_CAPTURES, Sequences, check_bool, check_choice, check_decode_slots,
                       check_same_device, check_tensor, check_tensor_args, check_written, make_capture_table,
                       make_sequences, new_output, resolve_backend)
from .problem import ConvProblem, ConvResult
from .torch_kernel import run_torch
from .triton_kernel import run_triton

WEIGHT_DTYPES = FLOAT_DTYPES + (torch.float64,)
ACTIVATIONS = (None, "silu", "swish")  # "swish" is silu's other name (mamba_ssm accepts both)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check_params(x, weight, bias, activation, *, token_dims):
    """Validate x, weight, bias and activation; return (dim, width, silu)."""
    check_tensor("x", x, [(name, None) for name in token_dims[:1]] + [("dim", None)]
                 + [(name, None) for name in token_dims[1:]], FLOAT_DTYPES)
    dim = x.shape[1]
    if dim < 1:
        raise ValueError(f"dim must be at least 1, got {dim}")
    check_tensor("weight", weight, [("dim", dim), ("width", None)], WEIGHT_DTYPES)
    width = weight.shape[1]
    if width < 1:
        raise ValueError(f"width must be at least 1, got weight of shape {tuple(weight.shape)}")
    if bias is not None:
        check_tensor("bias", bias, [("dim", dim)], WEIGHT_DTYPES)
    check_choice("activation", activation, ACTIVATIONS)
    return dim, width, activation is not None


def _check_state(name, t, x, dims):
    check_tensor(name, t, dims)
    if t.dtype != x.dtype:
        raise TypeError(f"{name} must have x's dtype {_dtype_name(x.dtype)} (conv states are inputs), "
                        f"got {_dtype_name(t.dtype)}")


def _run(problem: ConvProblem, backend: str) -> None:
    """On Triton, from a layout's fourth call on, the kernel's launch replayed (_replay.run_public)."""
    if backend != "triton":
        run_torch(problem)
        return
    _replay.run_public(("conv",), problem, lambda: run_triton(problem))


def causal_conv1d(x, weight, bias=None, *, activation=None, initial_states=None, cu_seqlens=None,
                  capture=None, backend="auto") -> ConvResult:
    """Depthwise causal conv over a prefill pass, with the conv state captured at any offsets.

    Per channel d and token t, accumulated in float32 in this fixed order:
        acc = bias[d]; for k in range(width): acc = acc + weight[d, k] * input[d, t - (width - 1) + k]
        out[d, t] = silu(acc) if activation else acc
    where inputs before the pass come from initial_states (zeros without it). The conv state of
    a sequence at offset k is its width - 1 inputs before k: (dim, width - 1), oldest first, in
    x's dtype (states are inputs, copied without rounding).

    Args:
        x: (batch, dim, seqlen) float32, float16 or bfloat16 (any strides).
        weight: (dim, width), any float dtype (an nn.Conv1d weight (dim, 1, width) squeezed).
        bias: (dim,), any float dtype, optional.
        activation: None, "silu" (or "swish").
        initial_states: (nseq, dim, width - 1) in x's dtype, optional (zeros): the inputs
            preceding the pass.
        cu_seqlens: (nseq + 1,) int32/int64 tensor, or a list of ints, optional: a varlen batch
            packed along seqlen (batch must be 1; empty sequences allowed). nseq is batch without
            it. A tensor's values are read back (on a GPU, a sync); a list reads nothing back.
        capture: (ncapture, 2) int tensor or (sequence index, offset) pairs with
            0 <= offset <= that sequence's length; any order, duplicates allowed. Offsets below
            width - 1 include inputs from initial_states.
        backend: "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch".

    Returns:
        ConvResult(out: like x in x's dtype (channels contiguous if x's are), final_states: (nseq, dim, width - 1),
        captured_states: (ncapture, dim, width - 1), both in x's dtype).

    Exact: a sequence gives bit-identical outputs and states however it is split into passes
    (continuing from a captured state), batched or captured, on one device and backend.
    """
    check_tensor_args(dict(x=x, weight=weight), dict(bias=bias, initial_states=initial_states))
    dim, width, silu = _check_params(x, weight, bias, activation, token_dims=("batch", "seqlen"))
    device = check_same_device(x=x, weight=weight, bias=bias, initial_states=initial_states)
    seqs = make_sequences(x.shape[0], x.shape[2], cu_seqlens, device)
    if initial_states is not None:
        _check_state("initial_states", initial_states, x,
                     [("nseq", seqs.count), ("dim", dim), ("width - 1", width - 1)])
    captures = make_capture_table(capture, seqs, device)
    backend = resolve_backend(backend, device)

    if x.stride(1) == 1 and x.stride(2) != 1:  # channels contiguous: out too, so its stores vectorize
        out = new_output(x.shape[0], x.shape[2], dim, dtype=x.dtype, device=device, name="out").transpose(1, 2)
    else:
        out = new_output(*x.shape, dtype=x.dtype, device=device, name="out")
    final_states = new_output(seqs.count, dim, width - 1, dtype=x.dtype, device=device, name="final_states")
    captured = new_output(captures.count, dim, width - 1, dtype=x.dtype, device=device, name="captured_states")
    _run(ConvProblem(x=x, weight=weight, bias=bias, silu=silu, state_in=initial_states, seqs=seqs,
                     captures=captures, out=out, state_out=final_states, captured=captured), backend)
    return ConvResult(out, final_states, captured)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, state_indices=None, *,
                         validate=True, backend="auto") -> torch.Tensor:
    """One decode token per batch row, updating the conv state pool in place.

    Args:
        x: (batch, dim) float32, float16 or bfloat16.
        conv_state: (nslots, dim, width - 1) in x's dtype, updated in place: row b reads and
            writes slot state_indices[b] (default b). No overlapping memory, not requiring grad.
        weight, bias, activation, backend: as in causal_conv1d.
        state_indices: (batch,) int32/int64, distinct slots (default 0..batch-1).
        validate: check every argument, index ranges included (the indices are read on the
            host: one device sync on CUDA). False skips all checks, for callers that already
            validated (a layer's decode step); invalid input is then undefined behaviour.

    Returns:
        out: (batch, dim) in x's dtype.

    Bit-identical to a one-token causal_conv1d pass from the same state (it is one).
    """
    if check_bool("validate", validate):
        check_tensor_args(dict(x=x, conv_state=conv_state, weight=weight), dict(bias=bias, state_indices=state_indices))
        dim, width, silu = _check_params(x, weight, bias, activation, token_dims=("batch",))
        _check_state("conv_state", conv_state, x, [("nslots", None), ("dim", dim), ("width - 1", width - 1)])
        device = check_same_device(x=x, conv_state=conv_state, weight=weight, bias=bias,
                                   state_indices=state_indices)
        check_written(dict(conv_state=conv_state), dict(x=x, weight=weight, bias=bias, state_indices=state_indices))
        check_decode_slots(state_indices, None, None, x.shape[0], conv_state.shape[0], state_name="conv_state")
    else:
        dim, silu, device = x.shape[1], activation is not None, x.device
    batch = x.shape[0]
    seqs = Sequences(None, [1] * batch, varlen=False)
    backend = resolve_backend(backend, device)

    out = new_output(batch, dim, 1, dtype=x.dtype, device=device, name="out")
    # In place by slot: each row's program reads its slot before it overwrites it.
    _run(ConvProblem(x=x.unsqueeze(-1), weight=weight, bias=bias, silu=silu, state_in=conv_state, seqs=seqs,
                     captures=NO_CAPTURES, out=out, state_out=conv_state, captured=conv_state[:0],
                     state_index=state_indices), backend)
    return out[:, :, 0]
