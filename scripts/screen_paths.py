#!/usr/bin/env python
"""The native int8 screen per kernel path against the dense fp32 head GEMV, on this CPU (issue 37).

    python scripts/screen_paths.py [--json OUT] [--threads 1 2] [--shapes 151936x896 262144x640]

For each kernel path the CPU runs (hf_csv_kernels.native.runnable_paths; each in its own process, forced with
HF_CSV_SCREEN_PATH), each head shape and thread count, medians over --reps interleaved calls of one decode row:
the dense fp32 GEMV (``F.linear``, MKL: 4 bytes per weight), the screen alone (``native.screen_i8`` on the
interleaved codes: 1 byte per weight) and the whole certified top-1 head (``CertifiedHead.topk``). Random weights
N(0, 0.05²) and hidden states N(0, 9): the screen's speed does not depend on the values, the certified head's set
does (real heads: scripts/certify_report.py). Prints the CPU model and its VNNI/AVX-512 flags with every figure.
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

from _load import cpu_info

_CHILD = "--child"


def child(path: str, shapes: list, threads: list, reps: int) -> dict:
    import torch
    import torch.nn.functional as F

    from hf_csv.core.certificate import CertifiedHead
    from hf_csv_kernels import native
    assert native.path() == path, (native.path(), native.why_unavailable())
    out = []
    for shape in shapes:
        V, d = map(int, shape.split("x"))
        g = torch.Generator().manual_seed(0)
        W = torch.randn(V, d, generator=g) * 0.05
        h = torch.randn(1, d, generator=g) * 3
        head = CertifiedHead(W)
        while not head.ready(h):
            time.sleep(0.05)
        rows = head.provider.rows
        qi, _ = native.interleave(rows.q.contiguous())
        A = torch.randint(-127, 128, (1, d), generator=g, dtype=torch.int8)
        cr = torch.ones(1)
        for n in threads:
            torch.set_num_threads(n)
            fns = {"dense": lambda: F.linear(h, W), "screen": lambda: native.screen_i8(qi, rows.scale, A, cr, True, threads=n),
                   "certified": lambda: head.topk(h)}
            for f in fns.values():
                f(), f()
            ts = {k: [] for k in fns}
            for _ in range(reps):
                for k, f in fns.items():
                    t0 = time.perf_counter()
                    f()
                    ts[k].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) * 1e3 for k, v in ts.items()}
            out.append({"shape": shape, "threads": n, "ms": med,
                        "dense_gb_per_s": V * d * 4 / med["dense"] / 1e6, "screen_gb_per_s": V * d / med["screen"] / 1e6,
                        "screen_vs_dense_bandwidth": (V * d / med["screen"]) / (V * d * 4 / med["dense"]),
                        "certified_speedup": med["dense"] / med["certified"]})
    return {"path": path, "results": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--shapes", nargs="+", default=["151936x896", "262144x640"])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--paths", nargs="+")
    ap.add_argument(_CHILD)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.shapes, a.threads, a.reps)))
        return
    from hf_csv_kernels import native
    rep = {"cpu": cpu_info(), "load_average": os.getloadavg(), "paths": []}
    for p in a.paths or native.runnable_paths():
        env = dict(os.environ, HF_CSV_SCREEN_PATH=p)
        r = subprocess.run([sys.executable, __file__, _CHILD, p, "--threads", *map(str, a.threads), "--shapes", *a.shapes,
                            "--reps", str(a.reps)], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            rep["paths"].append({"path": p, "error": r.stderr.strip()[-800:]})
            continue
        rep["paths"].append(json.loads(r.stdout.strip().splitlines()[-1]))
    rep["load_average_after"] = os.getloadavg()
    print(json.dumps(rep, indent=1))
    if a.json:
        a.json.write_text(json.dumps(rep, indent=1) + "\n")


if __name__ == "__main__":
    main()
