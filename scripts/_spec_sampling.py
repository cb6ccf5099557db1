"""Assisted sampling, stock against hf_csv, for ``scripts/bench_speculative.py --part2-only --e2e-sampling``: per
setting of :data:`SAMPLING_SETTINGS` the tokens/s of both sides interleaved, the acceptance rates, the head rows'
counts, and a check of the law (:func:`_law_probe`) or, with ``speculative="gumbel"``, of the tokens against a stock
Gumbel-max reference (:func:`_gumbel_reference`)."""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from collections import Counter
from typing import Any, Callable

import torch

from hf_csv import CSVConfig
from hf_csv.transformers.plans import TopK

PROMPTS = pathlib.Path(__file__).resolve().parents[2] / "shared" / "models" / "prompts.jsonl"


# the settings of issue 12: Qwen2.5's shipped chat defaults, and plain sampling at T = 1 (no top-k, no top-p)
SAMPLING_SETTINGS = {
    "qwen_defaults": dict(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05),
    "plain_T1": dict(temperature=1.0, top_k=0, top_p=1.0),
}


class _StockCounter:
    """Counts drafted / accepted tokens of stock's ``_speculative_sampling`` (for stock's acceptance rate)."""

    def __init__(self) -> None:
        import transformers.generation.utils as gu

        self.gu, self.orig = gu, gu._speculative_sampling
        self.drafted = self.accepted = 0

    def __enter__(self):
        def counted(cand, cand_logits, L, new_logits, *a, **k):
            valid, n = self.orig(cand, cand_logits, L, new_logits, *a, **k)
            self.drafted += int(L)
            self.accepted += valid.shape[1] - 1
            return valid, n

        self.gu._speculative_sampling = counted
        return self

    def __exit__(self, *exc):
        self.gu._speculative_sampling = self.orig


def _stock_rows(sess, cand: torch.Tensor, L: int) -> torch.Tensor:
    """Stock's processed rows of the target's ``L + 1`` verified positions: the full head on the step's hidden
    states, then the session's processors (hf_csv's own left out), position by position."""
    st = sess.step.last
    P = st.logits.shape[1]
    raw = sess.head.stock(st.H.reshape(P, -1))[P - (L + 1):].float()
    cur = cand.shape[1] - L
    procs = [p for p in sess.processors if type(p).__name__ != "CSVLogitsProcessor"]
    rows = [raw[i][None] for i in range(L + 1)]
    for i in range(L + 1):
        for p in procs:
            rows[i] = p(cand[:, : cur + i], rows[i])
    return torch.cat(rows)[None]


def _first_two(v: torch.Tensor) -> tuple:
    """A verify call's first emitted token and its second (or -1)."""
    return tuple(v[0, :2].tolist()) if v.shape[1] > 1 else (int(v[0, 0]), -1)


def _law_test(kind: str, fn_csv: Callable, stock: Callable, full: torch.Tensor, call: tuple, n: int,
              seed: int) -> dict:
    """``n`` draws of hf_csv's verify ``fn_csv`` and of stock's verify on ``full`` for one captured call
    (cand, cand_logits, L, new_logits): the joint law of (first emitted token, second or none), two-sample
    chi-square, and the time per draw of each side."""
    from scipy import stats as sps

    cand, cand_logits, L, new_logits = call
    obs_c, obs_s = Counter(), Counter()
    gc, gs = torch.Generator().manual_seed(seed), seed + 1
    torch.manual_seed(gs)
    t0 = time.perf_counter()
    for _ in range(n):
        v, _ = fn_csv(cand, cand_logits, L, new_logits, gc)
        obs_c[_first_two(v)] += 1
    t_csv = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n):
        v, _ = stock(cand, cand_logits, L, full, None)
        obs_s[_first_two(v)] += 1
    t_stock = time.perf_counter() - t0
    keys = [k for k in set(obs_c) | set(obs_s) if obs_c[k] + obs_s[k] >= 10]
    cols = [(obs_c[k], obs_s[k]) for k in keys]
    cols.append((n - sum(c for c, _ in cols), n - sum(s_ for _, s_ in cols)))
    cols = [c for c in cols if sum(c) > 0]
    pv = 1.0 if len(cols) < 2 else float(sps.chi2_contingency([[c[0] for c in cols], [c[1] for c in cols]]).pvalue)
    return dict(kind=kind, draws=n, drafted=int(L), categories=len(cols), pvalue=pv, alpha=1e-3,
                identical_law=pv > 1e-3, verify_ms_csv=1e3 * t_csv / n, verify_ms_stock=1e3 * t_stock / n)


def _law_probe(n: int, seed: int) -> tuple[dict, Callable]:
    """Capture the first certified verify call of a csv run and compare, on exactly those inputs, the law of
    hf_csv's verify (bounded in mode "spec", exact on the certified top-k vector in mode "topk") with stock's
    ``_speculative_sampling`` on the full head's processed rows: ``n`` draws each, the joint law of (first
    emitted token, second or none), two-sample chi-square. Returns (result dict, uninstall)."""
    import hf_csv.transformers.acceptance as hv
    import transformers.generation.utils as gu

    out: dict = {}
    orig_cert, orig_exact = hv.speculative_sampling_certified, hv._IMPLS["exact"]
    stock = gu._speculative_sampling

    def run(kind, fn_csv, sess, cand, cand_logits, L, new_logits):
        full = _stock_rows(sess, cand, L)
        out.update(_law_test(kind, fn_csv, stock, full, (cand, cand_logits, L, new_logits), n, seed))

    def certified(sess, cand, cand_logits, L, new_logits, **kw):
        if not out and int(L) >= 1 and sess.step.last is not None:  # (a call without its head step: the next)
            run("spec", lambda c, ql, LL, nl, g: orig_cert(sess, c, ql, LL, nl, generator=g), sess, cand,
                cand_logits, int(L), new_logits)
            sess.step.spec_pending = True  # the probe consumed the stash flag; the real call below clears it
        return orig_cert(sess, cand, cand_logits, L, new_logits, **kw)

    def topk_session():
        h = hv._stack()[-1] if hv._stack() else None
        sess = getattr(h, "session", None)
        return sess if sess is not None and isinstance(sess.plan, TopK) and sess.step.last is not None else None

    def exact(cand, cand_logits, L, new_logits, weight=None, **kw):
        sess = topk_session()
        if not out and int(L) >= 1 and sess is not None:
            run("topk", lambda c, ql, LL, nl, g: orig_exact(c, ql, LL, nl, None, generator=g), sess, cand,
                cand_logits, int(L), new_logits)
        return orig_exact(cand, cand_logits, L, new_logits, weight, **kw)

    def stock_verify(cand, cand_logits, L, new_logits, *a, **kw):
        # the target's checked top-K plan hands its rows to stock's verify (hf_csv.transformers.acceptance._dispatch): the law is
        # stock's exactly when those rows are stock's processed rows, which is checked here, bit for bit
        sess = topk_session()
        if not out and int(L) >= 1 and sess is not None:
            same = bool(torch.equal(new_logits.float(), _stock_rows(sess, cand, int(L)).to(new_logits.device)))
            out.update(kind="topk (stock's verify)", drafted=int(L), rows_identical=same, identical_law=same)
        return stock(cand, cand_logits, L, new_logits, *a, **kw)

    stock_verify.__wrapped__ = stock  # (hf_csv.transformers.compat checks stock's signature through it)
    hv.speculative_sampling_certified, hv._IMPLS["exact"], gu._speculative_sampling = certified, exact, stock_verify

    def uninstall():
        hv.speculative_sampling_certified, hv._IMPLS["exact"], gu._speculative_sampling = orig_cert, orig_exact, stock

    return out, uninstall


@torch.no_grad()
def _gumbel_reference(tok, tm, dm, prompt: str, gen_kw: dict, cfg, seed: int, n: int = 24) -> dict:
    """Gumbel-coupled verification (CSVConfig(speculative="gumbel")) emits at token index t the Gumbel-max draw
    argmax(stock's processed row + g_t) with the call's keyed noise g. The reference: *stock* plain sampling (no
    assistant, no csv) with a last processor that makes that same draw on stock's full processed rows. Token-for-token
    equality with the certified assisted call checks the certificate and the coupling end to end (the law is then
    the target's: docs/speculative.md, and the seeded chi-square test in tests/test_transformers_acceptance.py)."""
    from hf_csv.transformers.acceptance import gumbel_reference

    x = dict(tok(prompt, return_tensors="pt"))
    kw = dict(gen_kw, max_new_tokens=n)
    torch.manual_seed(seed)
    ours = tm.generate(**x, assistant_model=dm, csv_config=cfg, return_dict_in_generate=True, **kw)
    ref = gumbel_reference(tm, seed, **x, **kw)
    same = bool(torch.equal(ours.sequences, ref))
    return {"kind": "gumbel (reference: stock plain sampling with the same keyed Gumbel-max draw)",
            "tokens": int(ref.shape[1] - x["input_ids"].shape[1]), "reference_identical": same,
            "identical_law": same, "target_mode": ours.csv_stats["mode"],
            "draft_mode": (ours.csv_stats.get("draft") or {}).get("mode")}


def _law_check(args: argparse.Namespace, tok, tm, dm, prompt: str, gen_kw: dict, cfg, speculative: str) -> dict:
    """Warms both sides up on ``prompt``, then the setting's law check: the Gumbel reference, or the law probe on a
    short certified call."""
    warm = tok(prompt, return_tensors="pt")
    tm.generate(**warm, assistant_model=dm, csv_config=cfg, **dict(gen_kw, max_new_tokens=16))
    tm.generate(**warm, assistant_model=dm, **dict(gen_kw, max_new_tokens=16))
    if speculative == "gumbel":
        return _gumbel_reference(tok, tm, dm, prompt, gen_kw, cfg, args.seed)
    law, uninstall = _law_probe(args.law_draws, args.seed)
    try:
        tm.generate(**warm, assistant_model=dm, csv_config=cfg, **dict(gen_kw, max_new_tokens=8))
    finally:
        uninstall()
    return law


def _add_stats(st: dict, tot: dict) -> None:
    """Adds one certified call's stats to the setting's totals ``tot``: its modes and reasons, the target's and the
    draft's head rows (certified, speed guard, re-runs) and the speculative counts."""
    tot["modes"].add(st["mode"])
    tot["reasons"].update(st["reasons"])
    head_tot, spec_tot = tot["head"], tot["spec"]
    # every head row: the certified head's and those the speed guard gave the full head
    head_tot["rows"] += st.get("head_rows", st.get("rows", 0))
    head_tot["certified"] += st.get("certified", 0)
    head_tot["declined"] = head_tot.get("declined", 0) + st.get("declined_rows", 0)
    # rows whose check failed after the processors and re-ran stock's head (docs/certificates.md §3.2)
    head_tot["reruns"] = head_tot.get("reruns", 0) + st.get("verify_reruns", 0)
    draft = st.get("draft") or {}
    for k, src in (("rows", "head_rows"), ("certified", "certified"),
                   ("declined", "declined_rows"), ("verify_reruns", "verify_reruns")):
        head_tot["draft_" + k] = head_tot.get("draft_" + k, 0) + draft.get(src, 0)
    for k, v in (st.get("speculative") or {}).items():
        if isinstance(v, int):
            spec_tot[k] = spec_tot.get(k, 0) + v


def _timed_runs(args: argparse.Namespace, tok, tm, dm, prompts: list, gen_kw: dict, cfg, counter, tot: dict):
    """``--e2e-runs`` runs over the prompts, stock and csv alternating first, the same seed per prompt and run;
    tokens/s per run and side, and per (run, prompt) whether the two sides gave the same tokens."""
    tps = {"stock": [], "csv": []}
    same = []  # per (run, prompt): the same seed gave the same tokens (the checked top-K plan: it must)
    for run in range(args.e2e_runs):
        acc = {"stock": [0.0, 0], "csv": [0.0, 0]}
        for i, text in enumerate(prompts):
            x = dict(tok(text, return_tensors="pt"))
            n0 = x["input_ids"].shape[1]
            seqs = {}
            for m in ("stock", "csv") if (run + i) % 2 == 0 else ("csv", "stock"):
                torch.manual_seed(1000 * run + i)
                t0 = time.perf_counter()
                if m == "stock":
                    with counter:
                        out = tm.generate(**x, assistant_model=dm, **gen_kw)
                    seq = out
                else:
                    out = tm.generate(**x, assistant_model=dm, csv_config=cfg, return_dict_in_generate=True,
                                      **gen_kw)
                    seq = out.sequences
                acc[m][0] += time.perf_counter() - t0
                acc[m][1] += seq.shape[1] - n0
                seqs[m] = seq
                if m == "csv":
                    _add_stats(out.csv_stats, tot)
            same.append(bool(torch.equal(seqs["stock"], seqs["csv"])))
        for m in tps:
            tps[m].append(acc[m][1] / acc[m][0])
    return tps, same


def _setting_result(kw: dict, tps: dict, same: list, counter, tot: dict, law: dict) -> dict:
    med = {m: statistics.median(v) for m, v in tps.items()}
    head_tot, spec_tot = tot["head"], tot["spec"]
    return {
        "settings": kw, "tokens_per_s_runs": tps, "tokens_per_s_median": med,
        "assisted_sampling_speedup": med["csv"] / med["stock"],
        "identical_tokens_same_seed": same,
        "speedup_runs": [c / s_ for c, s_ in zip(tps["csv"], tps["stock"])],
        "acceptance_stock": counter.accepted / counter.drafted if counter.drafted else None,
        "acceptance_csv": spec_tot["accepted"] / spec_tot["drafted"] if spec_tot.get("drafted") else None,
        "target_mode": sorted(tot["modes"]), "reasons": sorted(tot["reasons"]),
        "target_head_rows": head_tot["rows"], "target_head_rows_certified": head_tot["certified"],
        "target_head_certified_fraction": head_tot["certified"] / head_tot["rows"] if head_tot["rows"] else None,
        "target_head_rows_speed_guard": head_tot.get("declined", 0),
        "target_rows_rerun": head_tot.get("reruns", 0),
        "draft_head_rows": head_tot.get("draft_rows", 0),
        "draft_head_rows_certified": head_tot.get("draft_certified", 0),
        "draft_head_rows_speed_guard": head_tot.get("draft_declined", 0),
        "draft_rows_rerun": head_tot.get("draft_verify_reruns", 0),
        "verify_rows": spec_tot.get("target_rows", 0),
        "verify_rows_by_bounds": spec_tot.get("target_rows_by_bounds", 0),
        "verify_rows_completed": spec_tot.get("target_rows_completed", 0),
        "law": law,
    }


@torch.no_grad()
def bench_sampling(args: argparse.Namespace, tok, tm, dm) -> dict[str, Any]:
    """Assisted sampling, stock vs hf_csv (certified target head + sub-vocabulary draft + exact verify), per
    setting of :data:`SAMPLING_SETTINGS`; calls interleaved, the same seed per prompt and run. With a top-k warper
    (Qwen's defaults) both heads run the checked top-K plan and stock's verify, so the tokens must be stock's
    (``identical_tokens_same_seed``); without one the random streams differ and the law is compared instead
    (:func:`_law_probe`)."""
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    prompts = prompts[: args.e2e_prompts]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    speculative = getattr(args, "speculative", "exact")
    cfg = CSVConfig(speculative=speculative)
    res: dict[str, Any] = {"speculative": speculative}
    settings = getattr(args, "settings", None)
    for name, kw in SAMPLING_SETTINGS.items():
        if settings is not None and name not in settings:
            continue
        gen_kw = dict(kw, do_sample=True, max_new_tokens=args.new_tokens, pad_token_id=pad)
        law = _law_check(args, tok, tm, dm, prompts[0], gen_kw, cfg, speculative)
        counter = _StockCounter()
        tot = {"head": {"rows": 0, "certified": 0}, "spec": {}, "modes": set(), "reasons": set()}
        tps, same = _timed_runs(args, tok, tm, dm, prompts, gen_kw, cfg, counter, tot)
        res[name] = _setting_result(kw, tps, same, counter, tot, law)
    res["assisted_sampling_speedup"] = {k: res[k]["assisted_sampling_speedup"] for k in SAMPLING_SETTINGS if k in res}
    res["assisted_sampling_identical_law"] = all(res[k]["law"].get("identical_law", False) for k in SAMPLING_SETTINGS
                                                 if k in res)
    return res
