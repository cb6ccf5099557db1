"""hf_csv.transformers.scope: one certified call's scoped patches: device_map placements (an offloaded head is declined with a
logged reason, a head on its own device is certified there) and the restore after an exception."""
from __future__ import annotations

import logging

import pytest
import torch
from accelerate import dispatch_model
from transformers import LogitsProcessor, LogitsProcessorList

import hf_csv
from hf_csv import CSVConfig
from conftest import _ids, tiny_llama
from dist_worker import tiny_llama as dist_tiny_llama


IDS = torch.tensor([[5, 17, 33, 2, 9, 44]])


def test_offloaded_head_falls_back_with_a_logged_reason(tmp_path, caplog):
    m = dist_tiny_llama()
    ref = m.generate(IDS, max_new_tokens=12, do_sample=False)
    m = dispatch_model(m, device_map={"model": "cpu", "lm_head": "disk"}, offload_dir=str(tmp_path))
    assert m.lm_head.weight.device.type == "meta"
    hf_csv.enable(m)
    from transformers.utils import logging as tlogging

    tlogging.set_verbosity_info()
    try:
        with caplog.at_level(logging.INFO):
            out = m.generate(IDS, max_new_tokens=12, do_sample=False, csv_config=CSVConfig(),
                             return_dict_in_generate=True)
    finally:
        tlogging.set_verbosity_warning()
    assert torch.equal(out.sequences, ref)
    assert out.csv_stats["mode"] == "full" and "offloaded" in out.csv_stats["reasons"][0]
    assert type(m.lm_head).__name__ == "Linear"  # restored


def test_head_on_its_own_device_is_certified():
    """Body and head dispatched separately (accelerate hooks on both): certified and identical."""
    m = dist_tiny_llama()
    ref = m.generate(IDS, max_new_tokens=12, do_sample=False)
    m = dispatch_model(m, device_map={"model": "cpu", "lm_head": "cpu"})
    hf_csv.enable(m)
    out = m.generate(IDS, max_new_tokens=12, do_sample=False, csv_config=CSVConfig(), return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.csv_stats["certified"] > 0 and out.csv_stats["mode"] == "topk"


def test_head_restored_after_exception(llama):
    class Boom(LogitsProcessor):
        csv_kind = "lower"

        def __call__(self, ids, s):
            raise RuntimeError("boom")

    head = llama.lm_head
    with pytest.raises(RuntimeError, match="boom"):
        llama.generate(**_ids(), max_new_tokens=3, logits_processor=LogitsProcessorList([Boom()]),
                       csv_config=CSVConfig())
    assert llama.lm_head is head and isinstance(head, torch.nn.Linear)
    assert "_get_logits_processor" not in llama.__dict__
    x = _ids()
    assert torch.equal(llama.generate(**x, max_new_tokens=4, do_sample=False),
                       tiny_llama(scale=20.0).generate(**x, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("bad", ["nan", "inf", "fp16_overflow"])
def test_a_head_with_non_finite_weights_takes_stocks_head_with_the_reason(bad):
    """A NaN or infinite head weight leaves no bound: the call takes stock's head and says why (it raised a
    ValueError while stock generated). A float16 cast that overflows a weight is the same case. Repaired in place, the
    head certifies again (no screen was cached)."""
    m = tiny_llama(vocab=2000, scale=20.0)
    with torch.no_grad():
        if bad == "fp16_overflow":
            m.lm_head.weight[1999, 0] = 1e6  # above float16's 65,504
            m = m.half()
        else:
            m.lm_head.weight[1999, 0] = float(bad)
    m = hf_csv.enable(m)
    x = _ids(batch=1, vocab=2000)
    ref = m.generate(**x, max_new_tokens=4, do_sample=False)
    out = m.generate(**x, max_new_tokens=4, do_sample=False, csv_config=CSVConfig(stats=True),
                     return_dict_in_generate=True)
    assert torch.equal(ref, out.sequences)
    st = out.csv_stats
    assert st["mode"] == "full" and "NaN or infinite" in st["reasons"][0], st["reasons"]
    with torch.no_grad():
        m.lm_head.weight[1999, 0] = 0.0
    out = m.generate(**x, max_new_tokens=4, do_sample=False, csv_config=CSVConfig(stats=True),
                     return_dict_in_generate=True)
    assert out.csv_stats["certified"] > 0

