"""hf_csv.vllm.subset in vLLM's environment (skipped without vLLM): vLLM's GEMM on a subset of the head's rows, and the
per-head memo of its probes (rebuilt after an in-place write; a batch size probed on a batch's own rows)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("vllm")

from hf_csv.vllm import subset  # noqa: E402  (imports vLLM)
from vllm_doubles import other_kernel  # noqa: E402


@pytest.mark.parametrize("m", [1, 5, 16, 300])
def test_the_engine_kernel_computes_the_subsets_columns(m):
    """Padded below 16 rows (oneDNN's one-column path) and cut back to the subset (whether it is bit for bit vLLM's
    full call is the probe's question, not this test's)."""
    g = torch.Generator().manual_seed(1)
    W = torch.randn(1000, 32, generator=g)
    H = torch.randn(4, 32, generator=g)
    cols = torch.randperm(1000, generator=g)[:m].sort().values
    kernel = subset.engine_subset_kernel(W)
    got = kernel(H, cols)
    assert got.shape == (4, m)
    assert torch.allclose(got, F.linear(H, W[cols]), rtol=1e-5, atol=1e-4)


def test_the_memo_probes_per_weights_and_per_batch_size(monkeypatch):
    exact = lambda Wn: lambda Hn, cols: (Hn.double() @ Wn[cols].double().T).to(Wn.dtype)  # noqa: E731
    built = []
    monkeypatch.setattr(subset, "engine_subset_kernel", lambda Wn: built.append(1) or exact(Wn))
    g = torch.Generator().manual_seed(2)
    W = torch.randn(500, 16, generator=g)
    full, calls = other_kernel(W)
    memo = subset.SubsetKernel()
    pytorch = subset.sampler_is_pytorch()
    kernel, ok = memo.get(W, 500, full, None)
    assert ok is pytorch and calls == [8, 64] and built == [1]  # the head's probe: full calls of 8 and 64 rows
    if not pytorch:
        pytest.skip("vLLM's top-k / top-p is not its PyTorch path here: values rows are declined")
    assert memo.get(W, 500, full, 5) == (kernel, None)  # a batch size not probed yet
    H = torch.randn(5, 16, generator=g)
    assert memo.probe_batch(H, full(H), 500)
    assert memo.get(W, 500, full, 5) == (kernel, True) and built == [1]
    W[0, 0] = 1.0  # an in-place write: a new kernel, probed again, batch sizes forgotten
    kernel2, ok = memo.get(W, 500, full, 5)
    assert kernel2 is not kernel and ok is None and built == [1, 1]
