"""The ε-softmax certificate (docs/certificates.md §2.2): S from a histogram of the upper bounds' softmax weights so
that the mass outside S, bounded from U, is at most ε; with ``upper`` it serves the verify of exact speculative
sampling (:meth:`CertifiedHead.spec`)."""
from __future__ import annotations

import torch

from hf_csv.core.certificate.result import CertResult, CertStats
from hf_csv.core.certificate.values import HeadValues

__all__ = ["EpsilonCertificates"]


class EpsilonCertificates(HeadValues):
    """The ε-softmax certificate of a head (called through :meth:`CertifiedHead.epsilon` and
    :meth:`CertifiedHead.spec`)."""

    def _epsilon(self, Hf, Hn, eps, temperature, out_dtype=None, with_upper: bool = False) -> CertResult:
        d = out_dtype or torch.float32
        N, T = Hf.shape[0], float(temperature)
        stats = CertStats(vocab_size=self.vocab_size)
        est, U, _ = self._screen(Hf)
        seeds = est.argmax(1)
        rows = torch.arange(N, device=Hf.device)
        val, err = self.exact(seeds, rows, Hf)
        tau = val - err
        z = (U - tau[:, None]) / T  # log w_i
        nb, width = 64, 0.5
        bucket = ((-z) / width).floor().clamp(0, nb - 1).long()  # bucket j: z in (-(j+1)w, -jw]
        w = torch.exp(z.clamp(max=80.0))
        hist = torch.zeros(N, nb, dtype=torch.float64, device=Hf.device).scatter_add_(1, bucket, w.double())
        tail = hist.flip(1).cumsum(1).flip(1)  # tail[j] = mass of buckets >= j
        ok = tail <= eps / 2
        # smallest j whose tail is within ε/2 (bucket nb-1 always includes everything below)
        j = torch.where(ok.any(1), ok.float().argmax(1), torch.full((N,), nb, device=Hf.device))
        S = bucket < j[:, None]
        logits, info = self._dense(S, Hf, Hn, d, stats, U)
        # certify exactly with the final S
        out_mass = (w * (~S)).double().sum(1)
        lz = ((logits.float() - tau[:, None]) / T)
        z_s = torch.exp(lz.clamp(max=80.0)).double().sum(1)
        tv = out_mass / (z_s + out_mass)
        bad = tv > eps
        if bad.any():  # cannot happen with sound bounds; stay correct anyway
            idx = bad.nonzero(as_tuple=True)[0]
            logits[idx] = self._stock_rows(Hf, Hn, d)[idx]
            stats.uncertify(S[idx].sum(1).tolist())
            S[idx] = True
            tv[idx] = 0
        stats.tv_bound_max = float(tv.max()) if N else 0.0
        upper = U + self.stock_error(Hf)[:, None] if with_upper else None  # |stock − real| <= E
        return CertResult(logits=logits, stats=stats, mask=S, upper=upper)
