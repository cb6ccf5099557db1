#!/usr/bin/env python
"""Which MKL code paths round differently on this host: one SHA-256 per MKL_ENABLE_INSTRUCTIONS setting.

    python scripts/mkl_paths.py            # prints "<setting>: <hash>" for the default, AVX2, AVX and SSE4_2
    python scripts/mkl_paths.py --subsets  # one JSON line per setting (default, AVX512, AVX2, SSE4_2): the kernel
                                           # the column-subset probe picks and how many probed subsets differ
    python scripts/mkl_paths.py --subsets --model $M/whisper-base ...  # the same on those models' real heads too
    python scripts/mkl_paths.py --probe-cost --model $M/smollm2-135m ...  # the probe's wall time per row count

Each setting runs in its own process (MKL reads the variable once) and hashes 30 fp32 products: full GEMVs and
GEMMs of 5 head shapes and column subsets of them (tails, blocks, a random subset of 97 rows), the operations whose
rounding the certified head's values on S depend on (docs/certificates.md §2.0). Equal hashes: the settings run the
same arithmetic on this CPU, so one fuzzer run covers them; different hashes: each needs its own run (.ci/run runs
AVX2 and SSE4_2 besides the default).

``--subsets``: the plans that hand the values on S to stock's own sampler, verify or score outputs need a column
subset of the head computed bit for bit as the full call does (docs/certificates.md §2.0); ``CertifiedHead.subset_exact``
probes its kernels for it once per head and setting (``F.linear`` on the gathered rows, then on the aligned blocks
of 8, 16, 32 and 64 rows that hold them: the first that matches), and where none matches those plans run the full
head. Per setting and random head (the shapes of a small test head, SmolLM2, whisper-base and Qwen2.5), and per
``--model`` on its real output head as loaded (its address modulo 64 bytes beside it), the kernel the probe picks
and, for each kernel, how many of the probe's 117 subsets (1 to 257 columns, random, the tail and a block; 1, 3 and
16 rows) differ from the full call.
"""
from __future__ import annotations

import argparse
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

    from hf_csv.core.certificate import SUBSET_KERNELS, probe_subset_kernel, subset_mismatches

    def nowhere(H: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:  # differs on every subset: counts them
        return torch.full((H.shape[0], cols.numel()), float("nan"))

    def counts(W: torch.Tensor) -> dict:  # the package's own probe, counted to the end for each kernel, and its pick
        return {"kernel": probe_subset_kernel(W, None),
                **{f"{name}_differing": subset_mismatches(W, None, make(W, None), first=False)
                   for name, make in SUBSET_KERNELS.items()}}

    torch.manual_seed(0)
    res = {}
    for V, d in [(4099, 64), (49152, 576), (51865, 512), (151936, 896)]:
        W = torch.randn(V, d)
        res[f"{V}x{d}"] = counts(W)
    for path in filter(None, os.environ.get("HF_CSV_SUBSET_MODELS", "").split(os.pathsep)):
        import transformers as tf

        whisper = tf.AutoConfig.from_pretrained(path).model_type == "whisper"
        auto = tf.AutoModelForSpeechSeq2Seq if whisper else tf.AutoModelForCausalLM
        W = auto.from_pretrained(path, dtype=torch.float32).get_output_embeddings().weight.detach()
        res[Path(path).name] = {"shape": list(W.shape), "address_mod_64": W.data_ptr() % 64, **counts(W)}
    return json.dumps({"MKL_ENABLE_INSTRUCTIONS": os.environ.get("MKL_ENABLE_INSTRUCTIONS", "default"),
                       "threads": torch.get_num_threads(), "subsets": subset_mismatches(W, None, nowhere, first=False), **res})


def _probe_cost(paths: list, threads: int) -> None:
    """Per model's output head: the dense GEMV's time (and GB/s), and the column-subset probe's wall time and pick on
    1 row (a decode step's shape probe), 8 rows (a batch of 8) and the probe's own 1, 3 and 16 rows, best of two."""
    import statistics
    import time

    import torch
    import torch.nn.functional as F
    import transformers as tf

    from hf_csv.core.certificate import probe_subset_kernel

    torch.set_num_threads(threads)
    for path in paths:
        W = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).get_output_embeddings().weight.detach()
        h = torch.randn(1, W.shape[1])
        ts = []
        for _ in range(13):
            t0 = time.perf_counter()
            F.linear(h, W)
            ts.append(time.perf_counter() - t0)
        gemv = statistics.median(ts[3:])
        row = {"model": Path(path).name, "shape": list(W.shape), "threads": threads, "gemv_ms": 1e3 * gemv,
               "gemv_GBps": W.numel() * 4 / gemv / 1e9}
        for rows in ((1,), (8,), (1, 3, 16)):
            best, kernel = float("inf"), None
            for _ in range(2):
                t0 = time.perf_counter()
                kernel = probe_subset_kernel(W, None, rows=rows)
                best = min(best, time.perf_counter() - t0)
            row[f"rows{'_'.join(map(str, rows))}"] = {"ms": 1e3 * best, "gemvs": best / gemv, "kernel": kernel}
        print(json.dumps(row), flush=True)


def _in_child(isa: str, mode: str) -> str:
    """``mode``'s output in a fresh process with ``MKL_ENABLE_INSTRUCTIONS=isa`` ("": MKL's own choice)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    env.pop("MKL_ENABLE_INSTRUCTIONS", None)
    if isa:
        env["MKL_ENABLE_INSTRUCTIONS"] = isa
    out = subprocess.run([sys.executable, __file__, "--child", mode], env=env, capture_output=True, text=True)
    return out.stdout.strip() or (out.stderr.strip().splitlines() or ["no output"])[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description="Which MKL code paths round differently on this host (see the module "
                                             "docstring).")
    ap.add_argument("--subsets", action="store_true", help="the column-subset probe's counts per setting (JSON lines)")
    ap.add_argument("--model", action="append", default=[], help="with --subsets: also this model's real head "
                                                                   "(repeatable)")
    ap.add_argument("--probe-cost", action="store_true", help="the column-subset probe's wall time per --model "
                                                                 "(causal LMs) on 1, 8 and 1+3+16 rows, beside the GEMV")
    ap.add_argument("--threads", type=int, default=2, help="with --probe-cost")
    ap.add_argument("--child", choices=("digest", "subsets"), help=argparse.SUPPRESS)  # one setting's own process
    args = ap.parse_args()
    if args.probe_cost:
        _probe_cost(args.model, args.threads)
        return
    if args.child:
        print(_subsets() if args.child == "subsets" else _digest())
        return
    if args.subsets:
        os.environ["HF_CSV_SUBSET_MODELS"] = os.pathsep.join(args.model)
        for isa in ("", "AVX512", "AVX2", "SSE4_2"):
            print(_in_child(isa, "subsets"))
        return
    for isa in ("", "AVX2", "AVX", "SSE4_2"):
        print(f"{isa or 'default'}: {_in_child(isa, 'digest')}")

if __name__ == "__main__":
    main()
