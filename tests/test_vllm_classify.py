"""hf_csv.vllm.classify without vLLM: the head, batch and row classifiers on stand-ins of vLLM's metadata
(tests/vllm_doubles.py), one case per declined setting."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_csv.vllm.classify import (GREEDY, RowPlan, batch_decline_reason, head_decline_reason, lowering_steps,
                                  row_plans)
from vllm_doubles import (ImpostorBias, LogitBiasLogitsProcessor, MinPLogitsProcessor, MinTokensLogitsProcessor,
                          UserProcessor, batch_sm, rows_sm)


def test_greedy_batch_with_idle_builtin_processors_is_eligible():
    assert batch_decline_reason(batch_sm(), rows=2, num_reqs=2) is None


@pytest.mark.parametrize("change, reason", [
    (dict(max_num_logprobs=0), "logprobs"),
    (dict(logprob_token_ids={0: [5]}), "logprobs"),
    (dict(no_penalties=False, repetition_penalties=torch.tensor([1.0, 0.9]), frequency_penalties=torch.zeros(2),
          presence_penalties=torch.zeros(2)), "penalties that raise entries"),
    (dict(no_penalties=False, repetition_penalties=torch.ones(2), frequency_penalties=torch.tensor([0.0, -0.5]),
          presence_penalties=torch.zeros(2)), "penalties that raise entries"),
    (dict(no_penalties=False, repetition_penalties=torch.ones(2), frequency_penalties=torch.zeros(2),
          presence_penalties=torch.tensor([-1.0, 0.0])), "penalties that raise entries"),
    (dict(spec_token_ids=[[4], []]), "speculative decoding"),
    (dict(logitsprocs=SimpleNamespace(non_argmax_invariant=[LogitBiasLogitsProcessor({0: {3: 1.0}})])),
     "logit bias"),
    (dict(logitsprocs=SimpleNamespace(non_argmax_invariant=[UserProcessor()])), "logits processor UserProcessor"),
    (dict(logitsprocs=SimpleNamespace(non_argmax_invariant=[ImpostorBias()])),
     "logits processor LogitBiasLogitsProcessor"),
    (dict(thinking_budget_state_holder=SimpleNamespace(has_tracked_requests=lambda: True)), "thinking budget"),
])
def test_each_entry_changing_step_declines_the_batch(change, reason):
    assert batch_decline_reason(batch_sm(**change), rows=2, num_reqs=2) == reason


def test_lowering_steps_are_classified():
    assert not lowering_steps(batch_sm())
    pen = dict(no_penalties=False, repetition_penalties=torch.tensor([1.3, 1.0]),
               frequency_penalties=torch.tensor([0.0, 0.5]), presence_penalties=torch.zeros(2))
    for change in (pen, dict(allowed_token_ids_mask=torch.zeros(2, 10, dtype=torch.bool)),
                   dict(bad_words_token_ids={0: [[3]]}),
                   dict(logitsprocs=SimpleNamespace(non_argmax_invariant=[
                       MinTokensLogitsProcessor({0: (4, [], set(), 0)})]))):
        assert batch_decline_reason(batch_sm(**change), rows=2, num_reqs=2) is None
        assert lowering_steps(batch_sm(**change))


def test_rows_other_than_the_requests_and_structured_outputs_decline():
    assert batch_decline_reason(batch_sm(), rows=3, num_reqs=2) == "rows are not the batch's requests"
    assert batch_decline_reason(batch_sm(), rows=2, num_reqs=2, structured=True) == "structured outputs"
    assert batch_decline_reason(batch_sm(), rows=2, num_reqs=2, speculative=True) == "speculative decoding"
    assert batch_decline_reason(batch_sm(), rows=2, num_reqs=2, prompt_logprobs=True) == "prompt logprobs"


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
    assert head_decline_reason(_layer(), tp, H, None) == "tensor parallel head layout"
    tp.shard_indices = SimpleNamespace(num_added_elements=0)  # vocabulary shards of the model's own tokens
    assert head_decline_reason(_layer(), tp, H, None) is None
    tp.shard_indices = SimpleNamespace(num_added_elements=8)  # LoRA's added tokens: declined
    assert head_decline_reason(_layer(), tp, H, None) == "tensor parallel head layout"
    q = SimpleNamespace(tp_size=1, quant_method=object(), weight=w)
    assert head_decline_reason(_layer(), q, H, None) == "quantized head"
    assert head_decline_reason(_layer(), head, H.bfloat16(), None) == "head weight"
    # a reduced fp32 matmul precision changes the engine's fp32 values beyond the bound: declined, restored after
    prev = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        assert head_decline_reason(_layer(), head, H, None) == "reduced fp32 matmul precision"
        bf = SimpleNamespace(tp_size=1, quant_method=UnquantizedEmbeddingMethod(), weight=w.bfloat16())
        assert head_decline_reason(_layer(), bf, H.bfloat16(), None) is None  # bf16 values stay exact in bf16 passes
        hf = SimpleNamespace(tp_size=1, quant_method=UnquantizedEmbeddingMethod(), weight=w.half())
        assert head_decline_reason(_layer(), hf, H.half(), None) == "reduced fp32 matmul precision"  # hf_csv's GEMMs
    finally:
        torch.set_float32_matmul_precision(prev)
    assert head_decline_reason(_layer(), head, H, None) is None


def test_row_plans():
    V = 100
    assert row_plans(rows_sm([0.0, 0.0]), 2, V) == (None, [GREEDY, GREEDY])
    reason, plans = row_plans(rows_sm([0.0, 0.8, 1.0], top_k=[V, 20, V], top_p=[1.0, 1.0, 1.0],
                                       argmax_invariant=[MinPLogitsProcessor([0.0, 0.0, 0.0])]), 3, V)
    t08 = float(torch.tensor(0.8, dtype=torch.float32))  # vLLM's fp32 temperature, as its sampler divides by it
    assert reason is None and plans == [GREEDY, RowPlan(t08, 20), RowPlan(1.0, None)]
    # seeded rows, top-p and min-p need stock's padded row: a top-k, and vLLM's subset kernel probed bit-exact
    seeded = rows_sm([0.0, 0.8], top_k=[V, 20], generators={1: object()})
    assert row_plans(seeded, 2, V, values_ok=True) == (None, [GREEDY, RowPlan(t08, 20, True)])
    assert row_plans(seeded, 2, V)[0] == "seeded sampling rows: vLLM's kernel rounds a subset of the head otherwise"
    assert row_plans(rows_sm([0.0, 0.8], generators={1: object()}), 2, V, values_ok=True)[0] == \
        "seeded sampling rows without top-k"
    assert row_plans(rows_sm([0.0, 0.8], top_p=[1.0, 0.9]), 2, V, values_ok=True)[0] == "top-p without top-k"
    t09 = float(torch.tensor(0.9, dtype=torch.float32))
    assert row_plans(rows_sm([0.8], top_k=[5], top_p=[0.9]), 1, V, values_ok=True) == \
        (None, [RowPlan(t08, 5, True, top_p=t09)])  # top-p and min-p travel with the plan: their cuts are checked
    assert row_plans(rows_sm([0.8], top_k=[5], argmax_invariant=[MinPLogitsProcessor([0.1])]), 1, V,
                     values_ok=True) == (None, [RowPlan(t08, 5, True, min_p=0.1)])
    assert row_plans(rows_sm([0.8], top_k=[5], top_p=[0.9]), 70, V, values_ok=True)[0] is not None  # above the probe
    assert row_plans(rows_sm([0.0, 0.8], argmax_invariant=[MinPLogitsProcessor([0.0, 0.1])]), 2, V,
                     values_ok=True)[0] == "min-p without top-k"
    assert row_plans(rows_sm([0.8], argmax_invariant=[UserProcessor()]), 1, V)[0] == "logits processor UserProcessor"
    # lowering steps (penalties, masks) are certified on greedy rows only
    assert row_plans(rows_sm([0.0, 0.8]), 2, V, lowering=True)[0] == "penalties or masks with sampling rows"
    assert row_plans(rows_sm([0.0, 0.0]), 2, V, lowering=True) == (None, [GREEDY, GREEDY])
    # a seeded greedy row and min-p on a greedy row change nothing
    assert row_plans(rows_sm([0.0, 0.8], generators={0: object()},
                              argmax_invariant=[MinPLogitsProcessor([0.2, 0.0])]), 2, V)[0] is None
