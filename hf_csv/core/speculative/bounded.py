"""Bounded acceptance: exact speculative-sampling acceptance when the target rows are known exactly only on a subset
of the vocabulary and bounded above elsewhere (a certified target head, docs/speculative.md "certified target").

Plain torch, no ``transformers`` import. Each decision (accept, residual draw, bonus draw) is taken from the bounds
only when they prove what the complete row would decide with the same random numbers; otherwise the row is
completed, so the emitted tokens have exactly the law of :func:`hf_csv.core.speculative.exact.exact_acceptance` on
the complete rows.
"""
from __future__ import annotations

import math

import torch

from hf_csv.core.speculative.gumbel import gumbel_noise
from hf_csv.core.speculative.race import sample_from_logits
from hf_csv.core.speculative.rule import AcceptanceResult, DraftProbabilityError, accepted, check_shapes, emitted

__all__ = ["bounded_acceptance"]

# log-space slack of the bounded decisions: above the fp32 rounding of the interval's logsumexps (a few ulps of
# values of magnitude <= ~100), far below any difference that changes a probability at fp32 resolution
_BOUND_SLACK = 1e-5


def _logaddexp(a: float, b: float) -> float:
    if a == -math.inf:
        return b
    if b == -math.inf:
        return a
    if math.isinf(a) or math.isinf(b):
        return math.inf
    m = max(a, b)
    return m + math.log(math.exp(a - m) + math.exp(b - m))


class _BoundedRow:
    """One target row known exactly on ``known`` (plus tokens fetched later) and bounded above elsewhere.

    ``lo <= log Z <= hi`` always holds: the exact entries give the lower end; the upper end adds the
    bounds of every entry that was not known at the start (fetched entries are below their bounds).
    After :meth:`complete` the row is exact everywhere and lo == hi. V-sized copies are made only when a
    draw needs the row (:meth:`dense`), not for the accept test.
    """

    def __init__(self, j: int, z: torch.Tensor, known: torch.Tensor, upper: torch.Tensor, lse_known: float,
                 lse_upper: float, complete) -> None:
        self.j, self._complete = j, complete
        self._z, self._known, self._upper = z, known, upper
        self.extra: dict[int, float] = {}  # fetched tokens -> exact value
        self.lo = lse_known
        self.hi = _logaddexp(lse_known, lse_upper)
        self.full: torch.Tensor | None = None  # the completed row

    def value(self, t: int) -> float:
        if self.full is not None:
            return float(self.full[t])
        if bool(self._known[t]):
            return float(self._z[t])
        if t not in self.extra:
            self.fetch(torch.tensor([t], device=self._z.device))
        return self.extra[t]

    def fetch(self, tokens: torch.Tensor) -> None:
        """Make ``tokens`` exact (computed by the caller's ``complete(j, tokens)``)."""
        if self.full is not None:
            return
        tokens = tokens[~self._known[tokens]]
        new = [t for t in tokens.tolist() if t not in self.extra]
        if not new:
            return
        vals = self._complete(self.j, torch.tensor(new, device=self._z.device)).float().tolist()
        for t, v in zip(new, vals):
            self.extra[t] = v
            self.lo = _logaddexp(self.lo, v)

    def complete(self) -> None:
        """The whole row from the caller's full head (its values replace every earlier one)."""
        if self.full is not None:
            return
        self.full = self._complete(self.j, None).float()
        self.lo = self.hi = float(torch.logsumexp(self.full, 0))
        if not math.isfinite(self.lo):
            raise DraftProbabilityError("a row of target logits cannot be normalized (all -inf, +inf or NaN)")

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(exact values, -inf where unknown; upper bounds where unknown, -inf elsewhere), V-sized."""
        if self.full is not None:
            return self.full, torch.full_like(self.full, float("-inf"))
        z = self._z.float().masked_fill(~self._known, float("-inf"))
        up = self._upper.float().masked_fill(self._known, float("-inf"))
        if self.extra:
            idx = torch.tensor(list(self.extra), device=z.device)
            z[idx] = torch.tensor(list(self.extra.values()), device=z.device)
            up[idx] = float("-inf")
        return z, up



def _bounded_row(j: int, target_logits: torch.Tensor, known: torch.Tensor, upper, complete) -> _BoundedRow:
    """Target row ``j`` as a :class:`_BoundedRow`, built when the acceptance reaches it (rows after the first
    rejection are never touched)."""
    up = upper[j] if torch.is_tensor(upper) else upper(j)
    kn = known[j]
    if bool(torch.isnan(up.masked_fill(kn, 0.0)).any()):
        raise ValueError("upper bounds must not be NaN")
    a = float(torch.logsumexp(target_logits[j].float().masked_fill(~kn, float("-inf")), 0))
    b = float(torch.logsumexp(up.float().masked_fill(kn, float("-inf")), 0))
    return _BoundedRow(j, target_logits[j], kn, up, a, b, complete)


def _decide(row: _BoundedRow, x: int, u: float, log_qx: float, c: dict) -> bool:
    """Whether the draft ``x`` (of draft log-probability ``log_qx``) is accepted at ``row`` with the uniform ``u``:
    from the bounds where they decide for every log Z in [lo, hi], else from the completed row."""
    c["rows"] += 1
    log_u = math.log(u) if u > 0 else -math.inf
    base = row.value(x) - log_qx
    if log_u < base - row.hi - _BOUND_SLACK:
        c["by_bounds"] += 1
        return True  # accepted for every log Z in [lo, hi]
    if not log_u < base - row.lo + _BOUND_SLACK:
        c["by_bounds"] += 1
        return False  # rejected for every log Z in [lo, hi]
    row.complete()
    c["completed"] += 1
    return accepted(u, (row.value(x) - row.lo) - log_qx, None)


def _accepted_prefix(ids: torch.Tensor, draft_logits: torch.Tensor, u: list, zqx: list, row_of,
                     c: dict) -> tuple[int, _BoundedRow | None, float | None]:
    """(n, the rejected row, its draft logsumexp): the accepted prefix, or (L, None, None) when every draft was
    accepted. ``row_of(j)`` builds target row j."""
    for j in range(len(zqx)):
        lse_q = float(torch.logsumexp(draft_logits[j].float(), 0))
        if not math.isfinite(zqx[j]) or not math.isfinite(lse_q):
            raise DraftProbabilityError(
                "a drafted token has draft probability 0 (logit -inf or NaN), or a draft row cannot be "
                "normalized: the draft logits are not the distribution the token was sampled from")
        row = row_of(j)
        if not _decide(row, int(ids[j]), u[j], zqx[j] - lse_q, c):
            return j, row, lse_q
    return len(zqx), None, None


@torch.no_grad()
def bounded_acceptance(
    draft_ids: torch.Tensor,
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    known: torch.Tensor,
    upper,
    complete,
    *,
    generator: torch.Generator | None = None,
    counts: dict | None = None,
) -> AcceptanceResult:
    """Exact speculative-sampling acceptance when the target rows are known exactly only on a subset.

    Args:
        draft_ids, draft_logits: as in :func:`exact_acceptance` (the draft's law q must be fully given).
        target_logits: [L+1, V] processed target scores, exact where ``known``.
        known: [L+1, V] bool.
        upper: [L+1, V] upper bounds on the processed target scores where not ``known``, or a function
            ``upper(j)`` returning row j's (rows are then built only when the acceptance reaches them).
        complete: ``complete(j, tokens)`` returns the exact processed scores of row j at ``tokens``
            (a long tensor), or the whole row when ``tokens`` is None.
        counts: optional dict accumulating ``rows`` (rows looked at), ``by_bounds`` (decisions taken from
            the bounds alone) and ``completed`` (rows completed with ``complete(j, None)``).

    Guarantee (docs/speculative.md, "certified target"): the emitted tokens have exactly the law of
    :func:`exact_acceptance` on the complete rows, i.e. the target's (``ensemble_weight`` is not supported). Each
    decision (accept, residual draw, bonus draw) is taken from the bounds only when the bounds prove
    what the complete row would decide with the same random numbers; otherwise the row is completed.
    Arithmetic: fp32, as stock's; the interval is widened by a slack that covers its rounding.
    """
    L = check_shapes(draft_ids, draft_logits, target_logits)
    if known.shape != target_logits.shape or (torch.is_tensor(upper) and upper.shape != target_logits.shape):
        raise ValueError("known and upper must have the target logits' shape [L+1, V]")
    dev = target_logits.device
    ids = draft_ids.to(device=dev, dtype=torch.long)
    c = counts if counts is not None else {}
    for key in ("rows", "by_bounds", "completed"):
        c.setdefault(key, 0)
    u = torch.rand(L, generator=generator, device=dev, dtype=torch.float32).tolist()
    V = target_logits.shape[1]
    zqx = draft_logits.float().gather(1, ids[:, None]).squeeze(1).tolist() if L else []

    def row_of(j: int) -> _BoundedRow:
        return _bounded_row(j, target_logits, known, upper, complete)

    n, row, lse_q = _accepted_prefix(ids, draft_logits, u, zqx, row_of, c)
    if n < L:
        tok = _bounded_residual(row, draft_logits[n].float(), lse_q, V, generator, c)
    else:
        c["rows"] += 1
        tok = _bounded_bonus(row_of(L), V, generator, c)
    return emitted(ids, n, tok, dev)


def _bounded_residual(row: _BoundedRow, zq: torch.Tensor, lq: float, V: int, generator, c: dict) -> int:
    """Winner of the Gumbel race over log max(0, p - q) + G (the residual's law, Lemma 1), from bounds
    where they prove the winner for every log Z in [lo, hi], else from the completed row (same noise)."""
    support = torch.isfinite(zq).nonzero(as_tuple=True)[0]
    if support.numel() > V // 8:
        row.complete()
        c["completed"] += 1
    else:
        row.fetch(support)
    q = torch.exp(zq - lq)  # 0 off the draft's support
    G = gumbel_noise(V, zq.device, generator)
    if row.full is None:
        z, up = row.dense()
        s_lo = torch.log((torch.exp(z - row.hi) - q).clamp_min_(0.0)) + G  # smallest weights (largest Z)
        s_hi = torch.log((torch.exp(z - row.lo) - q).clamp_min_(0.0)) + G
        cand = int(s_lo.argmax())
        best = float(s_lo[cand])
        s_hi[cand] = -math.inf
        rival = max(float(s_hi.max()), float((up - row.lo + G).max()))
        if math.isfinite(best) and best > rival + 2 * _BOUND_SLACK:
            c["by_bounds"] += 1
            return cand
        row.complete()
        c["completed"] += 1
    s = torch.log((torch.exp(row.full - row.lo) - q).clamp_min_(0.0)) + G
    tok = int(s.argmax())
    if not math.isfinite(float(s[tok])):
        # the residual vanished numerically (p == q to float precision): the law is p (see exact_acceptance)
        return int(sample_from_logits(row.full, generator))
    return tok


def _bounded_bonus(row: _BoundedRow, V: int, generator, c: dict) -> int:
    """Gumbel-max draw from p = softmax(row): from the exact entries when their best perturbed score beats
    every bounded one's perturbed upper bound (strictly), else from the completed row (same noise)."""
    G = gumbel_noise(V, row._z.device, generator)
    if row.full is None:
        z, up = row.dense()
        s = z + G
        cand = int(s.argmax())
        best = float(s[cand])
        if math.isfinite(best) and best > float((up + G).max()) + _BOUND_SLACK:
            c["by_bounds"] += 1
            return cand
        row.complete()
        c["completed"] += 1
    s = row.full + G
    cand = int(s.argmax())
    if not math.isfinite(float(s[cand])):
        raise DraftProbabilityError("a row of target logits cannot be normalized (all -inf, +inf or NaN)")
    return cand
