"""The top-k and threshold certificates (docs/certificates.md §2.1, §3.3): S = {U_i >= t}, with the cut t chosen from a
certified lower bound on stock's seed values so that every token outside S provably ranks below them; the values on S
and their slack come from :class:`~hf_csv.core.certificate.values.HeadValues`. A top-1 call whose values hf_csv may
keep (``own_values``) runs in the native one-row epilogue (:func:`hf_csv_kernels.native.top1`) where it is built."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from hf_csv_kernels.native import Top1Result
from hf_csv.core.certificate.result import CertResult, CertStats, StockFn, SubsetFn
from hf_csv.core.certificate.rounding import _cut, _down
from hf_csv.core.certificate.slack import _sparse_undecided
from hf_csv.core.certificate.values import HeadValues

__all__ = ["TopKCertificates"]


class TopKCertificates(HeadValues):
    """The top-k and threshold certificates of a head (called through :meth:`CertifiedHead.topk` and
    :meth:`CertifiedHead.threshold`, which check the arguments and the rows first). Reads, besides
    :class:`HeadValues`' attributes, the native epilogue's entry ``_top1`` and constants ``_top1_cst``."""

    _top1: Optional[Callable[..., Top1Result]]  # the dispatch op "top1" (hf_csv_kernels.native.top1), or None
    _top1_cst: Optional[torch.Tensor]

    def _topk(self, Hf: torch.Tensor, Hn: torch.Tensor, k: int, out_dtype: Optional[torch.dtype] = None,
              always: int = 0, with_upper: bool = False, k_min: Optional[int] = None,
              stock: Optional[StockFn] = None, subset: Optional[SubsetFn] = None,
              own_values: bool = False) -> CertResult:
        d = out_dtype or torch.float32
        N = Hf.shape[0]
        stats = CertStats(vocab_size=self.vocab_size)
        est, U, top = self._screen(Hf)
        if (own_values and k == 1 and top is not None and self._top1 is not None and not always
                and k_min is None and subset is None and d == self.weight.dtype and Hf.device.type == "cpu"):
            res = self._top1_native(Hf, est, U, top, stats)
            if res is not None:
                if with_upper:  # the same bounds as below: |stock − real| <= E
                    res.upper = U + self.stock_error(Hf)[:, None]
                return res
        if k == 1:  # the seed: est's top (found in the screen's own pass where it can)
            seeds = (top if top is not None else est.argmax(1)).view(N, 1)
        else:
            seeds = est.topk(k, dim=1).indices  # sorted: est's top first
        rows = torch.arange(N, device=Hf.device)
        if seeds.shape[1] > 1:
            rows = rows.repeat_interleave(seeds.shape[1])
        E = self.stock_error(Hf)
        lows = self._stock_lower(seeds.reshape(-1), rows, Hf, E).view(N, -1)
        t, bound = _cut(lows.amin(1), E, d)
        S = U >= t[:, None]
        if k_min is not None:
            # _dense's test: |S ∪ A| > budget + |A| for the always-block A, i.e. |S \ A| > budget
            over = S[:, :self.vocab_size - always].sum(1) > self.budget
            if bool(over.any()):  # those rows: the certificate of the first k_min seeds (a smaller S)
                t_min, bound_min = _cut(lows[:, :k_min].amin(1), E, d)
                t, bound = torch.where(over, t_min, t), torch.where(over, bound_min, bound)
                S = U >= t[:, None]
        if always:
            S[:, self.vocab_size - always:] = True
        logits, info = self._dense(S, Hf, Hn, d, stats, U, extra=always, stock=stock, subset=subset)
        bound = bound.masked_fill(info.complete, float("-inf"))
        slack = info.slack
        if k == 1 and bool((slack > 0).any()):
            # the argmax must not depend on where in its slack stock's value lies (docs/certificates.md §2.0)
            und = _sparse_undecided(info.rows, info.toks, info.vals, info.acc, info.ent, N, d) & (slack > 0)
            if bool(und.any()):
                self._to_stock(und, logits, S, bound, slack, Hf, Hn, d, stats, stock)
                keep = ~und[info.rows]
                info.rows, info.toks, info.vals, info.acc, info.ent = (info.rows[keep], info.toks[keep],
                                                                       info.vals[keep], info.acc[keep], info.ent[keep])
        upper = U + E[:, None] if with_upper else None  # |stock − real| <= E
        return CertResult(logits=logits, stats=stats, mask=S, est=est, bound=bound, upper=upper, slack=slack,
                          acc=(info.rows, info.toks, info.acc))

    def _top1_native(self, Hf: torch.Tensor, est: torch.Tensor, U: torch.Tensor, top: torch.Tensor,
                     stats: CertStats) -> Optional[CertResult]:
        """:meth:`_topk`'s result for k = 1 from the dispatch op ``top1`` (the native kernel's
        :func:`hf_csv_kernels.native.top1`, resolved when the head was built: per row the same seed, lower bound, cut,
        S, slack and argmax check, docs/certificates.md §2.1, §2.0); None where that call leaves the call to the torch
        path (a row with more candidates than the budget or the dense cut-off, an argmax the slack leaves open, a
        value that is not finite)."""
        got: Top1Result = self._top1(self.weight, Hf.contiguous(), U.contiguous(), top.contiguous(), self._abs_l1,
                         self._top1_cst, min(self.budget, self._dense_cutoff))
        if got.n < 0:
            return None
        N = Hf.shape[0]
        stats.rows += N
        stats.certified += N
        stats.native += N
        stats.subvocab_sum += got.n
        stats.subvocab_sizes.extend(got.counts.tolist())
        if stats.collect_radius:  # (a statistic: one host read of the rows' sums)
            stats.radius_sum += sum(r[3] for r in got.out.tolist())
        return CertResult(logits=got.logits, stats=stats, mask=got.mask, est=est, bound=got.out[:, 1],
                          slack=got.out[:, 2], acc=(got.rows, got.toks, got.acc))

    def _threshold(self, Hf: torch.Tensor, Hn: torch.Tensor, delta: float,
                   out_dtype: Optional[torch.dtype] = None, rel: float = 0.0) -> CertResult:
        d = out_dtype or torch.float32
        N = Hf.shape[0]
        stats = CertStats(vocab_size=self.vocab_size)
        est, U, _ = self._screen(Hf)
        seeds = est.argmax(1)
        lo = self._stock_lower(seeds, torch.arange(N, device=Hf.device), Hf)
        t, bound = _cut(_down(lo - delta - rel * lo.abs(), 3), self.stock_error(Hf), d)
        S = U >= t[:, None]
        logits, info = self._dense(S, Hf, Hn, d, stats, U)
        bound = bound.masked_fill(info.complete, float("-inf"))
        return CertResult(logits=logits, stats=stats, mask=S, est=est, bound=bound)
