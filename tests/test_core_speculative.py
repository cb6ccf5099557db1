"""hf_csv.core.speculative: the exact acceptance of drafts (and the lossy sigmoid one), the bounded acceptance of a
certified target and the keyed Gumbel-coupled acceptance.

Statistical tests: fixed seeds, chi-square at significance level ALPHA = 0.001, bins with an expected count < 5
merged into one. Each compares the empirical law of the emitted tokens with the analytic law of speculative
sampling (which is the target's) and, where stated, with the stock ``transformers`` function run on the same inputs
(tests/verify_laws.py). ``test_chi_square_has_power`` checks that the same machinery rejects a lossy acceptance."""
from __future__ import annotations

import math
import warnings
from collections import Counter

import pytest
import torch
from hypothesis import given, settings, strategies as st
from scipy import stats as sps

import hf_csv.core.speculative as kv
from hf_csv.core.speculative import exact as kv_exact, race as kv_race, sigmoid as kv_sigmoid
from hf_csv.transformers.acceptance import LossyVerifyWarning, speculative_sampling_exact
from hf_csv.core.speculative import (
    bounded_acceptance,
    exact_first_token_distribution,
    exact_acceptance,
    gumbel_coupled_acceptance,
    KeyedGumbel,
)

from conftest import ALPHA, _two_sample_p
from verify_laws import draw_drafts, gof_pvalue, make_case, run_stock, two_sample_pvalue


def _rows(V: int, L: int, g: torch.Generator, sharp: float = 3.0):
    """Peaked target rows, a sub-vocabulary draft (top-16 of a noisy copy, -inf elsewhere) and its tokens."""
    zp = -1.3 * (torch.randperm(V, generator=g).float() + 1).log()[None].repeat(L + 1, 1) * sharp
    zp = zp + 0.3 * torch.randn(L + 1, V, generator=g)
    zq = zp[:L] + 2.0 * torch.randn(L, V, generator=g)  # a poor draft: many rejections, residual draws
    kth = zq.topk(16, dim=1).values[:, -1:]
    zq = zq.masked_fill(zq < kth, float("-inf"))
    ids = torch.multinomial(torch.softmax(zq, -1), 1, generator=g).squeeze(1)
    return zp, zq, ids


def _bounded_case(zp: torch.Tensor, width: float, slack: float, g: torch.Generator):
    """known = the top entries of each row (about 1 - width of the mass); upper = value + slack elsewhere."""
    known = torch.zeros_like(zp, dtype=torch.bool)
    for j in range(zp.shape[0]):
        order = zp[j].argsort(descending=True)
        cum = torch.softmax(zp[j].double(), 0)[order].cumsum(0)
        known[j, order[: int((cum < 1 - width).sum()) + 1]] = True
    upper = (zp + slack * torch.rand(zp.shape, generator=g)).masked_fill(known, float("nan"))
    return known, upper


@pytest.mark.usefixtures("assume_subset_exact")
@pytest.mark.slow
@pytest.mark.parametrize("width,slack,sharp", [(1e-3, 0.05, 3.0), (0.2, 1.5, 3.0), (0.5, 3.0, 1.0), (0.5, 0.05, 1.0)])
def test_bounded_acceptance_law_equals_exact_acceptance(width, slack, sharp):
    """Same inputs, many draws: the joint law of (first emitted token, second or none) of the bounded acceptance
    equals the exact acceptance's; the first token's law equals p_0 (the theorem). Tight bounds decide most rows;
    loose ones force completions, which must not change the law either."""
    g = torch.Generator().manual_seed(7)
    V, L = 300, 3
    zp, zq, _ = _rows(V, L, g, sharp)
    known, upper = _bounded_case(zp, width, slack, g)
    z_in = zp.masked_fill(~known, float("-inf"))

    def complete(j, tokens):
        return zp[j] if tokens is None else zp[j, tokens]

    counts: dict = {}
    n = 4000
    gb, ge = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    obs_b, obs_e = Counter(), Counter()
    qs = torch.softmax(zq, -1)
    for _ in range(n):
        # the drafts are drawn afresh from q each time, so the first token's law is p_0 (the theorem)
        x = torch.multinomial(qs, 1, generator=g).squeeze(1)
        rb = bounded_acceptance(x, zq, z_in, known, upper, complete, generator=gb, counts=counts)
        re = exact_acceptance(x, zq, zp, generator=ge)
        obs_b[(int(rb.tokens[0]), int(rb.tokens[1]) if rb.tokens.numel() > 1 else -1)] += 1
        obs_e[(int(re.tokens[0]), int(re.tokens[1]) if re.tokens.numel() > 1 else -1)] += 1
    assert counts["rows"] > 0
    if slack < 0.1:  # tight bounds decide most rows (loose ones make the law test below exercise completion)
        assert counts["by_bounds"] > 0.8 * counts["rows"], counts
    else:
        assert counts["completed"] > 0, counts
    assert _two_sample_p(obs_b, obs_e) > ALPHA
    # first token against the analytic law p_0
    p0 = exact_first_token_distribution(zq[0], zp[0])
    first = Counter()
    for (a, _), c in obs_b.items():
        first[a] += c
    top = [i for i in p0.argsort(descending=True).tolist() if p0[i] * n >= 5]
    o = [first[i] for i in top] + [n - sum(first[i] for i in top)]
    e = [float(p0[i]) * n for i in top] + [n * (1 - float(p0[top].sum()))]
    assert sps.chisquare(o, e).pvalue > ALPHA


@pytest.mark.usefixtures("assume_subset_exact")
def test_bounded_acceptance_bonus_law():
    """L = 0 (only the bonus draw): the law is softmax of the row, with half its mass outside the exact set and
    tight bounds there, so the bounds decide most draws (chi-square goodness of fit, α = 1e-3)."""
    g = torch.Generator().manual_seed(5)
    V = 300
    zp, _, _ = _rows(V, 0, g, sharp=1.0)
    known, upper = _bounded_case(zp, 0.5, 0.05, g)
    counts: dict = {}
    gb = torch.Generator().manual_seed(9)
    n = 3000
    obs = Counter()
    for _ in range(n):
        r = bounded_acceptance(torch.empty(0, dtype=torch.long), torch.empty(0, V), zp.masked_fill(~known, float("-inf")),
                           known, upper, lambda j, t: zp[j] if t is None else zp[j, t], generator=gb, counts=counts)
        obs[int(r.tokens[0])] += 1
    assert counts["by_bounds"] > 0.3 * n, counts  # about half the mass is bounded: the rest needs the row
    p = torch.softmax(zp[0].double(), 0)
    top = [i for i in p.argsort(descending=True).tolist() if p[i] * n >= 5]
    o = [obs[i] for i in top] + [n - sum(obs[i] for i in top)]
    e = [float(p[i]) * n for i in top] + [n * (1 - float(p[top].sum()))]
    assert sps.chisquare(o, e).pvalue > ALPHA


@pytest.mark.usefixtures("assume_subset_exact")
def test_bounded_acceptance_needs_exact_rows_where_bounds_are_useless():
    """Upper bounds of +inf decide nothing: every decision completes its row, and the result is still valid."""
    g = torch.Generator().manual_seed(3)
    zp, zq, ids = _rows(200, 2, g)
    known = torch.zeros_like(zp, dtype=torch.bool)
    known[:, :5] = True
    upper = torch.full_like(zp, float("inf"))
    calls = []

    def complete(j, tokens):
        calls.append((j, None if tokens is None else tokens.numel()))
        return zp[j] if tokens is None else zp[j, tokens]

    counts: dict = {}
    res = bounded_acceptance(ids, zq, zp.masked_fill(~known, float("-inf")), known, upper, complete,
                         generator=torch.Generator().manual_seed(0), counts=counts)
    assert counts["completed"] >= 1 and any(t is None for _, t in calls)
    assert 1 <= res.tokens.numel() <= 3


@pytest.mark.usefixtures("assume_subset_exact")
def test_keyed_gumbel_rows_are_a_function_of_seed_and_key():
    a, b = KeyedGumbel(123, cache=2), KeyedGumbel(123, cache=2)
    r5 = a.row(5, 1000).clone()
    for k in (6, 7, 8):  # evict key 5 from a's cache: regenerated, identical
        a.row(k, 1000)
    assert torch.equal(a.row(5, 1000), r5) and torch.equal(b.row(5, 1000), r5)
    assert not torch.equal(a.row(6, 1000), r5)
    assert not torch.equal(KeyedGumbel(124).row(5, 1000), r5)
    # standard Gumbel: mean γ ≈ 0.5772, variance π²/6 (200k draws; 6 standard errors)
    x = KeyedGumbel(9).rows(range(200), 1000).double().flatten()
    assert abs(x.mean().item() - 0.5772) < 6 * (1.645 / 2e5) ** 0.5
    assert abs(x.var().item() - 1.6449) < 0.05


@pytest.mark.usefixtures("assume_subset_exact")
def test_gumbel_coupled_acceptance_accepts_the_matching_prefix():
    g = torch.Generator().manual_seed(0)
    L, V = 4, 50
    rows = torch.randn(L + 1, V, generator=g)
    noise = KeyedGumbel(1).rows(range(L + 1), V)
    y = (rows + noise).argmax(1)
    full = gumbel_coupled_acceptance(y[:L].clone(), rows, noise)
    assert full.n_accepted == L and full.tokens.tolist() == y.tolist()  # all accepted, then the bonus draw
    x = y[:L].clone()
    x[2] = (x[2] + 1) % V
    res = gumbel_coupled_acceptance(x, rows, noise)
    assert res.n_accepted == 2 and res.tokens.tolist() == y[:3].tolist()  # the target's own token at the mismatch
    one_hot = torch.full((L + 1, V), float("-inf"))
    one_hot[torch.arange(L + 1), y] = 0.0  # hf_csv's certified draws arrive as one-hot rows
    assert gumbel_coupled_acceptance(x, one_hot, noise).tokens.tolist() == y[:3].tolist()
    with pytest.raises(ValueError):
        gumbel_coupled_acceptance(x, rows[:L], noise[:L])


def run_ours(zp, zq, drafts, g, fn=kv.exact_acceptance, **kw) -> list[tuple[int, ...]]:
    return [tuple(fn(d, zq, zp, generator=g, **kw).tokens.tolist()) for d in drafts]


def seq_law(zp: torch.Tensor, zq: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Analytic law of the emitted sequence of one acceptance with drafts x_j ~ q_j:
    P(x_1..x_k, t) = prod_{j<k} min(p_j, q_j)(x_j) * (max(0, p_k - q_k)(t) if k < L else p_L(t))."""
    p = torch.softmax(zp.double(), -1)
    q = torch.softmax(zq.double(), -1)
    L, V = zq.shape
    law: dict[tuple[int, ...], float] = {}

    def rec(prefix: tuple[int, ...], mass: float) -> None:
        k = len(prefix)
        last = (p[k] - q[k]).clamp_min(0) if k < L else p[L]
        for t in range(V):
            if last[t] > 0:
                law[prefix + (t,)] = mass * float(last[t])
        if k < L:
            acc = torch.minimum(p[k], q[k])
            for x in range(V):
                if acc[x] > 0:
                    rec(prefix + (x,), mass * float(acc[x]))

    rec((), 1.0)
    return law


def n_t_law(zp: torch.Tensor, zq: torch.Tensor) -> dict[tuple[int, int], float]:
    """Analytic law of (number accepted n, last emitted token t)."""
    p = torch.softmax(zp.double(), -1)
    q = torch.softmax(zq.double(), -1)
    L, V = zq.shape
    law, surv = {}, 1.0
    for k in range(L + 1):
        last = (p[k] - q[k]).clamp_min(0) if k < L else p[L]
        for t in range(V):
            if last[t] > 0:
                law[(k, t)] = surv * float(last[t])
        if k < L:
            surv *= float(torch.minimum(p[k], q[k]).sum())
    return law


@pytest.mark.usefixtures("one_thread")
@pytest.mark.slow
@pytest.mark.parametrize("V,L,sub,seed", [(12, 3, None, 0), (16, 2, 9, 1), (8, 1, 5, 2)])
def test_exact_matches_analytic_law_and_stock(V, L, sub, seed):
    """(n, last token) and the first emitted token follow the analytic law (whose first-token
    marginal is the target p_0), for both ours and stock, and ours and stock agree."""
    N = 10000
    zp, zq, g = make_case(V, L, seed, sub=sub)
    drafts = draw_drafts(zq, N, g)
    ours = run_ours(zp, zq, drafts, g)
    stock = run_stock(zp, zq, drafts, seed)
    law = n_t_law(zp, zq)
    c_ours = Counter((len(s) - 1, s[-1]) for s in ours)
    c_stock = Counter((len(s) - 1, s[-1]) for s in stock)
    assert gof_pvalue(c_ours, law, N) > ALPHA
    assert gof_pvalue(c_stock, law, N) > ALPHA
    assert two_sample_pvalue(c_ours, c_stock) > ALPHA
    # first emitted token ~ p_0 exactly (the theorem), for ours
    p0 = torch.softmax(zp[0].double(), -1)
    first = Counter(s[0] for s in ours)
    assert gof_pvalue(first, {t: float(p0[t]) for t in range(V)}, N) > ALPHA
    # acceptance rate matches sum_x min(p, q) at the first position (sanity of the ratio)
    a0 = float(torch.minimum(torch.softmax(zp[0].double(), -1), torch.softmax(zq[0].double(), -1)).sum())
    acc = sum(len(s) > 1 for s in ours) / N
    assert abs(acc - a0) < 4 * math.sqrt(a0 * (1 - a0) / N) + 1e-9


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("lazy", [True, False])
def test_exact_full_sequence_law(lazy):
    """Whole emitted sequences (accepted drafts + final token), V=8, L=2, vs the analytic law, for
    the lazy (CPU default) and the batched (GPU default) paths."""
    N = 10000
    zp, zq, g = make_case(8, 2, seed=7, sub=6)
    drafts = draw_drafts(zq, N, g)
    c = Counter(run_ours(zp, zq, drafts, g, lazy=lazy))
    assert gof_pvalue(c, seq_law(zp, zq), N) > ALPHA


@pytest.mark.usefixtures("one_thread")
def test_ensemble_weight_matches_stock():
    """With stock's DIVERSE ensemble weight (lossy in both), ours follows stock's law."""
    N = 4000
    zp, zq, g = make_case(10, 2, seed=3)
    drafts = draw_drafts(zq, N, g)
    ours = Counter((len(s) - 1, s[-1]) for s in run_ours(zp, zq, drafts, g, ensemble_weight=0.6))
    stock = Counter((len(s) - 1, s[-1]) for s in run_stock(zp, zq, drafts, 3, assistant_ensemble_weight=0.6))
    assert two_sample_pvalue(ours, stock) > ALPHA


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("V", [2048 + 77, 5000])
def test_two_level_race_is_exact(V):
    """The blocked exponential race (V > 4 * RACE_BLOCK, with a partial tail block) draws i with
    probability w_i / sum w, including zero weights never being drawn."""
    assert V > 4 * kv.RACE_BLOCK
    g = torch.Generator().manual_seed(V)
    w = torch.zeros(V)
    support = torch.randperm(V, generator=g)[:15]
    support[0] = V - 1  # a token in the tail block
    w[support] = torch.rand(15, generator=g) + 0.05
    N = 10000
    c = Counter(int(kv_race.race(w.clone(), g)[0]) for _ in range(N))
    law = {int(i): float(w[i] / w.sum()) for i in support}
    assert gof_pvalue(c, law, N) > ALPHA


@pytest.mark.usefixtures("one_thread")
def test_chi_square_has_power():
    """Sanity of the statistical machinery: the lossy sigmoid acceptance is rejected against the target's law."""
    N = 4000
    zp, zq, g = make_case(12, 2, seed=5, noise=1.5)
    drafts = draw_drafts(zq, N, g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LossyVerifyWarning)
        c = Counter((len(s) - 1, s[-1]) for s in run_ours(zp, zq, drafts, g, fn=kv.sigmoid_acceptance))
    assert gof_pvalue(c, n_t_law(zp, zq), N) < ALPHA


@pytest.mark.usefixtures("one_thread")
def test_all_accepted_when_draft_equals_target():
    zp, _, g = make_case(50, 4, seed=11)
    zq = zp[:4].clone()
    for _ in range(200):
        d = draw_drafts(zq, 1, g)[0]
        r = kv.exact_acceptance(d, zq, zp, generator=g)
        assert r.n_accepted == 4 and r.tokens[:4].tolist() == d.tolist() and 0 <= r.tokens[4] < 50


@pytest.mark.usefixtures("one_thread")
def test_none_accepted_when_target_forbids_drafts():
    zp, zq, g = make_case(40, 3, seed=12)
    for _ in range(200):
        d = draw_drafts(zq, 1, g)[0]
        zp2 = zp.clone()
        zp2[0, d[0]] = float("-inf")  # p(x_1) = 0: must be rejected, never accepted
        banned = torch.isneginf(zp2[0])
        r = kv.exact_acceptance(d, zq, zp2, generator=g)
        assert r.n_accepted == 0 and r.tokens.shape == (1,)
        assert not banned[r.tokens[0]]  # the residual never emits a p = 0 token


@pytest.mark.usefixtures("one_thread")
def test_subvocab_draft_no_nan_and_valid():
    """Draft logits -inf outside a sub-vocabulary (q = 0 there): no NaN, valid tokens, and the
    residual can emit tokens outside the sub-vocabulary."""
    V, L = 300, 3
    zp, zq, g = make_case(V, L, seed=13, sub=20, noise=2.0)
    outside = set()
    for _ in range(300):
        d = draw_drafts(zq, 1, g)[0]
        for lazy in (True, False):
            r = kv.exact_acceptance(d, zq, zp, generator=g, lazy=lazy)
            assert r.tokens.dtype == torch.long and 0 <= r.n_accepted <= L
            assert r.tokens.shape == (r.n_accepted + 1,)
            assert ((r.tokens >= 0) & (r.tokens < V)).all()
            if r.n_accepted < L and torch.isneginf(zq[r.n_accepted, r.tokens[-1]]):
                outside.add(int(r.tokens[-1]))
    assert outside  # tokens the draft cannot propose still get their target mass


@pytest.mark.usefixtures("one_thread")
def test_zero_draft_probability_is_a_caller_bug():
    zp, zq, _ = make_case(20, 2, seed=14, sub=5)
    bad = torch.tensor([int(torch.isneginf(zq[0]).nonzero()[0]), 0])
    with pytest.raises(kv.DraftProbabilityError):
        kv.exact_acceptance(bad, zq, zp)
    with pytest.raises(ValueError):  # DraftProbabilityError is a ValueError
        speculative_sampling_exact(torch.cat([torch.zeros(2, dtype=torch.long), bad])[None], zq[None], 2, zp[None])


@pytest.mark.usefixtures("one_thread")
def test_all_inf_row_raises_not_nan():
    zp, zq, _ = make_case(20, 1, seed=15)
    zp[0] = float("-inf")
    with pytest.raises(kv.DraftProbabilityError):
        kv.exact_acceptance(torch.tensor([3]), zq, zp)


@pytest.mark.usefixtures("one_thread")
def test_vanished_residual_falls_back_to_target(monkeypatch):
    """If the residual max(0, p - q) is numerically all zero at a rejected row (p == q to float
    precision), the token is drawn from p -- never NaN, never a p = 0 token."""
    w = torch.zeros(3000)
    assert kv_race.race(w, None)[1] is False  # all-zero weights are reported, not silently index 0
    real = kv_race.race
    state = {"first": True}

    def fake(weights, generator):
        if state["first"]:
            state["first"] = False
            return torch.tensor(0), False
        return real(weights, generator)

    monkeypatch.setattr(kv_exact, "race", fake)
    zp, zq, g = make_case(30, 1, seed=16)
    d = draw_drafts(zq, 1, g)[0]
    zp[0, d[0]] = float("-inf")  # forces the rejection
    zp[0, 0] = float("-inf")  # the fake's index: must not leak out
    for _ in range(50):
        state["first"] = True
        r = kv.exact_acceptance(d, zq, zp, generator=g)
        assert r.n_accepted == 0 and not torch.isneginf(zp[0, r.tokens[0]])


@pytest.mark.usefixtures("one_thread")
def test_draft_length_zero_is_bonus_only():
    zp, _, g = make_case(10, 0, seed=18)
    r = kv.exact_acceptance(torch.zeros(0, dtype=torch.long), torch.zeros(0, 10), zp, generator=g)
    assert r.n_accepted == 0 and r.tokens.shape == (1,)


@pytest.mark.usefixtures("one_thread")
@settings(max_examples=40, deadline=None)
@given(V=st.integers(2, 3000), L=st.integers(1, 4), sub=st.integers(1, 50), seed=st.integers(0, 10_000),
       scale=st.floats(0.1, 60.0))
def test_property_no_nan_valid_output(V, L, sub, seed, scale):
    """Any logits (huge scales underflow softmax to 0 in fp32; -inf outside a sub-vocabulary):
    valid tokens, never a p = 0 or NaN-driven choice."""
    g = torch.Generator().manual_seed(seed)
    zp = torch.randn(L + 1, V, generator=g) * scale
    zq = torch.randn(L, V, generator=g) * scale
    if sub < V:
        zq[:, torch.randperm(V, generator=g)[sub:]] = float("-inf")
    zp[:, torch.randperm(V, generator=g)[: V // 3]] = float("-inf")
    zp[:, zp[0].argmax()] = 0.0  # keep every target row normalizable
    d = draw_drafts(zq, 1, g)[0]
    r = kv.exact_acceptance(d, zq, zp, generator=g)
    assert r.tokens.shape == (r.n_accepted + 1,)
    assert not torch.isneginf(zp[r.n_accepted, r.tokens[-1]])
    assert all(not torch.isneginf(zp[j, d[j]]) for j in range(r.n_accepted))


@pytest.mark.usefixtures("one_thread")
def test_sigmoid_kernel_warns_once_and_matches_its_analytic_law():
    kv_sigmoid._reset_sigmoid_warning()
    zp, zq, g = make_case(12, 1, seed=19, noise=1.5)
    with pytest.warns(LossyVerifyWarning):
        kv.sigmoid_acceptance(torch.tensor([0]), zq, zp, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LossyVerifyWarning)
        kv.sigmoid_acceptance(torch.tensor([0]), zq, zp, generator=g)  # second call: silent
    N = 6000
    drafts = draw_drafts(zq, N, g)
    first = Counter(s[0] for s in run_ours(zp, zq, drafts, g, fn=kv.sigmoid_acceptance))
    law, p_acc = kv.sigmoid_first_token_distribution(zq[0], zp[0])
    assert gof_pvalue(first, {t: float(law[t]) for t in range(12)}, N) > ALPHA
    assert p_acc > 0.99  # saturation: nearly everything accepted
    tv = 0.5 * float((law - torch.softmax(zp[0].double(), -1)).abs().sum())
    assert tv > 0.05  # lossy, measurably
