"""The recurrent scan's token loop compiled for the CPU (cpu_loop.c), built on first use.

The PyTorch loop (torch_kernel.py) runs a dozen torch ops a token; this runs the same recurrence
in C, a sequence a call (5-13x faster a layer call: docs/recurrent.md). It is built with the
machine's C compiler (`CC`, else `cc`) for the machine's own CPU into a cache folder
(`SSM_KERNELS_CACHE`, else ~/.cache/ssm_kernels), once per source, compiler and CPU. Where no
compiler builds it, the recurrent scan on CPU tensors runs the PyTorch loop, with one warning.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_loop.c")
# No fast-math (NaN and inf propagate); the vector loops call the C library's vector exp.
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-shared", "-fPIC"]
# glibc's vector math (libmvec) where cpu_loop.c declares its vector exp: x86-64 Linux
LIBS = ["-lm", "-lmvec"] if platform.machine() in ("x86_64", "AMD64") and platform.libc_ver()[0] == "glibc" else ["-lm"]


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and feature flags where Linux tells them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
    except OSError:
        return platform.machine() + platform.processor()


def _cache_dir() -> Path:
    return Path(os.environ.get("SSM_KERNELS_CACHE") or Path.home() / ".cache" / "ssm_kernels")


def _build(compiler: str) -> Path:
    """The shared library for this source, compiler (a command, e.g. "ccache gcc") and CPU,
    compiled unless cached."""
    command = shlex.split(compiler)
    version = subprocess.run([*command, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, version, *FLAGS, *LIBS, _cpu_identity()]).encode())
    folder = _cache_dir()
    path = folder / f"cpu_loop-{key.hexdigest()[:16]}.so"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:  # built aside, then moved in whole
            built = Path(tmp) / path.name
            subprocess.run([*command, *FLAGS, str(SOURCE), "-o", str(built), *LIBS], capture_output=True, text=True,
                           check=True)
            os.replace(built, path)
    return path


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled loop, or None (warned once) where it cannot be built or loaded."""
    compiler = os.environ.get("CC") or "cc"
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, ValueError, subprocess.CalledProcessError) as e:  # ValueError: CC that shlex cannot split
        detail = e.stderr.strip()[-500:] if isinstance(e, subprocess.CalledProcessError) else str(e)
        warnings.warn(f"ssm_kernels: the compiled CPU scan loop could not be built with {compiler!r} ({detail}); "
                      "the recurrent scan on CPU runs its PyTorch loop, many times slower", RuntimeWarning)
        return None
    i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.ssm_scan_sequence.restype = i32
    lib.ssm_scan_sequence.argtypes = [i64, i64, i64, i64, ptr, ptr, ptr, i32, i32, ptr, ptr, ptr, ptr, ptr, i32, f32,
                                      f32, ptr, ptr, i64, ptr, ptr]
    return lib


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float().contiguous()


class CompiledPass:
    """A ScanProblem's inputs, float32 and contiguous (B and C per head), for the compiled loop,
    made once a pass; `run` scans one of its sequences."""

    def __init__(self, lib: ctypes.CDLL, p, group_of_head: torch.Tensor):
        self.lib, self.p = lib, p
        # Mamba-2: dt, its bias and the decay are one per head (expanded along headdim)
        self.per_head = not p.a_per_state and p.dt.stride(3) == 0 and (p.dt_bias is None or p.dt_bias.stride(1) == 0)
        if self.per_head:
            self.dt, self.dt_bias = _f32(p.dt[..., 0]), _f32(p.dt_bias[:, 0] if p.dt_bias is not None else None)
            self.A = _f32(p.A[:, 0, 0])
        else:
            self.dt, self.dt_bias = _f32(p.dt), _f32(p.dt_bias)
            self.A = _f32(p.A.transpose(1, 2)) if p.a_per_state else _f32(p.A[:, :, 0])
        self.x, self.z, self.D = _f32(p.x), _f32(p.z), _f32(p.D)
        self.B, self.C = (t.index_select(2, group_of_head).float() for t in (p.B, p.C))  # new, contiguous
        self.y = torch.empty(p.x.shape, dtype=torch.float32, device="cpu")  # the compiled loop writes host memory

    def run(self, b: int, start: int, length: int, state: torch.Tensor, capture_offsets: list[int]):
        """Sequence (batch row b, tokens [start, start + length)) from its float32 state (H, P, N):
        y (length, H, P), the final state (H, P, N) and the states after each of capture_offsets
        (ascending; (ncap, H, P, N)), all float32."""
        p = self.p
        nheads, headdim, dstate, _ = p.dims
        at = lambda t: None if t is None else t[b, start].data_ptr()  # the sequence's first token
        state_t = state.transpose(1, 2).clone(memory_format=torch.contiguous_format)  # (H, N, P), written
        offsets = torch.tensor(capture_offsets, dtype=torch.int64, device="cpu")
        captured = torch.empty(len(capture_offsets), nheads, dstate, headdim, dtype=torch.float32, device="cpu")
        if length and self.lib.ssm_scan_sequence(
                length, nheads, headdim, dstate, at(self.x), at(self.dt), self.A.data_ptr(), int(self.per_head),
                int(p.a_per_state), at(self.B), at(self.C), at(self.z),
                None if self.D is None else self.D.data_ptr(),
                None if self.dt_bias is None else self.dt_bias.data_ptr(), int(p.dt_softplus), p.dt_min, p.dt_max,
                state_t.data_ptr(), at(self.y), len(capture_offsets), offsets.data_ptr(), captured.data_ptr()):
            raise MemoryError("the compiled CPU scan loop could not allocate its scratch")
        if not length:  # every capture is the initial state
            captured.copy_(state_t.expand(captured.shape))
        return self.y[b, start:start + length], state_t.transpose(1, 2), captured.transpose(2, 3)
