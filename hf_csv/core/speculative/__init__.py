"""Acceptance of drafted tokens in speculative sampling: which drafts to accept, and the token to emit after them.

Plain torch, no ``transformers`` import; the transformers-facing adapter with the stock ``_speculative_sampling``
signature lives in :mod:`hf_csv.transformers.acceptance`. One module per idea:

* :mod:`~hf_csv.core.speculative.rule`: the shapes, :class:`AcceptanceResult`, :class:`DraftProbabilityError` and
  the acceptance test ``u < p(x)/q(x)`` every algorithm shares;
* :mod:`~hf_csv.core.speculative.race`: the exponential race, an exact draw with no normalizer;
* :mod:`~hf_csv.core.speculative.exact`: :func:`exact_acceptance`, the target's law exactly (stock's), faster;
* :mod:`~hf_csv.core.speculative.bounded`: :func:`bounded_acceptance`, the same law from a certified target that is
  exact on a subset and bounded elsewhere;
* :mod:`~hf_csv.core.speculative.gumbel`: Gumbel noise, its fp32 shift and :class:`KeyedGumbel`;
* :mod:`~hf_csv.core.speculative.coupled`: :func:`gumbel_coupled_acceptance`, draft and target sharing the noise;
* :mod:`~hf_csv.core.speculative.sigmoid`: :func:`sigmoid_acceptance`, the seed paper's LOSSY approximation.

Guarantees and proofs: docs/speculative.md.
"""
from __future__ import annotations

from hf_csv.core.speculative.bounded import bounded_acceptance
from hf_csv.core.speculative.coupled import gumbel_coupled_acceptance
from hf_csv.core.speculative.exact import exact_acceptance, exact_first_token_distribution
from hf_csv.core.speculative.gumbel import GUMBEL_SHIFT_FROM, KeyedGumbel, gumbel_noise, gumbel_shift, row_max_finite
from hf_csv.core.speculative.race import RACE_BLOCK
from hf_csv.core.speculative.rule import AcceptanceResult, DraftProbabilityError
from hf_csv.core.speculative.sigmoid import (SIGMOID_ALPHA, SIGMOID_BETA, LossyVerifyWarning, sigmoid_acceptance,
                                            sigmoid_first_token_distribution, sigmoid_probs)

__all__ = [
    "AcceptanceResult",
    "DraftProbabilityError",
    "exact_acceptance",
    "bounded_acceptance",
    "gumbel_noise",
    "GUMBEL_SHIFT_FROM",
    "gumbel_shift",
    "row_max_finite",
    "KeyedGumbel",
    "gumbel_coupled_acceptance",
    "sigmoid_acceptance",
    "sigmoid_probs",
    "sigmoid_first_token_distribution",
    "exact_first_token_distribution",
    "RACE_BLOCK",
    "SIGMOID_ALPHA",
    "SIGMOID_BETA",
    "LossyVerifyWarning",
]
