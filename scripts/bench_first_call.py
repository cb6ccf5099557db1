#!/usr/bin/env python
"""The first ``generate`` call of a process, stock against certified: what a user sees once per process.

    python scripts/bench_first_call.py --model ~/.cache/hf-csv-models/qwen-coder-1.5b --rounds 5 --json out/fc.json
    python scripts/bench_first_call.py --model ~/.cache/hf-csv-models/whisper-tiny.en \
        --audio ../shared/models/speech/en_rainbow.wav --new-tokens 64 --rounds 7 --json out/fc_wt.json

Each round starts one fresh process per side (the order alternating round by round), which loads the model as
``scripts/bench_generate.py`` does (a Whisper model's encoder outputs computed before the timing), calls
``hf_csv.enable``, and times its first ``generate``: stock's, or one with ``csv_config=CSVConfig()``, which builds the
certified head from scratch inside the call (the row quantization, the outlier columns, the kernel's build or load
from its cache). The model load is not timed. Greedy, fp32, batch 1.

Writes: the per-round times of each side, their medians, ``ratio`` (stock's median over csv's: above 1, the certified
first call is faster), ``csv_faster_rounds``, ``identical`` (every process's tokens equal), threads, the machine
load before and after, and the CPU's model name, cores and the SIMD flags hf_csv's kernels look at (``_load.cpu_info``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

from _load import cpu_info  # noqa: E402


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    import hf_csv
    from bench_generate import load

    model, inputs, extra = load(args.model, args.audio)
    extra = dict(extra, do_sample=False, num_beams=1)  # (an LM's EOS is off, as in bench_generate: a fixed count)
    hf_csv.enable(model)
    kw = {"csv_config": hf_csv.CSVConfig()} if args.child == "csv" else {}
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=args.new_tokens, **extra, **kw)
    t = time.perf_counter() - t0
    stats = getattr(model, "csv_last_stats", None) if args.child == "csv" else None
    print(json.dumps({"t": t, "tokens": out.tolist(), "summary": (stats or {}).get("summary")}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--audio", default=None, help="a speech clip: --model is a Whisper model")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", choices=["stock", "csv"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    base = [sys.executable, str(Path(__file__).resolve()), "--model", args.model, "--new-tokens", str(args.new_tokens),
            "--threads", str(args.threads)] + (["--audio", args.audio] if args.audio else [])
    load_before = os.getloadavg()
    times: dict = {"stock": [], "csv": []}
    outs, summaries = [], []
    for r in range(args.rounds):
        for side in (("stock", "csv") if r % 2 == 0 else ("csv", "stock")):
            p = subprocess.run(base + ["--child", side], capture_output=True, text=True, timeout=3600)
            if p.returncode != 0:
                raise SystemExit(f"the {side} process failed:\n{p.stderr[-3000:]}")
            res = json.loads(p.stdout.strip().splitlines()[-1])
            times[side].append(res["t"])
            outs.append(res["tokens"])
            if side == "csv":
                summaries.append(res["summary"])
        print(f"round {r + 1}: stock {times['stock'][-1]:.3f} s, csv {times['csv'][-1]:.3f} s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"model": Path(args.model).name, "audio": args.audio, "new_tokens": args.new_tokens, "threads": args.threads,
           "rounds": args.rounds, "times_stock_s": times["stock"], "times_csv_s": times["csv"],
           "median_stock_s": med["stock"], "median_csv_s": med["csv"], "ratio": med["stock"] / med["csv"],
           "csv_faster_rounds": sum(c < s for s, c in zip(times["stock"], times["csv"])),
           "identical": all(o == outs[0] for o in outs), "csv_summary_last": summaries[-1],
           "load_before": load_before, "load_after": os.getloadavg(), "cpu": cpu_info()}
    print(json.dumps({k: res[k] for k in ("model", "median_stock_s", "median_csv_s", "ratio", "csv_faster_rounds",
                                          "identical")}))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
