"""Certificates: exact results from bounds plus an exact recompute on a small sub-vocabulary.

Given sound upper bounds U_i >= ℓ_i (from a :mod:`hf_csv.bounds` provider), every method
computes ℓ exactly (fp32 accumulation of the head's own weights) only on a candidate set S
and proves that tokens outside S cannot change the result (proofs: docs/certificates.md):

* :meth:`CertifiedHead.topk` – the top-k set and values equal the full head's;
* :meth:`CertifiedHead.epsilon` – the returned distribution is within TV <= ε of softmax(ℓ/T);
* :meth:`CertifiedHead.sample` – an exact draw from softmax(ℓ/T) (lazy Gumbel-max);
* over the budget, or for non-finite hidden states, the row falls back to the full head (counted).

Everything is vectorized over the batch and the vocabulary; there is no Python loop over
tokens or clusters. This module does not import transformers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from hf_csv_kernels import gamma, get_op

from .bounds import BoundProvider, make_provider
from .index import VocabIndex

__all__ = ["CertStats", "CertResult", "CertifiedHead"]


@dataclass
class CertStats:
    """Per-call statistics; ``merge`` accumulates them over a generation."""

    rows: int = 0
    certified: int = 0
    fallback: int = 0
    nonfinite: int = 0
    subvocab_sum: int = 0
    subvocab_sizes: list = field(default_factory=list)
    near_ties: int = 0
    tv_bound_max: float = 0.0
    radius_sum: float = 0.0
    vocab_size: int = 0
    collect_radius: bool = True

    def merge(self, other: "CertStats") -> "CertStats":
        for f in ("rows", "certified", "fallback", "nonfinite", "subvocab_sum", "near_ties"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.subvocab_sizes.extend(other.subvocab_sizes)
        self.tv_bound_max = max(self.tv_bound_max, other.tv_bound_max)
        self.radius_sum += other.radius_sum
        self.vocab_size = other.vocab_size or self.vocab_size
        return self

    @property
    def certified_fraction(self) -> float:
        return self.certified / self.rows if self.rows else float("nan")

    @property
    def mean_subvocab_fraction(self) -> float:
        """Mean |S|/V over certified rows (fallback rows read all of V and are counted apart)."""
        return self.subvocab_sum / (self.certified * self.vocab_size) if self.certified else float("nan")

    def as_dict(self) -> dict:
        return {"rows": self.rows, "certified": self.certified, "fallback": self.fallback,
                "nonfinite": self.nonfinite, "certified_fraction": self.certified_fraction,
                "mean_subvocab_fraction": self.mean_subvocab_fraction, "near_ties": self.near_ties,
                "tv_bound_max": self.tv_bound_max,
                "mean_bound_radius": self.radius_sum / self.subvocab_sum if self.subvocab_sum else float("nan")}


@dataclass
class CertResult:
    """Dense logits [N, V] (exact on S, −inf outside) or sampled tokens, plus stats."""

    logits: Optional[torch.Tensor]
    stats: CertStats
    tokens: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None  # bool [N, V]: the certified sub-vocabulary (all True on fallback)
    est: Optional[torch.Tensor] = None  # [N, V] the provider's estimate (top-k only; not a bound)


class CertifiedHead:
    """An LM head ℓ = W h + b computed on a certified sub-vocabulary.

    Args:
        weight: head weight [V, d] (any float dtype; never copied).
        bias: optional [V].
        provider: ``"screen"`` (default), ``"cluster"``, or a provider object.
        index: a :class:`VocabIndex` (or directory) for the cluster provider.
        budget: max |S| before falling back to the full head: an int, or a fraction of V.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 provider: Union[str, BoundProvider] = "screen", index: Union[VocabIndex, str, None] = None,
                 budget: Union[int, float] = 0.05, **provider_kwargs):
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"head weight must be a floating [V, d] tensor, got {tuple(weight.shape)} {weight.dtype}")
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach().float()
        self.vocab_size, self.hidden_size = weight.shape
        if isinstance(index, str):
            index = VocabIndex.from_pretrained(index)
        if isinstance(provider, str):
            provider = make_provider(provider, self.weight, self.bias, index=index, **provider_kwargs)
        self.provider = provider
        if isinstance(budget, float) and not (0 < budget <= 1):
            raise ValueError(f"budget as a fraction must be in (0, 1], got {budget}")
        self.budget = max(1, math.ceil(budget * self.vocab_size)) if isinstance(budget, float) else int(budget)
        if self.budget < 1:
            raise ValueError(f"budget must allow at least one candidate, got {budget}")
        self._gather = get_op("gather_gemv", weight.device)
        self._gam = gamma(self.hidden_size + 2)
        # ||W_i||_1 (rounded up) for the recompute's accumulation margin, chunked to avoid an fp32 copy
        self._abs_l1 = torch.cat([c.float().abs().sum(1) for c in self.weight.split(16384)]) * (1 + 1e-6)
        # rows with more candidates than this are recomputed with the dense GEMM, then masked
        self._dense_cutoff = max(1, self.vocab_size // 8)
        self._last_rows: Optional[torch.Tensor] = None

    # ----------------------------------------------------------- helpers
    def _check(self, H: torch.Tensor) -> torch.Tensor:
        if not torch.is_tensor(H) or not H.is_floating_point():
            raise TypeError(f"hidden states must be a floating tensor, got {type(H).__name__} "
                            f"{getattr(H, 'dtype', '')}")
        if H.dim() != 2 or H.shape[1] != self.hidden_size:
            raise ValueError(f"hidden states must be [N, {self.hidden_size}], got {tuple(H.shape)}")
        return H.float()

    def full(self, H: torch.Tensor) -> torch.Tensor:
        """The full head in fp32 (what every certificate is exact relative to)."""
        out = H.float() @ self.weight.float().T if self.weight.dtype != torch.float32 else H.float() @ self.weight.T
        return out + self.bias if self.bias is not None else out

    def exact(self, tokens: torch.Tensor, rows: torch.Tensor, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact fp32 logits at (rows, tokens) and a rigorous bound on their rounding error."""
        val = self._gather(self.weight, tokens, rows, H)
        # γ_{d+2}·Σ_j |W_ij h_j| <= γ·||W_i||_1·||h||_∞ bounds the fp32 accumulation error
        err = self._gam * self._abs_l1[tokens] * H[rows].abs().amax(1)
        if self.bias is not None:
            val = val + self.bias[tokens]
            err = err + val.abs() * gamma(1)
        return val, err

    def _candidates_to_dense(self, S: torch.Tensor, H: torch.Tensor, out_dtype: torch.dtype,
                             stats: CertStats, U: torch.Tensor) -> torch.Tensor:
        N, V = S.shape
        if N <= 8:  # decode: one pass over S; counts from the (small) candidate list
            r, t = S.nonzero(as_tuple=True)
            counts = torch.bincount(r, minlength=N)
        else:
            counts = S.sum(1)
        over = counts > self.budget
        big = (counts > self._dense_cutoff) & ~over
        special = over | big
        if N <= 8:
            if bool(special.any()):
                keep = ~special[r]
                r, t = r[keep], t[keep]
        else:
            r, t = (S & ~special[:, None] if bool(special.any()) else S).nonzero(as_tuple=True)
        vals, _ = self.exact(t, r, H)
        logits = torch.full((N, V), float("-inf"), dtype=out_dtype, device=H.device)
        logits[r, t] = vals.to(out_dtype)
        if stats.collect_radius:
            stats.radius_sum += float((U[r, t] - vals).sum())
        if big.any():  # within budget but large: one dense GEMM is cheaper than a gather
            idx = big.nonzero(as_tuple=True)[0]
            dense = self.full(H[idx])
            stats.radius_sum += float(((U[idx] - dense) * S[idx]).sum())
            logits[idx] = dense.masked_fill(~S[idx], float("-inf")).to(out_dtype)
        if over.any():
            idx = over.nonzero(as_tuple=True)[0]
            logits[idx] = self.full(H[idx]).to(out_dtype)
            S[idx] = True
        cert = ~over
        stats.rows += N
        stats.certified += int(cert.sum())
        stats.fallback += int(over.sum())
        sizes = counts[cert]
        stats.subvocab_sum += int(sizes.sum())
        stats.subvocab_sizes.extend(sizes.tolist())
        stats.vocab_size = V
        self._last_sparse = (vals, bool(special.any()))  # for the near-tie count without a V-wide pass
        self._last_rows = r
        return logits

    def _run_nonfinite(self, H: torch.Tensor, fn, *args, **kwargs) -> CertResult:
        """Rows with NaN/inf hidden states go to the full head (as stock would), counted."""
        finite = torch.isfinite(H).all(dim=1)
        if bool(finite.all()):
            return fn(H, *args, **kwargs)
        stats = CertStats(vocab_size=self.vocab_size)
        N = H.shape[0]
        out_dtype = kwargs.get("out_dtype") or torch.float32
        logits = torch.empty(N, self.vocab_size, dtype=out_dtype, device=H.device)
        mask = torch.ones(N, self.vocab_size, dtype=torch.bool, device=H.device)
        tokens = None
        bad = (~finite).nonzero(as_tuple=True)[0]
        logits[bad] = self.full(H[bad]).to(out_dtype)
        stats.rows += len(bad)
        stats.fallback += len(bad)
        stats.nonfinite += len(bad)
        good = finite.nonzero(as_tuple=True)[0]
        if len(good):
            sub = fn(H[good], *args, **kwargs)
            stats.merge(sub.stats)
            if sub.logits is not None:
                logits[good] = sub.logits
            if sub.mask is not None:
                mask[good] = sub.mask
            if sub.tokens is not None:
                tokens = torch.full((N,), -1, dtype=torch.long, device=H.device)
                tokens[good] = sub.tokens
        return CertResult(logits=logits, stats=stats, tokens=tokens, mask=mask)

    # ---------------------------------------------------------- top-k
    @torch.no_grad()
    def topk(self, H: torch.Tensor, k: int = 1, out_dtype: Optional[torch.dtype] = None) -> CertResult:
        """Dense logits, exact on a set S that provably contains the full head's top-k.

        Proof sketch (docs/certificates.md): seeds s_1..s_k (top-k of the estimate) are computed
        exactly; τ = min_j (ℓ̂_{s_j} − err_{s_j}) is at most the k-th largest true logit. Every
        i ∉ S = {U_i >= τ} has ℓ_i <= U_i < τ, so it is not in the top-k. With ``out_dtype`` of
        lower precision (e.g. bf16, to match a bf16 stock head) τ is lowered by one ulp of that
        dtype so that tokens that *round* to a tie with the k-th value are kept too.
        """
        H = self._check(H)
        if not 1 <= k <= self.vocab_size:
            raise ValueError(f"k must be in [1, {self.vocab_size}], got {k}")
        return self._run_nonfinite(H, self._topk, k=k, out_dtype=out_dtype)

    def _topk(self, H: torch.Tensor, k: int, out_dtype: Optional[torch.dtype] = None) -> CertResult:
        out_dtype = out_dtype or torch.float32
        N = H.shape[0]
        stats = CertStats(vocab_size=self.vocab_size)
        est, U = self.provider(H)
        seeds = est.argmax(1, keepdim=True) if k == 1 else est.topk(k, dim=1).indices
        rows = torch.arange(N, device=H.device).repeat_interleave(seeds.shape[1])
        val, err = self.exact(seeds.reshape(-1), rows, H)
        tau = (val - err).view(N, -1).amin(1)
        if out_dtype != torch.float32:
            tau = tau - tau.abs() * torch.finfo(out_dtype).eps - torch.finfo(out_dtype).tiny
        S = U >= tau[:, None]
        logits = self._candidates_to_dense(S, H, out_dtype, stats, U)
        if k == 1:
            vals, special = self._last_sparse
            if N == 1 and not special and vals.numel() >= 2:
                top2 = vals.float().topk(2).values[None]  # equals the dense top-2 (-inf outside S)
            elif not special and self._last_rows is not None:
                top2 = _sparse_top2(self._last_rows, vals.float(), N)  # no pass over [N, V]
            else:
                top2 = logits.float().topk(min(2, self.vocab_size), dim=1).values
            if top2.shape[1] == 2:
                gap = top2[:, 0] - top2[:, 1]
                # a stock head that rounds to out_dtype could order these two differently
                tol = top2[:, 0].abs() * (torch.finfo(out_dtype).eps if out_dtype != torch.float32 else 4 * self._gam)
                stats.near_ties += int((gap <= tol).sum())
        return CertResult(logits=logits, stats=stats, mask=S, est=est)

    # ------------------------------------------------------ ε-softmax
    @torch.no_grad()
    def epsilon(self, H: torch.Tensor, eps: float = 1e-3, temperature: float = 1.0,
                out_dtype: Optional[torch.dtype] = None) -> CertResult:
        """Logits exact on S, −inf outside, with TV(softmax(ℓ/T), softmax over S) <= ε.

        With w_i = exp((U_i − τ)/T) and τ <= max_i ℓ_i, the mass outside S is at most
        R̂/(Z_S + R̂) with R̂ = Σ_{i∉S} exp(U_i/T)·e^{−τ/T} and Z_S the exact in-S sum (scaled alike).
        S is chosen from a 64-bucket histogram of w so that R̂ <= ε, then certified exactly.
        """
        H = self._check(H)
        if not (0 < eps < 1):
            raise ValueError(f"epsilon must be in (0, 1), got {eps}")
        if not (temperature > 0 and math.isfinite(temperature)):
            raise ValueError(f"temperature must be positive and finite, got {temperature}")
        return self._run_nonfinite(H, self._epsilon, eps=eps, temperature=temperature, out_dtype=out_dtype)

    def _epsilon(self, H, eps, temperature, out_dtype=None) -> CertResult:
        out_dtype = out_dtype or torch.float32
        N, T = H.shape[0], float(temperature)
        stats = CertStats(vocab_size=self.vocab_size)
        est, U = self.provider(H)
        seeds = est.argmax(1)
        rows = torch.arange(N, device=H.device)
        val, err = self.exact(seeds, rows, H)
        tau = val - err
        z = (U - tau[:, None]) / T  # log w_i
        nb, width = 64, 0.5
        bucket = ((-z) / width).floor().clamp(0, nb - 1).long()  # bucket j: z in (-(j+1)w, -jw]
        w = torch.exp(z.clamp(max=80.0))
        hist = torch.zeros(N, nb, dtype=torch.float64, device=H.device).scatter_add_(1, bucket, w.double())
        tail = hist.flip(1).cumsum(1).flip(1)  # tail[j] = mass of buckets >= j
        ok = tail <= eps / 2
        # smallest j whose tail is within ε/2 (bucket nb-1 always includes everything below)
        j = torch.where(ok.any(1), ok.float().argmax(1), torch.full((N,), nb, device=H.device))
        S = bucket < j[:, None]
        logits = self._candidates_to_dense(S, H, out_dtype, stats, U)
        # certify exactly with the final S
        out_mass = (w * (~S)).double().sum(1)
        lz = ((logits.float() - tau[:, None]) / T)
        z_s = torch.exp(lz.clamp(max=80.0)).double().sum(1)
        tv = out_mass / (z_s + out_mass)
        bad = tv > eps
        if bad.any():  # cannot happen with sound bounds; stay correct anyway
            idx = bad.nonzero(as_tuple=True)[0]
            logits[idx] = self.full(H[idx]).to(out_dtype)
            S[idx] = True
            stats.certified -= int(bad.sum())
            stats.fallback += int(bad.sum())
            tv[idx] = 0
        stats.tv_bound_max = float(tv.max()) if N else 0.0
        return CertResult(logits=logits, stats=stats, mask=S)

    # ------------------------------------------------------ exact sampling
    @torch.no_grad()
    def sample(self, H: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
               generator: Optional[torch.Generator] = None) -> CertResult:
        """One exact draw per row from softmax(ℓ/T) (restricted to the top-k if ``top_k``).

        Lazy Gumbel-max: with G_i ~ Gumbel(0, 1) for all V tokens, argmax_i ℓ_i/T + G_i is an
        exact sample. The seed s = argmax(est/T + G) is computed exactly, τ = (ℓ̂_s − err_s)/T + G_s;
        any i with U_i/T + G_i < τ cannot be the argmax, so only S = {U_i/T + G_i >= τ} is recomputed.
        """
        H = self._check(H)
        if not (temperature > 0 and math.isfinite(temperature)):
            raise ValueError(f"temperature must be positive and finite, got {temperature}")
        return self._run_nonfinite(H, self._sample, temperature=temperature, top_k=top_k, generator=generator)

    def _sample(self, H, temperature, top_k=None, generator=None) -> CertResult:
        N, T = H.shape[0], float(temperature)
        if top_k is not None and top_k < self.vocab_size:
            res = self._topk(H, int(top_k))
            g = _gumbel(res.logits.shape, H.device, generator)
            res.tokens = (res.logits.float() / T + g).argmax(1)
            return res
        stats = CertStats(vocab_size=self.vocab_size)
        est, U = self.provider(H)
        g = _gumbel(U.shape, H.device, generator)
        seeds = (est / T + g).argmax(1)
        rows = torch.arange(N, device=H.device)
        val, err = self.exact(seeds, rows, H)
        tau = (val - err) / T + g[rows, seeds]
        S = (U / T + g) >= tau[:, None]
        logits = self._candidates_to_dense(S, H, torch.float32, stats, U)
        tokens = (logits / T + g).argmax(1)
        return CertResult(logits=logits, stats=stats, tokens=tokens, mask=S)


def _sparse_top2(rows: torch.Tensor, vals: torch.Tensor, N: int) -> torch.Tensor:
    """Per-row two largest of the sparse (row, value) pairs, -inf where a row has fewer: [N, 2]."""
    out = torch.full((N, 2), float("-inf"), dtype=vals.dtype, device=vals.device)
    if vals.numel() == 0:
        return out
    order = torch.argsort(vals, descending=True, stable=True)
    r = rows[order]
    order2 = torch.argsort(r, stable=True)  # grouped by row, descending values within a row
    r, v = r[order2], vals[order][order2]
    counts = torch.bincount(r, minlength=N)
    start = torch.cumsum(counts, 0) - counts
    has1, has2 = counts >= 1, counts >= 2
    out[has1, 0] = v[start[has1]]
    out[has2, 1] = v[start[has2] + 1]
    return out


def _gumbel(shape, device, generator) -> torch.Tensor:
    u = torch.rand(shape, device=device, generator=generator)
    # clamp away from 0 and 1 so G is finite; the change in probability is < 1e-38 per token
    return -torch.log(-torch.log(u.clamp(min=torch.finfo(torch.float32).tiny, max=1 - 2 ** -24)))
