#!/usr/bin/env python
"""The compiled head alone on this CPU (docs/benchmarks.md §9.8): torch.compile(fullgraph=True) of stock's
F.linear against hf_csv's StaticTopK with the screen provider (the shipped plan), StaticTopK with the weight-only
``_weight_int8pack_mm`` screen (the plan before), and two screen formulations alone; random weights of the real
head shapes, batch 1, medians of 30 interleaved calls.

    python scripts/bench_compiled_head.py --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from hf_csv.core.bounds import ScreenProvider
from hf_csv.core.static import StaticTopK
from hf_csv_kernels.quantize import quantize_rows_int8

SHAPES = {"smollm2": (49152, 576), "qwen-0.5b": (151936, 896)}


def _cases(W: torch.Tensor, d: int) -> tuple:
    """(name, function of one row) for stock's head, the two StaticTopK plans and the two screens alone."""
    rows = quantize_rows_int8(W, progress=False)
    plan = StaticTopK(W, rows, k=1, capacity=64)
    prov = ScreenProvider(W, rows=rows)
    prov.warm(torch.randn(4, d))
    prov.state.ready.wait()
    plan2 = StaticTopK(W, rows, k=1, capacity=64, screen=prov)
    q, s = rows.q, rows.scale

    def stock(h):
        return F.linear(h, W)

    def cert(h):
        return plan(h)

    def fused(h):
        return (h[:, None, :] * q.to(torch.float32)).sum(-1) * s

    h = torch.randn(1, d)
    assert torch.equal(plan2(h).argmax(-1), F.linear(h, W).argmax(-1))
    return (("stock", stock), ("static_weight_only", cert), ("static_provider", lambda h: plan2(h)),
            ("fused_screen", fused), ("int8pack_screen", lambda h: torch._weight_int8pack_mm(h, q, s))), h, q, s


def _bench(name: str, V: int, d: int) -> None:
    """Compiles each case, then 30 interleaved rounds; prints the medians (ms) and the fused screen's error."""
    torch.manual_seed(0)
    W = torch.randn(V, d) * 0.02
    cases, h, q, s = _cases(W, d)
    fns = {}
    for k, f in cases:
        fns[k] = torch.compile(f, fullgraph=True, dynamic=False)
        for _ in range(3):
            fns[k](h)
    ts = {k: [] for k in fns}
    for r in range(30):
        for k, f in fns.items():
            t = time.perf_counter()
            f(h)
            ts[k].append(time.perf_counter() - t)
    print(name, {k: round(1e3 * statistics.median(v), 2) for k, v in ts.items()}, flush=True)
    # the fused screen's values against the exact dequantized product
    e = fns["fused_screen"](h)
    ref = h.double() @ (q.double() * s.double()[:, None]).T
    print("  fused max abs err", float((e.double() - ref).abs().max()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    torch.set_num_threads(ap.parse_args().threads)
    for name, (V, d) in SHAPES.items():
        _bench(name, V, d)


if __name__ == "__main__":
    main()
