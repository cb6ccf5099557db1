"""hf_csv.transformers.posthead: what an architecture does to the head's output (scale, divide, softcap), read from its config;
unknown architectures and non-positive values are declined with a reason; check_output compares bit for bit."""
from types import SimpleNamespace

import pytest
import torch

from hf_csv.transformers.posthead import PostHead, check_output, post_head_of


def _model(model_type, **cfg):
    return SimpleNamespace(config=SimpleNamespace(model_type=model_type, **cfg))


@pytest.mark.parametrize("model, kind, value", [
    (_model("llama"), "identity", 1.0),
    (_model("cohere", logit_scale=0.0625), "scale", 0.0625),
    (_model("granite", logits_scaling=8.0), "divide", 8.0),
    (_model("gemma2", final_logit_softcapping=30.0), "softcap", 30.0),
    (_model("gemma3_text", final_logit_softcapping=None), "identity", 1.0),
])
def test_post_head_of_reads_the_config(model, kind, value):
    post, why = post_head_of(model)
    assert why == "" and post == PostHead(kind, value)


@pytest.mark.parametrize("model, words", [
    (_model("mamba"), "'mamba'"),
    (_model("cohere", logit_scale=-1.0), "logit_scale"),
    (_model("granite", logits_scaling=float("nan")), "logits_scaling"),
    (_model("gemma2", final_logit_softcapping=True), "final_logit_softcapping"),
    (SimpleNamespace(), "no config"),
])
def test_unknown_or_unproven_maps_are_declined_with_a_reason(model, words):
    post, why = post_head_of(model)
    assert post is None and words in why


def test_apply_is_the_models_arithmetic_in_the_input_dtype():
    x = torch.tensor([-40.0, -1.5, 0.0, 2.25, 70.0], dtype=torch.bfloat16)
    assert PostHead().apply(x) is x
    assert torch.equal(PostHead("scale", 0.5).apply(x), x * 0.5)
    assert torch.equal(PostHead("divide", 4.0).apply(x), x / 4.0)
    capped = PostHead("softcap", 30.0).apply(x)
    assert capped.dtype == torch.bfloat16 and torch.equal(capped, torch.tanh(x / 30.0) * 30.0)
    assert capped.abs().max() <= 30.0
    # monotone non-decreasing, and only softcap moves -inf
    assert (capped[1:] >= capped[:-1]).all()
    ninf = torch.tensor([float("-inf")])
    assert PostHead("scale", 2.0).keeps_neg_inf and torch.isneginf(PostHead("scale", 2.0).apply(ninf)).all()
    assert not PostHead("softcap", 30.0).keeps_neg_inf and PostHead("softcap", 30.0).apply(ninf).item() == -30.0
    assert PostHead("divide", 4.0).describe() == "logits / 4.0" and PostHead().describe() == "none"


def test_check_output_accepts_only_the_exact_transform():
    h = torch.randn(2, 7)
    assert check_output(PostHead(), h, h)  # identity: the very same storage
    assert not check_output(PostHead(), h, h.clone())
    post = PostHead("scale", 0.5)
    assert check_output(post, h, h * 0.5)
    assert not check_output(post, h, h * 0.5 + 1e-3)
    assert not check_output(post, h, (h * 0.5)[:1])


def test_check_output_takes_a_nan_where_the_model_has_one_as_the_same_value():
    """A float16 head output that overflowed to NaN: stock decodes (or raises) on it; the guard must not blame the
    model's code. A NaN on one side only, or at another position, is still a mismatch."""
    h = torch.randn(2, 7, dtype=torch.float16)
    h[1, 3] = float("nan")
    post = PostHead("scale", 0.3)
    assert check_output(post, h, h * 0.3)
    other = h * 0.3
    other[1, 3] = 0.0
    assert not check_output(post, h, other)
    moved = h * 0.3
    moved[1, 3], moved[0, 0] = 1.0, float("nan")
    assert not check_output(post, h, moved)
