"""hf_csv_kernels.quantize: the chunked quantizer's error terms and their recompute agree bit for bit."""
import pytest
import torch

from hf_csv_kernels import quantize_rows_fp8, quantize_rows_int8
from hf_csv_kernels.quantize import rows_from_codes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantizer_and_recompute_agree_bit_for_bit(dtype, fmt, monkeypatch):
    """An artifact's stored terms and their float32 recompute from the live head must match exactly
    (the artifact check compares them), whatever the chunking. (hf_csv's C recompute is checked below.)"""
    import hf_csv_kernels.quantize as qz

    monkeypatch.setattr(qz, "_native_terms_ok", lambda *a: False)
    g = torch.Generator().manual_seed(2)
    W = (torch.randn(777, 40, generator=g) * torch.logspace(-3, 1, 777)[:, None]).to(dtype)
    W[3] = 0
    quant = quantize_rows_int8 if fmt == "int8" else quantize_rows_fp8
    r = quant(W, chunk_rows=64, progress=False)
    r2 = rows_from_codes(W, r.q, r.scale, chunk_rows=100, progress=False)
    for k in ("err_l2", "l1", "abs_l1"):
        assert torch.equal(getattr(r, k), getattr(r2, k)), k
    deq = r.q.double() * r.scale.double()[:, None]
    assert (r.err_l2.double() >= (W.double() - deq).norm(dim=1)).all()
    assert (r.l1.double() >= deq.abs().sum(1)).all()
    assert (r.abs_l1.double() >= W.double().abs().sum(1)).all()
    r3 = quant(W, progress=False)  # default chunking: same codes
    assert torch.equal(r3.q.view(torch.int8), r.q.view(torch.int8))
