"""hf_csv_kernels.residual: the references of the verify step's row logsumexp and residual race."""
import torch

from hf_csv_kernels.residual import residual_race_reference, row_logsumexp_reference


def test_row_logsumexp_is_fp32_logsumexp_of_each_row():
    X = (torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 30).to(torch.bfloat16)
    X[1, 5:] = float("-inf")
    out = row_logsumexp_reference(X)
    assert out.dtype == torch.float32 and out.shape == (3,)
    ref = torch.logsumexp(X.double(), dim=-1)
    assert torch.allclose(out.double(), ref, rtol=1e-6, atol=1e-5)


def test_the_race_wins_only_where_the_target_exceeds_the_draft():
    g = torch.Generator().manual_seed(2)
    zp, zq = torch.randn(40, generator=g), torch.randn(40, generator=g)
    lp, lq = float(torch.logsumexp(zp, 0)), float(torch.logsumexp(zq, 0))
    resid = ((zp - lp).exp() - (zq - lq).exp()).clamp_min(0)
    assert (resid > 0).any() and (resid == 0).any()
    for _ in range(200):
        E = torch.empty(40).exponential_(generator=g)
        i, ok = residual_race_reference(zp, zq, lp, lq, E)
        assert ok and resid[i] > 0
        assert int(i) == int((resid / E).argmax())
    # with unit "exponentials" the winner is the residual's largest entry
    i, ok = residual_race_reference(zp, zq, lp, lq, torch.ones(40))
    assert ok and int(i) == int(resid.argmax())


def test_an_empty_residual_is_reported_and_the_sigmoid_variant_is_used():
    z = torch.randn(30, generator=torch.Generator().manual_seed(3))
    lse = float(torch.logsumexp(z, 0))
    _, ok = residual_race_reference(z, z, lse, lse, torch.ones(30))
    assert ok is False  # p == q: nothing to draw, never a silent index 0
    zq = z.clone()
    zq[4] -= 5.0  # only token 4 has sigmoid(p) > sigmoid(q)
    i, ok = residual_race_reference(z, zq, 0.0, 0.0, torch.ones(30), sigmoid=(-10.0, 10.0))
    assert ok and int(i) == 4
