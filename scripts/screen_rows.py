#!/usr/bin/env python
"""Calls of several rows: the certified head on hf_csv's native int8 kernel against the same head on fbgemm's pack.

    python scripts/screen_rows.py [--vocab 262144 --hidden 640] [--rows 1 2 4 8 16 32] [--threads 2] [--json OUT]
    python scripts/screen_rows.py --model DIR [--dtype bfloat16] ...

One certified head (``CertifiedHead.topk``, k = 1, in the weights' dtype) on random weights N(0, 0.05²) and hidden
states N(0, 9), or on a model's head and hidden states at random positions of the prompts of ``prompts.jsonl`` (``--model``),
timed per row count with its screen forced onto each kernel, medians over --reps calls, the dense fp32 head (``F.linear``) beside them. Prints the CPU model and its
SIMD flags with the figures (docs/benchmarks.md §9.12).
"""
from __future__ import annotations

import argparse
import json
import os
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

import hf_csv_kernels.screen as scr  # noqa: E402
from hf_csv.core.certificate import CertifiedHead  # noqa: E402
from hf_csv_kernels import native  # noqa: E402

from _load import cpu_info  # noqa: E402
from _timing import median_ms  # noqa: E402
from vllm_exactness import PROMPTS, load_prompts  # noqa: E402  (the prompts and their loader)


def _median_ms(fn, reps: int) -> float:
    for _ in range(2):  # warm: the first calls of a shape allocate
        fn()
    return median_ms(fn, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--hidden", type=int, default=640)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--model", help="a model directory: its head and real hidden states")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    if a.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dt = getattr(torch, a.dtype)
        tok = AutoTokenizer.from_pretrained(a.model)
        m = AutoModelForCausalLM.from_pretrained(a.model, dtype=dt).eval()
        prompts = load_prompts(str(PROMPTS), 16)
        with torch.no_grad():  # every position of the prompts; a call's rows are positions drawn at random, as the
            # rows of a decode batch are requests at different places of different prompts
            allh = torch.cat([m.model(**tok(p, return_tensors="pt")).last_hidden_state[0] for p in prompts])
        H = allh[torch.randperm(allh.shape[0], generator=g)[:max(a.rows)]].contiguous()
        W = m.lm_head.weight.detach()
        a.vocab, a.hidden = W.shape
    else:
        W = torch.randn(a.vocab, a.hidden, generator=g) * 0.05
        H = torch.randn(max(a.rows), a.hidden, generator=g) * 3
    out_dtype = None if W.dtype == torch.float32 else W.dtype
    head = CertifiedHead(W, tune_threads=False)
    head.prepare(H[:1])
    st = head.provider.state
    if st.native is None:
        raise SystemExit(f"the native kernel does not serve here: {native.why_unavailable()}")
    nat = st.native
    fb = scr.prepare_screen(st.rows, st.outlier_cols, native=False, weight=W)  # fbgemm's pack of the same codes
    for t in threading.enumerate():  # its consolidation into one pack runs in the background: let it finish
        if t.name.startswith("hf_csv-"):
            t.join()
    cpu = cpu_info()
    model, flags = cpu["model"], cpu["flags"]
    out = {"cpu": model, "flags": flags, "path": native.path(), "threads": a.threads, "model": a.model,
           "dtype": str(W.dtype), "vocab": a.vocab,
           "hidden": a.hidden, "load_before": os.getloadavg(), "rows": {}}
    print(f"{model}; {' '.join(flags)}; native path {native.path()}; {a.threads} threads; head {a.vocab} x {a.hidden}")
    for n in a.rows:
        h = H[:n].contiguous()
        row = {}
        for kernel in ("native", "fbgemm"):
            # without the native codes the screen takes fbgemm's pack (one row included)
            st.native, st.packed = (nat, None) if kernel == "native" else (None, fb.packed)
            row[kernel] = _median_ms(lambda: head.topk(h, out_dtype=out_dtype), a.reps)
            row[kernel + "_subvocab"] = head.topk(h, out_dtype=out_dtype).stats.mean_subvocab_fraction
        st.native, st.packed = nat, None
        row["dense"] = _median_ms(lambda: F.linear(h, W), a.reps)  # stock's head, in the weights' dtype
        out["rows"][n] = {k: (round(v, 2) if "subvocab" not in k else v) for k, v in row.items()}
        print(f"rows {n:3d}: native {row['native']:8.2f} ms (|S| {100 * row['native_subvocab']:.4f} % of V)  fbgemm "
              f"{row['fbgemm']:8.2f} ms (|S| {100 * row['fbgemm_subvocab']:.4f} %)  dense {row['dense']:8.2f} ms")
    out["load_after"] = os.getloadavg()
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
