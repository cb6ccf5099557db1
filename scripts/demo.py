#!/usr/bin/env python
"""hf_csv demo: greedy generation with the certified LM head on a small real model.

Runs SmolLM2-135M (from ../shared/models/prepare.py ci) stock and with
``csv_config=CSVConfig()``, checks the tokens are identical, and prints the measured
certification statistics and timings. ``--model DIR`` picks another causal LM.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_csv
from hf_csv import CSVConfig

MODELS = Path(os.environ.get("HF_CSV_MODELS", "~/.cache/hf-csv-models")).expanduser()
PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "models" / "prompts.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=str(MODELS / "smollm2-135m"))
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=3)
    args = ap.parse_args()

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    model = hf_csv.enable(model)  # the one documented call
    prompts = [json.loads(l)["prompt"] for l in PROMPTS.read_text().splitlines() if l.strip()][: args.prompts]
    cfg = CSVConfig()
    gen = dict(max_new_tokens=args.new_tokens, do_sample=False, min_new_tokens=args.new_tokens)
    print(f"model: {Path(args.model).name}  V={model.get_output_embeddings().weight.shape[0]}  "
          f"new tokens per prompt: {args.new_tokens}\n")
    t_stock, t_csv, all_same = [], [], True
    for p in prompts:
        inputs = tok(p, return_tensors="pt")
        model.generate(**inputs, max_new_tokens=2, csv_config=cfg)  # build the int8 screen once
        t0 = time.perf_counter()
        ref = model.generate(**inputs, **gen)
        t_stock.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = model.generate(**inputs, **gen, csv_config=cfg, return_dict_in_generate=True)
        t_csv.append(time.perf_counter() - t0)
        same = torch.equal(ref, out.sequences)
        all_same &= same
        stats = getattr(out, "csv_stats", None)
        sd = stats.as_dict() if hasattr(stats, "as_dict") else (stats or {})
        text = tok.decode(out.sequences[0, inputs.input_ids.shape[1]:], skip_special_tokens=True)
        print(f"prompt: {p[:60]!r}")
        print(f"  completion: {text[:100]!r}")
        print(f"  identical to stock greedy: {same}; certified steps: {sd.get('certified')}/{sd.get('rows')}, "
              f"mean sub-vocabulary: {100 * sd.get('mean_subvocab_fraction', float('nan')):.4f}% of V, "
              f"fallbacks: {sd.get('fallback')}")
    print(f"\nall identical: {all_same}")
    print(f"median time per prompt: stock {statistics.median(t_stock):.2f} s, csv {statistics.median(t_csv):.2f} s "
          f"(SmolLM2's head is a small share of a decode step, which caps any head-only speedup; "
          f"measured figures per model: docs/benchmarks.md)")
    if not all_same:
        raise SystemExit("tokens differ from stock greedy")


if __name__ == "__main__":
    main()
