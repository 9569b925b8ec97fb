"""The calls the static report models: the public functions (and their peers) at the standard
layer shapes, with inputs whose storage is never touched.

A workload is one public call; `run_call(name, shape, size)` makes its inputs and calls it once
(its kernels are recorded or counted by the caller, never run on a GPU). `size` is the pass's
tokens (prefill) or the decode batch. Inputs are `torch.empty` (or zeros for the interpreter
counts, whose values then stay finite), contiguous, 16-byte aligned as a CUDA allocation is.
Layer shapes are bench.workloads.STANDARD_SHAPES; conv dims are each layer's conv channels
(Mamba-2: heads x headdim + 2 x groups x dstate; Mamba-1: dim).

Captures: 8 per pass, at offsets c_k * 256 + j_k with j_k = 16 (2k + 1) for k = 0..7 (block
multiples of 16, 128 tokens into a chunk on average, as random block-aligned positions would be)
and c_k spread over the pass's 256-token chunks; so every size places them alike inside chunks.
The chunked scan's "grid captures" take the same chunks at their starts (j_k = 0), where a
planner on the chunk grid puts a chunked pass's snapshots.
"""
from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass
from typing import Callable
from unittest import mock

import torch

from triton_static.model import CLOCK_HZ, SMS, TENSOR_FLOPS, traffic

from .workloads import STANDARD_SHAPES, Mamba1Shape, Mamba2Shape

DTYPE = torch.bfloat16
CHUNK = 256
CONV_WIDTH = 4
SHAPES = {shape.name: shape for shape in STANDARD_SHAPES}
PREFILL_TOKENS = (8192, 32768)
DECODE_BATCHES = (64, 128, 256)


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # "prefill" (size = tokens) or "decode" (size = batch)
    layer: str  # "mamba2" or "mamba1": which shapes it runs at
    ours: Callable  # (shape, size, new) -> None
    peer: str | None  # key into PEERS, or None
    doc: str
    captures: int = 0
    chunked: bool = False  # its kernels work on chunks (as the prefill peer's always do): counted at 8 chunks and more
    mixed: bool = False  # it launches a mixed kernel (MIXED_KERNELS), whose every program is counted
    ablation: bool = False  # a variant of a kernel, modelled only when a --workload filter names it


def capture_offsets(tokens: int, count: int = 8, on_grid: bool = False) -> list[tuple[int, int]]:
    """(sequence 0, offset) pairs of the module doc's capture placement (on_grid: chunk starts)."""
    nchunks = tokens // CHUNK
    return [(0, min(tokens, (k * nchunks // count) * CHUNK + (0 if on_grid else 16 * (2 * k + 1))))
            for k in range(count)]


def conv_dim(shape) -> int:
    if shape.kind == "mamba1":
        return shape.dim
    return shape.nheads * shape.headdim + 2 * shape.ngroups * shape.dstate


def _mamba2(shape, tokens, new):
    H, P, N, G = shape.nheads, shape.headdim, shape.dstate, shape.ngroups
    return dict(x=new(1, tokens, H, P), dt=new(1, tokens, H), A=new(H, dtype=torch.float32),
                B=new(1, tokens, G, N), C=new(1, tokens, G, N),
                D=new(H, dtype=torch.float32), dt_bias=new(H, dtype=torch.float32))


def _decode(shape, batch, new):
    H, P, N, G = shape.nheads, shape.headdim, shape.dstate, shape.ngroups
    return dict(state=new(batch, H, P, N, dtype=torch.float32), x=new(batch, H, P), dt=new(batch, H),
                A=new(H, dtype=torch.float32), B=new(batch, G, N), C=new(batch, G, N),
                D=new(H, dtype=torch.float32), dt_bias=new(H, dtype=torch.float32))


def _fused_pass(fused: bool):
    """The chunked Mamba-2 pass's fused launch (fused) or its five stages, whatever the setting."""
    try:
        from ssm_kernels.scan.mamba2_chunked.triton_kernel import fused_pass
    except ImportError:  # a tree from before the fused pass (bench/static_at.sh): five stages only
        if fused:
            raise
        return contextlib.nullcontext()
    return fused_pass(fused)


def _scan(algorithm, captures, on_grid=False, fused=False):
    def run(shape, tokens, new):
        from ssm_kernels import mamba2_scan
        i = _mamba2(shape, tokens, new)
        with _fused_pass(fused):
            mamba2_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], D=i["D"], dt_bias=i["dt_bias"], dt_softplus=True,
                        capture=capture_offsets(tokens, on_grid=on_grid) if captures else None, backend="triton",
                        algorithm=algorithm, chunk_size=CHUNK)
    return run


def _ablated(variant: str):
    """The chunked Mamba-2 scan with bench.output_variants' `variant` as its output kernel."""
    scan = _scan("chunked", False)

    def run(shape, tokens, new):
        from .output_variants import ablated
        with ablated(variant):
            scan(shape, tokens, new)
    return run


def _ablation_workloads() -> list[Workload]:
    """A call per variant with an edit: "mamba2_scan chunked" is the unchanged kernel (an unchanged
    copy compiles to the real kernel's cached binary, whose lines name the real module, while the
    interpreter would count the copy's lines: its loops would go uncounted)."""
    from .output_variants import VARIANTS
    return [Workload(f"ablation: {variant}", "prefill", "mamba2", _ablated(variant), "mamba_chunk_scan_combined",
                     f"mamba2_scan chunked with its output kernel's variant '{variant}' (bench.output_variants: a "
                     "variant without a part computes a wrong y, only its cost counts)", chunked=True, ablation=True)
            for variant, edits in VARIANTS.items() if edits]


def _engine_prefill(captures, on_grid=False, fused=False):
    """mamba2_prefill's chunked algorithm on one fresh row, states in a bfloat16 cache (vLLM's
    default SSM cache dtype for these models): captures go straight into their slots."""
    def run(shape, tokens, new):
        from ssm_kernels.cache_ops import mamba2_prefill, prefill_batch
        i = _mamba2(shape, tokens, new)
        offsets = capture_offsets(tokens, on_grid=on_grid) if captures else []
        index = lambda values: torch.tensor(values, dtype=torch.int64)
        cap = dict(capture_seq=index([s for s, _ in offsets]), capture_offset=index([k for _, k in offsets]),
                   capture_slot=index(range(1, len(offsets) + 1))) if offsets else {}
        batch = prefill_batch(index([0, tokens]), index([0]), has_initial_state=torch.tensor([False]),
                              start_positions=[0], **cap)
        cache = new(1 + len(offsets), shape.nheads, shape.headdim, shape.dstate)
        sq = lambda t: t.squeeze(0)
        with _fused_pass(fused):
            mamba2_prefill(batch, sq(i["x"]), sq(i["dt"]), i["A"], sq(i["B"]), sq(i["C"]), ssm_state=cache,
                           out=torch.empty_like(sq(i["x"])), D=i["D"], dt_bias=i["dt_bias"], dt_softplus=True,
                           backend="triton", algorithm="chunked", chunk_size=CHUNK)
    return run


def _state_update(shape, batch, new):
    from ssm_kernels import selective_state_update
    i = _decode(shape, batch, new)
    selective_state_update(i["state"], i["x"], i["dt"], i["A"], i["B"], i["C"], D=i["D"], dt_bias=i["dt_bias"],
                           dt_softplus=True, backend="triton")


def _mamba1(algorithm, captures=False):
    def run(shape, tokens, new):
        from ssm_kernels import mamba1_scan
        Dm, N = shape.dim, shape.dstate
        mamba1_scan(new(1, Dm, tokens), new(1, Dm, tokens), new(Dm, N, dtype=torch.float32), new(1, N, tokens),
                    new(1, N, tokens), D=new(Dm, dtype=torch.float32), z=new(1, Dm, tokens),
                    delta_bias=new(Dm, dtype=torch.float32), delta_softplus=True, backend="triton",
                    capture=capture_offsets(tokens) if captures else None, algorithm=algorithm)
    return run


def _conv(shape, tokens, new):
    from ssm_kernels import causal_conv1d
    dim = conv_dim(shape)
    causal_conv1d(new(1, dim, tokens), new(dim, CONV_WIDTH, dtype=torch.float32), new(dim, dtype=torch.float32),
                  activation="silu", backend="triton")


def _conv_update(shape, batch, new):
    from ssm_kernels import causal_conv1d_update
    dim = conv_dim(shape)
    causal_conv1d_update(new(batch, dim), new(batch, dim, CONV_WIDTH - 1), new(dim, CONV_WIDTH, dtype=torch.float32),
                         new(dim, dtype=torch.float32), activation="silu", backend="triton")


WORKLOADS = {w.name: w for w in (
    Workload("mamba2_scan recurrent", "prefill", "mamba2", _scan("recurrent", False), "mamba_chunk_scan_combined",
             "mamba2_scan(algorithm='recurrent'), D, dt_bias, softplus, no z"),
    Workload("mamba2_scan recurrent + 8 captures", "prefill", "mamba2", _scan("recurrent", True),
             "mamba_chunk_scan_combined", "the same with 8 captures (the peer cannot capture)", captures=8),
    Workload("mamba2_scan chunked", "prefill", "mamba2", _scan("chunked", False), "mamba_chunk_scan_combined",
             "mamba2_scan(algorithm='chunked', chunk_size=256)", chunked=True),
    Workload("mamba2_scan chunked + 8 captures", "prefill", "mamba2", _scan("chunked", True),
             "mamba_chunk_scan_combined", "the same with 8 captures (the peer cannot capture)", captures=8,
             chunked=True),
    Workload("mamba2_scan chunked + 8 grid captures", "prefill", "mamba2", _scan("chunked", True, on_grid=True),
             "mamba_chunk_scan_combined", "the same with the 8 captures at chunk starts, as planned on the grid",
             captures=8, chunked=True),
    Workload("mamba2_prefill chunked, bf16 cache", "prefill", "mamba2", _engine_prefill(False),
             "mamba_chunk_scan_combined", "the engine op (ssm_kernels.cache_ops) on one fresh row, a bfloat16 state "
             "cache", chunked=True),
    Workload("mamba2_prefill chunked, bf16 cache + 8 captures", "prefill", "mamba2", _engine_prefill(True),
             "mamba_chunk_scan_combined", "the same with 8 captures written into cache slots", captures=8,
             chunked=True),
    Workload("mamba2_prefill chunked, bf16 cache + 8 grid captures", "prefill", "mamba2",
             _engine_prefill(True, on_grid=True), "mamba_chunk_scan_combined",
             "the same with the 8 captures at chunk starts", captures=8, chunked=True),
    Workload("mamba2_scan chunked, fused", "prefill", "mamba2", _scan("chunked", False, fused=True),
             "mamba_chunk_scan_combined", "mamba2_scan chunked on the fused pass (two launches; "
             "SSM_KERNELS_FUSED_SSD=1)", chunked=True, mixed=True),
    Workload("mamba2_scan chunked, fused + 8 captures", "prefill", "mamba2", _scan("chunked", True, fused=True),
             "mamba_chunk_scan_combined", "the same with 8 captures (the peer cannot capture)", captures=8,
             chunked=True, mixed=True),
    Workload("selective_state_update", "decode", "mamba2", _state_update, "selective_state_update",
             "one decode token per row, state pool of batch slots"),
    Workload("mamba1_scan recurrent", "prefill", "mamba1", _mamba1("recurrent"), "selective_scan_fn",
             "mamba1_scan(algorithm='recurrent') with z, D, delta_bias, softplus"),
    Workload("mamba1_scan recurrent + 8 captures", "prefill", "mamba1", _mamba1("recurrent", True),
             "selective_scan_fn", "the same with 8 captures (the peer cannot capture)", captures=8),
    Workload("mamba1_scan chunked", "prefill", "mamba1", _mamba1("chunked"), "selective_scan_fn",
             "mamba1_scan(algorithm='chunked', chunk_size=64) with z, D, delta_bias, softplus", chunked=True),
    Workload("mamba1_scan chunked + 8 captures", "prefill", "mamba1", _mamba1("chunked", True),
             "selective_scan_fn", "the same with 8 captures (the peer cannot capture)", captures=8, chunked=True),
    Workload("causal_conv1d", "prefill", "any", _conv, None, "width 4, bias, silu, on the layer's conv dim"),
    Workload("causal_conv1d_update", "decode", "any", _conv_update, None, "one decode token per row, width 4"),
    *_ablation_workloads(),
)}


# ---------------------------------------------------------------------------------------------
# Peers: mamba_ssm's Triton ops, and selective_scan_fn (CUDA: its extension is not built here, so
# it is modelled from its algorithm, by the memory rule every kernel gets).
# ---------------------------------------------------------------------------------------------
def _peer_scan(ops):
    def run(shape, tokens, new):
        i = _mamba2(shape, tokens, new)
        ops["mamba_chunk_scan_combined"](i["x"], i["dt"], i["A"], i["B"], i["C"], CHUNK, D=i["D"],
                                         dt_bias=i["dt_bias"], dt_softplus=True, return_final_states=True)
    return run


def _peer_state_update(ops):
    def run(shape, batch, new):
        i = _decode(shape, batch, new)
        H, P, N = shape.nheads, shape.headdim, shape.dstate
        # as mamba_ssm's Mamba2 step calls it: per-row views by stride-0 expansion
        ops["selective_state_update"](i["state"], i["x"], i["dt"][..., None].expand(-1, -1, P),
                                      i["A"][:, None, None].expand(H, P, N), i["B"], i["C"],
                                      D=i["D"][:, None].expand(H, P), dt_bias=i["dt_bias"][:, None].expand(H, P),
                                      dt_softplus=True)
    return run


PEER_RUNNERS = {"mamba_chunk_scan_combined": _peer_scan, "selective_state_update": _peer_state_update}


SELECTIVE_SCAN_CHUNK = 2048  # tokens per block iteration: 128 threads x 16 items (sequences over 1024 tokens)


def selective_scan_fn_storages(tokens: int, dim: int, dstate: int, ngroups: int = 1, elt: int = 2,
                               has_z: bool = True) -> dict[str, dict[str, float]]:
    """Bytes per storage that mamba_ssm's selective_scan_fn forward kernel asks for (its CUDA
    source, csrc/selective_scan/selective_scan_fwd_kernel.cuh), in triton_static.counts' terms: one block
    per (sequence, channel) walks the tokens in chunks of SELECTIVE_SCAN_CHUNK; per chunk it loads
    its channel's u and delta, then for every state index A and its group's B and C over the
    chunk (so every channel's block reads all of B and C: dim / ngroups re-reads of each), and
    stores out, then out_z = out * silu(z) after loading z, and the chunk's running prefix per
    state (float2) into x. u, delta, z, B, C, out, out_z in the input dtype (elt bytes). The grid
    is (sequences, channels): neighbouring blocks share B and C (reuse stride 1); A is re-read
    inside a block."""
    chunks = -(-tokens // SELECTIVE_SCAN_CHUNK)
    row = tokens * elt

    def storage(size, loaded=0.0, stored=0.0, shared=False):
        return {"loaded": float(loaded), "stored": float(stored), "atomic": 0.0, "size": float(size),
                **({"reuse_stride": 1.0} if shared else {})}

    out = {"u": storage(dim * row, loaded=dim * row), "delta": storage(dim * row, loaded=dim * row),
           "A": storage(dim * dstate * 4, loaded=dim * dstate * 4 * chunks),
           "B": storage(ngroups * dstate * row, loaded=dim * dstate * row, shared=True),
           "C": storage(ngroups * dstate * row, loaded=dim * dstate * row, shared=True),
           "D": storage(dim * 4, loaded=dim * 4), "delta_bias": storage(dim * 4, loaded=dim * 4),
           "out": storage(dim * row, stored=dim * row), "x": storage(dim * chunks * dstate * 8,
                                                                   stored=dim * chunks * dstate * 8)}
    if has_z:
        out |= {"z": storage(dim * row, loaded=dim * row), "out_z": storage(dim * row, stored=dim * row)}
    return out


def model_selective_scan_fn(tokens: int, dim: int, dstate: int, ngroups: int = 1, elt: int = 2,
                            has_z: bool = True) -> dict:
    """mamba_ssm's selective_scan_fn (CUDA, Mamba-1) from its algorithm, since its extension is
    not built here: memory by the rule every kernel gets (`traffic`) over the bytes its kernel
    asks for (selective_scan_fn_storages); one exp per state element and token (exp(delta * A):
    tokens x dim x dstate on the MUFU pipe, 16 per SM per cycle); time scanned in parallel (a
    block-wide scan per chunk, chained through the chunk's running state), so no per-token
    latency chain: about 6 fp32 FLOPs per state element and token (decay, input term, the scan's
    combine twice, the readout) on the FMA pipe."""
    elements = tokens * dim * dstate
    memory = traffic(selective_scan_fn_storages(tokens, dim, dstate, ngroups, elt, has_z), dim)
    terms = {
        "memory": memory.memory_ms,
        "mufu": elements / (SMS * 16 * CLOCK_HZ) * 1e3,
        "fp32": 6 * elements / TENSOR_FLOPS["none"] * 1e3,
    }
    bound = max(terms, key=terms.get)
    return {"terms_ms": terms, "time_ms": terms[bound], "bound": bound,
            "memory": {"bytes": memory.requested, "unique_bytes": memory.unique, "hbm_bytes": memory.hbm,
                       "reread_far_bytes": memory.reread_far, "l2_hit": memory.l2_hit,
                       "hbm_ms": memory.hbm_ms, "l2_ms": memory.l2_ms},
            "how": "modelled from its algorithm (no compiled kernel: its CUDA extension is not built)"}


def mamba_ssm_ops() -> tuple[dict | None, str]:
    """(mamba_ssm's Triton ops, how they were imported) or (None, why not)."""
    from .peers import import_mamba_ssm_ops
    return import_mamba_ssm_ops()


def shapes_for(workload: Workload, shapes=STANDARD_SHAPES) -> list:
    return [s for s in shapes if workload.layer in ("any", s.kind)]


def new_tensor_factory(fill: str):
    """A tensor maker: untouched storage ("empty") or zeros, in DTYPE unless told."""
    def new(*size, dtype=DTYPE):
        return (torch.zeros if fill == "zeros" else torch.empty)(*size, dtype=dtype)
    return new


def shape_record(shape) -> dict:
    return dict(vars(shape))


def shape_from_record(record: dict):
    return (Mamba2Shape if record["kind"] == "mamba2" else Mamba1Shape)(**record)


LAYER_FORMS = "mamba2:nheads=H,headdim=P,dstate=N,ngroups=G or mamba1:dim=D,dstate=N"


def parse_layer(text: str):
    """A custom layer from 'mamba2:nheads=4,headdim=16,dstate=32,ngroups=1' or
    'mamba1:dim=64,dstate=16'; ValueError, naming the forms, for anything else."""
    kind, _, dims = text.partition(":")
    fields = {"mamba2": {"nheads", "headdim", "dstate", "ngroups"}, "mamba1": {"dim", "dstate"}}.get(kind)
    try:
        values = {k: int(v) for k, v in (item.split("=") for item in dims.split(",") if item)}
    except ValueError:
        values = None
    if (values is None or set(values) != fields or min(values.values()) < 1
            or (kind == "mamba2" and values["nheads"] % values["ngroups"])):
        raise ValueError(f"a layer is {LAYER_FORMS} (positive ints, nheads a multiple of ngroups), "
                         f"got {text!r}")
    return shape_from_record({"name": f"custom {text}", "kind": kind, **values})


def layer_arg(text: str) -> str:
    """argparse type of --layer: the text, once parse_layer takes it."""
    try:
        parse_layer(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def run_call(workload: str, shape, size: int, *, peer: bool = False, fill: str = "empty") -> None:
    """Call a workload (ours, or its peer) once at a shape and size."""
    w = WORKLOADS[workload]
    new = new_tensor_factory(fill)
    if peer:
        ops, why = mamba_ssm_ops()
        if ops is None:
            raise RuntimeError(why)
        PEER_RUNNERS[w.peer](ops)(shape, size, new)
    else:
        w.ours(shape, size, new)


# A chunked prefill is counted at 8 and 16 chunks: from 8 chunks on, the 8 captures fall in 8
# different chunks, as at the real sizes, so everything a capture costs is constant from there on.
# A mixed kernel's programs all run through the interpreter (some 90 ms each on these machines,
# 7000 programs at Mamba-2 2.7B and 8 chunks), so a call without captures that launches one is
# counted at 2 and 4 chunks: its programs grow by a group per chunk from the second chunk on; with
# captures at 8 and 9 chunks: the 8 captures fall in chunks 0 to 7 at both, so the ninth chunk is
# one without a capture, as are all but 8 at the real sizes.
CHUNKED_COUNT_TOKENS = (8 * CHUNK, 16 * CHUNK)
MIXED_COUNT_TOKENS = (2 * CHUNK, 4 * CHUNK)
MIXED_CAPTURE_COUNT_TOKENS = (8 * CHUNK, 9 * CHUNK)


def count_sizes(workload: Workload, peer: bool = False) -> list[int]:
    """Sizes the interpreter counts this call at (bench.counts): batch 2 and 4 for a decode step
    (its grid grows with the batch, its programs do not); CHUNKED_COUNT_TOKENS for a chunked
    prefill (its grid is sampled, so the larger sizes cost little), MIXED_COUNT_TOKENS where it
    launches a mixed kernel (MIXED_CAPTURE_COUNT_TOKENS with captures); 64 and 128 tokens for the
    others (their per-token work does not depend on where a token is: the recurrent scan, whose
    captures only split its token loop, and the conv, whose 32-token tiles stay full)."""
    if workload.kind == "decode":
        return [2, 4]
    if workload.mixed and not peer:
        return list(MIXED_CAPTURE_COUNT_TOKENS if workload.captures else MIXED_COUNT_TOKENS)
    return list(CHUNKED_COUNT_TOKENS) if workload.chunked or peer else [64, 128]


# Grid axes along which a kernel's programs are not alike, so that the two ends cannot stand for
# the rest (triton_static.counts samples them in full). Along axis 0 of the chunked scan's state
# kernel, the rows past the chunks are the inner captures' (a partial each, of a part of a chunk);
# the fused pass's programs are of five kinds, by the tickets they take.
UNALIKE_AXES = {"_chunk_state_kernel": (0,), "_fused_pass_kernel": (0,)}
# Kernels whose programs are of several kinds in one launch (triton_static.model, mixed kernels).
MIXED_KERNELS = frozenset({"_fused_pass_kernel"})


@contextlib.contextmanager
def triton_path_on_cpu():
    """The public functions take CPU tensors with backend="triton" (their kernels are recorded or
    counted, never launched on a GPU)."""
    from ssm_kernels import _triton
    saved = _triton.RUNS_ON_CPU
    _triton.RUNS_ON_CPU = True
    try:
        yield
    finally:
        _triton.RUNS_ON_CPU = saved


@contextlib.contextmanager
def unmarked_workspaces():
    """Chunked Mamba-2 workspaces whose non-finite marks start at 0, as stage 3 leaves them on
    finite inputs: a sampled count runs some of stage 3's programs only, and the marks the others
    leave unwritten would send the output kernel's fix-up into work that such a pass never does."""
    from ssm_kernels.cache_ops import chunked
    from ssm_kernels.scan.mamba2_chunked import triton_kernel
    real = triton_kernel.new_workspace

    def unmarked(*args):
        ws = real(*args)
        ws.nonfinite.zero_()
        return ws

    with mock.patch.object(triton_kernel, "new_workspace", unmarked), \
            mock.patch.object(chunked, "new_workspace", unmarked):
        yield


def count_call(request: dict, size: int) -> None:
    """triton_static.counts' runner: one workload call (request: {workload, shape (a shape record),
    peer}) at `size`, on zeros (whose values stay finite through the interpreter)."""
    with triton_path_on_cpu(), unmarked_workspaces():
        run_call(request["workload"], shape_from_record(request["shape"]), size, peer=request["peer"], fill="zeros")
