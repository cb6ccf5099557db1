"""What a certificate returns: the call's statistics (:class:`CertStats`), its result (:class:`CertResult`), the sparse
values the recompute hands back to the certificates (:class:`_Dense`), and the type of another engine's own head
(:data:`StockFn`, :data:`SubsetFn`). No arithmetic beyond counting and scattering values lives here."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

__all__ = ["CertStats", "CertResult", "StockFn", "SubsetFn"]

# another engine's own head: hidden states [N, d] in the weight dtype -> its logits [N, V] in that dtype, for every
# row of the call (its GEMM over fewer rows may round differently, so the core never asks for a subset)
StockFn = Callable[[torch.Tensor], torch.Tensor]
# that engine's kernel on a subset of the head's rows: (hidden states [N, d] in the weight dtype, sorted token ids
# [m]) -> [N, m] in the weight dtype
SubsetFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class CertStats:
    """Per-call statistics; ``merge`` accumulates them over a generation."""

    rows: int = 0
    certified: int = 0
    fallback: int = 0
    nonfinite: int = 0
    out_of_range: int = 0  # finite rows with ||h||_∞ = 0 or outside [H_MIN, H_MAX]: the full head (stock's row)
    subvocab_sum: int = 0
    subvocab_sizes: list = field(default_factory=list)
    near_ties: int = 0
    # in-range rows of a call that also held a non-finite or out-of-range row: stock's rows of that call's full head
    beside_bad: int = 0
    native: int = 0  # certified rows whose epilogue ran in the native one-row kernel (own_values; speed only)
    tv_bound_max: float = 0.0
    radius_sum: float = 0.0
    vocab_size: int = 0
    collect_radius: bool = True

    def merge(self, other: "CertStats") -> "CertStats":
        for f in ("rows", "certified", "fallback", "nonfinite", "out_of_range", "subvocab_sum", "near_ties", "beside_bad",
                  "native"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.subvocab_sizes.extend(other.subvocab_sizes)
        self.tv_bound_max = max(self.tv_bound_max, other.tv_bound_max)
        self.radius_sum += other.radius_sum
        self.vocab_size = other.vocab_size or self.vocab_size
        return self

    def uncertify(self, sizes: list) -> int:
        """Rows counted certified, with these set sizes |S|, that end on stock's row: fallbacks now, and their sizes
        leave the certified rows' (``mean_subvocab_fraction`` is over certified rows). Returns how many moved."""
        n = min(len(sizes), self.certified)
        self.certified -= n
        self.fallback += n
        for size in sizes[:n]:
            self.subvocab_sum -= size
            if size in self.subvocab_sizes:  # (equal sizes are interchangeable: the multiset stays exact)
                self.subvocab_sizes.remove(size)
        return n

    @property
    def certified_fraction(self) -> float:
        return self.certified / self.rows if self.rows else 0.0

    @property
    def mean_subvocab_fraction(self) -> float:
        """Mean |S|/V over certified rows (fallback rows read all of V and are counted apart)."""
        return self.subvocab_sum / (self.certified * self.vocab_size) if self.certified and self.vocab_size else 0.0

    def as_dict(self) -> dict:
        return {"rows": self.rows, "certified": self.certified, "fallback": self.fallback,
                "nonfinite": self.nonfinite, "out_of_range": self.out_of_range, "certified_fraction": self.certified_fraction,
                "mean_subvocab_fraction": self.mean_subvocab_fraction, "near_ties": self.near_ties,
                "beside_bad": self.beside_bad,
                "native_rows": self.native,
                "tv_bound_max": self.tv_bound_max,
                "mean_bound_radius": self.radius_sum / self.subvocab_sum if self.subvocab_sum else 0.0}


@dataclass
class CertResult:
    """Dense logits [N, V] (exact on S, −inf outside) or sampled tokens, plus stats."""

    logits: Optional[torch.Tensor]
    stats: CertStats
    tokens: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None  # bool [N, V]: the certified sub-vocabulary (all True on fallback)
    est: Optional[torch.Tensor] = None  # [N, V] the provider's estimate (top-k only; not a bound)
    # [N] fp32: every token outside S has a stock logit (in the value dtype, before any post-head
    # transform) <= bound; -inf where the row holds the full head (top-k only)
    bound: Optional[torch.Tensor] = None
    # sample (lazy Gumbel) only: the Gumbel noise [N, V] and the cut [N]: every i ∉ S has
    # law_i + noise_i < cut (law: stock's final value before any lowering processor); -inf on complete rows
    noise: Optional[torch.Tensor] = None
    cut: Optional[torch.Tensor] = None
    # ... and the shift m [N] the draw subtracts first: the token is argmax fl(fl(law_i - m) + noise_i), and the cut
    # is in those shifted units (hf_csv.core.speculative.gumbel_shift; 0 on rows of ordinary magnitude)
    shift: Optional[torch.Tensor] = None
    # spec only: [N, V] fp32, an upper bound on stock's fp32 logit of every token (used off S)
    upper: Optional[torch.Tensor] = None
    # sample(with_conf=True) only: [N] the drawn token's probability, exact with a top-k warp, else with the
    # normalizer estimated from the provider's estimate off S (a heuristic for an assistant's confidence stop)
    conf: Optional[torch.Tensor] = None
    # [N] fp32: every returned value on S comes from an fp32 accumulator within ``slack`` of stock's (then rounded to
    # the value dtype as stock rounds); 0 on rows that are stock's own (docs/certificates.md §2.0, "Values on S")
    slack: Optional[torch.Tensor] = None
    # (rows, tokens, fp32 accumulators) of the values computed from a column subset (top-k only; rows with slack 0
    # hold stock's own values and have no entry): see :func:`value_interval`
    acc: Optional[tuple] = None

    def acc_dense(self) -> torch.Tensor:
        """[N, V] fp32: our accumulator on gathered entries, the returned value elsewhere (stock's own rows, -inf)."""
        return _acc_dense(self.logits, *(self.acc if self.acc is not None else (None, None, None)))


@dataclass
class _Dense:
    rows: torch.Tensor  # row of each sparse candidate value (special rows excluded)
    vals: torch.Tensor  # their fp32 values
    special: bool  # some row was computed densely (big or over budget)
    over: torch.Tensor  # bool [N]: rows over the budget (full head)
    complete: torch.Tensor  # bool [N]: rows that hold every token (S = V)
    slack: torch.Tensor  # fp32 [N]: |our accumulator − stock's| <= slack on every value of the row (0: stock's row)
    toks: torch.Tensor  # token of each sparse value
    acc: torch.Tensor  # our fp32 accumulator of each sparse value (vals is it rounded to the value dtype)
    ent: torch.Tensor  # each sparse value's own slack (the row's slack is their largest)


def _acc_dense(logits: torch.Tensor, rows: Optional[torch.Tensor], toks: Optional[torch.Tensor],
               acc: Optional[torch.Tensor]) -> torch.Tensor:
    """[N, V] fp32: the accumulators ``acc`` at (rows, toks), the returned ``logits`` elsewhere."""
    out = logits.float().clone()
    if rows is not None and rows.numel():
        out[rows, toks] = acc
    return out

