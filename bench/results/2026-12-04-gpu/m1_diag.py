"""Where tests/test_mamba1_chunked.py::test_split_at_a_grid_point_is_bitwise[bfloat16-triton] differs
on a GPU: the head pass's final state against captures at the same grid point (absolute position 48)
in the whole pass and in the head pass itself. Run from the repository root on a GPU:
`python3 bench/results/2026-12-04-gpu/m1_diag.py` (its output: m1_diag.log)."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests"))
from helpers import mamba1_inputs, mamba1_positional  # noqa: E402
from ssm_kernels import mamba1_scan  # noqa: E402

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
backend = "triton"


def chunked(*a, **kw):
    return mamba1_scan(*a, **kw, algorithm="chunked", chunk_size=16, backend=backend)


def split(args, kw, lo, hi):
    u, delta, A, B, C = args
    cut = lambda t: t[..., lo:hi]
    return (cut(u), cut(delta), A, cut(B), cut(C)), dict(kw, z=cut(kw["z"]))


def report(name, a, b):
    d = (a.double() - b.double()).abs()
    n = int((a != b).sum())
    where = (a != b).nonzero()[:6].tolist()
    print(f"{name}: {n} of {a.numel()} differ, max abs {d.max().item():.3e}, first {where}", flush=True)


for dtype in (torch.float32, torch.bfloat16):
    torch.manual_seed(0)
    args, kw = mamba1_positional(mamba1_inputs(1, 45, ngroups=2, dtype=dtype, device=dev))
    kw.update(delta_softplus=True)
    k = 32
    print(f"== {dtype}, u {tuple(args[0].shape)} strides {args[0].stride()}", flush=True)
    whole = chunked(*args, **kw, capture=[(0, k), (0, 7)], start_positions=[16])
    head_args, head_kw = split(args, kw, 0, k)
    head = chunked(*head_args, **head_kw, start_positions=[16])
    report("head final vs whole capture", head.final_states[0], whole.captured_states[0])
    report("head y vs whole y", head.y, whole.y[..., :k])
    only = chunked(*args, **kw, capture=[(0, k)], start_positions=[16])
    report("whole (one capture) capture vs whole capture", only.captured_states[0], whole.captured_states[0])
    head_c = chunked(*head_args, **head_kw, capture=[(0, k)], start_positions=[16])
    report("head's own capture at its end vs its final", head_c.captured_states[0], head.final_states[0])
    report("head's own capture at its end vs whole capture", head_c.captured_states[0], whole.captured_states[0])
    report("head (capture at its end) final vs its own capture", head_c.final_states[0], head_c.captured_states[0])
    head_7 = chunked(*head_args, **head_kw, capture=[(0, 7)], start_positions=[16])
    report("head (capture at 7) final vs whole capture", head_7.final_states[0], whole.captured_states[0])
    report("head (capture at 7) final vs head final", head_7.final_states[0], head.final_states[0])
    report("head (capture at 7) y vs head y", head_7.y, head.y)
    contig = [t.contiguous() for t in head_args]
    head_cc = chunked(*contig, **dict(head_kw, z=head_kw["z"].contiguous()), start_positions=[16])
    report("head (contiguous inputs) final vs head final", head_cc.final_states[0], head.final_states[0])
    cut = chunked(*args, **kw, start_positions=[16])  # bare whole pass
    report("whole bare final vs whole final", cut.final_states, whole.final_states)
