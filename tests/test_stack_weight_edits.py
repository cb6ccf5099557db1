"""A head edited after its screen was built (an optimizer step, ``load_state_dict``, a LoRA merge through ``.data``, a
deep copy edited on its own) or a screen built in another autograd mode (``inference_mode``): the next certified call
sees the edit, rebuilds what it must, and returns stock's tokens for the weights as they are now."""
from __future__ import annotations

import copy

import pytest
import torch

import hf_csv
from conftest import _ids, tiny_llama
from hf_csv import CSVConfig


@pytest.mark.slow
def test_screen_rebuilt_after_optimizer_step_and_load_state_dict():
    m = hf_csv.enable(tiny_llama(scale=20.0))
    x = _ids()
    m.generate(**x, max_new_tokens=4, csv_config=CSVConfig())  # builds and caches the screen
    opt = torch.optim.SGD([m.lm_head.weight], lr=1.0)
    g = torch.Generator().manual_seed(3)
    m.lm_head.weight.grad = torch.randn(m.lm_head.weight.shape, generator=g) * 5
    opt.step()
    a = m.generate(**x, max_new_tokens=10, do_sample=False)
    b = m.generate(**x, max_new_tokens=10, do_sample=False, csv_config=CSVConfig())
    assert torch.equal(a, b) and m.csv_last_stats["certified"] > 0
    other = tiny_llama(scale=20.0, seed=7)
    m.load_state_dict(other.state_dict())
    a = m.generate(**x, max_new_tokens=10, do_sample=False)
    b = m.generate(**x, max_new_tokens=10, do_sample=False, csv_config=CSVConfig())
    assert torch.equal(a, b)
    # writes through .data bypass version counters: hf_csv.refresh is the documented remedy
    m.lm_head.weight.data.mul_(-1)
    hf_csv.refresh(m)
    a = m.generate(**x, max_new_tokens=10, do_sample=False)
    b = m.generate(**x, max_new_tokens=10, do_sample=False, csv_config=CSVConfig())
    assert torch.equal(a, b)


def test_a_lora_merge_through_data_rebuilds_the_screen(caplog):
    """peft's merge (``safe_merge=False``) writes ``base_layer.weight.data += B @ A * scaling``: no version bump, the
    same storage. The sampled row fingerprints (hf_csv.transformers.heads.WeightProbe) see it, the screen is rebuilt with a
    warning, and the tokens are stock's (before the probe: other tokens, counted certified)."""
    m = hf_csv.enable(tiny_llama(scale=20.0))
    x = _ids()
    m.generate(**x, max_new_tokens=4, csv_config=CSVConfig())  # builds and caches the screen
    g = torch.Generator().manual_seed(5)
    B, A = torch.randn(m.lm_head.weight.shape[0], 8, generator=g), torch.randn(8, m.lm_head.weight.shape[1], generator=g)
    m.lm_head.weight.data += 2.0 * B @ A
    a = m.generate(**x, max_new_tokens=10, do_sample=False)
    from transformers.utils import logging as tlogging

    tlogging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            b = m.generate(**x, max_new_tokens=10, do_sample=False, csv_config=CSVConfig())
    finally:
        tlogging.disable_propagation()
    assert torch.equal(a, b) and m.csv_last_stats["certified"] > 0
    assert "without a version-counter bump" in caplog.text


def test_a_screen_built_under_inference_mode_serves_a_call_in_grad_mode():
    """The row probe is built with the screen, maybe under ``torch.inference_mode()``; a later call in grad mode reads
    it (before: "Inference tensors cannot be saved for backward", from indexing the weight with the probe's rows)."""
    m = hf_csv.enable(tiny_llama(scale=20.0))
    x = _ids()
    with torch.inference_mode():
        m.generate(**x, max_new_tokens=3, csv_config=CSVConfig())
    a = m.generate(**x, max_new_tokens=6, do_sample=False)
    b = m.generate(**x, max_new_tokens=6, do_sample=False, csv_config=CSVConfig())
    assert torch.equal(a, b) and m.csv_last_stats["certified"] > 0


def test_deepcopy_of_an_enabled_model_runs_the_copy():
    m = hf_csv.enable(tiny_llama(scale=20.0))
    c = copy.deepcopy(m)
    with torch.no_grad():
        c.lm_head.weight.mul_(-1)
    x = _ids()
    want = type(c).generate(c, **x, max_new_tokens=8, do_sample=False)
    assert not torch.equal(want, type(m).generate(m, **x, max_new_tokens=8, do_sample=False))
    assert torch.equal(c.generate(**x, max_new_tokens=8, do_sample=False), want)
    assert torch.equal(c.generate(**x, max_new_tokens=8, do_sample=False, csv_config=CSVConfig()), want)
    assert c.csv_last_stats["certified"] > 0 and "csv_last_stats" not in m.__dict__
