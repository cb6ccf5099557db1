#!/usr/bin/env python
"""Never slower from the first call of each shape: ``generate`` with and without ``csv_config``, per batch size.

    python scripts/bench_shapes.py --model ~/.cache/hf-csv-models/smollm2-135m --batch 1 8 64 256 --load 0 1 2 \
        --preset greedy qwen-chat --json out/shapes.json

For each load (0, 1 or 2 busy processes beside the benchmark, ``_load.cpu_load``) and preset (``greedy``; ``qwen-chat``:
Qwen2.5's chat sampling defaults, temperature 0.7, top-p 0.8, top-k 20, repetition penalty 1.05, seeded) one fresh
process loads the model, calls ``hf_csv.enable`` and the certified head's first build (one untimed batch-1 call of one
token, so that the figures are about a new *shape*, not the process's first call: ``scripts/bench_first_call.py``
times that), then runs the batch sizes in order, each ``--pairs`` pairs of calls on the same inputs, stock and
certified, the order alternating pair by pair. The first pair is the first call of that shape (a new key of the speed
guard). Reports per batch size: the first pair's ratio csv / stock, the median of csv's times over the median of
stock's, the worst pair's ratio, the speed guard's choice (certified rows) and whether every pair's tokens were equal.
Ratios above 1 mean the certified call was slower. ``--control``: an A/A run, stock on both sides (the spread of the
ratios this machine gives at each load, beside which the certified figures are read).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from _load import cpu_info, cpu_load, machine_load

PRESETS = {"greedy": dict(do_sample=False),
           "qwen-chat": dict(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)}


def _inputs(tok, batch: int, length: int) -> dict:
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(100, tok.vocab_size - 100, (batch, length), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def child(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    import hf_csv
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    model.generation_config.eos_token_id = None  # a fixed token count
    hf_csv.enable(model)
    gen = dict(PRESETS[args.child_preset], pad_token_id=0)
    with torch.no_grad():  # the head's first build, untimed (a batch-1 greedy call of one token)
        model.generate(**_inputs(tok, 1, 4), max_new_tokens=1, do_sample=False, pad_token_id=0,
                       csv_config=hf_csv.CSVConfig())
    rows = []
    for b in args.batch:
        x = _inputs(tok, b, args.prompt_len)
        pairs = args.pairs if b <= 8 else max(3, args.pairs // 2)
        t = {"stock": [], "csv": []}
        same, cert = True, []
        for i in range(pairs):
            outs = {}
            for side in (("stock", "csv") if i % 2 == 0 else ("csv", "stock")):
                kw = {"csv_config": hf_csv.CSVConfig()} if side == "csv" and not args.control else {}
                torch.manual_seed(i)
                t0 = time.perf_counter()
                with torch.no_grad():
                    outs[side] = model.generate(**x, max_new_tokens=args.new_tokens, **gen, **kw)
                t[side].append(time.perf_counter() - t0)
                if side == "csv":
                    st = {} if args.control else model.csv_last_stats or {}
                    cert.append(st.get("summary", "stock (--control)"))
            same &= torch.equal(outs["stock"], outs["csv"])
        r = [c / s for c, s in zip(t["csv"], t["stock"])]
        rows.append({"batch": b, "pairs": pairs, "first": r[0], "median": statistics.median(t["csv"]) / statistics.median(t["stock"]),
                     "worst": max(r), "stock_median_s": statistics.median(t["stock"]), "csv_s": t["csv"], "stock_s": t["stock"],
                     "certified_rows": cert, "identical": same})
    return {"rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--preset", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    ap.add_argument("--load", type=int, nargs="+", default=[0, 1, 2], help="busy processes beside the benchmark")
    ap.add_argument("--pairs", type=int, default=6, help="pairs per batch size (half, at least 3, above 8 rows)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--control", action="store_true",
                    help="an A/A run: both sides stock (the ratios this machine's noise gives at each load)")
    ap.add_argument("--json")
    ap.add_argument("--child-preset", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_preset:
        print("RESULT " + json.dumps(child(args)))
        return
    out = {"cpu": cpu_info(), "control": args.control, "threads": args.threads, "dtype": args.dtype, "model": args.model,
           "new_tokens": args.new_tokens, "prompt_len": args.prompt_len, "runs": []}
    base = [sys.executable, __file__, "--model", args.model, "--dtype", args.dtype, "--threads", str(args.threads),
            "--pairs", str(args.pairs), "--new-tokens", str(args.new_tokens), "--prompt-len", str(args.prompt_len),
            "--batch", *map(str, args.batch)] + (["--control"] if args.control else [])
    for load in args.load:
        for preset in args.preset:
            with cpu_load(load):
                before = machine_load()
                res = subprocess.run(base + ["--child-preset", preset], capture_output=True, text=True,
                                     env=dict(os.environ, HF_HUB_OFFLINE="1"))
                after = machine_load()
            line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"child failed ({preset}, load {load}):\n{res.stderr[-3000:]}")
            for row in json.loads(line[7:])["rows"]:
                row.update(load=load, preset=preset, loadavg=[before["loadavg_1min"], after["loadavg_1min"]])
                out["runs"].append(row)
                print(f"load {load} {preset:9s} batch {row['batch']:3d}: first {row['first']:.2f}  median "
                      f"{row['median']:.3f}  worst {row['worst']:.2f}  stock {row['stock_median_s']:.2f} s  "
                      f"identical {row['identical']}  last csv call: {row['certified_rows'][-1]}", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
