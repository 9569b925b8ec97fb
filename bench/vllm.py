"""vLLM with and without the ssm-prefill-kernels plugin: prefill passes, time and cached tokens
for cold, warm, branch and multi-turn requests, on tiny random hybrid models saved locally.

    python -m bench.vllm                     # all models and configurations; results in --out
    python -m bench.vllm --models granite --configs plugin-align

Runs where vLLM is installed (its CPU build here; CUDA vLLM on a GPU machine). Each
(model, configuration) runs in its own process (one vLLM engine per process). Models (random
weights, float32, saved with transformers; no hub): `granite` GraniteMoeHybrid (Mamba-2 and
attention layers), `jamba` Jamba (Mamba-1 and attention), `mamba` Mamba (Mamba-1 only).
Configurations:

- `vllm-none`: vLLM's own kernels, prefix caching off;
- `vllm-align`: vLLM's own kernels, prefix caching on (vLLM's "align" Mamba cache mode);
- `plugin-none`: the plugin, prefix caching off;
- `plugin-align-tail`: the plugin's kernels with vLLM's capture policy (the prompt tail, and a
  pass cut at a shared-prefix junction);
- `plugin-align-512`: the plugin capturing every 512 tokens and the junction, in-pass;
- `plugin-align`: the plugin capturing every block end a prefill pass crosses.

Traffic per round (a fresh random prompt each round; the first round is a warm-up, not reported):
cold (900 tokens), warm (the same again), branch (the first 704 tokens, then new ones: it leaves
the prompt before its tail), branch2 (another branch at the same point) and turn 2 (the prompt,
the reply, 180 new tokens); then a 10-token and a 600-token prompt served together, so that with
more than one output token a step decodes one while it prefills the other (checked by the tests,
not reported). Block size 128,
token budget 256 per step, so a 900-token prefill takes 4 passes. Per request: passes (engine
steps until the first token), prefill seconds (one output token), cached tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

MODELS = ("granite", "jamba", "mamba")
# A model whose state layers are not Mamba's (LFM2's short convs): the plugin leaves them to vLLM.
OTHER_MODELS = ("lfm2",)
CONFIGS = {
    # name: (plugin on, prefix caching on, plugin capture interval: None = default, 0 = vLLM's policy)
    "vllm-none": (False, False, None),
    "vllm-align": (False, True, None),
    "plugin-none": (True, False, None),
    "plugin-align-tail": (True, True, 0),
    "plugin-align-512": (True, True, 512),
    "plugin-align": (True, True, None),
}
BLOCK, BUDGET, PROMPT, SHARED, TURN2_NEW, VOCAB = 128, 256, 900, 704, 180, 512
REQUESTS = ("cold", "warm", "branch", "branch2", "turn2")
# Served together after those: the short prompt decodes while the long one is still in prefill,
# so an engine step holds decode and prefill rows at once.
TOGETHER, TOGETHER_LENGTHS = ("together_short", "together_long"), (10, 600)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------
def build_model(kind: str, path: Path) -> Path:
    """Save a tiny random model of `kind` under `path` (float32, transformers' format)."""
    import torch
    from transformers import (GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, JambaConfig, JambaForCausalLM,
                              Lfm2Config, Lfm2ForCausalLM, MambaConfig, MambaForCausalLM)

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "granite":
        # attention head_dim 64: vLLM's CPU attention kernel refuses 16
        model = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
            hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=2, layer_types=["mamba", "attention", "mamba", "attention"], num_local_experts=0,
            shared_intermediate_size=256, mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=32, mamba_d_head=32,
            mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64, max_position_embeddings=4096,
            position_embedding_type="rope", tie_word_embeddings=False, initializer_range=0.1, **common))
    elif kind == "jamba":
        model = JambaForCausalLM(JambaConfig(
            hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=100,
            expert_layer_offset=99, num_experts=1, num_experts_per_tok=1, mamba_d_state=16, mamba_d_conv=4,
            mamba_expand=2, mamba_dt_rank=8, max_position_embeddings=4096, initializer_range=0.1, **common))
    elif kind == "mamba":
        model = MambaForCausalLM(MambaConfig(
            hidden_size=128, state_size=16, num_hidden_layers=2, expand=2, conv_kernel=4, time_step_rank=8,
            initializer_range=0.3, **common))
    elif kind == "lfm2":
        # conv_dim and block_dim: read by vLLM's LFM2, which transformers' config leaves out
        model = Lfm2ForCausalLM(Lfm2Config(
            hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
            layer_types=["conv", "full_attention", "conv", "full_attention"], conv_L_cache=3, conv_dim=128,
            block_dim=128, block_auto_adjust_ff_dim=False, max_position_embeddings=4096, initializer_range=0.1,
            tie_word_embeddings=False, **common))
    else:
        raise ValueError(f"model must be one of {MODELS + OTHER_MODELS}, got {kind!r}")
    model.to(torch.float32).eval().save_pretrained(path)
    return path


def traffic(seed: int) -> dict[str, list[int]]:
    """One round's prompts; turn 2 is completed by the caller once the cold reply is known."""
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(3, VOCAB) for _ in range(n)]
    prompt = draw(PROMPT)
    return {"cold": prompt, "warm": list(prompt), "branch": prompt[:SHARED] + draw(PROMPT - SHARED),
            "branch2": prompt[:SHARED] + draw(PROMPT - SHARED), "turn2_new": draw(TURN2_NEW),
            **{name: draw(n) for name, n in zip(TOGETHER, TOGETHER_LENGTHS)}}


# ---------------------------------------------------------------------------------------------
# One vLLM engine in this process (the child)
# ---------------------------------------------------------------------------------------------
def run_child(model: str, config: str, rounds: int, max_tokens: int, out: Path) -> None:
    plugin, caching, interval = CONFIGS[config]
    os.environ["SSM_KERNELS_VLLM"] = "1" if plugin else "0"
    if interval is not None:
        os.environ["SSM_KERNELS_VLLM_CAPTURE_INTERVAL"] = str(interval)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    result = {"model": Path(model).name, "config": config, "rounds": [], "error": None}
    try:
        from vllm import LLM, SamplingParams

        t0 = time.perf_counter()
        llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                  enable_prefix_caching=caching, block_size=BLOCK, max_num_batched_tokens=BUDGET,
                  max_model_len=2048, max_num_seqs=4, seed=0)
        result["engine_start_s"] = time.perf_counter() - t0
        result["model_runner"] = model_runner(llm)
        steps = {"n": 0}
        step = llm.llm_engine.step

        def counting_step(*a, **k):
            steps["n"] += 1
            return step(*a, **k)

        llm.llm_engine.step = counting_step
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0)

        def serve(*prompts):
            """The prompts served together (one generate call); passes are counted for one alone."""
            steps["n"] = 0
            t, c, th = time.perf_counter(), time.process_time(), time.thread_time()
            outs = llm.generate([{"prompt_token_ids": tokens} for tokens in prompts], params, use_tqdm=False)
            seconds, cpu_seconds = time.perf_counter() - t, time.process_time() - c
            thread_seconds = time.thread_time() - th
            served = []
            for tokens, out in zip(prompts, outs):
                gen = out.outputs[0]
                served.append({
                    "prompt": tokens, "tokens": list(gen.token_ids), "seconds": seconds, "cpu_seconds": cpu_seconds,
                    "thread_seconds": thread_seconds,
                    "logprobs": [lp[t].logprob for lp, t in zip(gen.logprobs, gen.token_ids)],
                    "cached": out.num_cached_tokens,
                    "passes": steps["n"] - (len(gen.token_ids) - 1) if len(prompts) == 1 else None})
            return served

        for r in range(rounds):
            prompts = traffic(seed=r)
            reqs = {name: serve(prompts[name])[0] for name in ("cold", "warm", "branch", "branch2")}
            reqs["turn2"] = serve(prompts["cold"] + reqs["cold"]["tokens"] + prompts["turn2_new"])[0]
            reqs.update(zip(TOGETHER, serve(*(prompts[name] for name in TOGETHER))))
            result["rounds"].append(reqs)
    except Exception as e:  # recorded: a configuration that crashes is a result here
        import traceback

        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-4000:]
    if plugin:
        try:
            from ssm_serving.vllm_plugin import status

            result["plugin_status"] = status()
        except ImportError:
            result["plugin_status"] = None
    out.write_text(json.dumps(result))


def _runner_modules(worker) -> list[str]:
    return [c.__module__ for c in type(worker.model_runner).__mro__]


def model_runner(llm) -> str:
    """The model runner the engine's workers run: "v2" (vLLM's Model Runner V2, whose CPU runner
    extends the one in vllm.v1.worker.gpu) or "v1"."""
    modules = {m for worker in llm.collective_rpc(_runner_modules) for m in worker}
    return "v2" if "vllm.v1.worker.gpu.model_runner" in modules else "v1"


def run_config(model_dir: Path, config: str, *, rounds: int, max_tokens: int, workdir: Path,
               timeout: float = 900) -> dict:
    """Run one (model, configuration) in a child process; its JSON result (error recorded)."""
    out = workdir / f"{model_dir.name}-{config}.json"
    cmd = [sys.executable, "-m", "bench.vllm", "child", "--model", str(model_dir), "--config", config,
           "--rounds", str(rounds), "--max-tokens", str(max_tokens), "--json", str(out)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    (workdir / f"{model_dir.name}-{config}.log").write_text(proc.stdout + proc.stderr)
    if not out.exists():
        return {"model": model_dir.name, "config": config, "rounds": [],
                "error": f"the child exited with {proc.returncode}: {proc.stderr[-2000:]}"}
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - t
    return result


# ---------------------------------------------------------------------------------------------
# The reference: transformers' greedy tokens and log-probs
# ---------------------------------------------------------------------------------------------
def transformers_greedy(model_dir: Path, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of `prompt` and each chosen token's log-prob (float64)."""
    import torch
    from transformers import AutoModelForCausalLM

    # In float64: the reference's own rounding then adds nothing to the comparison.
    model = _hf_models.get(model_dir) or AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    _hf_models[model_dir] = model
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].double(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


_hf_models: dict = {}


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def summarize(result: dict) -> dict:
    """Medians over the reported rounds (round 0 is the warm-up) per request kind."""
    rounds = result["rounds"][1:] or result["rounds"]
    summary = {}
    for name in REQUESTS:
        reqs = [r[name] for r in rounds]
        if reqs:
            summary[name] = {"passes": statistics.median(q["passes"] for q in reqs),
                             "seconds": statistics.median(q["seconds"] for q in reqs),
                             "cpu_seconds": statistics.median(q["cpu_seconds"] for q in reqs),
                             "thread_seconds": statistics.median(q["thread_seconds"] for q in reqs),
                             "cached": statistics.median(q["cached"] for q in reqs)}
    return summary


def report(results: list[dict], env: dict, out: Path) -> str:
    from .common import header_lines, markdown_table

    rows, times = [], []
    for res in results:
        s = summarize(res) if not res["error"] else {}
        row = [res["model"], res["config"]]
        for name in REQUESTS:
            q = s.get(name)
            row += [f"{q['passes']:g} / {q['cached']:g}"] if q else ["-"]
        row.append(res["error"].split("\n")[0][:90] if res["error"] else "")
        rows.append(row)
        if s:
            cold, cold_cpu = s["cold"]["seconds"], s["cold"]["thread_seconds"]
            times.append([res["model"], res["config"], cold, cold_cpu]
                         + [f"{s[n]['seconds'] / cold:.2f} / {s[n]['thread_seconds'] / cold_cpu:.2f}"
                            for n in REQUESTS[1:]])
    headers = ["model", "config"] + [f"{name}: passes / cached" for name in REQUESTS] + ["error"]
    time_headers = ["model", "config", "cold s", "cold thread CPU s"] + [f"{n}/cold (wall / CPU)" for n in REQUESTS[1:]]
    lines = header_lines(env, "vLLM with and without the plugin") + [
        f"- vLLM {env.get('vllm')}; block {BLOCK}, token budget {BUDGET}, prompt {PROMPT} tokens, "
        f"branch shares {SHARED}, turn 2 adds {TURN2_NEW}; medians over {env.get('rounds', 0) - 1} rounds "
        "after a warm-up round; one output token per request",
        "", "Prefill passes (engine steps to the first token) and cached tokens (exact, deterministic):", "",
        markdown_table(headers, rows), "",
        "Prefill time: cold seconds (wall, and CPU time of the thread that runs the engine, "
        "vLLM's CPU build serving with one torch thread), then each request's time as a ratio to cold. "
        + env.get("time_note", ""), "", markdown_table(time_headers, times), ""]
    text = "\n".join(lines)
    (out / "vllm.md").write_text(text)
    return text


def main(argv=None) -> int:
    from . import use_triton_interpreter
    use_triton_interpreter()  # as every measuring benchmark (the engines' children inherit it)
    parser = argparse.ArgumentParser(prog="python -m bench.vllm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd")
    child = sub.add_parser("child", help="run one engine (internal)")
    child.add_argument("--model", required=True)
    child.add_argument("--config", required=True, choices=sorted(CONFIGS))
    child.add_argument("--rounds", type=int, default=3)
    child.add_argument("--max-tokens", type=int, default=1)
    child.add_argument("--json", required=True, type=Path)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--rounds", type=int, default=6, help="rounds per configuration, the first a warm-up")
    parser.add_argument("--time-note", default="", help="a sentence on the machine's load, for the report")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.cmd == "child":
        run_child(args.model, args.config, args.rounds, args.max_tokens, args.json)
        return 0
    if args.rounds < 2:
        parser.error(f"--rounds must be at least 2 (the first is a warm-up), got {args.rounds}")

    import datetime as _dt

    import torch
    try:
        import vllm
    except ImportError as exc:
        parser.error(f"needs vLLM installed (docs/vllm.md: on a CPU machine): {exc}")

    from .common import environment, write_json

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kind = "gpu" if device.type == "cuda" else "cpu"
    out = args.out or REPO_ROOT / "bench" / "results" / f"{_dt.date.today().isoformat()}-vllm-{kind}"
    (out / "logs").mkdir(parents=True, exist_ok=True)
    env = environment(device, reduced=False, quick=False)
    if device.type == "cpu":  # the common CPU label speaks of the scan benchmarks' reduced mode
        env["label"] = "CPU (vLLM's CPU build, tiny models; not GPU numbers)"
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    env.update(vllm=vllm.__version__, rounds=args.rounds, block_size=BLOCK, token_budget=BUDGET,
               load_average_at_start=load, time_note=args.time_note)
    import tempfile

    models = Path(tempfile.mkdtemp(prefix="bench-vllm-models-"))  # rebuilt from the seed; not kept
    results = []
    for kind_name in args.models:
        model_dir = build_model(kind_name, models / kind_name)
        for config in args.configs:
            res = run_config(model_dir, config, rounds=args.rounds, max_tokens=1, workdir=out / "logs")
            res["summary"] = summarize(res) if not res["error"] else None
            for r in res["rounds"]:
                for q in r.values():
                    q.pop("prompt", None)
            results.append(res)
            print(f"{kind_name} {config}: {res['summary'] or res['error'].splitlines()[0]}", flush=True)
    env["load_average_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    write_json(out / "vllm.json", {"environment": env, "results": results})
    print(report(results, env, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
