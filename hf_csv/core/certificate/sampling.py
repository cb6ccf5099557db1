"""Exact sampling (docs/certificates.md §2.3): one draw per row from stock's law, with a top-k warp on the certified
top-k set, else by lazy Gumbel-max, each decided within the values' slack (§2.0) or on stock's whole row."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from hf_csv.core.certificate.result import CertResult, CertStats, StockFn, _acc_dense
from hf_csv.core.certificate.rounding import value_interval
from hf_csv.core.certificate.slack import _GUMBEL_FAR, _draw_undecided, _slack_too_wide
from hf_csv.core.certificate.topk import TopKCertificates
from hf_csv.core.speculative import gumbel_noise, gumbel_shift, row_max_finite

__all__ = ["SamplingCertificates", "sample_warps"]


def sample_warps(temperature: float, top_k: Optional[int], warps: Optional[Sequence[tuple[str, float]]]) -> list:
    """The checked warps of a :meth:`CertifiedHead.sample` call: ``warps`` as given, else transformers' order
    ``[("temperature", temperature), ("top_k", top_k)]`` (each where it acts). Raises ``ValueError`` for a
    temperature that is not positive and finite, an unknown warp, or more than one top-k warp."""
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be positive and finite, got {temperature}")
    if warps is None:
        warps = [("temperature", float(temperature))] if temperature != 1.0 else []
        if top_k is not None and top_k > 0:
            warps.append(("top_k", int(top_k)))
    warps = list(warps)
    for kind, v in warps:
        if kind == "temperature" and not (v > 0 and math.isfinite(v)):
            raise ValueError(f"temperature must be positive and finite, got {v}")
        if kind not in ("temperature", "top_k"):
            raise ValueError(f"unknown warp {kind!r}; use 'temperature' or 'top_k'")
    if sum(kind == "top_k" for kind, _ in warps) > 1:
        raise ValueError("at most one top_k warp is supported")
    return warps


class SamplingCertificates(TopKCertificates):
    """The exact-sampling certificate of a head (called through :meth:`CertifiedHead.sample`)."""

    def _law(self, x: torch.Tensor, d: torch.dtype, post, warps, stop_at_topk: bool = False,
             mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """fp32 values of d-representable logits ``x`` after post (in d) and the warps, as stock computes
        them; entries outside ``mask`` (uncomputed) are -inf from the start."""
        y = x.to(d)
        if post is not None:
            y = post(y)
        y = y.float()
        if mask is not None:
            y = y.masked_fill(~mask, float("-inf"))
        for kind, v in warps:
            if kind == "temperature":
                y = y / v
            elif stop_at_topk:
                break
            else:
                k = min(int(v), y.shape[-1])
                kth = y.topk(k, dim=-1).values[..., -1:]
                y = y.masked_fill(y < kth, float("-inf"))
        return y

    def _sample(self, Hf, Hn, warps, generator=None, out_dtype=None, post=None, noise=None,
                with_conf=False, stock: Optional[StockFn] = None) -> CertResult:
        """One draw per row (:meth:`CertifiedHead.sample`, whose arguments this takes checked): on the certified
        top-k set where a top-k warp cuts the vocabulary (:meth:`_sample_topk`), else by lazy Gumbel-max
        (:meth:`_sample_gumbel`). (Named ``_sample``: the full-call path of ``CertifiedHead._run_rows`` reads it.)"""
        d = out_dtype or torch.float32
        V = self.vocab_size
        ks = [int(v) for kind, v in warps if kind == "top_k" and int(v) < V]
        warps = [(kind, v) for kind, v in warps if kind != "top_k" or int(v) < V]  # top-k >= V keeps all
        if ks:
            return self._sample_topk(Hf, Hn, ks[0], warps, d, generator, post, noise, with_conf, stock)
        return self._sample_gumbel(Hf, Hn, warps, d, generator, post, noise, with_conf, stock)

    def _sample_topk(self, Hf, Hn, top_k: int, warps, d: torch.dtype, generator=None, post=None, noise=None,
                     with_conf=False, stock: Optional[StockFn] = None) -> CertResult:
        """The draw under a top-k warp (``top_k`` < V): the certified top-k set, checked so that no uncomputed token
        reaches the top-k and the top-k set and the Gumbel winner hold within the values' slack; other rows take
        stock's row (docs/certificates.md §2.3, §2.0)."""
        N, V = Hf.shape[0], self.vocab_size
        k = min(top_k, V)
        res = self._topk(Hf, Hn, top_k, d, stock=stock)
        S, bound = res.mask, res.bound
        before = self._law(res.logits, d, post, warps, stop_at_topk=True, mask=S)
        ob = self._law(bound[:, None], d, post, warps, stop_at_topk=True)[:, 0]
        kth = before.topk(k, dim=1).values[:, -1]
        bad = ~(ob < kth) & (bound > float("-inf"))  # an uncomputed token could reach the top-k
        reach = bad.clone()  # (fallbacks, not ties: not counted in near_ties)
        # the values' slack (§2.0): the top-k set T of our values must be stock's (min over T of the lower law
        # above every other token's upper one), and the Gumbel winner must win within the slack too
        lo, hi = value_interval(res.acc_dense(), res.slack, d)
        T = before.topk(k, dim=1).indices
        inside = self._law(lo, d, post, warps, stop_at_topk=True, mask=S).gather(1, T).amin(1)
        others = self._law(hi, d, post, warps, stop_at_topk=True, mask=S).scatter(1, T, float("-inf")).amax(1)
        bad |= ~(inside > others) & (res.slack > 0)
        g = noise if noise is not None else gumbel_noise(before.shape, Hf.device, generator)
        inT = torch.zeros_like(S).scatter_(1, T, True)
        law_lo = self._law(lo, d, post, warps, mask=inT)
        law_hi = self._law(hi, d, post, warps, mask=inT)
        # the draw subtracts m (our row's largest value) before the noise; stock's values must lie close to it
        # for the noise to resolve on the full-head path too, so a row whose slack is that wide takes stock's row
        # now (decided from the values alone, before the noise is read)
        bad |= _slack_too_wide(law_lo, law_hi, inT, res.slack)
        if bool(bad.any()):
            self._to_stock(bad, res.logits, S, res.bound, res.slack, Hf, Hn, d, res.stats, stock)
            res.stats.near_ties -= int(reach.sum())
        law = self._law(res.logits, d, post, warps, mask=S)
        m = gumbel_shift(row_max_finite(law))[:, None]  # fixed before the draw, the same on every path below
        res.tokens = ((law - m) + g).argmax(1)
        und = _draw_undecided(res.tokens, g, law_lo - m, law_hi - m) & (res.slack > 0)
        if bool(und.any()):
            self._to_stock(und, res.logits, S, res.bound, res.slack, Hf, Hn, d, res.stats, stock)
            law = self._law(res.logits, d, post, warps, mask=S)
            res.tokens = ((law - m) + g).argmax(1)
        res.shift = m[:, 0]
        if with_conf:
            r = torch.arange(N, device=Hf.device)
            res.conf = torch.softmax(law, 1)[r, res.tokens]
        return res

    def _sample_gumbel(self, Hf, Hn, warps, d: torch.dtype, generator=None, post=None, noise=None,
                       with_conf=False, stock: Optional[StockFn] = None) -> CertResult:
        """The draw without a top-k warp: lazy Gumbel-max on S = the tokens whose upper law plus noise reaches the
        seed's lower law plus noise, decided within the values' slack, else on stock's row (docs/certificates.md
        §2.3, §2.0)."""
        N, V = Hf.shape[0], self.vocab_size
        stats = CertStats(vocab_size=V)
        est, U, _ = self._screen(Hf)
        g = noise if noise is not None else gumbel_noise(U.shape, Hf.device, generator)
        heur = est
        for kind, v in warps:
            heur = heur / v
        seeds = (heur + g).argmax(1)
        rows = torch.arange(N, device=Hf.device)
        lo = self._stock_lower(seeds, rows, Hf)
        lo_law = self._law(lo[:, None], d, post, warps)[:, 0]
        # every comparison below is in units shifted by m (fixed here, before S): fl(· - m) is non-decreasing, so
        # Theorem 4's chain holds for argmax fl(fl(y_i - m) + G_i) (docs/certificates.md §2.3)
        m = gumbel_shift(lo_law)
        t = (lo_law - m) + g[rows, seeds]
        upper = self._law(U + self.stock_error(Hf)[:, None], d, post, warps)
        S = ((upper - m[:, None]) + g) >= t[:, None]
        logits, info = self._dense(S, Hf, Hn, d, stats, U, stock=stock)
        law = self._law(logits, d, post, warps, mask=S)
        slack = info.slack
        lo = hi = None
        if bool((slack > 0).any()):
            lo, hi = value_interval(_acc_dense(logits, info.rows, info.toks, info.acc), slack, d)
            lo, hi = self._law(lo, d, post, warps, mask=S), self._law(hi, d, post, warps, mask=S)
        # the noise must resolve at the top of the row, on our values and on stock's: where the seed's lower value
        # (m) lies far below the row's largest value (a wide bound), or the values' slack is that wide, the row takes
        # stock's values and, complete, its own largest value. Decided from the values alone, before the noise is
        # read, so each branch is an exact Gumbel-max draw.
        top = row_max_finite(law)
        far = torch.isfinite(top) & ((top - m).abs() >= _GUMBEL_FAR) & ~info.complete
        if lo is not None:
            far |= _slack_too_wide(lo, hi, S, slack) & ~info.complete
        if bool(far.any()):
            self._to_stock(far, logits, S, None, slack, Hf, Hn, d, stats, stock)
            stats.near_ties -= int(far.sum())  # (a wide bound, not a tie)
            info.complete = info.complete | far
            law = self._law(logits, d, post, warps, mask=S)
        # a complete row (the full head, or S = V) has no cut to stay consistent with: its own largest value
        m = torch.where(info.complete, gumbel_shift(row_max_finite(law)), m)
        t = torch.where(info.complete, torch.full_like(t, float("-inf")), t)
        tokens = ((law - m[:, None]) + g).argmax(1)
        if lo is not None and bool((slack > 0).any()):
            # the winner must win for every value of stock's within the slack (§2.0), and reach the cut; an undecided
            # row draws on stock's row with the same m and the same noise (the same function of the noise)
            law_lo = lo - m[:, None]
            und = _draw_undecided(tokens, g, law_lo, hi - m[:, None])
            und |= ~((law_lo.gather(1, tokens[:, None])[:, 0] + g[rows, tokens]) >= t)
            und &= slack > 0
            if bool(und.any()):
                self._to_stock(und, logits, S, None, slack, Hf, Hn, d, stats, stock)
                info.complete = info.complete | und
                law = self._law(logits, d, post, warps, mask=S)
                tokens = ((law - m[:, None]) + g).argmax(1)
        cut = t.masked_fill(info.complete, float("-inf"))
        conf = None
        if with_conf:
            est_law = torch.where(S, law, heur)
            conf = (law[rows, tokens] - torch.logsumexp(est_law, 1)).exp()
        keep = ~info.complete[info.rows]
        return CertResult(logits=logits, stats=stats, tokens=tokens, mask=S,
                          bound=torch.full((N,), float("-inf"), device=Hf.device), noise=g, cut=cut, conf=conf, shift=m,
                          slack=slack, acc=(info.rows[keep], info.toks[keep], info.acc[keep]))
