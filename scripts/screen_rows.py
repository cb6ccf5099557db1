#!/usr/bin/env python
"""Calls of several rows: the certified head on hf_csv's native int8 kernel against the same head on fbgemm's pack.

    python scripts/screen_rows.py [--vocab 262144 --hidden 640] [--rows 1 2 4 8 16 32] [--threads 2] [--json OUT]

One certified head (``CertifiedHead.topk``, k = 1, fp32) on random weights N(0, 0.05²) and hidden states N(0, 9),
timed per row count with its screen forced onto each kernel, medians over --reps calls, the dense fp32 head (``F.linear``) beside them. Prints the CPU model and its
SIMD flags with the figures (docs/benchmarks.md §9.12).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_csv_kernels.screen as scr  # noqa: E402
from hf_csv.certificate import CertifiedHead  # noqa: E402
from hf_csv_kernels import native  # noqa: E402


def _median_ms(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--hidden", type=int, default=640)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    W = torch.randn(a.vocab, a.hidden, generator=g) * 0.05
    H = torch.randn(max(a.rows), a.hidden, generator=g) * 3
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
    flags = native.simd_flags()
    model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    out = {"cpu": model, "flags": flags, "path": native.path(), "threads": a.threads, "vocab": a.vocab,
           "hidden": a.hidden, "load_before": os.getloadavg(), "rows": {}}
    print(f"{model}; {' '.join(flags)}; native path {native.path()}; {a.threads} threads; head {a.vocab} x {a.hidden}")
    for n in a.rows:
        h = H[:n].contiguous()
        row = {}
        for kernel in ("native", "fbgemm"):
            # without the native codes the screen takes fbgemm's pack (one row included)
            st.native, st.packed = (nat, None) if kernel == "native" else (None, fb.packed)
            row[kernel] = _median_ms(lambda: head.topk(h), a.reps)
        st.native, st.packed = nat, None
        row["dense"] = _median_ms(lambda: F.linear(h, W), a.reps)
        out["rows"][n] = {k: round(v, 2) for k, v in row.items()}
        print(f"rows {n:3d}: native {row['native']:8.2f} ms  fbgemm {row['fbgemm']:8.2f} ms  dense {row['dense']:8.2f} ms")
    out["load_after"] = os.getloadavg()
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
