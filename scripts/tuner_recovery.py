"""After a passing load, how soon does the certified head's thread tuner return to the caller's thread count?

The certified head on CPU picks, per call shape, the caller's thread count or one thread by the recent mean
time of each (``hf_csv.core.speed.ThreadTuner``). This script builds the head of a real model, waits for
the screen's background pack, runs the head for ``--load-s`` seconds with one busy process beside it (the
tuner moves to one thread), stops that process, and then times ``--after`` calls: how many calls run before the
tuner is back on the caller's count, and the head's median and mean time over those calls.

    python scripts/tuner_recovery.py --model ~/.cache/hf-csv-models/qwen-coder-0.5b --json OUT

Run it with ``PYTHONPATH`` pointing at the code to compare (two worktrees, alternately).
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_csv
from hf_csv.core.certificate import CertifiedHead

from _load import cpu_load  # a sibling helper: Python puts the script's folder first on the import path

PROMPT = "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--load-s", type=float, default=8.0)
    ap.add_argument("--after", type=int, default=300)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.model)
    with torch.no_grad():
        hs = model.model(tok(PROMPT, return_tensors="pt").input_ids).last_hidden_state[0]
    ch = CertifiedHead(model.get_output_embeddings().weight)
    rows = [hs[i:i + 1].contiguous() for i in range(2, hs.shape[0])]
    ch.topk(rows[0])
    for th in threading.enumerate():  # the screen's background pack: not part of this measurement
        if th.name == "hf_csv-screen-pack":
            th.join()
    key = (("_topk", 1), args.threads)
    for r in rows * 2:
        ch.topk(r)
    with cpu_load(1):  # the passing load: one busy process, stopped after load_s seconds
        t0, n_load = time.perf_counter(), 0
        while time.perf_counter() - t0 < args.load_s:
            ch.topk(rows[n_load % len(rows)])
            n_load += 1
    choice_load = ch._tuner.choice(key)
    picks, ts = [], []
    for i in range(args.after):
        a = time.perf_counter()
        ch.topk(rows[i % len(rows)])
        ts.append(time.perf_counter() - a)
        picks.append(ch._tuner.choice(key))
    back = next((i for i, p in enumerate(picks) if p == args.threads), None)
    res = {"code": hf_csv.__file__, "model": args.model, "threads": args.threads, "calls_under_load": n_load,
           "choice_after_load": choice_load, "calls_until_caller_threads_again": back,
           "calls_on_1_thread": picks.count(1), "after": args.after,
           "median_ms_after": 1e3 * statistics.median(ts), "mean_ms_after": 1e3 * statistics.fmean(ts)}
    print(json.dumps(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
