"""Sigmoid acceptance: the seed paper's LOSSY approximation of speculative sampling, for measurement and as an
explicit opt-in.

Plain torch, no ``transformers`` import. Softmax is replaced by ``sigmoid((z - alpha) / (beta - alpha))``,
alpha = -1e4, beta = 1e4. Its output is *not* distributed as the target (docs/speculative.md).
"""
from __future__ import annotations

import warnings

import torch

from hf_csv.core.speculative.race import race
from hf_csv.core.speculative.rule import AcceptanceResult, check_shapes, emitted

__all__ = ["SIGMOID_ALPHA", "SIGMOID_BETA", "LossyVerifyWarning", "sigmoid_probs", "sigmoid_acceptance",
           "sigmoid_first_token_distribution"]

SIGMOID_ALPHA = -1.0e4
SIGMOID_BETA = 1.0e4


class LossyVerifyWarning(UserWarning):
    """Emitted (once per process by :func:`sigmoid_acceptance`, once per scope by
    :mod:`hf_csv.transformers.acceptance`) when the lossy sigmoid acceptance is used."""


_SIGMOID_WARNED = False


def _reset_sigmoid_warning() -> None:
    """Test hook: make the next :func:`sigmoid_acceptance` call warn again."""
    global _SIGMOID_WARNED
    _SIGMOID_WARNED = False


def sigmoid_probs(z: torch.Tensor, alpha: float = SIGMOID_ALPHA, beta: float = SIGMOID_BETA) -> torch.Tensor:
    """The seed paper's softmax replacement sigmoid((z - alpha)/(beta - alpha)), elementwise and
    unnormalized. For |z| << 1e4 every value is ~sigmoid(0.5) ≈ 0.62; -inf maps to 0."""
    return torch.sigmoid((z.float() - alpha) / (beta - alpha))


@torch.no_grad()
def sigmoid_acceptance(
    draft_ids: torch.Tensor,
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    *,
    ensemble_weight: float | None = None,
    generator: torch.Generator | None = None,
    alpha: float = SIGMOID_ALPHA,
    beta: float = SIGMOID_BETA,
    warn: bool = True,
) -> AcceptanceResult:
    """LOSSY acceptance: the speculative-sampling algorithm with every softmax replaced by
    :func:`sigmoid_probs` (acceptance ratio s_p(x)/s_q(x), residual norm(max(0, s_p - s_q)),
    bonus from norm(s_p)).

    No distributional guarantee: because s ≈ 0.62 for every finite logit, almost every draft is
    accepted whatever the target says, and the bonus/residual draws are close to uniform over the
    tokens with finite logits. Measured quality: docs/speculative.md. Warns once per process
    (``warn=False`` for callers that warn themselves, e.g. :mod:`hf_csv.transformers.acceptance` once per scope).
    """
    global _SIGMOID_WARNED
    if warn and not _SIGMOID_WARNED:
        _SIGMOID_WARNED = True
        warnings.warn(
            "sigmoid acceptance is a lossy approximation of speculative sampling: its output is NOT "
            "distributed as the target model (see docs/speculative.md)",
            LossyVerifyWarning,
            stacklevel=2,
        )
    L = check_shapes(draft_ids, draft_logits, target_logits)
    dev = target_logits.device
    ids = draft_ids.to(device=dev, dtype=torch.long)
    # only the L gathered values are needed for acceptance: no V-sized work unless we resample
    sq = sigmoid_probs(draft_logits.gather(1, ids[:, None]).squeeze(1), alpha, beta)
    sp = sigmoid_probs(target_logits[:L].gather(1, ids[:, None]).squeeze(1), alpha, beta)
    ratio = sp / sq.clamp_min(torch.finfo(torch.float32).tiny)
    if ensemble_weight is not None:
        ratio = (1.0 - ensemble_weight) + ensemble_weight * ratio
    u = torch.rand(L, generator=generator, device=dev, dtype=torch.float32)
    n = int((~(u < ratio)).cumsum(0).eq(0).sum())
    if n < L:
        w = sigmoid_probs(target_logits[n], alpha, beta).sub_(sigmoid_probs(draft_logits[n], alpha, beta))
        tok, ok = race(w.clamp_min_(0.0), generator)
        if not ok:
            tok, _ = race(sigmoid_probs(target_logits[n], alpha, beta), generator)
    else:
        tok, _ = race(sigmoid_probs(target_logits[L], alpha, beta), generator)
    return emitted(ids, n, tok, dev)


@torch.no_grad()
def sigmoid_first_token_distribution(
    draft_logits_row: torch.Tensor,
    target_logits_row: torch.Tensor,
    alpha: float = SIGMOID_ALPHA,
    beta: float = SIGMOID_BETA,
) -> tuple[torch.Tensor, float]:
    """Analytic distribution of the first emitted token under :func:`sigmoid_acceptance` when the draft
    really samples from q = softmax(draft logits) (float64), and its acceptance probability.

    P(x) = q(x) min(1, s_p(x)/s_q(x)) + P(reject) norm(max(0, s_p - s_q))(x).
    """
    q = torch.softmax(draft_logits_row.double(), -1)
    sp = torch.sigmoid((target_logits_row.double() - alpha) / (beta - alpha))
    sq = torch.sigmoid((draft_logits_row.double() - alpha) / (beta - alpha))
    a = torch.where(sq > 0, torch.clamp(sp / sq.clamp_min(1e-300), max=1.0), torch.zeros_like(sq))
    accept = q * a
    p_acc = float(accept.sum())
    res = (sp - sq).clamp_min(0)
    if float(res.sum()) > 0:
        res = res / res.sum()
    else:
        res = sp / sp.sum()
    return accept + (1.0 - p_acc) * res, p_acc
