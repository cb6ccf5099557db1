"""The per-row checks that stand between the certified head and the token (core: no transformers import).

Each function decides, from the head's result on one position and the processed scores, whether a row's outcome is
provably stock's; the caller (``hf_csv.transformers.processors``, the transformers adapter) recomputes the rows it is not sure of
with stock's head. Every function here is proof-carrying and names its section of docs/certificates.md. They take
tensors and, where the step's logits processors must be applied, a callable ``before(x)`` that runs them; they read
no session and no transformers object, so a second engine can call them.

Limits: float32 processed scores (the adapter casts), CPU or CUDA tensors; the rounding arguments are those of fp32
accumulators rounded to the model dtype (docs/certificates.md §2.0).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from hf_csv.core.speculative import gumbel_shift, row_max_finite

from hf_csv.core.certificate.rounding import _f32_down, _f32_up

__all__ = ["topk_unsure", "set_unsure", "gumbel_unsure", "epsilon_bound", "min_p_unsure", "timestamp_decision",
           "nucleus_sigma", "nucleus_decide", "round_charge", "normalizer_terms", "logprob_box",
           "avg_logprob_interval", "winner_only", "raise_by_dtype"]

U32 = 2.0 ** -24  # float32 unit roundoff


def raise_by_dtype(up: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """An upper bound on stock's logit in ``out_dtype`` from one on its fp32 accumulator (docs/certificates.md
    §2.0: stock's logit is the accumulator rounded to the model dtype, within one of its ulps)."""
    if out_dtype != torch.float32:
        up = up + up.abs() * torch.finfo(out_dtype).eps
    return up


def topk_unsure(scores: torch.Tensor, ob: torch.Tensor, k: int) -> torch.Tensor:
    """Rows whose processed top-``k`` might hold a token the head did not compute (docs/certificates.md §3.2): the
    k-th largest processed score must be strictly above ``ob``, the bound on every uncomputed token's processed
    score (strict: argmax breaks ties toward the lowest index, which may be an uncomputed token)."""
    kth = scores.amax(1).float() if k == 1 else scores.float().topk(k, dim=1).values[:, -1]
    return ~(kth > ob)


def set_unsure(scores: torch.Tensor, f_lo: torch.Tensor, f_hi: torch.Tensor, k: int, ob: torch.Tensor,
               slack: torch.Tensor) -> torch.Tensor:
    """Rows whose processed top-``k`` set could differ from stock's (docs/certificates.md §2.0): each token's
    processed score lies in [f_lo, f_hi]; the set T of our top k is stock's when min over T of f_lo exceeds every
    other token's f_hi and the bound ``ob`` outside S. Rows with zero ``slack`` hold stock's values exactly."""
    top = scores.float().topk(k, dim=1).indices
    inside = f_lo.gather(1, top).amin(1)
    others = f_hi.scatter(1, top, float("-inf")).amax(1)
    return ~((inside > others) & (inside > ob)) & (slack > 0)


def gumbel_unsure(scores: torch.Tensor, g: torch.Tensor, cut: torch.Tensor, shift: Optional[torch.Tensor],
                  slack: Optional[torch.Tensor] = None,
                  interval: Optional[Callable[[], tuple[torch.Tensor, torch.Tensor]]] = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unsure [B], winner [B], shift [B, 1]) of the Gumbel-max draw over the processed ``scores`` with the noise
    ``g`` (docs/certificates.md §2.3): exact where the winner reaches the head's ``cut`` (every uncomputed token's
    processed score plus its noise is below it: lowering processors only lower) and, where the values carry
    ``slack``, wins for every processed score in ``interval()`` = (f_lo, f_hi) too (§2.0). ``shift``: the one the
    head fixed with the cut (its units); a row without a finite cut (a full row) uses its own max."""
    m = gumbel_shift(row_max_finite(scores))
    if shift is not None:
        m = torch.where(torch.isfinite(cut), shift, m)
    m = m[:, None]
    val = (scores.float() - m) + g
    win = val.max(1)
    bad = ~(win.values >= cut) | ~torch.isfinite(win.values)
    tok = win.indices
    if slack is not None and interval is not None and bool((slack > 0).any()):
        f_lo, f_hi = interval()
        mine = ((f_lo - m).gather(1, tok[:, None]) + g.gather(1, tok[:, None]))[:, 0]
        rest = ((f_hi - m) + g).scatter(1, tok[:, None], float("-inf")).amax(1)
        bad |= ~((mine > rest) & (mine >= cut)) & (slack > 0)
    return bad, tok, m


def epsilon_bound(raw: torch.Tensor, complete: torch.Tensor, beam_epsilon: float) -> torch.Tensor:
    """Approximate beam search (``mode="epsilon"``, docs/certificates.md §2.2): a bound in log-prob space on the
    tokens outside S, max log-prob in S + ln(ε/2); −inf on complete rows."""
    r = raw.float()
    ob = r.amax(1) - torch.logsumexp(r, 1) + math.log(beam_epsilon / 2)
    return torch.where(complete, torch.full_like(ob, float("-inf")), ob)


# Relative slack of the min-p decision in float arithmetic (docs/certificates.md §3.3): the warper compares
# fl(fl(exp(fl(x_i − m)))·r) with fl(min_p·r), r = fl(1/Z); the rounding moves x_i − m by at most
# ~8u + u·|x_i − m| in log space (exp within 1 ulp). 1e-5 is a 20-fold margin over that, which also
# covers an exp accurate to ~100 ulps.
MIN_P_SLACK = 1e-5


def min_p_unsure(x: torch.Tensor, ob: torch.Tensor, min_p: float) -> torch.Tensor:
    """Rows where the min-p warper's decision on this vector might differ from its decision on stock's
    (docs/certificates.md §3.3).

    Sure when (a) every uncomputed token's final score (<= ``ob``) is clearly below m + ln(min_p), so stock
    removes it, as it is removed here (-inf, or a post-map value <= ob); and (b) every finite computed score
    is clear of the threshold, so both vectors give it the same decision (the normalizer cancels).
    m is the row max here, which is stock's max since every uncomputed score is below m.
    """
    lm = math.log(min_p)
    m = x.amax(1)
    gap_out = (m + lm) - ob
    out_ok = (ob == float("-inf")) | (gap_out > MIN_P_SLACK * (1 + (m - ob).abs()))
    fin = torch.isfinite(x)
    dist = (x - m[:, None] - lm).abs()
    near = fin & ~(dist > MIN_P_SLACK * (1 + (x - m[:, None]).abs()))
    return ~out_ok | near.any(1) | ~torch.isfinite(m)


# Slack of the timestamp decision (docs/certificates.md §3.4): stock compares fl(logsumexp(fl(log_softmax(x))[ts]))
# with fl(max(fl(log_softmax(x))[text])) under its normalizer, this vector under another; each side is within a few
# ulps of its magnitude plus the logsumexp's summation error over <= ~1,500 terms (γ_1500 < 1e-4) of the exact
# difference. 1e-3 + 1e-5·magnitude is a ten-fold margin over that.
TS_SLACK_ABS, TS_SLACK_REL = 1e-3, 1e-5


def timestamp_decision(xm: torch.Tensor, tb: int, ob: torch.Tensor, alive: torch.Tensor,
                       from_logprob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(ok [B], ts_won [B]) for Whisper's timestamp processor run next on this vector (docs/certificates.md §3.4).

    ``xm``: the scores (float64) with the processor's rule masks applied; ``tb``: its timestamp_begin; ``alive``:
    rows where an uncomputed token survives the masks; ``from_logprob``: the processor also masks all text when
    logsumexp(timestamps) > max(text) in log-probabilities (the normalizer cancels). A row is sure (``ok``) when
    * no uncomputed token survives the masks: both vectors are then equal after them; or
    * the text max here is above ``ob`` (so it is stock's) and clear of the timestamp logsumexp by the slack:
      the same decision, and the same argmax after it (uncomputed tokens <= ob < that max); or
    * the timestamp logsumexp (exact: the block is always computed) clears max(text max, ob): both mask the
      text and keep equal timestamp blocks.
    ``ts_won``: rows whose text stock's logsumexp rule masks (certified)."""
    ob = ob.double()
    if not from_logprob:  # rules only: a lowering processor
        ok = ~alive | (xm.amax(1) > ob)
        return ok, torch.zeros_like(ok)
    a = xm[:, :tb].amax(1)
    t = torch.logsumexp(xm[:, tb:], 1)
    mag = torch.where(torch.isfinite(a), a.abs(), 0) + torch.where(torch.isfinite(t), t.abs(), 0)
    slack = TS_SLACK_ABS + TS_SLACK_REL * mag
    clear = (t - a).abs() > slack
    ts_won = (t - torch.maximum(a, ob)) > slack
    ok = ~alive | ((a > ob) & clear) | ts_won
    return ok, ts_won | ((a > ob) & clear & (t > a))


def nucleus_sigma(V: int) -> float:
    """Relative slack of the top-p decision (docs/certificates.md §3.5): stock's float cumulative probability
    C'_j = fl(cumsum(fl(softmax(sorted x))))_j is within a factor 1 ± (γ_{V−1} + γ_{j−1} + 6u) of the exact C_j
    in any summation order (exp within 1 ulp); 3·V·u + 1e-3 is a margin of more than 1.4 over that."""
    return 3.0 * V * 2.0 ** -24 + 1e-3


def nucleus_decide(scores: torch.Tensor, S: torch.Tensor, up: torch.Tensor, top_p: float):
    """(remove [B, V], unsure [B]) for the top-p warper on stock's vector, from this vector (exact on S, -inf
    elsewhere) and ``up`` (>= stock's final score of every token outside S) (docs/certificates.md §3.5).

    Stock removes token i iff C_i = mass of the tokens sorted at or below it <= 1 − top_p. With Z_S the exact mass
    on S and R >= the mass outside S (both relative to the row's max on S), for i in S:
    C_i >= (Σ_{j∈S, x_j<x_i} + e_i) / (Z_S + R) and C_i <= (Σ_{j∈S, x_j<=x_i} + R) / Z_S (ties in any order); every
    token outside S has C <= (R + Σ_{j∈S, x_j<=ob}) / Z_S, ob = its largest bound. A row is sure when every
    decision clears 1 − top_p by the relative slack σ."""
    B, V = scores.shape
    thr = 1.0 - top_p
    sig = nucleus_sigma(V)
    x = scores.double()
    remove = torch.zeros(B, V, dtype=torch.bool, device=scores.device)
    bad = torch.zeros(B, dtype=torch.bool, device=scores.device)
    for b in range(B):  # rows are few; each works on its (small) computed set only
        fin = torch.isfinite(x[b])
        idx = fin.nonzero(as_tuple=True)[0]
        if idx.numel() == 0:
            bad[b] = True
            continue
        v = x[b, idx]
        m = v.max()
        e = torch.exp(v - m)
        zs = e.sum()
        unc = ~S[b]
        ub = up[b].double()[unc]
        R = torch.exp(ub - m).sum() if ub.numel() else torch.zeros((), dtype=torch.float64)
        if not bool(torch.isfinite(R)):
            bad[b] = True
            continue
        sv, order = torch.sort(v)
        cum = torch.cat([torch.zeros(1, dtype=torch.float64, device=v.device), torch.cumsum(e[order], 0)])
        lt = cum[torch.searchsorted(sv, v, right=False)]
        le = cum[torch.searchsorted(sv, v, right=True)]
        lo = (lt + e) / (zs + R)
        hi = (le + R) / zs
        rm = hi < thr * (1 - sig)
        keep = lo > thr * (1 + sig)
        ok = bool((rm | keep).all())
        if ub.numel():
            ob = ub.max()
            below = cum[torch.searchsorted(sv, ob.reshape(1), right=True)][0]
            ok &= bool((R + below) / zs < thr * (1 - sig))
        if ok:
            remove[b, idx[rm]] = True
        else:
            bad[b] = True
    return remove, bad


def round_charge(t: torch.Tensor, d: torch.Tensor, z_hi: torch.Tensor) -> torch.Tensor:
    """Per row, a bound (in units of the row's max term) on the rounding error of stock's float32 sum of the terms
    exp(x_k − max) whose upper bounds are ``t`` (``d``: lower bounds on max − x_k), in *any* summation order
    (docs/certificates.md §3.6). Each addition errs by at most min(u·Z, its smaller operand), which charges a term
    t >= τ = u·Z at most 3τ and a smaller one t·(3 + log2(τ/t)); exp within 1 ulp and the rounded subtraction
    x_k − max add u·(2t + max_{d' >= d} d'·e^{−d'})."""
    tau = (U32 * z_hi)[:, None]
    small = t < tau
    ratio = torch.where(small, tau / t.clamp(min=1e-300), torch.ones_like(t))
    c = torch.where(small, t * (3.0 + torch.log2(ratio)), 3.0 * tau.expand_as(t))
    g = torch.where(d >= 1.0, d * torch.exp(-d), torch.full_like(d, math.exp(-1.0)))
    c = c + U32 * (2.0 * t + g)
    return torch.where(t > 0, c, torch.zeros_like(c)).sum(1)


def normalizer_terms(x: torch.Tensor, up: torch.Tensor, outside: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m, Z_S, Z_hi, C) per row, float64, for stock's float32 normalizer Z = Σ_V e^{x_i − m} of a row whose
    values ``x`` are stock's where finite and whose tokens in ``outside`` are bounded by ``up``
    (docs/certificates.md §3.6 and §3.10): Z_S = Σ_finite e^{x_i − m} <= Z <= Z_hi = Z_S + Σ_outside e^{up_i − m},
    and C bounds the float32 summation error of Z in any order (64u·Z_hi covers the final log and the
    subtraction). The one normalizer interval of beam search (:func:`logprob_box`) and of Whisper's
    avg-logprob record (hf_csv.transformers.processors)."""
    neg = torch.full_like(x, float("-inf"))
    fin = torch.isfinite(x)
    m = torch.where(fin, x, neg).amax(1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    t_s = torch.exp(torch.where(fin, x - m[:, None], neg))
    t_o = torch.where(outside, torch.exp((up - m[:, None]).clamp(max=700.0)), torch.zeros_like(up))
    zs = t_s.sum(1)
    z_hi = zs + t_o.sum(1)
    d_s = torch.where(fin, m[:, None] - x, torch.zeros_like(x))
    d_o = torch.where(outside, (m[:, None] - up).clamp(min=0.0), torch.zeros_like(up))
    C = round_charge(t_s, d_s, z_hi) + round_charge(t_o, d_o, z_hi) + 64 * U32 * z_hi
    return m, zs, z_hi, C


def confidence_unsure(scores: torch.Tensor, S: torch.Tensor, up: torch.Tensor, threshold: float,
                      lo: Optional[torch.Tensor] = None, hi: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows on which stock's confidence stop (transformers' ``ConfidenceCriteria``: ``softmax(scores)[t] <
    threshold`` at the drafted token t, a greedy draft's argmax) may decide otherwise than on this row
    (docs/certificates.md §3.11).

    ``scores``: float32 rows, −inf outside S; S holds each row's max, whose token is stock's argmax (the top-1
    certificate and the check before this one). ``lo``/``hi``: bounds on stock's value of each token of S, where
    the values carry a slack (the head's own values, §2.0); None: ``scores`` are stock's values. ``up``: float64
    upper bounds on stock's value of every token. With m = x_t, stock's normalizer Z = Σ_V e^{x_i − m} lies in
    [Z_lo, Z_up] (each term of S between its bounds' extremes, t's own exactly 1, every term <= 1 since t is the
    max, the others below e^{up_i − m}), and its float32 sum in any order errs by at most C (:func:`round_charge`
    on the terms' upper bounds, as :func:`normalizer_terms`). The numerator e^0 = 1 is exact; one reciprocal and
    one product round by u each. So stock's probability, and this row's (its own values lie within the same
    bounds, S alone), lie in [(1 − 4u)/(Z_up + C), (1 + 4u)/(Z_lo − C)]: a row whose interval lies on one side of
    the threshold gets stock's decision; every other row is unsure (its full row is then computed)."""
    x = scores.double()
    lo = x if lo is None else lo.double()
    hi = x if hi is None else hi.double()
    fin = torch.isfinite(x)
    zero = torch.zeros_like(x)
    t = torch.where(fin, x, torch.full_like(x, float("-inf"))).argmax(1, keepdim=True)
    lo_t, hi_t = lo.gather(1, t), hi.gather(1, t)
    others = fin.scatter(1, t, False)
    outside = ~S
    # each term e^{x_i − m} between its bounds (<= 1: m is the max); t's own term is 1
    t_lo = torch.where(others, torch.exp((lo - hi_t).clamp(max=0.0)), zero)
    t_up = torch.where(others, torch.exp((hi - lo_t).clamp(max=0.0)), zero)
    t_out = torch.where(outside, torch.exp((up - lo_t).clamp(max=0.0)), zero)
    z_lo = 1.0 + t_lo.sum(1)
    z_up = 1.0 + t_up.sum(1) + t_out.sum(1)
    # lower bounds on m − x_i (the charge's d), 0 for t itself
    d_s = torch.where(others, (lo_t - hi).clamp(min=0.0), zero)
    d_o = torch.where(outside, (lo_t - up).clamp(min=0.0), zero)
    one = torch.zeros_like(z_lo)[:, None] + 1.0
    C = (round_charge(torch.cat([t_up, one], 1), torch.cat([d_s, torch.zeros_like(one)], 1), z_up)
         + round_charge(t_out, d_o, z_up) + 64 * U32 * z_up)
    p_lo = (1 - 4 * U32) / (z_up + C)
    p_hi = (1 + 4 * U32) / (z_lo - C)
    usable = (z_lo - C > 0) & torch.isfinite(z_up) & torch.isfinite(lo_t[:, 0]) & torch.isfinite(hi_t[:, 0])
    return ~(usable & ((p_lo >= threshold) | (p_hi < threshold)))


def logprob_box(raw: torch.Tensor, S: torch.Tensor, up: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lo [N, V], hi [N, V], ob [N]) float32: an interval around stock's fl(log_softmax(fp32(logits))) of every
    token of S and a bound ``ob`` on every other token's (docs/certificates.md §3.10), before any processor.

    ``raw``: stock's logits on S (−inf elsewhere); ``up``: float64 upper bounds on stock's logit of every token
    (raised for the model dtype). The normalizer lies in [LSE_S, log(e^{LSE_S} + R)] with R = Σ_{i∉S} e^{up_i},
    and stock's float32 summation in any order errs by at most C (§3.6), so stock's log-prob of i ∈ S lies in
    [x_i − LSE_hi − log1p(ρ) − s_i, x_i − LSE_S − log1p(−ρ) + s_i], ρ = C/Z_S, s_i = 4u(|x_i| + |LSE_hi| + 1),
    rounded outward to float32; a token outside S has stock value <= bound − LSE_S − log1p(−ρ) + s. Rows whose
    normalizer interval is unusable (ρ >= ½) get (−inf, +inf) and ob = +inf: every decision on them fails."""
    up = up + up.abs() * 4 * U32  # (U + E was summed in float32)
    bound = torch.where(S, torch.full_like(up, float("-inf")), up).amax(1)  # every token outside S is below
    x = raw.double()
    neg = torch.full_like(x, float("-inf"))
    fin = torch.isfinite(x)
    m, zs, z_hi, C = normalizer_terms(x, up, ~S)
    rho = C / zs
    lse_s = m + torch.log(zs)
    lse_hi = m + torch.log(z_hi)
    ok = (rho < 0.5) & torch.isfinite(lse_hi) & (zs > 0)
    rho = torch.where(ok, rho, torch.zeros_like(rho))
    a = (lse_hi + torch.log1p(rho))[:, None]
    b = (lse_s + torch.log1p(-rho))[:, None]
    s = 4 * U32 * (x.abs() + lse_hi.abs()[:, None] + 1.0)
    lo64 = torch.where(fin, x - a - s, neg)
    hi64 = torch.where(fin, x - b + s, neg)
    ob = bound - b[:, 0] + 4 * U32 * (bound.abs() + lse_hi.abs() + 1.0)
    lo64 = torch.where(ok[:, None] & fin, lo64, torch.where(fin, torch.full_like(x, float("-inf")), neg))
    hi64 = torch.where(ok[:, None] & fin, hi64, torch.where(fin, torch.full_like(x, float("inf")), neg))
    ob = torch.where(ok, ob, torch.full_like(ob, float("inf")))
    return _f32_down(lo64), _f32_up(hi64), _f32_up(ob)


def avg_logprob_interval(rows: list, tokens: torch.Tensor, steps: list, index: int,
                         exact_lp: dict) -> tuple[float, float, list]:
    """[lo, hi] containing stock's avg_logprob of one sequence, and per step the interval width (docs/certificates.md
    §3.6: each step's normalizer lies between the kept row's own and that plus the recorded bound R on the mass
    outside S, stock's float32 summation erring by at most the recorded C).

    ``rows``: the kept score rows (this call's), ``steps``: hf_csv's per-step records, ``exact_lp``: step -> stock's
    own log-prob where known (replayed or exact steps). Widths are 0 on those."""
    n = len(rows)
    lo_sum = hi_sum = abs_sum = 0.0
    widths = []
    for t in range(n):
        tok = int(tokens[t])
        if t in exact_lp:
            v = float(exact_lp[t])
            lo_sum, hi_sum, abs_sum = lo_sum + v, hi_sum + v, abs_sum + abs(v)
            widths.append(0.0)
            continue
        st = steps[t]
        r = rows[t].double()
        x = float(r[tok])
        lse_s = float(torch.logsumexp(r, 0))  # the kept row's finite entries: stock's values on S
        lse_hi = float(torch.logaddexp(torch.tensor(lse_s, dtype=torch.float64), st["logR"][index]))
        rho = math.exp(min(0.0, float(st["logC"][index]) - lse_s))  # summation error, relative to Z >= Z_S
        if not (math.isfinite(x) and math.isfinite(lse_s)) or rho >= 0.5:
            lo, hi = -math.inf, math.inf
        else:
            slack = 4 * U32 * (abs(x) + abs(lse_hi) + 1.0)
            if rows[t].dtype != torch.float32:
                slack += (abs(x - lse_s) + abs(x - lse_hi) + 1.0) * torch.finfo(rows[t].dtype).eps
            lo = x - lse_hi - math.log1p(rho) - slack
            hi = x - lse_s - math.log1p(-rho) + slack
        lo_sum, hi_sum, abs_sum = lo_sum + lo, hi_sum + hi, abs_sum + max(abs(lo), abs(hi))
        widths.append(hi - lo)
    # stock adds n float32 values in order and divides by n: within n·u·Σ|v| and one more rounding
    sum_slack = (n + 2) * U32 * abs_sum
    lo, hi = (lo_sum - sum_slack) / n, (hi_sum + sum_slack) / n
    return lo - abs(lo) * 2 * U32, hi + abs(hi) * 2 * U32, widths


def winner_only(scores: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """The row stock's sampler can only draw ``tok`` from (docs/certificates.md §2.3: the certified draw handed to
    stock's sampler): the winner keeps its own score, every other token -inf (a row whose every score is -inf keeps
    stock's behaviour: all -inf)."""
    out = torch.full_like(scores, float("-inf"))
    r = torch.arange(scores.shape[0], device=scores.device)
    out[r, tok] = scores[r, tok]
    return out
