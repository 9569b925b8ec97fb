"""Compile every Triton kernel launch of a set of representative calls for a Hopper GPU (sm_90a),
on a machine without one, exactly as each launch would specialise it.

The interpreter runs the kernels' semantics on CPU but never compiles them; this script does
the opposite: each `kernel[grid](...)` is recorded instead of launched and compiled through
Triton's real pipeline (TTIR, TTGIR, LLVM IR, PTX, cubin) for the H100/H200 target, bound by
Triton's own runtime binder (triton_static.launches: 16-byte alignment and divisibility attributes,
stride-1 arguments as constants, as a real launch), so type errors, unsupported constructs and
register-tile mistakes show up without a GPU, on the binaries a GPU would run. Outputs stay
unwritten.

Each variant's registers and spills are read from `ptxas -v` (the ptxas and flags Triton uses;
triton_static.sass), its registers also from the cubin, and the MMA form its SASS uses (wgmma,
mma.sync or none) from the cubin. A variant that spills more than
SPILL_LIMIT_BYTES per thread to local memory fails the run: a few bytes are register-allocation
noise, while a tile that does not fit in registers spills hundreds to thousands (64 x 64 conv
tiles spilled 3 KB, fp32 64 x 64 x 128 chunk-output tiles 11 KB).

A variant whose TTGIR holds more scans or reductions than its TTIR fails too: the layout passes
computed one twice, in two layouts, which add in two orders and so round two ways, and whatever
takes one copy (a capture) then differs from whatever takes the other (the carried state) in the
last bits (Triton 3.6 did this to the Mamba-1 chunk kernel's scan with 16-bit inputs and captures).

Run with TRITON_INTERPRET unset, from the repository root: python -m bench.tests.compile_for_gpu
(prints one line per kernel variant; exit 1 on any spill or duplicated scan or reduction).
"""
from __future__ import annotations

import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("compile_for_gpu.py needs TRITON_INTERPRET unset: it compiles the kernels, not interprets them")
os.environ["TRITON_INTERPRET"] = "0"  # compile: a kernel is compiled or interpreted as it is defined

import torch  # noqa: E402
import triton  # noqa: E402
from triton_static import sass  # noqa: E402
from triton_static.launches import TARGET, compile_launch, recording  # noqa: E402

from bench.static_workloads import triton_path_on_cpu  # noqa: E402

SPILL_LIMIT_BYTES = 64
REDUCTIONS = ('"tt.scan"', '"tt.reduce"')


def duplicated_reductions(kernel) -> list[str]:
    """The kinds of scan or reduction a compiled kernel's TTGIR holds more of than its TTIR."""
    return [op.strip('"') for op in REDUCTIONS if kernel.asm["ttgir"].count(op) > kernel.asm["ttir"].count(op)]


def representative_calls() -> None:
    """Every public function with every optional input on and off, odd sizes, both dtypes (float16 where
    it compiles otherwise)."""
    from ssm_kernels import causal_conv1d, causal_conv1d_update, mamba1_scan, mamba2_scan, selective_state_update
    from ssm_kernels.scan.mamba2_chunked.triton_kernel import fused_pass

    for dtype in (torch.bfloat16, torch.float32):
        # The smallest tiles (dstate 16, headdim 32: tl.dot's minimum sizes), the largest (dstate 256:
        # register pressure grows with the tiles) and the common sizes between (64, 128).
        for ngroups, dstate, headdim in ((1, 128, 64), (8, 16, 32), (1, 256, 64), (2, 64, 64)):
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
                if algorithm == "chunked":  # the fused pass in place of stages 2 to 5, every option on
                    with fused_pass():
                        mamba2_scan(x, dt, A, B, C, **full, backend="triton", algorithm=algorithm, chunk_size=chunk)
            for state_dtype in (torch.float32, torch.bfloat16):
                state = torch.zeros(4, nheads, headdim, dstate, dtype=state_dtype)
                selective_state_update(state, x[0, :2], dt[0, :2], A, B[0, :2], C[0, :2], D=full["D"],
                                       z=full["z"][0, :2], dt_bias=full["dt_bias"], dt_softplus=True,
                                       state_indices=torch.tensor([3, -1]), dst_state_indices=torch.tensor([0, 1]),
                                       pad_slot_id=-1, backend="triton")
        u = torch.randn(2, 64, 30).to(dtype)
        # chunk 16 with 16-bit inputs: Triton 3.6 once computed the scan of this one twice. Six
        # captures in one chunk: the chunked kernel's capture loop, not its unrolled steps.
        one, six = [(1, 7)], [(1, k) for k in range(1, 7)]
        for algorithm, positions, chunk, capture in (("recurrent", None, None, one), ("chunked", None, None, one),
                                                     ("chunked", [3, 64], None, one), ("chunked", None, 16, one),
                                                     ("chunked", None, None, six)):
            mamba1_scan(u, torch.randn_like(u), -torch.rand(64, 16), torch.randn(2, 16, 30).to(dtype),
                        torch.randn(2, 16, 30).to(dtype), D=torch.randn(64), z=torch.randn_like(u),
                        delta_bias=torch.randn(64), delta_softplus=True, initial_states=torch.randn(2, 64, 16),
                        capture=capture, backend="triton", algorithm=algorithm, start_positions=positions,
                        chunk_size=chunk)
        conv_x = torch.randn(1, 96, 50).to(dtype)
        for width in (4, 2):
            weight = torch.randn(96, width)
            causal_conv1d(conv_x, weight, backend="triton")
            causal_conv1d(conv_x, weight, torch.randn(96), activation="silu",
                          initial_states=torch.randn(2, 96, width - 1).to(dtype),
                          cu_seqlens=torch.tensor([0, 20, 50]), capture=[(0, 3), (1, 30)], backend="triton")
            causal_conv1d_update(conv_x[:, :, 0], torch.randn(3, 96, width - 1).to(dtype), weight, activation="silu",
                                 backend="triton")
    # float16 chunked Mamba-2 at the common size, five stages and fused: C B^T multiplies in float16
    # (cb_dot_dtype), the other matmuls in bfloat16.
    x, B = torch.randn(1, 40, 8, 64).half(), torch.randn(1, 40, 1, 128).half()
    args = (x, torch.randn(1, 40, 8).half(), -torch.rand(8), B, torch.randn_like(B))
    for fused in (False, True):
        with fused_pass(fused):
            mamba2_scan(*args, D=torch.randn(8), z=torch.randn_like(x), dt_softplus=True, capture=[(0, 5)],
                        backend="triton", algorithm="chunked", chunk_size=256)


def main() -> int:
    import ssm_kernels

    torch.manual_seed(0)
    launches = []
    with triton_path_on_cpu(), recording(launches):
        representative_calls()
    spills, mismatched, duplicated, seen = [], [], [], set()
    for launch in launches:
        kernel = compile_launch(launch)
        if id(kernel) in seen:
            continue
        seen.add(id(kernel))
        code = sass.read(kernel)
        flags = ", ".join(f"{k}={v}" for k, v in sorted(launch.constexprs.items()))
        line = (f"{launch.kernel}: {code.ptxas_registers} registers, {code.spill_stores} B spilled, "
                f"MMA {code.mma_form}  ({flags}, num_warps={launch.num_warps}, num_stages={launch.num_stages})")
        spilled = max(code.spill_stores, code.spill_loads) > SPILL_LIMIT_BYTES
        if spilled:
            spills.append(line)
        twice = duplicated_reductions(kernel)
        if twice:
            duplicated.append(line)
            line += f"  (computed twice: {', '.join(twice)})"
        if code.registers != code.ptxas_registers:
            mismatched.append(line)
            line += f"  (but the cubin has {code.registers}: ptxas -v was not run as Triton runs it)"
        print(f"{'SPILL' if spilled else 'TWICE' if twice else 'ok '} {line}", flush=True)
    print(f"{len(seen)} kernel variants compiled for {TARGET.backend} sm_{TARGET.arch}a "
          f"(triton {triton.__version__}, ssm_kernels from {os.path.dirname(ssm_kernels.__file__)}); "
          f"{len(mismatched)} differ from the cubin's registers; {len(spills)} spill more than {SPILL_LIMIT_BYTES} B; "
          f"{len(duplicated)} compute a scan or reduction twice")
    return 1 if spills or mismatched or duplicated else 0


if __name__ == "__main__":
    sys.exit(main())
