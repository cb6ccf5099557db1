#!/usr/bin/env python
"""Certification report: run real text through a model and certify its final hidden states.

    python scripts/certify_report.py --model DIR --provider {screen,cluster} --json OUT.json

Writes JSON with provider, positions, certified_fraction (top-1), mean/p99 sub-vocabulary
fraction, violations (tokens whose exact logit exceeds its upper bound: must be 0),
head_ms_dense / head_ms_certified (medians, timed interleaved in the same run, one row at a
time as in decoding), head_speedup_vs_dense and identical_top1; and a PNG histogram.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

REPO = Path(__file__).resolve().parents[1]

from hf_csv.core.certificate import CertifiedHead  # noqa: E402
from hf_csv.hub.artifact import CSVArtifact  # noqa: E402
from hf_csv_kernels import native  # noqa: E402

from _load import cpu_load, machine_load  # noqa: E402
from _timing import median_ms  # noqa: E402

DEFAULT_PROMPTS = REPO.parent / "shared" / "models" / "prompts.jsonl"


def load_text(path: Path) -> str:
    if path.suffix == ".jsonl":
        return "\n\n".join(json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip())
    return path.read_text()


@torch.no_grad()
def hidden_states(model_dir: str, text: str, positions: int, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    ids = tok(text, return_tensors="pt").input_ids[:, :positions]
    out = model(ids, output_hidden_states=True, logits_to_keep=0)
    H = out.hidden_states[-1][0]  # transformers: the last entry is after the final norm
    head = model.get_output_embeddings()
    # sanity: the head applied to H reproduces the model's logits
    ref = out.logits[0].float()
    chk = (H.float() @ head.weight.float().T)
    if getattr(head, "bias", None) is not None:
        chk += head.bias.float()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if softcap:
        chk = torch.tanh(chk / softcap) * softcap
    if not torch.allclose(chk, ref, atol=1e-2 * max(1.0, ref.abs().max().item()), rtol=1e-3):
        raise RuntimeError("hidden states do not reproduce the model's logits; cannot certify this model")
    return H, head.weight.detach(), (head.bias.detach() if getattr(head, "bias", None) is not None else None), model


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model directory (HF format)")
    ap.add_argument("--provider", choices=["screen", "cluster"], default="screen")
    ap.add_argument("--quant", choices=["int8", "fp8"], default="int8",
                    help="screen row format (fp8 = e4m3; on CPU it runs the weight-only reference)")
    ap.add_argument("--index", help="index directory for the cluster provider (built if missing)")
    ap.add_argument("--num-clusters", type=int, default=None)
    ap.add_argument("--text", type=Path, default=DEFAULT_PROMPTS, help="text or prompts.jsonl")
    ap.add_argument("--positions", type=int, default=300)
    ap.add_argument("--timing-rows", type=int, default=40, help="head calls timed (each on --batch positions)")
    ap.add_argument("--batch", type=int, default=1, help="positions per timed head call (decoding at batch B)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--load", type=int, default=0, help="busy CPU processes during the timing")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--png", type=Path, default=None)
    return ap.parse_args(argv)


def _cluster_index(args: argparse.Namespace, W: torch.Tensor, b):
    """The cluster provider's index: read from ``--index``, or built (and saved there if given)."""
    if args.index and Path(args.index).is_dir():
        return CSVArtifact.from_pretrained(args.index).index
    art = CSVArtifact.build(W, b, screen=False, index=True, num_clusters=args.num_clusters)
    if args.index:
        art.save_pretrained(args.index)
    return art.index


def _timings(head: CertifiedHead, H: torch.Tensor, args: argparse.Namespace) -> tuple[list, list, list]:
    """Median ms per call of the dense head, the certified top-1 call and (screen provider) the screen alone, on
    ``--timing-rows`` calls of ``--batch`` rows each, interleaved, under ``--load``."""
    B = max(1, args.batch)
    starts = torch.linspace(0, len(H) - B, args.timing_rows).long()
    groups = [H[int(i): int(i) + B] for i in starts]
    dense_fn = head.stock  # what nn.Linear computes, in the head's dtype
    dense_ms, cert_ms, screen_ms = [], [], []
    with cpu_load(args.load):
        for h in groups:  # interleaved, one decode-like call of B rows at a time
            dense_fn(h), head.topk(h)
            dense_ms.append(median_ms(lambda: dense_fn(h), args.reps))
            cert_ms.append(median_ms(lambda: head.topk(h), args.reps))
            if args.provider == "screen":  # the screen alone: int8 GEMV + bounds, for its bandwidth
                screen_ms.append(median_ms(lambda: head.provider(h), args.reps))
    return dense_ms, cert_ms, screen_ms


def _histogram(sizes: torch.Tensor, report: dict, args: argparse.Namespace) -> None:
    """The certified sub-vocabulary sizes as a PNG (``--png``, else beside the JSON); skipped without matplotlib."""
    png = args.png or args.json.with_suffix(".png")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.hist((sizes * 100).numpy(), bins=50)
        ax.set_xlabel("sub-vocabulary size (% of V)")
        ax.set_ylabel("positions")
        ax.set_title(f"{report['model']} / {args.provider}: certified top-1 sub-vocabulary")
        fig.tight_layout()
        fig.savefig(png, dpi=100)
    except ImportError:
        pass


def main(argv=None) -> dict:
    args = _args(argv)
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    before = machine_load()
    H, W, b, model = hidden_states(args.model, load_text(args.text), args.positions, dtype)
    H = H.float()
    index = _cluster_index(args, W, b) if args.provider == "cluster" else None
    t0 = time.perf_counter()
    kw = {"quant": args.quant} if args.provider == "screen" else {}
    head = CertifiedHead(W, b, provider=args.provider, index=index, budget=1.0, **kw)
    setup_s = time.perf_counter() - t0
    if args.provider == "screen":
        head.provider.calibrate(H[: min(32, len(H))])

    full = head.full(H)
    _, U = head.provider(H)
    violations = int((full > U).sum())
    res = head.topk(H, k=1)
    st = res.stats
    identical = bool(torch.equal(res.logits.argmax(1), full.argmax(1)))
    sizes = torch.tensor(st.subvocab_sizes, dtype=torch.float64) / head.vocab_size

    dense_ms, cert_ms, screen_ms = _timings(head, H, args)
    ratios = [d / c for d, c in zip(dense_ms, cert_ms)]
    V_, d_ = W.shape
    dense_bytes = V_ * d_ * W.element_size()
    screen_bytes = V_ * d_ * 1  # one byte per weight (int8 / fp8 codes)
    report = {
        "model": Path(args.model).name, "provider": args.provider, "dtype": args.dtype,
        "quant": args.quant if args.provider == "screen" else None,
        "kernel_backend": os.environ.get("HF_CSV_KERNELS", "auto"),
        # the native int8 screen's path (avx512vnni / avxvnni / avx2; None: fbgemm or not the screen) and the CPU's
        # flags that choose it, so a figure names its host
        "screen_path": native.path(), "cpu_flags": native.simd_flags(),
        "vocab_size": head.vocab_size, "hidden_size": head.hidden_size, "positions": int(len(H)),
        "certified_fraction": st.certified_fraction,
        "mean_subvocab_fraction": float(sizes.mean()) if len(sizes) else float("nan"),
        "p99_subvocab_fraction": float(sizes.quantile(0.99)) if len(sizes) else float("nan"),
        "max_subvocab_fraction": float(sizes.max()) if len(sizes) else float("nan"),
        "violations": violations, "identical_top1": identical, "near_ties": st.near_ties,
        "mean_bound_radius": st.as_dict()["mean_bound_radius"],
        "head_ms_dense": statistics.median(dense_ms), "head_ms_certified": statistics.median(cert_ms),
        "head_speedup_vs_dense": statistics.median(ratios),
        # achieved bandwidth: bytes of the weight read per call / time (dense: the head's dtype; screen: codes)
        "dense_gb_per_s": dense_bytes / statistics.median(dense_ms) / 1e6,
        "screen_ms": statistics.median(screen_ms) if screen_ms else None,
        "screen_gb_per_s": screen_bytes / statistics.median(screen_ms) / 1e6 if screen_ms else None,
        "provider_setup_s": setup_s, "torch_threads": torch.get_num_threads(),
        "load": args.load, "batch": max(1, args.batch), "machine_before": before,
    }
    if index is not None:
        report["num_clusters"] = index.config.num_clusters
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    _histogram(sizes, report, args)
    print(json.dumps(report, indent=2))
    return report

if __name__ == "__main__":
    main()
