"""Verify step of speculative sampling: an exact fast path and the (lossy) sigmoid approximation.

Plain torch, no ``transformers`` and no ``hf_csv`` import. The transformers-facing adapter with the
stock ``_speculative_sampling`` signature lives in :mod:`hf_csv.verify`.

Guarantee of :func:`exact_verify` (proof in ``docs/speculative.md``): if the drafted tokens
``x_j`` were sampled from ``q_j = softmax(draft_logits[j])`` then the emitted tokens are
distributed exactly as if sampled one by one from ``p_j = softmax(target_logits[j])`` — the same
distribution the stock ``_speculative_sampling`` produces — up to the floating-point resolution
of the random number generator. It differs from the stock function only in *how* it computes:

* acceptance ratios ``p_j(x_j)/q_j(x_j)`` come from log-normalizers (one ``logsumexp`` per row)
  and a gather at the drafted id; no V-sized probability or ratio tensor is materialized;
* rows are processed lazily on CPU (row ``j+1`` is never normalized once row ``j`` was rejected);
* the residual ``norm(max(0, p - q))`` is sampled by the exponential race
  ``argmax_i max(0, p_i - q_i) / E_i`` with ``E_i ~ Exp(1)``, which needs no normalizer, run in
  two levels (blocks race with their summed weights, then the winning block's elements race), which
  has the same law and needs ~2 sqrt(V) exponentials instead of V;
* the bonus token (all drafts accepted) is the same race over ``exp(z - max z)`` of the raw
  target logits, so no softmax is formed.

:func:`sigmoid_verify` implements the seed paper's approximation (softmax replaced by
``sigmoid((z - alpha) / (beta - alpha))``, alpha = -1e4, beta = 1e4). It is **lossy**: its output
is *not* distributed as the target. It exists for measurement and as an explicit opt-in.
"""
from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch

from .dispatch import backend_for, get_op

__all__ = [
    "VerifyResult",
    "DraftProbabilityError",
    "exact_verify",
    "bounded_verify",
    "sigmoid_verify",
    "sigmoid_probs",
    "sigmoid_first_token_distribution",
    "exact_first_token_distribution",
    "SIGMOID_ALPHA",
    "SIGMOID_BETA",
    "LossyVerifyWarning",
]

SIGMOID_ALPHA = -1.0e4
SIGMOID_BETA = 1.0e4


class VerifyResult(NamedTuple):
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


class LossyVerifyWarning(UserWarning):
    """Emitted (once per process by the kernel, once per scope by :mod:`hf_csv.verify`) when the
    lossy sigmoid verify is used."""


_SIGMOID_WARNED = False


def _reset_sigmoid_warning() -> None:
    """Test hook: make the next :func:`sigmoid_verify` call warn again."""
    global _SIGMOID_WARNED
    _SIGMOID_WARNED = False


def _check_shapes(draft_ids: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor) -> int:
    if draft_ids.dim() != 1:
        raise ValueError(f"draft_ids must be 1-D [L], got shape {tuple(draft_ids.shape)}")
    L = draft_ids.numel()  # L = 0 is allowed: nothing to verify, just the bonus token
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


def _exp1(like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Exp(1) variates, clamped away from 0 so that 0/E and x/E are never NaN.

    (torch's sampler can return exactly 0 with probability ~2^-53 per element; the clamp changes
    the distribution only on that event.)"""
    e = torch.empty(like.shape, dtype=torch.float32, device=like.device)
    e.exponential_(generator=generator)
    return e.clamp_min_(torch.finfo(torch.float32).tiny)


def _sample_from_logits(z: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Exact draw from softmax(z): race over the unnormalized weights exp(z - max z).

    -inf logits get weight 0 and are never chosen."""
    zf = z.float()
    m = float(zf.amax())
    if not math.isfinite(m):
        raise DraftProbabilityError("a row of target logits cannot be normalized (all -inf, +inf or NaN)")
    w = torch.sub(zf, m).exp_()
    idx, _ = _race(w, generator)
    return idx


# block size of the two-level race; ~sqrt(V) keeps both levels small for V in [3e4, 3e5]
RACE_BLOCK = 512


def _race(weights: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, bool]:
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
        key = weights.div_(_exp1(weights, generator))
        idx = key.argmax()
        return idx, bool(key[idx] > 0)
    nfull = V // B
    sums = weights[: nfull * B].view(nfull, B).sum(1)
    if nfull * B < V:
        sums = torch.cat([sums, weights[nfull * B :].sum().reshape(1)])
    bkey = sums.div(_exp1(sums, generator))
    b = int(bkey.argmax())
    if not bool(bkey[b] > 0):
        return torch.zeros((), dtype=torch.long, device=weights.device), False
    lo = b * B
    blk = weights[lo : lo + B]
    k = blk.div(_exp1(blk, generator)).argmax()
    return k + lo, True


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


@torch.no_grad()
def exact_verify(
    draft_ids: torch.Tensor,
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    *,
    ensemble_weight: float | None = None,
    generator: torch.Generator | None = None,
    lazy: bool | None = None,
) -> VerifyResult:
    """Exact speculative-sampling verify of ``L`` drafted tokens.

    Args:
        draft_ids: int [L], the drafted tokens, sampled from ``softmax(draft_logits[j])``.
        draft_logits: [L, V] processed draft scores (may be -inf outside a sub-vocabulary).
        target_logits: [L+1, V] processed target scores; row L is the bonus position.
        ensemble_weight: optional w in (0, 1]: accept with ``1 - w + w p/q`` (the DIVERSE
            relaxation that stock supports; *lossy* for w < 1, exactly as in stock).
        generator: torch.Generator for reproducibility.
        lazy: normalize rows one at a time and stop at the first rejection (default: on CPU).

    Returns:
        :class:`VerifyResult`. With ``ensemble_weight=None`` the tokens are distributed exactly as
        the target (see module docstring).

    Raises:
        DraftProbabilityError: a drafted token has draft logit -inf (q(x)=0) or a row cannot be
            normalized. Such a token cannot have been sampled from ``q``; see docs/speculative.md.
    """
    L = _check_shapes(draft_ids, draft_logits, target_logits)
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

    fused = False
    if lazy:
        n = L
        for j in range(L):
            # exp(z - max) buffers are kept for row j: on rejection they give p and q directly
            eq, sq, lq = _row_exp(draft_logits[j])
            ep, sp, lp = _row_exp(target_logits[j])
            if not _accept(float(u[j]), (float(zp[j]) - lp) - (float(zq[j]) - lq), ensemble_weight):
                n = j
                break
        if n < L:
            # residual max(0, p - q) = max(0, ep/sp - eq/sq), in place: 3 V-sized passes
            w = torch.add(ep.div_(sp), eq, alpha=-1.0 / sq).clamp_min_(0.0)
    else:
        lse_q = _finite_lse(draft_logits)
        lse_p = _finite_lse(target_logits[:L])
        log_ratio = (zp - lse_p) - (zq - lse_q)
        ratio = log_ratio.exp()  # +inf when q(x) << p(x): accepted, no NaN since log_ratio is not NaN
        if ensemble_weight is not None:
            ratio = (1.0 - ensemble_weight) + ensemble_weight * ratio
        rejected = ~(u < ratio)
        n = int(rejected.cumsum(0).eq(0).sum())  # accepted prefix length (one sync)

        if n < L:
            if backend_for(dev) == "triton":
                # fused residual + exponential race: one pass, no V-sized residual buffer
                E = _exp1(target_logits[n], generator)
                tok, ok = get_op("residual_race", dev)(target_logits[n], draft_logits[n], float(lse_p[n]),
                                                       float(lse_q[n]), E)
                fused = True
            else:
                # residual max(0, p - q) at the rejected row, in place on one V-sized buffer
                w = (target_logits[n].float() - lse_p[n]).exp_()
                w.sub_((draft_logits[n].float() - lse_q[n]).exp_()).clamp_min_(0.0)

    if n < L:
        if not fused:
            tok, ok = _race(w, generator)
        if not ok:
            # p == q to float precision at this row, so the residual vanished numerically. The
            # rejection itself had probability ~0; the limiting distribution is p (stock would hit
            # 0/0 here; for its ensemble mode it falls back to p as well).
            tok = _sample_from_logits(target_logits[n], generator)
    else:
        tok = _sample_from_logits(target_logits[L], generator)
    out = torch.empty(n + 1, dtype=torch.long, device=dev)
    out[:n] = ids[:n]
    out[n] = tok
    return VerifyResult(n, out)


# log-space slack of the bounded decisions: far above the float64 rounding of the interval sums, far below
# any difference that changes a probability at fp32 resolution
_BOUND_SLACK = 1e-9


def _gumbel_noise(n: int, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """i.i.d. standard Gumbel variates, float64: -log(E), E ~ Exp(1) clamped away from 0."""
    return _exp1(torch.empty(n, device=device), generator).double().log_().neg_()


def _lse64(x: torch.Tensor, bound: bool = False) -> float:
    """logsumexp of a 1-D tensor in float64 (-inf when empty or all -inf; +inf for a ``bound`` with +inf)."""
    if x.numel() == 0:
        return -math.inf
    x = x.double()
    m = float(x.amax())
    if m == -math.inf:
        return -math.inf
    if bound and m == math.inf:
        return math.inf  # a useless upper bound: it decides nothing, the row gets completed
    if not math.isfinite(m):
        raise DraftProbabilityError("a row of target logits cannot be normalized (+inf or NaN)")
    return m + math.log(float(torch.exp(x - m).sum()))


class _BoundedRow:
    """One target row known exactly on ``known`` (plus tokens fetched later) and bounded above elsewhere.

    ``lo <= log Z <= hi`` always holds: the exact entries give the lower end; the upper end adds the
    bounds of every entry that was not known at the start (fetched entries are below their bounds).
    After :meth:`complete` the row is exact everywhere and lo == hi.
    """

    def __init__(self, j: int, z: torch.Tensor, known: torch.Tensor, upper: torch.Tensor, complete) -> None:
        self.j, self._complete = j, complete
        self.z = z.float().masked_fill(~known, float("-inf"))
        self.known = known.clone()
        self.upper = upper.float().masked_fill(known, float("-inf"))
        a = _lse64(self.z[known])
        self.lo = a
        self.hi = float(torch.logaddexp(torch.tensor(a, dtype=torch.float64),
                                        torch.tensor(_lse64(self.upper, bound=True), dtype=torch.float64)))
        self.full = bool(known.all())

    def fetch(self, tokens: torch.Tensor) -> None:
        """Make ``tokens`` exact (computed by the caller's ``complete(j, tokens)``)."""
        tokens = tokens[~self.known[tokens]]
        if tokens.numel() == 0:
            return
        vals = self._complete(self.j, tokens).float()
        self.z[tokens] = vals
        self.known[tokens] = True
        self.upper[tokens] = float("-inf")
        self.lo = float(torch.logaddexp(torch.tensor(self.lo, dtype=torch.float64),
                                        torch.tensor(_lse64(vals), dtype=torch.float64)))
        self.full = bool(self.known.all())

    def complete(self) -> None:
        """The whole row from the caller's full head (its values replace every earlier one)."""
        if self.full and self.lo == self.hi:
            return
        self.z = self._complete(self.j, None).float()
        self.known[:] = True
        self.upper.fill_(float("-inf"))
        self.lo = self.hi = _lse64(self.z)
        if self.lo == -math.inf:
            raise DraftProbabilityError("a row of target logits cannot be normalized (all -inf)")
        self.full = True


@torch.no_grad()
def bounded_verify(
    draft_ids: torch.Tensor,
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    known: torch.Tensor,
    upper: torch.Tensor,
    complete,
    *,
    generator: torch.Generator | None = None,
    counts: dict | None = None,
) -> VerifyResult:
    """Exact speculative-sampling verify when the target rows are known exactly only on a subset.

    Args:
        draft_ids, draft_logits: as in :func:`exact_verify` (the draft's law q must be fully given).
        target_logits: [L+1, V] processed target scores, exact where ``known``.
        known: [L+1, V] bool.
        upper: [L+1, V] upper bounds on the processed target scores where not ``known``.
        complete: ``complete(j, tokens)`` returns the exact processed scores of row j at ``tokens``
            (a long tensor), or the whole row when ``tokens`` is None.
        counts: optional dict accumulating ``rows`` (rows looked at), ``by_bounds`` (decided from the
            bounds alone) and ``completed`` (rows completed with ``complete(j, None)``).

    Guarantee (docs/speculative.md, "certified target"): the emitted tokens have exactly the law of
    :func:`exact_verify` on the complete rows, i.e. the target's (with ``ensemble_weight`` unsupported). Each
    decision (accept, residual draw, bonus draw) is taken from the bounds only when the bounds prove
    what the complete row would decide with the same random numbers; otherwise the row is completed.
    """
    L = _check_shapes(draft_ids, draft_logits, target_logits)
    if known.shape != target_logits.shape or upper.shape != target_logits.shape:
        raise ValueError("known and upper must have the target logits' shape [L+1, V]")
    dev = target_logits.device
    ids = draft_ids.to(device=dev, dtype=torch.long)
    c = counts if counts is not None else {}
    for key in ("rows", "by_bounds", "completed"):
        c.setdefault(key, 0)
    u = torch.rand(L, generator=generator, device=dev, dtype=torch.float32)
    V = target_logits.shape[1]
    n = L
    row = None
    for j in range(L):
        zq = draft_logits[j].float()
        lq = _lse64(zq)
        zqx = float(zq[ids[j]])
        if not math.isfinite(zqx) or not math.isfinite(lq):
            raise DraftProbabilityError(
                "a drafted token has draft probability 0 (logit -inf or NaN), or a draft row cannot be "
                "normalized: the draft logits are not the distribution the token was sampled from")
        row = _BoundedRow(j, target_logits[j], known[j], upper[j], complete)
        row.fetch(ids[j:j + 1])
        c["rows"] += 1
        log_u = math.log(float(u[j])) if float(u[j]) > 0 else -math.inf
        zpx = float(row.z[ids[j]])
        base = zpx - (zqx - lq)
        if log_u < base - row.hi - _BOUND_SLACK:
            c["by_bounds"] += 1
            continue  # accepted for every log Z in [lo, hi]
        if not log_u < base - row.lo + _BOUND_SLACK:
            c["by_bounds"] += 1
            n = j  # rejected for every log Z in [lo, hi]
            break
        row.complete()
        c["completed"] += 1
        if not _accept(float(u[j]), (float(row.z[ids[j]]) - row.lo) - (zqx - lq), None):
            n = j
            break
    if n < L:
        tok = _bounded_residual(row, draft_logits[n].float(), V, generator, c)
    else:
        row = _BoundedRow(L, target_logits[L], known[L], upper[L], complete)
        c["rows"] += 1
        tok = _bounded_bonus(row, V, generator, c)
    out = torch.empty(n + 1, dtype=torch.long, device=dev)
    out[:n] = ids[:n]
    out[n] = tok
    return VerifyResult(n, out)


def _bounded_residual(row: _BoundedRow, zq: torch.Tensor, V: int, generator, c: dict) -> torch.Tensor:
    """Winner of the Gumbel race over log max(0, p - q) + G (the residual's law, Lemma 1), from bounds
    where they prove the winner for every log Z in [lo, hi], else from the completed row (same noise)."""
    lq = _lse64(zq)
    support = torch.isfinite(zq).nonzero(as_tuple=True)[0]
    if support.numel() > V // 8:
        row.complete()
        c["completed"] += 1
    else:
        row.fetch(support)
    q = torch.exp(zq.double() - lq)  # 0 off the draft's support
    G = _gumbel_noise(V, zq.device, generator)
    if not row.full or row.lo != row.hi:
        z = row.z.double()
        w_lo = (torch.exp(z - row.hi) - q).clamp_min_(0.0)  # the smallest residual weights (largest Z)
        w_hi = (torch.exp(z - row.lo) - q).clamp_min_(0.0)
        s_lo = torch.log(w_lo) + G
        s_hi = torch.log(w_hi) + G
        cand = int(s_lo.argmax())
        best = float(s_lo[cand])
        s_hi[cand] = -math.inf
        rival = max(float(s_hi.max()), float((row.upper.double() - row.lo + G).max()))
        if math.isfinite(best) and best > rival + _BOUND_SLACK:
            c["by_bounds"] += 1
            return torch.tensor(cand, device=zq.device)
        row.complete()
        c["completed"] += 1
    z = row.z.double()
    w = (torch.exp(z - row.lo) - q).clamp_min_(0.0)
    s = torch.log(w) + G
    tok = int(s.argmax())
    if not math.isfinite(float(s[tok])):
        # the residual vanished numerically (p == q to float precision): the law is p (see exact_verify)
        return _sample_from_logits(row.z, generator)
    return torch.tensor(tok, device=zq.device)


def _bounded_bonus(row: _BoundedRow, V: int, generator, c: dict) -> torch.Tensor:
    """Gumbel-max draw from p = softmax(row): from the exact entries when their best perturbed score beats
    every bounded one's perturbed upper bound (strictly), else from the completed row (same noise)."""
    G = _gumbel_noise(V, row.z.device, generator)
    s = row.z.double() + G
    cand = int(s.argmax())
    best = float(s[cand])
    if not row.full:
        rival = float((row.upper.double() + G).max())
        if math.isfinite(best) and best > rival + _BOUND_SLACK:
            c["by_bounds"] += 1
            return torch.tensor(cand, device=row.z.device)
        row.complete()
        c["completed"] += 1
        s = row.z.double() + G
        cand = int(s.argmax())
        best = float(s[cand])
    if not math.isfinite(best):
        raise DraftProbabilityError("a row of target logits cannot be normalized (all -inf, +inf or NaN)")
    return torch.tensor(cand, device=row.z.device)


def _accept(u: float, log_ratio: float, ensemble_weight: float | None) -> bool:
    # log-space comparison: u < exp(log_ratio); math.exp overflow means ratio = inf -> accept
    if math.isnan(log_ratio):
        raise DraftProbabilityError("NaN acceptance ratio")
    ratio = math.exp(log_ratio) if log_ratio < 700.0 else math.inf
    if ensemble_weight is not None:
        ratio = (1.0 - ensemble_weight) + ensemble_weight * ratio
    return u < ratio


def sigmoid_probs(z: torch.Tensor, alpha: float = SIGMOID_ALPHA, beta: float = SIGMOID_BETA) -> torch.Tensor:
    """The seed paper's softmax replacement sigmoid((z - alpha)/(beta - alpha)), elementwise and
    unnormalized. For |z| << 1e4 every value is ~sigmoid(0.5) ≈ 0.62; -inf maps to 0."""
    return torch.sigmoid((z.float() - alpha) / (beta - alpha))


@torch.no_grad()
def sigmoid_verify(
    draft_ids: torch.Tensor,
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    *,
    ensemble_weight: float | None = None,
    generator: torch.Generator | None = None,
    alpha: float = SIGMOID_ALPHA,
    beta: float = SIGMOID_BETA,
    warn: bool = True,
) -> VerifyResult:
    """LOSSY verify: the speculative-sampling algorithm with every softmax replaced by
    :func:`sigmoid_probs` (acceptance ratio s_p(x)/s_q(x), residual norm(max(0, s_p - s_q)),
    bonus from norm(s_p)).

    No distributional guarantee: because s ≈ 0.62 for every finite logit, almost every draft is
    accepted whatever the target says, and the bonus/residual draws are close to uniform over the
    tokens with finite logits. Measured quality: docs/speculative.md. Warns once per process
    (``warn=False`` for callers that warn themselves, e.g. :mod:`hf_csv.verify` once per scope).
    """
    global _SIGMOID_WARNED
    if warn and not _SIGMOID_WARNED:
        _SIGMOID_WARNED = True
        warnings.warn(
            "sigmoid verify is a lossy approximation of speculative sampling: its output is NOT "
            "distributed as the target model (see docs/speculative.md)",
            LossyVerifyWarning,
            stacklevel=2,
        )
    L = _check_shapes(draft_ids, draft_logits, target_logits)
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
        tok, ok = _race(w.clamp_min_(0.0), generator)
        if not ok:
            tok, _ = _race(sigmoid_probs(target_logits[n], alpha, beta), generator)
    else:
        tok, _ = _race(sigmoid_probs(target_logits[L], alpha, beta), generator)
    out = torch.empty(n + 1, dtype=torch.long, device=dev)
    out[:n] = ids[:n]
    out[n] = tok
    return VerifyResult(n, out)


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


@torch.no_grad()
def sigmoid_first_token_distribution(
    draft_logits_row: torch.Tensor,
    target_logits_row: torch.Tensor,
    alpha: float = SIGMOID_ALPHA,
    beta: float = SIGMOID_BETA,
) -> tuple[torch.Tensor, float]:
    """Analytic distribution of the first emitted token under :func:`sigmoid_verify` when the draft
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
