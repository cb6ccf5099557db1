"""generate(assistant_model=..., csv_config=...): certified target verification and the exact verify patch."""
import pytest
import torch
import transformers.generation.utils as gen_utils
from transformers import LlamaConfig, LlamaForCausalLM

import hf_csv
from hf_csv import CSVConfig
from hf_csv.verify import LossyVerifyWarning


def _llama(layers, seed):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=95)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def pair():
    return hf_csv.enable(_llama(2, 0)), _llama(1, 1)


def test_greedy_assisted_with_csv_equals_plain_greedy(pair):
    target, draft = pair
    ids = torch.tensor([[5, 17, 33, 2, 9]])
    plain = target.generate(ids, max_new_tokens=20, do_sample=False)
    out = target.generate(ids, assistant_model=draft, max_new_tokens=20, do_sample=False, csv_config=CSVConfig(),
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert out.csv_stats["certified"] > 0 if isinstance(out.csv_stats, dict) else out.csv_stats.certified > 0


def test_assisted_sampling_uses_the_patch_and_restores(pair, monkeypatch):
    """Without a top-k warper assisted sampling runs hf_csv's exact verify (the certified one in mode spec, or the
    exact one on full rows); with one, the checked top-K rows go to stock's verify (test_assisted_sampling.py)."""
    target, draft = pair
    ids = torch.tensor([[5, 17, 33, 2, 9]])
    stock = gen_utils._speculative_sampling
    calls = []
    import hf_csv.verify as hv
    orig_impl, orig_cert = hv._IMPLS["exact"], hv.speculative_sampling_certified
    monkeypatch.setitem(hv._IMPLS, "exact", lambda *a, **k: (calls.append(1), orig_impl(*a, **k))[1])
    monkeypatch.setattr(hv, "speculative_sampling_certified", lambda *a, **k: (calls.append(2), orig_cert(*a, **k))[1])
    out = target.generate(ids, assistant_model=draft, max_new_tokens=12, do_sample=True, top_k=0,
                          csv_config=CSVConfig())
    assert calls, "assisted sampling under csv_config must run hf_csv's exact verify"
    assert gen_utils._speculative_sampling is stock
    assert out.shape[1] > ids.shape[1] and (out >= 0).all() and (out < 96).all()
    with pytest.warns(LossyVerifyWarning):
        target.generate(ids, assistant_model=draft, max_new_tokens=6, do_sample=True,
                        csv_config=CSVConfig(speculative="sigmoid"))
    assert gen_utils._speculative_sampling is stock


def test_speculative_field_is_validated():
    with pytest.raises(ValueError, match="speculative"):
        CSVConfig(speculative="fast")
