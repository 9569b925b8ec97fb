"""Accuracy of every mamba2_scan path against the float64 reference, as one table.

    python -m bench.accuracy [--seqlen 63] [--chunk-size 16]

RMS-relative error of y, the final states and the captured states (captures at 0, 1, the
middle, len - 1 and len), for float32 and bfloat16 inputs, on the recurrent and chunked
algorithms and both backends (Triton: compiled on CUDA, the interpreter on CPU). The tests hold
the same errors to their tolerances; this prints the values.
"""
from __future__ import annotations

import argparse
import sys

import torch

from . import use_triton_interpreter

use_triton_interpreter()  # the interpreter without CUDA; before Triton and the kernels are imported
from . import common  # noqa: E402
from ssm_kernels import mamba2_scan  # noqa: E402
from ssm_kernels.scan import mamba2_chunked  # noqa: E402
from ssm_kernels.scan.reference import mamba2_scan_ref, rel_error  # noqa: E402


def inputs(seqlen: int, dtype: torch.dtype, device: torch.device, nheads=4, headdim=16, ngroups=2, dstate=16):
    g = torch.Generator(device="cpu").manual_seed(0)
    f = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    args = (f(2, seqlen, nheads, headdim), f(2, seqlen, nheads) * 0.5,
            -(torch.rand(nheads, generator=g) + 0.5).to(device), f(2, seqlen, ngroups, dstate),
            f(2, seqlen, ngroups, dstate))
    kw = dict(D=torch.randn(nheads, generator=g).to(device), z=f(2, seqlen, nheads, headdim),
              dt_bias=(torch.randn(nheads, generator=g) * 0.5).to(device), dt_softplus=True,
              initial_states=torch.randn(2, nheads, headdim, dstate, generator=g).to(device),
              capture=[(0, 0), (0, 1), (0, seqlen // 2), (1, seqlen - 1), (1, seqlen)])
    return args, kw


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.accuracy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, default=63)
    parser.add_argument("--chunk-size", type=int, default=16)
    args = parser.parse_args(argv)
    if args.seqlen < 2:
        parser.error(f"--seqlen must be at least 2, got {args.seqlen}")
    try:
        mamba2_chunked.RULES.check_chunk_size(args.chunk_size)
    except ValueError as exc:
        parser.error(f"--chunk-size: {exc}")
    device = common.bench_device()
    triton_label = "triton" if device.type == "cuda" else "triton-interpreter"
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        scan_args, kw = inputs(args.seqlen, dtype, device)
        ref = mamba2_scan_ref(*(a.cpu() for a in scan_args), **{k: v.cpu() if torch.is_tensor(v) else v
                                                                 for k, v in kw.items()})
        for algorithm in ("recurrent", "chunked"):
            for backend, label in (("torch", "torch"), ("triton", triton_label)):
                got = mamba2_scan(*scan_args, **kw, backend=backend, algorithm=algorithm, chunk_size=args.chunk_size)
                errors = [rel_error(g, r) for g, r in zip(got, ref)]
                rows.append([str(dtype).replace("torch.", ""), algorithm, label, *(f"{e:.1e}" for e in errors)])
    print(f"mamba2_scan vs float64, {args.seqlen} tokens x 2 sequences, chunk {args.chunk_size}, "
          f"{common.device_label(device)}")
    print(common.text_table(["inputs", "algorithm", "backend", "y", "final", "captured"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
