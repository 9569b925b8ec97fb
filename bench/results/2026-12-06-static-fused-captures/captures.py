"""What 8 inner captures add to a pass, by the model's time and by the serial estimate, against
the time their own float32 bytes take at the model's HBM bandwidth: a Markdown row per pair of
calls (the same workload without and with "+ 8 captures", the same shape and size) found in the
reports given (one model version). PYTHONPATH=$PWD:$PWD/tools python
bench/results/2026-12-06-static-fused-captures/captures.py DIR/*.json"""
import json
import sys

from bench.static_calibration import call_serial
from bench.static_workloads import SHAPES, capture_offsets

CAPTURED = " + 8 captures"
reports = [json.load(open(path)) for path in sys.argv[1:]]
assert len({r["model_version"] for r in reports}) == 1, "one model version"
calls = {(c["workload"], c["shape"], c["size"]): (r, c) for r in reports for c in r["calls"]}
for (workload, shape, size), (report, with_captures) in sorted(calls.items()):
    if not workload.endswith(CAPTURED):
        continue
    plain_report, plain = calls[(workload[:-len(CAPTURED)], shape, size)]
    dims = SHAPES[shape]
    own_bytes = len(capture_offsets(size)) * dims.nheads * dims.headdim * dims.dstate * 4
    floor_us = own_bytes / report["gpu_model"]["hbm_bytes_per_s"] * 1e6
    added = (with_captures["time_ms"] - plain["time_ms"]) * 1e3
    added_serial = (call_serial(report, with_captures) - call_serial(plain_report, plain)) * 1e3
    print(f"| {workload[:-len(CAPTURED)]} | {shape} | {size} | {plain['time_ms']:.4f} | {with_captures['time_ms']:.4f} "
          f"| {added:+.1f} ({added / floor_us:.1f}x) | {added_serial:+.1f} ({added_serial / floor_us:.1f}x) "
          f"| {floor_us:.1f} |")
