"""The fused pass's rows of --no-peers reports (arguments) against the peer and the five stages of
bench/results/2026-12-06-static-fused (the same model version, the same peer): a Markdown row per
shape. PYTHONPATH=$PWD:$PWD/tools python bench/results/2026-12-06-static-fused-chunk-programs/ratios.py *.json"""
import json
import sys

from bench.static_calibration import call_serial

OLD = json.load(open("bench/results/2026-12-06-static-fused/static.json"))


def find(data, workload, shape):
    return next(c for c in data["calls"] if c["workload"] == workload and c["shape"] == shape and c["size"] == 8192)


for path in sys.argv[1:]:
    new = json.load(open(path))
    assert new["model_version"] == OLD["model_version"], (new["model_version"], OLD["model_version"])
    for c in new["calls"]:
        if c["workload"] != "mamba2_scan chunked, fused":
            continue
        before, five = find(OLD, c["workload"], c["shape"]), find(OLD, "mamba2_scan chunked", c["shape"])
        peer, peer_serial = before["peer"]["time_ms"], call_serial(OLD, before, True)
        serial, serial_before = call_serial(new, c), call_serial(OLD, before)
        print(f"| {c['shape']} | {c['time_ms']:.3f}, {serial:.3f} | {c['time_ms'] / peer:.2f}, {serial / peer_serial:.2f} | "
              f"{before['time_ms']:.3f}, {serial_before:.3f} ({before['time_ms'] / peer:.2f}, "
              f"{serial_before / peer_serial:.2f}) | {five['time_ms'] / peer:.3f}, {call_serial(OLD, five) / peer_serial:.3f} "
              f"| {peer:.3f}, {peer_serial:.3f} |")
