"""Tests of the fast verify step (hf_csv_kernels.verify) and its transformers patch (hf_csv.verify).

Statistical tests: fixed seeds, chi-square at significance level ALPHA = 0.001, bins with an
expected count < 5 merged into one. Each test compares the empirical law of the emitted tokens
with the analytic law of speculative sampling (which is the target's) and, where stated, with the
stock ``transformers`` function run on the same inputs. ``test_chi_square_has_power`` checks the
same machinery does reject a lossy verify.
"""
from __future__ import annotations

import math
import threading
import warnings
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import inspect

from scipy import stats

import hf_csv_kernels.verify as kv
from hf_csv.errors import UnsupportedVersionError
from hf_csv.verify import (
    LossyVerifyWarning,
    patch_speculative_sampling,
    speculative_sampling_exact,
)

transformers = pytest.importorskip("transformers")
from transformers.generation import utils as gen_utils  # noqa: E402

STOCK = gen_utils._speculative_sampling
_EXTRA = tuple(inspect.signature(STOCK).parameters)[4]  # 5.x: assistant_ensemble_weight; 4.57: is_done_candidate


_X = (False,) if _EXTRA == "is_done_candidate" else ()  # the fifth argument stock's caller passes


def stock(*args, **kw):
    """Stock ``_speculative_sampling`` (4.57: is_done_candidate=False; its ensemble weight does not exist)."""
    if _EXTRA == "is_done_candidate":
        if kw.pop("assistant_ensemble_weight", None) is not None:
            pytest.skip("transformers 4.57 has no assistant_ensemble_weight")
        kw.setdefault("is_done_candidate", False)
    return STOCK(*args, **kw)
ALPHA = 0.001  # significance level of every statistical test in this file


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add wake-up latency on a loaded 2-core machine (stock's
    softmax took ~0.4 ms per call with 2 threads), so run this module single-threaded."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_case(V: int, L: int, seed: int, sub: int | None = None, noise: float = 1.0):
    """Target logits [L+1, V], draft logits [L, V] (-inf outside a random sub-vocabulary of size
    ``sub`` if given) and a generator."""
    g = torch.Generator().manual_seed(seed)
    zp = torch.randn(L + 1, V, generator=g) * 1.5
    zq = zp[:L] + noise * torch.randn(L, V, generator=g)
    if sub is not None:
        for j in range(L):
            keep = torch.randperm(V, generator=g)[:sub]
            mask = torch.full((V,), float("-inf"))
            mask[keep] = 0.0
            zq[j] = zq[j] + mask
    return zp, zq, g


def draw_drafts(zq: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
    """n independent draft sequences [n, L], x_j ~ softmax(zq[j])."""
    q = torch.softmax(zq, -1)
    return torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(zq.shape[0])], 1)


def seq_law(zp: torch.Tensor, zq: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Analytic law of the emitted sequence of one verify with drafts x_j ~ q_j:
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


def gof_pvalue(counts: Counter, law: dict, n: int) -> float:
    """Chi-square goodness of fit; bins with expected < 5 merged; outcomes outside the law's support
    make the p-value 0 (an impossible outcome is a failure, not noise)."""
    if any(k not in law for k in counts):
        return 0.0
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for k, pr in law.items():
        if pr * n >= 5:
            obs.append(counts.get(k, 0))
            exp.append(pr * n)
        else:
            rest_o += counts.get(k, 0)
            rest_e += pr * n
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    exp = [e * n / sum(exp) for e in exp]  # renormalize float round-off
    return float(stats.chisquare(obs, exp).pvalue)


def two_sample_pvalue(a: Counter, b: Counter) -> float:
    """Chi-square test of homogeneity of two categorical samples (bins with < 10 total merged)."""
    keys = sorted(set(a) | set(b))
    big = [k for k in keys if a.get(k, 0) + b.get(k, 0) >= 10]
    small = [k for k in keys if k not in big]
    rows = [[a.get(k, 0) for k in big], [b.get(k, 0) for k in big]]
    if small:
        rows[0].append(sum(a.get(k, 0) for k in small))
        rows[1].append(sum(b.get(k, 0) for k in small))
    return float(stats.chi2_contingency(rows).pvalue)


def run_ours(zp, zq, drafts, g, fn=kv.exact_verify, **kw) -> list[tuple[int, ...]]:
    return [tuple(fn(d, zq, zp, generator=g, **kw).tokens.tolist()) for d in drafts]


def run_stock(zp, zq, drafts, seed, **kw) -> list[tuple[int, ...]]:
    torch.manual_seed(seed)  # stock draws from the global RNG
    L = zq.shape[0]
    prefix = torch.zeros(1, 3, dtype=torch.long)
    out = []
    for d in drafts:
        cand = torch.cat([prefix, d[None]], 1)
        valid, _ = stock(cand, zq[None], L, zp[None], **kw)
        out.append(tuple(valid[0].tolist()))
    return out


# ----------------------------------------------------------------------------- exactness


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


@pytest.mark.parametrize("lazy", [True, False])
def test_exact_full_sequence_law(lazy):
    """Whole emitted sequences (accepted drafts + final token), V=8, L=2, vs the analytic law, for
    the lazy (CPU default) and the batched (GPU default) paths."""
    N = 10000
    zp, zq, g = make_case(8, 2, seed=7, sub=6)
    drafts = draw_drafts(zq, N, g)
    c = Counter(run_ours(zp, zq, drafts, g, lazy=lazy))
    assert gof_pvalue(c, seq_law(zp, zq), N) > ALPHA


def test_ensemble_weight_matches_stock():
    """With stock's DIVERSE ensemble weight (lossy in both), ours follows stock's law."""
    N = 4000
    zp, zq, g = make_case(10, 2, seed=3)
    drafts = draw_drafts(zq, N, g)
    ours = Counter((len(s) - 1, s[-1]) for s in run_ours(zp, zq, drafts, g, ensemble_weight=0.6))
    stock = Counter((len(s) - 1, s[-1]) for s in run_stock(zp, zq, drafts, 3, assistant_ensemble_weight=0.6))
    assert two_sample_pvalue(ours, stock) > ALPHA


def test_is_done_candidate_keeps_the_drafts_without_a_bonus(monkeypatch):
    """transformers 4.57's contract: when every draft is accepted and the last one ends the sequence,
    return the L drafts and n = L - 1 (no bonus token). Exercised on every version through the dispatch."""
    import hf_csv.verify as hv

    zp, zq, g = make_case(32, 3, seed=30)
    zp = torch.cat([zq, zp[-1:]])  # p == q on the drafted positions: every draft is accepted
    d = draw_drafts(zq, 1, g)[0]
    cand = torch.cat([torch.zeros(2, dtype=torch.long), d])[None]
    with patch_speculative_sampling():
        monkeypatch.setitem(hv._installed, "extra", "is_done_candidate")
        v, n = gen_utils._speculative_sampling(cand, zq[None], 3, zp[None], True)
        assert v[0].tolist() == d.tolist() and int(n) == 2
        v, n = gen_utils._speculative_sampling(cand, zq[None], 3, zp[None], False)
        assert v.shape[1] == 4 and v[0, :3].tolist() == d.tolist() and int(n) == 3
        monkeypatch.setitem(hv._installed, "extra", "assistant_ensemble_weight")


@pytest.mark.skipif(_EXTRA != "is_done_candidate", reason="transformers 4.57 only")
def test_is_done_candidate_law_matches_stock_457():
    """4.57, is_done_candidate=True: the patched verify's law equals stock's (alpha = ALPHA)."""
    zp, zq, g = make_case(12, 2, seed=31)
    drafts = draw_drafts(zq, 6000, g)
    with patch_speculative_sampling():
        ours = Counter(tuple(gen_utils._speculative_sampling(torch.cat([torch.zeros(1, 3, dtype=torch.long), d[None]], 1),
                                                             zq[None], 2, zp[None], True)[0][0].tolist())
                       for d in drafts)
    theirs = Counter(run_stock(zp, zq, drafts, 5, is_done_candidate=True))
    assert two_sample_pvalue(ours, theirs) > ALPHA


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
    c = Counter(int(kv._race(w.clone(), g)[0]) for _ in range(N))
    law = {int(i): float(w[i] / w.sum()) for i in support}
    assert gof_pvalue(c, law, N) > ALPHA


def test_chi_square_has_power():
    """Sanity of the statistical machinery: the lossy sigmoid verify is rejected against the target's law."""
    N = 4000
    zp, zq, g = make_case(12, 2, seed=5, noise=1.5)
    drafts = draw_drafts(zq, N, g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LossyVerifyWarning)
        c = Counter((len(s) - 1, s[-1]) for s in run_ours(zp, zq, drafts, g, fn=kv.sigmoid_verify))
    assert gof_pvalue(c, n_t_law(zp, zq), N) < ALPHA


# ----------------------------------------------------------------------------- edge cases


def test_all_accepted_when_draft_equals_target():
    zp, _, g = make_case(50, 4, seed=11)
    zq = zp[:4].clone()
    for _ in range(200):
        d = draw_drafts(zq, 1, g)[0]
        r = kv.exact_verify(d, zq, zp, generator=g)
        assert r.n_accepted == 4 and r.tokens[:4].tolist() == d.tolist() and 0 <= r.tokens[4] < 50


def test_none_accepted_when_target_forbids_drafts():
    zp, zq, g = make_case(40, 3, seed=12)
    for _ in range(200):
        d = draw_drafts(zq, 1, g)[0]
        zp2 = zp.clone()
        zp2[0, d[0]] = float("-inf")  # p(x_1) = 0: must be rejected, never accepted
        banned = torch.isneginf(zp2[0])
        r = kv.exact_verify(d, zq, zp2, generator=g)
        assert r.n_accepted == 0 and r.tokens.shape == (1,)
        assert not banned[r.tokens[0]]  # the residual never emits a p = 0 token


def test_subvocab_draft_no_nan_and_valid():
    """Draft logits -inf outside a sub-vocabulary (q = 0 there): no NaN, valid tokens, and the
    residual can emit tokens outside the sub-vocabulary."""
    V, L = 300, 3
    zp, zq, g = make_case(V, L, seed=13, sub=20, noise=2.0)
    outside = set()
    for _ in range(300):
        d = draw_drafts(zq, 1, g)[0]
        for lazy in (True, False):
            r = kv.exact_verify(d, zq, zp, generator=g, lazy=lazy)
            assert r.tokens.dtype == torch.long and 0 <= r.n_accepted <= L
            assert r.tokens.shape == (r.n_accepted + 1,)
            assert ((r.tokens >= 0) & (r.tokens < V)).all()
            if r.n_accepted < L and torch.isneginf(zq[r.n_accepted, r.tokens[-1]]):
                outside.add(int(r.tokens[-1]))
    assert outside  # tokens the draft cannot propose still get their target mass


def test_zero_draft_probability_is_a_caller_bug():
    zp, zq, _ = make_case(20, 2, seed=14, sub=5)
    bad = torch.tensor([int(torch.isneginf(zq[0]).nonzero()[0]), 0])
    with pytest.raises(kv.DraftProbabilityError):
        kv.exact_verify(bad, zq, zp)
    with pytest.raises(ValueError):  # DraftProbabilityError is a ValueError
        speculative_sampling_exact(torch.cat([torch.zeros(2, dtype=torch.long), bad])[None], zq[None], 2, zp[None])


def test_all_inf_row_raises_not_nan():
    zp, zq, _ = make_case(20, 1, seed=15)
    zp[0] = float("-inf")
    with pytest.raises(kv.DraftProbabilityError):
        kv.exact_verify(torch.tensor([3]), zq, zp)


def test_vanished_residual_falls_back_to_target(monkeypatch):
    """If the residual max(0, p - q) is numerically all zero at a rejected row (p == q to float
    precision), the token is drawn from p -- never NaN, never a p = 0 token."""
    w = torch.zeros(3000)
    assert kv._race(w, None)[1] is False  # all-zero weights are reported, not silently index 0
    real = kv._race
    state = {"first": True}

    def fake(weights, generator):
        if state["first"]:
            state["first"] = False
            return torch.tensor(0), False
        return real(weights, generator)

    monkeypatch.setattr(kv, "_race", fake)
    zp, zq, g = make_case(30, 1, seed=16)
    d = draw_drafts(zq, 1, g)[0]
    zp[0, d[0]] = float("-inf")  # forces the rejection
    zp[0, 0] = float("-inf")  # the fake's index: must not leak out
    for _ in range(50):
        state["first"] = True
        r = kv.exact_verify(d, zq, zp, generator=g)
        assert r.n_accepted == 0 and not torch.isneginf(zp[0, r.tokens[0]])


@pytest.mark.parametrize("L", [1, 2, 5])
def test_stock_signature_shapes_and_dtypes(L):
    zp, zq, g = make_case(64, L, seed=17)
    d = draw_drafts(zq, 1, g)[0]
    cand = torch.cat([torch.zeros(4, dtype=torch.long), d])[None]
    v1, n1 = stock(cand, zq[None], L, zp[None])
    v2, n2 = speculative_sampling_exact(cand, zq[None], L, zp[None])
    assert v2.dtype == v1.dtype and v2.dim() == v1.dim() == 2 and v2.shape[0] == 1
    assert n2.dtype == n1.dtype and n2.dim() == n1.dim() == 0
    assert v2.shape[1] == int(n2) + 1 and v2[0, : int(n2)].tolist() == d[: int(n2)].tolist()
    with pytest.raises(ValueError):
        speculative_sampling_exact(cand.repeat(2, 1), zq[None].repeat(2, 1, 1), L, zp[None].repeat(2, 1, 1))


def test_draft_length_zero_is_bonus_only():
    zp, _, g = make_case(10, 0, seed=18)
    r = kv.exact_verify(torch.zeros(0, dtype=torch.long), torch.zeros(0, 10), zp, generator=g)
    assert r.n_accepted == 0 and r.tokens.shape == (1,)


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
    r = kv.exact_verify(d, zq, zp, generator=g)
    assert r.tokens.shape == (r.n_accepted + 1,)
    assert not torch.isneginf(zp[r.n_accepted, r.tokens[-1]])
    assert all(not torch.isneginf(zp[j, d[j]]) for j in range(r.n_accepted))


# ----------------------------------------------------------------------------- sigmoid


def test_sigmoid_kernel_warns_once_and_matches_its_analytic_law():
    kv._reset_sigmoid_warning()
    zp, zq, g = make_case(12, 1, seed=19, noise=1.5)
    with pytest.warns(LossyVerifyWarning):
        kv.sigmoid_verify(torch.tensor([0]), zq, zp, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LossyVerifyWarning)
        kv.sigmoid_verify(torch.tensor([0]), zq, zp, generator=g)  # second call: silent
    N = 6000
    drafts = draw_drafts(zq, N, g)
    first = Counter(s[0] for s in run_ours(zp, zq, drafts, g, fn=kv.sigmoid_verify))
    law, p_acc = kv.sigmoid_first_token_distribution(zq[0], zp[0])
    assert gof_pvalue(first, {t: float(law[t]) for t in range(12)}, N) > ALPHA
    assert p_acc > 0.99  # saturation: nearly everything accepted
    tv = 0.5 * float((law - torch.softmax(zp[0].double(), -1)).abs().sum())
    assert tv > 0.05  # lossy, measurably


def test_sigmoid_patch_warns_on_entry():
    with pytest.warns(LossyVerifyWarning):
        with patch_speculative_sampling("sigmoid") as h:
            assert h.mode == "sigmoid"
    assert gen_utils._speculative_sampling is STOCK


# ----------------------------------------------------------------------------- patch mechanics


def test_patch_restores_on_exit_and_exception_and_nests():
    assert gen_utils._speculative_sampling is STOCK
    with patch_speculative_sampling() as outer:
        patched = gen_utils._speculative_sampling
        assert patched is not STOCK
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LossyVerifyWarning)
            with patch_speculative_sampling("sigmoid") as inner:
                assert gen_utils._speculative_sampling is patched
        assert inner.mode == "sigmoid"
        assert gen_utils._speculative_sampling is patched  # outer scope still active
    assert outer.mode == "exact"
    assert gen_utils._speculative_sampling is STOCK
    with pytest.raises(RuntimeError, match="boom"):
        with patch_speculative_sampling():
            raise RuntimeError("boom")
    assert gen_utils._speculative_sampling is STOCK


def test_patch_is_thread_local():
    zp, zq, g = make_case(16, 2, seed=20)
    d = draw_drafts(zq, 1, g)[0]
    cand = torch.cat([torch.zeros(1, dtype=torch.long), d])[None]
    entered, release = threading.Event(), threading.Event()
    other: dict = {}

    def worker():
        with patch_speculative_sampling() as h:
            entered.set()
            release.wait(10)
            gen_utils._speculative_sampling(cand, zq[None], 2, zp[None], *_X)
            other["calls"] = h.calls

    t = threading.Thread(target=worker)
    t.start()
    assert entered.wait(10)
    assert gen_utils._speculative_sampling is not STOCK
    with patch_speculative_sampling() as mine:
        gen_utils._speculative_sampling(cand, zq[None], 2, zp[None], *_X)
    assert gen_utils._speculative_sampling is not STOCK  # the worker's scope keeps it installed
    gen_utils._speculative_sampling(cand, zq[None], 2, zp[None], *_X)  # this thread: no scope -> stock
    release.set()
    t.join(10)
    assert mine.calls == 1 and other["calls"] == 1
    assert gen_utils._speculative_sampling is STOCK


def test_unknown_transformers_version_fails_clearly(monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "9.99.0")
    with pytest.raises(UnsupportedVersionError, match="9.99.0"):
        with patch_speculative_sampling():
            pass
    assert gen_utils._speculative_sampling is STOCK


def test_bad_mode():
    with pytest.raises(ValueError):
        patch_speculative_sampling("fast")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- end to end


def _tiny_llamas():
    from transformers import LlamaConfig, LlamaForCausalLM

    common = dict(vocab_size=96, max_position_embeddings=256, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, **common)).eval()
    assistant = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, **common)).eval()
    # make the draft resemble the target a little so that drafts get accepted sometimes
    with torch.no_grad():
        assistant.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight[:, :32])
    return target, assistant


def test_end_to_end_assisted_generate():
    target, assistant = _tiny_llamas()
    ids = torch.tensor([[1, 5, 9, 22, 40]])
    with patch_speculative_sampling() as h:
        torch.manual_seed(1)
        out = target.generate(ids, assistant_model=assistant, do_sample=True, max_new_tokens=24,
                              min_new_tokens=24)
    assert h.calls > 0 and h.drafted > 0
    assert out.shape == (1, ids.shape[1] + 24)
    assert out[0, : ids.shape[1]].tolist() == ids[0].tolist()
    assert ((out >= 0) & (out < 96)).all()
    assert gen_utils._speculative_sampling is STOCK
    # greedy assisted output equals plain greedy (inside the patch too)
    plain = target.generate(ids, do_sample=False, max_new_tokens=20, min_new_tokens=20)
    with patch_speculative_sampling():
        assisted = target.generate(ids, assistant_model=assistant, do_sample=False, max_new_tokens=20,
                                   min_new_tokens=20)
    assert torch.equal(plain, assisted)
