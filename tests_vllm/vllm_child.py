"""One vLLM engine in a child process, for tests that need engine settings of their own (a tight
KV cache, tensor parallelism): `serve(model, engine, prompts, ...)` runs this file and returns the
child's JSON (each prompt's tokens, log-probs and cached tokens, served one after another; the
plugin's status). A child that does not finish in `timeout` seconds is killed and reported, so a
stalled engine fails a test instead of hanging it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# The model runner this run asks vLLM for: .ci/vllm.sh runs tests_vllm under each (V2 with
# tests_vllm/model_runner_v2 on PYTHONPATH); the tests check each engine ran this one.
MODEL_RUNNER = "v2" if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1" else "v1"
# vLLM's engine arguments every test here uses (tiny float32 models saved locally, no tokenizer).
BASE_ENGINE = dict(skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0)


def serve(model: Path, engine: dict, prompts: list[list[int]], *, max_tokens: int = 4, env: dict | None = None,
          timeout: float = 600) -> dict:
    """The child's result; {"error": ...} when it failed or ran past `timeout` seconds."""
    args = json.dumps({"model": str(model), "engine": {**BASE_ENGINE, **engine}, "prompts": prompts,
                       "max_tokens": max_tokens})
    child_env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    try:
        proc = subprocess.run([sys.executable, __file__, args], cwd=REPO_ROOT, env=child_env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return {"error": f"no result after {timeout:.0f} s (stalled?)", "log": str(e.stderr)[-3000:]}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": f"the child exited with {proc.returncode}", "log": proc.stderr[-3000:]}


def _child(args: dict) -> None:
    from vllm import LLM, SamplingParams

    sys.path.insert(0, str(REPO_ROOT))
    from bench.vllm import model_runner

    llm = LLM(model=args["model"], **args["engine"])
    params = SamplingParams(max_tokens=args["max_tokens"], temperature=0.0, logprobs=0)
    served = []
    for prompt in args["prompts"]:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        gen = out.outputs[0]
        served.append({"tokens": list(gen.token_ids), "cached": out.num_cached_tokens,
                       "logprobs": [lp[t].logprob for lp, t in zip(gen.logprobs, gen.token_ids)]})
    from ssm_serving.vllm_plugin import status

    print("RESULT " + json.dumps({"error": None, "served": served, "plugin_status": status(),
                                  "model_runner": model_runner(llm)}), flush=True)


if __name__ == "__main__":  # spawned workers (tensor parallelism) re-import this file
    _child(json.loads(sys.argv[1]))
