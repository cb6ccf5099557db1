"""Exact acceptance of speculative sampling: the drafts are accepted or rejected, and the next token drawn, with
exactly the target's law, without forming a V-sized probability tensor.

Plain torch, no ``transformers`` import. Guarantee of :func:`exact_acceptance` (proof in ``docs/speculative.md``): if
the drafted tokens ``x_j`` were sampled from ``q_j = softmax(draft_logits[j])`` then the emitted tokens are
distributed exactly as if sampled one by one from ``p_j = softmax(target_logits[j])`` — the same distribution the
stock ``_speculative_sampling`` produces — up to the floating-point resolution of the random number generator. It
differs from the stock function only in *how* it computes:

* acceptance ratios ``p_j(x_j)/q_j(x_j)`` come from log-normalizers (one ``logsumexp`` per row)
  and a gather at the drafted id; no V-sized probability or ratio tensor is materialized;
* rows are processed lazily on CPU (row ``j+1`` is never normalized once row ``j`` was rejected);
* the residual ``norm(max(0, p - q))`` is sampled by the exponential race
  ``argmax_i max(0, p_i - q_i) / E_i`` with ``E_i ~ Exp(1)``, which needs no normalizer, run in
  two levels (:func:`hf_csv.core.speculative.race.race`), which has the same law and needs ~2 sqrt(V) exponentials
  instead of V;
* the bonus token (all drafts accepted) is the same race over ``exp(z - max z)`` of the raw
  target logits, so no softmax is formed.
"""
from __future__ import annotations

import math

import torch

from hf_csv.core.speculative.race import exp1, race, sample_from_logits
from hf_csv.core.speculative.rule import AcceptanceResult, DraftProbabilityError, accepted, check_shapes, emitted
from hf_csv_kernels.dispatch import backend_for, get_op

__all__ = ["exact_acceptance", "exact_first_token_distribution"]


def _row_exp(z: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    """(exp(z - max z), its sum s, logsumexp z = max + log s) of one row; 4 V-sized passes, the
    same as torch.logsumexp, but the exp buffer is kept for the residual."""
    zf = z.float()
    m = float(zf.amax())
    if not math.isfinite(m):  # all -inf, or +inf / NaN present (NaN propagates through amax)
        raise DraftProbabilityError("a row of logits cannot be normalized (all -inf, +inf or NaN)")
    e = torch.sub(zf, m).exp_()
    s = float(e.sum())  # >= 1: the maximum contributes exp(0)
    return e, s, m + math.log(s)


def _finite_lse(rows: torch.Tensor) -> torch.Tensor:
    lse = get_op("row_logsumexp", rows.device)(rows)  # Triton streaming kernel on CUDA
    if not bool(torch.isfinite(lse).all()):
        raise DraftProbabilityError("a row of logits cannot be normalized (all -inf, +inf or NaN)")
    return lse


def _lazy_prefix(draft_logits: torch.Tensor, target_logits: torch.Tensor, zq: torch.Tensor, zp: torch.Tensor,
                 u: torch.Tensor, ensemble_weight: float | None) -> tuple[int, torch.Tensor | None]:
    """(n, residual weights max(0, p - q) at row n, or None when all L drafts were accepted), normalizing the rows
    one at a time and stopping at the first rejection (the CPU path)."""
    L = zq.numel()
    for j in range(L):
        # exp(z - max) buffers are kept for row j: on rejection they give p and q directly
        eq, sq, lq = _row_exp(draft_logits[j])
        ep, sp, lp = _row_exp(target_logits[j])
        if not accepted(float(u[j]), (float(zp[j]) - lp) - (float(zq[j]) - lq), ensemble_weight):
            # residual max(0, p - q) = max(0, ep/sp - eq/sq), in place: 3 V-sized passes
            return j, torch.add(ep.div_(sp), eq, alpha=-1.0 / sq).clamp_min_(0.0)
    return L, None


def _batched_prefix(draft_logits: torch.Tensor, target_logits: torch.Tensor, zq: torch.Tensor, zp: torch.Tensor,
                    u: torch.Tensor, ensemble_weight: float | None) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(n, the target rows' and the draft rows' logsumexps), every row normalized at once (one sync)."""
    L = zq.numel()
    lse_q = _finite_lse(draft_logits)
    lse_p = _finite_lse(target_logits[:L])
    log_ratio = (zp - lse_p) - (zq - lse_q)
    ratio = log_ratio.exp()  # +inf when q(x) << p(x): accepted, no NaN since log_ratio is not NaN
    if ensemble_weight is not None:
        ratio = (1.0 - ensemble_weight) + ensemble_weight * ratio
    rejected = ~(u < ratio)
    n = int(rejected.cumsum(0).eq(0).sum())  # accepted prefix length (one sync)
    return n, lse_p, lse_q


def _batched_residual(draft_logits: torch.Tensor, target_logits: torch.Tensor, n: int, lse_p: torch.Tensor,
                      lse_q: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, bool]:
    """The race over the residual max(0, p - q) at the rejected row ``n``: (token, ok), ok False when the residual
    vanished numerically."""
    dev = target_logits.device
    if backend_for(dev) == "triton":
        # fused residual + exponential race: one pass, no V-sized residual buffer
        E = exp1(target_logits[n], generator)
        return get_op("residual_race", dev)(target_logits[n], draft_logits[n], float(lse_p[n]), float(lse_q[n]), E)
    # residual max(0, p - q) at the rejected row, in place on one V-sized buffer
    w = (target_logits[n].float() - lse_p[n]).exp_()
    w.sub_((draft_logits[n].float() - lse_q[n]).exp_()).clamp_min_(0.0)
    return race(w, generator)


@torch.no_grad()
def exact_acceptance(
    draft_ids: torch.Tensor,
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    *,
    ensemble_weight: float | None = None,
    generator: torch.Generator | None = None,
    lazy: bool | None = None,
) -> AcceptanceResult:
    """Exact speculative-sampling acceptance of ``L`` drafted tokens: accept a prefix, then draw one token.

    Args:
        draft_ids: int [L], the drafted tokens, sampled from ``softmax(draft_logits[j])``.
        draft_logits: [L, V] processed draft scores (may be -inf outside a sub-vocabulary).
        target_logits: [L+1, V] processed target scores; row L is the bonus position.
        ensemble_weight: optional w in (0, 1]: accept with ``1 - w + w p/q`` (the DIVERSE
            relaxation that stock supports; *lossy* for w < 1, exactly as in stock).
        generator: torch.Generator for reproducibility.
        lazy: normalize rows one at a time and stop at the first rejection (default: on CPU).

    Returns:
        :class:`AcceptanceResult`. With ``ensemble_weight=None`` the tokens are distributed exactly as
        the target (see module docstring).

    Raises:
        DraftProbabilityError: a drafted token has draft logit -inf (q(x)=0) or a row cannot be
            normalized. Such a token cannot have been sampled from ``q``; see docs/speculative.md.
    """
    L = check_shapes(draft_ids, draft_logits, target_logits)
    dev = target_logits.device
    ids = draft_ids.to(device=dev, dtype=torch.long)
    # logits at the drafted ids: L gathers, the only per-token data the acceptance test needs
    zq = draft_logits.gather(1, ids[:, None]).squeeze(1).float()
    zp = target_logits[:L].gather(1, ids[:, None]).squeeze(1).float()
    if bool(torch.isneginf(zq).any()) or bool(torch.isnan(zq).any()):
        raise DraftProbabilityError(
            "a drafted token has draft probability 0 (logit -inf or NaN): the draft logits are not the "
            "distribution the token was sampled from"
        )
    # u ~ U[0,1); accept iff u < ratio (strict: a target-probability-0 token is never accepted)
    u = torch.rand(L, generator=generator, device=dev, dtype=torch.float32)
    if lazy is None:
        lazy = dev.type == "cpu"
    if lazy:
        n, w = _lazy_prefix(draft_logits, target_logits, zq, zp, u, ensemble_weight)
        if n < L:
            tok, ok = race(w, generator)
    else:
        n, lse_p, lse_q = _batched_prefix(draft_logits, target_logits, zq, zp, u, ensemble_weight)
        if n < L:
            tok, ok = _batched_residual(draft_logits, target_logits, n, lse_p, lse_q, generator)
    if n < L:
        if not ok:
            # p == q to float precision at this row, so the residual vanished numerically. The
            # rejection itself had probability ~0; the limiting distribution is p (stock would hit
            # 0/0 here; for its ensemble mode it falls back to p as well).
            tok = sample_from_logits(target_logits[n], generator)
    else:
        tok = sample_from_logits(target_logits[L], generator)
    return emitted(ids, n, tok, dev)


@torch.no_grad()
def exact_first_token_distribution(draft_logits_row: torch.Tensor, target_logits_row: torch.Tensor) -> torch.Tensor:
    """Analytic distribution of the first emitted token of exact speculative sampling (float64):
    q(x) min(1, p(x)/q(x)) + P(reject) norm(max(0, p - q))(x). Equals p (the theorem); used in tests."""
    p = torch.softmax(target_logits_row.double(), -1)
    q = torch.softmax(draft_logits_row.double(), -1)
    acc = torch.minimum(p, q)
    res = (p - q).clamp_min(0)
    rej = 1.0 - acc.sum()
    return acc + (rej * res / res.sum() if res.sum() > 0 else 0.0)
