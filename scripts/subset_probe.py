#!/usr/bin/env python
"""Whether this host's BLAS computes a column subset of a head bit for bit as the full call does, per MKL setting.

    python scripts/subset_probe.py        # one JSON line per MKL_ENABLE_INSTRUCTIONS setting

The plans that hand the values on S to stock's own sampler, verify or score outputs need that property
(docs/certificates.md §2.0); ``CertifiedHead.subset_exact`` probes it once per head and setting, and where it fails
those plans run the full head. This script prints the probe's answer on two random heads (4,099 × 64 and
151,936 × 896) and, over the same kind of subsets (1 to 257 columns, random and the tail, one row and three), how
many differ from the full call. Each setting runs in its own process (MKL reads the variable once).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r'''
import json, os, torch, torch.nn.functional as F
from hf_csv.certificate import _probe_subsets
torch.manual_seed(0)
res = {}
for V, d in [(4099, 64), (151936, 896)]:
    W = torch.randn(V, d)
    g = torch.Generator().manual_seed(1)
    bad = tot = 0
    for rows in (1, 3):
        H = torch.randn(rows, d, generator=g)
        full = F.linear(H, W)
        for n in (1, 2, 3, 5, 7, 8, 16, 17, 33, 64, 96, 129, 257):
            for cols in (torch.randperm(V, generator=g)[:n].sort().values, torch.arange(V - n, V)):
                tot += 1
                bad += int(not torch.equal(F.linear(H, W[cols]), full[:, cols]))
    res[f"{V}x{d}"] = {"probe_passes": _probe_subsets(W, None), "subsets_differing": bad, "subsets": tot}
print(json.dumps({"MKL_ENABLE_INSTRUCTIONS": os.environ.get("MKL_ENABLE_INSTRUCTIONS", "default"),
                  "threads": torch.get_num_threads(), **res}))
'''


def main() -> None:
    for setting in (None, "AVX512", "AVX2", "SSE4_2"):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
        if setting:
            env["MKL_ENABLE_INSTRUCTIONS"] = setting
        out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
        print(out.stdout.strip() or out.stderr.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
