"""Compile every Triton kernel launch of a set of representative calls for a Hopper GPU (sm_90),
on a machine without one.

The interpreter runs the kernels' semantics on CPU but never compiles them; this script does
the opposite: each `kernel[grid](...)` is compiled through Triton's real pipeline (TTIR, TTGIR,
LLVM IR, PTX, cubin) for the H100/H200 target instead of launched, so type errors, unsupported
constructs and register-tile mistakes show up without a GPU. Outputs stay unwritten.

Each variant's register use is read from `ptxas -v` (the ptxas Triton uses). A variant that
spills more than SPILL_LIMIT_BYTES per thread to local memory fails the run: a few bytes are
register-allocation noise, while a tile that does not fit in registers spills hundreds to
thousands (64 x 64 conv tiles spilled 3 KB, fp32 64 x 64 x 128 chunk-output tiles 11 KB).

Run with TRITON_INTERPRET unset: python tests/compile_for_gpu.py  (prints one line per kernel
variant; exit 1 on the first failure or spill).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("compile_for_gpu.py needs TRITON_INTERPRET unset: it compiles the kernels, not interprets them")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend, get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = CUDABackend(TARGET)
PTXAS = get_ptxas(TARGET.arch).path  # the ptxas Triton itself uses for this target
SPILL_LIMIT_BYTES = 64
compiled: dict = {}
spills: list[str] = []


def resource_usage(ptx: str) -> dict[str, int]:
    """Registers, stack frame and spill bytes of a PTX kernel, from `ptxas -v`."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        report = subprocess.run([PTXAS, "-lineinfo", "-v", f"--gpu-name=sm_{TARGET.arch}a", f.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    numbers = lambda pattern: int(re.search(pattern, report).group(1))  # noqa: E731
    return dict(registers=numbers(r"Used (\d+) registers"), stack=numbers(r"(\d+) bytes stack frame"),
                spill_stores=numbers(r"(\d+) bytes spill stores"), spill_loads=numbers(r"(\d+) bytes spill loads"))


def compile_instead_of_launch(self, *args, grid, warmup, **kwargs):
    # Specialise as a launch does (the runtime binder): 16-byte alignment and stride-1 arguments
    # become attributes, which change the code (vector loads, address registers).
    bound, specialization, options = create_function_from_signature(self.signature, self.params, BACKEND)(
        *args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(BACKEND, kwargs, bound, specialization, options)
    options = {k: getattr(options, k) for k in ("num_warps", "num_stages")}
    key = (self.fn.__name__, str(signature), str(constexprs), str(attrs), tuple(options.items()))
    if key not in compiled:
        kernel = triton.compile(ASTSource(self, signature, constexprs, attrs), target=TARGET, options=options)
        compiled[key] = kernel
        flags = ", ".join(f"{self.arg_names[k[0]]}={v}" for k, v in sorted(constexprs.items()))
        usage = resource_usage(kernel.asm["ptx"])
        line = (f"{self.fn.__name__}: {usage['registers']} registers, {usage['spill_stores']} B spilled  "
                f"({flags}, {options})")
        spilled = max(usage["spill_stores"], usage["spill_loads"]) > SPILL_LIMIT_BYTES
        if spilled:
            spills.append(line)
        print(f"{'SPILL' if spilled else 'ok '} {line}", flush=True)


def main() -> int:
    JITFunction.run = compile_instead_of_launch
    import ssm_kernels
    from ssm_kernels import _triton

    _triton.RUNS_ON_CPU = True  # let backend="triton" take CPU tensors: nothing is launched
    from ssm_kernels import causal_conv1d, causal_conv1d_update, mamba1_scan, mamba2_scan, selective_state_update

    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for ngroups, dstate, headdim in ((1, 128, 64), (8, 16, 32), (1, 256, 64), (2, 64, 64), (1, 32, 64)):
            nheads = 8
            x = torch.randn(1, 40, nheads, headdim).to(dtype)
            dt = torch.randn(1, 40, nheads).to(dtype)
            A = -torch.rand(nheads)
            B = torch.randn(1, 40, ngroups, dstate).to(dtype)
            C = torch.randn(1, 40, ngroups, dstate).to(dtype)
            full = dict(D=torch.randn(nheads), z=torch.randn_like(x), dt_bias=torch.randn(nheads), dt_softplus=True,
                        initial_states=torch.randn(2, nheads, headdim, dstate), cu_seqlens=torch.tensor([0, 17, 40]),
                        capture=[(0, 5), (1, 23)])
            for algorithm, chunk in (("recurrent", None), ("chunked", 16), ("chunked", 256)):
                mamba2_scan(x, dt, A, B, C, backend="triton", algorithm=algorithm, chunk_size=chunk)
                mamba2_scan(x, dt, A, B, C, **full, backend="triton", algorithm=algorithm, chunk_size=chunk)
            state = torch.zeros(4, nheads, headdim, dstate)
            selective_state_update(state, x[0, :2], dt[0, :2], A, B[0, :2], C[0, :2], D=full["D"], z=full["z"][0, :2],
                                   dt_bias=full["dt_bias"], dt_softplus=True, backend="triton")
        u = torch.randn(2, 64, 30).to(dtype)
        mamba1_scan(u, torch.randn_like(u), -torch.rand(64, 16), torch.randn(2, 16, 30).to(dtype),
                    torch.randn(2, 16, 30).to(dtype), D=torch.randn(64), z=torch.randn_like(u),
                    delta_bias=torch.randn(64), delta_softplus=True, initial_states=torch.randn(2, 64, 16),
                    capture=[(1, 7)], backend="triton")
        conv_x = torch.randn(1, 96, 50).to(dtype)
        for width in (4, 2):
            weight = torch.randn(96, width)
            causal_conv1d(conv_x, weight, backend="triton")
            causal_conv1d(conv_x, weight, torch.randn(96), activation="silu",
                          initial_states=torch.randn(2, 96, width - 1).to(dtype),
                          cu_seqlens=torch.tensor([0, 20, 50]), capture=[(0, 3), (1, 30)], backend="triton")
            causal_conv1d_update(conv_x[:, :, 0], torch.randn(3, 96, width - 1).to(dtype), weight, activation="silu",
                                 backend="triton")
    print(f"{len(compiled)} kernel variants compiled for {TARGET.backend} sm_{TARGET.arch} "
          f"(triton {triton.__version__}, ssm_kernels from {os.path.dirname(ssm_kernels.__file__)}); "
          f"{len(spills)} spill more than {SPILL_LIMIT_BYTES} B")
    return 1 if spills else 0


if __name__ == "__main__":
    sys.exit(main())
