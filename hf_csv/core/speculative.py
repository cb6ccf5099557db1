"""Verify step of speculative sampling: an exact fast path and the (lossy) sigmoid approximation.

Plain torch, no ``transformers`` and no ``hf_csv`` import. The transformers-facing adapter with the
stock ``_speculative_sampling`` signature lives in :mod:`hf_csv.transformers.acceptance`.

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

from hf_csv_kernels.dispatch import backend_for, get_op

__all__ = [
    "VerifyResult",
    "DraftProbabilityError",
    "exact_verify",
    "bounded_verify",
    "gumbel_noise",
    "gumbel_shift",
    "row_max_finite",
    "KeyedGumbel",
    "gumbel_coupled_verify",
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
    """Emitted (once per process by the kernel, once per scope by :mod:`hf_csv.transformers.acceptance`) when the
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


# log-space slack of the bounded decisions: above the fp32 rounding of the interval's logsumexps (a few ulps of
# values of magnitude <= ~100), far below any difference that changes a probability at fp32 resolution
_BOUND_SLACK = 1e-5


def gumbel_noise(shape, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """i.i.d. standard Gumbel variates -log(-log u), u ~ U(0, 1) (torch.rand: ~10x cheaper per element than
    exponential_ on CPU), clamped away from 0 and 1 so G is finite; the change in probability is < 1e-38 per
    token. Shared by the certified head's lazy Gumbel draw and the bounded verify."""
    u = torch.rand(shape, device=device, generator=generator)
    return u.clamp_(min=torch.finfo(torch.float32).tiny, max=1 - 2 ** -24).log_().neg_().log_().neg_()


# |reference| from which a Gumbel-max draw subtracts it first: fl(y + G) resolves the noise to ulp(y), 7.6e-6 at 64;
# at |y| >= 2^24 it absorbs the noise altogether (fl(y + G) = y) and the draw would be the first maximum
GUMBEL_SHIFT_FROM = 64.0


def gumbel_shift(ref: torch.Tensor) -> torch.Tensor:
    """The per-row constant m a Gumbel-max draw subtracts before adding the noise: argmax fl(fl(y_i - m) + G_i).
    In exact arithmetic any m leaves the law softmax(y) unchanged; in fp32 it keeps the noise resolved when the
    values are large (|y - m| is small for every token with any probability: Sterbenz, y within 2x of m). ``ref``
    [N]: the row's reference value (its largest finite value, or a certified lower value); m = ref where |ref| >=
    GUMBEL_SHIFT_FROM, else 0 (rows of ordinary magnitude draw exactly as without a shift)."""
    ref = ref.float()
    big = torch.isfinite(ref) & (ref.abs() >= GUMBEL_SHIFT_FROM)
    return torch.where(big, ref, torch.zeros_like(ref))


def row_max_finite(x: torch.Tensor) -> torch.Tensor:
    """[N]: the largest finite value of each row of ``x`` [N, V] (-inf where there is none)."""
    return torch.where(torch.isfinite(x), x.float(), torch.full_like(x, float("-inf"), dtype=torch.float32)).amax(-1)


_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's output function: a bijective 64-bit mixer (distinct keys give unrelated generator seeds)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class KeyedGumbel:
    """Gumbel noise that is a fixed function of (seed, key): the noise g_t of token index t, shared by every
    party that draws the token at index t — the draft, the target's head, the verify (Gumbel-coupled
    verification, docs/speculative.md).

    ``rows(keys, V)`` returns [len(keys), V] i.i.d. standard Gumbel variates (:func:`gumbel_noise` from a CPU
    ``torch.Generator`` seeded with a SplitMix64 mix of (seed, key)); the same key always gives the same row, and
    different keys give rows from unrelated generator seeds (treated as independent, as any PRNG stream is).
    The last ``cache`` rows are kept, so the draft's row for index t is reused by the target's verify of t.
    Per call: one instance belongs to one ``generate`` call (its seed is drawn from torch's global generator).
    """

    def __init__(self, seed: int, cache: int = 48) -> None:
        self.seed = int(seed) & _M64
        self.cache = int(cache)
        self._rows: dict = {}
        self.generated = 0

    def row(self, key: int, V: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The noise row [V] (fp32) of token index ``key``."""
        k = (int(key), int(V))
        got = self._rows.pop(k, None)
        if got is None:
            gen = torch.Generator().manual_seed(_splitmix64(self.seed ^ _splitmix64(int(key) & _M64)) >> 1)
            got = gumbel_noise((int(V),), torch.device("cpu"), gen)
            self.generated += 1
        self._rows[k] = got  # most recent last
        while len(self._rows) > self.cache:
            self._rows.pop(next(iter(self._rows)))
        return got.to(device)

    def rows(self, keys, V: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[len(keys), V] noise rows of the token indices ``keys``."""
        return torch.stack([self.row(k, V, device) for k in keys])


def gumbel_coupled_verify(draft_ids: torch.Tensor, target_logits: torch.Tensor, noise: torch.Tensor) -> VerifyResult:
    """Gumbel-coupled verification (docs/speculative.md): the target's token at verified position j is
    y_j = argmax_i target_logits[j, i] + noise[j, i]; drafts are accepted while x_j == y_j, and the first y_j that
    differs (or y_L after L accepted drafts) is emitted.

    Law: whatever the draft did, the emitted token at each position is the Gumbel-max draw from
    softmax(target_logits[j]) with that position's noise, so the output has the target's law when the noise of a
    token index is independent of everything that decided the tokens before it (:class:`KeyedGumbel`). A row that
    is one-hot (one finite entry, as hf_csv's certified draw returns it) yields its finite entry. Ties in the
    argmax go to the lowest index (measure zero). Shapes: draft_ids [L], target_logits and noise [L + 1, V].
    """
    L = int(draft_ids.shape[0])
    if target_logits.dim() != 2 or target_logits.shape[0] != L + 1 or noise.shape != target_logits.shape:
        raise ValueError(f"target_logits and noise must be [L + 1, V] with L = {L}; got "
                         f"{tuple(target_logits.shape)} and {tuple(noise.shape)}")
    ids = draft_ids.tolist()
    for j in range(L + 1):
        row = target_logits[j].float()
        m = gumbel_shift(row_max_finite(row[None]))[0]
        y = int(((row - m) + noise[j].to(row.device)).argmax())
        if not bool(torch.isfinite(row[y])):
            raise ValueError(f"verified row {j} has no finite logit: nothing to sample")
        if j == L or y != ids[j]:
            toks = torch.tensor(ids[:j] + [y], dtype=torch.long, device=draft_ids.device)
            return VerifyResult(j, toks)
    raise AssertionError("unreachable")  # pragma: no cover


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


@torch.no_grad()
def bounded_verify(
    draft_ids: torch.Tensor,
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    known: torch.Tensor,
    upper,
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
        upper: [L+1, V] upper bounds on the processed target scores where not ``known``, or a function
            ``upper(j)`` returning row j's (rows are then built only when the verify reaches them).
        complete: ``complete(j, tokens)`` returns the exact processed scores of row j at ``tokens``
            (a long tensor), or the whole row when ``tokens`` is None.
        counts: optional dict accumulating ``rows`` (rows looked at), ``by_bounds`` (decisions taken from
            the bounds alone) and ``completed`` (rows completed with ``complete(j, None)``).

    Guarantee (docs/speculative.md, "certified target"): the emitted tokens have exactly the law of
    :func:`exact_verify` on the complete rows, i.e. the target's (``ensemble_weight`` is not supported). Each
    decision (accept, residual draw, bonus draw) is taken from the bounds only when the bounds prove
    what the complete row would decide with the same random numbers; otherwise the row is completed.
    Arithmetic: fp32, as stock's; the interval is widened by a slack that covers its rounding.
    """
    L = _check_shapes(draft_ids, draft_logits, target_logits)
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
    lse_q: dict[int, float] = {}

    def make_row(j: int) -> _BoundedRow:
        # built when the verify reaches row j: rows after the first rejection are never touched
        up = upper[j] if torch.is_tensor(upper) else upper(j)
        kn = known[j]
        if bool(torch.isnan(up.masked_fill(kn, 0.0)).any()):
            raise ValueError("upper bounds must not be NaN")
        a = float(torch.logsumexp(target_logits[j].float().masked_fill(~kn, float("-inf")), 0))
        b = float(torch.logsumexp(up.float().masked_fill(kn, float("-inf")), 0))
        return _BoundedRow(j, target_logits[j], kn, up, a, b, complete)

    rows: dict[int, _BoundedRow] = {}
    n = L
    for j in range(L):
        lse_q[j] = float(torch.logsumexp(draft_logits[j].float(), 0))
        if not math.isfinite(zqx[j]) or not math.isfinite(lse_q[j]):
            raise DraftProbabilityError(
                "a drafted token has draft probability 0 (logit -inf or NaN), or a draft row cannot be "
                "normalized: the draft logits are not the distribution the token was sampled from")
        row = rows[j] = make_row(j)
        x = int(ids[j])
        c["rows"] += 1
        log_u = math.log(u[j]) if u[j] > 0 else -math.inf
        base = row.value(x) - (zqx[j] - lse_q[j])
        if log_u < base - row.hi - _BOUND_SLACK:
            c["by_bounds"] += 1
            continue  # accepted for every log Z in [lo, hi]
        if not log_u < base - row.lo + _BOUND_SLACK:
            c["by_bounds"] += 1
            n = j  # rejected for every log Z in [lo, hi]
            break
        row.complete()
        c["completed"] += 1
        if not _accept(u[j], (row.value(x) - row.lo) - (zqx[j] - lse_q[j]), None):
            n = j
            break
    if n < L:
        tok = _bounded_residual(rows[n], draft_logits[n].float(), lse_q[n], V, generator, c)
    else:
        c["rows"] += 1
        tok = _bounded_bonus(make_row(L), V, generator, c)
    out = torch.empty(n + 1, dtype=torch.long, device=dev)
    out[:n] = ids[:n]
    out[n] = tok
    return VerifyResult(n, out)


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
        # the residual vanished numerically (p == q to float precision): the law is p (see exact_verify)
        return int(_sample_from_logits(row.full, generator))
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
    (``warn=False`` for callers that warn themselves, e.g. :mod:`hf_csv.transformers.acceptance` once per scope).
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
