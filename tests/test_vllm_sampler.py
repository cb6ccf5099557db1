"""hf_csv.vllm.sampler without vLLM: the boundary check of vLLM's min-p and top-p on a padded row (its use in a batch,
against vLLM's steps under any tie order: tests/test_vllm_certify.py)."""
from __future__ import annotations

import torch

from hf_csv.vllm.sampler import sampler_boundary_unsure


def test_sampler_boundary_check_finds_ties_at_the_top_p_cut_and_tokens_at_the_min_p_threshold():
    # ascending kept values 1, 2, 2, 3 (T = 1): the cut at 1 - p falls between the two 2s or not
    x = torch.full((1, 10), float("-inf"))
    x[0, :4] = torch.tensor([1.0, 2.0, 2.0, 3.0])
    e = torch.tensor([1.0, 2.0, 2.0, 3.0]).double().exp()
    c = (e / e.sum()).cumsum(0)  # c[1] masks one 2 and keeps the other when c[1] <= 1 - p < c[2]
    mid = float(1 - (c[1] + c[2]) / 2)
    assert bool(sampler_boundary_unsure(x, 4, top_p=mid)[0])
    assert not bool(sampler_boundary_unsure(x, 4, top_p=float(1 - c[2] - 0.01))[0])  # both 2s kept
    assert not bool(sampler_boundary_unsure(x, 4, top_p=float(1 - c[1] + 0.01))[0])  # both 2s dropped
    assert not bool(sampler_boundary_unsure(x, 4)[0])  # top-k alone: one set on both rows
    # the max itself tied: vLLM keeps the last position always, so a tiny top-p splits the pair
    y = x.clone()
    y[0, :4] = torch.tensor([1.0, 2.0, 3.0, 3.0])
    assert bool(sampler_boundary_unsure(y, 4, top_p=1e-3)[0])
    # a token whose probability ratio to the maximum is min_p itself, to rounding: unsure; min_p apart: sure
    ratio = float(torch.tensor(2.0 - 3.0).double().exp())
    assert bool(sampler_boundary_unsure(x, 4, min_p=ratio)[0])
    assert not bool(sampler_boundary_unsure(x, 4, min_p=ratio * 1.01)[0])
    assert bool(sampler_boundary_unsure(x, 4, min_p=1e-40)[0])  # a min-p whose threshold may be subnormal
