"""What the column-subset probe costs, per head and per row count (docs/benchmarks.md, "Value slack").

A plan that hands the values on S to stock's sampler, verify or score outputs runs only after
``CertifiedHead.subset_kernel`` probed the current setting and row count (hf_csv/core/certificate.py); a call's first row
count other than the probe's own (1, 3, 16) pays a probe on that many rows. The vLLM plugin probes each batch size
of its value-reading rows the same way (``hf_csv.vllm.probe.probe_subset_kernel``); run from vLLM's environment, the
plugin's probe here uses vLLM's own CPU GEMM dispatch as the plugin does (elsewhere ``F.linear`` stands in, and the
line says so). This script times those probes on a model's real head, each in a fresh ``CertifiedHead``
state (the probe's memo is per head), and prints one JSON line per probe::

    python scripts/probe_cost.py --model ~/.cache/hf-csv-models/qwen-coder-0.5b --rows 1 2 4 8 32 64
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from hf_csv.core.certificate import PROBE_ROWS, probe_subset_kernel
from hf_csv.vllm.probe import probe_subset_kernel as plugin_probe


def _engine_gemm(W: torch.Tensor):
    """The full call and the subset kernel the plugin probes: vLLM's CPU GEMM dispatch where vLLM is installed (the
    plugin's own :func:`hf_csv.vllm.subset.engine_subset_kernel`), else ``F.linear``."""
    try:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    except ImportError:
        return (lambda H: F.linear(H, W)), (lambda H, cols: F.linear(H, W[cols])), "F.linear stand-in"
    from hf_csv.vllm.subset import engine_subset_kernel

    head = torch.nn.Module()
    head.weight = torch.nn.Parameter(W.contiguous(), requires_grad=False)
    dispatch_cpu_unquantized_gemm(head, remove_weight=False)
    return (lambda H: head.cpu_linear(H, head.weight, None)), engine_subset_kernel(W), "vLLM's GEMM"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a causal LM directory")
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8, 32, 64], help="row counts probed one by one")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="append the lines here too")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    W = model.get_output_embeddings().weight.detach().contiguous()
    V, d = W.shape
    out = []

    def timed(what: str, rows, fn) -> None:
        t0 = time.perf_counter()
        got = fn()
        out.append({"model": args.model.rstrip("/").split("/")[-1], "V": V, "d": d, "threads": args.threads,
                    "probe": what, "rows": rows, "result": got, "seconds": round(time.perf_counter() - t0, 3)})
        print(json.dumps(out[-1]), flush=True)

    F.linear(torch.randn(1, d), W)  # the first BLAS call's own setup is not the probe's
    timed("hf_csv first probe", list(PROBE_ROWS), lambda: probe_subset_kernel(W, None))
    for n in args.rows:
        timed("hf_csv row count", [n], lambda: probe_subset_kernel(W, None, rows=(n,)))
    full, kern, gemm = _engine_gemm(W)
    timed(f"vLLM plugin first probe ({gemm})", [8, 64], lambda: plugin_probe(kern, full, d, V, W.dtype))
    for n in args.rows:
        timed(f"vLLM plugin batch size ({gemm})", [n], lambda: plugin_probe(kern, full, d, V, W.dtype, rows=n))
    if args.json:
        with open(args.json, "a") as f:
            for line in out:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
