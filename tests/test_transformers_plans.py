"""hf_csv.transformers.plans: the plans end to end: exact sampling (``Sample``), min-p (``Threshold``,
docs/certificates.md §3.3) and top-p without a top-k (``Nucleus``, §3.5) draw stock's tokens."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats as sps

import hf_csv
from hf_csv import CSVConfig

from conftest import ALPHA, _ids, model_dir, tiny_llama, tokenizer


def test_sampling_distribution_exact():
    """Chi-square (α = 1e-3, fixed seeds): csv samples vs the exact softmax(ℓ/T) and vs stock samples."""
    V, n, T = 48, 3000, 0.8
    m = hf_csv.enable(tiny_llama(vocab=V, scale=10.0, seed=3))
    x = {"input_ids": torch.tensor([[5, 9, 17, 4]]).repeat(n, 1)}
    with torch.no_grad():
        logits = m(input_ids=x["input_ids"][:1]).logits[0, -1].double()
    p = torch.softmax(logits / T, 0).numpy()
    cfg = CSVConfig(budget=1.0)
    torch.manual_seed(0)
    out = m.generate(**x, max_new_tokens=1, do_sample=True, temperature=T, top_k=0, csv_config=cfg)
    st = m.csv_last_stats
    # (rows whose draw the values' slack leaves open take the full head: near_ties, docs/certificates.md §2.0)
    assert st["mode"] == "sample" and st["fallback"] == st["near_ties"] and st["mean_subvocab_fraction"] < 1.0
    torch.manual_seed(1)
    ref = m.generate(**x, max_new_tokens=1, do_sample=True, temperature=T, top_k=0)
    c_csv = np.bincount(out[:, -1].numpy(), minlength=V)
    c_ref = np.bincount(ref[:, -1].numpy(), minlength=V)
    keep = p * n >= 5  # pool rare tokens into one cell
    exp = np.append(p[keep] * n, p[~keep].sum() * n)
    for c in (c_csv, c_ref):
        obs = np.append(c[keep], c[~keep].sum())
        if exp[-1] < 5:
            obs, e = obs[:-1], exp[:-1] * obs[:-1].sum() / exp[:-1].sum()
        else:
            e = exp
        assert sps.chisquare(obs, e).pvalue > ALPHA
    table = np.stack([np.append(c_csv[keep], c_csv[~keep].sum()), np.append(c_ref[keep], c_ref[~keep].sum())])
    table = table[:, table.sum(0) > 0]
    assert sps.chi2_contingency(table).pvalue > ALPHA


@pytest.mark.parametrize("scale,budget", [(10.0, 1.0), (10.0, 0.05), (1.0, 0.05)])
def test_sampling_with_lowering_processors_law_exact(scale, budget):
    """top_k=0 with repetition penalty and a bad word: the Gumbel draw after the processors (docs/certificates.md
    §2.3) follows stock's law, softmax(processed scores / T) (chi-square, α = 1e-3, fixed seeds), also where
    the check re-runs rows with the full head (a lowered top token, small budgets)."""
    V, n, T = 48, 3000, 0.8
    m = hf_csv.enable(tiny_llama(vocab=V, scale=scale, seed=3))
    ids = torch.tensor([[5, 9, 17, 4]])
    with torch.no_grad():
        logits = m(input_ids=ids).logits[0, -1].double()
    top = int(logits.argmax())
    ids = torch.tensor([[5, top, 17, 4]])  # the top token is in the context: the penalty lowers it
    with torch.no_grad():
        x = m(input_ids=ids).logits[0, -1].double()
    pen, bad = 1.5, (top + 1) % V
    for t in set(ids[0].tolist()):
        x[t] = x[t] / pen if x[t] > 0 else x[t] * pen
    x[bad] = float("-inf")
    p = torch.softmax(x / T, 0).numpy()
    kw = dict(max_new_tokens=1, do_sample=True, temperature=T, top_k=0, repetition_penalty=pen, bad_words_ids=[[bad]])
    torch.manual_seed(0)
    out = m.generate(input_ids=ids.repeat(n, 1), csv_config=CSVConfig(budget=budget), **kw)
    st = m.csv_last_stats
    assert st["mode"] == "sample" and st["reasons"] == [], st
    c = np.bincount(out[:, -1].numpy(), minlength=V)
    assert c[bad] == 0
    keep = p * n >= 5
    obs = np.append(c[keep], c[~keep].sum())
    exp = np.append(p[keep] * n, p[~keep].sum() * n)
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1] * obs[:-1].sum() / exp[:-1].sum()
    assert sps.chisquare(obs, exp).pvalue > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    {"min_p": 0.1},
    {"min_p": 0.05, "temperature": 0.7},
    {"min_p": 0.3, "temperature": 1.3, "repetition_penalty": 1.3, "no_repeat_ngram_size": 2},
    {"min_p": 0.02, "top_k": 0, "bad_words_ids": [[7], [9]]},
])
@pytest.mark.parametrize("scale", [20.0, 3.0])
def test_min_p_sampling_same_tokens_as_stock(kw, scale, assume_subset_exact):
    """min-p without top-k (threshold certificate, docs/certificates.md §3.3): the same tokens as stock for
    the same seed, with most rows certified on a spread head and the check catching the rest."""
    m = hf_csv.enable(tiny_llama(scale=scale, seed=3))
    kw = dict(kw, do_sample=True, top_k=0, max_new_tokens=12)
    cert = 0
    for seed in range(4):
        torch.manual_seed(seed)
        ref = m.generate(**_ids(batch=3, seed=seed), **kw)
        torch.manual_seed(seed)
        out = m.generate(**_ids(batch=3, seed=seed), csv_config=CSVConfig(), **kw)
        assert torch.equal(out, ref), (seed, kw)
        st = m.csv_last_stats
        assert st["mode"] == "threshold", st
        cert += st["certified"] - st["verify_reruns"]
    if scale == 20.0:
        assert cert > 0


SETTINGS = [dict(top_p=0.9, top_k=0), dict(top_p=0.5, top_k=0, temperature=0.7),
            dict(top_p=0.95, top_k=0, repetition_penalty=1.3), dict(top_p=0.8, top_k=0, no_repeat_ngram_size=2)]


@pytest.mark.usefixtures("assume_subset_exact")
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_top_p_without_top_k_same_tokens_as_stock(dtype):
    seen = Counter()
    for scale in (30.0, 60.0):
        m = hf_csv.enable(tiny_llama(scale=scale).to(dtype))
        ids = _ids(batch=3)
        for kw in SETTINGS:
            for seed in range(2):
                torch.manual_seed(seed)
                x = m.generate(**ids, max_new_tokens=20, do_sample=True, **kw)
                torch.manual_seed(seed)
                y = m.generate(**ids, max_new_tokens=20, do_sample=True, csv_config=CSVConfig(budget=0.3), **kw)
                assert torch.equal(x, y), (scale, kw, seed)
                st = m.csv_last_stats
                assert st["mode"] == "nucleus", st["reasons"]
                seen.update(st["nucleus"])
    # most rows are decided by the bounds; some are not, and take the full row through stock's warper
    assert seen["decided_by_bounds"] > 0.7 * seen["rows"] and seen["rows_rerun"] > 0, seen


@pytest.mark.usefixtures("assume_subset_exact")
@pytest.mark.slow
def test_real_smollm2_top_p_same_tokens_and_certified(monkeypatch):
    # an exactness test: the speed guard's timing-dependent choice would make the certified-row counts vacuous
    monkeypatch.setenv("HF_CSV_SPEED_GUARD", "0")
    from transformers import AutoModelForCausalLM

    d = model_dir("smollm2-135m")
    tok = tokenizer(d, padding_side="left")
    m = hf_csv.enable(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval())
    enc = tok(["def fibonacci(n):", "The capital of France is"], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=24, do_sample=True, top_p=0.9, top_k=0, temperature=0.7, pad_token_id=tok.eos_token_id)
    rows = Counter()
    for seed in range(3):
        torch.manual_seed(seed)
        x = m.generate(**enc, **kw)
        torch.manual_seed(seed)
        y = m.generate(**enc, **kw, csv_config=CSVConfig())
        assert torch.equal(x, y), seed
        st = m.csv_last_stats
        assert st["mode"] == "nucleus"
        rows.update(st["nucleus"])
    assert rows["decided_by_bounds"] >= 0.5 * rows["rows"], rows


def test_the_guard_times_greedy_and_sampled_top_k_apart():
    """A sampled top-k row (k tokens, stock's values for the warper after it) costs the certified head more than a
    greedy one: sharing a speed-guard key let a greedy call's verdict start a sampled shape on the certified head."""
    from hf_csv.transformers.plans import TopK

    greedy, sampled = TopK(k=1), TopK(k=20, check_after=object())
    assert greedy.guard_tag != sampled.guard_tag != TopK(k=20).guard_tag
    assert TopK(k=20, check_after=object()).guard_tag == sampled.guard_tag  # the same plan: one key
