"""Every Triton kernel against its torch reference (TRITON_INTERPRET=1 on CPU; natively on CUDA).

Odd sizes that are not multiples of the block sizes, bf16/fp16/fp32 weights, and the vocabulary sizes
that broke the seed repository's kernels (V = 32000, 51864, 151936, 262144; tiny d to keep the
interpreter fast).
"""
import math

import pytest
import torch

triton = pytest.importorskip("triton")

from hf_csv_kernels import quantize_rows_int8
from hf_csv_kernels.cluster import cluster_upper_reference, segmented_gemv_reference
from hf_csv_kernels.gather import gather_gemv_reference
from hf_csv_kernels.residual import residual_race_reference, row_logsumexp_reference
from hf_csv_kernels.screen import prepare_screen, screen_int8_reference

import hf_csv_kernels.triton_ops as T

DEV = "cuda" if torch.cuda.is_available() else "cpu"
G = torch.Generator().manual_seed(0)


def rnd(*shape, scale=1.0):
    return (torch.randn(*shape, generator=G) * scale).to(DEV)


@pytest.mark.slow
@pytest.mark.parametrize("V,d,N", [(1000, 37, 2), (129, 64, 1), (32000, 8, 1), (51864, 4, 1), (151936, 4, 1),
                                   (262144, 4, 1)])
def test_screen_matches_reference_and_is_sound(V, d, N):
    W = rnd(V, d, scale=0.05)
    H = rnd(N, d, scale=3.0)
    state = prepare_screen(quantize_rows_int8(W), pack_cpu=False)
    est, rad, bmax = T.screen_int8_with_block_max(state, H)
    e_ref, r_ref = screen_int8_reference(state, H)
    assert torch.allclose(est, e_ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(rad, r_ref, rtol=1e-6, atol=0)
    exact = H.double() @ W.double().T
    assert ((exact - est.double()).abs() <= rad.double()).all()
    low = est - rad
    nblk = math.ceil(V / T.SCREEN_BLOCK_V)
    pad = torch.full((N, nblk * T.SCREEN_BLOCK_V - V), float("-inf"), device=DEV)
    assert torch.equal(bmax, torch.cat([low, pad], 1).view(N, nblk, -1).amax(2))


@pytest.mark.slow
def test_screen_fp8_decodes_every_e4m3_code_exactly():
    """All 254 finite e4m3fn codes (normal, subnormal, ±0) through the in-kernel decoder."""
    from hf_csv_kernels.quantize import Int8Rows

    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    q = codes.view(torch.float8_e4m3fn)[None].to(DEV)  # one row, d = 254
    one = torch.ones(1, device=DEV)
    rows = Int8Rows(q=q, scale=one, err_l2=one * 0, l1=one, abs_l1=one)
    state = prepare_screen(rows, pack_cpu=False)
    H = torch.eye(254, device=DEV)
    est, _ = T.screen_int8(state, H)
    assert torch.equal(est[:, 0], q[0].float())


@pytest.mark.slow
@pytest.mark.parametrize("V,d,N", [(1000, 37, 2), (32000, 8, 1), (151936, 4, 1)])
def test_screen_fp8_matches_reference_and_is_sound(V, d, N):
    """fp8 e4m3 rows through the same Triton screen kernel (GPU: sm89+; here the interpreter)."""
    from hf_csv_kernels import quantize_rows_fp8
    W = rnd(V, d, scale=0.05)
    H = rnd(N, d, scale=3.0)
    state = prepare_screen(quantize_rows_fp8(W), pack_cpu=False)
    est, rad = T.screen_int8(state, H)
    e_ref, r_ref = screen_int8_reference(state, H)
    assert torch.allclose(est, e_ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(rad, r_ref, rtol=1e-6, atol=0)
    exact = H.double() @ W.double().T
    assert ((exact - est.double()).abs() <= rad.double()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V,d,M", [(1000, 37, 77), (51864, 8, 33), (262144, 4, 65)])
def test_gather_gemv(dtype, V, d, M):
    W = rnd(V, d).to(dtype)
    H = rnd(3, d)
    tok = torch.randint(0, V, (M,), generator=G).to(DEV)
    tok[0] = V - 1
    b = torch.randint(0, 3, (M,), generator=G).to(DEV)
    assert torch.allclose(T.gather_gemv(W, tok, b, H), gather_gemv_reference(W, tok, b, H), rtol=1e-5, atol=1e-5)
    assert T.gather_gemv(W, tok[:0], b[:0], H).numel() == 0


@pytest.mark.parametrize("spherical", [False, True])
@pytest.mark.parametrize("C,d", [(33, 37), (1024, 8), (5, 130)])
def test_cluster_upper(spherical, C, d):
    mu = rnd(C, d)
    if spherical:
        mu = mu / mu.norm(dim=1, keepdim=True)
    R = rnd(C).abs()
    bias = rnd(C)
    H = rnd(2, d)
    nmin, nmax = (rnd(C).abs(), rnd(C).abs() + 2) if spherical else (None, None)
    out = T.cluster_upper(mu, R, bias, H, nmin, nmax)
    ref = cluster_upper_reference(mu, R, bias, H, nmin, nmax)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segmented_gemv(dtype):
    V, d, C = 5003, 19, 40
    W = rnd(V, d).to(dtype)
    sizes = torch.randint(0, 250, (C,), generator=G)
    sizes[-1] = V - sizes[:-1].sum().clamp(max=V)
    sizes = sizes.clamp(min=0)
    offsets = torch.zeros(C + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(sizes, 0).clamp(max=V)
    offsets = offsets.to(DEV)
    cids = torch.tensor([0, 3, 39, 7], device=DEV)
    batch = torch.tensor([0, 1, 1, 0], device=DEV)
    H = rnd(2, d)
    v, p, pr = T.segmented_gemv(W, offsets, cids, batch, H)
    vr, pref, prr = segmented_gemv_reference(W, offsets, cids, batch, H)
    assert torch.equal(p, pref) and torch.equal(pr, prr)
    assert torch.allclose(v, vr, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("V", [7, 1025, 32000, 151936])
def test_row_logsumexp(V):
    X = rnd(3, V, scale=4.0)
    X[1, : V // 2] = float("-inf")
    X[2] = float("-inf")  # an all -inf row stays -inf, no NaN
    out = T.row_logsumexp(X)
    ref = row_logsumexp_reference(X)
    assert torch.allclose(out[:2], ref[:2], rtol=1e-5, atol=1e-5)
    assert out[2] == float("-inf")


@pytest.mark.parametrize("sigmoid", [None, (-1e4, 1e4)])
@pytest.mark.parametrize("V", [1000, 51864, 262144])
def test_residual_race_matches_reference(sigmoid, V):
    zp, zq = rnd(V, scale=3.0), rnd(V, scale=3.0)
    zq[: V // 3] = float("-inf")  # a sub-vocabulary draft
    lp, lq = float(torch.logsumexp(zp, 0)), float(torch.logsumexp(zq, 0))
    E = torch.empty(V, device=DEV).exponential_(generator=None).clamp_min_(1e-30)
    i, ok = T.residual_race(zp, zq, lp, lq, E, sigmoid)
    j, okr = residual_race_reference(zp, zq, lp, lq, E, sigmoid)
    assert ok == okr and int(i) == int(j)


@pytest.mark.slow
def test_residual_race_is_an_exact_draw():
    """Chi-square at α = 0.001: winners follow norm(max(0, p − q))."""
    from scipy import stats

    V, n = 12, 4000
    zp, zq = torch.randn(V, generator=G).to(DEV), torch.randn(V, generator=G).to(DEV)
    lp, lq = float(torch.logsumexp(zp, 0)), float(torch.logsumexp(zq, 0))
    r = ((zp - lp).exp() - (zq - lq).exp()).clamp_min(0).double().cpu()
    r = r / r.sum()
    g = torch.Generator().manual_seed(7)
    counts = torch.zeros(V)
    for _ in range(n):
        E = torch.empty(V).exponential_(generator=g).to(DEV)
        counts[int(T.residual_race(zp, zq, lp, lq, E)[0])] += 1
    keep = r > 0
    assert counts[~keep].sum() == 0
    assert stats.chisquare(counts[keep].numpy(), (r[keep] * n).numpy()).pvalue > 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_certified_head_on_cuda_uses_triton():
    from hf_csv.core.certificate import CertifiedHead

    W = torch.randn(151936, 256, device="cuda") * 0.05
    H = torch.randn(4, 256, device="cuda") * 3
    res = CertifiedHead(W).topk(H, 1)
    assert torch.equal(res.logits.argmax(1), (H @ W.T).argmax(1))


@pytest.mark.slow
def test_exact_acceptance_with_triton_kernels_follows_the_target(monkeypatch):
    """The batched exact acceptance routed through the Triton logsumexp and fused residual race (forced
    backend, interpreter on CPU): the first emitted token follows p exactly (chi-square, α = 0.001)."""
    from scipy import stats

    from hf_csv.core import speculative as hv
    monkeypatch.setenv("HF_CSV_KERNELS", "triton")
    g = torch.Generator().manual_seed(11)
    V, n = 10, 1500
    zq = torch.randn(2, V, generator=g)
    zq[:, :3] = float("-inf")  # sub-vocabulary draft
    zp = torch.randn(3, V, generator=g)
    p0 = hv.exact_first_token_distribution(zq[0], zp[0])
    assert torch.allclose(p0, torch.softmax(zp[0].double(), 0))
    counts = torch.zeros(V)
    q = torch.softmax(zq, -1)
    for _ in range(n):
        ids = torch.multinomial(q, 1, generator=g).squeeze(1)
        res = hv.exact_acceptance(ids.to(DEV), zq.to(DEV), zp.to(DEV), generator=None, lazy=False)
        counts[int(res.tokens[0])] += 1
    assert stats.chisquare(counts.numpy(), (p0 * n).numpy()).pvalue > 1e-3
