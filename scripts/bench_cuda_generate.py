#!/usr/bin/env python
"""Greedy generate on CUDA: stock against hf_csv (speed guard on, and off), a random Qwen2-0.5B-shaped model.

    python scripts/bench_cuda_generate.py [--dtype bf16 --tokens 64 --runs 5 --batch 1]

No checkpoint travels to the GPU machine, so the model is random (Qwen2.5-0.5B's shapes: V = 151936, d = 896,
24 layers) with its head scaled ×20 so that certificates hold; the timings are of the shapes, not of a trained model.
Runs are interleaved (stock, guard on, guard off); medians; tokens must be identical on every run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import hf_csv  # noqa: E402
from hf_csv import CSVConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with torch.device("cuda"):
        m = Qwen2ForCausalLM(cfg).eval().to(dt)
    with torch.no_grad():
        m.lm_head.weight.mul_(20.0)
    m.generation_config.pad_token_id = 0
    m = hf_csv.enable(m)
    ids = torch.randint(3, 151936, (a.batch, 16), generator=torch.Generator().manual_seed(1)).cuda()
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.tokens, min_new_tokens=a.tokens,
              do_sample=False)

    def run(guard: str | None):
        if guard is not None:
            os.environ["HF_CSV_SPEED_GUARD"] = guard
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = m.generate(**kw, **({} if guard is None else {"csv_config": CSVConfig()}))
        torch.cuda.synchronize()
        return out, time.perf_counter() - t0, (None if guard is None else dict(m.csv_last_stats))

    first = {name: run(g)[1] for name, g in (("stock", None), ("guard_on", "1"), ("guard_off", "0"))}
    times: dict = {"stock": [], "guard_on": [], "guard_off": []}
    stats = {}
    ref = None
    for _ in range(a.runs):
        for name, g in (("stock", None), ("guard_on", "1"), ("guard_off", "0")):
            out, t, st = run(g)
            ref = out if ref is None else ref
            assert torch.equal(out, ref), f"{name}: tokens differ from stock"
            times[name].append(t)
            stats[name] = st
    med = {k: statistics.median(v) for k, v in times.items()}
    rep = {"device": torch.cuda.get_device_name(), "dtype": a.dtype, "batch": a.batch, "tokens": a.tokens,
           "runs": a.runs, "first_call_s": first, "median_s": med,
           "ratio_vs_stock": {k: med["stock"] / med[k] for k in ("guard_on", "guard_off")},
           "stats": {k: {f: v[f] for f in ("rows", "certified", "declined_rows", "summary") if f in v}
                     for k, v in stats.items() if v}}
    print(json.dumps(rep, indent=2, default=str))
    if a.json:
        a.json.write_text(json.dumps(rep, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
