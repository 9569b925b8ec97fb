"""The public calls' host time with and without the replay of their launches, in one run: python
bench/results/2026-12-05-host-replay-recurrent/replay_ab.py (from the repository root, with tools/
on PYTHONPATH). bench.host's layer calls (`mamba2_scan` chunked and recurrent, `mamba1_scan`
chunked, the `selective_state_update` and `causal_conv1d_update` decode steps; launches stubbed
after binding) and the bench.scan rows at Mamba-2 2.7B, 8192 tokens, batch 1, bfloat16, timed in
20 alternating blocks of 10 calls, every call after three like it (a model's fourth and later
layers): "replayed", as the calls run; "not replayed", the same calls with the replay bypassed
(bench.host.replay_ab)."""
from bench import host

if __name__ == "__main__":
    host.replay_ab()
