"""Certified head with hf_csv's native int8 screen against the same head on fbgemm, one process, interleaved.

    python scripts/screen_kernel_ab.py --model DIR [--threads 2] [--tokens 40]

Real hidden states: the head inputs of a greedy generation of one code prompt (one row per step). Two
``CertifiedHead`` objects on the same head, one built while the native kernel is turned off; then per row, three
calls interleaved — native, fbgemm, stock's ``F.linear`` — over 3 passes; medians and the mean candidate set of
``topk(h, 1)``. Prints one JSON line. (Run a busy process beside it for the loaded figure.)
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_csv_kernels.screen as scr
from hf_csv.core.certificate import CertifiedHead


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=40)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(a.model)
    m = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    head = m.get_output_embeddings()
    seen = []
    hk = head.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()[0, -1:].clone()))
    with torch.no_grad():
        m.generate(**tok(["def quicksort(arr):\n    "], return_tensors="pt"), max_new_tokens=a.tokens, do_sample=False)
    hk.remove()
    H = torch.cat(seen)
    real = scr._use_native
    heads = {}
    for kind in ("native", "fbgemm"):
        scr._use_native = real if kind == "native" else (lambda rows: False)
        ch = CertifiedHead(head.weight, head.bias, num_outliers=16)
        for i in range(min(12, H.shape[0])):  # the screen is built and its columns re-chosen in these calls
            ch.topk(H[i:i + 1], 1)
        heads[kind] = ch
    scr._use_native = real
    for t in threading.enumerate():
        if t.name.startswith("hf_csv-"):
            t.join()
    res = {k: [] for k in ("native", "fbgemm", "dense")}
    size = {k: [] for k in ("native", "fbgemm")}
    for rep in range(3):
        for i in range(H.shape[0]):
            h = H[i:i + 1]
            for k in ("native", "fbgemm", "dense"):
                t0 = time.perf_counter()
                if k == "dense":
                    torch.nn.functional.linear(h, head.weight, head.bias)
                else:
                    r = heads[k].topk(h, 1)
                    if rep == 0:
                        size[k].append(int(r.mask.sum()))
                res[k].append(time.perf_counter() - t0)
    print(json.dumps({"model": a.model, "threads": a.threads, "rows": H.shape[0],
                      **{f"{k}_ms": round(statistics.median(v) * 1e3, 2) for k, v in res.items()},
                      **{f"{k}_mean_S": round(statistics.mean(v), 1) for k, v in size.items()},
                      "native_used": heads["native"].provider.state.native is not None,
                      "fbgemm_used": heads["fbgemm"].provider.state.native is None,
                      "load_before": round(__import__("os").getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
