"""A step's later layers replay the launches its earlier layers recorded (_replay.py): the rules
on a stand-in kernel (an engine step's, and fresh scratch's, as the public chunked scan replays),
then every engine op on Triton against a fresh step, bit for bit."""
from __future__ import annotations

import itertools
import threading
import weakref

import pytest
import torch
import triton

from helpers import mamba1_inputs, mamba2_inputs
from ssm_kernels import _triton, cache_ops
from ssm_kernels import _replay as replay
from ssm_kernels.scan.mamba2_chunked.triton_kernel import fused_pass


class Kernel:
    """A kernel's stand-in: each launch appends (grid, args, kwargs) to `launched` and returns
    `compiled` (None, as under the interpreter)."""

    def __init__(self, compiled=None):
        def fn(a, b, n, flag, BLOCK=4):
            pass
        self.fn, self.arg_names, self.launched, self.compiled = fn, ["a", "b", "n", "flag", "BLOCK"], [], compiled

    def __getitem__(self, grid):
        return lambda *args, **kwargs: (self.launched.append((grid, args, kwargs)), self.compiled)[1]


class Op:
    """An engine op's stand-in on a step (`launches`, the batch's): each call launches the kernel
    on its tensor `x` (through _triton.launch) with what `body(x)` gives for the other arguments;
    `ran` counts the calls that ran the body."""

    def __init__(self, body, kernel=None, fresh=False):
        self.kernel, self.body, self.launches, self.ran, self.fresh = kernel or Kernel(), body, {}, 0, fresh

    def __call__(self, *tensors):
        def call():
            self.ran += 1
            _triton.launch(self.kernel, (2,), tensors[0], *self.body(*tensors), BLOCK=8, num_warps=1)
        replay.run(self.launches, ("op",), tensors, call, fresh=self.fresh)


TABLE = torch.arange(6)  # a step's table: the same tensor for every layer


def test_later_calls_replay_the_launches_with_their_own_tensors():
    op = Op(lambda x: (TABLE, 5, True))
    xs = [torch.randn(4, 3) for _ in range(4)]
    for x in xs:
        op(x)
    assert op.ran == 2, "two recordings, then replays"
    for x, (grid, args, kwargs) in zip(xs, op.kernel.launched):
        assert grid in ((2,), (2, 1, 1)) and args[0] is x and args[1] is TABLE and args[2:4] == (5, True)
    assert op.kernel.launched[-1][1][4] == 8 and op.kernel.launched[-1][2] == {"num_warps": 1}, \
        "a replay passes every parameter in order, the launch options by name"


def test_a_tensor_the_call_allocates_is_reused():
    op = Op(lambda x: (torch.empty(3), 5, True))
    for _ in range(4):
        op(torch.randn(4, 3))
    assert op.ran == 2
    second, third, fourth = (args[1] for _, args, _ in op.kernel.launched[1:])
    assert third is second and fourth is second, "the second recording's scratch"


@pytest.mark.parametrize("body", [
    lambda x: (x + 1, 5, True),  # a torch kernel: a replay would skip its work
    lambda x: (x[1:], 5, True),  # another view of the call's tensor: not replaced by its address
    lambda x, count=itertools.count(): (TABLE, next(count), True),  # recordings that differ
], ids=["torch kernel", "offset view", "recordings differ"])
def test_a_call_that_cannot_be_replayed_runs_as_it_is(body):
    op = Op(body)
    recorders = []
    op.body = lambda x: (recorders.append(_triton.recording.recorder), body(x))[1]
    for _ in range(5):
        op(torch.randn(4, 3))
    assert op.ran == 5
    assert [r is not None for r in recorders] == [True] * replay.RECORDINGS + [False] * (5 - replay.RECORDINGS)


def test_fresh_replays_run_on_scratch_of_their_own():
    """A public pass's replay (fresh): its first call records nothing, the second is watched, the
    third checked against it; later calls get new scratch, laid out as the call made it (a view's
    offset into its storage kept), and what the op keeps holds none of it."""
    recorders, made = [], []

    def body(x):
        recorders.append(_triton.recording.recorder)
        scratch = torch.empty(10)
        made.append(weakref.ref(scratch))
        return scratch[4:], 5, True
    op = Op(body, fresh=True)
    for _ in range(6):
        op(torch.randn(4, 3))
    assert op.ran == 3 and recorders[0] is None and None not in recorders[1:]
    replayed = [args[1] for _, args, _ in op.kernel.launched[3:]]
    for t in replayed:
        assert t.storage_offset() == 4 and t.untyped_storage().nbytes() == 40 and t.dtype == torch.float32
    del replayed, t
    op.kernel.launched.clear()
    recorders.clear()
    assert all(ref() is None for ref in made), "the recordings' scratch is not kept: each replay made its own"


@pytest.mark.parametrize("body", [
    lambda x: (x + 1, 5, True),  # a torch kernel: a replay would skip its work
    lambda x, count=itertools.count(): (TABLE, next(count), True),  # recordings that differ
    lambda x, count=itertools.count(): (torch.empty(3) if next(count) % 2 else TABLE, 5, True),  # scratch or not
], ids=["torch kernel", "recordings differ", "scratch in one"])
def test_a_fresh_call_that_cannot_be_replayed_runs_as_it_is(body):
    op = Op(body, fresh=True)
    for _ in range(6):
        op(torch.randn(4, 3))
    assert op.ran == 6


def test_two_tensors_at_one_address_are_not_replayed():
    op = Op(lambda x, y: (y, 5, True))
    for _ in range(4):
        x = torch.randn(4, 3)
        op(x, x)
    assert op.ran == 4


def test_another_threads_launches_are_not_recorded():
    """A recorder sees its own thread's launches only (another engine may launch meanwhile)."""
    other = Kernel()

    def body(x):
        thread = threading.Thread(target=lambda: _triton.launch(other, (1,), TABLE, TABLE, 1, False))
        thread.start()
        thread.join()
        return TABLE, 5, True
    op = Op(body)
    for _ in range(4):
        op(torch.randn(4, 3))
    assert op.ran == 2 and len(op.kernel.launched) == 4
    assert len(other.launched) == 2, "launched by its own thread, never replayed with the op"


def test_each_layout_records_its_own():
    """Shape, strides, dtype and the address modulo 16 (Triton specializes on it) make a layout."""
    op = Op(lambda x: (TABLE, 5, True))
    layouts = [lambda: torch.randn(4, 3), lambda: torch.randn(3, 4).t(), lambda: torch.randn(4, 3).double(),
               lambda: torch.randn(13)[1:].view(4, 3)]
    for make in layouts:
        for _ in range(3):
            op(make())
    assert op.ran == 2 * len(layouts)
    assert len(op.launches) == len(layouts)


def test_a_compiled_kernel_is_launched_directly(monkeypatch):
    """Where the launch returned a compiled kernel (on a GPU), a replay calls its launcher on the
    current stream with every parameter, as Triton's own launch does, and binds nothing."""
    class Compiled:
        function, packed_metadata = "function", "metadata"

        def __init__(self):
            self.ran = []

        def run(self, *args):
            self.ran.append(args)

        def launch_metadata(self, grid, stream, *args):
            return ("metadata of", grid, stream, args)

    compiled = Compiled()
    monkeypatch.setattr(replay, "_stream", lambda: "stream")
    op = Op(lambda x: (TABLE, 5, True), Kernel(compiled))
    xs = [torch.randn(4, 3) for _ in range(3)]
    for x in xs:
        op(x)
    assert len(op.kernel.launched) == 2, "the third call did not go through the kernel"
    (args,) = compiled.ran
    values = (xs[2], TABLE, 5, True, 8)
    assert args[:6] == (2, 1, 1, "stream", "function", "metadata")
    assert args[6] == ("metadata of", (2, 1, 1), "stream", values)
    assert args[7:9] == (triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook)
    assert args[9] is xs[2] and args[10:] == values[1:]


# Every engine op on Triton, a step of three layers each with its own tensors and cache: the
# third replays, and gives the bits of the same layer in a step of its own.
LENGTHS, SLOTS, POSITIONS = [5, 0, 9, 1], [3, 1, 0, 2], [16, 0, 3, 0]
HAS_INIT = [True, False, True, False]
CAPTURES = [(0, 2, 4), (2, 9, 5)]  # (sequence, offset, slot)
NSLOTS, CHUNK = 6, 16


def _prefill_batch(chunk_size=CHUNK):
    """The step from host data, as the vLLM plugin builds it; without chunk_size its chunk tables
    are built by the step's first chunked layer."""
    bounds = [0]
    for n in LENGTHS:
        bounds.append(bounds[-1] + n)
    seq, offset, slot = zip(*CAPTURES)
    return cache_ops.prefill_batch(
        torch.tensor(bounds, dtype=torch.int32), torch.tensor(SLOTS, dtype=torch.int32),
        has_initial_state=torch.tensor(HAS_INIT), capture_seq=list(seq), capture_offset=list(offset),
        capture_slot=torch.tensor(slot), validate=False, start_positions=POSITIONS, host_cu_seqlens=bounds,
        chunk_size=chunk_size)


def _decode_batch():
    return cache_ops.decode_batch(torch.tensor(SLOTS, dtype=torch.int32), nslots=NSLOTS)


def _mamba2(ntokens):
    kw = mamba2_inputs(1, ntokens, dtype=torch.bfloat16)
    nheads, headdim, dstate = kw["initial_states"].shape[1:]
    return dict(x=kw["x"][0], dt=kw["dt"][0], A=kw["A"], B=kw["B"][0], C=kw["C"][0], D=kw["D"], z=kw["z"][0],
                dt_bias=kw["dt_bias"], ssm_state=torch.randn(NSLOTS, nheads, headdim, dstate).bfloat16(),
                out=torch.zeros_like(kw["x"][0]))


def _mamba1(ntokens, token_axis):
    kw = mamba1_inputs(1, ntokens, ngroups=2)
    t = (lambda v: v[0]) if token_axis == 1 else (lambda v: v[0].movedim(-1, 0))
    dim, dstate = kw["A"].shape
    return dict(u=t(kw["u"]), delta=t(kw["delta"]), A=kw["A"], B=t(kw["B"]), C=t(kw["C"]), D=kw["D"], z=t(kw["z"]),
                delta_bias=kw["delta_bias"], ssm_state=torch.randn(NSLOTS, dim, dstate),
                out=torch.zeros_like(t(kw["u"])))


def _conv(ntokens, token_axis):
    x = torch.randn(8, ntokens) if token_axis == 1 else torch.randn(ntokens, 8)
    return dict(x=x, weight=torch.randn(8, 4), bias=torch.randn(8),
                conv_state=torch.randn(NSLOTS, 3, 8).transpose(1, 2), out=torch.zeros_like(x))


def _mamba2_prefill_fused(b, x, dt, A, B, C, **kw):
    """The chunked prefill on the fused pass (its step's workspace is the fused pass's)."""
    with fused_pass():
        cache_ops.mamba2_prefill(b, x, dt, A, B, C, dt_softplus=True, algorithm="chunked", chunk_size=CHUNK, **kw)


NTOKENS = sum(LENGTHS)
OPS = {  # name: (the op with its options, its batch, a layer's tensors)
    "mamba2_prefill recurrent": (lambda b, x, dt, A, B, C, **kw: cache_ops.mamba2_prefill(
        b, x, dt, A, B, C, dt_softplus=True, algorithm="recurrent", **kw), _prefill_batch, lambda: _mamba2(NTOKENS)),
    "mamba2_prefill chunked": (lambda b, x, dt, A, B, C, **kw: cache_ops.mamba2_prefill(
        b, x, dt, A, B, C, dt_softplus=True, algorithm="chunked", chunk_size=CHUNK, **kw), _prefill_batch,
        lambda: _mamba2(NTOKENS)),
    "mamba2_prefill chunked, tables built by the first layer": (
        lambda b, x, dt, A, B, C, **kw: cache_ops.mamba2_prefill(b, x, dt, A, B, C, dt_softplus=True,
                                                                 algorithm="chunked", chunk_size=CHUNK, **kw),
        lambda: _prefill_batch(chunk_size=None), lambda: _mamba2(NTOKENS)),
    "mamba2_prefill chunked, fused": (_mamba2_prefill_fused, _prefill_batch, lambda: _mamba2(NTOKENS)),
    "mamba1_prefill recurrent": (lambda b, u, delta, A, B, C, **kw: cache_ops.mamba1_prefill(
        b, u, delta, A, B, C, delta_softplus=True, algorithm="recurrent", **kw), _prefill_batch,
        lambda: _mamba1(NTOKENS, 1)),
    "mamba1_prefill chunked": (lambda b, u, delta, A, B, C, **kw: cache_ops.mamba1_prefill(
        b, u, delta, A, B, C, delta_softplus=True, algorithm="chunked", chunk_size=CHUNK, **kw), _prefill_batch,
        lambda: _mamba1(NTOKENS, 1)),
    "conv_prefill": (lambda b, x, weight, bias, **kw: cache_ops.conv_prefill(b, x, weight, bias, activation="silu",
                                                                            **kw), _prefill_batch,
                     lambda: _conv(NTOKENS, 1)),
    "mamba2_decode": (lambda b, x, dt, A, B, C, **kw: cache_ops.mamba2_decode(b, x, dt, A, B, C, dt_softplus=True,
                                                                             **kw), _decode_batch,
                      lambda: _mamba2(len(SLOTS))),
    "mamba1_decode": (lambda b, u, delta, A, B, C, **kw: cache_ops.mamba1_decode(
        b, u, delta, A, B, C, delta_softplus=True, **kw), _decode_batch, lambda: _mamba1(len(SLOTS), 0)),
    "conv_decode": (lambda b, x, weight, bias, **kw: cache_ops.conv_decode(b, x, weight, bias, activation="silu",
                                                                          **kw), _decode_batch,
                    lambda: _conv(len(SLOTS), 0)),
}


@pytest.fixture
def on_the_device():
    """Triton runs on CUDA tensors where there is a GPU, through the interpreter elsewhere."""
    torch.set_default_device("cuda" if torch.cuda.is_available() else "cpu")
    yield torch.get_default_device()
    torch.set_default_device(None)  # no default-device mode left behind


@pytest.mark.parametrize("name", OPS)
def test_a_replayed_layer_gives_the_bits_of_a_fresh_step(name, on_the_device):
    op, make_batch, make_layer = OPS[name]
    layers = [{k: v.to(on_the_device) for k, v in make_layer().items()} for _ in range(3)]
    want = {k: v.clone() for k, v in layers[2].items()}
    op(make_batch(), **want, backend="triton")
    batch = make_batch()
    for i, layer in enumerate(layers):
        op(batch, **layer, backend="triton", validate=i == 0)
    (entry,) = batch.launches.values()
    assert entry.agreed and entry.recordings == 2, "the third layer replayed"
    for k, v in want.items():
        assert torch.equal(layers[2][k], v), k


def test_the_pytorch_backend_records_nothing():
    op, make_batch, make_layer = OPS["conv_prefill"]
    batch = make_batch()
    for _ in range(3):
        op(batch, **make_layer(), backend="torch")
    assert batch.launches == {}


def test_a_replayed_op_still_checks_its_arguments(on_the_device):
    """validate=True checks a layer's arguments before a replay: an `out` over x is refused."""
    op, make_batch, make_layer = OPS["conv_prefill"]
    batch = make_batch()
    for _ in range(3):
        op(batch, **{k: v.to(on_the_device) for k, v in make_layer().items()}, backend="triton", validate=False)
    (entry,) = batch.launches.values()
    assert entry.agreed
    layer = {k: v.to(on_the_device) for k, v in make_layer().items()}
    layer["out"] = layer["x"]
    with pytest.raises(ValueError, match="out"):
        op(batch, **layer, backend="triton")


def test_a_layer_on_the_other_chunked_pass_is_not_replayed_from_the_five_stages(on_the_device):
    """The fused pass's setting is part of what decides an engine op's launches: a step's layer
    under fused_pass() after layers on the five stages runs its own (and its bits)."""
    five, _, make_layer = OPS["mamba2_prefill chunked"]
    fused = OPS["mamba2_prefill chunked, fused"][0]
    layers = [{k: v.to(on_the_device) for k, v in make_layer().items()} for _ in range(4)]
    want = {k: v.clone() for k, v in layers[3].items()}
    fused(_prefill_batch(), **want, backend="triton")
    batch = _prefill_batch()
    for layer in layers[:3]:
        five(batch, **layer, backend="triton")
    fused(batch, **layers[3], backend="triton")
    assert len(batch.launches) == 2, "the fused layer took the five stages' launches"
    for k, v in want.items():
        assert torch.equal(layers[3][k], v), k
