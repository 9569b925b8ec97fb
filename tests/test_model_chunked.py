"""The hybrid model on the chunked scan, served with the planner's grid: passes start and
snapshots sit on multiples of the chunk size, so every warm request is bit-identical to one cold
pass, as on the recurrent scan; without the grid, warm restores off it are only close."""
import pytest
import torch

from helpers import assert_rel_close
from planner import POLICIES, multi_turn_chat
from ssm_serving import Engine, HybridConfig, HybridLM
from ssm_serving.demo import Incident

CHUNK = 16
CONFIG = HybridConfig(vocab_size=64, hidden_size=32, num_layers=3, attention_every=2, num_attention_heads=2,
                      mamba_heads=2, mamba_head_dim=32, state_size=8, mlp_size=48, seed=3,
                      scan_algorithm="chunked", chunk_size=CHUNK)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: token-sized ops, one thread


@pytest.fixture(scope="module", params=["torch", "triton"])
def model(request, device):
    return HybridLM(CONFIG, backend=request.param, device=device)


def prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist()


def test_scan_grid_follows_the_algorithm():
    assert CONFIG.scan_grid == CHUNK
    assert HybridConfig().scan_grid == 1
    assert HybridConfig(scan_algorithm="chunked").scan_grid == 256
    with pytest.raises(ValueError, match="scan_algorithm must be 'recurrent' or 'chunked', got 'auto'"):
        HybridConfig(scan_algorithm="auto")
    with pytest.raises(ValueError, match="chunk_size must be a power of two"):
        HybridConfig(scan_algorithm="chunked", chunk_size=24)


@pytest.mark.parametrize("policy", POLICIES)
def test_incident_on_the_grid_is_bitwise(model, policy):
    """The incident at 1/256 scale (budget 32, first chunk 33, 132 tokens, block 16), chunk 16."""
    incident = Incident(256)
    tokens = prompt(incident.total, seed=7)
    reference = model.prefill(tokens)
    engine = Engine(model, policy=policy, **incident.rules())
    cold = engine.serve(tokens)
    warm = engine.serve(tokens)
    assert all(start % CHUNK == 0 for start, _ in cold.passes + warm.passes)
    assert all(position % CHUNK == 0 for position in cold.snapshots)
    # the match, 128, is a grid point; split cuts its last chunk at the tail split point, 112
    assert (warm.restore_point, warm.replayed) == ((112, 20) if policy == "split" else (128, 4))
    assert torch.equal(cold.logits, reference)
    assert torch.equal(warm.logits, reference[warm.restore_point:])


def test_chat_trace_on_the_grid_is_bitwise(model):
    trace = multi_turn_chat(conversations=1, turns=3, system_tokens=40, message_tokens=(3, 20),
                            reply_tokens=(3, 20), vocab_size=CONFIG.vocab_size, seed=1)
    engine = Engine(model, policy="free", block_size=8, budget=32, interval=2)
    hits = 0
    for tokens in trace:
        result = engine.serve(tokens)
        hits += result.restore_point > 0
        assert result.restore_point % CHUNK == 0
        assert torch.equal(result.logits, model.prefill(tokens)[result.restore_point:])
    assert hits >= 2


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_shorter_prompt_served_first_leaves_warm_requests_bitwise(backend, device):
    """Q ends inside A's first chunk: its KV there came from a partly filled chunk (other rounding
    than a full one), which a later request restoring past it (B, at A's capture 16) must not
    take in place of A's."""
    model = HybridLM(HybridConfig(vocab_size=8, hidden_size=32, num_layers=2, attention_every=2,
                                  num_attention_heads=2, mamba_heads=2, mamba_head_dim=32, state_size=8,
                                  mlp_size=32, seed=1, scan_algorithm="chunked", chunk_size=CHUNK), backend=backend,
                     device=device)
    a = [0, 4, 3, 6, 1, 5, 6, 7, 4, 1, 3, 3, 2, 2, 3, 0, 0, 1, 1, 0, 4, 3, 7, 4]
    b = a + [5, 7, 5, 1, 0, 0, 4, 6, 1, 0, 7, 7, 5, 5, 6]
    engine = Engine(model, policy="free", block_size=1, budget=40)
    engine.serve(a[:10])
    engine.serve(a)
    warm = engine.serve(b)
    assert warm.restore_point == 16
    assert torch.equal(warm.logits, model.prefill(b)[16:])


def test_blocks_that_are_not_multiples_of_the_grid_are_bitwise(model):
    """Block 10, grid 16: the snapshot at 32 sits inside the block [30, 40), whose KV rows from 32
    on are not final after a 45-token prompt (its chunk [32, 48) is partly filled); a longer
    prompt computes them in a full chunk, and its continuation's restore at 64 reads them."""
    a = prompt(45, seed=4)
    b = a + prompt(25, seed=5)
    engine = Engine(model, policy="legacy", block_size=10, budget=32, interval=1)
    engine.serve(a)
    for tokens, restore_point in ((a, 32), (b, 32), (b + [1, 2, 3], 64)):
        warm = engine.serve(tokens)
        assert warm.restore_point == restore_point
        assert torch.equal(warm.logits, model.prefill(tokens)[restore_point:])


def test_budget_below_the_grid_is_refused(model):
    with pytest.raises(ValueError, match=r"budget \(12\) must be at least the grid \(16\)"):
        Engine(model, policy="split", block_size=4, budget=12)


def test_off_the_grid_restores_are_close_not_bitwise(model):
    """grid=1 on the chunked scan: the restore at 72 (block 8) is between chunk boundaries."""
    tokens = prompt(77, seed=2)
    reference = model.prefill(tokens)
    engine = Engine(model, policy="inpass", block_size=8, budget=24, grid=1)
    engine.serve(tokens)
    warm = engine.serve(tokens)
    assert warm.restore_point == 72
    assert_rel_close(warm.logits, reference[72:].double(), 1e-4, "warm logits off the grid")
