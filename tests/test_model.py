"""The hybrid model served with the planner: a warm request's logits are bit-identical to a cold
one-pass prefill of the same prompt, for every policy, on the incident and on planner traces."""
import dataclasses

import numpy as np
import pytest
import torch

from planner import POLICIES, agentic_branching, multi_turn_chat
from ssm_serving.demo import Incident
from ssm_serving import Engine, HybridConfig, HybridLM, KVBlockStore
from ssm_serving.model import ModelSnapshot, ModelState

CONFIG = HybridConfig(vocab_size=64, hidden_size=32, num_layers=4, attention_every=2, num_attention_heads=2,
                      mamba_heads=2, mamba_head_dim=32, state_size=8, mlp_size=48, seed=3)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: token-sized ops, one thread


@pytest.fixture(scope="module")
def model():
    return HybridLM(CONFIG, backend="torch")


@pytest.fixture(scope="module")
def references(model):
    """One cold single-pass prefill per prompt, shared by the tests of this module."""
    cache = {}

    def reference(tokens):
        key = tuple(tokens)
        if key not in cache:
            cache[key] = model.prefill(key)
        return cache[key]

    return reference


def prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist()


# -------------------------------------------------------------------------------------------
# The model itself
# -------------------------------------------------------------------------------------------
def test_layer_pattern_and_seeded_weights():
    assert CONFIG.layer_types == ("mamba2", "attention", "mamba2", "attention")
    a, b = HybridLM(CONFIG), HybridLM(CONFIG)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    other = HybridLM(HybridConfig(**{**CONFIG.__dict__, "seed": 4}))
    assert not torch.equal(a.embed.weight, other.embed.weight)


def test_any_split_with_captures_is_bitwise(model, references):
    tokens = prompt(37)
    state, logits, snapshots = model.new_state(), [], []
    for lo, hi, capture in [(0, 1, [1]), (1, 14, [0, 5, 13]), (14, 15, []), (15, 37, [22, 3])]:
        out = model.forward_pass(tokens[lo:hi], state, capture=capture)
        logits.append(out.logits)
        snapshots += out.snapshots
    assert state.position == 37
    assert torch.equal(torch.cat(logits), references(tokens))
    assert [s.position for s in snapshots] == [1, 1, 6, 14, 37, 18]
    # Restore the snapshot at 6 (with the KV of [0, 6)) and continue: the same logits.
    kv = [(k[:6], v[:6]) for k, v in model.kv_rows(state)]
    resumed = model.forward_pass(tokens[6:], model.restore(snapshots[2], kv))
    assert torch.equal(resumed.logits, references(tokens)[6:])


def test_last_logits_only(model, references):
    tokens = prompt(9, seed=1)
    out = model.forward_pass(tokens, model.new_state(), logits="last")
    assert torch.equal(out.logits, references(tokens)[-1:])


def test_restore_and_inputs_are_checked(model):
    out = model.forward_pass(prompt(5), model.new_state(), capture=[5])
    kv = model.kv_rows(out.state)
    with pytest.raises(ValueError, match=r"KV keys of shape \(4, 2, 16\) must be \(position, heads, head_dim\) = "
                                         r"\(5, 2, 16\)"):
        model.restore(out.snapshots[0], [(k[:4], v[:4]) for k, v in kv])
    with pytest.raises(TypeError, match="KV values must be torch.float32 on cpu, got torch.float32 on meta"):
        model.restore(out.snapshots[0], [(k, v.to("meta")) for k, v in kv])
    with pytest.raises(ValueError, match="does not fit a model"):
        model.restore(out.snapshots[0], kv[:1])
    with pytest.raises(ValueError, match="logits must be one of"):
        model.forward_pass([1], model.new_state(), logits="first")


@pytest.mark.parametrize("tokens, capture, error, message", [
    ([1, 64], (), ValueError, r"token ids must be in \[0, 64\), got tokens\[1\] = 64"),
    ([1, -1], (), ValueError, r"got tokens\[1\] = -1"),
    ([1, 2, 3.9], (), TypeError, r"tokens\[2\] must be an int token id, got 3.9 \(float\)"),
    ([1, True], (), TypeError, r"tokens\[1\] must be an int token id, got True \(bool\)"),
    ("abc", (), TypeError, "tokens must be a sequence of ints or a 1-D integer tensor, got str"),
    (torch.tensor([[1, 2]]), (), TypeError, r"a tensor of shape \(1, 2\)"),
    (torch.tensor([1.0, 2.0]), (), TypeError, "dtype torch.float32"),
    ({1, 2}, (), TypeError, "tokens must be a sequence of ints or a 1-D integer tensor, got set"),  # no order
    ({1: "a"}, (), TypeError, "got dict"),
    (np.array(3), (), TypeError, r"got ndarray of shape \(\)"),
    ([1, 2, 3], [4], ValueError, r"capture\[0\] = 4 is outside this pass's offsets 0..3"),
    ([1, 2, 3], [1.5], TypeError, r"capture\[0\] must be an int offset, got 1.5"),
])
def test_forward_pass_rejects_bad_tokens_and_offsets_before_advancing(model, tokens, capture, error, message):
    state = model.forward_pass(prompt(3), model.new_state()).state
    kv_before = [k.clone() for k, _ in model.kv_rows(state)]
    with pytest.raises(error, match=message):
        model.forward_pass(tokens, state, capture=capture)
    assert state.position == 3 and all(torch.equal(k, b) for (k, _), b in zip(model.kv_rows(state), kv_before))


def _other_model(**changes):
    return HybridLM(dataclasses.replace(CONFIG, **changes), backend="torch")


@pytest.mark.parametrize("make_state, error, message", [
    (lambda m: _other_model(num_attention_heads=4).new_state(), ValueError,
     r"state.layers\[\d\] holds keys of \(heads, head_dim\) \(4, 8\), torch.float32 on cpu; the layer needs "
     r"\(2, 16\)"),
    (lambda m: ModelState(0, m.new_state().layers[::-1]), TypeError,
     r"state.layers\[\d\] (must be a KVCache|\(a Mamba)"),
    (lambda m: ModelState(0, m.new_state().layers[:-1]), ValueError, "a list of one state per layer"),
    (lambda m: ModelState(5, m.new_state().layers), ValueError, r"state.layers\[0\] is at position 0, the state at 5"),
    (lambda m: ModelState(-1, m.new_state().layers), ValueError, "state.position must be an int >= 0"),
])
def test_forward_pass_refuses_a_state_of_another_model_or_position_before_advancing(model, make_state, error,
                                                                                      message):
    state = make_state(model)
    before = [(layer.ssm.clone(), layer.positions) if hasattr(layer, "ssm") else layer.length
              for layer in state.layers]
    with pytest.raises(error, match=message):
        model.forward_pass(prompt(3), state)
    after = [(layer.ssm.clone(), layer.positions) if hasattr(layer, "ssm") else layer.length
             for layer in state.layers]
    assert all(a == b if isinstance(a, int) else torch.equal(a[0], b[0]) and a[1] == b[1]
               for a, b in zip(after, before))


def test_restore_refuses_a_snapshot_whose_layers_are_at_another_position(model):
    out = model.forward_pass(prompt(6), model.new_state(), capture=[3, 6])
    early, late = out.snapshots
    mixed = ModelSnapshot(late.position, (early.layers[0], *late.layers[1:]))
    with pytest.raises(ValueError, match=r"snapshot.layers\[0\] is at position 3, the snapshot at 6"):
        model.restore(mixed, model.kv_rows(out.state))


def test_integer_tensor_tokens_are_served_like_lists(model, references):
    tokens = prompt(9, seed=4)
    engine = Engine(model, policy="split", block_size=8, budget=16)
    assert torch.equal(engine.serve(torch.tensor(tokens)).logits, references(tokens))


@pytest.mark.parametrize("changes, error, message", [
    (dict(num_layers=0), ValueError, "num_layers must be an int from 1 to 1024, got 0"),
    (dict(dtype=torch.int64), TypeError, r"dtype must be one of torch.float32, torch.float16, torch.bfloat16 .*"
                                         r"got torch.int64"),
    (dict(dtype="float32"), TypeError, "dtype must be one of"),
    (dict(eps=0.0), ValueError, "eps must be a positive finite number, got 0.0"),
    (dict(eps="1e-5"), ValueError, "eps must be a positive finite number"),
    (dict(seed=-1), ValueError, "seed must be an int from 0 to 18446744073709551615, got -1"),
    (dict(hidden_size=30, num_attention_heads=4), ValueError, r"hidden_size \(30\) must be a multiple of"),
    (dict(mamba_heads=3, n_groups=2), ValueError, r"mamba_heads \(3\) must be a multiple of n_groups \(2\)"),
    (dict(state_size=1000), ValueError, "state_size 1000 is beyond the kernels' limit of 256"),
    # Sizes beyond the machine: refused before any weight is allocated.
    (dict(vocab_size=10**12), ValueError, r"would have \d+ parameters \(2 x vocab_size 1000000000000 x "
                                          r"hidden_size 64 in the embeddings and the LM head, .*\), "
                                          r"more than the limit of 2147483648"),
    (dict(hidden_size=2**20, num_attention_heads=1), ValueError, "more than the limit of 2147483648"),
    (dict(num_layers=10**9), ValueError, "num_layers must be an int from 1 to 1024, got 1000000000"),
    (dict(seed=2**64), ValueError, "seed must be an int from 0 to 18446744073709551615, got 18446744073709551616"),
])
def test_config_rejects_what_the_model_cannot_run(changes, error, message):
    with pytest.raises(error, match=message):
        HybridConfig(**changes)


@pytest.mark.parametrize("changes", [{}, dict(attention_every=0, n_groups=2, conv_kernel=3),
                                     dict(num_layers=5, attention_every=3, mlp_size=7)])
def test_config_counts_the_parameters_the_model_allocates(changes):
    config = HybridConfig(**{**CONFIG.__dict__, **changes})
    model = HybridLM(config, device="meta")  # shapes only
    assert config.num_parameters == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("make, error, message", [
    (lambda: HybridLM("small"), TypeError, "config must be a HybridConfig, got str"),
    (lambda: HybridLM(CONFIG, backend="cuda"), ValueError,
     r"backend must be one of \('auto', 'triton', 'torch'\), got 'cuda'"),
    (lambda: HybridLM(CONFIG, device="gpu0"), ValueError, "device must be a torch device or its name, got 'gpu0'"),
    pytest.param(lambda: HybridLM(CONFIG, device="cuda"), ValueError, "device is cuda, but this torch has no CUDA",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")),
])
def test_model_refuses_a_bad_config_backend_or_device_before_building(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_missing_or_mistyped_pass_arguments_are_named(model):
    state = model.new_state()
    with pytest.raises(TypeError, match="capture must be a sequence of int offsets, got NoneType"):
        model.forward_pass([1, 2], state, capture=None)
    with pytest.raises(TypeError, match="snapshot must be a ModelSnapshot or None, got str"):
        model.restore("snapshot", [])
    snapshot = model.forward_pass([1, 2], model.new_state(), capture=[2]).snapshots[0]
    with pytest.raises(TypeError, match=r"kv must be a sequence of \(keys, values\) pairs, got NoneType"):
        model.restore(snapshot, None)
    with pytest.raises(TypeError, match=r"kv\[0\] must be a \(keys, values\) pair, got Tensor"):
        model.restore(snapshot, [torch.zeros(2, 2, 16), torch.zeros(2, 2, 16)])
    assert state.position == 0


def test_meta_model_is_refused_clearly():
    meta = HybridLM(CONFIG, device="meta")
    with pytest.raises(ValueError, match="the model is on the meta device, which holds shapes but no weights"):
        meta.prefill([1, 2])
    with pytest.raises(ValueError, match="the model is on the meta device"):
        Engine(meta, policy="split", block_size=8, budget=16)


def test_a_model_moved_to_another_dtype_is_refused_clearly():
    moved = HybridLM(CONFIG).to(torch.bfloat16)
    with pytest.raises(TypeError, match="the model's weights are torch.bfloat16, its config's dtype torch.float32"):
        moved.prefill([1, 2])
    with pytest.raises(TypeError, match="the model's weights are torch.bfloat16"):
        Engine(moved, policy="split", block_size=8, budget=16)


@pytest.mark.parametrize("block_size, error", [(0, ValueError), (True, TypeError), (16.0, TypeError)])
def test_kv_block_store_refuses_a_bad_block_size(block_size, error):
    with pytest.raises(error, match=f"block_size must be an int >= 1, got {block_size!r}"):
        KVBlockStore(block_size)
    with pytest.raises(ValueError, match="end must be an int >= 0, got -1"):
        KVBlockStore(4).gather([1, 2, 3, 4], -1)


def test_kv_block_store_finds_blocks_by_their_whole_prefix():
    store = KVBlockStore(block_size=2)
    k = torch.arange(5.0).view(5, 1, 1)
    store.insert([1, 2, 3, 4, 5], [(k, -k)])
    assert store.blocks == 2  # the trailing partial block is not stored
    (got,) = store.gather([1, 2, 3, 4, 9], 3)
    assert torch.equal(got[0], k[:3]) and torch.equal(got[1], -k[:3])
    assert store.gather([9, 2, 3, 4], 3) is None  # same second block, another prefix
    assert store.gather([1, 2, 3, 4], 0) == []


def test_kv_block_store_holds_a_block_s_first_rows_up_to_end():
    """Rows at or past ``end`` are never stored (on the chunked scan they are not yet the bits
    every pass computes); a block held with fewer rows gets the rest from a later insert."""
    store = KVBlockStore(block_size=4)
    k = torch.arange(10.0).view(10, 1, 1)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    store.insert(tokens, [(k, -k)], end=6)
    assert store.blocks == 2
    (got,) = store.gather(tokens, 6)
    assert torch.equal(got[0], k[:6]) and torch.equal(got[1], -k[:6])
    assert store.gather(tokens, 7) is None  # row 6 was not stored
    store.insert(tokens, [(k + 100, -k)], end=8)  # rows 4 and 5 are kept, 6 and 7 added
    (got,) = store.gather(tokens, 8)
    assert torch.equal(got[0], torch.cat([k[:6], k[6:8] + 100])) and store.blocks == 2
    store.insert(tokens, [(k, -k)], end=10)  # the trailing partial block [8, 10) is not stored
    assert store.blocks == 2 and store.gather(tokens, 9) is None
    with pytest.raises(ValueError, match="end must be an int from 0 to 10, got 11"):
        store.insert(tokens, [(k, -k)], end=11)
    with pytest.raises(ValueError, match=r"kv must hold rows of positions \[0, 8\), got a tensor of 5 rows"):
        KVBlockStore(4).insert(tokens, [(k[:5], -k)])


# -------------------------------------------------------------------------------------------
# Serving: warm == cold, bitwise, for every policy
# -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_incident_warm_request_is_bitwise_and_restores_where_the_seed_says(model, references, policy):
    """The seed's incident at 1/256 scale (budget 32, first chunk 33, 132 tokens, block 16)."""
    incident = Incident(256)
    budget = incident.budget
    tokens = prompt(incident.total, seed=7)
    engine = Engine(model, policy=policy, **incident.rules())
    cold = engine.serve(tokens)
    warm = engine.serve(tokens)
    expected = {"legacy": (3 * budget + 1, budget + 3), "split": (4 * budget - 16, 20),
                "inpass": (4 * budget, 4), "free": (4 * budget, 4)}[policy]
    assert (warm.restore_point, warm.replayed) == expected
    assert warm.matched == 4 * budget
    assert torch.equal(cold.logits, references(tokens))
    assert torch.equal(warm.logits, references(tokens)[warm.restore_point:])
    if policy in ("inpass", "free"):
        assert 4 * budget - 16 in cold.captures  # the tail split point, captured inside a pass


TRACES = {
    "chat": lambda: multi_turn_chat(conversations=2, turns=3, system_tokens=40, message_tokens=(3, 20),
                                    reply_tokens=(3, 20), vocab_size=CONFIG.vocab_size, seed=1),
    "agent": lambda: agentic_branching(contexts=2, branches=3, context_tokens=(50, 90), continuation_tokens=(3, 15),
                                       vocab_size=CONFIG.vocab_size, seed=2),
}


@pytest.mark.parametrize("trace", sorted(TRACES))
@pytest.mark.parametrize("policy", POLICIES)
def test_traces_are_served_bitwise(model, references, trace, policy):
    engine = Engine(model, policy=policy, block_size=8, budget=24, first_budget=25, interval=2)
    hits = 0
    for tokens in TRACES[trace]():
        result = engine.serve(tokens)
        hits += result.restore_point > 0
        assert result.replayed == len(tokens) - result.restore_point >= 1
        assert torch.equal(result.logits, references(tokens)[result.restore_point:]), (trace, policy, result)
    assert hits >= 3  # the later turns and branches did restore


def test_eviction_keeps_serving_bitwise(model, references):
    trace = TRACES["chat"]()
    engine = Engine(model, policy="free", block_size=8, budget=24, interval=1, max_snapshots=3, eviction="utility")
    for tokens in trace:
        result = engine.serve(tokens)
        assert torch.equal(result.logits, references(tokens)[result.restore_point:])
        assert len(engine.snapshots) == len(engine.cache) <= 3


def test_last_token_logits_engine(model, references):
    tokens = prompt(50, seed=5)
    engine = Engine(model, policy="inpass", block_size=8, budget=16, logits="last")
    engine.serve(tokens)
    warm = engine.serve(tokens)
    assert warm.restore_point == 48 and torch.equal(warm.logits, references(tokens)[-1:])


def test_a_request_the_planner_refuses_leaves_the_cache_as_it_was(model, monkeypatch):
    import planner.plan

    engine = Engine(model, policy="split", block_size=8, budget=16)
    first, second = prompt(40, seed=1), prompt(40, seed=2)
    engine.serve(first)
    engine.serve(second)
    before = (dataclasses.astuple(engine.cache.stats), engine.cache.handles())
    monkeypatch.setattr(planner.plan, "MAX_PASSES", 3)  # the extension of first needs more from its hit
    with pytest.raises(ValueError, match="raise budget"):
        engine.serve(first + prompt(60, seed=3))
    assert (dataclasses.astuple(engine.cache.stats), engine.cache.handles()) == before
    monkeypatch.undo()
    assert engine.serve(first + prompt(60, seed=3)).restore_point > 0  # first's snapshot is found and counted
    assert engine.cache.stats.lookups == before[0][0] + 1 and engine.cache.stats.hits == before[0][1] + 1


def test_engine_refuses_a_backend_that_cannot_run_on_the_model_s_device(monkeypatch):
    import ssm_kernels._triton

    model = HybridLM(CONFIG, backend="triton")  # on CPU: this process's kernels run through the interpreter
    monkeypatch.setattr(ssm_kernels._triton, "RUNS_ON_CPU", False)  # as in a process without it
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        Engine(model, policy="split", block_size=8, budget=16)


def test_engine_rejects_bad_rules(model):
    with pytest.raises(ValueError, match="policy"):
        Engine(model, policy="eager", block_size=8, budget=16)
    with pytest.raises(ValueError, match=r"logits must be one of \('all', 'last'\) \(what serve returns\), got 'some'"):
        Engine(model, policy="split", block_size=8, budget=16, logits="some")
    with pytest.raises(TypeError, match="model must be a HybridLM, got str"):
        Engine("model", policy="split", block_size=8, budget=16)
    engine = Engine(model, policy="split", block_size=8, budget=16)
    with pytest.raises(ValueError, match="at least 1 token"):
        engine.serve([])
    with pytest.raises(TypeError, match=r"tokens\[2\] must be an int token id, got 3.9"):
        engine.serve([1, 2, 3.9])
    with pytest.raises(TypeError, match="on_tokens must be a function"):
        engine.serve([1, 2], on_tokens=5)
    assert len(engine.cache) == 0 and engine.kv.blocks == 0  # nothing was served or stored
