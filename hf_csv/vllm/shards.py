"""Tensor parallelism's combination of greedy rows certified per vocabulary shard (docs/vllm.md, "Tensor
parallelism (greedy rows)"): each rank summarises its shard's certified result in three numbers per row
(:func:`shard_summary`), and the gathered summaries decide stock's first maximum over the whole vocabulary or leave
the row undecided (:func:`combine_shards`). No vLLM import: the ranks' collectives are the layer's
(``hf_csv.vllm.layer``)."""
from __future__ import annotations

import torch

from hf_csv.core.certificate import value_interval

__all__ = ["shard_summary", "combine_shards"]


def shard_summary(logits: torch.Tensor, acc: torch.Tensor, slack: torch.Tensor, d: torch.dtype) -> torch.Tensor:
    """[N, 3] fp32 per row of one vocabulary shard's certified greedy result: our value v at the shard's first
    maximum w, and lo <= stock's value at w <= hi (value_interval of its accumulator ``acc`` [N, V_r] within the
    row's ``slack``; lo = hi = v on rows that are stock's own). Every token of the shard has a stock value <= hi:
    S's other tokens are decided below w within their slack, the rest lie below the certificate's bound
    (docs/vllm.md, tensor parallelism)."""
    lf = logits.float()
    w = lf.argmax(1, keepdim=True)  # the first maximum, as vLLM's greedy sampler
    v = lf.gather(1, w)[:, 0]
    lo, hi = value_interval(acc, slack, d)
    lo_w, hi_w = lo.gather(1, w)[:, 0], hi.gather(1, w)[:, 0]
    exact = slack <= 0
    return torch.stack([v, torch.where(exact, v, lo_w), torch.where(exact, v, hi_w)], 1)


def combine_shards(summaries: torch.Tensor) -> torch.Tensor:
    """bool [N]: rows whose global greedy token the shards' summaries decide ([T, N, 3], shards in vocabulary
    order, as vLLM's all-gather concatenates them). The first maximum of the concatenated values lies in the
    first shard r* with the largest v, at its own first maximum w; stock's is the same token when lo(w) exceeds
    every earlier shard's hi (those tokens have lower ids: stock's first maximum would take them on a tie) and is
    at least every later shard's hi. Undecided rows need every shard's stock row."""
    v, lo, hi = summaries.unbind(-1)  # [T, N]
    rstar = v.argmax(0)  # the first shard with the largest value (ties: the lower ids)
    lo_star = lo.gather(0, rstar[None])[0]
    ranks = torch.arange(v.shape[0], device=v.device)[:, None]
    ok = torch.where(ranks < rstar[None], lo_star[None] > hi,
                     torch.where(ranks > rstar[None], lo_star[None] >= hi, torch.ones_like(hi, dtype=torch.bool)))
    return ok.all(0) & torch.isfinite(lo_star)
