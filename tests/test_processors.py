"""hf_csv.processors: the ``CSVLogitsProcessor`` check after the other processors (lowering processors keep stock's
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
    assert llama.csv_last_stats["verify_reruns"] > 0
