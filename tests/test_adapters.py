"""transformers models on the library's kernels (ssm_kernels.adapters): logits against
transformers' own PyTorch path, in-pass captures, restores, and rejected input.

Tiny random-weight configs (no download). On CPU the adapter's "auto" backend is the PyTorch
path; on CUDA it is Triton (TF32 off so that transformers' reference stays float32-exact).
"""
import inspect

import pytest
import torch

from helpers import assert_rel_close

transformers = pytest.importorskip("transformers")
DynamicCache = transformers.DynamicCache

from ssm_kernels.adapters import (LayerSnapshot, capture_states, remove_ssm_kernels,  # noqa: E402
                                  restore_states, use_ssm_kernels)
from ssm_kernels.adapters import hf_cache  # noqa: E402
from ssm_kernels.layers import Snapshot  # noqa: E402

TOL = 1e-5
V = 100  # vocab
PROMPT, SPLIT, DECODE = 24, 10, 3  # prompt length, first chunk of the chunked prefill, decode steps
CAPTURE = (6, 13)  # positions captured in-pass: one in each chunk of the chunked prefill


def _mamba2_cfg(T):
    return T.Mamba2Config(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8, expand=2,
                          state_size=16, n_groups=2, conv_kernel=4, chunk_size=8, use_bias=True,
                          time_step_limit=(0.0, 0.5))


def _falcon_h1_cfg(T, rms_norm):
    return T.FalconH1Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=8,
                            mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_d_ssm=64,
                            mamba_chunk_size=8, mamba_rms_norm=rms_norm, max_position_embeddings=128,
                            ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.9], ssm_in_multiplier=1.3)


# family -> (transformers model class name, config maker, kind)
FAMILIES = {
    "Mamba2": ("Mamba2ForCausalLM", _mamba2_cfg, "mamba2"),
    "Bamba": ("BambaForCausalLM", lambda T: T.BambaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, max_position_embeddings=128), "mamba2"),
    "NemotronH": ("NemotronHForCausalLM", lambda T: T.NemotronHConfig(
        vocab_size=V, hidden_size=32, layers_block_type=["mamba", "attention", "mamba", "mlp"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=64, mamba_num_heads=8, mamba_head_dim=8,
        ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8, max_position_embeddings=128), "mamba2"),
    "FalconH1": ("FalconH1ForCausalLM", lambda T: _falcon_h1_cfg(T, False), "mamba2"),
    "FalconH1-gated-norm": ("FalconH1ForCausalLM", lambda T: _falcon_h1_cfg(T, True), "mamba2"),
    "Zamba2": ("Zamba2ForCausalLM", lambda T: T.Zamba2Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "mamba"],
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2, n_mamba_heads=8, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=64, num_mem_blocks=1, chunk_size=8, max_position_embeddings=128,
        adapter_rank=4), "mamba2"),
    "GraniteMoeHybrid": ("GraniteMoeHybridForCausalLM", lambda T: T.GraniteMoeHybridConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"], num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=2, num_experts_per_tok=1, shared_intermediate_size=64, mamba_n_heads=8, mamba_d_head=8,
        mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
        max_position_embeddings=128), "mamba2"),
    "Mamba": ("MambaForCausalLM", lambda T: T.MambaConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4,
        time_step_rank=8), "mamba1"),
    "FalconMamba": ("FalconMambaForCausalLM", lambda T: T.FalconMambaConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4,
        time_step_rank=8), "mamba1"),
    "Jamba": ("JambaForCausalLM", lambda T: T.JambaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, num_experts=2, num_experts_per_tok=1, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=2, mamba_dt_rank=8, max_position_embeddings=128), "mamba1"),
}


@pytest.fixture(autouse=True)
def exact_float32():
    """transformers' reference runs cuDNN convs and matmuls on CUDA: keep them out of TF32."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    with torch.no_grad():
        yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def build(family, device):
    cls_name, make_config, kind = FAMILIES[family]
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    torch.manual_seed(0)
    config = make_config(transformers)
    config._attn_implementation = "eager"
    return cls(config).to(device).eval(), kind


def run(model, ids, cache, start, **extra):
    """One forward pass of tokens [start, start + len) through the cache; returns the logits."""
    params = inspect.signature(model.forward).parameters
    kwargs = dict(use_cache=True, **extra)
    kwargs[next(k for k in ("cache", "past_key_values", "cache_params") if k in params)] = cache
    if "position_ids" in params:
        kwargs["position_ids"] = torch.arange(start, start + ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
    return model(input_ids=ids, **kwargs).logits


def session(model, ids, chunks, decode, cache=None, start=0):
    """Prefill ids in the given chunks, then decode the tokens of `decode` one by one."""
    cache = DynamicCache(config=model.config) if cache is None else cache
    outs, pos = [], start
    for n in chunks:
        outs.append(run(model, ids[:, pos:pos + n], cache, pos))
        pos += n
    for i in range(decode.shape[1]):
        outs.append(run(model, decode[:, i:i + 1], cache, pos))
        pos += 1
    return torch.cat(outs, 1), cache


def assert_token_counts(cache, layers, n):
    """Each SSM layer of the cache counts n tokens, where the release keeps a count (transformers
    5.25 on: what get_seq_length returns and generate feeds the prompt past; none before)."""
    if not hasattr(hf_cache.linear_layer(cache, layers[0]), "cumulative_length_linear"):
        return
    counts = {i: int(hf_cache.linear_layer(cache, i).cumulative_length_linear) for i in layers}
    assert counts == dict.fromkeys(layers, n), f"token counts {counts}, expected {n}"


def inputs(device, batch=2):
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, V, (batch, PROMPT), generator=g).to(device),
            torch.randint(0, V, (batch, DECODE), generator=g).to(device))


def ssm_layer_ids(model):
    return sorted(m.layer_idx for m in model.modules() if "_ssm_kernels_pass" in m.__dict__)


def cache_states(cache, layers):
    """Copies of every state the cache holds for the given SSM layers, plus attention lengths."""
    out = {}
    for i in layers:
        layer = hf_cache.linear_layer(cache, i)
        out[i] = (hf_cache.has_previous(layer),
                  None if layer.conv_states[0] is None else layer.conv_states[0].clone(),
                  None if layer.recurrent_states[0] is None else layer.recurrent_states[0].clone())
    return out, hf_cache.attention_lengths(cache)


def assert_same_states(a, b):
    (sa, la), (sb, lb) = a, b
    assert la == lb
    for i in sa:
        assert sa[i][0] == sb[i][0]
        for x, y in zip(sa[i][1:], sb[i][1:]):
            assert (x is None and y is None) or torch.equal(x, y), f"layer {i} changed"


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(family, device):
    """Full prefill, chunked prefill through the cache and decode steps give transformers' logits,
    and leave the cache holding transformers' states."""
    model, kind = build(family, device)
    ids, dec = inputs(device)
    # transformers' own, before use_ssm_kernels: one-token steps included, on every release allowed
    ref_full, ref_cache = session(model, ids, [PROMPT], dec)
    ref_chunked, _ = session(model, ids, [SPLIT, PROMPT - SPLIT], dec)
    use_ssm_kernels(model)
    full, cache = session(model, ids, [PROMPT], dec)
    chunked, _ = session(model, ids, [SPLIT, PROMPT - SPLIT], dec)

    assert_rel_close(full, ref_full, TOL, "full prefill + decode logits")
    # transformers' Mamba-1 PyTorch path restarts the SSM state from zeros in a multi-token pass
    # that continues from the cache; the adapter continues, so chunked matches the full pass.
    assert_rel_close(chunked, ref_full, TOL, "chunked prefill + decode logits vs one full pass")
    if kind == "mamba2":
        assert_rel_close(chunked, ref_chunked, TOL, "chunked prefill + decode logits vs transformers chunked")
    for i in ssm_layer_ids(model):
        ours, theirs = hf_cache.linear_layer(cache, i), hf_cache.linear_layer(ref_cache, i)
        assert_rel_close(ours.recurrent_states[0], theirs.recurrent_states[0], TOL, f"layer {i} SSM state")
        assert_rel_close(ours.conv_states[0], theirs.conv_states[0], TOL, f"layer {i} conv state")
    assert_token_counts(cache, ssm_layer_ids(model), PROMPT + DECODE)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_capture_then_restore_continues(family, device):
    """States captured inside prefill passes, restored into another cache, continue as the full
    prompt would: the attention cache (hybrids) comes from a prefix pass, the SSM states from the
    snapshots (the cache's own SSM states are scrambled first)."""
    model, _ = build(family, device)
    ids, dec = inputs(device)
    ref, _ = session(model, ids, [PROMPT], dec)
    use_ssm_kernels(model)
    layers = ssm_layer_ids(model)
    with capture_states(model, positions=CAPTURE) as snaps:
        session(model, ids, [SPLIT, PROMPT - SPLIT], dec[:, :0])
    assert snaps.positions == list(CAPTURE)
    assert len(snaps) == len(CAPTURE) * len(layers) * ids.shape[0]
    assert all(isinstance(s, Snapshot) for s in snaps)
    at = CAPTURE[1]

    cache = DynamicCache(config=model.config)
    hybrid = bool(hf_cache.attention_lengths(cache))
    if hybrid:  # attention keys/values for [0, at); SSM states then replaced by garbage
        run(model, ids[:, :at], cache, 0)
        for i in layers:
            snap = [s for s in snaps.at(at) if s.layer == i][0]
            state = hf_cache.linear_layer(cache, i)
            assert_rel_close(state.recurrent_states[0][0], snap.ssm, TOL, "in-pass capture vs pass-end state")
            assert_rel_close(state.conv_states[0][0, :, 1:], snap.conv, TOL, "in-pass conv capture")
            state.recurrent_states[0].normal_()
            state.conv_states[0].normal_()
    restore_states(model, cache, snaps.at(at), position=at)
    assert_token_counts(cache, layers, at)
    out, _ = session(model, ids, [PROMPT - at], dec, cache=cache, start=at)
    assert_rel_close(out, ref[:, at:], TOL, f"continuation from the snapshot at {at}")
    assert_token_counts(cache, layers, PROMPT + DECODE)

    # and the adapter knows where the restored cache is: a later capture lands at the right place
    with capture_states(model, offsets=[0]) as again:
        run(model, dec[:, :1], cache, PROMPT + DECODE)
    assert again.positions == [PROMPT + DECODE]


@pytest.mark.parametrize("family", ["Mamba2", "Jamba"])
def test_generate_matches_transformers(family, device):
    """transformers' generate() runs the patched model (its own cache handling) to the same tokens."""
    model, _ = build(family, device)
    ids, _ = inputs(device)
    opts = dict(max_new_tokens=5, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    ref = model.generate(ids, **opts)
    use_ssm_kernels(model)
    assert torch.equal(model.generate(ids, **opts), ref)


@pytest.mark.parametrize("family", ["Mamba2", "Mamba", "Jamba"])
def test_generate_from_inputs_embeds_matches_transformers(family, device):
    """generate(inputs_embeds=...) (generate reads prepare_inputs_for_generation's signature, and
    passes the generated tokens' ids after the prompt's embeddings) gives transformers' tokens,
    from a fresh cache and, on an SSM-only model, from one restored inside the prompt."""
    model, _ = build(family, device)
    ids, _ = inputs(device)
    embeds = model.get_input_embeddings()(ids)
    opts = dict(max_new_tokens=DECODE, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    ref = model.generate(inputs_embeds=embeds, **opts)
    use_ssm_kernels(model)
    assert torch.equal(model.generate(inputs_embeds=embeds, **opts), ref)
    cache = DynamicCache(config=model.config)
    if hf_cache.attention_lengths(cache):
        return
    at = CAPTURE[1]
    with capture_states(model, positions=[at]) as snaps:
        run(model, ids, DynamicCache(config=model.config), 0)
    restore_states(model, cache, snaps.at(at))
    assert torch.equal(model.generate(inputs_embeds=embeds, cache=cache, **opts), ref)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_recording_cache_rolls_back(family, device):
    """A cache recording its past (what assisted decoding turns on to drop rejected draft tokens):
    a pass of 5 tokens keeps the states after each, crop(-k) goes back k tokens, and the next
    pass gives the logits of one pass over the tokens kept and the new ones."""
    model, _ = build(family, device)
    ids, alt = inputs(device)
    keep_ = 12
    use_ssm_kernels(model)
    for k in (1, 2, 4):
        kept = 17 - k
        want = run(model, torch.cat([ids[:, :kept], alt], 1), DynamicCache(config=model.config), 0)[:, kept:]
        cache = DynamicCache(config=model.config)
        cache.activate_past_recording(recurrent_states_to_keep=5)
        run(model, ids[:, :keep_], cache, 0)
        run(model, ids[:, keep_:17], cache, keep_)
        cache.crop(-k)
        assert_rel_close(run(model, alt, cache, kept), want, TOL, f"logits after crop({-k})")


@pytest.mark.parametrize("family", ["Mamba2", "Mamba"])
def test_a_restored_recording_cache_rolls_back_to_the_restore_point_only(family, device):
    """restore_states into a cache recording its past, which had held another sequence: a crop
    after the restore goes back to states of the restored sequence (the logits of a cold pass),
    and one that reaches below the restore point fails, rather than installing the other
    sequence's state that the cache kept for its own crops."""
    model, _ = build(family, device)
    ids, alt = inputs(device)
    use_ssm_kernels(model)
    at, n = CAPTURE[1], 3
    with capture_states(model, positions=[at]) as snaps:
        run(model, ids, DynamicCache(config=model.config), 0)
    for k in range(n + 1):
        cache = DynamicCache(config=model.config)
        cache.activate_past_recording(recurrent_states_to_keep=5)
        run(model, alt.flip(0).repeat(1, 6), cache, 0)  # another sequence, 18 tokens
        restore_states(model, cache, snaps.at(at))
        run(model, ids[:, at:at + n], cache, at)
        cache.crop(-k)
        kept = at + n - k
        want = run(model, torch.cat([ids[:, :kept], alt], 1), DynamicCache(config=model.config), 0)[:, kept:]
        assert_rel_close(run(model, alt, cache, kept), want, TOL, f"logits after crop({-k})")
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording(recurrent_states_to_keep=5)
    run(model, alt.flip(0).repeat(1, 6), cache, 0)
    restore_states(model, cache, snaps.at(at))
    run(model, ids[:, at:at + n], cache, at)
    with pytest.raises(IndexError):
        cache.crop(-(n + 1))


@pytest.mark.parametrize("family", ["Mamba2", "Jamba"])
def test_assisted_generate_matches_greedy(family, device):
    """generate with an assistant model (draft tokens verified in one pass, the rejected ones
    cropped from the cache) gives plain greedy's tokens."""
    model, _ = build(family, device)
    torch.manual_seed(123)
    assistant = type(model)(model.config).to(device).eval()
    ids, _ = inputs(device, batch=1)
    opts = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    use_ssm_kernels(model)
    plain = model.generate(ids, **opts)
    assisted = model.generate(ids, assistant_model=assistant, num_assistant_tokens=4,
                              num_assistant_tokens_schedule="constant", **opts)
    assert torch.equal(assisted, plain)


@pytest.mark.parametrize("family", ["Mamba2", "Mamba"])
def test_captures_hold_the_sequence_as_it_stands(family, device):
    """Captures in assisted generation (draft tokens verified in one pass, the rejected ones
    cropped, the sequence computed again from there) hold the states of the tokens kept, one per
    layer and row, as a cold pass over the output gives them; and a position that ends one pass
    and starts the next (offsets 0 and its length) is held once, so that restore_states makes a
    cache of the batch's size."""
    model, _ = build(family, device)
    torch.manual_seed(123)
    assistant = type(model)(model.config).to(device).eval()
    ids, _ = inputs(device, batch=1)
    use_ssm_kernels(model)
    layers = ssm_layer_ids(model)
    at = PROMPT + 3
    with capture_states(model, positions=[at]) as snaps:
        out = model.generate(ids, assistant_model=assistant, num_assistant_tokens=4, max_new_tokens=8,
                             num_assistant_tokens_schedule="constant", do_sample=False, pad_token_id=0)
    cold = DynamicCache(config=model.config)
    run(model, out[:, :at], cold, 0)
    assert [s.layer for s in snaps.at(at)] == layers
    for s in snaps.at(at):
        assert_rel_close(s.ssm, hf_cache.linear_layer(cold, s.layer).recurrent_states[0][0], TOL, f"layer {s.layer}")

    ids, _ = inputs(device)
    with capture_states(model, offsets=[0, SPLIT]) as snaps:
        session(model, ids, [SPLIT, SPLIT], ids[:, :0])
    assert snaps.positions == [0, SPLIT, 2 * SPLIT]
    assert len(snaps.at(SPLIT)) == len(layers) * ids.shape[0]
    cache = restore_states(model, DynamicCache(config=model.config), snaps.at(SPLIT))
    assert hf_cache.linear_layer(cache, layers[0]).recurrent_states[0].shape[0] == ids.shape[0]


@pytest.mark.parametrize("family", ["Mamba2", "Mamba", "Bamba"])
def test_generate_continues_a_restored_cache(family, device):
    """generate(whole prompt, cache=restored at p) computes only the prompt's tokens past p and
    gives a cold generate's tokens; on an SSM-only model, a prompt not longer than p is refused
    before anything runs (a hybrid's generate slices the prompt by its attention cache's length)."""
    model, _ = build(family, device)
    use_ssm_kernels(model)
    ids, _ = inputs(device)
    opts = dict(max_new_tokens=DECODE, do_sample=False, pad_token_id=0, output_scores=True,
                return_dict_in_generate=True)
    cold = model.generate(ids, **opts)
    at = CAPTURE[1]
    with capture_states(model, positions=[at]) as snaps:
        run(model, ids, DynamicCache(config=model.config), 0)

    def restored():
        cache = DynamicCache(config=model.config)
        if hf_cache.attention_lengths(cache):  # hybrid: the attention cache of [0, at) first
            run(model, ids[:, :at], cache, 0)
        return restore_states(model, cache, snaps.at(at))

    cache, fed = restored(), []
    hook = model.register_forward_pre_hook(lambda m, a, k: fed.append(k["input_ids"].shape[1]), with_kwargs=True)
    try:
        warm = model.generate(ids, cache=cache, **opts)
    finally:
        hook.remove()
    assert fed[0] == PROMPT - at, f"the first pass computed {fed[0]} tokens, not the {PROMPT - at} past the cache"
    assert torch.equal(warm.sequences, cold.sequences)
    assert_rel_close(torch.stack(warm.scores), torch.stack(cold.scores), TOL, "generate scores from the restored cache")

    cache = restored()
    if hf_cache.attention_lengths(cache):
        return
    before = cache_states(cache, ssm_layer_ids(model))
    for short in (ids[:, :at], ids[:, at:]):  # the prefix the cache holds, or only the tail
        with pytest.raises(ValueError, match=rf"generate was given {short.shape[1]} tokens.*SSM layers are at "
                                             rf"position {at}: pass the whole sequence"):
            model.generate(short, cache=cache, **opts)
        assert_same_states(cache_states(cache, ssm_layer_ids(model)), before)


def test_snapshot_reprs_show_shapes_not_data(device):
    model, _ = build("Mamba2", device)
    use_ssm_kernels(model)
    ids, _ = inputs(device)
    with capture_states(model, positions=[5, 9]) as snaps:
        run(model, ids, DynamicCache(config=model.config), 0)
    assert repr(snaps) == "Captured(8 snapshots at positions [5, 9], layers [0, 1])"
    assert repr(snaps[0]) == "LayerSnapshot(position=5, conv=(128, 3) float32, ssm=(8, 8, 16) float32, layer=0)"


@pytest.mark.parametrize("family", ["Mamba2", "Bamba", "Jamba"])
def test_restore_rejects_bad_snapshots(family, device):
    """Wrong layer, shape, position, batch or type: a clear error, and the cache is untouched."""
    model, _ = build(family, device)
    use_ssm_kernels(model)
    ids, _ = inputs(device)
    layers = ssm_layer_ids(model)
    with capture_states(model, positions=CAPTURE) as snaps:
        session(model, ids, [SPLIT, PROMPT - SPLIT], ids[:, :0])
    good = snaps.at(CAPTURE[1])
    cache = DynamicCache(config=model.config)
    run(model, ids[:, :CAPTURE[1]], cache, 0)
    hybrid = bool(hf_cache.attention_lengths(cache))
    other = next(i for i in range(len(cache.layers) + 1) if i not in layers)  # not an SSM layer
    swap = lambda s, **kw: LayerSnapshot(**{**dict(position=s.position, conv=s.conv, ssm=s.ssm, layer=s.layer), **kw})
    before = cache_states(cache, layers)

    cases = [
        ([swap(s, layer=other) if s.layer == layers[0] else s for s in good], ValueError, "snapshots for layers"),
        ([s for s in good if s.layer != layers[-1]], ValueError, "no snapshot for SSM layers"),
        ([swap(s, ssm=s.ssm[..., :-1]) for s in good], ValueError, "SSM state|ssm state has shape"),
        ([swap(s, conv=s.conv[:-1]) for s in good], ValueError, "conv state has shape"),
        ([swap(s, ssm=s.ssm.double()) for s in good], TypeError, "must be float32"),
        ([swap(s, position=CAPTURE[0]) if s.layer == layers[0] else s for s in good], ValueError, "one position"),
        (snaps.at(CAPTURE[0]), ValueError, "attention layers hold" if hybrid else None),
        ([s for i, s in enumerate(good) if i % 2 == 0], ValueError, "batch 1|same number"),
        ([Snapshot(s.position, s.conv, s.ssm) for s in good], TypeError, "must be a LayerSnapshot"),
        ([], ValueError, "needs snapshots"),
        # A bool passed the int check: True restored the state as position 1.
        ([swap(s, position=True) for s in good], TypeError, r"snapshots\[0\].position must be an int, got True"),
        ([swap(s, layer=True) for s in good], TypeError, r"snapshots\[0\].layer must be an int, got True"),
    ]
    for bad, error, message in cases:
        if message is None:
            continue
        with pytest.raises(error, match=message):
            restore_states(model, cache, bad)
        assert_same_states(cache_states(cache, layers), before)
    with pytest.raises(ValueError, match="expected position"):
        restore_states(model, cache, good, position=CAPTURE[1] + 1)
    with pytest.raises(TypeError, match="position must be an int, got float"):
        restore_states(model, cache, good, position=float(CAPTURE[1]))
    assert_same_states(cache_states(cache, layers), before)


@pytest.mark.parametrize("family", ["Mamba2", "Mamba"])
def test_left_padding_matches_transformers(family, device):
    """A left-padded batch with an attention mask gives transformers' logits (prefill and decode);
    captures in a padded pass are refused."""
    model, _ = build(family, device)
    ids, dec = inputs(device)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0

    def padded():
        cache = DynamicCache(config=model.config)
        outs = [run(model, ids, cache, 0, attention_mask=mask)]
        for i in range(DECODE):  # decode tokens are never padding (no attention layers need the mask)
            outs.append(run(model, dec[:, i:i + 1], cache, PROMPT + i))
        return torch.cat(outs, 1)

    ref = padded()
    use_ssm_kernels(model)
    assert_rel_close(padded(), ref, TOL, "left-padded logits")
    with pytest.raises(ValueError, match="unpadded"), capture_states(model, offsets=[3]):
        run(model, ids, DynamicCache(config=model.config), 0, attention_mask=mask)
    # A one-token step after a padded pass: its own mask holds no zeros, its rows' positions are off all the same.
    cache = DynamicCache(config=model.config)
    run(model, ids, cache, 0, attention_mask=mask)
    with pytest.raises(ValueError, match="unpadded"), capture_states(model, offsets=[1]):
        run(model, dec[:, :1], cache, PROMPT)


@pytest.mark.parametrize("family", ["Mamba2", "Mamba"])
def test_decode_step_captures(family, device):
    """Offsets 0 and 1 of a one-token pass are the states before and after it."""
    model, _ = build(family, device)
    use_ssm_kernels(model)
    ids, dec = inputs(device)
    cache = DynamicCache(config=model.config)
    run(model, ids, cache, 0)
    layers = ssm_layer_ids(model)
    before = {i: hf_cache.linear_layer(cache, i).recurrent_states[0].clone() for i in layers}
    with capture_states(model, offsets=[1, 0]) as snaps:
        run(model, dec[:, :1], cache, PROMPT)
    assert snaps.positions == [PROMPT, PROMPT + 1]
    for s in snaps:
        row = [id(t) for t in snaps if t.layer == s.layer and t.position == s.position].index(id(s))
        want = before[s.layer] if s.position == PROMPT else hf_cache.linear_layer(cache, s.layer).recurrent_states[0]
        assert torch.equal(s.ssm, want[row])
        if s.position == PROMPT + 1:
            assert torch.equal(s.conv, hf_cache.linear_layer(cache, s.layer).conv_states[0][row, :, 1:])


class _DeviceReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts reads of a tensor's value on the host (int(), bool(), .item(): each waits on a GPU)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["Mamba2", "Mamba"])
def test_a_decode_step_reads_nothing_back(family, device):
    """No capture asked: a decode step neither reads the layers' positions nor tests the mask
    for padding on the host (each had waited on the device once a layer); captures after it are
    placed and refused as before."""
    model, _ = build(family, device)
    use_ssm_kernels(model)
    ids, dec = inputs(device)
    cache = DynamicCache(config=model.config)
    run(model, ids, cache, 0, attention_mask=torch.ones_like(ids))
    for i in range(2):
        with _DeviceReads() as reads:
            run(model, dec[:, i:i + 1], cache, PROMPT + i,
                attention_mask=torch.ones(ids.shape[0], PROMPT + i + 1, dtype=ids.dtype, device=ids.device))
        assert reads.count == 0
    with capture_states(model, offsets=[1]) as snaps:
        run(model, dec[:, 2:3], cache, PROMPT + 2)
    assert set(snaps.positions) == {PROMPT + 3}


@pytest.mark.parametrize("family", ["Mamba2", "Mamba"])
def test_decode_step_leaves_transformers_conv_state(family, device):
    """A decode step updates the conv cache in place to what transformers' own step leaves, bit
    for bit, its never-read first column included: at the first SSM layer, whose conv inputs are
    the same projections of the same embeddings on both paths."""
    ids, dec = inputs(device)
    states = []
    for patched in (False, True):
        model, _ = build(family, device)
        if patched:
            use_ssm_kernels(model)
        cache = DynamicCache(config=model.config)
        run(model, ids, cache, 0)
        run(model, dec[:, :1], cache, PROMPT)
        first = min(m.layer_idx for m in model.modules() if hasattr(m, "conv1d") and hasattr(m, "layer_idx"))
        states.append(hf_cache.linear_layer(cache, first).conv_states[0])
    assert torch.equal(states[1], states[0])


def test_an_older_transformers_is_refused(monkeypatch, device):
    """Below the oldest release tested the adapter refuses to patch, naming the release it needs."""
    model, _ = build("Mamba2", device)
    monkeypatch.setattr("transformers.__version__", "5.23.0")  # the module as imported now
    with pytest.raises(ImportError, match=r"transformers >= 5\.24 .*found 5\.23\.0"):
        use_ssm_kernels(model)
    assert not ssm_layer_ids(model)
    monkeypatch.setattr("transformers.__version__", "5.24.0.dev0")
    use_ssm_kernels(model)
    assert ssm_layer_ids(model)


def test_unsupported_models_and_calls_are_rejected(device):
    """No SSM mixer, an unknown one, autograd, packed sequences, bad capture requests."""
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4))
    with pytest.raises(ValueError, match="no SSM mixer"):
        use_ssm_kernels(llama)

    model, _ = build("Mamba2", device)
    model.extra = torch.nn.Module()
    model.extra.A_log = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(NotImplementedError, match="cannot run"):
        use_ssm_kernels(model)
    assert not ssm_layer_ids(model), "nothing may be patched when the model is rejected"
    del model.extra

    ids, _ = inputs(device)
    with pytest.raises(ValueError, match="use_ssm_kernels"), capture_states(model, offsets=[1]):
        pass
    use_ssm_kernels(model)
    with torch.enable_grad(), pytest.raises(RuntimeError, match="inference-only"):
        model(input_ids=ids)
    model.requires_grad_(False)
    for name in ("A_log", "D", "dt_bias", "conv1d.weight", "in_proj.bias"):  # any one trained: refused too
        param = model.get_parameter(f"backbone.layers.0.mixer.{name}")
        param.requires_grad_(True)
        with torch.enable_grad(), pytest.raises(RuntimeError, match="inference-only"):
            model(input_ids=ids)
        param.requires_grad_(False)
    model.lm_head.requires_grad_(True)  # only the head trained: nothing needs the mixers' backward
    with torch.enable_grad():
        model(input_ids=ids).logits.sum().backward()
    assert model.lm_head.weight.grad is not None
    mixer = model.backbone.layers[0].mixer
    with pytest.raises(NotImplementedError, match="packed sequences"):
        mixer(torch.randn(1, 4, 32, device=device), seq_idx=torch.zeros(1, 4, dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match="exactly one"), capture_states(model):
        pass
    with pytest.raises(ValueError, match=r"positions\[0\] must be >= 0, got -1"), capture_states(model, positions=[-1]):
        pass
    with pytest.raises(TypeError, match=r"offsets\[1\] must be an int, got True"), \
            capture_states(model, offsets=[2, True]):
        pass
    cache = DynamicCache(config=model.config)
    with pytest.raises(ValueError, match="past this pass"), capture_states(model, offsets=[PROMPT + 1]):
        run(model, ids, cache, 0)
    assert not any(hf_cache.has_previous(hf_cache.linear_layer(cache, i)) for i in ssm_layer_ids(model)), \
        "a rejected capture request must not run any layer"

    remove_ssm_kernels(model)
    assert not ssm_layer_ids(model) and "forward" not in model.backbone.layers[0].mixer.__dict__
