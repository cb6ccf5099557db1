"""Property tests: no bound provider ever under-estimates a logit."""
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_csv.bounds import ClusterProvider, ScreenProvider
from hf_csv.index import VocabIndex
from hf_csv_kernels import quantize_rows_fp8, quantize_rows_int8
from hf_csv_kernels.screen import prepare_screen, screen_int8_cpu, screen_int8_reference

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


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(heads())
def test_screen_kernels_two_sided(head):
    """Both screen backends: |<W_i,h> - est| <= rad (a two-sided bound, bias excluded)."""
    W, _, H = head
    rows = quantize_rows_int8(W)
    state = prepare_screen(rows, torch.tensor([0]))
    ex = H.double() @ W.double().T
    for fn in (screen_int8_reference, screen_int8_cpu):
        est, rad = fn(state, H)
        assert ((ex - est.double()).abs() <= rad.double()).all(), fn.__name__


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
