"""hf_csv.core.config: ``CSVConfig`` validates every field on construction (a bad value names the field), and the
largest value it accepts is one the head serves."""
from __future__ import annotations

import pytest
import torch

import hf_csv
from hf_csv import CSVConfig
@pytest.mark.parametrize("kw,field", [({"mode": "fast"}, "mode"), ({"epsilon": 0.0}, "epsilon"),
                                      ({"epsilon": 1.5}, "epsilon"), ({"provider": "x"}, "provider"),
                                      ({"budget": 0}, "budget"), ({"budget": 1.5}, "budget"),
                                      ({"num_outliers": -1}, "num_outliers"), ({"stats": "yes"}, "stats"),
                                      ({"provider": "cluster"}, "index"), ({"index": 3}, "index")])
def test_config_rejects_bad_values(kw, field):
    with pytest.raises(ValueError, match=field):
        CSVConfig(**kw)


def test_speculative_field_is_validated():
    with pytest.raises(ValueError, match="speculative"):
        CSVConfig(speculative="fast")


def test_too_many_outlier_columns_refused_when_the_config_is_built():
    with pytest.raises(ValueError, match="num_outliers must be at most 1000"):
        CSVConfig(num_outliers=1001)


def test_the_largest_outlier_count_serves_a_wide_head():
    """num_outliers=1000 on a head whose hidden size exceeds 1000: certified, stock's tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=1040, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    ref = LlamaForCausalLM(cfg).eval()
    ref.generation_config.pad_token_id = 0
    m = hf_csv.enable(LlamaForCausalLM(cfg).eval())
    m.load_state_dict(ref.state_dict())
    ids = torch.randint(3, 256, (1, 5))
    out = m.generate(ids, max_new_tokens=4, do_sample=False, csv_config=CSVConfig(num_outliers=1000))
    assert torch.equal(out, ref.generate(ids, max_new_tokens=4, do_sample=False))
