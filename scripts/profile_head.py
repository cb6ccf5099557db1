#!/usr/bin/env python
"""Where a certified top-1 head call spends its time (torch.profiler), against the dense head.

    python scripts/profile_head.py [--vocab 151936 --hidden 1536 --dtype bf16 --rows 1]

Prints the profiler's top operators by device time (CUDA) or CPU time, the number of kernel launches and of
device-to-host synchronisations per call. Random weights (N(0, 0.05²)), hidden states N(0, 9): the set S is small.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from hf_csv.core.certificate import CertifiedHead  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    W = (torch.randn(a.vocab, a.hidden, device=dev, generator=g) * 0.05).to(dt)
    h = (torch.randn(a.rows, a.hidden, device=dev, generator=g) * 3).to(dt)
    head = CertifiedHead(W)
    od = dt if dt != torch.float32 else None
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    for _ in range(3):
        head.topk(h, out_dtype=od), F.linear(h, W)
    sync()
    for name, fn in (("dense", lambda: F.linear(h, W)), ("certified", lambda: head.topk(h, out_dtype=od))):
        ts = []
        for _ in range(a.reps):
            sync(); t0 = time.perf_counter(); fn(); sync(); ts.append(time.perf_counter() - t0)
        ts.sort()
        print(f"{name}: median {ts[len(ts) // 2] * 1e3:.3f} ms over {a.reps}")
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(5):
            head.topk(h, out_dtype=od)
        sync()
    ka = prof.key_averages()
    key = "self_device_time_total" if dev == "cuda" else "self_cpu_time_total"
    print(ka.table(sort_by=key, row_limit=25))
    print(ka.table(sort_by="self_cpu_time_total", row_limit=25))
    n_sync = sum(e.count for e in ka if e.key in ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize",
                                                    "cudaDeviceSynchronize", "aten::nonzero"))
    n_launch = sum(e.count for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                      "cudaLaunchKernelExC"))
    print(f"per call: ~{n_launch / 5:.0f} kernel launches, ~{n_sync / 5:.0f} host syncs (item/nonzero)")


if __name__ == "__main__":
    main()
