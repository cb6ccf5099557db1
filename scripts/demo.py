#!/usr/bin/env python
"""hf_csv demo: the certified LM head on a real model — the gain, the proof that nothing changed, the stats.

    python scripts/demo.py                                   # HuggingFaceTB/SmolLM2-135M-Instruct from the Hub
    python scripts/demo.py --model ~/.cache/hf-csv-models/smollm2-135m   # offline (../shared/models/prepare.py ci)
    python scripts/demo.py --model google/gemma-3-270m       # a 262k vocabulary: the head is most of a step

What it prints, all measured in this run (medians over interleaved runs, this machine, fp32, batch 1):

1. **The head alone**: stock's LM head (one GEMV over all V rows) against hf_csv's certified head (int8 screen
   + the exact logits of the few tokens the certificate keeps) on the model's own hidden states. This is the
   part hf_csv speeds up.
2. **Whole generate calls**: stock greedy against certified greedy, with a check that the tokens are identical.
   The end-to-end gain is capped by the head's share of a decode step, which the demo measures and prints:
   on a small-vocabulary model (SmolLM2: 49k tokens, 30 layers) the head is a small share, on Gemma-3
   (262k tokens) most of it.
3. **The stats** of each certified call, one line: certified rows over all head rows, why any row used the
   full head, and the mean certified sub-vocabulary as a share of V.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from _timing import median_ms

PROMPTS = (
    "The three laws of thermodynamics say that",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "A short story about a lighthouse keeper who finds a message in a bottle:",
)
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _load(name: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).eval()
    except OSError as e:  # no network / no such directory: say what to do, in one line
        local = not Path(name).expanduser().exists() and "/" in name
        raise SystemExit(
            f"could not load {name!r} ({type(e).__name__}). "
            + ("Offline? Prepare the local copy with `python ../shared/models/prepare.py ci` and run "
               "`python scripts/demo.py --model ~/.cache/hf-csv-models/smollm2-135m`." if local else
               "Pass a Hub id or a directory with config.json and weights.")) from None
    return tok, model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="Hub id or local directory of a causal LM")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3, help="interleaved stock / certified calls per prompt")
    args = ap.parse_args()

    import hf_csv
    from hf_csv import CertifiedHead, CSVConfig
    tok, model = _load(args.model)
    head_w = model.get_output_embeddings().weight.detach()
    V, d = head_w.shape
    print(f"model: {args.model}  (V = {V:,}, hidden {d}, fp32, {torch.get_num_threads()} threads)\n")

    # 1. the head alone, on this model's own last-layer hidden states (every prompt position)
    with torch.no_grad():
        H = torch.cat([model(**tok(p, return_tensors="pt"), output_hidden_states=True).hidden_states[-1][0]
                       for p in PROMPTS]).float()
        t0 = time.perf_counter()
        ch = CertifiedHead(head_w, model.get_output_embeddings().bias)
        build_s = time.perf_counter() - t0
        h1 = H[-1:]
        ch.topk(h1), ch.stock(h1)  # first calls (lazy kernel setup) are not the steady state
        full_ms, cert_ms = [], []
        for i in range(0, len(H), max(1, len(H) // 12)):  # interleaved, one decode-like row at a time
            h = H[i:i + 1]
            full_ms.append(median_ms(lambda: ch.stock(h), 20))
            cert_ms.append(median_ms(lambda: ch.topk(h, k=1), 20))
        res = ch.topk(H, k=1)
        same_top1 = torch.equal(res.logits.argmax(-1), ch.stock(H).argmax(-1))
    fm, cm = statistics.median(full_ms), statistics.median(cert_ms)
    st = res.stats
    print("1. the LM head alone (what hf_csv replaces), one row per call:")
    print(f"   stock head {fm:.3f} ms   certified head {cm:.3f} ms   -> {fm / cm:.2f}x "
          f"(screen built in {build_s:.2f} s, once per model)")
    print(f"   {len(H)} positions: certified {st.certified}/{st.rows}, top-1 identical to stock: {same_top1}, "
          f"mean sub-vocabulary {100 * st.mean_subvocab_fraction:.3g} % of V "
          f"({st.mean_subvocab_fraction * V:.1f} tokens)\n")

    # 2. whole generate calls
    model = hf_csv.enable(model)  # the one call that makes `csv_config=` work
    cfg = CSVConfig()
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    t_stock, t_csv, all_same, lines = [], [], True, []
    for p in PROMPTS:
        inputs = tok(p, return_tensors="pt")
        model.generate(**inputs, max_new_tokens=2)  # warm both paths once (first-call costs are not the subject)
        model.generate(**inputs, max_new_tokens=2, csv_config=cfg)
        for _ in range(args.runs):
            t0 = time.perf_counter()
            ref = model.generate(**inputs, **gen)
            t_stock.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            out = model.generate(**inputs, **gen, csv_config=cfg, return_dict_in_generate=True)
            t_csv.append(time.perf_counter() - t0)
            all_same &= torch.equal(ref, out.sequences)
        text = tok.decode(out.sequences[0, inputs.input_ids.shape[1]:], skip_special_tokens=True)
        lines.append((p, text, out.csv_stats["summary"]))
    ts, tc = statistics.median(t_stock), statistics.median(t_csv)
    step_ms = 1e3 * ts / args.new_tokens
    print(f"2. generate, greedy, {args.new_tokens} new tokens, {len(PROMPTS)} prompts x {args.runs} interleaved runs:")
    for p, text, summary in lines:
        print(f"   {p[:48]!r:52} -> {text[:40]!r}")
        print(f"      {summary}")
    print(f"   identical to stock greedy: {all_same}")
    print(f"   median call: stock {ts:.2f} s, certified {tc:.2f} s -> {ts / tc:.2f}x")
    print(f"   the head is {100 * fm / step_ms:.0f} % of a stock decode step here ({fm:.2f} of {step_ms:.1f} ms), "
          f"so no head speedup can make this call more than {1 / max(1e-9, 1 - fm / step_ms):.2f}x faster")
    if not all_same:
        sys.exit("tokens differ from stock greedy")


if __name__ == "__main__":
    main()
