"""The public chunked scan's host time per call with and without the replay of its launches, in one
run: python bench/results/2026-12-04-host-replay-public/replay_ab.py (from the repository root, with
tools/ on PYTHONPATH). bench.host's layer call (`mamba2_scan chunked`, launches stubbed after
binding) and the bench.scan row at Mamba-2 2.7B, 8192 tokens, batch 1, bfloat16, timed in
alternating blocks, every call after three like it (a model's fourth and later layers), its chunk
tables and capture table those of the calls before (tables.recent_pass): "replayed", as the scan
runs; "not replayed", the same calls with the replay bypassed (each runs the stages' host code
and Triton's argument binding), as every call ran before it. Since 2026-12-05 the other public
calls replay too and this runs bench.host.replay_ab, whose cases include them
(bench/results/2026-12-05-host-replay-recurrent); replay_ab.txt holds this run's four rows."""
from bench import host

if __name__ == "__main__":
    host.replay_ab()
