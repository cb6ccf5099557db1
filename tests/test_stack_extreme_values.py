"""Hidden states and logits at the ends of the float range (subnormal, zero, huge or non-finite hidden states; a
subnormal final norm; logits so large that fl(y + G) = y): stock's row where a certificate cannot hold, and draws
that keep the law where it can (the Gumbel noise is shifted so that it does not vanish). CI runs this file again
under MKL's other code paths (.ci/run)."""
from __future__ import annotations

import pytest
import torch

import hf_csv
from conftest import tiny_llama
from hf_csv import CSVConfig


@pytest.mark.parametrize("scale", [1e-43, 1e-38, 1e-30, 0.0, 1e30])
def test_tiny_and_huge_hidden_states_are_stock_or_declined(scale):
    """Rows with ||h||_∞ outside [2⁻⁶⁴, 2⁶⁴] (subnormal, zero, huge) get stock's full row; with |h| ≈ 1e-43 the screen's
    step underflowed and 22 of 30 "certified" top-1 rows were wrong."""
    from hf_csv import CertifiedHead
    from hf_csv.core.certificate import H_MAX, H_MIN
    import torch.nn.functional as F

    torch.manual_seed(0)
    W = torch.randn(4099, 64)
    H = torch.randn(30, 64) * scale
    head = CertifiedHead(W)
    res = head.topk(H, k=1)
    stock = F.linear(H, W)
    inside = (H.abs().amax(1) >= H_MIN) & (H.abs().amax(1) <= H_MAX)
    assert torch.equal(res.logits.argmax(1), stock.argmax(1))
    assert res.stats.out_of_range == int((~inside).sum())
    assert res.stats.certified == int(inside.sum())
    full = res.mask.all(1)
    assert torch.equal(res.logits[full], stock[full])


@pytest.mark.parametrize("kind", ["topk", "sample"])
def test_a_call_with_an_out_of_range_row_is_stocks_full_call_on_every_row(kind):
    """A batch with one non-finite row: its in-range rows are stock's rows of the same full call, not a certified
    call on fewer rows (whose GEMM of another row count may round a fallback's row or the values handed to stock's
    code otherwise), every row counted."""
    from hf_csv import CertifiedHead
    import torch.nn.functional as F

    torch.manual_seed(1)
    W = torch.randn(3001, 32)
    H = torch.randn(3, 32)
    H[1, 0] = float("inf")
    head = CertifiedHead(W)
    res = head.topk(H, k=2) if kind == "topk" else head.sample(H, temperature=0.8)
    stock = F.linear(H, W)
    ok = torch.tensor([0, 2])
    assert torch.equal(res.logits[ok], stock[ok])
    assert res.stats.rows == 3 and res.stats.certified == 0 and res.stats.fallback == 3
    assert res.stats.nonfinite == 1 and res.stats.beside_bad == 2
    if kind == "sample":
        assert bool((res.tokens == -1).all())  # full rows: the caller draws from them


def test_subnormal_final_norm_generates_stock_tokens():
    """A tiny Llama whose final norm weight is 1e-44 generated [490, 140, 0, 0] against stock's, all "certified"."""
    import copy

    ref = tiny_llama(vocab=512, scale=20.0)
    with torch.no_grad():
        ref.model.norm.weight.fill_(1e-44)
    m = hf_csv.enable(copy.deepcopy(ref))
    ids = torch.randint(3, 512, (1, 6), generator=torch.Generator().manual_seed(0))
    out = m.generate(ids, max_new_tokens=4, do_sample=False, csv_config=CSVConfig())
    assert torch.equal(out, ref.generate(ids, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("warps", [[("temperature", 1.7)], [("top_k", 5)], [("temperature", 0.6), ("top_k", 40)]])
@pytest.mark.parametrize("scale", [1.0, 1e6, 1e13])
def test_gumbel_draws_with_huge_logits_follow_the_law(warps, scale):
    """Two exactly tied top tokens must each be drawn about half the time, whatever the logits' magnitude: fl(y + G)
    = y once |y| >= 2^24, so a draw without a shift returned the first of them every time (the fuzzer's cases 1224
    and 2576, hidden states scaled by 1e15). Binomial test at alpha = 1e-3 (fixed seed)."""
    from scipy import stats as sps

    torch.manual_seed(0)
    V, d = 512, 32
    W = torch.randn(V, d)
    W[300] = W[7]  # an exact twin of token 7
    h = torch.randn(1, d)
    W[7] = W[300] = h[0] / h[0].norm() * 10.0  # the twins lead the row by a wide margin
    head = hf_csv.CertifiedHead(W)
    N = 2000
    res = head.sample((h * scale).repeat(N, 1), warps=warps, generator=torch.Generator().manual_seed(1))
    toks = res.tokens
    assert bool(((toks == 7) | (toks == 300)).all())
    n7 = int((toks == 7).sum())
    assert sps.binomtest(n7, N, 0.5).pvalue > 1e-3, (n7, res.stats.as_dict())


def test_sampling_after_a_lowering_processor_with_huge_logits_follows_the_law():
    """The draw after the processors (repetition penalty, no top-k) shifts by the head's m too."""
    from scipy import stats as sps

    m = tiny_llama(scale=1.0)
    head = m.lm_head.weight
    with torch.no_grad():
        head[200] = head[17]
        m.model.norm.weight.fill_(1e9)
    m = hf_csv.enable(m)
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        top2 = m(ids).logits[0, -1].topk(2)
    kw = dict(do_sample=True, top_k=0, temperature=1.3, repetition_penalty=1.3, max_new_tokens=1)
    torch.manual_seed(0)
    out = m.generate(ids.repeat(1500, 1), **kw, csv_config=CSVConfig())[:, -1]
    if set(top2.indices.tolist()) == {17, 200}:  # the twins lead: each half the time
        n = int((out == 17).sum())
        assert int(((out == 17) | (out == 200)).sum()) == len(out)
        assert sps.binomtest(n, len(out), 0.5).pvalue > 1e-3, n
    else:  # one token leads by a huge margin: it is the only draw
        assert bool((out == top2.indices[0]).all())
