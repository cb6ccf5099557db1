"""How wide the values' slack is against real rows' top-2 gaps (docs/certificates.md §2.0, "Values on S").

For each greedy step of a few prompts: the gap between stock's two largest logits, and the slack a certified row
would carry on them — s_i = 2·γ_{d+2}·Σ_j |W_ij h_j| (per value; the row's is the larger of the two) — next to the
looser form 2·γ_{d+2}·||W_i||_1·||h||_∞ + 2E. A row whose gap is at most the slack is left open and takes the full
head (``stats.near_ties``).

    python scripts/slack_report.py --model smollm2-135m --prompts 8 --tokens 24
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib

import numpy as np
import torch

PROMPTS = ["def fibonacci(n):\n", "The capital of France is", "import numpy as np\n\ndef softmax(x):\n",
           "Once upon a time", "SELECT name FROM users WHERE", "class Stack:\n    def __init__(self):\n",
           "The three laws of motion are", "for i in range(10):\n"]


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a prepared model name or a directory")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    d = pathlib.Path(a.model)
    if not d.is_dir():
        d = pathlib.Path(os.environ.get("HF_CSV_MODELS", "~/.cache/hf-csv-models")).expanduser() / a.model
    m = AutoModelForCausalLM.from_pretrained(d, dtype=getattr(torch, a.dtype)).eval()
    tok = AutoTokenizer.from_pretrained(d)
    W = m.get_output_embeddings().weight.detach().float()
    n = W.shape[1] + 2
    g = n * 2.0 ** -24 / (1 - n * 2.0 ** -24)
    l1 = W.abs().sum(1)
    gaps, tight, loose = [], [], []
    for p in PROMPTS[:a.prompts]:
        ids = tok(p, return_tensors="pt").input_ids
        out = m.generate(ids, max_new_tokens=a.tokens, do_sample=False, output_hidden_states=True,
                         return_dict_in_generate=True)
        for st in out.hidden_states:
            h = st[-1][0, -1].float()
            top = (W @ h).topk(2)
            i = top.indices
            gaps.append(float(top.values[0] - top.values[1]))
            tight.append(2 * 2 * float(g * (W[i].abs() @ h.abs()).max()))
            E = g * float(l1.max() * h.abs().max())
            loose.append(2 * float(g * l1[i].max() * h.abs().max()) + 2 * E)
    gaps, tight, loose = map(np.array, (gaps, tight, loose))
    print(json.dumps({"model": a.model, "dtype": a.dtype, "rows": len(gaps), "median_top2_gap": float(np.median(gaps)),
                      "median_gap_needed": float(np.median(tight)), "rows_left_open": int((gaps <= tight).sum()),
                      "median_gap_needed_loose": float(np.median(loose)),
                      "rows_left_open_loose": int((gaps <= loose).sum())}))


if __name__ == "__main__":
    main()
