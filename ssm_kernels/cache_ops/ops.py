"""Per-layer entry points for a serving engine: prefill, conv and decode, in place in its caches.

Each call takes the step's PrefillBatch or DecodeBatch, reads and writes the engine's cache tensors
by slot and writes the output into `out`; on Triton a step's later calls replay the launches of its
first two (_replay.py). By default (algorithm="recurrent") it allocates nothing but the Mamba-2
scan's dt table, once a step (PrefillBatch.prepared): the same kernels as mamba2_scan, mamba1_scan and causal_conv1d
(the recurrent scan, so a sequence's outputs and states are bit-identical however the engine
splits, batches or captures it), launched on views. The prefill scans also take algorithm="chunked"
(the public scans' chunked algorithms, much faster on a GPU for long passes; exact at splits on the
absolute chunk grid: see chunked.py) or "auto".
States are kept in float32 inside the kernels and rounded to the cache's dtype (float32,
float16 or bfloat16) when stored. Tensor parallelism needs nothing special: a rank passes its
own heads (or channels) and its own slice of the cache; slots and captures are rank-local.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from .._common import (FLOAT_DTYPES, check_bool, check_choice, check_dt_limit, check_same_device, check_tensor,
                       check_tensor_args, check_written, resolve_backend)
from ..conv.problem import ConvProblem
from ..conv.torch_kernel import run_torch as run_conv_torch
from ..conv.triton_kernel import run_triton as run_conv_triton
from ..scan import mamba2_chunked
from ..scan import dispatch, mamba1_chunked
from ..scan.mamba2 import check_mamba2_args, mamba2_problem
from ..scan.problem import ScanProblem, check_scan_sizes
from ..scan.triton_kernel import dt_table_shape
from . import chunked
from .. import _replay as replay
from .batch import DecodeBatch, PrefillBatch, host_view, step_scratch

F32 = (torch.float32,)
ACTIVATIONS = (None, "silu", "swish")


def _launch(batch, backend: str, op: tuple, tensors: tuple, call) -> None:
    """call(), the op on the batch: on Triton through the step's replay (_replay.py), where `op`
    names the op and its other arguments and `tensors` are its tensor arguments."""
    if backend == "triton":
        replay.run(batch.launches, op, tensors, call)
    else:
        call()


def _check_out(name, out, shape, dtype):
    check_tensor(name, out, [(f"dim{i}", n) for i, n in enumerate(shape)], FLOAT_DTYPES)
    if out.dtype != dtype:
        raise TypeError(f"{name} must have the input's dtype {dtype}, got {out.dtype}")


def _check_cache(name, cache, dims):
    check_tensor(name, cache, [("nslots", None)] + dims, FLOAT_DTYPES)


def _mamba2_problem(batch, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, ssm_state, out, decode):
    """x: (batch, tokens, nheads, headdim) views; the scan layout over the cache."""
    return mamba2_problem(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, ssm_state, batch.state_indices,
                          batch.seqs, batch.captures, out, ssm_state, ssm_state,
                          has_initial=None if decode else batch.has_initial,
                          state_out_index=batch.dst_state_indices if decode else None, skip_slot=batch.skip_slot)


def _check_mamba2(x, dt, A, B, C, D, z, dt_bias, ssm_state, out, lead):
    nheads, headdim, _, dstate = check_mamba2_args(x, dt, A, B, C, D, z, dt_bias, token_dims=lead)
    _check_cache("ssm_state", ssm_state, [("nheads", nheads), ("headdim", headdim), ("dstate", dstate)])
    _check_out("out", out, x.shape, x.dtype)
    device = check_same_device(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, ssm_state=ssm_state, out=out)
    check_written(dict(out=out, ssm_state=ssm_state), dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias))
    return device


def _check_batch(batch, cls, device, cache_name, cache, ntokens=None, token_axis=None):
    """The batch against the tensors: its device, its rows (decode: ntokens) or tokens (prefill:
    token_axis, which may hold trailing padding), and its slots against the cache's size, since
    the kernels would write past the cache. Slots and tokens are checked where the batch read them
    back to the host (validate=True, CPU tensors or start_positions)."""
    if not isinstance(batch, cls):
        raise TypeError(f"batch must be a {cls.__name__} (from ssm_kernels.cache_ops."
                        f"{cls.__name__.lower()[:-5]}_batch), got {type(batch).__name__}")
    if batch.seqs.cu_seqlens.device != device:
        raise ValueError(f"the batch is on {batch.seqs.cu_seqlens.device} but the tensors are on {device}")
    if ntokens is not None and ntokens != batch.seqs.count:
        raise ValueError(f"the inputs hold {ntokens} rows but the batch has {batch.seqs.count}")
    if token_axis is not None and batch.ntokens is not None and token_axis < batch.ntokens:
        raise ValueError(f"the inputs hold {token_axis} tokens but the batch's cu_seqlens ends at {batch.ntokens}")
    nslots = cache.shape[0]
    for arg, i, slot in batch.extremes:
        if not 0 <= slot < nslots:
            raise ValueError(f"the batch's {arg}[{i}] = {slot} is out of range for {cache_name} with {nslots} slots")


def mamba2_prefill(batch: PrefillBatch, x, dt, A, B, C, *, ssm_state, out, D=None, z=None, dt_bias=None,
                   dt_softplus=False, dt_limit=(0.0, math.inf), backend="auto", algorithm="recurrent",
                   chunk_size=None, validate=True) -> None:
    """One Mamba-2 layer's scan over a prefill step, states in place in the engine's cache.

    Args:
        batch: the step's PrefillBatch.
        x: (ntokens, nheads, headdim) float32/float16/bfloat16, the packed pass.
        dt: (ntokens, nheads); A: (nheads,) float32; B, C: (ntokens, ngroups, dstate).
        ssm_state: (nslots, nheads, headdim, dstate) float32/float16/bfloat16, the cache:
            each row's initial state is read from its slot, its final state and its captures
            are written to their slots.
        out: like x, written (rows of skipped sequences are left as they were).
        D: (nheads,) or (nheads, headdim); z: like x; dt_bias: (nheads,); dt_softplus, dt_limit
            and backend as in mamba2_scan.
        algorithm: "recurrent" (default: exact at any split), "chunked" (the SSD algorithm of
            mamba2_scan(algorithm="chunked"); needs a batch built with start_positions; its
            workspace is built by a step's first layer and reused by the others) or "auto" (mamba2_scan's rule:
            chunked on CUDA from ssm_kernels.scan.mamba2_chunked.AUTO_CHUNKED_MIN_TOKENS tokens in the
            longest row, when the batch has start positions; else recurrent).
        chunk_size: the chunked algorithm's, as in mamba2_scan (default 256).
        validate: check every argument against the others and the batch (default). False skips
            those checks, for an engine whose step's layers all take tensors alike (it may
            validate the step's first layer and not the others); invalid input is then undefined
            behaviour.

    Exact: the chunked algorithm gives the bits of mamba2_scan(algorithm="chunked") on the same
    rows with the same start positions; a row that resumes at a multiple of chunk_size (absolute
    position) from a float32 cache continues a longer pass bit for bit.
    """
    if check_bool("validate", validate):
        device = _check_mamba2(x, dt, A, B, C, D, z, dt_bias, ssm_state, out, ("ntokens",))
        _check_batch(batch, PrefillBatch, device, "ssm_state", ssm_state, token_axis=x.shape[0])
        dt_softplus = check_bool("dt_softplus", dt_softplus)
        dt_limit = check_dt_limit(dt_limit)
    else:
        device, dt_limit = x.device, (float(dt_limit[0]), float(dt_limit[1]))
    backend = resolve_backend(backend, device)
    batch = host_view(batch) if backend == "torch" else batch  # the PyTorch paths walk host lengths
    chunk_size = mamba2_chunked.check_chunk_size(chunk_size)
    algorithm = chunked.resolve(algorithm, batch, device, mamba2_chunked.RULES)

    def call():
        if algorithm == "chunked":
            chunked.run_mamba2(batch, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, ssm_state, out,
                               backend, chunk_size)
            return
        u = lambda t: None if t is None else t.unsqueeze(0)
        problem = _mamba2_problem(batch, u(x), u(dt), A, u(B), u(C), D, u(z), dt_bias, dt_softplus, dt_limit,
                                  ssm_state, u(out), decode=False)
        # the Triton kernel's dt table: one a step, shared by its layers
        table = step_scratch(batch, "dt table", dt_table_shape(problem), torch.float32, device) \
            if backend == "triton" else None
        dispatch.run(problem, backend, table)
    fused = algorithm == "chunked" and mamba2_chunked.triton_kernel.fused_pass_enabled()  # another pass's launches
    _launch(batch, backend, ("mamba2_prefill", algorithm, chunk_size, dt_softplus, dt_limit, fused),
            (x, dt, A, B, C, D, z, dt_bias, ssm_state, out), call)


def mamba2_decode(batch: DecodeBatch, x, dt, A, B, C, *, ssm_state, out, D=None, z=None, dt_bias=None,
                  dt_softplus=False, dt_limit=(0.0, math.inf), backend="auto", validate=True) -> None:
    """One decode token per row for one Mamba-2 layer, the state updated in the cache.

    x: (batch, nheads, headdim); dt: (batch, nheads); B, C: (batch, ngroups, dstate);
    ssm_state: (nslots, nheads, headdim, dstate); out like x; the rest as in mamba2_prefill
    (validate too). Bit-identical to a one-token prefill from the same state.
    """
    if check_bool("validate", validate):
        device = _check_mamba2(x, dt, A, B, C, D, z, dt_bias, ssm_state, out, ("batch",))
        _check_batch(batch, DecodeBatch, device, "ssm_state", ssm_state, x.shape[0])
        dt_softplus = check_bool("dt_softplus", dt_softplus)
        dt_limit = check_dt_limit(dt_limit)
    else:
        device, dt_limit = x.device, (float(dt_limit[0]), float(dt_limit[1]))
    backend = resolve_backend(backend, device)
    u = lambda t: None if t is None else t.unsqueeze(1)
    call = lambda: dispatch.run(_mamba2_problem(batch, u(x), u(dt), A, u(B), u(C), D, u(z), dt_bias, dt_softplus,
                                                dt_limit, ssm_state, u(out), decode=True), backend)
    _launch(batch, backend, ("mamba2_decode", dt_softplus, dt_limit), (x, dt, A, B, C, D, z, dt_bias, ssm_state, out),
            call)


def _check_mamba1(u, delta, A, B, C, D, z, delta_bias, ssm_state, out, token_axis):
    """u: (dim, ntokens) for prefill, (batch, dim) for decode. Returns (device, ngroups)."""
    check_tensor_args(dict(u=u, delta=delta, A=A, B=B, C=C, ssm_state=ssm_state, out=out),
                      dict(D=D, z=z, delta_bias=delta_bias))
    check_tensor("u", u, [("a", None), ("b", None)], FLOAT_DTYPES)
    dim = u.shape[0] if token_axis == 1 else u.shape[1]
    check_tensor("delta", delta, [("a", u.shape[0]), ("b", u.shape[1])], FLOAT_DTYPES)
    check_tensor("A", A, [("dim", dim), ("dstate", None)], F32)
    dstate = A.shape[1]
    if token_axis == 1:  # B, C: (ngroups, dstate, ntokens) or (dstate, ntokens)
        lead = [] if B.ndim == 2 else [("ngroups", None)]
        b_dims = lead + [("dstate", dstate), ("ntokens", u.shape[1])]
    else:  # (batch, ngroups, dstate) or (batch, dstate)
        lead = [("batch", u.shape[0])] + ([] if B.ndim == 2 else [("ngroups", None)])
        b_dims = lead + [("dstate", dstate)]
    check_tensor("B", B, b_dims, FLOAT_DTYPES)
    check_tensor("C", C, [(n, B.shape[i]) for i, (n, _) in enumerate(b_dims)], FLOAT_DTYPES)
    ngroups = 1 if B.ndim == 2 else B.shape[1 if token_axis == 0 else 0]
    check_scan_sizes("dim", dim, ngroups, dstate)
    for name, t in (("D", D), ("delta_bias", delta_bias)):
        if t is not None:
            check_tensor(name, t, [("dim", dim)], FLOAT_DTYPES)
    if z is not None:
        check_tensor("z", z, [("a", u.shape[0]), ("b", u.shape[1])], FLOAT_DTYPES)
    _check_cache("ssm_state", ssm_state, [("dim", dim), ("dstate", dstate)])
    _check_out("out", out, u.shape, u.dtype)
    device = check_same_device(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias,
                               ssm_state=ssm_state, out=out)
    check_written(dict(out=out, ssm_state=ssm_state), dict(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z,
                                                           delta_bias=delta_bias))
    return device, ngroups


def _mamba1_problem(rows, bc, A, D, delta_bias, delta_softplus, ngroups, **state_fields):
    """rows: (x, dt, z, y) in the scan layout (1 or batch, tokens, G, P); state_fields: the
    ScanProblem's state, sequence and capture fields."""
    grouped = lambda t: None if t is None else t.unflatten(0, (ngroups, -1))
    x, dt, z, y = rows
    return ScanProblem(
        x=x, dt=dt, A=grouped(A), B=bc[0], C=bc[1], D=grouped(D), z=z, dt_bias=grouped(delta_bias),
        dt_softplus=delta_softplus, dt_min=-math.inf, dt_max=math.inf, a_per_state=True, y=y,
        **state_fields)


def _cache_fields(batch, ssm_state, ngroups, decode):
    """The state fields of a scan in place in the cache, by the batch's slots."""
    states = ssm_state.unflatten(1, (ngroups, -1))
    return dict(state_in=states, state_index=batch.state_indices, seqs=batch.seqs, captures=batch.captures,
                state_out=states, captured=states, has_initial=None if decode else batch.has_initial,
                state_out_index=batch.dst_state_indices if decode else None, skip_slot=batch.skip_slot)


def mamba1_prefill(batch: PrefillBatch, u, delta, A, B, C, *, ssm_state, out, D=None, z=None, delta_bias=None,
                   delta_softplus=False, backend="auto", algorithm="recurrent", chunk_size=None,
                   validate=True) -> None:
    """One Mamba-1 layer's scan over a prefill step (selective_scan_fn's varlen layout).

    u, delta, z, out: (dim, ntokens); A: (dim, dstate) float32; B, C: (dstate, ntokens) or
    (ngroups, dstate, ntokens); D, delta_bias: (dim,); ssm_state: (nslots, dim, dstate) cache.
    algorithm, chunk_size: as in mamba2_prefill, with mamba1_scan's chunked algorithm (chunk_size
    default 64, at most 256; "auto" from ssm_kernels.scan.mamba1_chunked.AUTO_CHUNKED_MIN_TOKENS).
    validate: as in mamba2_prefill.
    """
    if check_bool("validate", validate):
        device, ngroups = _check_mamba1(u, delta, A, B, C, D, z, delta_bias, ssm_state, out, token_axis=1)
        _check_batch(batch, PrefillBatch, device, "ssm_state", ssm_state, token_axis=u.shape[1])
        delta_softplus = check_bool("delta_softplus", delta_softplus)
    else:
        device, ngroups = u.device, 1 if B.ndim == 2 else B.shape[0]
    backend = resolve_backend(backend, device)
    batch = host_view(batch) if backend == "torch" else batch  # the PyTorch paths walk host lengths
    chunk_size = mamba1_chunked.check_chunk_size(chunk_size)
    rows = lambda t: None if t is None else t.unflatten(0, (ngroups, -1)).permute(2, 0, 1).unsqueeze(0)
    bc = lambda t: (t.unsqueeze(0) if t.ndim == 2 else t).permute(2, 0, 1).unsqueeze(0)  # (1, T, G, N)
    problem = lambda y, **fields: _mamba1_problem((rows(u), rows(delta), rows(z), rows(y)), (bc(B), bc(C)), A, D,
                                                  delta_bias, delta_softplus, ngroups, **fields)
    algorithm = chunked.resolve(algorithm, batch, device, mamba1_chunked.RULES)

    def call():
        if algorithm == "chunked":
            chunked.run_mamba1(batch, problem, out, ssm_state, ngroups, backend, chunk_size,
                               _cache_fields(batch, ssm_state, ngroups, False))
        else:
            dispatch.run(problem(out, **_cache_fields(batch, ssm_state, ngroups, False)), backend)
    _launch(batch, backend, ("mamba1_prefill", algorithm, chunk_size, delta_softplus),
            (u, delta, A, B, C, D, z, delta_bias, ssm_state, out), call)


def mamba1_decode(batch: DecodeBatch, u, delta, A, B, C, *, ssm_state, out, D=None, z=None, delta_bias=None,
                  delta_softplus=False, backend="auto", validate=True) -> None:
    """One decode token per row for one Mamba-1 layer.

    u, delta, z, out: (batch, dim); B, C: (batch, dstate) or (batch, ngroups, dstate); the rest as
    in mamba1_prefill (validate too).
    """
    if check_bool("validate", validate):
        device, ngroups = _check_mamba1(u, delta, A, B, C, D, z, delta_bias, ssm_state, out, token_axis=0)
        _check_batch(batch, DecodeBatch, device, "ssm_state", ssm_state, u.shape[0])
        delta_softplus = check_bool("delta_softplus", delta_softplus)
    else:
        device, ngroups = u.device, 1 if B.ndim == 2 else B.shape[1]
    backend = resolve_backend(backend, device)
    rows = lambda t: None if t is None else t.unflatten(1, (ngroups, -1)).unsqueeze(1)  # (batch, 1, G, P)
    bc = lambda t: (t.unsqueeze(1) if t.ndim == 2 else t).unsqueeze(1)  # (batch, 1, G, N)
    call = lambda: dispatch.run(_mamba1_problem(
        (rows(u), rows(delta), rows(z), rows(out)), (bc(B), bc(C)), A, D, delta_bias, delta_softplus, ngroups,
        **_cache_fields(batch, ssm_state, ngroups, True)), backend)
    _launch(batch, backend, ("mamba1_decode", delta_softplus), (u, delta, A, B, C, D, z, delta_bias, ssm_state, out),
            call)


def _check_conv(x, weight, bias, conv_state, out, activation):
    check_tensor("weight", weight, [("dim", None), ("width", None)], FLOAT_DTYPES + (torch.float64,))
    dim, width = weight.shape
    if x.shape[0] != dim:
        raise ValueError(f"x has {x.shape[0]} channels but weight has {dim}")
    if width < 2:
        raise ValueError(f"the conv width must be at least 2 to keep a state, got {width}")
    if bias is not None:
        check_tensor("bias", bias, [("dim", dim)], FLOAT_DTYPES + (torch.float64,))
    _check_cache("conv_state", conv_state, [("dim", dim), ("width - 1", width - 1)])
    _check_out("out", out, x.shape, x.dtype)
    check_choice("activation", activation, ACTIVATIONS)
    device = check_same_device(x=x, weight=weight, bias=bias, conv_state=conv_state, out=out)
    # The Triton kernel stores a tile's outputs before it reads the inputs of the conv states
    # from x: out over x would put outputs into the states.
    check_written(dict(out=out, conv_state=conv_state), dict(x=x, weight=weight, bias=bias))
    return device


def conv_prefill(batch: PrefillBatch, x, weight, bias=None, *, conv_state, out, activation=None,
                 backend="auto", validate=True) -> None:
    """One layer's causal conv over a prefill step, conv states in place in the engine's cache.

    Args:
        x: (dim, ntokens) float32/float16/bfloat16 (any strides), the packed pass.
        weight: (dim, width); bias: (dim,), optional; activation: None or "silu".
        conv_state: (nslots, dim, width - 1), any strides: vLLM's (nslots, width - 1, dim)
            layout is passed as its transpose view. Slot contents are the width - 1 inputs before
            a position, oldest first; rows read their slot (has_initial_state), final states and
            captures are written in the cache's dtype.
        out: like x, written.
        validate: as in mamba2_prefill.
    """
    if check_bool("validate", validate):
        check_tensor_args(dict(x=x, weight=weight, conv_state=conv_state, out=out), dict(bias=bias))
        check_tensor("x", x, [("dim", None), ("ntokens", None)], FLOAT_DTYPES)
        device = _check_conv(x, weight, bias, conv_state, out, activation)
        _check_batch(batch, PrefillBatch, device, "conv_state", conv_state, token_axis=x.shape[1])
    else:
        device = x.device
    backend = resolve_backend(backend, device)
    batch = host_view(batch) if backend == "torch" else batch  # the PyTorch paths walk host lengths

    def call():
        seqs = batch.seqs
        if batch.device_only:
            # Lengths unknown on the host: the grid covers the longest possible sequence, and the
            # kernel reads the true lengths on the device (programs past a row's end do nothing).
            seqs = dataclasses.replace(seqs, lengths=[x.shape[1]] * seqs.count)
        (run_conv_triton if backend == "triton" else run_conv_torch)(ConvProblem(
            x=x.unsqueeze(0), weight=weight, bias=bias, silu=activation is not None, state_in=conv_state, seqs=seqs,
            captures=batch.captures, out=out.unsqueeze(0), state_out=conv_state, captured=conv_state,
            state_index=batch.state_indices, has_initial=batch.has_initial, skip_slot=batch.skip_slot))
    _launch(batch, backend, ("conv_prefill", activation), (x, weight, bias, conv_state, out), call)


def conv_decode(batch: DecodeBatch, x, weight, bias=None, *, conv_state, out, activation=None,
                backend="auto", validate=True) -> None:
    """One decode token per row through one layer's causal conv, the conv state shifted in place.

    x, out: (batch, dim); conv_state: (nslots, dim, width - 1), any strides; the rest as in
    conv_prefill. Rows read and write state_indices (a distinct dst_state_indices is not supported
    here: the conv state is shifted in place). validate: as in mamba2_prefill.
    """
    if check_bool("validate", validate):
        check_tensor_args(dict(x=x, weight=weight, conv_state=conv_state, out=out), dict(bias=bias))
        check_tensor("x", x, [("batch", None), ("dim", None)], FLOAT_DTYPES)
        check_tensor("out", out, [("batch", x.shape[0]), ("dim", x.shape[1])], FLOAT_DTYPES)  # 2-D before .t()
        device = _check_conv(x.t(), weight, bias, conv_state, out.t(), activation)
        _check_batch(batch, DecodeBatch, device, "conv_state", conv_state, x.shape[0])
        if batch.dst_state_indices is not None:
            raise ValueError("conv_decode updates the conv state in place: build its DecodeBatch without "
                             "dst_state_indices")
    else:
        device = x.device
    backend = resolve_backend(backend, device)
    call = lambda: (run_conv_triton if backend == "triton" else run_conv_torch)(ConvProblem(
        x=x.unsqueeze(-1), weight=weight, bias=bias, silu=activation is not None, state_in=conv_state,
        seqs=batch.seqs, captures=batch.captures, out=out.unsqueeze(-1), state_out=conv_state, captured=conv_state,
        state_index=batch.state_indices, skip_slot=batch.skip_slot))
    _launch(batch, backend, ("conv_decode", activation), (x, weight, bias, conv_state, out), call)
