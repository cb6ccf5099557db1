#!/usr/bin/env python
"""Benchmark of the speculative-sampling verify step: stock vs hf_csv exact vs hf_csv sigmoid.

Part 1 (this file): the verify step alone, as transformers calls it
(``_speculative_sampling(candidate_input_ids, candidate_logits, L, new_logits)``), on synthetic
LM-like logits for V in {49152, 151936, 262144} and draft lengths 1..8; median wall times,
ratios to stock measured in the same run (calls interleaved round-robin), plus the sigmoid mode's
quality (acceptance rate and total-variation distance of its first emitted token from the target
distribution), analytically, on a real target/draft pair when available.

Part 2 (``--part2``, ``--part2-only``): end-to-end assisted generation on a real target/draft pair,
:func:`bench_end_to_end` (greedy, merged into the JSON under ``"end_to_end"``) and, with ``--e2e-sampling``,
assisted sampling per setting (``scripts/_spec_sampling.py``, under ``"sampling"``).

Run under the shared lock:  flock /tmp/hf_csv_bench.lock python scripts/bench_speculative.py --json out/spec.json
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time
import warnings
from typing import Any, Callable

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]

import hf_csv  # noqa: E402
from hf_csv import CSVConfig  # noqa: E402
from hf_csv.transformers.acceptance import (  # noqa: E402
    LossyVerifyWarning,
    check_transformers_version,
    speculative_sampling_exact,
    speculative_sampling_sigmoid,
)
from hf_csv.core.speculative import exact_first_token_distribution, sigmoid_first_token_distribution  # noqa: E402

from _spec_sampling import SAMPLING_SETTINGS, bench_sampling  # noqa: E402

MODELS = pathlib.Path(os.environ.get("HF_CSV_MODELS", "~/.cache/hf-csv-models")).expanduser()
PROMPTS = ROOT.parent / "shared" / "models" / "prompts.jsonl"


# ----------------------------------------------------------------------------- synthetic logits


def lm_like_logits(V: int, rows: int, g: torch.Generator, temp: float = 1.0) -> torch.Tensor:
    """Zipf-shaped logits (z = -1.1 log rank + N(0, 0.5^2), random rank order per row): peaked
    like real next-token distributions (top-1 probability ~0.1-0.5)."""
    ranks = torch.stack([torch.randperm(V, generator=g) for _ in range(rows)]).float() + 1.0
    return (-1.1 * ranks.log() + 0.5 * torch.randn(rows, V, generator=g)) / temp


def make_case(V: int, L: int, g: torch.Generator, draft_noise: float = 1.0):
    """Target rows [L+1, V]; draft rows = target + N(0, draft_noise^2) noise (a weaker model's view);
    drafted ids sampled from the draft's softmax, as the assistant does."""
    zp = lm_like_logits(V, L + 1, g)
    zq = zp[:L] + draft_noise * torch.randn(L, V, generator=g)
    ids = torch.multinomial(torch.softmax(zq, -1), 1, generator=g).squeeze(1)
    cand = torch.cat([torch.zeros(16, dtype=torch.long), ids])[None]
    return cand, zq[None].contiguous(), zp[None].contiguous()


# ----------------------------------------------------------------------------- part 1: verify step


def bench_verify(Vs: list[int], Ls: list[int], repeats: int, cases: int, seed: int) -> dict[str, Any]:
    """Median time of stock / exact / sigmoid verify per (V, L), calls interleaved round-robin over
    ``cases`` different inputs so that all three see the same machine state."""
    gen_utils = check_transformers_version()
    stock = gen_utils._speculative_sampling
    fns: dict[str, Callable[..., Any]] = {
        "stock": stock,
        "exact": speculative_sampling_exact,
        "sigmoid": speculative_sampling_sigmoid,
    }
    g = torch.Generator().manual_seed(seed)
    grid = []
    acc_counts = {k: [0, 0] for k in fns}
    for V in Vs:
        for L in Ls:
            inputs = [make_case(V, L, g) for _ in range(cases)]
            times: dict[str, list[float]] = {k: [] for k in fns}
            for name, f in fns.items():  # warm-up
                f(inputs[0][0], inputs[0][1], L, inputs[0][2])
            for r in range(repeats):
                cand, zq, zp = inputs[r % cases]
                order = list(fns.items())
                order = order[r % 3 :] + order[: r % 3]  # rotate who goes first
                for name, f in order:
                    t0 = time.perf_counter()
                    valid, n = f(cand, zq, L, zp)
                    times[name].append(time.perf_counter() - t0)
                    acc_counts[name][0] += valid.shape[1] - 1
                    acc_counts[name][1] += L
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            row = {
                "V": V,
                "L": L,
                "stock_ms": med["stock"],
                "exact_ms": med["exact"],
                "sigmoid_ms": med["sigmoid"],
                "speedup_exact": med["stock"] / med["exact"],
                "speedup_sigmoid": med["stock"] / med["sigmoid"],
            }
            grid.append(row)
            print(f"V={V:6d} L={L}  stock {med['stock']:7.3f} ms  exact {med['exact']:7.3f} ms "
                  f"({row['speedup_exact']:.2f}x)  sigmoid {med['sigmoid']:7.3f} ms ({row['speedup_sigmoid']:.2f}x)",
                  flush=True)
    return {
        "grid": grid,
        "verify_speedup_exact": statistics.median(r["speedup_exact"] for r in grid),
        "verify_speedup_exact_min": min(r["speedup_exact"] for r in grid),
        "verify_speedup_exact_max": max(r["speedup_exact"] for r in grid),
        "verify_speedup_sigmoid": statistics.median(r["speedup_sigmoid"] for r in grid),
        "synthetic_acceptance": {k: a / max(d, 1) for k, (a, d) in acc_counts.items()},
    }


# ----------------------------------------------------------------------------- sigmoid quality


def _top_k_mask(z: torch.Tensor, k: int) -> torch.Tensor:
    kth = z.topk(k, -1).values[..., -1:]
    return z.masked_fill(z < kth, float("-inf"))


def quality_rows(zp_rows: torch.Tensor, zq_rows: torch.Tensor, top_k: int | None) -> dict[str, float]:
    """Analytic per-position acceptance and TV(first emitted token, target) for sigmoid and exact."""
    if top_k:
        zp_rows, zq_rows = _top_k_mask(zp_rows, top_k), _top_k_mask(zq_rows, top_k)
    s_acc, s_tv, e_acc, e_tv = [], [], [], []
    for zp, zq in zip(zp_rows, zq_rows):
        p = torch.softmax(zp.double(), -1)
        law, a = sigmoid_first_token_distribution(zq, zp)
        s_acc.append(a)
        s_tv.append(0.5 * float((law - p).abs().sum()))
        q = torch.softmax(zq.double(), -1)
        e_acc.append(float(torch.minimum(p, q).sum()))
        e_tv.append(0.5 * float((exact_first_token_distribution(zq, zp) - p).abs().sum()))
    m = statistics.mean
    return {"positions": len(s_acc), "sigmoid_acceptance": m(s_acc), "sigmoid_tv_from_target": m(s_tv),
            "sigmoid_tv_max": max(s_tv), "exact_acceptance": m(e_acc), "exact_tv_from_target": m(e_tv)}


@torch.no_grad()
def real_pair_logits(target: str, draft: str, n_prompts: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Teacher-forced next-token logits of a real target/draft pair (same tokenizer) on the shared
    prompts; None when the models are not prepared."""
    td, dd = MODELS / target, MODELS / draft
    if not ((td / "PROVENANCE.json").is_file() and (dd / "PROVENANCE.json").is_file() and PROMPTS.is_file()):
        return None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(td)
    tm = AutoModelForCausalLM.from_pretrained(td, dtype=torch.float32).eval()
    dm = AutoModelForCausalLM.from_pretrained(dd, dtype=torch.float32).eval()
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()][:n_prompts]
    zps, zqs = [], []
    for text in prompts:
        ids = tok(text, return_tensors="pt").input_ids
        zp = tm(ids).logits[0].float()
        zq = dm(ids).logits[0].float()
        V = min(zp.shape[-1], zq.shape[-1])  # padded vocab rows: keep the shared ids
        zps.append(zp[:, :V])
        zqs.append(zq[:, :V])
    return torch.cat(zps), torch.cat(zqs)


def bench_quality(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(args.seed + 1)
    zp = lm_like_logits(49152, 64, g)
    zq = zp + torch.randn(64, 49152, generator=g)
    out["synthetic_V49152"] = {"T1": quality_rows(zp, zq, None), "top_k50": quality_rows(zp, zq, 50)}
    if not args.no_real:
        pair = real_pair_logits(args.target, args.draft, args.prompts)
        if pair is not None:
            zp, zq = pair
            out[f"real_{args.target}_vs_{args.draft}"] = {
                "T1": quality_rows(zp, zq, None), "top_k50": quality_rows(zp, zq, 50)}
    return out


# ----------------------------------------------------------------------------- part 2 hook


def _load_pair(target: str, draft: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    td, dd = MODELS / target, MODELS / draft
    if not ((td / "PROVENANCE.json").is_file() and (draft == "quantized" or (dd / "PROVENANCE.json").is_file())):
        raise SystemExit(f"part 2 needs {td} and {dd}: python ../shared/models/prepare.py {target} {draft}")
    tok = AutoTokenizer.from_pretrained(td)
    tm = hf_csv.enable(AutoModelForCausalLM.from_pretrained(td, dtype=torch.float32).eval())
    if draft == "quantized":  # the int8 self-draft (hf_csv.transformers.drafts.quantized_assistant)
        from hf_csv.transformers.drafts import quantized_assistant

        return tok, tm, quantized_assistant(tm)
    dm = AutoModelForCausalLM.from_pretrained(dd, dtype=torch.float32).eval()
    return tok, tm, dm


@torch.no_grad()
def bench_end_to_end(args: argparse.Namespace) -> dict[str, Any]:
    """End-to-end assisted generation on a real pair, stock and hf_csv interleaved in one process.

    Greedy: ``target.generate(assistant_model=draft)`` stock vs ``csv_config=CSVConfig()`` (certified
    top-1 for the draft head and for the target's L+1 verified positions); tokens must be identical.
    Sampling (reported, not compared token by token: a different random stream): stock vs hf_csv
    (sub-vocabulary draft + exact fast verify). The plain target (no assistant) is timed too.
    """
    tok, tm, dm = _load_pair(args.target, args.draft)
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    prompts = prompts[: args.e2e_prompts]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    cfg = CSVConfig()
    gen_kw = dict(max_new_tokens=args.new_tokens, pad_token_id=pad)
    # warm-up: builds the int8 screens (once per model) and the caches
    warm = tok(prompts[0], return_tensors="pt")
    for _ in range(2):  # long enough that the verify step sees its large shapes once before timing
        tm.generate(**warm, assistant_model=dm, do_sample=False, csv_config=cfg, max_new_tokens=32, pad_token_id=pad)
        tm.generate(**warm, assistant_model=dm, do_sample=False, max_new_tokens=32, pad_token_id=pad)
    modes = {
        "plain_stock": lambda x: tm.generate(**x, do_sample=False, **gen_kw),
        "assisted_stock": lambda x: tm.generate(**x, assistant_model=dm, do_sample=False, **gen_kw),
        "assisted_csv": lambda x: tm.generate(**x, assistant_model=dm, do_sample=False, csv_config=cfg, **gen_kw),
    }
    if args.e2e_sampling:
        modes["sampling_assisted_stock"] = lambda x: tm.generate(**x, assistant_model=dm, do_sample=True, **gen_kw)
        modes["sampling_assisted_csv"] = lambda x: tm.generate(**x, assistant_model=dm, do_sample=True,
                                                               csv_config=cfg, **gen_kw)
    times: dict[str, list[float]] = {m: [] for m in modes}
    toks: dict[str, int] = {m: 0 for m in modes}
    identical = True
    stats = []
    for run in range(args.e2e_runs):
        per_run = {m: [0.0, 0] for m in modes}
        for i, text in enumerate(prompts):
            x = dict(tok(text, return_tensors="pt"))
            n0 = x["input_ids"].shape[1]
            outs = {}
            for m, fn in modes.items():
                torch.manual_seed(1000 * run + i)
                t0 = time.perf_counter()
                out = fn(x)
                per_run[m][0] += time.perf_counter() - t0
                per_run[m][1] += out.shape[1] - n0
                outs[m] = out
            identical &= torch.equal(outs["assisted_csv"], outs["assisted_stock"])
            identical &= torch.equal(outs["assisted_stock"], outs["plain_stock"])
            if run == 0:
                # stats of the greedy csv call: rerun once outside the timing to read them
                o = tm.generate(**x, assistant_model=dm, do_sample=False, csv_config=cfg, return_dict_in_generate=True,
                                **gen_kw)
                stats.append(o.csv_stats)
        for m in modes:
            times[m].append(per_run[m][1] / per_run[m][0])
            toks[m] = per_run[m][1]
    med = {m: statistics.median(v) for m, v in times.items()}
    res: dict[str, Any] = {
        "target": args.target, "draft": args.draft, "prompts": len(prompts), "new_tokens": args.new_tokens,
        "runs": args.e2e_runs, "tokens_per_s_runs": times, "tokens_per_s_median": med,
        "assisted_tokens_per_s_stock": med["assisted_stock"], "assisted_tokens_per_s_csv": med["assisted_csv"],
        "assisted_speedup": med["assisted_csv"] / med["assisted_stock"],
        "assisted_speedup_runs": [c / s for c, s in zip(times["assisted_csv"], times["assisted_stock"])],
        "assisted_stock_vs_plain": med["assisted_stock"] / med["plain_stock"],
        "assisted_csv_vs_plain": med["assisted_csv"] / med["plain_stock"],
        "identical_tokens": bool(identical),
        "csv_stats_first_run": stats,
    }
    if args.e2e_sampling:
        res["sampling_assisted_speedup"] = med["sampling_assisted_csv"] / med["sampling_assisted_stock"]
    return res


# ----------------------------------------------------------------------------- plot + main


def plot(res: dict[str, Any], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = res["grid"]
    Vs = sorted({r["V"] for r in grid})
    fig, axes = plt.subplots(1, len(Vs), figsize=(5 * len(Vs), 4), sharey=True)
    for ax, V in zip(axes if len(Vs) > 1 else [axes], Vs):
        rows = [r for r in grid if r["V"] == V]
        Ls = [r["L"] for r in rows]
        for key, label in (("stock_ms", "stock"), ("exact_ms", "hf_csv exact"), ("sigmoid_ms", "sigmoid (lossy)")):
            ax.plot(Ls, [r[key] for r in rows], marker="o", label=label)
        ax.set_title(f"verify step, V = {V}")
        ax.set_xlabel("draft length L")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    (axes[0] if len(Vs) > 1 else axes).set_ylabel("median time per call (ms)")
    (axes[0] if len(Vs) > 1 else axes).legend()
    fig.suptitle(f"speculative verify: median exact speedup {res['verify_speedup_exact']:.2f}x "
                 f"(threads={res['env']['torch_threads']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_e2e(e2e: dict[str, Any], path: pathlib.Path) -> None:
    """Bar chart of part 2: median tokens/s per mode (whiskers: min/max over runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = e2e["tokens_per_s_runs"]
    names = list(runs)
    med = [statistics.median(runs[n]) for n in names]
    lo = [m - min(runs[n]) for m, n in zip(med, names)]
    hi = [max(runs[n]) - m for m, n in zip(med, names)]
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 2, 4))
    ax.bar(names, med, yerr=[lo, hi], capsize=4, color=["#999", "#6a9fd4", "#2e7d32", "#b39ddb", "#7e57c2"][: len(names)])
    ax.set_ylabel("tokens / s (median over runs)")
    ax.set_title(f"{e2e['target']} + {e2e['draft']}: assisted_speedup {e2e['assisted_speedup']:.3f}x, "
                 f"identical={e2e['identical_tokens']}")
    ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=pathlib.Path, required=True, help="output JSON")
    ap.add_argument("--png", type=pathlib.Path, default=None, help="plot (default: JSON path with .png)")
    ap.add_argument("--V", type=int, nargs="+", default=[49152, 151936, 262144])
    ap.add_argument("--L", type=int, nargs="+", default=list(range(1, 9)))
    ap.add_argument("--repeats", type=int, default=30, help="timed calls per function and grid cell")
    ap.add_argument("--cases", type=int, default=10, help="distinct inputs per grid cell")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", default="qwen-coder-1.5b", help="real target for the sigmoid quality")
    ap.add_argument("--draft", default="qwen-coder-0.5b",
                    help="real draft (same tokenizer), or 'quantized': the target's int8 self-draft")
    ap.add_argument("--prompts", type=int, default=12, help="prompts for the quality measurement")
    ap.add_argument("--no-real", action="store_true", help="skip the real-model quality measurement")
    ap.add_argument("--part2", action="store_true", help="also run part 2 (end-to-end assisted generation)")
    ap.add_argument("--part2-only", action="store_true", help="run part 2 only")
    ap.add_argument("--new-tokens", type=int, default=64, help="part 2: new tokens per prompt")
    ap.add_argument("--e2e-prompts", type=int, default=4, help="part 2: prompts per run")
    ap.add_argument("--e2e-runs", type=int, default=3, help="part 2: interleaved runs (median reported)")
    ap.add_argument("--e2e-sampling", action="store_true",
                    help="part 2: also assisted sampling per setting (speedup, acceptance, law test)")
    ap.add_argument("--no-greedy", action="store_true", help="part 2: skip the greedy and plain timings")
    ap.add_argument("--settings", nargs="+", choices=sorted(SAMPLING_SETTINGS), default=None,
                    help="part 2 sampling: run only these settings (default: all)")
    ap.add_argument("--law-draws", type=int, default=20000, help="part 2: draws per law test")
    ap.add_argument("--speculative", choices=("exact", "gumbel"), default="exact",
                    help="part 2 sampling: hf_csv's verify (CSVConfig(speculative=...)); 'gumbel' is compared with "
                         "stock assisted sampling for speed and with a stock Gumbel-max reference for its tokens")
    return ap.parse_args(argv)


def _part2_only(args: argparse.Namespace, res: dict) -> int:
    """``--part2-only``: the greedy end-to-end run (unless ``--no-greedy``) and, with ``--e2e-sampling``, assisted
    sampling; writes the JSON."""
    from _load import machine_load

    res["machine_before"] = machine_load()
    if not args.no_greedy:
        res["end_to_end"] = e2e = bench_end_to_end(args)
        plot_e2e(e2e, args.json.with_name(args.json.stem + "_e2e.png"))
        for k in ("assisted_tokens_per_s_stock", "assisted_tokens_per_s_csv", "assisted_speedup",
                  "identical_tokens"):
            res[k] = e2e[k]
    else:
        e2e = {}
    if args.e2e_sampling:
        tok, tm, dm = _load_pair(args.target, args.draft)
        res["sampling"] = samp = bench_sampling(args, tok, tm, dm)
        res["assisted_sampling_speedup"] = samp["assisted_sampling_speedup"]
        res["assisted_sampling_identical_law"] = samp["assisted_sampling_identical_law"]
        for k in (k for k in SAMPLING_SETTINGS if k in samp):
            res.setdefault("acceptance", {})[k] = {"stock": samp[k]["acceptance_stock"],
                                                  "csv": samp[k]["acceptance_csv"]}
        e2e = dict(e2e, sampling=samp)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in e2e.items() if k != "csv_stats_first_run"}, indent=2, default=str))
    return 0


def _part1(args: argparse.Namespace, res: dict) -> int:
    """Part 1 (the verify step alone and the sigmoid mode's quality), and part 2's greedy run with ``--part2``;
    writes the JSON and the plot."""
    res.update(bench_verify(args.V, args.L, args.repeats, args.cases, args.seed))
    quality = bench_quality(args)
    res["quality"] = quality
    real = [k for k in quality if k.startswith("real_")]
    src = quality[real[0]] if real else quality["synthetic_V49152"]
    res["quality_source"] = real[0] if real else "synthetic_V49152"
    res["sigmoid_acceptance"] = src["T1"]["sigmoid_acceptance"]
    res["sigmoid_tv_from_target"] = src["T1"]["sigmoid_tv_from_target"]
    if args.part2:
        res["end_to_end"] = e2e = bench_end_to_end(args)
        for k in ("assisted_tokens_per_s_stock", "assisted_tokens_per_s_csv", "assisted_speedup", "identical_tokens"):
            res[k] = e2e[k]
        plot_e2e(e2e, args.json.with_name(args.json.stem + "_e2e.png"))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=2))
    png = args.png or args.json.with_suffix(".png")
    plot(res, png)
    print(json.dumps({k: res[k] for k in ("verify_speedup_exact", "verify_speedup_sigmoid", "sigmoid_acceptance",
                                          "sigmoid_tv_from_target", "quality_source", "assisted_speedup",
                                          "identical_tokens") if k in res}, indent=2))
    print(f"wrote {args.json} and {png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore", LossyVerifyWarning)
    import transformers

    res: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "env": {"torch": torch.__version__, "transformers": transformers.__version__,
                "torch_threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
                "cpu_count": os.cpu_count()},
    }
    return _part2_only(args, res) if args.part2_only else _part1(args, res)

if __name__ == "__main__":
    raise SystemExit(main())
