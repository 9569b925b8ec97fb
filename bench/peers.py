"""Peers: other implementations of the same scans, imported when present.

Each loader returns a Peer: available or not, and why. Each adapter maps the benchmark's inputs
(bench.workloads) onto the peer's API and returns a zero-argument callable that runs the peer,
plus a function that turns what it returned into (y, final states) in this library's layout, so
that the benchmark can check the mapping against mamba2_scan/mamba1_scan before timing it.

- mamba_ssm (Triton ops): mamba_chunk_scan_combined and selective_state_update. Importing the
  package needs its compiled `selective_scan_cuda`; a stand-in module is put into sys.modules
  first. If the package's __init__ still fails (it imports transformers through
  its generation utilities), the package is loaded bare, without its __init__, and only the
  Triton ops are imported.
- fla: chunk_simple_gla with the Mamba-2 mapping q = C, k = B, v = dt' * x, g = dt' * A,
  scale 1, where dt' = softplus(dt + dt_bias); B and C expanded to heads (fla has no groups);
  D * x added after. The mapping is computed outside the timed call: the figure is the kernel's.
- hf-torch: transformers' PyTorch paths (transformers >= 5 names them at module level; the
  hub-kernel wrapper is unwrapped so the torch code runs even where mamba_ssm is installed):
  mamba2_chunk_scan (chunked SSD in PyTorch, chunk 256, no varlen), mamba_selective_scan
  (Mamba-1, a Python loop over tokens) and mamba2_selective_state_update.

mamba_ssm and fla are GPU-only Triton code whose multi-config autotuning does not run under
the Triton interpreter, so on CPU they are reported, not run.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import types
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

MAMBA_SSM, FLA, HF = "mamba_ssm", "fla", "hf-torch"
PEER_NAMES = (MAMBA_SSM, FLA, HF)


@dataclass
class Peer:
    name: str
    available: bool
    reason: str
    version: str | None = None
    ops: dict = field(default_factory=dict)

    def record(self) -> dict:
        return {"available": self.available, "reason": self.reason, "version": self.version,
                "ops": sorted(self.ops)}


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:
        return None


def _find(name: str):
    """importlib.util.find_spec, None for a module that cannot be found or is blocked."""
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def _install_selective_scan_cuda_stand_in() -> bool:
    """Put a stand-in for mamba_ssm's compiled extension into sys.modules; True if one was put."""
    if "selective_scan_cuda" in sys.modules or _find("selective_scan_cuda"):
        return False
    stand_in = types.ModuleType("selective_scan_cuda")

    def unavailable(*args, **kwargs):
        raise RuntimeError("selective_scan_cuda is a stand-in put there by bench.peers; the "
                           "compiled CUDA extension is not installed")

    stand_in.fwd = stand_in.bwd = unavailable
    sys.modules["selective_scan_cuda"] = stand_in
    return True


def _import_bare_package(name: str) -> None:
    """Register package `name` without running its __init__ (its submodules import normally)."""
    spec = importlib.util.find_spec(name)
    module = types.ModuleType(name)
    module.__path__ = list(spec.submodule_search_locations or [])
    module.__spec__ = spec
    module.__file__ = spec.origin
    sys.modules[name] = module


def import_mamba_ssm_ops() -> tuple[dict | None, str]:
    """({name: op} of mamba_ssm's Triton ops, how they were imported), or (None, why not).
    Works without CUDA: the ops are GPU code, but importing them needs none."""
    if _find("mamba_ssm") is None:
        return None, "absent: mamba_ssm is not installed"
    stand_in = _install_selective_scan_cuda_stand_in()
    how = "with a stand-in selective_scan_cuda" if stand_in else "with its own selective_scan_cuda"
    if _find("packaging") is None and _find("pip._vendor.packaging") is not None:
        # its Triton ops compare versions with `packaging`; pip vendors the same library
        sys.modules["packaging"] = importlib.import_module("pip._vendor.packaging")
        sys.modules["packaging.version"] = importlib.import_module("pip._vendor.packaging.version")
        how += " and pip's vendored packaging"
    try:
        importlib.import_module("mamba_ssm")
    except Exception as exc:  # noqa: BLE001 - any import failure: fall back to the bare package
        for key in [k for k in sys.modules if k == "mamba_ssm" or k.startswith("mamba_ssm.")]:
            del sys.modules[key]
        _import_bare_package("mamba_ssm")
        how += f"; package __init__ skipped ({type(exc).__name__}: {exc})"
    try:
        ssd = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
        ssu = importlib.import_module("mamba_ssm.ops.triton.selective_state_update")
    except Exception as exc:  # noqa: BLE001
        return None, f"failed to import its Triton ops: {type(exc).__name__}: {exc}"
    return ({"mamba_chunk_scan_combined": ssd.mamba_chunk_scan_combined,
             "selective_state_update": ssu.selective_state_update}, f"imported {how}")


def load_mamba_ssm(device: torch.device) -> Peer:
    if _find("mamba_ssm") is None:
        return Peer(MAMBA_SSM, False, "absent: mamba_ssm is not installed")
    version = _version("mamba_ssm") or _version("mamba-ssm")
    if device.type != "cuda":
        return Peer(MAMBA_SSM, False, "installed but not run on CPU: GPU-only Triton kernels whose "
                    "autotuning does not run under the Triton interpreter", version)
    ops, how = import_mamba_ssm_ops()
    if ops is None:
        return Peer(MAMBA_SSM, False, how, version)
    return Peer(MAMBA_SSM, True, how, version, ops)


def load_fla(device: torch.device) -> Peer:
    if _find("fla") is None:
        return Peer(FLA, False, "absent: fla (flash-linear-attention) is not installed")
    version = _version("fla-core") or _version("flash-linear-attention")
    if device.type != "cuda":
        return Peer(FLA, False, "installed but not run on CPU: GPU-only Triton kernels whose "
                    "autotuning does not run under the Triton interpreter", version)
    try:
        module = importlib.import_module("fla.ops.simple_gla")
    except Exception as exc:  # noqa: BLE001
        return Peer(FLA, False, f"failed to import fla.ops.simple_gla: {type(exc).__name__}: {exc}", version)
    return Peer(FLA, True, "imported", version, {"chunk_simple_gla": module.chunk_simple_gla})


def load_hf(device: torch.device) -> Peer:
    if _find("transformers") is None:
        return Peer(HF, False, "absent: transformers is not installed")
    version = _version("transformers")
    try:
        m2 = importlib.import_module("transformers.models.mamba2.modeling_mamba2")
        m1 = importlib.import_module("transformers.models.mamba.modeling_mamba")
    except Exception as exc:  # noqa: BLE001
        return Peer(HF, False, f"failed to import its Mamba models: {type(exc).__name__}: {exc}", version)
    ops = {}
    for key, module, name in (("mamba2_chunk_scan", m2, "mamba2_chunk_scan"),
                              ("mamba2_selective_state_update", m2, "mamba2_selective_state_update"),
                              ("mamba_selective_scan", m1, "mamba_selective_scan")):
        fn = getattr(module, name, None)
        if fn is None:
            continue
        fn = inspect.unwrap(fn)  # the PyTorch function under the hub-kernel wrapper
        # Only the torch code written in the modeling file itself: never a kernel it dispatches to.
        if getattr(getattr(fn, "__code__", None), "co_filename", "") == module.__file__:
            ops[key] = fn
    if not ops:
        return Peer(HF, False, f"transformers {version} has no module-level PyTorch scan functions "
                    "(mamba2_chunk_scan etc. appear in transformers 5); its torch path lives inside "
                    "Mamba2Mixer.torch_forward with the projections, which this benchmark does not time", version)
    return Peer(HF, True, "imported (PyTorch path, hub-kernel wrappers unwrapped)", version, ops)


def load_peers(device: torch.device) -> dict[str, Peer]:
    return {peer.name: peer for peer in (load_mamba_ssm(device), load_fla(device), load_hf(device))}


# ---------------------------------------------------------------------------------------------
# Adapters: (callable, to_ours) where to_ours(result) -> (y, final_states) in our layout.
# They raise NotImplementedError for a case the peer cannot express (reported as n/a).
# ---------------------------------------------------------------------------------------------
Adapter = tuple[Callable[[], object], Callable[[object], tuple]]


def _accepts(fn, *names) -> bool:
    params = inspect.signature(fn).parameters
    return all(n in params for n in names) or any(p.kind == p.VAR_KEYWORD for p in params.values())


def _seq_idx(lengths, device) -> torch.Tensor:
    counts = torch.tensor(lengths, device=device)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device, dtype=torch.int32), counts)[None]


def mamba_ssm_scan(peer: Peer, inp: dict, cu_seqlens, lengths, chunk_size: int = 256) -> Adapter:
    fn = peer.ops["mamba_chunk_scan_combined"]
    x, dt, A, B, C = (inp[k] for k in ("x", "dt", "A", "B", "C"))
    kw = dict(D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=True)
    if cu_seqlens is None:
        return (lambda: fn(x, dt, A, B, C, chunk_size, **kw, return_final_states=True),
                lambda r: (r[0], r[1]))
    if not _accepts(fn, "cu_seqlens", "return_varlen_states"):
        raise NotImplementedError("this mamba_ssm version returns no per-sequence (varlen) states")
    seq_idx = _seq_idx(lengths, x.device)
    return (lambda: fn(x, dt, A, B, C, chunk_size, **kw, seq_idx=seq_idx, cu_seqlens=cu_seqlens,
                       return_varlen_states=True),
            lambda r: (r[0], r[1]))


def _decode_views(inp: dict) -> dict:
    """The per-row views mamba_ssm's and transformers' decode steps take (as their Mamba2 modules
    build them: stride-0 expansions, no copies)."""
    state, x = inp["state"], inp["x"]
    _, H, P, N = state.shape
    return dict(x=x, dt=inp["dt"][..., None].expand(-1, -1, P), A=inp["A"][:, None, None].expand(H, P, N),
                B=inp["B"], C=inp["C"], D=inp["D"][:, None].expand(H, P),
                dt_bias=inp["dt_bias"][:, None].expand(H, P))


def decode_step(fn, inp: dict) -> Callable[[], torch.Tensor]:
    """mamba_ssm's selective_state_update or transformers' mamba2_selective_state_update."""
    v = _decode_views(inp)
    state = inp["state"]
    return lambda: fn(state, v["x"], v["dt"], v["A"], v["B"], v["C"], D=v["D"], dt_bias=v["dt_bias"],
                      dt_softplus=True)


def fla_scan(peer: Peer, inp: dict, cu_seqlens, lengths) -> Adapter:
    fn = peer.ops["chunk_simple_gla"]
    x, dt, A, B, C, D = (inp[k] for k in ("x", "dt", "A", "B", "C", "D"))
    H, G = x.shape[2], B.shape[2]
    dts = F.softplus(dt.float() + inp["dt_bias"])  # (1, T, H)
    q = C.repeat_interleave(H // G, dim=2).contiguous()
    k = B.repeat_interleave(H // G, dim=2).contiguous()
    v = (x.float() * dts[..., None]).to(x.dtype)
    g = (dts * A).contiguous()  # log decay per head and token
    kw = dict(g=g, scale=1.0, output_final_state=True)
    if cu_seqlens is not None:
        kw["cu_seqlens"] = cu_seqlens.long()
        if _accepts(fn, "cu_seqlens_cpu"):
            kw["cu_seqlens_cpu"] = cu_seqlens.long().cpu()

    def to_ours(r):
        o, ht = r
        return o + (x * D[:, None]).to(o.dtype), ht.transpose(-1, -2)  # state (N, H, K, V) -> (N, H, P, N)

    return (lambda: fn(q, k, v, **kw)), to_ours


def hf_mamba2_scan(peer: Peer, inp: dict, cu_seqlens, lengths, chunk_size: int = 256) -> Adapter:
    if cu_seqlens is not None:
        raise NotImplementedError("transformers' PyTorch chunk scan has no varlen (it raises without mamba_ssm)")
    fn = peer.ops["mamba2_chunk_scan"]
    x, dt, A, B, C = (inp[k] for k in ("x", "dt", "A", "B", "C"))
    return (lambda: fn(x, dt, A, B, C, chunk_size, D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=True,
                       return_final_states=True),
            lambda r: (r[0], r[1]))


def hf_mamba1_scan(peer: Peer, inp: dict, cu_seqlens, lengths) -> Adapter:
    if cu_seqlens is not None:
        raise NotImplementedError("transformers' PyTorch selective scan has no varlen")
    fn = peer.ops["mamba_selective_scan"]
    u, delta, A, B, C = (inp[k] for k in ("u", "delta", "A", "B", "C"))
    return (lambda: fn(u, delta, A, B, C, D=inp["D"], z=inp["z"], delta_bias=inp["delta_bias"],
                       delta_softplus=True, return_last_state=True),
            lambda r: (r[0], r[1]))


# (peer name, op key, kind) -> adapter, for the scan table
SCAN_ADAPTERS = {
    (MAMBA_SSM, "mamba2"): ("mamba_chunk_scan_combined", mamba_ssm_scan),
    (FLA, "mamba2"): ("chunk_simple_gla", fla_scan),
    (HF, "mamba2"): ("mamba2_chunk_scan", hf_mamba2_scan),
    (HF, "mamba1"): ("mamba_selective_scan", hf_mamba1_scan),
}
DECODE_OPS = {MAMBA_SSM: "selective_state_update", HF: "mamba2_selective_state_update"}
# Shapes a slow peer skips on the GPU (stated in the results): transformers' Mamba-1 path is a
# Python loop over tokens (about a second per call at 32768 tokens, and 4 x 10.7 GB of float32
# discretised A and B u) and its Mamba-2 path materialises (chunks, 256, 256, heads) float32
# score tensors several times over (on an H200 at 8192 tokens: about 300 ms a call at 128 heads,
# and 80 GiB asked for, out of memory, at Mamba-2 2.7B's 80 heads x 64).
MAX_SEQLEN = {(HF, "mamba1"): 8192, (HF, "mamba2"): 2048}
