"""The exponential race: an exact draw from unnormalized non-negative weights, with no normalizer formed.

Plain torch, no ``transformers`` import. The exact and the sigmoid acceptance draw their residual and bonus tokens
with it (proof of the two-level form: the race lemma, docs/speculative.md).
"""
from __future__ import annotations

import math

import torch

from hf_csv.core.speculative.rule import DraftProbabilityError

__all__ = ["RACE_BLOCK", "exp1", "race", "sample_from_logits"]

# block size of the two-level race; ~sqrt(V) keeps both levels small for V in [3e4, 3e5]
RACE_BLOCK = 512


def exp1(like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Exp(1) variates, clamped away from 0 so that 0/E and x/E are never NaN.

    (torch's sampler can return exactly 0 with probability ~2^-53 per element; the clamp changes
    the distribution only on that event.)"""
    e = torch.empty(like.shape, dtype=torch.float32, device=like.device)
    e.exponential_(generator=generator)
    return e.clamp_min_(torch.finfo(torch.float32).tiny)


def race(weights: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, bool]:
    """Exponential race over non-negative, unnormalized weights: the winner of argmax_i w_i / E_i,
    E_i ~ Exp(1) i.i.d., so P(i) = w_i / sum_j w_j -- no normalizer is ever formed.

    Drawn in two levels with identical law (race lemma, docs/speculative.md): the blocks race
    first with their total weights W_b = sum_{i in b} w_i (min of independent exponentials is
    exponential with the summed rate, and the argmin is independent of the min), then the
    elements of the winning block race with their own weights. This needs ~V/B + B exponentials
    instead of V -- on CPU torch's exponential_ (~20 ns/element) dominates a flat V-sized race.

    Returns (index as a 0-d long tensor, ok); ok is False when every weight is 0.
    ``weights`` may be modified in place.
    """
    V = weights.numel()
    B = RACE_BLOCK
    if V <= 4 * B:
        key = weights.div_(exp1(weights, generator))
        idx = key.argmax()
        return idx, bool(key[idx] > 0)
    nfull = V // B
    sums = weights[: nfull * B].view(nfull, B).sum(1)
    if nfull * B < V:
        sums = torch.cat([sums, weights[nfull * B :].sum().reshape(1)])
    bkey = sums.div(exp1(sums, generator))
    b = int(bkey.argmax())
    if not bool(bkey[b] > 0):
        return torch.zeros((), dtype=torch.long, device=weights.device), False
    lo = b * B
    blk = weights[lo : lo + B]
    k = blk.div(exp1(blk, generator)).argmax()
    return k + lo, True


def sample_from_logits(z: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Exact draw from softmax(z): race over the unnormalized weights exp(z - max z).

    -inf logits get weight 0 and are never chosen."""
    zf = z.float()
    m = float(zf.amax())
    if not math.isfinite(m):
        raise DraftProbabilityError("a row of target logits cannot be normalized (all -inf, +inf or NaN)")
    w = torch.sub(zf, m).exp_()
    idx, _ = race(w, generator)
    return idx
