"""What every acceptance algorithm of speculative sampling shares: the shapes it takes, the result it returns, the
refusal of a draft that was not sampled from its logits, and the acceptance test ``u < p(x)/q(x)``.

Plain torch, no ``transformers`` import.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["AcceptanceResult", "DraftProbabilityError", "check_shapes", "accepted", "emitted"]


class AcceptanceResult(NamedTuple):
    """``n_accepted`` drafted tokens were accepted; ``tokens`` (int64, shape [n_accepted + 1]) are
    the emitted tokens: the accepted drafts followed by one token sampled from the target (the
    residual on rejection, the bonus position when every draft was accepted)."""

    n_accepted: int
    tokens: torch.Tensor


class DraftProbabilityError(ValueError):
    """A drafted token has zero draft probability (its draft logit is -inf), or a row of logits
    cannot be normalized (all -inf, +inf or NaN). The draft could not have sampled such a token
    from the given logits, so the logits are not the draft's sampling distribution and no
    speculative-sampling guarantee holds: this is a caller bug and we refuse to guess."""


def check_shapes(draft_ids: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor) -> int:
    """``L``, the number of drafted tokens, after checking draft_ids [L], draft_logits [L, V] and target_logits
    [L + 1, V] (ValueError otherwise)."""
    if draft_ids.dim() != 1:
        raise ValueError(f"draft_ids must be 1-D [L], got shape {tuple(draft_ids.shape)}")
    L = draft_ids.numel()  # L = 0 is allowed: no draft to accept or reject, just the bonus token
    if draft_logits.dim() != 2 or draft_logits.shape[0] != L:
        raise ValueError(f"draft_logits must be [L={L}, V], got {tuple(draft_logits.shape)}")
    if target_logits.dim() != 2 or target_logits.shape[0] != L + 1:
        raise ValueError(f"target_logits must be [L+1={L + 1}, V], got {tuple(target_logits.shape)}")
    if draft_logits.shape[1] != target_logits.shape[1]:
        # stock would fail on `p - q` broadcasting; say so clearly instead
        raise ValueError(
            f"draft and target vocabularies differ ({draft_logits.shape[1]} vs {target_logits.shape[1]})"
        )
    return L


def accepted(u: float, log_ratio: float, ensemble_weight: float | None) -> bool:
    """The acceptance test of one draft: ``u < p(x)/q(x)`` (or ``u < 1 - w + w p(x)/q(x)`` with an ensemble
    weight w), given ``log_ratio = log p(x) - log q(x)``. Strict: a token of target probability 0 is never
    accepted."""
    # log-space comparison: u < exp(log_ratio); math.exp overflow means ratio = inf -> accept
    if math.isnan(log_ratio):
        raise DraftProbabilityError("NaN acceptance ratio")
    ratio = math.exp(log_ratio) if log_ratio < 700.0 else math.inf
    if ensemble_weight is not None:
        ratio = (1.0 - ensemble_weight) + ensemble_weight * ratio
    return u < ratio


def emitted(ids: torch.Tensor, n: int, tok, device: torch.device) -> AcceptanceResult:
    """The result of accepting the first ``n`` of the drafted ``ids`` and then emitting ``tok``."""
    out = torch.empty(n + 1, dtype=torch.long, device=device)
    out[:n] = ids[:n]
    out[n] = tok
    return AcceptanceResult(n, out)
