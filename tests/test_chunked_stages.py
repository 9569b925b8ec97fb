"""The chunked scan's five stages, each run on its own against its float64 reference
(ssm_kernels/scan/mamba2_chunked/reference.py) and fed the reference's inputs for that stage, so
that a wrong stage fails its own test: the Triton stages (through the interpreter), and the
PyTorch path's per-chunk equivalents of stages 1, 3 and 5 (it folds stage 2 into 5, and its walk,
stage 4, is its loop). The references themselves are checked composed, against the float64 scan.

The kernels keep cs in base-2 units (cs * log2 e), and C B^T, the chunks' own contributions, the
inner captures' partial sums and the chunk-start states in the matmul dtype: those conversions are
made here, not in the references.
Tolerances (helpers.TOLERANCE): float32's for what a stage computes in float32 from its inputs,
the matmul dtype's for what it multiplies or stores in that dtype.
"""
import math
from dataclasses import fields, replace
from types import SimpleNamespace

import pytest
import torch

from helpers import TOLERANCE, assert_rel_close, mamba2_inputs
from ssm_kernels._common import make_capture_table, make_sequences, new_output
from ssm_kernels.scan.mamba2 import mamba2_problem
from ssm_kernels.scan.mamba2_chunked import reference as ref
from ssm_kernels.scan.mamba2_chunked import torch_kernel as pt
from ssm_kernels.scan.mamba2_chunked import triton_kernel as tk
from ssm_kernels._common import Sequences
from ssm_kernels.scan.mamba2_chunked.tables import Chunk, ChunkCapture, make_chunk_tables, plan_chunks
from ssm_kernels.scan.reference import mamba2_scan_ref
from ssm_kernels.scan.torch_kernel import discretize_dt

CHUNK = 16
LOG2E = math.log2(math.e)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
F32_TOL = TOLERANCE[torch.float32]
# A dense batch of two 37-token sequences, the second starting off the chunk grid (an 11-token
# first chunk), with every optional input; a varlen batch with a 1-token and an empty sequence,
# the first starting at a grid point, a per-row D and a dt limit without softplus.
CASES = {
    "dense": dict(lengths=[37, 37], varlen=False, start_positions=[0, 5], D_per_row=False,
                  dims=dict(nheads=4, headdim=16, ngroups=2, dstate=32),
                  options=("D", "z", "dt_bias", "initial_states"), dt_softplus=True, dt_limit=(0.0, math.inf)),
    "varlen": dict(lengths=[20, 1, 0, 37], varlen=True, start_positions=[16, 0, 0, 0], D_per_row=True,
                   dims=dict(nheads=4, headdim=12, ngroups=1, dstate=16),
                   options=("D",), dt_softplus=False, dt_limit=(0.05, 0.4)),
}


def captures_for(lengths):
    """Captures at 0, 1, inside a chunk (5), at 16 (a chunk's start or inside one), len-1, len;
    the first one asked for again."""
    pairs = [(s, k) for s, n in enumerate(lengths) for k in sorted({0, 1, 5, 16, n - 1, n}) if 0 <= k <= n]
    return pairs + pairs[:1]


def make_pass(case, dtype, device, capture=None):
    """The pass's inputs, its ScanProblem (outputs poisoned), its ChunkTables, and every stage's
    float64 reference output, each stage fed the previous references' outputs; its captures
    `capture` (default captures_for's)."""
    spec = CASES[case]
    lengths = spec["lengths"]
    batch, seqlen = (1, sum(lengths)) if spec["varlen"] else (len(lengths), lengths[0])
    kw = mamba2_inputs(batch, seqlen, **spec["dims"], dtype=dtype, device=device, D_per_row=spec["D_per_row"],
                       nseq=len(lengths))
    inp = SimpleNamespace(**{k: kw[k] if k in ("x", "dt", "A", "B", "C") + spec["options"] else None for k in kw},
                          dt_softplus=spec["dt_softplus"], dt_limit=spec["dt_limit"])
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=device) if spec["varlen"] else None
    seqs = make_sequences(batch, seqlen, cu, device)
    capture = captures_for(lengths) if capture is None else capture
    captures = make_capture_table(capture, seqs, device)
    nheads, headdim, dstate = spec["dims"]["nheads"], spec["dims"]["headdim"], spec["dims"]["dstate"]

    def state(rows):
        return new_output(rows, nheads, headdim, dstate, dtype=torch.float32, device=device)

    p = mamba2_problem(inp.x, inp.dt, inp.A, inp.B, inp.C, inp.D, inp.z, inp.dt_bias, inp.dt_softplus, inp.dt_limit,
                       inp.initial_states, None, seqs, captures, new_output(*inp.x.shape, dtype=dtype, device=device),
                       state(seqs.count), state(captures.count))
    tables = make_chunk_tables(seqs, captures, CHUNK, spec["start_positions"], device)

    dt, cs, decay = ref.dt_cumsum_ref(inp.dt, inp.A, tables, dt_bias=inp.dt_bias, dt_softplus=inp.dt_softplus,
                                      dt_limit=inp.dt_limit)
    cb = ref.chunk_cb_ref(inp.B, inp.C, tables)
    states, partial = ref.chunk_state_ref(inp.x, inp.B, dt, cs, tables)
    rows = [row for _, _, row in captures.entries]
    start, final, captured = ref.state_passing_ref(states, decay, cs, partial, tables, inp.initial_states, rows)
    y = ref.chunk_output_ref(inp.x, inp.C, dt, cs, cb, start, tables, D=inp.D, z=inp.z)
    want = SimpleNamespace(dt=dt, cs=cs, decay=decay, cb=cb, states=states, partial=partial, start=start,
                           final=final, captured=captured, y=y)
    return SimpleNamespace(inp=inp, cu_seqlens=cu, capture=capture, p=p, tables=tables, want=want, rows=rows,
                           mm_tol=TOLERANCE[tk.MATMUL_DTYPES[dtype]])


def run_stage(stage, case, dtype, device, *inputs, run=None):
    """A pass (make_pass, or `run`) after the Triton stage `stage` ran on a workspace that is NaN
    (-1 for the non-finite marks) but for the scratch named in `inputs`, copied in from the
    references (cs converted to base 2, each rounded to its scratch's dtype): (the pass, the
    workspace)."""
    run = run or make_pass(case, dtype, device)
    ws = tk.new_workspace(run.p, run.tables)
    for f in fields(ws):
        if f.name not in ("cfg", "counters", "flags"):  # the scratch; the fused pass's counters are ints
            scratch = getattr(ws, f.name)
            scratch.fill_(float("nan") if scratch.is_floating_point() else -1)
    for name in inputs:
        value = getattr(run.want, name)
        getattr(ws, name).copy_(value * LOG2E if name == "cs" else value)
    if ws.fused:
        ws.counters[0] = 1  # the generation stage 1 opens
    stage(run.p, run.tables, ws)
    return run, ws


# The Triton stages -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_stage1_dt_cumsum(case, dtype, device):
    run, ws = run_stage(tk.stage1_dt_cumsum, case, dtype, device)
    assert_rel_close(ws.dt, run.want.dt, F32_TOL, "dt'")
    assert_rel_close(ws.cs / LOG2E, run.want.cs, F32_TOL, "cs")
    assert_rel_close(ws.decay, run.want.decay, F32_TOL, "decay")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_stage2_chunk_cb(case, dtype, device):
    run, ws = run_stage(tk.stage2_chunk_cb, case, dtype, device)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=device).tril()  # all the kernels write or read
    assert_rel_close(torch.where(causal, ws.cb, 0.0), torch.where(causal, run.want.cb, 0.0), run.mm_tol, "C B^T")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_stage3_chunk_state(case, dtype, device):
    run, ws = run_stage(tk.stage3_chunk_state, case, dtype, device, "dt", "cs")
    assert_rel_close(ws.states, run.want.states, run.mm_tol, "chunk states")
    assert_rel_close(ws.partial, run.want.partial, run.mm_tol, "inner captures' partial states")
    assert torch.equal(ws.nonfinite, nonfinite_marks(run, ws.cfg["BLOCK_P"])), "non-finite marks of finite inputs"


def nonfinite_marks(run, block_p):
    """Workspace.nonfinite from its definition: 1 where chunk c's x holds a non-finite entry in head
    h's P block, from x itself."""
    x = run.inp.x
    nheads, headdim = x.shape[2:]
    n_pblocks = -(-headdim // block_p)
    marks = torch.zeros(run.tables.nchunks, nheads, n_pblocks, dtype=torch.int8, device=x.device)
    for c, (b, t0, n) in enumerate(run.tables.chunk_list):
        for i in range(n_pblocks):
            block = x[b, t0:t0 + n, :, i * block_p:(i + 1) * block_p]
            marks[c, :, i] = (~block.isfinite()).any(2).any(0).to(torch.int8)
    return marks


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf, as on a GPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stage3_marks_each_chunks_nonfinite_x(dtype, device, monkeypatch):
    """Stage 3 marks (chunk, head, P block) where the chunk's x holds a NaN or an inf, at a chunk's
    first and last token and inside one, in one P block of two (headdim 80: P blocks of 64, or 16 x
    5 for float32), and nowhere else; the output kernel's fix-up rests on these marks."""
    monkeypatch.setitem(CASES, "wide", dict(CASES["varlen"], dims=dict(nheads=2, headdim=80, ngroups=1, dstate=16)))
    run = make_pass("wide", dtype, device)
    x = run.inp.x  # (1, 58, 2, 80): chunks of 16, 4, 1 and 16, 16, 5 tokens
    for t, h, p, value in [(0, 0, 3, float("nan")), (20, 1, 70, float("inf")), (27, 0, 79, -float("inf")),
                           (57, 1, 0, float("nan"))]:
        x[0, t, h, p] = value
    run, ws = run_stage(tk.stage3_chunk_state, "wide", dtype, device, "dt", "cs", run=run)
    want = nonfinite_marks(run, ws.cfg["BLOCK_P"])
    assert 0 < int(want.sum()) < want.numel()
    assert torch.equal(ws.nonfinite, want), "non-finite marks"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_stage4_state_passing(case, dtype, device):
    run, ws = run_stage(tk.stage4_state_passing, case, dtype, device, "states", "decay", "cs", "partial")
    # The reference walk from what the stage read: the chunks' contributions and the partials as
    # their scratch holds them (in the matmul dtype), so that the walk itself is held to float32.
    start, final, captured = ref.state_passing_ref(ws.states.double(), run.want.decay, run.want.cs,
                                                   ws.partial.double(), run.tables, run.inp.initial_states, run.rows)
    assert_rel_close(ws.start, start, run.mm_tol, "chunk-start states")  # stored in the matmul dtype
    assert_rel_close(run.p.state_out, final, F32_TOL, "final states")
    assert_rel_close(run.p.captured, captured, F32_TOL, "captured states")


@pytest.mark.parametrize("case", CASES)
def test_stage4_walks_the_chunks_without_the_step_table_where_no_capture_needs_a_step(case, device):
    """Without a capture at a chunk's start or inside one (ChunkTables.plain_walk; the final
    states' captures aside), stage 4 walks the chunks without reading the step table
    (_walk_chunks): the chunk-start, final and end-captured states of the table's walk, bit for bit."""
    lengths = CASES[case]["lengths"]
    run = make_pass(case, torch.bfloat16, device, capture=[(s, n) for s, n in enumerate(lengths)])
    assert run.tables.plain_walk
    assert not make_pass(case, torch.bfloat16, device).tables.plain_walk  # captures at 0, 1, 5, 16, ...
    walked = []
    for plain in (True, False):
        run.tables = replace(run.tables, plain_walk=plain)
        run.p.state_out.fill_(float("nan"))
        run.p.captured.fill_(float("nan"))
        _, ws = run_stage(tk.stage4_state_passing, case, torch.bfloat16, device, "states", "decay", "cs", run=run)
        walked.append([ws.start.clone(), run.p.state_out.clone(), run.p.captured.clone()])
    for name, a, b in zip(("chunk-start states", "final states", "captured states"), *walked):
        assert not a.isnan().any() and torch.equal(a, b), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_stage5_chunk_output(case, dtype, device):
    run, _ = run_stage(tk.stage5_chunk_output, case, dtype, device, "dt", "cs", "cb", "start")
    assert_rel_close(run.p.y, run.want.y, run.mm_tol, "y")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_stages_2_to_5_fused(case, dtype, device):
    """The fused pass (stages 2 to 5 in one launch) writes what the four stages write, and every
    program took its ticket and every producer raised its flag once."""
    with tk.fused_pass():
        run, ws = run_stage(tk.stage2to5_fused, case, dtype, device, "dt", "cs", "decay")
    want = run.want
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=device).tril()
    assert_rel_close(torch.where(causal, ws.cb, 0.0), torch.where(causal, want.cb, 0.0), run.mm_tol, "C B^T")
    assert_rel_close(ws.start, want.start, run.mm_tol, "chunk-start states")
    assert_rel_close(run.p.state_out, want.final, run.mm_tol, "final states")  # from its own chunk states
    assert_rel_close(run.p.captured, want.captured, run.mm_tol, "captured states")
    assert_rel_close(run.p.y, want.y, run.mm_tol, "y")
    nheads, headdim, dstate, ngroups = run.p.dims
    tables = run.tables
    counts = tk.fused_counts(ws.cfg, headdim, dstate, CHUNK)
    ninner, nempty, nm = tables.inner.shape[0], tables.nrows - tables.nchunks, CHUNK // ws.cfg["BLOCK_M"]
    per_chunk = nheads * (counts.n_pn + counts.n_mp) + ngroups * nm * nm
    programs = nheads * (ninner * counts.n_pn + nempty * counts.n_pass) + (tables.nchunks + 1) * per_chunk
    assert ws.counters.tolist() == [1, programs], "(generation, tickets taken)"
    # Each flag raised once by each of its producers: a (chunk, head)'s by its chunk programs and its
    # group's C B^T programs, an (inner capture, head)'s by its partials.
    raised = [(tables.nchunks * nheads, counts.n_pn + nm * nm), (ninner * nheads, counts.n_pn)]
    want = torch.cat([torch.full((n,), producers, dtype=torch.int32) for n, producers in raised])
    assert torch.equal(ws.flags.cpu(), want), "a flag that its producers did not all raise"


# The PyTorch path's equivalents, chunk by chunk (float32 whatever the input dtype) ----------------

def torch_chunk(run, c):
    """Chunk c as run_chunked_torch takes it, in float32: its batch row b, tokens tok and length n,
    the references' cs and dt' (n, nheads), x (n, nheads, headdim), the heads' B and C (n, nheads,
    dstate)."""
    inp, want = run.inp, run.want
    nheads = inp.x.shape[2]
    group = torch.arange(nheads, device=inp.x.device) // (nheads // inp.B.shape[2])
    b, t0, n = run.tables.chunk_list[c]
    tok = slice(t0, t0 + n)
    return SimpleNamespace(b=b, tok=tok, n=n, cs=want.cs[c, :, :n].T.float(), dt=want.dt[c, :, :n].T.float(),
                           x=inp.x[b, tok].float(), B=inp.B[b, tok][:, group].float(),
                           C=inp.C[b, tok][:, group].float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_torch_stage1_dt_cumsum(case, dtype, device):
    run = make_pass(case, dtype, device)
    p = run.p
    dt_bias = p.dt_bias[:, 0].float() if p.dt_bias is not None else None
    for c in range(run.tables.nchunks):
        ch = torch_chunk(run, c)
        dt = discretize_dt(p.dt[ch.b, ch.tok, :, 0].float(), dt_bias, p)
        assert_rel_close(dt, run.want.dt[c, :, :ch.n].T, F32_TOL, f"chunk {c} dt'")
        assert_rel_close(pt.dt_cumsum(dt, p.A[:, 0, 0].float()), run.want.cs[c, :, :ch.n].T, F32_TOL, f"chunk {c} cs")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_torch_stage3_chunk_state(case, dtype, device):
    run = make_pass(case, dtype, device)
    zero = torch.zeros(run.want.states.shape[1:], device=device)

    def contribution(c, k):  # of chunk c's first k tokens: the state they leave from a zero one
        ch = torch_chunk(run, c)
        return pt.state_after(zero, ch.cs, ch.dt, ch.x, ch.B, k)

    states = [contribution(c, n) for c, (_, _, n) in enumerate(run.tables.chunk_list)]
    partial = [contribution(c, j) for _, c, j in run.tables.inner_list]
    assert_rel_close(torch.stack(states), run.want.states, F32_TOL, "chunk states")
    assert_rel_close(torch.stack(partial), run.want.partial, F32_TOL, "inner captures' partial states")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_torch_stage5_chunk_output(case, dtype, device):
    run = make_pass(case, dtype, device)
    p = run.p
    y = torch.zeros_like(run.want.y)
    D = p.D.float() if p.D is not None else None
    for c in range(run.tables.nchunks):
        ch = torch_chunk(run, c)
        z = p.z[ch.b, ch.tok].float() if p.z is not None else None
        y[ch.b, ch.tok] = pt.chunk_output(run.want.start[c].float(), ch.cs, ch.dt, ch.x, ch.B, ch.C, D, z).double()
    assert_rel_close(y, run.want.y, F32_TOL, "y")


# The references ---------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_stage_references_compose_to_the_float64_scan(case, device):
    run = make_pass(case, torch.float32, device)
    inp = run.inp
    opts = dict(D=inp.D, z=inp.z, dt_bias=inp.dt_bias, dt_softplus=inp.dt_softplus, dt_limit=inp.dt_limit,
                initial_states=inp.initial_states)
    got = ref.chunked_scan_ref(inp.x, inp.dt, inp.A, inp.B, inp.C, run.tables, **opts,
                               capture_rows=[row for _, _, row in run.p.captures.entries])
    want = mamba2_scan_ref(inp.x, inp.dt, inp.A, inp.B, inp.C, **opts, cu_seqlens=run.cu_seqlens, capture=run.capture)
    for name, u, v in zip(want._fields, got, want):
        assert_rel_close(u, v, 1e-12, name)


def test_chunk_plans_at_their_edges():
    """A pass starting at 6 on a grid of 16 is cut at offsets 10 and 26: a capture at 10 (a grid
    point) is the start of chunk 1, not the end of chunk 0 nor an inner capture; one at 16 is
    inner, 6 into chunk 1. A capture on a grid point is a walk's start capture: no plain walk. An
    empty sequence owns no chunk, only a row of its own after the chunks, where its capture at 0
    lands."""
    plan = plan_chunks(Sequences(None, [40], False), [(0, 10, 0), (0, 16, 1)], 16, [6])
    assert plan.chunk_list == [Chunk(0, 0, 10), Chunk(0, 10, 16), Chunk(0, 26, 14)]
    assert plan.capture_list == [ChunkCapture(0, 1, 0), ChunkCapture(1, 1, 6)]
    assert plan.inner_list == [ChunkCapture(1, 1, 6)]
    assert not plan_chunks(Sequences(None, [40], False), [(0, 16, 0)], 16, [0]).plain_walk
    assert plan_chunks(Sequences(None, [40], False), [(0, 40, 0)], 16, [0]).plain_walk
    plan = plan_chunks(Sequences(None, [0, 5], True), [(0, 0, 0)], 16, [0, 0])
    assert plan.chunk_list == [Chunk(0, 0, 5)] and plan.seq_chunk_list == [0, 0, 1]
    assert plan.capture_list == [ChunkCapture(0, 1, 0)]
