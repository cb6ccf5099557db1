"""hf_csv.vllm.probe without vLLM: the subset kernel's probe passes an exact kernel and fails one that rounds
otherwise at a row count it tries."""
from __future__ import annotations

import torch

from hf_csv.vllm.probe import engine_subset_matches
from vllm_doubles import other_kernel


def test_the_subset_probe_tries_batches_up_to_its_row_limit():
    """The probe behind values rows: a kernel exact on every subset passes; one that rounds otherwise only in calls
    of more than 8 rows (a blocking that changes with the batch) fails, as the rows it would serve would."""
    g = torch.Generator().manual_seed(2)
    V, d = 2000, 32
    W = torch.randn(V, d, generator=g) * 0.1
    stock, _ = other_kernel(W)
    exact = lambda Hn, cols: stock(Hn)[:, cols]  # noqa: E731

    def wide_differs(Hn, cols):
        return (Hn @ W[cols].T) if Hn.shape[0] > 8 else stock(Hn)[:, cols]
    assert engine_subset_matches(exact, stock, d, V, W.dtype)
    assert not engine_subset_matches(wide_differs, stock, d, V, W.dtype)

    def five_differs(Hn, cols):  # a row count the general probe never tries: a batch of 5 gets its own probe
        return (Hn @ W[cols].T) if Hn.shape[0] == 5 else stock(Hn)[:, cols]
    assert engine_subset_matches(five_differs, stock, d, V, W.dtype)
    assert not engine_subset_matches(five_differs, stock, d, V, W.dtype, rows=5)
    assert engine_subset_matches(five_differs, stock, d, V, W.dtype, rows=6)
