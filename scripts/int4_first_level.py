#!/usr/bin/env python
"""How much of V a per-row int4 first-level screen leaves for a top-1 certificate (docs/benchmarks.md §9.6).

    python scripts/int4_first_level.py gemma3-270m 16     # model name under $HF_CSV_MODELS, outlier columns

Simulated in float64 on real hidden states (every second position of three prompts): 16 symmetric levels per
row over the columns outside the k largest |h_j| (kept exact), int8 activations of the rest, and Theorem 1's
Cauchy-Schwarz radius; the per-row int8 screen of the same construction for comparison. A token stays a candidate
when its upper bound reaches the largest lower bound.
"""
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
torch.set_num_threads(2)
name = sys.argv[1]
p = os.path.join(os.environ.get("HF_CSV_MODELS", os.path.expanduser("~/.cache/hf-csv-models")), name)
m = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(p)
texts = [
    "The history of the Roman empire is long and complicated, and historians have argued for centuries about",
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[len(arr) // 2]\n",
    "In a small village at the foot of the mountains there lived an old woman who"]
Hs = []
with torch.no_grad():
    for t in texts:
        ids = tok(t, return_tensors="pt").input_ids
        Hs.append(m.model(ids).last_hidden_state[0])
H = torch.cat(Hs)[::2].double()
W = m.get_output_embeddings().weight.detach().double()
V, d = W.shape
k = int(sys.argv[2]) if len(sys.argv) > 2 else 16
J = H.abs().amax(0).topk(k).indices
R = torch.ones(d, dtype=torch.bool); R[J] = False
WR = W[:, R]
for levels in (16,):
    half = (levels - 1) / 2
    s1 = WR.abs().amax(1, keepdim=True) / half
    c = torch.round(WR / s1 + half).clamp(0, levels - 1) - half
    W1 = c * s1
    e1 = (WR - W1).norm(dim=1)
    l1 = W1.abs().sum(1)
    # int8 level 2 for comparison
    s8 = WR.abs().amax(1, keepdim=True) / 127
    W8 = torch.round(WR / s8) * s8
    e8 = (WR - W8).norm(dim=1); l8 = W8.abs().sum(1)
    fr1, fr8, fr1j8 = [], [], []
    for r in range(H.shape[0]):
        h = H[r]; hR = h[R]; mR = hR.abs().max()
        A = torch.round(hR / mR * 127); Xh = A / 127 * mR
        act = mR / 127 / 2
        exJ = W[:, J] @ h[J]
        est1 = W1 @ Xh + exJ
        rad1 = e1 * hR.norm() + l1 * act
        U1, L1 = est1 + rad1, est1 - rad1
        fr1.append(float((U1 >= L1.max()).double().mean()))
        # J columns as int8 per row of their own (level 1 cheaper)
        sJ = W[:, J].abs().amax(1, keepdim=True) / 127
        WJ8 = torch.round(W[:, J] / sJ) * sJ
        eJ = (W[:, J] - WJ8).norm(dim=1)
        est1b = W1 @ Xh + WJ8 @ h[J]
        rad1b = rad1 + eJ * h[J].norm()
        fr1j8.append(float((est1b + rad1b >= (est1b - rad1b).max()).double().mean()))
        est8 = W8 @ Xh + exJ
        rad8 = e8 * hR.norm() + l8 * act
        fr8.append(float((est8 + rad8 >= (est8 - rad8).max()).double().mean()))
    import statistics as st
    q = lambda a: (round(100 * st.mean(a), 3), round(100 * sorted(a)[int(0.9 * len(a))], 3), round(100 * max(a), 3))
    print(f"{name} k={k} rows={H.shape[0]} int4 (J fp32): mean/p90/max % of V {q(fr1)}; int4 (J int8) {q(fr1j8)}; int8 {q(fr8)}")
