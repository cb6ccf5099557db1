"""Top-p sampling without a top-k (docs/certificates.md §3.5): stock's nucleus from exact logits on S and
bounds elsewhere, so stock's sampler draws stock's tokens for the same seed."""
from collections import Counter

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_csv
from conftest import model_dir, tokenizer
from hf_csv import CSVConfig
from test_generate import _ids, tiny_llama

# these paths hand the values on S to stock (docs/certificates.md §2.0): their machinery under that property
pytestmark = pytest.mark.usefixtures("assume_subset_exact")

SETTINGS = [dict(top_p=0.9, top_k=0), dict(top_p=0.5, top_k=0, temperature=0.7),
            dict(top_p=0.95, top_k=0, repetition_penalty=1.3), dict(top_p=0.8, top_k=0, no_repeat_ngram_size=2)]


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


class ReadsScores(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_declined_after_the_list_is_built_still_applies_top_p():
    """A stopping criterion that may read scores declines the call after the processors were built (the
    CSVLogitsProcessor already sits in the top-p warper's place): it must run stock's warper then."""
    m = hf_csv.enable(tiny_llama(scale=30.0))
    ids = _ids(batch=2)
    kw = dict(max_new_tokens=12, do_sample=True, top_p=0.6, top_k=0, stopping_criteria=StoppingCriteriaList([ReadsScores()]))
    torch.manual_seed(0)
    x = m.generate(**ids, **kw)
    torch.manual_seed(0)
    y = m.generate(**ids, **kw, csv_config=CSVConfig(budget=0.3))
    assert torch.equal(x, y)
    assert m.csv_last_stats["mode"] == "full"


@pytest.mark.parametrize("kw, why", [
    (dict(top_p=0.9, top_k=0, min_p=0.1), "normalizing warpers"),
    (dict(top_p=0.9, top_k=0, typical_p=0.9), "normalizing warpers"),
])
def test_other_normalizing_warpers_with_top_p_are_declined(kw, why):
    m = hf_csv.enable(tiny_llama(scale=30.0))
    torch.manual_seed(0)
    x = m.generate(**_ids(batch=2), max_new_tokens=6, do_sample=True, **kw)
    torch.manual_seed(0)
    y = m.generate(**_ids(batch=2), max_new_tokens=6, do_sample=True, csv_config=CSVConfig(), **kw)
    assert torch.equal(x, y)
    st = m.csv_last_stats
    assert st["mode"] == "full" and any(why in r for r in st["reasons"]), st["reasons"]


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


def test_nucleus_decision_is_sound_for_every_vector_within_the_bounds():
    """Randomized soundness of the decision itself: whenever it claims a row, stock's TopPLogitsWarper removes
    exactly the claimed tokens on *every* vector that agrees on S and stays below the bounds elsewhere."""
    from transformers import TopPLogitsWarper

    from hf_csv.checks import nucleus_decide as _nucleus_decide

    g = torch.Generator().manual_seed(0)
    claimed = unsure = 0
    for trial in range(1500):
        V = int(torch.randint(6, 40, (1,), generator=g))
        x = torch.randn(V, generator=g) * float(torch.empty(1).uniform_(0.5, 4.0, generator=g))
        if trial % 3 == 0:
            x = x.round()  # ties: stock's sort may put tied tokens in any order
        top_p = float(torch.empty(1).uniform_(0.3, 0.97, generator=g))
        cut = float(torch.quantile(x, float(torch.empty(1).uniform_(0.2, 0.9, generator=g))))
        S = x >= cut
        S |= torch.rand(V, generator=g) < 0.1
        S[x.argmax()] = True
        up = torch.where(S, torch.full_like(x, float("inf")), x + torch.rand(V, generator=g) * 2.0)
        scores = torch.where(S, x, torch.full_like(x, float("-inf")))[None]
        remove, bad = _nucleus_decide(scores, S[None], up[None], top_p)
        if bool(bad[0]):
            unsure += 1
            continue
        claimed += 1
        for v in range(6):  # vectors within the bounds: at the bound, below it, far below, or -inf
            mode = v % 3
            lowered = up - (0.0 if mode == 0 else torch.rand(V, generator=g) * (1.0 if mode == 1 else 20.0))
            y = torch.where(S, x, lowered)
            if v == 5:
                y = torch.where(S, x, torch.full_like(x, float("-inf")))
            out = TopPLogitsWarper(top_p)(None, y[None].clone())[0]
            stock_removed = torch.isinf(out) & torch.isfinite(y)
            assert torch.equal(stock_removed[S], remove[0][S]), (trial, v)
            assert bool(stock_removed[~S & torch.isfinite(y)].all()), (trial, v)
    assert claimed > 300 and unsure > 100, (claimed, unsure)
