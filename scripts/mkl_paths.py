#!/usr/bin/env python
"""Which MKL code paths round differently on this host: one SHA-256 per MKL_ENABLE_INSTRUCTIONS setting.

    python scripts/mkl_paths.py            # prints "<setting>: <hash>" for the default, AVX2, AVX and SSE4_2
    python scripts/mkl_paths.py --subsets  # one JSON line per setting (default, AVX512, AVX2, SSE4_2): the column-
                                           # subset probe's answer and how many probed subsets differ

Each setting runs in its own process (MKL reads the variable once) and hashes 30 fp32 products: full GEMVs and
GEMMs of 5 head shapes and column subsets of them (tails, blocks, a random subset of 97 rows), the operations whose
rounding the certified head's values on S depend on (docs/certificates.md §2.0). Equal hashes: the settings run the
same arithmetic on this CPU, so one fuzzer run covers them; different hashes: each needs its own run (.ci/run runs
AVX2 and SSE4_2 besides the default).

``--subsets``: the plans that hand the values on S to stock's own sampler, verify or score outputs need a column
subset of the head computed bit for bit as the full call does (docs/certificates.md §2.0); ``CertifiedHead.subset_exact``
probes it once per head and setting, and where it fails those plans run the full head. Per setting, the probe's answer
on two random heads (4,099 × 64 and 151,936 × 896) and, over the same kind of subsets (1 to 257 columns, random and
the tail, one row and three), how many differ from the full call.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _digest() -> str:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    h = hashlib.sha256()
    for V, d in [(4099, 64), (1000, 576), (257, 896), (33, 384), (5000, 640)]:
        W, x = torch.randn(V, d), torch.randn(3, d)
        for cols in (slice(None), slice(0, 17), slice(5, 200)):
            h.update(F.linear(x[:1], W[cols]).numpy().tobytes())
            h.update(F.linear(x, W[cols]).numpy().tobytes())
        h.update(F.linear(x[:1], W[torch.randperm(V)[:97]]).numpy().tobytes())
    return h.hexdigest()[:16]


def _subsets() -> str:
    import torch
    import torch.nn.functional as F

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
    return json.dumps({"MKL_ENABLE_INSTRUCTIONS": os.environ.get("MKL_ENABLE_INSTRUCTIONS", "default"),
                       "threads": torch.get_num_threads(), **res})


def _in_child(isa: str, mode: str) -> str:
    """``mode``'s output in a fresh process with ``MKL_ENABLE_INSTRUCTIONS=isa`` ("": MKL's own choice)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    env.pop("MKL_ENABLE_INSTRUCTIONS", None)
    if isa:
        env["MKL_ENABLE_INSTRUCTIONS"] = isa
    out = subprocess.run([sys.executable, __file__, "--child", mode], env=env, capture_output=True, text=True)
    return out.stdout.strip() or (out.stderr.strip().splitlines() or ["no output"])[-1]


def main() -> None:
    if "--child" in sys.argv:
        print(_subsets() if sys.argv[-1] == "subsets" else _digest())
        return
    if "--subsets" in sys.argv:
        for isa in ("", "AVX512", "AVX2", "SSE4_2"):
            print(_in_child(isa, "subsets"))
        return
    for isa in ("", "AVX2", "AVX", "SSE4_2"):
        print(f"{isa or 'default'}: {_in_child(isa, 'digest')}")


if __name__ == "__main__":
    main()
