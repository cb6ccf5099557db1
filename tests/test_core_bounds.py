"""Property tests: no bound provider ever under-estimates a logit."""
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_csv.core.bounds import ClusterProvider, ScreenProvider
from hf_csv.core.index import VocabIndex
from hf_csv_kernels import quantize_rows_fp8, quantize_rows_int8
from hf_csv_kernels.screen import Outliers, prepare_screen, screen_int8_cpu, screen_int8_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def heads(draw):
    """Random heads, including adversarial ones: near-duplicate rows (near-ties), huge rows,
    zero rows, massive-activation hidden states."""
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    V = draw(st.integers(2, 300))
    d = draw(st.sampled_from([1, 3, 16, 37, 64]))
    dtype = draw(st.sampled_from(DTYPES))
    scale = draw(st.sampled_from([1e-3, 0.05, 1.0, 30.0]))
    W = torch.randn(V, d, generator=g) * scale
    kind = draw(st.sampled_from(["plain", "near_ties", "zero_rows", "outlier_row"]))
    if kind == "near_ties":
        W = W[:1].repeat(V, 1) + torch.randn(V, d, generator=g) * scale * 1e-4
    elif kind == "zero_rows":
        W[:: 3] = 0
    elif kind == "outlier_row":
        W[0] *= 1000
    lim = torch.finfo(dtype).max / 2
    W = W.clamp(-lim, lim).to(dtype)
    bias = (torch.randn(V, generator=g) * scale).to(dtype) if draw(st.booleans()) else None
    N = draw(st.integers(1, 4))
    H = torch.randn(N, d, generator=g) * draw(st.sampled_from([0.1, 1.0, 20.0]))
    if draw(st.booleans()) and d > 1:
        H[:, draw(st.integers(0, d - 1))] *= 300  # a massive activation
    return W, bias, H


def exact64(W, bias, H):
    out = H.double() @ W.double().T
    return out + bias.double() if bias is not None else out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(heads(), st.sampled_from(["reference", "cpu"]), st.integers(0, 4))
def test_screen_upper_never_underestimates(head, backend, n_out):
    W, bias, H = head
    import os
    os.environ["HF_CSV_KERNELS"] = backend
    try:
        prov = ScreenProvider(W, bias, num_outliers=min(n_out, W.shape[1]))
        est, U = prov(H)
    finally:
        os.environ.pop("HF_CSV_KERNELS", None)
    ex = exact64(W, bias, H)
    assert (U.double() >= ex).all(), float((ex - U.double()).max())


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(heads())
def test_screen_kernels_two_sided(head):
    """Both screen backends: |<W_i,h> - est| <= rad (a two-sided bound, bias excluded)."""
    W, _, H = head
    rows = quantize_rows_int8(W)
    ex = H.double() @ W.double().T
    cols = torch.arange(min(3, W.shape[1]))
    for nat in (False, None):  # fbgemm, and hf_csv's native kernel where it is available
        for state in (prepare_screen(rows, torch.tensor([0]), native=nat), prepare_screen(rows, cols, weight=W, native=nat)):
            for fn in (screen_int8_reference, screen_int8_cpu):
                est, rad = fn(state, H)
                assert ((ex - est.double()).abs() <= rad.double()).all(), fn.__name__
                for r in range(H.shape[0]):  # one row: the native kernel on any head it serves
                    e1, r1 = fn(state, H[r:r + 1])
                    assert ((ex[r] - e1[0].double()).abs() <= r1[0].double()).all(), fn.__name__


@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_screen_bounds_two_sided(with_bias):
    """hf_csv's fused pass (est, upper, top): est − (upper − est) <= <W_i, h> + b_i <= upper on every token, for
    one row and several, with Ŵ's and with exact outlier columns, on the off-grid head whose massive activations
    meet the largest quantization error; top is the first largest est (torch's argmax); and the bound is the
    unfused one's (same formula), not a looser one."""
    from hf_csv_kernels import native
    from hf_csv_kernels.screen import screen_bounds_cpu
    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.why_unavailable()}")
    W, H, J = _off_grid_head(V=203, d=70)
    H = torch.cat([H, torch.randn(2, W.shape[1])])
    bias = torch.randn(W.shape[0]) if with_bias else None
    ex = exact64(W, bias, H)
    rows = quantize_rows_int8(W)
    for state in (prepare_screen(rows, J), prepare_screen(rows, J, weight=W)):
        for Hs, exs in [(H[r:r + 1], ex[r:r + 1]) for r in range(H.shape[0])] + [(H, ex)]:
            res = screen_bounds_cpu(state, Hs, bias)
            assert res is not None
            est, up, top = res
            rad = up.double() - est.double()
            assert (up.double() >= exs).all() and (est.double() - rad <= exs).all()
            assert torch.equal(top, est.argmax(1))
            e0, r0 = screen_int8_cpu(state, Hs)  # the unfused radius, before the provider's margins
            assert (rad <= r0.double() * 1.01 + 1e-3 * Hs.abs().amax(1, keepdim=True).double() * rows.l1.double()).all()
            assert float(rad.median()) > 0.5 * float(r0.median())  # and the same order: not a different bound


def test_fused_screen_bounds_ties_pick_the_first():
    from hf_csv_kernels import native
    from hf_csv_kernels.screen import screen_bounds_cpu
    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.why_unavailable()}")
    W = torch.randn(5000, 64)
    W[4321] = W[17]  # two identical rows: the same estimate, the first wins (argmax's rule), across chunks
    W[17] *= 1.0
    h = W[17:18] * 3
    state = prepare_screen(quantize_rows_int8(W), None)
    est, up, top = screen_bounds_cpu(state, h)
    assert int(top) == int(est.argmax(1)) == 17 and est[0, 17] == est[0, 4321]


def test_fused_screen_checks_a_bias_of_another_dtype_once():
    """A bf16 bias is copied to float32 every call; the once-per-bias input check is keyed by the caller's
    object, so the state's cache does not grow with the number of calls (it did when keyed by the copy)."""
    from hf_csv_kernels import native
    from hf_csv_kernels.screen import screen_bounds_cpu
    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.why_unavailable()}")
    g = torch.Generator().manual_seed(5)
    W = torch.randn(300, 32, generator=g)
    state = prepare_screen(quantize_rows_int8(W), None)
    bias = torch.randn(300, generator=g).bfloat16()
    h = torch.randn(1, 32, generator=g)
    est0 = screen_bounds_cpu(state, h, bias)[0]
    n = len(state._cache)
    for _ in range(5):
        est, up, top = screen_bounds_cpu(state, h, bias)
    assert len(state._cache) == n
    assert torch.equal(est, est0)
    real = h.double() @ W.double().T + bias.double()  # the bf16 bias is exact in float64
    rad = up.double() - est.double()
    assert bool((up.double() >= real).all()) and bool((est.double() - rad <= real).all())



def test_a_settled_screen_is_one_kernel_call_equal_to_the_fused_pass():
    """Once the provider's first-call work is over (packed, the columns re-chosen from the first rows), its
    ``steady`` state's ``call`` is what :func:`screen_bounds_cpu` computes, bit for bit, also after the outlier set or
    the codes' layout is swapped; the certified head then calls it alone; a bias or ``calibrate`` keep or send the
    provider back to :meth:`screen`."""
    from hf_csv.core.certificate import CertifiedHead
    from hf_csv_kernels import native
    from hf_csv_kernels.screen import make_outliers, screen_bounds_cpu
    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.why_unavailable()}")
    g = torch.Generator().manual_seed(9)
    W = torch.randn(3000, 48, generator=g) * 0.05
    H = torch.randn(12, 48, generator=g) * 3
    ch = CertifiedHead(W, num_outliers=4)
    prov = ch.provider
    for r in range(8):  # 8 rows choose the columns again (in this call's thread: no background build)
        assert prov.steady is None
        ch.topk(H[r:r + 1], own_values=True)
    st = prov.steady
    assert st is prov.state and st.call is not None
    for Hs in (H[10:11], H):
        assert all(torch.equal(a, b) for a, b in zip(st.call(Hs.contiguous()), screen_bounds_cpu(st, Hs)))
    calls = []
    monkey = st.call
    st.call = lambda h: calls.append(1) or monkey(h)
    res = ch.topk(H[11:12], own_values=True)
    assert calls == [1] and torch.equal(res.logits.argmax(1), (H[11:12] @ W.T).argmax(1))
    # a swapped outlier set, or one assigned directly: the call follows it
    st.swap_outliers(make_outliers(st.rows, torch.tensor([0, 5, 7, 9]), W))
    assert all(torch.equal(a, b) for a, b in zip(st.call(H), screen_bounds_cpu(st, H)))
    st.outliers = make_outliers(st.rows, torch.tensor([1, 2, 3, 4]), W)
    assert torch.equal(st.call.keywords["cols"], torch.tensor([1, 2, 3, 4]))
    assert all(torch.equal(a, b) for a, b in zip(st.call(H), screen_bounds_cpu(st, H)))
    lay = st.native
    st.native = None  # without the native codes there is no one-call screen: the provider's path serves
    assert st.call is None and ch.topk(H[11:12], own_values=True).stats.certified == 1
    st.native = lay
    prov.calibrate(H)
    assert prov.steady is None
    biased = CertifiedHead(W, torch.randn(3000, generator=g), num_outliers=4)
    for r in range(12):
        biased.topk(H[r:r + 1])
    assert biased.provider.steady is None

def _off_grid_head(V=64, d=48, k=4, seed=0):
    """Rows whose outlier-column weights sit halfway between int8 levels (the largest quantization error
    there), the other columns on the grid, and hidden states whose outlier columns are massive."""
    g = torch.Generator().manual_seed(seed)
    s = 0.01
    q = torch.randint(-127, 128, (V, d), generator=g).float()
    q[:, 0] = 127  # fixes the row scale at s
    W = q * s
    J = torch.arange(1, k + 1)
    W[:, J] = (torch.randint(-100, 100, (V, k), generator=g).float() + 0.5) * s
    H = torch.randn(3, d, generator=g)
    H[:, J] = 1e4 * torch.sign(torch.randn(3, k, generator=g))
    return W, H, J


def test_exact_outlier_columns_shrink_the_weight_term():
    """With the weight, the outlier columns are W[:, J] itself and the weight term drops to the rest of the
    columns: sound and far tighter where the massive activations meet quantization error. (If the columns
    were Ŵ[:, J] with the rest-only radius, the two-sided check below would fail: the J error times 1e4.)"""
    W, H, J = _off_grid_head()
    rows = quantize_rows_int8(W)
    ex = H.double() @ W.double().T
    old = prepare_screen(rows, J)
    new = prepare_screen(rows, J, weight=W)
    assert torch.equal(new.w_outlier, W[:, J])
    assert (new.err_rest.double() >= (W - rows.dequantize())[:, [j for j in range(W.shape[1]) if j not in J]]
            .double().norm(dim=1)).all()
    e_old, r_old = screen_int8_cpu(old, H)
    e_new, r_new = screen_int8_cpu(new, H)
    assert ((ex - e_old.double()).abs() <= r_old.double()).all()
    assert ((ex - e_new.double()).abs() <= r_new.double()).all()
    assert float(r_new.max()) < 0.05 * float(r_old.min())  # the outlier columns carry nearly all of the radius
    # the rest-only radius with Ŵ's outlier columns is unsound here: the test above can fail
    old.outliers = Outliers(old.outliers.cols, old.outliers.w, new.err_rest)
    e_bad, r_bad = screen_int8_cpu(old, H)
    assert not ((ex - e_bad.double()).abs() <= r_bad.double()).all()


def test_exact_outlier_columns_in_bf16():
    """A bf16 weight converts to fp32 exactly; the bound holds against the bf16 head's real logits."""
    W, H, J = _off_grid_head(seed=1)
    Wb = W.bfloat16()
    rows = quantize_rows_int8(Wb)
    st_ = prepare_screen(rows, J, weight=Wb)
    assert st_.w_outlier.dtype == torch.float32 and torch.equal(st_.w_outlier, Wb[:, J].float())
    est, rad = screen_int8_cpu(st_, H)
    ex = H.double() @ Wb.double().T
    assert ((ex - est.double()).abs() <= rad.double()).all()
    with pytest.raises(ValueError, match="does not fit"):
        prepare_screen(rows, J, weight=Wb[:, :-1])


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(heads(), st.integers(0, 4))
def test_fp8_screen_never_underestimates(head, n_out):
    """fp8 e4m3 rows: the same two-sided bound, and the provider's upper bound with bias."""
    W, bias, H = head
    rows = quantize_rows_fp8(W)
    assert rows.q.dtype == torch.float8_e4m3fn
    ex = H.double() @ W.double().T
    est, rad = screen_int8_reference(prepare_screen(rows, torch.tensor([0])), H)
    assert ((ex - est.double()).abs() <= rad.double()).all()
    prov = ScreenProvider(W, bias, num_outliers=min(n_out, W.shape[1]), quant="fp8")
    _, U = prov(H)
    assert (U.double() >= exact64(W, bias, H)).all()


def test_fp8_rows_error_terms_are_exact_upper_bounds():
    g = torch.Generator().manual_seed(3)
    W = torch.randn(200, 64, generator=g) * torch.logspace(-3, 1, 200)[:, None]
    rows = quantize_rows_fp8(W)
    deq = rows.q.double() * rows.scale.double()[:, None]
    assert (rows.err_l2.double() >= (W.double() - deq).norm(dim=1)).all()
    assert (rows.l1.double() >= deq.abs().sum(1)).all()
    assert (deq.abs().amax(1) <= W.double().abs().amax(1) * (1 + 2 ** -4)).all()  # scaled into range
    with pytest.raises(ValueError, match="quant"):
        ScreenProvider(W, quant="int4")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(heads(), st.sampled_from(["euclidean", "spherical"]))
def test_cluster_upper_never_underestimates(head, metric):
    W, bias, H = head
    V = W.shape[0]
    C = max(1, min(V, 7))
    index = VocabIndex.build(W, bias, num_clusters=C, metric=metric, niter=3, progress=False)
    U = ClusterProvider(index, W, bias)(H)[1]
    assert (U.double() >= exact64(W, bias, H)).all()


def test_quantize_error_terms_are_upper_bounds():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(500, 33, generator=g)
    r = quantize_rows_int8(W)
    deq = r.q.double() * r.scale.double()[:, None]
    assert (r.err_l2.double() >= (W.double() - deq).norm(dim=1)).all()
    assert (r.l1.double() >= deq.abs().sum(1)).all()
    assert (r.abs_l1.double() >= W.double().abs().sum(1)).all()
    assert r.q.abs().max() <= 127


def test_screen_rejects_bad_weight():
    with pytest.raises(ValueError):
        ScreenProvider(torch.randn(3, 4, 5))
    with pytest.raises(ValueError, match="non-finite"):
        ScreenProvider(torch.tensor([[float("nan"), 1.0]]))


def test_first_call_columns_are_rechosen_from_more_rows():
    """Columns chosen from a single first row are re-chosen once from the first 8 rows (no repack), the
    swap is one object, and the bound stays sound before and after. A given choice is never changed."""
    g = torch.Generator().manual_seed(5)
    V, d = 200, 32
    W = torch.randn(V, d, generator=g)
    prov = ScreenProvider(W, num_outliers=2)
    h0 = torch.randn(1, d, generator=g)
    h0[0, 3] = 500.0  # the first row's outlier is not where the later rows' are
    _, U0 = prov(h0)
    assert prov.state.outlier_cols.tolist() == sorted(h0.abs().amax(0).topk(2).indices.tolist())
    packed, first = prov.state.packed, prov.state.outliers
    later = torch.randn(7, d, generator=g)
    later[:, 10] = 800.0
    later[:, 20] = -900.0
    for r in range(7):
        _, U = prov(later[r: r + 1])
        assert (U.double() >= exact64(W, None, later[r: r + 1])).all()
    assert prov.recalibrated and prov.state.outlier_cols.tolist() == [10, 20]
    assert prov.state.packed is packed and prov.state.outliers is not first
    assert torch.equal(prov.state.w_outlier, W[:, [10, 20]])
    _, U1 = prov(h0)
    assert (U1.double() >= exact64(W, None, h0)).all()
    fixed = ScreenProvider(W, num_outliers=2, outlier_cols=torch.tensor([0, 1]))
    start = ScreenProvider(W, num_outliers=2, outlier_cols=torch.tensor([0, 1]), recalibrate=True)  # an artifact's
    for r in range(8):
        fixed(later[r % 7: r % 7 + 1])
        start(later[r % 7: r % 7 + 1])
    assert fixed.state.outlier_cols.tolist() == [0, 1] and not fixed.recalibrated
    assert start.state.outlier_cols.tolist() == [10, 20] and start.recalibrated
    # a head built for generate (background=True) re-chooses off the decode path; calls meanwhile stay sound
    bg = ScreenProvider(W, num_outliers=2, background=True)
    bg(h0)
    while not bg.ready():
        pass
    first = bg.state.outliers
    for r in range(7):
        _, U = bg(later[r: r + 1])
        assert (U.double() >= exact64(W, None, later[r: r + 1])).all()
    assert bg._recal is not None
    bg._recal.join()
    assert bg.recalibrated and bg.state.outlier_cols.tolist() == [10, 20] and bg.state.outliers is not first
    _, U = bg(later[:1])
    assert (U.double() >= exact64(W, None, later[:1])).all()


def test_rows_count_once_when_the_head_warms_first():
    """CertifiedHead checks ``ready`` (which warms the screen) before each call: a step's row counts once."""
    from hf_csv.core.certificate import CertifiedHead

    g = torch.Generator().manual_seed(6)
    W = torch.randn(300, 32, generator=g)
    ch = CertifiedHead(W)
    for step in range(8):
        h = torch.randn(1, 32, generator=g)
        assert ch.ready(h)
        ch.topk(h, k=1)
        if step < 7:
            assert ch.provider._seen is not None and ch.provider._seen_rows == step + 1
    assert ch.provider._seen is None  # re-chosen after exactly 8 rows
