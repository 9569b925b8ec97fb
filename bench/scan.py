"""Scan benchmarks: ``python -m bench.scan [--reduced] [--quick] [--out DIR] [--time-budget S]
[--seqlens N ...] [--sections A,B] [--no-varlen]``. Sections, the most wanted first (a time budget
cuts the rest: the longer passes at batch 1, captures and the grid split, then the rest):

1. copy bandwidth (the roofline's denominator, see bench.workloads);
2. scan passes: mamba2_scan / mamba1_scan at the standard layer shapes, batch 1 and a varlen
   batch of 16 mixed lengths (the same total tokens), per backend and algorithm (for mamba2_scan
   also the chunked scan on its fused pass, opt-in in the library), and the peers at the same
   inputs (their outputs checked against ours first);
3. algorithm crossover: recurrent against chunked over pass lengths;
4. capture overhead: one pass with 0, 1, 8 and 64 captures spread evenly, and (chunked) 8 at chunk
   starts ("8 grid");
5. in-pass capture against two passes split at the tail split point (planner.tail_split_point);
6. grid split (chunked, and on the fused pass): one pass against two passes split at a multiple
   of the chunk size, timed, and whether y and the final state are bit-identical (the chunked
   scan's grid guarantee, checked on the compiled kernels when run on a GPU);
7. decode: selective_state_update at batch 1 .. 256, and the peers' decode steps.

Outputs under --out: scan.json (every figure, the environment, the peers' status), scan.md,
scan_throughput.png (tokens/s against sequence length per kernel, with the roofline),
scan_decode.png. Without CUDA everything runs reduced and is labelled CPU.
"""
from __future__ import annotations

import argparse
import inspect
import sys
import time
from dataclasses import dataclass, field

from torch import equal as torch_equal

from . import use_triton_interpreter

use_triton_interpreter()  # the interpreter without CUDA; before Triton and the kernels are imported
from . import common, peers as peers_mod, report, workloads as wl  # noqa: E402
from .common import Budget, Terminated, TimingOptions, time_fn  # noqa: E402
import ssm_kernels  # noqa: E402
from planner import tail_split_point  # noqa: E402
from ssm_kernels.scan.mamba2_chunked import ALGORITHMS, AUTO_CHUNKED_MIN_TOKENS, DEFAULT_CHUNK_SIZE  # noqa: E402
from ssm_kernels.scan.reference import rel_error  # noqa: E402

try:  # the fused chunked pass (opt-in), measured beside the five stages where the library has it
    from ssm_kernels.scan.mamba2_chunked.triton_kernel import fused_pass
except ImportError:
    fused_pass = None

ELT = 2  # bfloat16 inputs
CHECK_TOLERANCE = 5e-2  # a peer whose y differs from ours by more (RMS-relative) is flagged


def failed(*errors) -> dict:
    """The status and note of a row whose measurements failed or were skipped."""
    errors = [e for e in errors if e]
    return dict(status=errors[0].split(":")[0], note="; ".join(errors))


def algorithms(fn) -> list[str]:
    """The algorithms to measure for `fn`: "recurrent", plus "chunked" when `fn` takes an
    `algorithm` keyword and the library has it ("auto" runs one of the two), and for mamba2_scan
    "fused" (chunked, its stages 2 to 5 fused into one launch) where the library has that."""
    if "algorithm" not in inspect.signature(fn).parameters or "chunked" not in ALGORITHMS:
        return ["recurrent"]
    return ["recurrent", "chunked"] + (["fused"] if fn is ssm_kernels.mamba2_scan and fused_pass else [])


def on_the_fused_pass(call):
    """`call` run with the fused chunked pass in place of the five stages."""
    def run():
        with fused_pass():
            return call()
    return run


@dataclass
class Config:
    reduced: bool
    quick: bool
    cuda: bool
    shapes: tuple = ()
    seqlens: tuple = ()
    decode_batches: tuple = ()
    capture_counts: tuple = (1, 8, 64)
    capture_seqlen: int = 8192
    crossover_lengths: tuple = ()
    block_size: int = 16
    chunk_size: int | None = None
    interp_seqlen: int = 32
    interp_shapes: tuple = ()
    timing: TimingOptions = field(default_factory=TimingOptions)

    @classmethod
    def make(cls, reduced: bool, quick: bool, cuda: bool) -> "Config":
        if not reduced:
            return cls(reduced, quick, cuda, wl.STANDARD_SHAPES,
                       wl.STANDARD_SEQLENS[:2] if quick else wl.STANDARD_SEQLENS,
                       wl.DECODE_BATCHES[::2] if quick else wl.DECODE_BATCHES,
                       capture_seqlen=8192, crossover_lengths=(16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
                       timing=TimingOptions(warmup_ms=10, rep_ms=25 if quick else 50, max_rep_ms=1000))
        # Reduced: block 8 so that the interpreter's 32-token passes have a tail split point.
        return cls(reduced, quick, cuda, wl.REDUCED_SHAPES,
                   wl.REDUCED_SEQLENS[:2] if quick else wl.REDUCED_SEQLENS, wl.REDUCED_DECODE_BATCHES,
                   capture_seqlen=128, crossover_lengths=(16, 32, 64, 128), block_size=8, chunk_size=16,
                   timing=TimingOptions(warmup_ms=5, rep_ms=20, max_rep_ms=200, cpu_runs=5),
                   # The interpreter is slow (milliseconds per program and token): it runs the first
                   # shape of each layout only, which covers every code path of the kernels, and one
                   # sequence a pass (a varlen batch of 16 took most of a dry run, 47 s for Mamba-1's
                   # chunked kernel; the tests run every kernel on varlen batches).
                   interp_shapes=(wl.REDUCED_SHAPES[0].name, wl.REDUCED_SHAPES[3].name))

    def backends(self, shape=None):
        """(backend argument, label, single interpreted run) per backend to run for `shape`."""
        if self.cuda:
            return [("triton", "triton", False)]
        interp = shape is None or shape.name in self.interp_shapes
        return [("torch", "torch", False)] + ([("triton", "triton-interpreter", True)] if interp else [])

    def record(self) -> dict:
        return {"shapes": [dict(vars(s)) for s in self.shapes], "seqlens": list(self.seqlens),
                "varlen_sequences": wl.VARLEN_SEQUENCES, "decode_batches": list(self.decode_batches),
                "capture_counts": list(self.capture_counts), "capture_seqlen": self.capture_seqlen,
                "crossover_lengths": list(self.crossover_lengths), "block_size": self.block_size,
                "auto_chunked_min_tokens_modelled": AUTO_CHUNKED_MIN_TOKENS,
                "chunk_size": self.chunk_size, "dtype": "bfloat16", "interpreter_seqlen": self.interp_seqlen,
                "interpreter_shapes": list(self.interp_shapes),
                "timing": vars(self.timing), "peer_max_seqlen": {f"{p}/{k}": v for (p, k), v in
                                                                  peers_mod.MAX_SEQLEN.items()}}


class ScanBench:
    def __init__(self, args, device):
        self.device = device
        self.cfg = Config.make(args.reduced or device.type != "cuda", args.quick, device.type == "cuda")
        if args.seqlens:
            self.cfg.seqlens = tuple(sorted(set(args.seqlens)))
        self.varlen = not args.no_varlen
        self.sections = set(args.sections) if args.sections else None
        self.budget = Budget(args.time_budget)
        self.out = common.output_dir(args, device)
        self.env = common.environment(device, reduced=self.cfg.reduced, quick=self.cfg.quick)
        self.peers = peers_mod.load_peers(device)
        self.algs = {"mamba2": algorithms(ssm_kernels.mamba2_scan), "mamba1": algorithms(ssm_kernels.mamba1_scan)}
        if args.no_fused:
            self.algs["mamba2"] = [alg for alg in self.algs["mamba2"] if alg != "fused"]
        self.bw = None
        self.peer_failures = {}
        self.results = {"benchmark": "scan", "label": self.env["label"], "env": self.env,
                        "config": self.cfg.record(), "algorithms": self.algs,
                        "peers": {name: p.record() for name, p in self.peers.items()},
                        "copy_bandwidth": None, "scan": [], "crossover": [], "captures": [],
                        "inpass_vs_split": [], "grid_split": [], "decode": [], "notes": [],
                        "incomplete": "did not finish (killed?)"}
        notes = self.results["notes"]
        notes.append("decode covers the Mamba-2 layers only: selective_state_update takes the Mamba-2 layout")
        if self.cfg.cuda:
            notes.append("ssm_kernels' PyTorch path (one token at a time, for CPU) is not timed on the GPU")
        else:
            notes.append(f"the Triton interpreter runs {', '.join(self.cfg.interp_shapes)} only, at "
                         f"{self.cfg.interp_seqlen} tokens, one sequence, one run each")

    # -- timing helpers ------------------------------------------------------------------------
    def timed(self, fn, interp=False):
        """(Timing, first result, None) or (None, None, why not)."""
        if self.budget.expired():
            return None, None, "skipped: time budget exhausted"
        try:
            timing, result = time_fn(fn, self.device, self.cfg.timing, single_cpu_run=interp)
        except Terminated:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed measurement is reported, not fatal
            common.release_memory(self.device)
            text = str(exc).strip().splitlines()
            return None, None, f"failed: {type(exc).__name__}: {text[0][:300] if text else ''}"
        return timing, result, None

    def fill(self, row, timing, error, nbytes, tokens):
        if timing is None:
            row.update(status=error.split(":")[0], note=error)
            return row
        roofline_ms = nbytes / (self.bw["GBps"] * 1e6)
        if timing.gpu_ms is not None:  # CUDA: the kernels alone, and the host's part of the call
            row.update(gpu_ms=timing.gpu_ms, gpu_roofline_fraction=roofline_ms / timing.gpu_ms, host_ms=timing.host_ms,
                       gpu_kernels=timing.gpu_kernels)
        row.update(status="ok", ms=timing.ms, samples=timing.samples, timing=timing.method, wall_s=timing.wall_s,
                   bytes=nbytes,
                   tokens=tokens, tokens_per_s=tokens / (timing.ms / 1e3), GBps=nbytes / (timing.ms * 1e6),
                   roofline_ms=roofline_ms, roofline_fraction=roofline_ms / timing.ms)
        return row

    def save(self):
        common.write_json(self.out / "scan.json", self.results)

    # -- our kernels -----------------------------------------------------------------------------
    def our_scan(self, shape, inp, backend, algorithm, cu=None, capture=None, initial_states=None,
                 start_positions=None):
        kw = dict(cu_seqlens=cu, capture=capture, initial_states=initial_states, backend=backend)
        if shape.kind == "mamba2":
            if start_positions is not None:
                kw["start_positions"] = start_positions
            if "algorithm" in inspect.signature(ssm_kernels.mamba2_scan).parameters:
                kw["algorithm"] = "chunked" if algorithm == "fused" else algorithm
                if kw["algorithm"] == "chunked" and self.cfg.chunk_size:
                    kw["chunk_size"] = self.cfg.chunk_size
            call = lambda: ssm_kernels.mamba2_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"],  # noqa: E731
                                                   D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=True, **kw)
            return on_the_fused_pass(call) if algorithm == "fused" else call
        if "algorithm" in inspect.signature(ssm_kernels.mamba1_scan).parameters:
            kw["algorithm"] = algorithm
        return lambda: ssm_kernels.mamba1_scan(inp["u"], inp["delta"], inp["A"], inp["B"], inp["C"], D=inp["D"],
                                               z=inp["z"], delta_bias=inp["delta_bias"], delta_softplus=True, **kw)

    def inputs(self, shape, ntokens):
        make = wl.mamba2_inputs if shape.kind == "mamba2" else wl.mamba1_inputs
        return make(shape, ntokens, self.device)

    def algs_on(self, shape, backend):
        """The algorithms measured for `shape` on `backend`: the fused pass is Triton's only."""
        return [alg for alg in self.algs[shape.kind] if alg != "fused" or backend == "triton"]

    def alg_label(self, algorithm):
        if algorithm in ("chunked", "fused"):
            fused = ", fused" if algorithm == "fused" else ""
            return f"chunked{fused} (chunk {self.cfg.chunk_size or 'default'})"
        return algorithm

    # -- sections --------------------------------------------------------------------------------
    def copy_bandwidth(self):
        self.bw = common.copy_bandwidth(self.device, self.cfg.timing)
        self.results["copy_bandwidth"] = self.bw

    def scan_shape(self, shape, seqlen, varlen):
        lengths = wl.varlen_lengths(seqlen) if varlen else [seqlen]
        cu = wl.cu_seqlens_of(lengths, self.device) if varlen else None
        inp = self.inputs(shape, seqlen)
        nbytes = wl.pass_bytes(shape, seqlen, len(lengths), ELT)
        base = dict(section="scan", model=shape.name, kind=shape.kind, dims=shape.describe(),
                    batch=f"varlen {len(lengths)}" if varlen else "1", seqlen=seqlen, nseq=len(lengths))
        if varlen:
            base["lengths"] = lengths
        reference = None
        for backend, label, interp in self.cfg.backends(shape):
            if interp and (seqlen > self.cfg.interp_seqlen or varlen):
                continue
            for alg in self.algs_on(shape, backend):
                row = dict(base, impl="ssm_kernels", op=f"{shape.kind}_scan", backend=label,
                           algorithm=self.alg_label(alg))
                timing, result, error = self.timed(self.our_scan(shape, inp, backend, alg, cu), interp)
                self.fill(row, timing, error, nbytes, seqlen)
                if result is not None:
                    if reference is None:
                        reference = (result.y, result.final_states)
                    else:
                        row["check_rel_err_y"] = rel_error(result.y, reference[0])
                self.results["scan"].append(row)
        for name in peers_mod.PEER_NAMES:
            self.scan_peer(name, shape, inp, cu, lengths, base, nbytes, reference)
        del inp, reference
        common.release_memory(self.device)
        self.save()

    def scan_peer(self, name, shape, inp, cu, lengths, base, nbytes, reference):
        peer = self.peers[name]
        entry = peers_mod.SCAN_ADAPTERS.get((name, shape.kind))
        if entry is None or not peer.available or entry[0] not in peer.ops:
            return
        op, adapter = entry
        row = dict(base, impl=name, op=op, backend="torch" if name == peers_mod.HF else "triton",
                   algorithm={peers_mod.MAMBA_SSM: "chunked (SSD, chunk 256)", peers_mod.FLA: "chunked (simple GLA)",
                              peers_mod.HF: "chunked (SSD, chunk 256)" if shape.kind == "mamba2"
                              else "recurrent (Python loop)"}[name])
        limit = peers_mod.MAX_SEQLEN.get((name, shape.kind))
        if limit is not None and base["seqlen"] > limit and not self.cfg.reduced:
            row.update(status="skipped", note=f"skipped: slow peer, run up to {limit} tokens (see bench.peers)")
            self.results["scan"].append(row)
            return
        earlier = self.peer_failures.get((name, shape.kind))
        if earlier:
            row.update(status="skipped", note=f"skipped: failed at an earlier shape ({earlier[:160]})")
            self.results["scan"].append(row)
            return
        try:
            fn, to_ours = adapter(peer, inp, cu, lengths)
        except NotImplementedError as exc:
            row.update(status="n/a", note=f"n/a: {exc}")
            self.results["scan"].append(row)
            return
        timing, result, error = self.timed(fn)
        self.fill(row, timing, error, nbytes, base["seqlen"])
        if error and error.startswith("failed") and "OutOfMemory" not in error:
            self.peer_failures[(name, shape.kind)] = error  # the same code will fail again: skip it
        if result is not None and reference is not None:
            try:
                y, states = to_ours(result)
                row["check_rel_err_y"] = rel_error(y.reshape(reference[0].shape), reference[0])
                row["check_rel_err_state"] = rel_error(states.reshape(reference[1].shape), reference[1])
                if not row["check_rel_err_y"] <= CHECK_TOLERANCE:
                    row["note"] = f"output differs from ours (RMS-relative {row['check_rel_err_y']:.2e})"
            except Exception as exc:  # noqa: BLE001
                row["note"] = f"check failed: {type(exc).__name__}: {exc}"
        self.results["scan"].append(row)

    def crossover(self):
        if "chunked" not in self.algs["mamba2"]:
            self.results["notes"].append("crossover: mamba2_scan has no chunked algorithm")
            return
        shape = self.cfg.shapes[0]
        backend, label, _ = self.cfg.backends()[0]
        for n in self.cfg.crossover_lengths:
            inp = self.inputs(shape, n)
            for alg in ("recurrent", "chunked"):
                row = dict(section="crossover", model=shape.name, backend=label, algorithm=self.alg_label(alg),
                           seqlen=n, batch="1")
                timing, _, error = self.timed(self.our_scan(shape, inp, backend, alg))
                self.results["crossover"].append(self.fill(row, timing, error, wl.pass_bytes(shape, n, 1, ELT), n))
        self.save()

    def capture_placements(self, seqlen, alg):
        """(label, offsets) of each capture row: none, then each count spread evenly over the pass;
        for the chunked scan also 8 at chunk starts spread over the pass ("8 grid", where a grid
        planner puts them; as bench.static_workloads places its grid captures)."""
        out = [(count, [round(seqlen * (i + 1) / (count + 1)) for i in range(count)])
               for count in (0, *self.cfg.capture_counts)]
        chunk = self.cfg.chunk_size or DEFAULT_CHUNK_SIZE
        if alg in ("chunked", "fused") and seqlen // chunk >= 8:
            out.append(("8 grid", [k * (seqlen // chunk) // 8 * chunk for k in range(8)]))
        return out

    def captures(self):
        for shape in self.cfg.shapes:
            for backend, label, interp in self.cfg.backends(shape):
                seqlen = self.cfg.interp_seqlen if interp else self.cfg.capture_seqlen
                inp = self.inputs(shape, seqlen)
                for alg in self.algs_on(shape, backend):
                    base = None
                    for count, offsets in self.capture_placements(seqlen, alg):
                        row = dict(section="captures", model=shape.name, kind=shape.kind, backend=label,
                                   algorithm=self.alg_label(alg), seqlen=seqlen, batch="1", captures=count)
                        if len(offsets) >= seqlen:
                            row.update(status="n/a", note=f"n/a: {count} captures in a {seqlen}-token pass")
                            self.results["captures"].append(row)
                            continue
                        fn = self.our_scan(shape, inp, backend, alg, capture=[(0, k) for k in offsets])
                        timing, _, error = self.timed(fn, interp)
                        self.fill(row, timing, error, wl.pass_bytes(shape, seqlen, 1, ELT, ncapture=len(offsets)),
                                  seqlen)
                        if timing is not None and count == 0:
                            base = timing
                        elif timing is not None and base:
                            row["vs_no_capture"] = timing.ms / base.ms
                            row["us_per_capture"] = (timing.ms - base.ms) * 1e3 / len(offsets)
                            if timing.gpu_ms is not None:
                                row["gpu_vs_no_capture"] = timing.gpu_ms / base.gpu_ms
                        self.results["captures"].append(row)
                inp = None  # free this batch's inputs before the next one allocates
        self.save()

    def inpass_vs_split(self):
        for seqlen in self.cfg.seqlens:
            split = tail_split_point(seqlen, self.cfg.block_size)
            if split is None:
                continue
            for shape in self.cfg.shapes:
                inp = self.inputs(shape, seqlen)
                first, second = self.halves(shape, inp, split)
                for backend, label, interp in self.cfg.backends(shape):
                    if interp and seqlen > self.cfg.interp_seqlen:
                        continue
                    for alg in self.algs_on(shape, backend):
                        row = dict(section="inpass_vs_split", model=shape.name, kind=shape.kind, backend=label,
                                   algorithm=self.alg_label(alg), seqlen=seqlen, batch="1", split=split,
                                   block_size=self.cfg.block_size)
                        (t1, _, e1), (t2, _, e2) = self.one_and_two_passes(
                            shape, inp, (first, second), split, backend, alg, interp, capture=[(0, split)])
                        row.update(one_pass_ms=t1.ms if t1 else None, two_passes_ms=t2.ms if t2 else None,
                                   one_pass_bytes=wl.pass_bytes(shape, seqlen, 1, ELT, ncapture=1),
                                   two_passes_bytes=wl.pass_bytes(shape, split, 1, ELT)
                                   + wl.pass_bytes(shape, seqlen - split, 1, ELT, initial_states=True),
                                   timing=(t1 or t2).method if (t1 or t2) else None)
                        if t1 and t2:
                            row.update(status="ok", ratio=t2.ms / t1.ms, extra_ms=t2.ms - t1.ms)
                        else:
                            row.update(failed(e1, e2))
                        self.results["inpass_vs_split"].append(row)
                del inp, first, second
                common.release_memory(self.device)
        self.save()

    def grid_split(self):
        """One chunked pass against two split at a grid point (the last multiple of the chunk
        size at or below the middle), the second given its absolute start: time and bitwise."""
        if "chunked" not in self.algs["mamba2"]:
            return
        chunk = self.cfg.chunk_size or DEFAULT_CHUNK_SIZE
        for seqlen in self.cfg.seqlens:
            split = seqlen // 2 // chunk * chunk
            for shape in (s for s in self.cfg.shapes if s.kind == "mamba2"):
                inp = self.inputs(shape, seqlen)
                first, second = self.halves(shape, inp, split)
                for backend, label, interp in self.cfg.backends(shape):
                    if (interp and seqlen > self.cfg.interp_seqlen) or split == 0:
                        continue
                    for alg in [alg for alg in self.algs_on(shape, backend) if alg != "recurrent"]:
                        row = dict(section="grid_split", model=shape.name, backend=label,
                                   algorithm=self.alg_label(alg), seqlen=seqlen, batch="1", split=split)
                        (t1, r1, e1), (t2, r2, e2) = self.one_and_two_passes(
                            shape, inp, (first, second), split, backend, alg, interp)
                        if t1 and t2:
                            bitwise = torch_equal(r2.y, r1.y[:, split:]) and torch_equal(r2.final_states,
                                                                                        r1.final_states)
                            row.update(status="ok", one_pass_ms=t1.ms, two_passes_ms=t2.ms, ratio=t2.ms / t1.ms,
                                       bitwise=bitwise, timing=t1.method)
                        else:
                            row.update(failed(e1, e2))
                        self.results["grid_split"].append(row)
                del inp, first, second
                common.release_memory(self.device)
        self.save()

    def one_and_two_passes(self, shape, inp, halves, split, backend, alg, interp, capture=None):
        """(timing, result, error) of one pass over `inp`, and of two over its halves: the second
        resumed from the first's final state, at its absolute start `split`."""
        first, second = halves
        head = self.our_scan(shape, first, backend, alg)

        def two():
            return self.our_scan(shape, second, backend, alg, initial_states=head().final_states,
                                 start_positions=[split])()

        return self.timed(self.our_scan(shape, inp, backend, alg, capture=capture), interp), self.timed(two, interp)

    @staticmethod
    def halves(shape, inp, split):
        """The inputs of [0, split) and [split, end), as separate contiguous buffers."""
        if shape.kind == "mamba2":
            cut = lambda t, s: t[:, s].contiguous() if t.ndim >= 3 else t  # noqa: E731
            keys = ("x", "dt", "B", "C")
        else:
            cut = lambda t, s: t[..., s].contiguous() if t.ndim == 3 else t  # noqa: E731
            keys = ("u", "delta", "B", "C", "z")
        first = {k: cut(v, slice(0, split)) if k in keys else v for k, v in inp.items()}
        second = {k: cut(v, slice(split, None)) if k in keys else v for k, v in inp.items()}
        return first, second

    def decode(self):
        for shape in self.cfg.shapes:
            if shape.kind != "mamba2":
                continue
            for batch in self.cfg.decode_batches:
                inp = wl.decode_inputs(shape, batch, self.device)
                nbytes = wl.decode_bytes(shape, batch, ELT)
                base = dict(section="decode", model=shape.name, batch=batch)
                for backend, label, interp in self.cfg.backends(shape):
                    fn = lambda backend=backend: ssm_kernels.selective_state_update(  # noqa: E731
                        inp["state"], inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], D=inp["D"],
                        dt_bias=inp["dt_bias"], dt_softplus=True, backend=backend)
                    timing, _, error = self.timed(fn, interp)
                    row = self.fill(dict(base, impl="ssm_kernels", backend=label), timing, error, nbytes, batch)
                    self.results["decode"].append(row)
                for name, op in peers_mod.DECODE_OPS.items():
                    peer = self.peers[name]
                    if not peer.available or op not in peer.ops:
                        continue
                    peer_inp = dict(inp, state=inp["state"].clone())
                    timing, _, error = self.timed(peers_mod.decode_step(peer.ops[op], peer_inp))
                    row = dict(base, impl=name, backend="torch" if name == peers_mod.HF else "triton")
                    self.results["decode"].append(self.fill(row, timing, error, nbytes, batch))
                inp = None  # free this batch's inputs before the next one allocates
        self.save()

    def scan_lengths(self, seqlens, batches=(False, True)):
        for seqlen in seqlens:
            for shape in self.cfg.shapes:
                for varlen in batches:
                    self.scan_shape(shape, seqlen, varlen)

    def run(self):
        # The headline first (the longer passes at batch 1 with the peers, the capture overhead,
        # the grid split), so that a budget cut costs the secondary figures; the longest last.
        shortest, *longer = self.cfg.seqlens
        middle, longest = longer[:-1], longer[-1:]
        if not self.varlen:  # batch 1 only: the shorter lengths, captures and the grid split, the longest
            seqlens = list(self.cfg.seqlens)
            middle, longest = (seqlens[:-1], seqlens[-1:]) if len(seqlens) > 1 else (seqlens, [])
            shortest, longer = None, []
        sections = [("copy_bandwidth", "copy_bandwidth", self.copy_bandwidth),
                    ("scan", f"scan {middle}, batch 1", lambda: self.scan_lengths(middle, (False,))),
                    ("captures", "captures", self.captures), ("grid_split", "grid_split", self.grid_split),
                    ("scan", f"scan {longest}, batch 1", lambda: self.scan_lengths(longest, (False,))),
                    ("scan", f"scan {shortest}", lambda: self.scan_lengths([shortest] if shortest else [])),
                    ("scan", f"scan {longer}, varlen", lambda: self.scan_lengths(longer, (True,))),
                    ("crossover", "crossover", self.crossover),
                    ("inpass_vs_split", "inpass_vs_split", self.inpass_vs_split), ("decode", "decode", self.decode)]
        seconds = self.results["section_seconds"] = {}
        for key, name, section in sections:
            if self.sections is not None and key not in self.sections | {"copy_bandwidth"}:
                continue
            began = time.monotonic()
            try:
                section()
            finally:
                seconds[name] = time.monotonic() - began
                self.save()


SECTIONS = ("scan", "captures", "grid_split", "crossover", "inpass_vs_split", "decode")


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"a pass length must be >= 1, got {n}")
    return n


def _sections(text: str) -> list[str]:
    names = text.split(",")
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown section(s) {', '.join(unknown)}; "
                                         f"the sections: {', '.join(SECTIONS)}")
    return names


def add_args(parser) -> None:
    parser.add_argument("--seqlens", type=_positive, nargs="+", default=None, metavar="N",
                        help="pass lengths (default: the standard ones, or the reduced ones)")
    parser.add_argument("--sections", type=_sections, default=None, metavar="A,B",
                        help=f"run only these sections, comma-separated, of: {', '.join(SECTIONS)}")
    parser.add_argument("--no-varlen", action="store_true", help="batch 1 only (no varlen batches)")
    parser.add_argument("--no-fused", action="store_true",
                        help="the chunked mamba2_scan on its five stages only, not also on the fused pass")


def check_args(parser, args) -> None:
    if args.seqlens and not args.no_varlen and min(args.seqlens) < wl.VARLEN_SEQUENCES:
        parser.error(f"--seqlens below {wl.VARLEN_SEQUENCES} need --no-varlen "
                     f"(a varlen batch has {wl.VARLEN_SEQUENCES} sequences of at least a token)")


def main(argv=None) -> int:
    return common.run_benchmark(argv, prog="python -m bench.scan", doc=__doc__, make_bench=ScanBench,
                                write_report=report.write_scan_report, short_table=report.scan_short_table,
                                add_args=add_args, check_args=check_args)


if __name__ == "__main__":
    sys.exit(main())
