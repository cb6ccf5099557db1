#!/usr/bin/env python
"""Which MKL code paths round differently on this host: one SHA-256 per MKL_ENABLE_INSTRUCTIONS setting.

    python scripts/mkl_paths.py            # prints "<setting>: <hash>" for the default, AVX2, AVX and SSE4_2

Each setting runs in its own process (MKL reads the variable once) and hashes 30 fp32 products: full GEMVs and
GEMMs of 5 head shapes and column subsets of them (tails, blocks, a random subset of 97 rows), the operations whose
rounding the certified head's values on S depend on (docs/certificates.md §2.0). Equal hashes: the settings run the
same arithmetic on this CPU, so one fuzzer run covers them; different hashes: each needs its own run (.ci/run runs
AVX2 and SSE4_2 besides the default).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys


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


def main() -> None:
    if "--child" in sys.argv:
        print(_digest())
        return
    for isa in ("", "AVX2", "AVX", "SSE4_2"):
        env = dict(os.environ)
        env.pop("MKL_ENABLE_INSTRUCTIONS", None)
        if isa:
            env["MKL_ENABLE_INSTRUCTIONS"] = isa
        out = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True).stdout
        print(f"{isa or 'default'}: {out.strip()}")


if __name__ == "__main__":
    main()
