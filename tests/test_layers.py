"""Mamba mixer layers: transformers' weights load unchanged and give its outputs; the row ops are
batch-invariant; with exact=True snapshots restore bit for bit and the decode step equals a
one-token pass; mismatched states are rejected."""
import pytest
import torch
import torch.nn.functional as F

from helpers import assert_rel_close, reads_back
from ssm_kernels.layers import GatedRMSNorm, LayerState, Mamba1Mixer, Mamba2Mixer, exact_linear, exact_rowwise
from ssm_kernels.layers.rows import tile_rows

HIDDEN = 32


def mamba2(**kw):
    return Mamba2Mixer(HIDDEN, num_heads=4, head_dim=8, state_size=16, n_groups=2, **kw)


def mamba1(**kw):
    return Mamba1Mixer(HIDDEN, intermediate_size=24, state_size=8, **kw)


MIXERS = {"mamba2": mamba2, "mamba1": mamba1}


def randomised(layer):
    """Perturb every parameter so that no term of the math hides behind a default init."""
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return layer.eval()


# -------------------------------------------------------------------------------------------
# transformers compatibility
# -------------------------------------------------------------------------------------------
def hf_pair(kind):
    transformers = pytest.importorskip("transformers")
    if kind == "mamba2":
        from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMixer
        config = transformers.Mamba2Config(hidden_size=HIDDEN, num_heads=4, head_dim=16, expand=2, state_size=16,
                                           n_groups=2, conv_kernel=4, chunk_size=8, num_hidden_layers=1,
                                           use_bias=True)
        ours = Mamba2Mixer.from_config(config, backend="torch")
    else:
        from transformers.models.mamba.modeling_mamba import MambaMixer as HFMixer
        config = transformers.MambaConfig(hidden_size=HIDDEN, intermediate_size=48, state_size=8, conv_kernel=4,
                                          num_hidden_layers=1)
        ours = Mamba1Mixer.from_config(config, backend="torch")
    return randomised(HFMixer(config, layer_idx=0)), ours


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("kind", ["mamba2", "mamba1"])
def test_loads_transformers_weights_and_matches_its_torch_forward(kind):
    hf, ours = hf_pair(kind)
    hf_sd = hf.state_dict()
    assert set(ours.state_dict()) == set(hf_sd)
    ours.load_state_dict(hf_sd, strict=True)
    hidden = torch.randn(2, 19, HIDDEN)
    with torch.no_grad():
        want = hf(hidden)
        got = ours(hidden)
    assert_rel_close(got.out, want, 1e-5, "out")
    assert got.state.positions == (19, 19)


# -------------------------------------------------------------------------------------------
# Batch-invariant row ops: a row's result whatever rows come with it
# -------------------------------------------------------------------------------------------
def _row_ops(dtype, device):
    """(name, input widths, function) of the ops the layers and the served model run as rows."""
    torch.manual_seed(1)
    ops = []
    # projections, odd and wide ones too; inner widths not a multiple of 4 (6, 13) rounded a row by
    # its place in a float32 GEMM tile before exact_linear padded them
    for k, n in ((32, 292), (64, 5), (24, 100), (256, 600), (6, 8), (13, 40)):
        linear = torch.nn.Linear(k, n, bias=n % 2 == 0, dtype=dtype, device=device)
        ops.append((f"linear {k}->{n}", (k,), lambda x, f=linear: exact_linear(f, x)))
    for width, group in ((128, 64), (600, 600), (70, 35)):
        norm = GatedRMSNorm(width, group, dtype=dtype, device=device)
        with torch.no_grad():
            norm.weight.add_(torch.randn(width, dtype=dtype, device=device))
        ops.append((f"gated norm {width}/{group}", (width, width), lambda y, g, f=norm: exact_rowwise(f, y, g)))
    ops.append(("silu * up 1000", (1000, 1000), lambda g, u: exact_rowwise(lambda a, b: F.silu(a) * b, g, u)))
    return ops


@torch.no_grad()
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_ops_are_bitwise_the_same_whatever_rows_come_with_a_row(dtype, threads, device):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, widths, op in _row_ops(dtype, device):
            row = [(torch.randn(1, w) * 3).to(device, dtype) for w in widths]
            alone = op(*row)
            for count in (1, 7, 64, 65, 130):
                others = [(torch.randn(count, w) * 3).to(device, dtype) for w in widths]
                for at in sorted({0, 1, count // 2, count - 2, count - 1} & set(range(count))):
                    batch = [o.clone() for o in others]
                    for b, r in zip(batch, row):
                        b[at] = r[0]
                    assert torch.equal(op(*batch)[at:at + 1], alone), (name, dtype, threads, count, at)
    finally:
        torch.set_num_threads(before)


def test_elementwise_tiles_are_whole_vector_steps_on_one_thread():
    assert tile_rows(32) == 64 and tile_rows(100) == 64 and tile_rows(512) == 64
    assert tile_rows(1000) == 32 and tile_rows(4096) == 8 and tile_rows(8192) == 4
    assert tile_rows(1001) == 1 and tile_rows(50000) == 1  # odd wide rows: one row per tile
    for width in range(1, 3000, 7):
        rows = tile_rows(width)
        assert rows == 1 or (rows * width % 64 == 0 and rows * width <= 32768)


def test_exact_row_ops_keep_leading_shapes_and_empty_inputs():
    for k in (8, 6):  # 6: padded to INNER_STEP
        linear = torch.nn.Linear(k, 3)
        x = torch.randn(2, 5, k)
        assert exact_linear(linear, x).shape == (2, 5, 3)
        assert exact_linear(linear, x[:, :0]).shape == (2, 0, 3)
        assert_rel_close(exact_linear(linear, x), linear(x).detach().double(), 1e-6,
                         "tiled == plain to rounding")
    with pytest.raises(TypeError, match="linear must be an nn.Linear"):
        exact_linear(lambda r: r, x)


# -------------------------------------------------------------------------------------------
# Exactness: snapshots, splits, neighbours, decode
# -------------------------------------------------------------------------------------------
SEQLEN = 11


@pytest.fixture(params=sorted(MIXERS))
def layer(request):
    return randomised(MIXERS[request.param](backend="torch", exact=True))


def test_exact_is_off_by_default_and_a_bool():
    assert mamba2().exact is False and mamba1().exact is False
    with pytest.raises(TypeError, match=r"exact must be a bool \(True or False\), got 'yes'"):
        mamba2(exact="yes")


@torch.no_grad()
@pytest.mark.parametrize("k", [0, 1, 2, SEQLEN - 1, SEQLEN])
def test_restoring_a_snapshot_continues_bitwise(layer, k):
    hidden = torch.randn(1, SEQLEN, HIDDEN)
    whole = layer(hidden, capture=[(0, k)])
    (snap,) = whole.snapshots
    assert snap.position == k
    tail = layer(hidden[:, k:], state=layer.restore(snap))
    assert torch.equal(tail.out, whole.out[:, k:])
    assert torch.equal(tail.state.conv, whole.state.conv) and torch.equal(tail.state.ssm, whole.state.ssm)
    head = layer(hidden[:, :k])
    assert torch.equal(head.out, whole.out[:, :k])
    assert torch.equal(head.state.conv[0], snap.conv) and torch.equal(head.state.ssm[0], snap.ssm)


@torch.no_grad()
def test_positions_are_absolute(layer):
    hidden = torch.randn(1, 9, HIDDEN)
    first = layer(hidden[:, :4])
    assert first.state.position == 4
    second = layer(hidden[:, 4:], state=first.state, capture=[(0, 5), (0, 0), (0, 2)])
    assert [s.position for s in second.snapshots] == [9, 4, 6]
    assert second.state.position == 9
    assert torch.equal(second.snapshots[0].ssm, second.state.ssm[0])
    assert torch.equal(second.snapshots[1].conv, first.state.conv[0])


@torch.no_grad()
@pytest.mark.parametrize("captures", [[(0, 3)], [(0, 2), (0, 5), (0, 9)]])
def test_a_snapshot_owns_its_tensors(layer, captures):
    # A cache holds snapshots one by one and counts their nbytes: none may keep the pass's other
    # captures alive through a view of their buffer.
    out = layer(torch.randn(1, 9, HIDDEN), capture=captures)
    for snap in out.snapshots:
        for part in (snap.conv, snap.ssm):
            assert part.untyped_storage().nbytes() == part.numel() * part.element_size()
        assert snap.nbytes == sum(p.untyped_storage().nbytes() for p in (snap.conv, snap.ssm))


@torch.no_grad()
def test_varlen_neighbours_and_dense_batch_change_nothing(layer):
    hidden = torch.randn(1, SEQLEN, HIDDEN)
    alone = layer(hidden, capture=[(0, 4)])
    other = torch.randn(1, 5, HIDDEN)
    packed = layer(torch.cat([other, hidden, other[:, :1]], dim=1), cu_seqlens=torch.tensor([0, 5, 5, 16, 17]),
                   capture=[(2, 4), (0, 1)])
    assert torch.equal(packed.out[:, 5:16], alone.out)
    assert (torch.equal(packed.state.ssm[2], alone.state.ssm[0])
            and torch.equal(packed.state.conv[2], alone.state.conv[0]))
    assert torch.equal(packed.snapshots[0].ssm, alone.snapshots[0].ssm)
    assert packed.state.positions == (5, 0, SEQLEN, 1)
    dense = layer(torch.cat([torch.randn_like(hidden), hidden]))
    assert torch.equal(dense.out[1], alone.out[0])


@torch.no_grad()
def test_varlen_layer_reads_cu_seqlens_once(layer):
    """A packed pass reads a cu_seqlens tensor back once (a sync on a GPU), not once per kernel
    call: its conv and scan take the bounds from the host; host ints are read nowhere."""
    hidden = torch.randn(1, 12, HIDDEN)
    cu = torch.tensor([0, 5, 5, 12])
    with reads_back(cu) as reads:
        packed = layer(hidden, cu_seqlens=cu, capture=[(2, 3)])
    assert len(reads) == 1
    hosted = layer(hidden, cu_seqlens=[0, 5, 5, 12], capture=[(2, 3)])
    assert torch.equal(hosted.out, packed.out) and torch.equal(hosted.state.ssm, packed.state.ssm)


@torch.no_grad()
def test_decode_step_equals_one_token_pass_and_continues_a_prefill(layer):
    hidden = torch.randn(2, 6, HIDDEN)
    whole = layer(hidden)
    state = layer(hidden[:, :5]).state
    out = layer.step(hidden[:, 5], state)
    assert torch.equal(out, whole.out[:, 5])
    assert torch.equal(state.conv, whole.state.conv) and torch.equal(state.ssm, whole.state.ssm)
    assert state.positions == (6, 6)


@torch.no_grad()
def test_decode_step_checks_its_inputs_once(layer, monkeypatch):
    """step() checks the state and hidden states itself; the conv and scan ops it calls on the
    layer's own projections do not check them again (host time on every decode step)."""
    import ssm_kernels.conv.conv1d as conv1d
    import ssm_kernels.scan.mamba1 as mamba1_ops
    import ssm_kernels.scan.mamba2 as mamba2_ops

    hidden = torch.randn(2, 6, HIDDEN)
    state = layer(hidden[:, :5]).state
    expected = layer.step(hidden[:, 5], LayerState(state.conv.clone(), state.ssm.clone(), state.positions))

    def refuse(*args, **kwargs):
        raise AssertionError("an op validated its arguments inside step()")
    monkeypatch.setattr(conv1d, "_check_params", refuse)
    monkeypatch.setattr(mamba2_ops, "check_mamba2_args", refuse)
    monkeypatch.setattr(mamba1_ops, "check_tensor_args", refuse)  # mamba1_scan's first check
    assert torch.equal(layer.step(hidden[:, 5], state), expected)
    with pytest.raises(ValueError, match="state.ssm"):  # the layer's own checks still run
        layer.step(hidden[:, 5], LayerState(state.conv, state.ssm[:, :1], state.positions))


@torch.no_grad()
def test_bfloat16_split_is_bitwise():
    layer = randomised(mamba2(backend="torch", exact=True, dtype=torch.bfloat16))
    hidden = torch.randn(1, 9, HIDDEN, dtype=torch.bfloat16)
    whole = layer(hidden, capture=[(0, 5)])
    assert whole.snapshots[0].conv.dtype == torch.bfloat16 and whole.snapshots[0].ssm.dtype == torch.float32
    tail = layer(hidden[:, 5:], state=layer.restore(whole.snapshots))
    assert torch.equal(tail.out, whole.out[:, 5:])


@torch.no_grad()
def test_triton_backend_runs_the_layer_bitwise(device):
    """Both kernels through Triton (the interpreter on CPU): a restored snapshot continues exactly
    and the result is close to the PyTorch path."""
    layer = randomised(mamba2(backend="triton", exact=True)).to(device)
    hidden = torch.randn(1, 7, HIDDEN, device=device)
    whole = layer(hidden, capture=[(0, 3)])
    tail = layer(hidden[:, 3:], state=layer.restore(whole.snapshots[0]))
    assert torch.equal(tail.out, whole.out[:, 3:]) and torch.equal(tail.state.ssm, whole.state.ssm)
    layer.backend = "torch"
    assert_rel_close(whole.out, layer(hidden).out.double(), 1e-5, "triton vs torch")


@torch.no_grad()
@pytest.mark.parametrize("kind", sorted(MIXERS))
def test_triton_decode_step_equals_one_token_pass(kind, device):
    """The decode step on Triton (the interpreter on CPU), its state updated in place, gives a
    one-token pass's output and states bit for bit."""
    layer = randomised(MIXERS[kind](backend="triton", exact=True)).to(device)
    hidden = torch.randn(2, 4, HIDDEN, device=device)
    whole = layer(hidden)
    state = layer(hidden[:, :3]).state
    out = layer.step(hidden[:, 3], state)
    assert torch.equal(out, whole.out[:, 3])
    assert torch.equal(state.conv, whole.state.conv) and torch.equal(state.ssm, whole.state.ssm)


@torch.no_grad()
def test_batched_projections_are_close_to_the_exact_path(layer):
    hidden = torch.randn(2, 9, HIDDEN)
    exact = layer(hidden).out
    layer.exact = False
    assert_rel_close(layer(hidden).out, exact.double(), 1e-5, "exact=False")


@torch.no_grad()
def test_chunked_algorithm_is_close_and_captures_the_same_states():
    layer = randomised(mamba2(backend="torch"))
    hidden = torch.randn(1, 40, HIDDEN)
    exact = layer(hidden, capture=[(0, 17)])
    layer.algorithm, layer.chunk_size = "chunked", 16
    fast = layer(hidden, capture=[(0, 17)])
    assert_rel_close(fast.out, exact.out.double(), 1e-5, "chunked out")
    assert_rel_close(fast.snapshots[0].ssm, exact.snapshots[0].ssm.double(), 1e-5, "chunked capture")
    assert torch.equal(fast.snapshots[0].conv, exact.snapshots[0].conv)


# -------------------------------------------------------------------------------------------
# Mismatched states and snapshots
# -------------------------------------------------------------------------------------------
def test_snapshot_of_another_shape_is_rejected():
    small, other = mamba2(), Mamba2Mixer(HIDDEN, num_heads=8, head_dim=4, state_size=16, n_groups=2)
    with torch.no_grad():
        snap = other(torch.randn(1, 3, HIDDEN), capture=[(0, 2)]).snapshots[0]
    with pytest.raises(ValueError, match=r"ssm state of shape \(8, 4, 16\), but Mamba2Mixer .* needs \(4, 8, 16\)"):
        small.restore(snap)
    with torch.no_grad():
        m1_snap = mamba1()(torch.randn(1, 3, HIDDEN), capture=[(0, 1)]).snapshots[0]
    with pytest.raises(ValueError, match="taken from a layer of another shape"):
        small.restore(m1_snap)
    with pytest.raises(TypeError, match="must be a Snapshot"):
        small.restore([object()])


def test_step_refuses_overlapping_or_grad_states_before_writing():
    for layer in (mamba2(), mamba1()):
        state = layer.initial_state(2)
        hidden = torch.randn(2, HIDDEN)
        for bad, message in ((LayerState(state.conv[:1].expand_as(state.conv), state.ssm, state.positions),
                              "state.conv has overlapping memory"),
                             (LayerState(state.conv, state.ssm[:1].expand_as(state.ssm), state.positions),
                              "state.ssm has overlapping memory"),
                             (LayerState(state.conv, state.ssm.clone().requires_grad_(), state.positions),
                              "state.ssm requires grad")):
            conv_before = bad.conv.detach().clone()
            with pytest.raises(ValueError, match=message):
                layer.step(hidden, bad)
            assert torch.equal(bad.conv, conv_before) and bad.positions == (0, 0)


@pytest.mark.parametrize("bad, error, message", [
    (lambda s: LayerState(s.conv[:, :-1], s.ssm, s.positions), ValueError, r"state.conv must have shape"),
    (lambda s: LayerState(s.conv, s.ssm.double(), s.positions), TypeError, "state.ssm must have dtype float32"),
    (lambda s: LayerState(s.conv.bfloat16(), s.ssm, s.positions), TypeError, "state.conv must have the hidden"),
    (lambda s: LayerState(s.conv, s.ssm, (0, 0)), ValueError, "state.positions must hold 1 positions"),
    (lambda s: LayerState(s.conv, s.ssm, (-4,)), ValueError, r"state.positions\[0\] must be >= 0, got -4"),
    (lambda s: LayerState(s.conv, s.ssm, (1.5,)), TypeError, r"state.positions\[0\] must be an int"),
    (lambda s: (s.conv, s.ssm), TypeError, "state must be a LayerState"),
])
def test_bad_state_is_rejected(bad, error, message):
    layer = mamba2()
    with pytest.raises(error, match=message):
        layer(torch.randn(1, 3, HIDDEN), state=bad(layer.initial_state()))


def test_bad_hidden_states_and_captures_are_rejected():
    layer = mamba2()
    with pytest.raises(ValueError, match=r"hidden_states must have shape .*hidden_size is 31, expected 32"):
        layer(torch.randn(1, 3, HIDDEN - 1))
    with pytest.raises(ValueError, match="capture offset 4 for sequence 0 is past its length 3"):
        layer(torch.randn(1, 3, HIDDEN), capture=[(0, 4)])
    with pytest.raises(ValueError, match="position is defined for a single-sequence state"):
        layer.initial_state(2).position
    with pytest.raises(ValueError, match=r"hidden_act must be one of \('silu', 'swish'\), got 'gelu'"):
        mamba2(hidden_act="gelu")
    assert mamba2(hidden_act="swish") is not None  # swish is silu
    for other in (mamba2(), mamba1()):
        with pytest.raises(TypeError,
                           match="hidden_states must have the layer's dtype torch.float32, got torch.bfloat16"):
            other(torch.randn(1, 3, HIDDEN, dtype=torch.bfloat16))
        with pytest.raises(TypeError, match="hidden_states must have the layer's dtype"):
            other.step(torch.randn(1, HIDDEN, dtype=torch.bfloat16), other.initial_state())
        with pytest.raises(ValueError, match=r"snapshots\[0\].position must be >= 0, got -3"):
            snap = other.initial_state().snapshot(0)
            other.restore(type(snap)(-3, snap.conv, snap.ssm))


@pytest.mark.parametrize("kind, changes, error, message", [
    ("mamba2", dict(head_dim=-1), ValueError, "head_dim must be >= 1, got -1"),
    ("mamba2", dict(hidden_size=2.5), TypeError, "hidden_size must be an int, got float"),
    ("mamba2", dict(num_heads=True), TypeError, "num_heads must be an int, got True"),
    ("mamba2", dict(dtype=torch.int64), TypeError, r"dtype must be float32, float16, bfloat16 or None .* torch.int64"),
    ("mamba2", dict(dtype=torch.float64), TypeError, "dtype must be float32, float16, bfloat16 or None"),
    ("mamba2", dict(n_groups=3), ValueError, r"num_heads \(4\) must be a multiple of n_groups \(3\)"),
    ("mamba2", dict(state_size=300), ValueError, "state_size 300 is beyond the kernels' limit of 256"),
    ("mamba2", dict(use_bias="no"), TypeError, r"use_bias must be a bool \(True or False\), got 'no'"),
    ("mamba2", dict(use_conv_bias=0), TypeError, "use_conv_bias must be a bool"),
    ("mamba2", dict(layer_norm_epsilon=-1e-5), ValueError, "layer_norm_epsilon must be > 0"),
    ("mamba2", dict(time_step_min=0.5, time_step_max=0.1), ValueError,
     "time_step_min .* must not exceed time_step_max"),
    ("mamba2", dict(time_step_floor="1e-4"), TypeError, "time_step_floor must be a finite real number"),
    ("mamba2", dict(time_step_limit=(1.0, 0.0)), ValueError, "dt_limit must satisfy min <= max"),
    ("mamba2", dict(backend="cuda"), ValueError, "backend must be one of"),
    ("mamba2", dict(algorithm="fast"), ValueError, "algorithm must be one of"),
    ("mamba2", dict(chunk_size=17), ValueError, "chunk_size must be a power of two"),
    ("mamba1", dict(intermediate_size=0), ValueError, "intermediate_size must be >= 1, got 0"),
    ("mamba1", dict(conv_kernel=0), ValueError, "conv_kernel must be >= 1, got 0"),
    ("mamba1", dict(time_step_rank=2.5), TypeError, "time_step_rank must be an int, got float"),
    ("mamba1", dict(state_size=-8), ValueError, "state_size must be >= 1"),
    ("mamba1", dict(dtype=torch.int32), TypeError, "dtype must be float32, float16, bfloat16 or None"),
    ("mamba1", dict(use_bias="no"), TypeError, "use_bias must be a bool"),
    ("mamba1", dict(backend=None), ValueError, "backend must be one of"),
])
def test_constructor_arguments_are_checked(kind, changes, error, message):
    """Before any parameter is built: torch's own errors name no argument, and some bad values
    (a conv kernel of 0, a truncated time_step_rank) built a layer that failed later or silently."""
    base = dict(hidden_size=HIDDEN, num_heads=4, head_dim=8, state_size=16, n_groups=2) if kind == "mamba2" else \
        dict(hidden_size=HIDDEN, intermediate_size=24, state_size=8)
    with pytest.raises(error, match=message):
        (Mamba2Mixer if kind == "mamba2" else Mamba1Mixer)(**{**base, **changes})


def test_initial_state_sizes_are_checked():
    layer = mamba2()
    with pytest.raises(TypeError, match="nseq must be an int, got True"):
        layer.initial_state(True)
    with pytest.raises(ValueError, match=r"the conv states of shape \(1099511627776, 96, 3\) .* would need"):
        layer.initial_state(2 ** 40)


def test_step_refuses_states_that_share_memory():
    """state.conv and state.ssm cut from one buffer over each other: the step's conv update would
    change the SSM state it then reads."""
    for layer in (mamba2(), mamba1()):
        state = layer.initial_state(1)
        buf = torch.zeros(state.conv.numel() + state.ssm.numel())
        shared = LayerState(buf[:state.conv.numel()].view(state.conv.shape),
                            buf[:state.ssm.numel()].view(state.ssm.shape), state.positions)
        with pytest.raises(ValueError, match="state.conv must not overlap state.ssm in memory"):
            layer.step(torch.randn(1, HIDDEN), shared)
        assert not buf.any() and shared.positions == (0,)


def test_snapshot_parts_and_indices_are_type_checked():
    layer = mamba2()
    state = layer.initial_state(2)
    with pytest.raises(TypeError, match="index must be an int, got True"):
        state.snapshot(True)
    snap = state.snapshot(1)
    with pytest.raises(TypeError, match=r"snapshots\[0\].conv must be a torch.Tensor, got list"):
        layer.restore(type(snap)(snap.position, snap.conv.tolist(), snap.ssm))
    with pytest.raises(TypeError, match=r"snapshots\[1\] has a conv state of dtype torch.bfloat16; .* runs in "
                                        "torch.float32"):
        layer.restore([snap, type(snap)(snap.position, snap.conv.bfloat16(), snap.ssm)])


@pytest.mark.parametrize("layer", list(MIXERS))
def test_grad_mode_is_refused_before_anything_is_written(layer):
    """The kernels have no backward: a pass or a step in grad mode, with the layer's parameters
    requiring grad (any fresh module's), is refused; under no_grad both run."""
    mixer = MIXERS[layer]()
    state = mixer.initial_state(2)
    before = state.clone()
    message = "is forward only .* call it under torch.no_grad"
    with pytest.raises(ValueError, match=message):
        mixer(torch.randn(2, 3, HIDDEN), state=state)
    with pytest.raises(ValueError, match=message):
        mixer.step(torch.randn(2, HIDDEN), state)
    assert torch.equal(state.conv, before.conv) and torch.equal(state.ssm, before.ssm) and state.positions == (0, 0)
    with torch.no_grad():
        mixer.step(torch.randn(2, HIDDEN), state)
    assert state.positions == (1, 1)


def test_layer_checks_at_their_edges():
    """state_size up to the kernels' limit, time_step_min equal to time_step_max, epsilon > 0 (0
    refused); dt_bias_init's softplus within [dt_min, dt_max]; a snapshot of sequence 0 by
    default; restore refuses no snapshot and a float64 SSM state; step refuses a missing state."""
    from ssm_kernels.layers.common import dt_bias_init
    from ssm_kernels.scan import MAX_DSTATE
    Mamba2Mixer(16, num_heads=2, head_dim=8, state_size=MAX_DSTATE, time_step_min=0.01, time_step_max=0.01)
    with pytest.raises(ValueError, match="beyond the kernels' limit"):
        Mamba2Mixer(16, num_heads=2, head_dim=8, state_size=MAX_DSTATE + 1)
    with pytest.raises(ValueError, match="layer_norm_epsilon must be > 0"):
        Mamba2Mixer(16, num_heads=2, head_dim=8, state_size=8, layer_norm_epsilon=0.0)
    dt = F.softplus(dt_bias_init(10000, dt_min=1e-3, dt_max=0.1, generator=torch.Generator().manual_seed(0)))
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
    mixer = Mamba2Mixer(16, num_heads=2, head_dim=8, state_size=8)
    state = mixer.initial_state(2)
    state.positions = (3, 7)
    assert state.snapshot().position == 3
    with pytest.raises(ValueError, match="restore needs at least one snapshot"):
        mixer.restore([])
    snap = state.snapshot()
    with pytest.raises(TypeError, match="SSM state of dtype torch.float64; it must be float32"):
        mixer.restore(type(snap)(snap.position, snap.conv, snap.ssm.double()))
    with pytest.raises(TypeError, match="step needs a LayerState"):
        mixer.step(torch.randn(1, 16), None)
