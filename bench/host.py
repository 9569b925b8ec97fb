"""The engine ops' and the public scan's host work per layer call: python -m bench.host [--layers N] [--repeats N]
[--device D] [--out DIR]

Without a GPU (and on one: --device cuda, below). A serving step builds one PrefillBatch (or
DecodeBatch) and calls every layer's ops with it; on a GPU, what a call costs on the host
(validation, tables, views, the torch ops around the kernels, each Triton launch's argument
binding) is what the step pays beyond its kernels when the host is the bottleneck. Here every call
runs on CPU tensors, at a small layer shape so that the torch ops that do run on the CPU cost
little, with its Triton launches stubbed: for the times, each launch through JITFunction.run does
what it does for a compiled kernel before the driver call (the generated binder for sm_90a, the
cache key) and returns a stand-in for the compiled kernel, whose launcher a replayed launch
(ssm_kernels/_replay.py) calls and which does nothing; for the counts, a second pass
records the launches (triton_static.launches.recording) and the torch dispatches. Per op, for the
step's first layer, its second, its third and its later layers (an engine op's first two record
their launches and the later ones replay them): host time (median), the time from entry to the
first launch, launches, torch kernels and views dispatched, and allocations (outputs whose storage
no input shares); a step's batch is built before its layers (prefill_batch's own time is its own
row), from host lengths and captures as the vLLM plugin builds it, and the layers are called as the
plugin calls them: the first with validate=True, the later ones with validate=False. Each step is a
new prompt (other lengths). The public scans (`mamba2_scan` recurrent and chunked, `mamba1_scan`
chunked) and decode steps (`selective_state_update`, `causal_conv1d_update`) are called as a
model's layers call them (ssm_kernels.layers, the transformers adapters): every layer a whole
call, with new outputs; the chunked scan's later layers take the chunk tables the first one made;
each public call's second and third record their launches and the later ones replay them
(tables.recent_pass, _replay.run_public). A warm-up step first, so that one-time work (each
kernel's binder) is not counted.

Times are this machine's wall time per call without the driver's launch cost: compare ops and
layers within one run, not across machines. With --device cuda (on a GPU) the calls launch their
kernels and only the times are taken: a call's wall time is its host time, the launches
included (it returns before its kernels run); a replayed call's first launch is timed where it
asks for the stream. Results: host.json and host.md in --out (default
bench/results/<date>-host).
"""
from __future__ import annotations

from . import use_triton_interpreter

use_triton_interpreter(False)  # launches are recorded, never run; before the kernels are imported

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from unittest import mock  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402
from triton import knobs  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature  # noqa: E402
from triton_static.launches import TARGET, recording  # noqa: E402

from ssm_kernels import (cache_ops, causal_conv1d_update, mamba1_scan, mamba2_scan,  # noqa: E402
                         selective_state_update)
from ssm_kernels import _replay as replay  # noqa: E402

from .common import RESULTS_DIR, cpu_name, git_commit, markdown_table, save_results  # noqa: E402
from .static_workloads import triton_path_on_cpu  # noqa: E402
from .workloads import STANDARD_SHAPES, mamba2_inputs  # noqa: E402

# A small Mamba-2 / Mamba-1 layer: the host work does not depend on the sizes.
NHEADS, HEADDIM, NGROUPS, DSTATE, WIDTH = 8, 16, 1, 16, 4
LENGTHS = [64, 64, 48, 80]  # one prefill step: four rows
CHUNK = 16
START_POSITIONS = [32, 0, 16, 0]
CAPTURES = [(0, 16), (2, 40)]  # (row, offset)


class Dispatches(TorchDispatchMode):
    """The aten ops dispatched inside, the views among them, and the allocations: outputs whose
    storage no input shares (views and out= ops reuse their inputs' memory)."""

    def __init__(self):
        super().__init__()
        self.ops, self.views, self.allocations = [], 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self.ops.append(str(func))
        self.views += func.is_view
        self.allocations += [str(func) for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.numel()
                             and t.untyped_storage().data_ptr() not in given]
        return out


def _lengths(step: int) -> list[int]:
    """The rows' lengths at step `step`: each step a new prompt (its first row `step` tokens longer
    and its second as many shorter than LENGTHS, the tokens of a step unchanged)."""
    return [LENGTHS[0] + step, LENGTHS[1] - step, *LENGTHS[2:]]


def _batch_args(device, step: int = 0) -> tuple[tuple, dict]:
    """prefill_batch's arguments for one step as an engine gives them (the vLLM plugin): four rows,
    two captures, start positions; lengths and the captures' sequences and offsets on the host."""
    bounds = [0, *torch.tensor(_lengths(step)).cumsum(0).tolist()]
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    return (cu, torch.arange(len(LENGTHS), dtype=torch.int32, device=device)), dict(
        has_initial_state=torch.tensor([True, False, True, False], device=device),
        capture_seq=[s for s, _ in CAPTURES], capture_offset=[k for _, k in CAPTURES],
        capture_slot=torch.tensor([8, 9], device=device), nslots=16, validate=False,
        start_positions=START_POSITIONS, host_cu_seqlens=bounds)


def _step(device, step: int = 0):
    """One prefill step's and one decode step's batches, caches and a layer's inputs."""
    args, kwargs = _batch_args(device, step)
    nseq, ntok = len(LENGTHS), sum(LENGTHS)
    prefill = cache_ops.prefill_batch(*args, **kwargs)
    decode = cache_ops.decode_batch(args[1], validate=False)
    dim = NHEADS * HEADDIM
    conv_dim = dim + 2 * NGROUPS * DSTATE
    f = dict(device=device, dtype=torch.bfloat16)
    return dict(
        prefill=prefill, decode=decode, ntok=ntok, nseq=nseq,
        x=torch.randn(ntok, NHEADS, HEADDIM, **f), dt=torch.randn(ntok, NHEADS, **f),
        A=-torch.rand(NHEADS, device=device),
        B=torch.randn(ntok, NGROUPS, DSTATE, **f), C=torch.randn(ntok, NGROUPS, DSTATE, **f),
        D=torch.ones(NHEADS, device=device), dt_bias=torch.zeros(NHEADS, device=device),
        ssm2=torch.zeros(16, NHEADS, HEADDIM, DSTATE, **f), ssm1=torch.zeros(16, dim, DSTATE, **f),
        conv=torch.zeros(16, WIDTH - 1, conv_dim, **f).transpose(1, 2), xbc=torch.randn(conv_dim, ntok, **f),
        w=torch.randn(conv_dim, WIDTH, **f), u=torch.randn(dim, ntok, **f), delta=torch.randn(dim, ntok, **f),
        A1=-torch.rand(dim, DSTATE, device=device), B1=torch.randn(NGROUPS, DSTATE, ntok, **f),
        C1=torch.randn(NGROUPS, DSTATE, ntok, **f))


def calls(s) -> dict:
    """The ops measured, each a call of one layer on the step `s` (outputs allocated once, as an
    engine's are), taking `validate` as the vLLM plugin passes it: True for a step's first layer."""
    y2, y1, conv_out = torch.empty_like(s["x"]), torch.empty_like(s["u"]), torch.empty_like(s["xbc"])
    d = s["nseq"]  # decode: one token a row
    x2d, dt2d, B2d, C2d = (s[k][:d].clone() for k in ("x", "dt", "B", "C"))
    y2d = torch.empty_like(x2d)
    mamba2 = lambda algorithm: lambda validate: cache_ops.mamba2_prefill(
        s["prefill"], s["x"], s["dt"], s["A"], s["B"], s["C"], ssm_state=s["ssm2"], out=y2, D=s["D"],
        dt_bias=s["dt_bias"], dt_softplus=True, backend="triton", algorithm=algorithm, chunk_size=CHUNK,
        validate=validate)
    mamba1 = lambda algorithm: lambda validate: cache_ops.mamba1_prefill(
        s["prefill"], s["u"], s["delta"], s["A1"], s["B1"], s["C1"], ssm_state=s["ssm1"], out=y1,
        delta_softplus=True, backend="triton", algorithm=algorithm, chunk_size=CHUNK, validate=validate)
    return {
        "mamba2_prefill recurrent": mamba2("recurrent"),
        "mamba2_prefill chunked": mamba2("chunked"),
        "mamba1_prefill recurrent": mamba1("recurrent"),
        "mamba1_prefill chunked": mamba1("chunked"),
        "conv_prefill": lambda validate: cache_ops.conv_prefill(
            s["prefill"], s["xbc"], s["w"], conv_state=s["conv"], out=conv_out, activation="silu", backend="triton",
            validate=validate),
        "mamba2_decode": lambda validate: cache_ops.mamba2_decode(
            s["decode"], x2d, dt2d, s["A"], B2d, C2d, ssm_state=s["ssm2"], out=y2d,
            D=s["D"], dt_bias=s["dt_bias"], dt_softplus=True, backend="triton", validate=validate),
        **public_calls(s),
    }


def public_calls(s) -> dict:
    """The public scans as a model's layers call them (ssm_kernels.layers, the transformers adapters):
    each layer a pass over the step's sequences (cu_seqlens on the device, initial states, the
    step's two captures, the rows' start positions), new outputs each call; and the decode steps
    of one token a sequence, the scan's on a float32 state and the conv's, a slot a sequence,
    updated in place; no `validate`."""
    packed = {k: s[k].unsqueeze(0) for k in ("x", "dt", "B", "C")}
    seqs = s["prefill"].seqs
    initial = torch.zeros(seqs.count, NHEADS, HEADDIM, DSTATE, device=s["x"].device)
    mamba2 = lambda algorithm: lambda validate: mamba2_scan(
        packed["x"], packed["dt"], s["A"], packed["B"], packed["C"], D=s["D"], dt_bias=s["dt_bias"],
        dt_softplus=True, initial_states=initial, cu_seqlens=seqs.cu_seqlens, capture=CAPTURES, backend="triton",
        algorithm=algorithm, chunk_size=CHUNK, start_positions=START_POSITIONS)
    d = seqs.count
    state, conv_state = torch.zeros_like(initial), s["conv"][:d].clone()
    decode = lambda validate: selective_state_update(
        state, s["x"][:d], s["dt"][:d], s["A"], s["B"][:d], s["C"][:d], D=s["D"], dt_bias=s["dt_bias"],
        dt_softplus=True, backend="triton")
    conv_step = lambda validate: causal_conv1d_update(s["xbc"][:, :d].T, conv_state, s["w"], activation="silu",
                                                      backend="triton")
    packed1 = {k: s[k].unsqueeze(0) for k in ("u", "delta", "B1", "C1")}
    mamba1 = lambda validate: mamba1_scan(
        packed1["u"], packed1["delta"], s["A1"], packed1["B1"], packed1["C1"], delta_softplus=True,
        cu_seqlens=seqs.cu_seqlens, capture=CAPTURES, backend="triton", algorithm="chunked", chunk_size=CHUNK,
        start_positions=START_POSITIONS)
    return {"mamba2_scan recurrent": mamba2("recurrent"), "mamba2_scan chunked": mamba2("chunked"),
            "mamba1_scan chunked": mamba1, "selective_state_update": decode, "causal_conv1d_update": conv_step}


def scan_at_2p7b(algorithm: str):
    """The public scan as bench.scan calls it at Mamba-2 2.7B (80 heads x 64, dstate 128, one
    group), 8192 tokens, batch 1, bfloat16, as a layer call (for the host-time comparisons under
    bench/results)."""
    inp = mamba2_inputs(STANDARD_SHAPES[0], 8192, torch.device("cpu"))
    return lambda validate: mamba2_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], D=inp["D"], dt_softplus=True,
                                        backend="triton", algorithm=algorithm)


def public_cases() -> dict:
    """The public calls the host-time comparisons under bench/results time: this bench's layer
    calls, and bench.scan's at 2.7B, chunked and recurrent."""
    layer = calls(_step(torch.device("cpu")))
    return {"bench.host's mamba2_scan chunked": layer["mamba2_scan chunked"],
            "bench.host's mamba2_scan recurrent": layer["mamba2_scan recurrent"],
            "bench.host's mamba1_scan chunked": layer["mamba1_scan chunked"],
            "bench.host's selective_state_update": layer["selective_state_update"],
            "bench.host's causal_conv1d_update": layer["causal_conv1d_update"],
            "2.7B, 8192 tokens, chunked": scan_at_2p7b("chunked"),
            "2.7B, 8192 tokens, recurrent": scan_at_2p7b("recurrent")}


def timed_blocks(cases: dict, modes: dict, blocks: int, calls: int, warmup: int) -> None:
    """Per case (name: a layer call), `warmup` calls, then `blocks` rounds of `calls` calls in each
    mode (name: a context manager factory) in turn, with launches stubbed; prints each mode's median
    us and their ratio, the first mode over the second."""
    with launches_stubbed():
        for name, call in cases.items():
            for _ in range(warmup):
                call(False)
            times = {mode: [] for mode in modes}
            for _ in range(blocks):
                for mode, within in modes.items():
                    with within():
                        times[mode] += [_timed(lambda: call(False))[0] for _ in range(calls)]
            (a, ta), (b, tb) = ((mode, statistics.median(t)) for mode, t in times.items())
            print(f"{name}: {a} {ta:.0f} us, {b} {tb:.0f} us, {a} / {b} {ta / tb:.2f} "
                  f"(medians of {blocks * calls} calls each)")


def replay_ab(blocks: int = 20, calls: int = 10) -> None:
    """The public calls' host time (public_cases) with their launches replayed and with the replay
    bypassed (each call runs its host code and Triton's argument binding), timed_blocks in one run,
    every call after three like it (a model's fourth and later layers)."""
    torch.set_num_threads(1)
    bypassed = lambda: mock.patch.object(replay, "run", lambda launches, op, tensors, call, fresh=False: call())
    # warm-up: a plain call, two recordings, a replay; each kernel's binder
    timed_blocks(public_cases(), {"replayed": contextlib.nullcontext, "not replayed": bypassed}, blocks, calls,
                 warmup=4)


_BACKEND = make_backend(TARGET)
_binders: dict = {}
_first_launch: list[float] = []  # when the call being timed launched first


class _Compiled:
    """What a compiled kernel holds for its launch, the launch a no-op (a replay's launch,
    replay.py, calls it as it calls a CompiledKernel's)."""

    function, packed_metadata = 0, b""

    def run(self, *args):
        if not _first_launch:
            _first_launch.append(time.perf_counter())

    def launch_metadata(self, grid, stream, *args):
        return None


def _bind(fn: JITFunction, args, kwargs):
    """JITFunction.run's work on a compiled kernel before the driver launches it (its binder found
    by device, here by the kernel's id, not by hashing the kernel); returns the kernel's stand-in."""
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    binder = _binders.get(id(fn))
    if binder is None:
        binder = _binders[id(fn)] = (create_function_from_signature(fn.signature, fn.params, _BACKEND), {}, _Compiled())
    _, specialization, options = binder[0](*args, **kwargs)
    compute_cache_key(binder[1], specialization, options)
    binder[2].run()
    return binder[2]


@contextlib.contextmanager
def launches_stubbed():
    """Inside, a Triton launch binds its arguments as a real launch does and returns; a replayed
    one calls the stand-in's launch."""
    def run(self, *args, grid, warmup, **kwargs):
        return _bind(self, args, kwargs)
    with triton_path_on_cpu(), mock.patch.object(JITFunction, "run", run), \
            mock.patch.object(replay, "_stream", lambda: 0):
        yield


@contextlib.contextmanager
def launches_on_gpu():
    """Inside, the calls launch their kernels; a replayed call's first launch is timed where it
    asks for the stream, just before it."""
    real = replay._stream

    def stream():
        if not _first_launch:
            _first_launch.append(time.perf_counter())
        return real()
    with mock.patch.object(replay, "_stream", stream):
        yield


def _timed(call) -> tuple[float, float]:
    """(us the call took, us from its entry to its first launch)."""
    _first_launch.clear()
    began = time.perf_counter()
    call()
    ended = time.perf_counter()
    return (ended - began) * 1e6, ((_first_launch or [ended])[0] - began) * 1e6


def _counted(call) -> dict:
    launches = []
    with triton_path_on_cpu(), recording(launches), Dispatches() as seen:
        call()
    return {"launches": len(launches), "torch_kernels": len(seen.ops) - seen.views, "views": seen.views,
            "allocations": len(seen.allocations)}


# A step's layers: an engine op's first (validated, recorded), second (recorded again) and later ones
# (replayed where the two recordings agree); the public scan's first (run as it is), second and third
# (recorded) and later ones (replayed).
LAYERS = {"first": slice(0, 1), "second": slice(1, 2), "third": slice(2, 3), "later": slice(3, None)}


def measure(layers: int, repeats: int, device: torch.device) -> list[dict]:
    """Per op: a warm-up step, then `repeats` steps of `layers` layer calls each, every step with
    a fresh batch, timed; then, on CPU, one step counted."""
    rows = []
    args, kwargs = _batch_args(device)
    batch_us = [_timed(lambda: cache_ops.prefill_batch(*args, **kwargs))[0] for _ in range(repeats + 1)][1:]
    rows.append({"op": "prefill_batch (once a step)", "first": {"us": statistics.median(batch_us)}})
    on_gpu = device.type == "cuda"
    for name in calls(_step(device)):
        timed = []
        with launches_on_gpu() if on_gpu else launches_stubbed():
            for step in range(repeats + 1):
                replay._public.clear()  # each step a new model's layers, as the chunk tables
                call = calls(_step(device, step))[name]
                timed.append([_timed(lambda: call(layer == 0)) for layer in range(layers)])
                if on_gpu:
                    torch.cuda.synchronize()
        timed = timed[1:]  # the first step warms up
        counts = [{}] * layers
        if not on_gpu:
            replay._public.clear()
            call = calls(_step(device, repeats + 1))[name]  # a new step's, as the timed ones
            counts = [_counted(lambda: call(layer == 0)) for layer in range(layers)]
        row = {"op": name}
        for part, span in LAYERS.items():
            times = [t for step in timed for t in step[span]]
            row[part] = {"us": statistics.median(t for t, _ in times),
                         **{k: max(c[k] for c in counts[span]) for k in counts[0]}}
        row["later"]["first_launch_us"] = statistics.median(f for step in timed for _, f in step[LAYERS["later"]])
        rows.append(row)
    return rows


def markdown(rows: list[dict], env: dict) -> str:
    how = ("GPU, launched: a call returns before its kernels run" if env["device"] == "cuda"
           else "CPU, Triton launches stubbed after binding")
    header = (f"Host work per layer call ({how}; {env['cpu']}, "
              f"commit {env['commit']}, {env['date']}): a step of {env['layers']} layers, "
              f"{env['repeats']} steps; time is the median, counts the largest. An engine op's first layer "
              f"validates; its first two record their launches, the later ones replay them. The public "
              f"calls' layers are whole calls (the chunked scan's later ones on the first one's chunk tables), "
              f"each step a new model's: their second and third record their launches and the later ones "
              f"replay them with new scratch.\n\n")
    body = [[r["op"], *(f"{r[k]['us']:.0f}" if k in r else "" for k in LAYERS),
             f"{r['later']['first_launch_us']:.0f}" if "later" in r else "",
             *(r["later"].get(c, "") if "later" in r else "" for c in ("launches", "torch_kernels", "views",
                                                                         "allocations")),
             r["first"].get("allocations", "")] for r in rows]
    columns = ["op", "first layer us", "second layer us", "third layer us", "later layers us",
               "later: first launch after us",
               "launches", "torch kernels", "views", "allocations", "first layer's allocations"]
    return header + markdown_table(columns, body) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.host", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8, help="layer calls per step (default 8)")
    parser.add_argument("--repeats", type=int, default=5, help="steps per op (default 5)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu (default): launches stubbed, with counts; cuda: launched on the GPU, times only")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results/<date>-host)")
    args = parser.parse_args(argv)
    if args.layers < 4 or args.repeats < 1:
        parser.error("--layers must be at least 4 and --repeats at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU")
    torch.set_num_threads(1)
    rows = measure(args.layers, args.repeats, torch.device(args.device))
    env = {"cpu": torch.cuda.get_device_name() if args.device == "cuda" else cpu_name(), "device": args.device,
           "commit": git_commit().get("commit", "unknown")[:12], "torch": torch.__version__,
           "date": datetime.date.today().isoformat(), "layers": args.layers, "repeats": args.repeats}
    out = args.out or RESULTS_DIR / f"{env['date']}-host"
    save_results(out, "host", {"environment": env, "rows": rows}, markdown(rows, env))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
