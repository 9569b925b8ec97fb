"""A model's layers call the public scans one after another alike: from a layout's fourth call
their launches are replayed (the chunked Mamba-2 scan: mamba2_chunked.run; the recurrent kernel's
and conv kernels' calls: _replay.run_public; all with fresh scratch), and each replay gives the bits of
a fresh call, for every argument that decides the launches. The capture tables of like calls are
one table (make_capture_table)."""
import math
from types import SimpleNamespace

import pytest
import torch

from helpers import mamba1_inputs, mamba1_positional, mamba2_inputs, mamba2_positional
from ssm_kernels import (_common, _replay, causal_conv1d, causal_conv1d_update, mamba1_scan, mamba2_scan,
                         selective_state_update)
from ssm_kernels.conv import conv1d
from ssm_kernels._common import Sequences, make_capture_table
from ssm_kernels.scan import dispatch, mamba1_chunked, mamba2_chunked
from ssm_kernels.scan.mamba2_chunked import tables as chunk_tables
from ssm_kernels.scan.mamba2_chunked.triton_kernel import fused_pass

SMALL = dict(nheads=4, headdim=16, ngroups=2, dstate=16)
CALLS = 6  # a plain call, a watched recording, a checked one, then replays


@pytest.fixture
def runs(monkeypatch):
    """How many calls ran the stages' host code (the rest were replayed)."""
    count, real = [0], mamba2_chunked.run_chunked_triton

    def counted(p, tables):
        count[0] += 1
        real(p, tables)
    monkeypatch.setattr(mamba2_chunked, "run_chunked_triton", counted)
    return count


def _fresh(args, kw):
    """The pass with nothing taken from an earlier one."""
    chunk_tables._recent_tables.cache_clear()
    _common._recent_capture_table.cache_clear()
    return mamba2_scan(*args, **kw)


def _assert_equal(got, want):
    for name, g, w in zip(("y", "final_states", "captured_states"), got, want):
        assert torch.equal(g, w), name


PASSES = {
    "dense, captures": dict(batch=2, seqlen=40, kw=dict(capture=[(1, 40), (0, 17), (0, 0)], start_positions=[16, 0])),
    "varlen, empty and 1-token": dict(batch=1, seqlen=41, nseq=4, kw=dict(capture=[(3, 1), (0, 20)]),
                                      cu_seqlens=[0, 30, 30, 40, 41]),
    "bfloat16, per-row D": dict(batch=1, seqlen=35, dtype=torch.bfloat16, D_per_row=True, kw=dict(capture=[(0, 33)])),
}


@pytest.mark.parametrize("name", PASSES)
def test_later_calls_replay_and_give_a_fresh_passs_bits(name, runs, device):
    spec = dict(PASSES[name])
    kw, cu = spec.pop("kw"), spec.pop("cu_seqlens", None)
    batch, seqlen = spec.pop("batch"), spec.pop("seqlen")
    calls = []
    for _ in range(CALLS):  # a layer's own tensors each call, laid out alike
        args, inputs = mamba2_positional(mamba2_inputs(batch, seqlen, **SMALL, device=device, **spec))
        inputs.update(kw, dt_softplus=True, backend="triton", algorithm="chunked", chunk_size=16)
        if cu is not None:
            inputs["cu_seqlens"] = torch.tensor(cu, device=device)
        calls.append((args, inputs, mamba2_scan(*args, **inputs)))
    assert runs[0] == 3
    for args, inputs, got in calls:
        _assert_equal(got, _fresh(args, inputs))


CHANGES = {
    "captures in another order": dict(capture=[(0, 5), (0, 30)]),
    "dt_limit": dict(dt_limit=(0.01, 0.5)),
    "dt_limit's lower bound -0.0, not 0.0": dict(dt_limit=(-0.0, math.inf)),  # equal as floats, not as bits
    "dt_softplus": dict(dt_softplus=False),
    "start positions": dict(start_positions=[5]),
    "chunk size": dict(chunk_size=32),
    "no D": dict(D=None),
    "strided x": dict(x="strided"),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_call_that_differs_from_the_replayed_one_runs_as_itself(change, runs, device):
    """After a layout replays, a call that differs in anything that decides the launches (the
    captures' order, scalars, the grid, an optional input, strides) runs its own launches."""
    def call(**changes):
        args, inputs = mamba2_positional(mamba2_inputs(1, 45, **SMALL, device=device))
        inputs.update(dict(capture=[(0, 30), (0, 5)], dt_softplus=True, backend="triton", algorithm="chunked",
                           chunk_size=16), **changes)
        if inputs.pop("x", None) == "strided":  # every other row of a wider tensor's last axis
            args = (torch.cat([args[0], args[0]], dim=-1)[..., ::2], *args[1:])
        return args, inputs, mamba2_scan(*args, **inputs)
    for _ in range(4):
        call()
    assert runs[0] == 3
    args, inputs, got = call(**CHANGES[change])
    assert runs[0] == 4
    _assert_equal(got, _fresh(args, inputs))


def test_the_fused_pass_is_not_replayed_for_the_five_stages_nor_at_all(runs, device):
    """A replay of the five stages is not taken for the fused pass; and the fused pass is never
    replayed: a call allocates its workspace's counters and flags zeroed (a torch kernel)."""
    args, inputs = mamba2_positional(mamba2_inputs(1, 40, **SMALL, device=device))
    inputs.update(dt_softplus=True, backend="triton", algorithm="chunked", chunk_size=16)
    for _ in range(4):
        mamba2_scan(*args, **inputs)
    with fused_pass():
        for n in range(5):
            got = mamba2_scan(*args, **inputs)
            assert runs[0] == 4 + n
        _assert_equal(got, _fresh(args, inputs))


def test_a_capture_table_like_a_recent_one_is_that_one(monkeypatch):
    """The same captures in the same order over as many sequences: one table. Another order is
    another table (its rows say where each capture goes); under CUDA graph capture, always a new one."""
    seqs = Sequences(None, [30, 5], True)
    cpu = torch.device("cpu")
    first = make_capture_table([(0, 20), (1, 5)], seqs, cpu)
    assert make_capture_table(torch.tensor([[0, 20], [1, 5]]), seqs, cpu) is first
    other = make_capture_table([(1, 5), (0, 20)], seqs, cpu)
    assert other is not first and other.row.tolist() == [1, 0] and first.row.tolist() == [0, 1]
    with pytest.raises(ValueError, match="past its length"):
        make_capture_table([(1, 6)], seqs, cpu)  # checked every call
    real = _common.int_tables
    monkeypatch.setattr(_common, "int_tables", lambda device, *lists: real(cpu, *lists))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=1))
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    cuda = torch.device("cuda", 0)
    assert make_capture_table([(0, 20)], seqs, cuda) is make_capture_table([(0, 20)], seqs, cuda)
    capturing[0] = True
    assert make_capture_table([(0, 20)], seqs, cuda) is not make_capture_table([(0, 20)], seqs, cuda)


def test_no_replay_while_a_graph_is_captured(monkeypatch, runs, device):
    """Under CUDA graph capture every call plans its own pass and records nothing: the graph keeps
    what it launched."""
    monkeypatch.setattr(_common, "cache_stream", lambda device: (False, None))
    monkeypatch.setattr(chunk_tables, "cache_stream", lambda device: (False, None))
    args, inputs = mamba2_positional(mamba2_inputs(1, 40, **SMALL, device=device))
    inputs.update(dt_softplus=True, backend="triton", algorithm="chunked", chunk_size=16)
    for _ in range(5):
        mamba2_scan(*args, **inputs)
    assert runs[0] == 5


# -------------------------------------------------------------------------------------------
# The other public calls: the recurrent scans, Mamba-1 chunked, the decode steps, the conv
# -------------------------------------------------------------------------------------------
@pytest.fixture
def recurrent_runs(monkeypatch):
    """How many public calls ran the recurrent, Mamba-1 chunked or conv kernels' host code (the
    rest were replayed)."""
    count = [0]
    for module in (dispatch, mamba1_chunked, conv1d):
        def counted(p, *table, real=module.run_triton):
            count[0] += 1
            real(p, *table)
        monkeypatch.setattr(module, "run_triton", counted)
    return count


def _mamba2(device, cu=(0, 17, 17, 30, 31), **changes):
    args, kw = mamba2_positional(mamba2_inputs(1, cu[-1], **SMALL, nseq=len(cu) - 1, device=device))
    kw.update(dict(cu_seqlens=list(cu), capture=[(3, 1), (0, 9), (2, 0)], dt_softplus=True, backend="triton",
                   algorithm="recurrent"), **changes)
    return lambda: mamba2_scan(*args, **kw)


def _mamba1(device, **changes):
    args, kw = mamba1_positional(mamba1_inputs(2, 21, ngroups=2, device=device))
    kw.update(dict(capture=[(1, 21), (0, 4)], delta_softplus=True, backend="triton", algorithm="recurrent"),
              **changes)
    return lambda: mamba1_scan(*args, **kw)


def _decode(device, dtype=torch.float32, **changes):
    """A decode step on a pool of 5 slots: rows read slots 3 and 0, a padded row, and write slots
    4, 0 and nothing; returns y and the pool after the step (its own copy)."""
    kw = mamba2_inputs(3, 1, **SMALL, device=device)
    pool = torch.randn(5, *kw["initial_states"].shape[1:], device=device).to(dtype)
    step = dict(x=kw["x"][:, 0], dt=kw["dt"][:, 0], A=kw["A"], B=kw["B"][:, 0], C=kw["C"][:, 0], D=kw["D"],
                dt_bias=kw["dt_bias"], dt_softplus=True, state_indices=torch.tensor([3, 0, -1], device=device),
                dst_state_indices=torch.tensor([4, 0, -1], device=device), pad_slot_id=-1, backend="triton")
    step.update(changes)

    def call():
        state = pool.clone()
        return selective_state_update(state, **step), state
    return call


def _conv(device):
    x = torch.randn(1, 24, 31, device=device)
    kw = dict(weight=torch.randn(24, 4, device=device), bias=torch.randn(24, device=device), activation="silu",
              initial_states=torch.randn(4, 24, 3, device=device), cu_seqlens=[0, 17, 17, 30, 31],
              capture=[(3, 1), (0, 2), (2, 0)], backend="triton")
    return lambda: causal_conv1d(x, **kw)


def _conv_step(device):
    """A conv decode step on a pool of 5 slots, rows on slots 3, 0 and 4; returns out and the pool
    after the step (its own copy)."""
    x, pool = torch.randn(3, 24, device=device), torch.randn(5, 24, 3, device=device)
    kw = dict(weight=torch.randn(24, 4, device=device), activation="silu",
              state_indices=torch.tensor([3, 0, 4], device=device), backend="triton")

    def call():
        state = pool.clone()
        return causal_conv1d_update(x, state, **kw), state
    return call


RECURRENT = {"mamba2_scan varlen": _mamba2, "mamba1_scan groups": _mamba1,
             "mamba1_scan chunked, start positions": lambda device: _mamba1(
                 device, algorithm="chunked", chunk_size=16, start_positions=[5, 0]),
             "decode step": _decode,
             "decode step, bfloat16 pool": lambda device: _decode(device, torch.bfloat16),
             "causal_conv1d varlen": _conv, "causal_conv1d_update": _conv_step}


@pytest.mark.parametrize("name", RECURRENT)
def test_recurrent_calls_replay_and_give_a_fresh_calls_bits(name, recurrent_runs, device):
    calls = [RECURRENT[name](device) for _ in range(CALLS)]  # a layer's own tensors each call
    results = [call() for call in calls]
    assert recurrent_runs[0] == 3
    for call, got in zip(calls, results):
        _replay._public.clear()
        assert all(torch.equal(g, w) for g, w in zip(got, call()))


RECURRENT_CHANGES = {
    "other sequences, same shapes": lambda device: _mamba2(device, cu=(0, 9, 20, 20, 31)),
    "dt_limit": lambda device: _mamba2(device, dt_limit=(0.01, 0.5)),
    "dt_limit's lower bound -0.0, not 0.0": lambda device: _mamba2(device, dt_limit=(-0.0, math.inf)),
    "no captures": lambda device: _mamba2(device, capture=None),
    "no pad_slot_id": lambda device: _decode(device, pad_slot_id=None,
                                             state_indices=torch.tensor([3, 0, 1], device=device),
                                             dst_state_indices=torch.tensor([4, 0, 2], device=device)),
}


@pytest.mark.parametrize("change", RECURRENT_CHANGES)
def test_a_recurrent_call_that_differs_from_the_replayed_one_runs_as_itself(change, recurrent_runs, device):
    base = _decode if change.startswith("no pad") else _mamba2
    for _ in range(4):
        base(device)()
    assert recurrent_runs[0] == 3
    call = RECURRENT_CHANGES[change](device)
    got = call()
    assert recurrent_runs[0] == 4
    _replay._public.clear()
    assert all(torch.equal(g, w) for g, w in zip(got, call()))


def test_the_recurrent_calls_keep_their_last_layouts_and_none_under_graph_capture(monkeypatch, recurrent_runs,
                                                                                 device):
    """A layout not among the RECENT_LAYOUTS called last is recorded again; under CUDA graph
    capture every call runs as it is."""
    monkeypatch.setattr(_replay, "_public", _replay.RecentLayouts(2))
    layouts = [lambda: _mamba2(device), lambda: _mamba2(device, dt_limit=(0.0, 1.0)),
               lambda: _mamba2(device, dt_limit=(0.0, 2.0))]
    for make in layouts[:2]:
        for _ in range(4):
            make()()
    assert recurrent_runs[0] == 6
    for _ in range(4):
        layouts[2]()()  # the first layout's launches go
    layouts[1]()()
    assert recurrent_runs[0] == 9
    layouts[0]()()
    assert recurrent_runs[0] == 10
    layouts[1]()()  # called lately: kept while the first's come back
    assert recurrent_runs[0] == 10
    monkeypatch.setattr(_common, "cache_stream", lambda device: (False, None))
    for _ in range(4):
        layouts[1]()()
    assert recurrent_runs[0] == 14
