#!/usr/bin/env python
"""Per-kernel timings against the stock torch path.

    python scripts/bench_kernels.py --json OUT.json [--vocab 151936 --hidden 1536]

On CUDA: the Triton screen + exact recompute (CertifiedHead.topk; int8 and fp8 e4m3 rows) against the
dense bf16 head GEMV,
each Triton kernel against its torch reference, medians over --reps, and achieved bandwidth as a
fraction of the device's peak (table below; unknown devices report null). Without CUDA it times the
CPU path (fbgemm screen) against the fp32 dense head and says that GPU timings were not measured.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hf_csv.core.certificate import CertifiedHead  # noqa: E402

PEAK_GBS = {"H100": 3350.0, "H200": 4800.0, "A100": 2039.0, "L4": 300.0}


def timed(fn, reps: int) -> float:
    cuda = torch.cuda.is_available()
    fn()
    ts = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    V, d = a.vocab, a.hidden
    g = torch.Generator(device=dev).manual_seed(0)
    W = torch.randn(V, d, device=dev, generator=g) * 0.05
    h = torch.randn(1, d, device=dev, generator=g) * 3
    head = CertifiedHead(W)
    rep: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "vocab": V, "hidden": d, "gpu": cuda}
    if cuda:
        Wb = W.bfloat16()
        hb = h.bfloat16()
        dense = timed(lambda: hb @ Wb.T, a.reps)
        cert = timed(lambda: head.topk(h), a.reps)
        peak = next((v for k, v in PEAK_GBS.items() if k in rep["device"]), None)
        head8 = CertifiedHead(W, quant="fp8")
        cert8 = timed(lambda: head8.topk(h), a.reps)
        rep.update({"screen_fp8_recompute_ms": cert8, "speedup_fp8_vs_bf16": dense / cert8})
        rep.update({"dense_bf16_ms": dense, "screen_recompute_ms": cert, "speedup_vs_bf16": dense / cert,
                    "dense_bandwidth_frac": (V * d * 2 / dense / 1e6) / peak if peak else None,
                    "screen_bandwidth_frac": (V * d / cert / 1e6) / peak if peak else None})
        import hf_csv_kernels.triton_ops as T
        from hf_csv_kernels.residual import residual_race_reference, row_logsumexp_reference
        X = torch.randn(9, V, device=dev)
        rep["row_logsumexp_ms"] = {"triton": timed(lambda: T.row_logsumexp(X), a.reps),
                                   "torch": timed(lambda: row_logsumexp_reference(X), a.reps)}
        E = torch.empty(V, device=dev).exponential_()
        rep["residual_race_ms"] = {"triton": timed(lambda: T.residual_race(X[0], X[1], 0.0, 0.0, E), a.reps),
                                   "torch": timed(lambda: residual_race_reference(X[0], X[1], 0.0, 0.0, E), a.reps)}
    else:
        head.provider.calibrate(h)
        dense = timed(lambda: h @ W.T, a.reps)
        cert = timed(lambda: head.topk(h), a.reps)
        rep.update({"dense_fp32_ms": dense, "screen_recompute_cpu_ms": cert, "speedup_vs_fp32": dense / cert,
                    "note": "no CUDA device: GPU timings not yet measured (Triton kernels are "
                            "correctness-tested under TRITON_INTERPRET=1)"})
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(rep, indent=2) + "\n")
    print(json.dumps(rep, indent=2))


if __name__ == "__main__":
    main()
