"""hf_csv.vllm.shards without vLLM: tensor parallelism's combination of certified vocabulary shards, the ranks
simulated (the engine run with two ranks: tests/test_stack_vllm_engine.py)."""
from __future__ import annotations

import pytest
import torch

from hf_csv import CertifiedHead
from hf_csv.vllm.shards import combine_shards, shard_summary
from vllm_doubles import other_kernel


@pytest.mark.parametrize("dtype, shards", [(torch.float32, 2), (torch.bfloat16, 2), (torch.float32, 3)])
def test_vocabulary_shards_combine_to_the_stock_heads_argmax(dtype, shards):
    """Tensor parallelism's combination on its own (vLLM's ranks simulated: each shard a CertifiedHead over its
    rows, its stock the fp64-rounded kernel): where combine_shards decides a row, the first maximum of the
    concatenated certified shards is the full stock row's; duplicated rows across a shard boundary (exact ties
    stock breaks to the lower id) and near ties are in the batch."""
    g = torch.Generator().manual_seed(9)
    V, d = 3000, 48
    W = (torch.randn(V, d, generator=g) * 0.05).to(dtype)
    cut = [i * V // shards for i in range(shards + 1)]
    W[cut[1]] = W[cut[1] - 1]  # a duplicate pair across the first boundary
    W[cut[1] + 5] = (W[cut[1] - 3].float() * (1 + 2 ** -9)).to(dtype)  # a near tie across it
    H = (torch.randn(48, d, generator=g) * 3).to(dtype)
    H[0] = W[cut[1]].float().to(dtype) * 40
    H[1] = W[cut[1] - 3].float().to(dtype) * 40
    stock, _ = other_kernel(W)
    full = stock(H)
    # another order of summation may round the later duplicate one ulp up: stock's first maximum is then the later
    # id, while hf_csv's recomputes of the pair are equal (a combination without the slack picks the earlier one)
    full[0, cut[1]] = torch.nextafter(full[0, cut[1]].float(), torch.tensor(float("inf"))).to(dtype)
    if full[0, cut[1]] == full[0, cut[1] - 1]:  # (bf16: one fp32 ulp rounds back: a bf16 ulp instead)
        full[0, cut[1]] = (full[0, cut[1]].float() * (1 + 2 ** -7)).to(dtype)
    decided_rows = 0
    summaries, parts = [], []
    for r in range(shards):
        Ws = W[cut[r]:cut[r + 1]]
        head = CertifiedHead(Ws)
        res = head.topk(H, k=1, out_dtype=dtype, stock=lambda Hn, a=cut[r], b=cut[r + 1]: full[:, a:b])
        summaries.append(shard_summary(res.logits, res.acc_dense(), res.slack, dtype))
        parts.append(res.logits)
    ok = combine_shards(torch.stack(summaries))
    cat = torch.cat(parts, 1)
    assert ok.dtype == torch.bool and ok.shape == (48,)
    for i in ok.nonzero().view(-1).tolist():
        assert int(cat[i].float().argmax()) == int(full[i].float().argmax()), i
        decided_rows += 1
    assert decided_rows >= 40  # the combination decides nearly every row of a random head


def test_combine_shards_rules():
    # [T, N, 3]: (v, lo, hi). Row 0: shard 1 wins clearly. Row 1: equal values: shard 0 (the lower ids) is the
    # candidate, and shard 1's hi reaches above its lo: undecided. Row 2: shard 0 wins and its lo only ties shard 1's
    # hi (a later shard: stock keeps the lower id on a tie): decided. Row 3: overlapping intervals: undecided.
    s = torch.tensor([[[1.0, 0.9, 1.1], [2.0, 1.9, 2.1], [3.0, 2.9, 3.1], [1.0, 0.9, 1.1]],
                      [[2.0, 1.9, 2.1], [2.0, 1.9, 2.1], [2.95, 2.8, 2.9], [1.05, 0.95, 1.15]]])
    assert combine_shards(s).tolist() == [True, False, True, False]
