#!/usr/bin/env python
"""The certified head on the caller's thread count, on one thread, and tuned (hf_csv.core.speed.ThreadTuner),
against the dense head, interleaved, on real hidden states; quiet or beside ``--load N`` busy processes.

    python scripts/bench_threads.py --model ~/.cache/hf-csv-models/qwen-coder-0.5b --threads 2 --load 1

Prints JSON: per variant the median and mean ms per head call (one decode row per call, --rows rows per
rep, --reps reps, variants interleaved within each rep) and the tuner's choice.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

from _load import cpu_load, machine_load  # noqa: E402
from certify_report import hidden_states, load_text, DEFAULT_PROMPTS  # noqa: E402
from hf_csv.core.certificate import CertifiedHead  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--load", type=int, default=0)
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    before = machine_load()
    H, W, b, _ = hidden_states(a.model, load_text(DEFAULT_PROMPTS), 200, torch.float32)
    H = H.float()
    ch = CertifiedHead(W, b)
    ch.provider.calibrate(H[:32])
    rows = [H[i][None] for i in torch.linspace(0, len(H) - 1, a.rows).long()]
    variants = {"dense": None, f"fixed_{a.threads}": str(a.threads), "fixed_1": "1", "tuned": "auto"}
    res = {k: [] for k in variants}
    with cpu_load(a.load):
        for _ in range(a.reps):
            for name, env in variants.items():
                t0 = time.perf_counter()
                for h in rows:
                    if env is None:
                        ch.stock(h)
                    else:
                        os.environ["HF_CSV_HEAD_THREADS"] = env
                        ch.topk(h, 1)
                res[name].append((time.perf_counter() - t0) / len(rows) * 1e3)
    os.environ.pop("HF_CSV_HEAD_THREADS", None)
    out = {"model": Path(a.model).name, "threads": a.threads, "load": a.load, "machine_before": before,
           "ms_median": {k: round(statistics.median(v), 3) for k, v in res.items()},
           "ms_mean": {k: round(statistics.fmean(v), 3) for k, v in res.items()},
           "tuner_choice": {str(k): ch._tuner.choice(k) for k in ch._tuner._ctl._state}}
    print(json.dumps(out, indent=1))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
