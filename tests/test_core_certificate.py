"""Each certificate's output equals the full computation."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from hf_csv.core.certificate import CertifiedHead
from hf_csv.core.index import VocabIndex
from hf_csv_kernels import gamma
from conftest import ALPHA, _chi2_p
from test_core_bounds import exact64, heads


def _true_topk_ok(ex64: torch.Tensor, idx: torch.Tensor, k: int, tol: torch.Tensor) -> bool:
    """Every returned index has a true logit within rounding tolerance of the true k-th largest."""
    kth = ex64.topk(k, dim=1).values[:, -1:]
    return bool((ex64.gather(1, idx) >= kth - tol).all())


def _tol(W, H):
    return gamma(W.shape[1] + 2) * 4 * (H.double().abs() @ W.double().abs().T).amax(1, keepdim=True) + 1e-12


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(heads(), st.integers(1, 5), st.sampled_from(["screen", "cluster"]))
def test_topk_matches_full(head, k, provider):
    W, bias, H = head
    k = min(k, W.shape[0])
    index = VocabIndex.build(W, bias, num_clusters=min(4, W.shape[0]), niter=2, progress=False) if provider == "cluster" else None
    ch = CertifiedHead(W, bias, provider=provider, index=index, budget=1.0)
    res = ch.topk(H, k)
    ex = exact64(W, bias, H)
    idx = res.logits.topk(k, dim=1).indices
    assert _true_topk_ok(ex, idx, k, _tol(W, H))
    # the values returned on S are the exact fp32 logits
    full = ch.full(H)
    on = torch.isfinite(res.logits)
    assert torch.allclose(res.logits[on].double(), full[on].double(), rtol=0, atol=float(_tol(W, H).max()) * 2)
    # every token outside S is provably below the k-th value; a top-1 row whose top-2 gap is within the values'
    # slack takes stock's whole row (near_ties, docs/certificates.md §2.0)
    assert res.stats.certified + res.stats.near_ties == H.shape[0]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(heads(), st.sampled_from([1e-1, 1e-3, 1e-6]), st.sampled_from([0.5, 1.0, 2.0]))
def test_epsilon_tv_bound(head, eps, T):
    W, bias, H = head
    ch = CertifiedHead(W, bias, budget=1.0)
    res = ch.epsilon(H, eps=eps, temperature=T)
    p = torch.softmax(exact64(W, bias, H) / T, dim=1)
    q = torch.softmax(res.logits.double() / T, dim=1)
    tv = 0.5 * (p - q).abs().sum(1)
    # fp32 logits themselves err by up to ~γ_d·Σ|W h| from the float64 truth; that shifts TV by at most that / T
    rounding = (_tol(W, H)[:, 0] / T).clamp(max=1.0)
    assert (tv <= eps + rounding + 1e-9).all(), (tv.max().item(), eps)
    assert res.stats.tv_bound_max <= eps


def test_exact_sampling_chi_square():
    """Lazy Gumbel-max draws are indistinguishable from softmax(ℓ/T): chi-square at α = 0.001."""
    g = torch.Generator().manual_seed(1234)
    V, d, n = 40, 16, 40000
    W = torch.randn(V, d, generator=g) * 0.5
    b = torch.randn(V, generator=g) * 0.3
    h = torch.randn(1, d, generator=g)
    for T, top_k in [(1.0, None), (0.7, None), (1.3, 5)]:
        ch = CertifiedHead(W, b, budget=1.0)
        res = ch.sample(h.expand(n, d).contiguous(), temperature=T, top_k=top_k, generator=g)
        logits = exact64(W, b, h)[0] / T
        if top_k:
            kth = logits.topk(top_k).values[-1]
            logits = torch.where(logits >= kth, logits, torch.tensor(float("-inf"), dtype=logits.dtype))
        p = torch.softmax(logits, 0)
        counts = torch.bincount(res.tokens, minlength=V).double()
        assert counts[p == 0].sum() == 0
        keep = p * n >= 5  # pool small expected counts into one cell
        obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
        exp = torch.cat([p[keep] * n, (p[~keep] * n).sum()[None]])
        if exp[-1] == 0:
            obs, exp = obs[:-1], exp[:-1]
        stat, pval = sps.chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item())
        assert pval > 1e-3, (T, top_k, pval)
        assert res.stats.mean_subvocab_fraction < 1.0


def test_budget_fallback_is_exact_and_counted():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(300, 8, generator=g)
    H = torch.randn(3, 8, generator=g)
    ch = CertifiedHead(W, budget=1)
    res = ch.topk(H, 2)
    assert res.stats.fallback + res.stats.certified == 3
    assert torch.equal(res.logits.topk(2).indices, ch.full(H).topk(2).indices) or res.stats.fallback == 3
    assert torch.isfinite(res.logits[res.mask.all(1)]).all()


def test_default_budget_certifies_rows_up_to_an_eighth_of_v():
    """The default budget is V/8 (speed only). A multi-row call with one row whose S holds 5-12.5 % of V is certified
    as a whole with the default, with stock's top-k values on every row, where a 5 % budget sends that row to the
    full head (and, in a real head, the whole call through the full GEMM: docs/benchmarks.md §3)."""
    g = torch.Generator().manual_seed(0)
    V, d, k, m = 4000, 32, 20, 320  # a cluster of m = 8 % of V near-equal rows: a flat top, |S| ~ m
    W = torch.randn(V, d, generator=g)
    w0 = torch.randn(d, generator=g)
    W[:m] = w0 + 1e-3 * torch.randn(m, d, generator=g)
    base = 2 * w0[None]
    n = int(CertifiedHead(W, budget=1.0).topk(base, k).mask.sum())
    assert 0.05 * V < n <= V // 8, n
    H = torch.cat([base, torch.randn(2, d, generator=g) * 4])
    ch = CertifiedHead(W)
    assert ch.budget == math.ceil(V / 8)
    res = ch.topk(H, k)
    assert res.stats.fallback == 0 and res.stats.certified == 3
    assert not bool(res.mask[0].all())  # the flat row kept its own S (not the full row)
    ref = ch.stock(H)
    top = ref.topk(k, dim=1)
    assert torch.equal(res.logits.topk(k, dim=1).indices.sort(1).values, top.indices.sort(1).values)
    assert torch.equal(res.logits.gather(1, top.indices), top.values)
    low = CertifiedHead(W, budget=0.05).topk(H, k)
    assert low.stats.fallback == 1 and bool(low.mask[0].all())


def test_wider_k_falls_back_to_k_min_per_row_not_to_the_full_head():
    """``topk(k, k_min=...)``: a row whose set for k would exceed the budget gets the set for k_min (stock's top-k_min
    exactly, certified) instead of the full row; other rows keep stock's top-k (config.lowered_k: a wider set after
    a repetition penalty must never cost a row its certificate)."""
    g = torch.Generator().manual_seed(1)
    V, d, k, k_min, m = 4000, 32, 10, 5, 600  # m > budget V/8 = 500 near-equal rows just below the top 5
    w0 = torch.randn(d, generator=g)
    W = torch.randn(V, d, generator=g)
    W[:k_min] = 3 * w0 + 0.05 * torch.randn(k_min, d, generator=g)
    W[k_min:k_min + m] = w0 + 1e-3 * torch.randn(m, d, generator=g)
    H = torch.cat([2 * w0[None], torch.randn(1, d, generator=g) * 4])
    ch = CertifiedHead(W)
    plain = ch.topk(H, k)
    assert plain.stats.fallback == 1 and bool(plain.mask[0].all())  # row 0's top-10 set holds the whole cluster
    res = ch.topk(H, k, k_min=k_min)
    assert res.stats.fallback == 0 and res.stats.certified == 2
    assert int(res.mask[0].sum()) < m  # the k_min set, without the cluster
    ref = ch.stock(H)
    for row, kk in ((0, k_min), (1, k)):  # stock's top-k_min on the narrowed row, top-k on the other
        top = ref[row].topk(kk)
        assert torch.equal(res.logits[row].topk(kk).indices.sort().values, top.indices.sort().values)
        assert torch.equal(res.logits[row, top.indices], top.values)
        outside = ~res.mask[row]
        assert bool((ref[row][outside] <= res.bound[row]).all()) and float(res.bound[row]) < float(top.values[-1])
    with pytest.raises(ValueError, match="k_min"):
        ch.topk(H, k, k_min=k + 1)

def test_nonfinite_hidden_state_falls_back_counted():
    W = torch.randn(100, 8)
    H = torch.randn(3, 8)
    H[1, 2] = float("nan")
    res = CertifiedHead(W).topk(H)
    assert res.stats.nonfinite == 1 and res.stats.fallback >= 1
    assert torch.isnan(res.logits[1]).all()  # same as the full head: no silent token
    assert torch.equal(res.logits[[0, 2]].argmax(1), (H[[0, 2]] @ W.T).argmax(1))


def test_bad_inputs_raise_clearly():
    ch = CertifiedHead(torch.randn(10, 4))
    with pytest.raises(ValueError, match=r"\[N, 4\]"):
        ch.topk(torch.randn(2, 5))
    with pytest.raises(TypeError):
        ch.topk(torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="k must be"):
        ch.topk(torch.randn(1, 4), k=11)
    with pytest.raises(ValueError, match="epsilon"):
        ch.epsilon(torch.randn(1, 4), eps=0)
    with pytest.raises(ValueError, match="temperature"):
        ch.sample(torch.randn(1, 4), temperature=0)
    with pytest.raises(ValueError, match="budget"):
        CertifiedHead(torch.randn(10, 4), budget=1.5)
    with pytest.raises(ValueError, match="provider"):
        CertifiedHead(torch.randn(10, 4), provider="magic")


def test_bf16_out_dtype_keeps_rounding_ties():
    """With out_dtype=bf16, tokens that round to the top value are all in S (matches a bf16 head)."""
    g = torch.Generator().manual_seed(3)
    W = (torch.randn(2000, 32, generator=g) * 0.02).bfloat16()
    H = torch.randn(8, 32, generator=g).bfloat16()
    res = CertifiedHead(W).topk(H.float(), 1, out_dtype=torch.bfloat16)
    stock = (H.float() @ W.float().T).bfloat16()
    top = stock.max(1, keepdim=True).values
    tied = stock == top
    assert (res.mask | ~tied).all()
    assert torch.equal(res.logits.max(1).values, top[:, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [0.3, 0.7, 1.3, 3.0, 7.0])
def test_cut_order_stays_strict_after_the_temperature(dtype, T):
    """docs/certificates.md §3.9 (compiled sampling): every value the cut leaves outside (<= b, in the dtype) is
    strictly below round_d(lo) after x/T, for division and for multiplication by the rounded reciprocal. The plain
    cut does not survive a narrowing temperature in float32: for some lo its bound ties with lo after x/T (checked, so
    this test fails if the margin is dropped)."""
    from hf_csv.core.certificate.rounding import _cut, _cut_order

    g = torch.Generator().manual_seed(int(T * 10))
    lo = torch.cat([torch.randn(20000, generator=g) * 30, torch.tensor([1e-3, -1e-3, 17.0, -17.0])])
    E = torch.zeros_like(lo)
    t, b = _cut_order(lo, E, dtype, T)
    L = lo.to(dtype).float()
    ok = torch.isfinite(t)
    assert bool(ok.all())
    bd = b.to(dtype).float()
    assert torch.equal(bd, b)  # b is a value of the dtype
    for proc in (lambda x: x / T, lambda x: x * torch.tensor(1.0 / T, dtype=torch.float32)):
        assert bool((proc(b) < proc(L)).all())
        # the cut's own guarantee: anything below t (here E = 0: below the edge) rounds to <= b
        below = torch.nextafter(t, torch.full_like(t, float("-inf")))
        assert bool((below.to(dtype).float() <= b).all())
    _, b_plain = _cut(lo, E, dtype)
    if dtype == torch.float32 and T > 1:  # (a bf16 step, or a widening map, leaves no float32 tie)
        assert bool((b_plain / T == L / T).any()), "the plain cut should tie somewhere after x/T"
    # non-finite, zero and subnormal-after-temperature rows are not certified
    t2, b2 = _cut_order(torch.tensor([float("nan"), 0.0, 1e-35]), torch.zeros(3), dtype, 1e4)
    assert bool(torch.isneginf(t2).all()) and bool(torch.isposinf(b2).all())
    with pytest.raises(ValueError):
        _cut_order(lo, E, dtype, 0.0)


# ------------------------------------------------------------------ the native one-row top-1 epilogue
def _native_or_skip():
    from hf_csv_kernels import native
    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.why_unavailable()}")


def _counting_top1(monkeypatch):
    """Count the calls of the dispatch op ``top1`` and how many it left to the torch path (heads built after this
    call: a head resolves the op when it is built)."""
    from hf_csv_kernels import dispatch, native
    seen = {"calls": 0, "declined": 0}

    def spy(*a, **k):
        got = native.top1(*a, **k)
        seen["calls"] += 1
        seen["declined"] += got.n < 0
        return got

    monkeypatch.setitem(dispatch._REGISTRY["top1"], "native", spy)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V,d,scale", [(1000, 12, 3.0), (5000, 64, 3.0), (3000, 77, 0.3), (20000, 256, 3.0)])
def test_native_top1_is_a_valid_certificate_and_agrees_with_the_torch_path(V, d, scale, dtype, monkeypatch):
    """own_values=True (the native epilogue) on random heads, float32 and bfloat16: stock's argmax (the first maximum),
    every token outside S at most the bound, the bound below stock's top value, stock's value inside each value's
    interval (value_interval of its accumulator and slack), S as the torch path's on nearly every row, the stats
    counting S. Rows include exact ties (duplicated head rows)."""
    from hf_csv.core.certificate import value_interval

    _native_or_skip()
    g = torch.Generator().manual_seed(V + d)
    W = torch.randn(V, d, generator=g) * 0.05
    W[V // 2] = W[V // 3]  # an exact tie whenever one of them is the top: the first index wins
    W[V - 1] = W[7]
    W = W.to(dtype)
    seen = _counting_top1(monkeypatch)
    ch = CertifiedHead(W)
    od = None if dtype == torch.float32 else dtype
    same_s = 0
    rows = 60
    for i in range(rows):
        h = torch.randn(1, d, generator=g) * scale
        if i % 5 == 0:  # aim the row at a tied pair
            j = (V // 3, 7)[i % 2]
            h = (W[j:j + 1].float() / W[j].float().norm() * 40 + h * 0.01)
        h = h.to(dtype)
        nat = ch.topk(h, 1, out_dtype=od, own_values=True)
        ref = ch.topk(h, 1, out_dtype=od)
        stock = torch.nn.functional.linear(h, W)[0].float()
        am = int(stock.argmax())
        assert nat.logits.dtype == dtype
        assert int(nat.logits.argmax()) == am == int(ref.logits.argmax())
        assert nat.stats.rows == 1 and nat.stats.certified + nat.stats.fallback == 1
        S = nat.mask[0]
        if nat.stats.certified:
            assert bool(S[am])
            if bool((~S).any()):
                assert float(stock[~S].max()) <= float(nat.bound[0])
            assert float(nat.bound[0]) < float(stock[am])
            r, t, acc = nat.acc
            assert torch.equal(t, S.nonzero().view(-1))
            lo, hi = value_interval(acc[None], nat.slack, dtype)
            assert bool(((lo[0] <= stock[t]) & (stock[t] <= hi[0])).all())
            assert torch.equal(nat.logits[0, t], acc.to(dtype)) and bool(torch.isinf(nat.logits[0, ~S]).all())
            assert nat.stats.subvocab_sizes == [int(S.sum())]
        same_s += bool(torch.equal(S, ref.mask[0]))
    assert seen["calls"] == rows
    assert seen["declined"] <= rows // 4, seen  # (near ties and over-budget rows go to the torch path)
    assert same_s >= rows - 3  # the seed's dot product in another order can move the cut by an ulp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_top1_on_several_rows_equals_its_rows_one_by_one(dtype, monkeypatch):
    """A batched call gives each row what a one-row call gives (logits, S, bound, slack, accumulators in row order),
    and one row the native call cannot finish sends the whole call to the torch path (stock's argmax on every row)."""
    _native_or_skip()
    g = torch.Generator().manual_seed(11)
    W = (torch.randn(6000, 96, generator=g) * 0.05).to(dtype)
    seen = _counting_top1(monkeypatch)
    ch = CertifiedHead(W)
    od = None if dtype == torch.float32 else dtype
    H = (torch.randn(5, 96, generator=g) * 3).to(dtype)
    many = ch.topk(H, 1, out_dtype=od, own_values=True)
    assert seen["calls"] == 1 and seen["declined"] == 0 and many.stats.native == 5
    rows, toks, acc = many.acc
    at = 0
    for r in range(5):
        one = ch.topk(H[r:r + 1], 1, out_dtype=od, own_values=True)
        assert torch.equal(many.logits[r], one.logits[0]) and torch.equal(many.mask[r], one.mask[0])
        assert float(many.bound[r]) == float(one.bound[0]) and float(many.slack[r]) == float(one.slack[0])
        n = one.acc[1].numel()
        assert torch.equal(rows[at:at + n], torch.full((n,), r)) and torch.equal(toks[at:at + n], one.acc[1])
        assert torch.equal(acc[at:at + n], one.acc[2])
        at += n
    assert at == toks.numel() and many.stats.subvocab_sizes == [int(m.sum()) for m in many.mask]
    # a row over the budget (near-equal head rows make its S large): the torch path takes the call
    W2 = W.float().clone()
    W2[:3000] = W2[0] + torch.randn(3000, 96, generator=g) * 1e-5
    ch2 = CertifiedHead(W2.to(dtype), budget=50)
    H2 = torch.cat([H[:2], (W2[0:1] * 30).to(dtype)])
    res = ch2.topk(H2, 1, out_dtype=od, own_values=True)
    assert seen["calls"] == 7 and seen["declined"] == 1 and res.stats.native == 0  # (1 batched + 5 one-row calls before)
    stock = torch.nn.functional.linear(H2, W2.to(dtype)).float()
    assert torch.equal(res.logits.float().argmax(1), stock.argmax(1))


def test_native_top1_leaves_rows_over_the_budget_and_open_argmaxes_to_the_torch_path(monkeypatch):
    _native_or_skip()
    g = torch.Generator().manual_seed(5)
    W = torch.randn(1, 64, generator=g) * 0.05 + torch.randn(4000, 64, generator=g) * 1e-4  # near-equal rows
    seen = _counting_top1(monkeypatch)
    ch = CertifiedHead(W, budget=3)
    for _ in range(10):
        h = torch.randn(1, 64, generator=g) * 3  # flat logits: S is larger than 3 tokens
        nat = ch.topk(h, 1, own_values=True)
        ref = ch.topk(h, 1)
        assert torch.equal(nat.logits, ref.logits) and torch.equal(nat.mask, ref.mask)
        assert nat.stats.fallback == ref.stats.fallback == 1
    assert seen["calls"] == seen["declined"] == 10
    # an exact tie whose values the slack cannot order: the torch path gives stock's row
    W2 = torch.zeros(100, 32)
    W2[3] = W2[50] = torch.linspace(-1, 1, 32)
    W2[60] = torch.linspace(-1, 1, 32) * (1 - 2 ** -22)
    h = torch.linspace(-1, 1, 32)[None] * 10
    nat = CertifiedHead(W2).topk(h, 1, own_values=True)
    assert int(nat.logits.argmax()) == int(torch.nn.functional.linear(h, W2).argmax()) == 3


def test_native_top1_serves_only_calls_that_may_take_hf_csvs_own_values(monkeypatch):
    """It runs for k = 1, own_values=True, values in the head's dtype (one row or several); never for the default
    call (values from stock's op), k > 1, a bias, a bf16 head returning float32 values, fp16, or a head built under
    HF_CSV_KERNELS=reference."""
    _native_or_skip()
    g = torch.Generator().manual_seed(6)
    W = torch.randn(2000, 64, generator=g) * 0.05
    h = torch.randn(3, 64, generator=g) * 3
    seen = _counting_top1(monkeypatch)
    ch = CertifiedHead(W)
    ch.topk(h[:1], 1)
    ch.topk(h[:1], 2, own_values=True)
    CertifiedHead(W, torch.randn(2000, generator=g)).topk(h[:1], 1, own_values=True)
    CertifiedHead(W.bfloat16()).topk(h[:1].bfloat16(), 1, own_values=True)
    CertifiedHead(W.half()).topk(h[:1].half(), 1, out_dtype=torch.float16, own_values=True)
    assert seen["calls"] == 0
    monkeypatch.setenv("HF_CSV_KERNELS", "reference")  # read when a head is built
    CertifiedHead(W).topk(h[:1], 1, own_values=True)
    assert seen["calls"] == 0
    monkeypatch.delenv("HF_CSV_KERNELS")
    ch.topk(h[:1], 1, own_values=True)
    ch.topk(h, 1, own_values=True)
    assert seen["calls"] == 2


def test_only_plans_that_prove_their_decisions_within_the_slack_ask_for_own_values(monkeypatch):
    """Plain greedy decoding asks the head for its own values; greedy after a lowering processor does not (its head call
    is a wider top-k: hf_csv.core.config.lowered_k), nor top-k sampling with stock's sampler or scores returned to the
    caller (they need stock's op on S)."""
    import hf_csv
    from conftest import tiny_llama

    m = hf_csv.enable(tiny_llama(scale=20.0))
    calls = []
    orig = CertifiedHead.topk

    def spy(self, H, k=1, **kw):
        calls.append(kw.get("own_values", False))
        return orig(self, H, k, **kw)

    monkeypatch.setattr(CertifiedHead, "topk", spy)
    ids = torch.tensor([[1, 5, 9, 13]])
    cfg = hf_csv.CSVConfig()
    for gen, want in ((dict(do_sample=False), True), (dict(do_sample=False, repetition_penalty=1.3), False),
                      (dict(do_sample=True, top_k=5), False),
                      (dict(do_sample=False, output_scores=True, return_dict_in_generate=True), False)):
        calls.clear()
        c = hf_csv.CSVConfig(scores="subvocab") if gen.get("output_scores") else cfg
        torch.manual_seed(0)
        m.generate(ids, max_new_tokens=4, csv_config=c, **gen)
        # (top-k sampling runs the full head instead of a top-k call where stock's values on S cannot be had)
        assert (bool(calls) and set(calls) == {True}) if want else True not in calls, (gen, calls)


def test_prepare_packs_now_and_keeps_the_later_work_in_the_background():
    """CertifiedHead.prepare (an engine's load step: hf_csv.vllm.layer.prebuild) calibrates and packs in the calling
    thread, so the first certified call finds the screen ready; the provider's background setting is left as it was
    (the columns' re-choice from the first real rows stays off the decode path), and results are the same."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(70000, 64, generator=g) * 0.05
    H = torch.randn(3, 64, generator=g) * 3
    a, b = CertifiedHead(W, background=True), CertifiedHead(W)
    a.prepare(torch.randn(1, 64, generator=g))
    assert a.provider.ready() and a.provider.background
    st = a.provider.state
    assert st.outliers.err_rest is not None  # the exact outlier columns (a large head defers them otherwise)
    if st.native is not None:  # the native kernel: the interleaved codes already in place
        assert st.native[1] and st.packed is None
    ra, rb = a.topk(H), b.topk(H)
    assert torch.equal(ra.logits.argmax(1), rb.logits.argmax(1))
    assert torch.equal(ra.logits.argmax(1), F.linear(H, W).argmax(1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cut_at_the_largest_finite_value(dtype):
    """A cap b at d's largest finite value: its successor in d is +inf, and a stock logit above d's overflow
    threshold rounds to +inf > b, so no finite threshold caps the uncomputed tokens: the row gets no cut (t = -inf,
    the full head). A cap below it keeps its cut."""
    from hf_csv.core.certificate.rounding import _cut, _cut_at

    top = torch.finfo(dtype).max
    t, b = _cut_at(torch.tensor([top, 1000.0], dtype=torch.float32), torch.tensor([1.0, 1.0]), dtype)
    assert t[0].item() == float("-inf") and b[0].item() == float("inf")
    assert math.isfinite(t[1].item()) and b[1].item() == 1000.0
    if dtype == torch.float16:  # a seed lower bound that overflows float16 (above 65,504): no cut either
        t, b = _cut(torch.tensor([70000.0, 1000.0]), torch.tensor([1.0, 1.0]), dtype)
        assert t[0].item() == float("-inf") and math.isfinite(t[1].item())


def test_float16_logits_that_overflow_give_stocks_greedy_tokens():
    """A float16 head whose largest logits reach and pass 65,504: stock's row holds +inf there and its argmax is the
    first +inf. The cut used to take 65,504 as a bound on every uncomputed token and certify an empty set (token 0
    in every step); now such rows take the full head, and rows below the overflow stay certified."""
    import hf_csv
    from hf_csv import CSVConfig
    from conftest import _ids, tiny_llama

    overflowed = certified = 0
    for scale in (2e4, 6e4, 1.2e5, 3e5):
        m = tiny_llama(vocab=2000, scale=scale).half()
        m = hf_csv.enable(m)
        x = _ids(batch=3, length=6, vocab=2000)
        with torch.no_grad():
            overflowed += int(torch.isinf(m(**x).logits[:, -1]).any(-1).sum())
        ref = m.generate(**x, max_new_tokens=4, do_sample=False)
        out = m.generate(**x, max_new_tokens=4, do_sample=False, csv_config=CSVConfig(stats=True),
                         return_dict_in_generate=True)
        assert torch.equal(ref, out.sequences), scale
        certified += out.csv_stats["certified"]
    assert overflowed > 0 and certified > 0, (overflowed, certified)  # (both kinds of row ran)


@pytest.mark.parametrize("budget", [0.05, 1])
def test_topk_sample_draws_only_inside_stock_topk(budget):
    """CertifiedHead.sample(top_k=K) draws from the top-K only, also when every row falls back (budget 1)."""
    torch.manual_seed(0)
    W = torch.randn(4000, 64) * 0.1  # a flat law: a draw over a superset of the top-20 leaves it often
    H = torch.randn(6, 64)
    head = CertifiedHead(W, budget=budget)
    topk = F.linear(H, W).topk(20, dim=1).indices
    for seed in range(30):
        r = head.sample(H, temperature=1.5, top_k=20, generator=torch.Generator().manual_seed(seed))
        assert (r.tokens[:, None] == topk).any(1).all()
    if budget == 1:
        assert r.stats.fallback == 6


def test_bf16_sampling_follows_the_bf16_law():
    """Logits near 200 (bf16 spacing 1.0) with offsets < 0.5 all round to 200: stock's law is uniform over
    them, the fp32-exact law is not (TV > 0.05). The certified draw must follow stock's."""
    V, d = 64, 8
    W = torch.zeros(V, d)
    W[:, 0] = -20.0
    W[:5, 0] = 200.0
    W[:5, 1] = torch.tensor([0.0, 0.125, 0.25, 0.375, 0.4375])  # exact in bf16
    Wb = W.bfloat16()
    hb = torch.zeros(1, d, dtype=torch.bfloat16)
    hb[0, 0], hb[0, 1] = 1.0, 1.0
    stock = torch.nn.functional.linear(hb, Wb).float()[0].double()
    exact = (hb.float() @ Wb.float().T)[0].double()
    p_stock, p_exact = torch.softmax(stock, 0).numpy(), torch.softmax(exact, 0).numpy()
    assert 0.5 * np.abs(p_stock - p_exact).sum() > 0.05
    head = CertifiedHead(Wb, budget=1.0)
    n = 20000
    r = head.sample(hb.repeat(n, 1), out_dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    draws = r.tokens.numpy()
    assert _chi2_p(draws, p_stock) > ALPHA
    assert _chi2_p(draws, p_exact) < ALPHA
def test_index_is_a_vocab_index_not_a_path(tmp_path):
    """The core never loads an artifact (the Hub layer does): CertifiedHead takes a VocabIndex or None, and a path
    raises a TypeError that names the loader."""
    W = torch.randn(50, 8)
    for bad in (str(tmp_path), tmp_path):
        with pytest.raises(TypeError, match=r"CSVArtifact\.from_pretrained\(path\)\.index"):
            CertifiedHead(W, provider="cluster", index=bad)
