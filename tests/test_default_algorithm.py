"""mamba2_scan's and mamba1_scan's default algorithm is "auto": the recurrent scan's bits on CPU,
and the chunked path on CUDA from the path's AUTO_CHUNKED_MIN_TOKENS tokens.

No CUDA is needed: the rule is checked on torch.device("cuda") directly, and a spy on the rule
shows what a call without `algorithm` asks for and what it would get on CUDA for that pass."""
import pytest
import torch

from helpers import mamba1_inputs, mamba1_positional, mamba2_inputs, mamba2_positional
from ssm_kernels import mamba1_scan, mamba2_scan
from ssm_kernels._common import Sequences
from ssm_kernels.scan import mamba1_chunked, mamba2_chunked

# (scan, its chunked path, inputs of `tokens` tokens as (positional, keyword))
SCANS = {
    "mamba2": (mamba2_scan, mamba2_chunked, lambda tokens: mamba2_positional(mamba2_inputs(1, tokens))),
    "mamba1": (mamba1_scan, mamba1_chunked, lambda tokens: mamba1_positional(mamba1_inputs(1, tokens))),
}


def sequences(lengths):
    cu = torch.tensor([0] + torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist())
    return Sequences(cu, lengths, varlen=True)


@pytest.mark.parametrize("name", SCANS)
def test_auto_rule_per_path(name):
    """Chunked on CUDA from the threshold in the longest sequence; recurrent below it, for an
    empty pass and for CPU tensors; a named algorithm is taken as given."""
    _, path, _ = SCANS[name]
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    least = path.AUTO_CHUNKED_MIN_TOKENS
    assert path.resolve_algorithm("auto", cuda, sequences([1, least, 0])) == "chunked"
    assert path.resolve_algorithm("auto", cuda, sequences([least - 1, 2])) == "recurrent"
    assert path.resolve_algorithm("auto", cuda, sequences([])) == "recurrent"
    assert path.resolve_algorithm("auto", cpu, sequences([least])) == "recurrent"
    assert path.resolve_algorithm("recurrent", cuda, sequences([least])) == "recurrent"


@pytest.mark.parametrize("name", SCANS)
def test_default_is_auto(name, monkeypatch):
    """A call without `algorithm` asks the rule for "auto": on CUDA this pass (one sequence at the
    threshold) would run chunked; on CPU it runs the recurrent scan, bit for bit."""
    scan, path, make = SCANS[name]
    rule, asked = path.resolve_algorithm, []

    def spy(algorithm, device, seqs):
        asked.append((algorithm, rule(algorithm, torch.device("cuda"), seqs)))
        return rule(algorithm, device, seqs)

    args, kw = make(path.AUTO_CHUNKED_MIN_TOKENS)
    kw["capture"] = [(0, 5)]
    recurrent = scan(*args, **kw, backend="torch", algorithm="recurrent")
    monkeypatch.setattr(path, "resolve_algorithm", spy)
    default = scan(*args, **kw, backend="torch")
    assert asked == [("auto", "chunked")]
    for want, got in zip(recurrent, default):
        assert torch.equal(want, got)


def test_layers_keep_the_recurrent_scan(monkeypatch):
    """The mixers' passes continue each other bit for bit at any split, so they ask for the
    recurrent scan, not the scans' "auto" default, unless told otherwise."""
    from ssm_kernels import Mamba1Mixer, Mamba2Mixer

    asked = []

    def spy(rule):
        def resolve(algorithm, device, seqs):
            asked.append(algorithm)
            return rule(algorithm, device, seqs)
        return resolve

    for path in (mamba2_chunked, mamba1_chunked):
        monkeypatch.setattr(path, "resolve_algorithm", spy(path.resolve_algorithm))
    torch.manual_seed(0)
    mixers = (Mamba2Mixer(hidden_size=32, num_heads=4, head_dim=8, state_size=8),
              Mamba1Mixer(hidden_size=32, intermediate_size=32, state_size=8))
    with torch.no_grad():
        for mixer in mixers:
            mixer.eval()(torch.randn(1, 9, 32), capture=[(0, 4)])
    assert asked == ["recurrent", "recurrent"]
