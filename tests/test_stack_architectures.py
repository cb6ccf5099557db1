"""Architectures with a map of their own after the head (Granite's logits scaling, Cohere's logit scale, Gemma 2's
final softcap) and architectures hf_csv does not know: a certified call follows the model's own arithmetic (stock's
tokens, stock's law), declines with a reason, or is stopped by the guard when a transform is not in the registry.
Statistical tests: fixed seeds, significance level ALPHA."""
from __future__ import annotations

import pytest
import torch
import transformers as tf

import hf_csv
from conftest import ALPHA, _chi2_p, _ids
from hf_csv import CSVConfig
from hf_csv.core.errors import CSVError

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _tiny(cls, cfg_cls, scale=20.0, seed=0, dtype=torch.float32, **kw):
    torch.manual_seed(seed)
    m = cls(cfg_cls(**COMMON, **kw)).eval()
    with torch.no_grad():
        m.get_output_embeddings().weight.mul_(scale)
    m.generation_config.pad_token_id = 0
    return hf_csv.enable(m.to(dtype))


@pytest.mark.parametrize("scaling", [0.25, 8.0])
def test_granite_logits_scaling_with_repetition_penalty_identical(scaling):
    """logits / scaling: with scaling < 1 a check in the unscaled space passes rows it must re-run."""
    m = _tiny(tf.GraniteForCausalLM, tf.GraniteConfig, logits_scaling=scaling)
    for seed in range(6):
        x = _ids(batch=2, seed=seed)
        a = m.generate(**x, max_new_tokens=10, do_sample=False, repetition_penalty=3.0)
        b = m.generate(**x, max_new_tokens=10, do_sample=False, repetition_penalty=3.0, csv_config=CSVConfig())
        assert torch.equal(a, b)
        assert m.csv_last_stats["mode"] == "topk"


def test_cohere_logit_scale_sampling_law():
    """The drawn law is stock's softmax(logit_scale·ℓ / T) (chi-square, α = 1e-3), not the unscaled one."""
    m = _tiny(tf.CohereForCausalLM, tf.CohereConfig, scale=3.0, logit_scale=3.0)
    x = {"input_ids": torch.tensor([[5, 9, 17, 4]])}
    stock = m.generate(**x, do_sample=True, max_new_tokens=1, temperature=0.8, top_k=0,
                       return_dict_in_generate=True, output_scores=True)
    p = torch.softmax(stock.scores[0][0].double(), -1).numpy()
    n = 3000
    torch.manual_seed(0)
    out = m.generate(input_ids=x["input_ids"].repeat(n, 1), do_sample=True, max_new_tokens=1, temperature=0.8,
                     top_k=0, csv_config=CSVConfig())
    assert m.csv_last_stats["mode"] == "sample" and m.csv_last_stats["certified"] > 0
    draws = out[:, -1].numpy()
    assert _chi2_p(draws, p) > ALPHA
    # power: the unscaled law (the old behaviour) is rejected by the same draws
    with torch.no_grad():
        raw = m.lm_head(m.model(**x).last_hidden_state[:, -1])[0].double()
    assert _chi2_p(draws, torch.softmax(raw / 0.8, -1).numpy()) < ALPHA


@pytest.mark.slow
def test_gemma2_softcap_ties_greedy_identical():
    """A small cap saturates tanh in bf16: stock's argmax sees ties and takes the lowest index."""
    m = _tiny(tf.Gemma2ForCausalLM, tf.Gemma2Config, scale=30.0, dtype=torch.bfloat16, head_dim=16,
              final_logit_softcapping=2.0, attn_logit_softcapping=50.0, query_pre_attn_scalar=16, sliding_window=16)
    ties = 0
    for seed in range(8):
        x = _ids(batch=2, seed=seed)
        a = m.generate(**x, max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_scores=True)
        b = m.generate(**x, max_new_tokens=8, do_sample=False, csv_config=CSVConfig())
        assert torch.equal(a.sequences, b)
        ties += sum(int((s.topk(2).values[:, 0] == s.topk(2).values[:, 1]).sum()) for s in a.scores)
    assert ties > 0  # the test exercises the tie path
    assert m.csv_last_stats["mode"] == "topk" and m.csv_last_stats["verify_reruns"] > 0


def test_unknown_architecture_declines_with_a_reason():
    torch.manual_seed(0)
    m = hf_csv.enable(tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=2)).eval())
    x = {"input_ids": torch.tensor([[3, 4, 5]])}
    a = m.generate(**x, max_new_tokens=5, do_sample=False, pad_token_id=0)
    b = m.generate(**x, max_new_tokens=5, do_sample=False, pad_token_id=0, csv_config=CSVConfig())
    assert torch.equal(a, b)
    st = m.csv_last_stats
    assert st["mode"] == "full" and any("gpt2" in r for r in st["reasons"]) and st["declined_rows"] == 5


def test_guard_catches_an_unregistered_post_head_transform():
    class Doubling(tf.LlamaForCausalLM):  # model_type llama (registered identity), but scales its logits
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(**COMMON, tie_word_embeddings=False)
    m = hf_csv.enable(Doubling(cfg).eval())
    with pytest.raises(CSVError, match="post-head transform"):
        m.generate(**_ids(), max_new_tokens=3, do_sample=False, csv_config=CSVConfig())
    assert isinstance(m.lm_head, torch.nn.Linear)
