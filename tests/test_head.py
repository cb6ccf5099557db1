"""hf_csv.head: the head swap acts only in the calling context (other threads get stock's head)."""
from __future__ import annotations

import threading

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from hf_csv import CSVConfig

from conftest import _ids


def test_other_threads_see_the_stock_head(llama):
    """While a certified call runs, another thread calling the (swapped) head gets stock logits."""
    seen = {}
    h = torch.randn(1, 64)

    class Probe(LogitsProcessor):
        csv_kind = "order"

        def __call__(self, ids, s):
            if "diff" not in seen:
                wrapper = llama.lm_head
                t = threading.Thread(target=lambda: seen.setdefault("other", wrapper(h)))
                t.start(), t.join()
                seen["swapped"] = wrapper is not wrapper_inner()
                seen["diff"] = True
            return s

    def wrapper_inner():
        from hf_csv.head import find_head
        return find_head(llama)[1]

    stock = wrapper_inner()(h)
    llama.generate(**_ids(), max_new_tokens=2, logits_processor=LogitsProcessorList([Probe()]),
                   csv_config=CSVConfig())
    assert seen["swapped"]
    assert torch.equal(seen["other"], stock)
