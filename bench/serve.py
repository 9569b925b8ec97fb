"""Serving benchmarks: ``python -m bench.serve [--reduced] [--quick] [--out DIR] [--time-budget S]``.

1. Simulator (modelled, not measured): planner.simulate for every policy on the planner's default
   traces, with the seed engine's rules (block 16, budget 8192, first chunk 8193, a snapshot every
   32 blocks) and the planner's default cost model.
2. One layer's plans (measured, kernels only): the seed's incident prompt (4 * budget + 4 tokens)
   prefilled cold by one Mamba-2 layer's scan pass by pass, as each policy plans it (in-pass
   captures included), then the byte-identical warm request from the snapshot the cache would
   restore. Checks that the warm output equals the cold one bit for bit (recurrent algorithm).
3. Hybrid model (measured): ssm_serving's Engine serving the incident prompt cold and then
   warm under each policy (wall clock, device synchronised, one run each: a cold run needs a
   fresh cache); checks warm logits == cold logits bit for bit.

The incident is scaled as ssm_serving.demo scales it: budget 8192 / scale, first chunk budget + 1,
prompt 4 * budget + 4 tokens, interval max(1, 32 / scale) blocks. Full size (scale 1) for the layer
plans on a GPU; the hybrid model computes every non-SSM op one token at a time (for exactness), so
it runs at scale 8 on a GPU and smaller on CPU.

Outputs under --out: serve.json, serve.md, serve_policies.png (replay tokens and modelled time per
policy and trace) and serve_measured.png (measured cold and warm prefill per policy).
"""
from __future__ import annotations

import random
import sys
import time

import torch

from . import use_triton_interpreter

use_triton_interpreter()  # the interpreter without CUDA; before Triton and the kernels are imported
from . import common, report, workloads as wl  # noqa: E402
from .common import Budget, Terminated, TimingOptions, time_fn  # noqa: E402
import ssm_kernels  # noqa: E402
from planner import POLICIES, CostModel, default_traces, plan_prefill, simulate  # noqa: E402

# The seed engine's dense serve (planner.cli uses the same defaults).
RULES = dict(block_size=16, budget=8192, first_budget=8193, interval=32)


def incident_rules(scale: int) -> tuple[dict, int]:
    """(plan rules, prompt tokens) of the seed's incident at 1/scale of its size."""
    budget = RULES["budget"] // scale
    rules = dict(block_size=RULES["block_size"], budget=budget, first_budget=budget + 1,
                 interval=max(1, RULES["interval"] // scale))
    return rules, 4 * budget + 4


class ServeBench:
    def __init__(self, args, device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.reduced = args.reduced or not self.cuda
        self.quick = args.quick
        self.budget = Budget(args.time_budget)
        self.out = common.output_dir(args, device)
        self.env = common.environment(device, reduced=self.reduced, quick=self.quick)
        self.timing = (TimingOptions(warmup_ms=10, rep_ms=50, max_rep_ms=1000) if self.cuda
                       else TimingOptions(cpu_runs=5))
        # Scales: the layer plans at full size on a GPU; the hybrid model smaller (see docstring).
        self.layer_scale = 1 if not self.reduced else 64
        self.model_scale = (16 if self.quick else 8) if not self.reduced else 64
        self.results = {"benchmark": "serve", "label": self.env["label"], "env": self.env,
                        "simulator": None, "layer_plans": None, "hybrid_model": None,
                        "incomplete": "did not finish (killed?)"}

    def save(self):
        common.write_json(self.out / "serve.json", self.results)

    # -- 1. simulator ----------------------------------------------------------------------------
    def simulator(self):
        cost = CostModel()
        traces = []
        for trace in default_traces():
            policies = {}
            for policy in POLICIES:
                report_ = simulate(trace, policy=policy, cost_model=cost, **RULES)
                policies[policy] = report_.to_dict()["totals"]
            traces.append({"name": trace.name, "description": trace.description, "requests": len(trace),
                           "prompt_tokens": trace.prompt_tokens, "policies": policies})
        self.results["simulator"] = {
            "what": "modelled by planner.simulate (not measured)", "rules": RULES,
            "cost_model": {"per_token_ms": cost.per_token_ms, "per_pass_ms": cost.per_pass_ms},
            "traces": traces}
        self.save()

    # -- 2. one layer's plans ----------------------------------------------------------------------
    def layer_plans(self):
        shape = (wl.REDUCED_SHAPES if self.reduced else wl.STANDARD_SHAPES)[0]
        rules, total = incident_rules(self.layer_scale)
        inp = wl.mamba2_inputs(shape, total, self.device)
        backend = "triton" if self.cuda else "torch"
        entry = {"what": "measured: one Mamba-2 layer's scan (mamba2_scan, recurrent) running each policy's "
                         "passes; kernels only, not the model", "model": shape.name, "dims": shape.describe(),
                 "backend": backend, "dtype": "bfloat16", "rules": rules, "prompt_tokens": total,
                 "scale": self.layer_scale, "policies": {}}
        self.results["layer_plans"] = entry
        for policy in POLICIES:
            if self.budget.expired():
                entry["policies"][policy] = {"status": "skipped", "note": "skipped: time budget exhausted"}
                continue
            entry["policies"][policy] = self.layer_policy(inp, backend, policy, rules, total)
            self.save()
        del inp
        common.release_memory(self.device)

    def layer_policy(self, inp, backend, policy, rules, total):
        plan = plan_prefill(total, policy=policy, **rules)
        warm = plan.warm_restore()
        warm_plan = plan_prefill(total, start=warm.restore_point, policy=policy, **rules)

        def run(passes, state, keep=()):
            """Run the passes from `state`; return (y per pass, {position: state} for `keep`)."""
            ys, kept = [], {}
            for p in passes:
                offsets = list(p.capture_offsets)
                out = ssm_kernels.mamba2_scan(
                    inp["x"][:, p.start:p.end], inp["dt"][:, p.start:p.end], inp["A"], inp["B"][:, p.start:p.end],
                    inp["C"][:, p.start:p.end], D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=True,
                    initial_states=state, capture=[(0, k) for k in offsets], backend=backend,
                    algorithm="recurrent")  # exact at any split: the plans' passes start anywhere
                for k, captured in zip(offsets, out.captured_states):
                    if p.start + k in keep:
                        kept[p.start + k] = captured[None]
                if p.end in keep:
                    kept[p.end] = out.final_states
                state = out.final_states
                ys.append(out.y)
            return ys, kept

        row = {"passes": [(p.start, p.length) for p in plan.passes],
               "captures": [c for p in plan.passes for c in p.captures],
               "snapshots": list(plan.snapshot_positions), "warm_restore_point": warm.restore_point,
               "warm_replay_tokens": warm.replay_tokens, "warm_passes": [(p.start, p.length) for p in warm_plan.passes]}
        try:
            cold_ys, kept = run(plan.passes, None, keep={warm.restore_point})
            snapshot = kept.get(warm.restore_point) if warm.restore_point else None
            warm_ys, _ = run(warm_plan.passes, snapshot)
            cold_y = torch.cat(cold_ys, dim=1)
            row["bitwise_warm_equals_cold"] = bool(torch.equal(torch.cat(warm_ys, dim=1),
                                                               cold_y[:, warm.restore_point:]))
            t_cold, _ = time_fn(lambda: run(plan.passes, None), self.device, self.timing)
            t_warm, _ = time_fn(lambda: run(warm_plan.passes, snapshot), self.device, self.timing)
        except Terminated:
            raise
        except Exception as exc:  # noqa: BLE001
            common.release_memory(self.device)
            return dict(row, status="failed", note=f"failed: {type(exc).__name__}: {exc}"[:400])
        return dict(row, status="ok", cold_ms=t_cold.ms, warm_ms=t_warm.ms, timing=t_cold.method)

    # -- 3. hybrid model -----------------------------------------------------------------------
    def hybrid_model(self):
        would_call = ("ssm_serving.Engine(HybridLM(HybridConfig()), policy=..., block_size=16, budget=..., "
                      "first_budget=..., interval=...).serve(prompt), cold and then warm")
        try:
            from ssm_serving import Engine, HybridConfig, HybridLM
        except ImportError as exc:
            self.results["hybrid_model"] = {"status": "not available", "reason": f"{type(exc).__name__}: {exc}",
                                            "would_call": would_call}
            return
        rules, total = incident_rules(self.model_scale)
        config = HybridConfig()
        model = HybridLM(config, device=self.device)
        rng = random.Random(0)
        prompt = [rng.randrange(config.vocab_size) for _ in range(total)]
        entry = {"what": "measured: ssm_serving.Engine.serve, the incident prompt cold then the "
                         "byte-identical request warm; wall clock, device synchronised, one run each",
                 "config": {k: str(v) if isinstance(v, torch.dtype) else v for k, v in vars(config).items()},
                 "layers": list(config.layer_types), "rules": rules, "prompt_tokens": total,
                 "scale": self.model_scale, "policies": {}, "status": "ok"}
        self.results["hybrid_model"] = entry
        try:  # GPU warm-up: compile every kernel variant the timed runs use (a small incident)
            small_rules, small_total = incident_rules(256)
            for policy in POLICIES if self.cuda else ():
                engine = Engine(model, policy=policy, **small_rules)
                engine.serve(prompt[:small_total])
                engine.serve(prompt[:small_total])
        except Terminated:
            raise
        except Exception as exc:  # noqa: BLE001
            entry.update(status="failed", note=f"failed in warm-up: {type(exc).__name__}: {exc}"[:400])
            self.save()
            return
        for policy in POLICIES:
            if self.budget.expired():
                entry["policies"][policy] = {"status": "skipped", "note": "skipped: time budget exhausted"}
                continue
            try:
                engine = Engine(model, policy=policy, **rules)
                cold, cold_s = self.served(engine, prompt)
                warm, warm_s = self.served(engine, prompt)
            except Terminated:
                raise
            except Exception as exc:  # noqa: BLE001
                entry["policies"][policy] = {"status": "failed", "note": f"failed: {type(exc).__name__}: {exc}"[:400]}
                continue
            entry["policies"][policy] = {
                "status": "ok", "cold_s": cold_s, "warm_s": warm_s, "cold_passes": cold.passes,
                "cold_captures": cold.captures, "cold_snapshots": cold.snapshots,
                "warm_matched": warm.matched, "warm_restore_point": warm.restore_point,
                "warm_replayed": warm.replayed, "warm_ssm_replayed": warm.ssm_replayed, "warm_passes": warm.passes,
                "bitwise_warm_equals_cold": bool(torch.equal(warm.logits, cold.logits[warm.restore_point:]))}
            self.save()

    def served(self, engine, prompt):
        if self.cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        result = engine.serve(prompt)
        if self.cuda:
            torch.cuda.synchronize()
        return result, time.perf_counter() - began

    def run(self):
        self.simulator()
        self.layer_plans()
        self.hybrid_model()


def main(argv=None) -> int:
    return common.run_benchmark(argv, prog="python -m bench.serve", doc=__doc__, make_bench=ServeBench,
                                write_report=report.write_serve_report, short_table=report.serve_short_table)


if __name__ == "__main__":
    sys.exit(main())
