"""hf_csv_kernels.gather: the gather-GEMV reference recomputes a ragged set of (row, token) logits in fp32 within
its stated rounding bound."""
import pytest
import torch

from hf_csv_kernels.gather import gather_gemv_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [2, 8192])
def test_each_pair_is_its_dot_product_within_the_bound(dtype, chunk):
    g = torch.Generator().manual_seed(0)
    V, d = 11, 9
    W = torch.randn(V, d, generator=g).to(dtype)
    H = torch.randn(3, d, generator=g) * 5
    tokens = torch.tensor([0, 10, 4, 4, 7])
    batch = torch.tensor([2, 0, 0, 1, 2])
    out = gather_gemv_reference(W, tokens, batch, H, chunk=chunk)
    assert out.dtype == torch.float32 and out.shape == (5,)
    prod = W[tokens].double() * H[batch].double()
    exact = prod.sum(-1)
    u = 2.0 ** -24
    gamma = d * u / (1 - d * u)
    assert ((out.double() - exact).abs() <= gamma * prod.abs().sum(-1)).all()
    assert torch.equal(out, gather_gemv_reference(W, tokens, batch, H, chunk=3))  # chunking changes nothing


def test_no_pairs_give_an_empty_result():
    out = gather_gemv_reference(torch.randn(4, 3), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                                torch.randn(2, 3))
    assert out.shape == (0,) and out.dtype == torch.float32
