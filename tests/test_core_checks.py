"""hf_csv.core.checks: the per-row proofs between the certified head and the token."""
import pytest
import torch


@pytest.mark.usefixtures("assume_subset_exact")
def test_nucleus_decision_is_sound_for_every_vector_within_the_bounds():
    """Randomized soundness of the decision itself: whenever it claims a row, stock's TopPLogitsWarper removes
    exactly the claimed tokens on *every* vector that agrees on S and stays below the bounds elsewhere."""
    from transformers import TopPLogitsWarper

    from hf_csv.core.checks import nucleus_decide as _nucleus_decide

    g = torch.Generator().manual_seed(0)
    claimed = unsure = 0
    for trial in range(1500):
        V = int(torch.randint(6, 40, (1,), generator=g))
        x = torch.randn(V, generator=g) * float(torch.empty(1).uniform_(0.5, 4.0, generator=g))
        if trial % 3 == 0:
            x = x.round()  # ties: stock's sort may put tied tokens in any order
        top_p = float(torch.empty(1).uniform_(0.3, 0.97, generator=g))
        cut = float(torch.quantile(x, float(torch.empty(1).uniform_(0.2, 0.9, generator=g))))
        S = x >= cut
        S |= torch.rand(V, generator=g) < 0.1
        S[x.argmax()] = True
        up = torch.where(S, torch.full_like(x, float("inf")), x + torch.rand(V, generator=g) * 2.0)
        scores = torch.where(S, x, torch.full_like(x, float("-inf")))[None]
        remove, bad = _nucleus_decide(scores, S[None], up[None], top_p)
        if bool(bad[0]):
            unsure += 1
            continue
        claimed += 1
        for v in range(6):  # vectors within the bounds: at the bound, below it, far below, or -inf
            mode = v % 3
            lowered = up - (0.0 if mode == 0 else torch.rand(V, generator=g) * (1.0 if mode == 1 else 20.0))
            y = torch.where(S, x, lowered)
            if v == 5:
                y = torch.where(S, x, torch.full_like(x, float("-inf")))
            out = TopPLogitsWarper(top_p)(None, y[None].clone())[0]
            stock_removed = torch.isinf(out) & torch.isfinite(y)
            assert torch.equal(stock_removed[S], remove[0][S]), (trial, v)
            assert bool(stock_removed[~S & torch.isfinite(y)].all()), (trial, v)
    assert claimed > 300 and unsure > 100, (claimed, unsure)
