"""hf_csv.transformers.processors: the ``CSVLogitsProcessor`` check after the other processors (lowering processors keep stock's
tokens; a processed winner outside the certified set re-runs its row)."""
from __future__ import annotations

import pytest
import torch

from hf_csv import CSVConfig
from conftest import _ids


@pytest.mark.parametrize("kw", [{"repetition_penalty": 3.0}, {"no_repeat_ngram_size": 1},
                                {"min_new_tokens": 10, "eos_token_id": 2}])
def test_lowering_processors_verified(llama, kw):
    x = _ids()
    a = llama.generate(**x, max_new_tokens=12, do_sample=False, **kw)
    b = llama.generate(**x, max_new_tokens=12, do_sample=False, csv_config=CSVConfig(), **kw)
    assert torch.equal(a, b)
    assert llama.csv_last_stats["mode"] == "topk"


def test_suppressing_the_top_token_forces_a_rerun(llama):
    """Suppress the stock greedy tokens and the first step's top-16: the processed winner of the first step
    lies outside the (2-3 token) certified set, so the check must catch it and re-run that row."""
    x = _ids(batch=1)
    first = llama.generate(**x, max_new_tokens=6, do_sample=False)[0, x["input_ids"].shape[1]:].tolist()
    with torch.no_grad():
        top16 = llama(**x).logits[0, -1].topk(16).indices.tolist()
    kw = {"suppress_tokens": sorted(set(first + top16))}
    a = llama.generate(**x, max_new_tokens=6, do_sample=False, **kw)
    b = llama.generate(**x, max_new_tokens=6, do_sample=False, csv_config=CSVConfig(), **kw)
    assert torch.equal(a, b)
    st = llama.csv_last_stats
    assert st["verify_reruns"] > 0
    # a re-run row's token is stock's row's: counted as a fallback, not as certified (every row counted once)
    assert st["certified"] + st["fallback"] == st["rows"] and st["fallback"] >= st["verify_reruns"], st


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_suppress_tokens_mask_built_once_gives_stock_scores_bit_for_bit(dtype):
    """hf_csv.transformers.processors.mask_once: a copy of transformers' SuppressTokensLogitsProcessor that reads its mask off stock's
    own processor once, then gives stock's scores bit for bit (NaN, ±inf and ties included; a new vocabulary size
    rebuilds the mask); its class keeps stock's name and is a subclass; the caller's instance is untouched."""
    from transformers.generation.logits_process import SuppressTokensLogitsProcessor

    from hf_csv.transformers.processors import mask_once

    stock = SuppressTokensLogitsProcessor([3, 7, 50, 299])
    mine = mask_once(stock)
    assert type(mine).__name__ == "SuppressTokensLogitsProcessor" and isinstance(mine, SuppressTokensLogitsProcessor)
    assert type(stock) is SuppressTokensLogitsProcessor and "_csv_mask" not in stock.__dict__
    g = torch.Generator().manual_seed(0)
    calls = []
    real = SuppressTokensLogitsProcessor.__call__
    SuppressTokensLogitsProcessor.__call__ = lambda self, i, s: calls.append(1) or real(self, i, s)
    try:
        for V in (300, 300, 300, 64):
            s = torch.randn(2, V, generator=g).to(dtype)
            s[0, 3], s[0, 5], s[1, 7], s[1, 8] = float("nan"), float("inf"), float("-inf"), float("nan")
            ids = torch.randint(0, V, (2, 4), generator=g)
            want = real(stock, ids, s)
            got = mine(ids, s)
            assert got.dtype == want.dtype and torch.equal(got.isnan(), want.isnan())
            assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    finally:
        SuppressTokensLogitsProcessor.__call__ = real
    assert len(calls) == 2  # the mask for V = 300 once, for V = 64 once


def test_whisper_certified_call_builds_the_suppress_mask_once(monkeypatch):
    """In a certified Whisper call the suppress-token processor of the call's list is the mask-once copy (stock's
    processor runs once, for the mask, not at every step) and the tokens are stock's."""
    from transformers.generation.logits_process import SuppressTokensLogitsProcessor

    import hf_csv
    from conftest import _tiny_whisper

    m = hf_csv.enable(_tiny_whisper(seed=5))
    m.generation_config.suppress_tokens = [4, 9, 17]
    feats = torch.randn(1, 80, 3000, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = m.generate(feats, max_new_tokens=10, do_sample=False)
    real = SuppressTokensLogitsProcessor.__call__
    calls = []
    monkeypatch.setattr(SuppressTokensLogitsProcessor, "__call__",
                        lambda self, i, s: calls.append(type(self).__module__) or real(self, i, s))
    with torch.no_grad():
        out = m.generate(feats, max_new_tokens=10, do_sample=False, csv_config=CSVConfig())
    assert torch.equal(out, ref)
    assert m.csv_last_stats["certified"] > 0
    assert len(calls) == 1, calls  # the mask's one probe (stock's own call), not one per step
