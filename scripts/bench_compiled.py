#!/usr/bin/env python
"""Compiled decoding with a static cache: stock vs certified (docs/certificates.md §3.9), interleaved in one process.

    python scripts/bench_compiled.py --model ~/.cache/hf-csv-models/qwen-coder-0.5b --threads 2 --runs 5 \
        --json out/compiled_qwen.json

Both sides run ``generate(cache_implementation="static", compile_config=CompileConfig(fullgraph=True,
dynamic=False))`` (``_compile_all_devices`` set: transformers compiles on accelerators only unless told), greedy
or (``--sample``) top-k sampling reseeded per call, batch 1, ``--new-tokens`` tokens. Each side is compiled and warmed first (the compile times are reported apart);
then ``--runs`` interleaved pairs, one prompt each, left-padded to one length (a new length would recompile both
sides; tokens/s from the tokens generated). Writes: tokens_per_s_stock / tokens_per_s_csv (medians),
speedup (median of the per-pair ratios), identical_tokens, compiled_head (rows, certified, mean |S|), compile_s_*.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig

import hf_csv

from _load import machine_load

PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "models" / "prompts.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--sample", choices=["greedy", "default-sample", "llama-chat"], default="greedy",
                    help="default-sample: do_sample with transformers' top_k=50; llama-chat: T 0.6, top_k 50, top_p 0.9 "
                         "(each call reseeded with the same seed, so both sides draw from one stream)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    hf_csv.enable(model)
    prompts = [json.loads(line)["prompt"] for line in open(PROMPTS)]
    cc = CompileConfig(fullgraph=True, dynamic=False)
    cc._compile_all_devices = True
    # (no min_new_tokens: its processor lowers scores, which compiled decoding certifies only in eager steps)
    gen = dict(max_new_tokens=args.new_tokens, do_sample=False, num_beams=1, cache_implementation="static",
               compile_config=cc)
    if args.sample != "greedy":
        gen.update(do_sample=True, top_k=50)
        if args.sample == "llama-chat":
            gen.update(temperature=0.6, top_p=0.9)

    # every prompt left-padded to one length: a new input length would change the static cache's shape and
    # recompile (both sides), which is not what is timed here
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    used = [prompts[i % len(prompts)] for i in range(args.runs)]
    L = max(len(tok(p).input_ids) for p in used)

    def run(csv: bool, prompt: str):
        x = tok(prompt, return_tensors="pt", padding="max_length", max_length=L)
        torch.manual_seed(1234)
        t = time.perf_counter()
        out = model.generate(**x, **gen, csv_config=hf_csv.CSVConfig()) if csv else model.generate(**x, **gen)
        return time.perf_counter() - t, out, (model.csv_last_stats if csv else None)

    before = machine_load()
    compile_s = {}
    for side in ("stock", "csv"):  # compile and warm each side's graph
        t = time.perf_counter()
        for _ in range(2):
            run(side == "csv", prompts[0])
        compile_s[side] = time.perf_counter() - t
    ts, tc, ratios, same, stats, ntok = [], [], [], True, [], []
    for i in range(args.runs):
        p = prompts[i % len(prompts)]
        a, ref, _ = run(False, p)
        b, got, st = run(True, p)
        ts.append(a)
        tc.append(b)
        ratios.append(a / b)
        same &= torch.equal(ref, got)
        stats.append(st)
        ntok.append(ref.shape[1] - L)
    n = statistics.median(ntok)
    if any("compiled_head" not in s for s in stats):
        raise SystemExit(f"the certified calls did not run the compiled head: {[s['reasons'] for s in stats]}")
    rows = sum(s["compiled_head"]["rows"] for s in stats)
    cert = sum(s["compiled_head"]["certified"] for s in stats)
    sub = [s["compiled_head"]["mean_subvocab"] for s in stats if s["compiled_head"]["mean_subvocab"] is not None]
    res = {"model": os.path.basename(os.path.normpath(args.model)), "threads": args.threads, "runs": args.runs,
           "new_tokens": ntok, "dtype": "float32", "batch": 1,
           "decoding": args.sample, "generate_kwargs": {k: v for k, v in gen.items() if k != "compile_config"}, "machine_before": before,
           "machine_after": machine_load(),
           "tokens_per_s_stock": n / statistics.median(ts), "tokens_per_s_csv": n / statistics.median(tc),
           "speedup": statistics.median(ratios), "identical_tokens": bool(same),
           "compiled_head": {"rows": rows, "certified": cert, "mean_subvocab": statistics.fmean(sub) if sub else None,
                             "capacity": stats[0]["compiled_head"]["capacity"]},
           "reasons": sorted({r for s in stats for r in s["reasons"]}), "compile_s": compile_s,
           "times_stock_s": ts, "times_csv_s": tc}
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
