"""Decisions proven within the values' slack (docs/certificates.md §2.0, §2.3): the values on S are our fp32
accumulators, each within its slack of stock's, so an argmax or a Gumbel-max draw over them is stock's only where it
holds for every value of stock's inside those intervals. These functions find the rows where it may not (the caller
then takes stock's whole row)."""
from __future__ import annotations

import torch

from hf_csv.core.certificate.rounding import value_interval
from hf_csv.core.speculative import GUMBEL_SHIFT_FROM


def _sparse_undecided(rows: torch.Tensor, toks: torch.Tensor, vals: torch.Tensor, acc: torch.Tensor,
                      ent: torch.Tensor, N: int, d: torch.dtype) -> torch.Tensor:
    """bool [N]: rows whose argmax over the returned values (the first of equal ones, as ``argmax``) is not proven
    stock's. w is stock's argmax when lo_w > hi_j for every other j with a lower index and lo_w >= hi_j for every j
    with a higher one (a tie at stock's precision goes to the lower index). Tokens outside S are below w by the
    certificate. Entries are the sparse values, each with its own slack ``ent`` (0: stock's own value)."""
    dev = vals.device
    und = torch.zeros(N, dtype=torch.bool, device=dev)
    if vals.numel() == 0:
        return und
    ninf = torch.full((N,), float("-inf"), device=dev)
    top = ninf.scatter_reduce(0, rows, vals, "amax", include_self=True)
    is_top = vals == top[rows]
    big = torch.full((N,), torch.iinfo(torch.int64).max, dtype=torch.long, device=dev)
    w = big.scatter_reduce(0, rows[is_top], toks[is_top], "amin", include_self=True)
    lo, hi = value_interval(acc[:, None], ent, d)
    lo, hi = lo[:, 0], hi[:, 0]
    at_w = toks == w[rows]
    lo_w = ninf.scatter_reduce(0, rows[at_w], lo[at_w], "amax", include_self=True)
    before = toks < w[rows]
    after = toks > w[rows]
    hb = ninf.scatter_reduce(0, rows[before], hi[before], "amax", include_self=True)
    ha = ninf.scatter_reduce(0, rows[after], hi[after], "amax", include_self=True)
    has = torch.zeros(N, dtype=torch.bool, device=dev).index_fill_(0, rows, True)
    return has & ~((lo_w > hb) & (lo_w >= ha))


# a Gumbel draw's values lie within this of its shift at the top of the row (ulp 1.2e-4 there); farther, the noise
# would resolve worse than on rows of ordinary magnitude, so the row takes the full head and its own shift
_GUMBEL_FAR = 16 * GUMBEL_SHIFT_FROM


def _slack_too_wide(lo: torch.Tensor, hi: torch.Tensor, on: torch.Tensor, slack: torch.Tensor) -> torch.Tensor:
    """bool [N]: rows whose law interval [lo, hi] on the tokens ``on`` is at least ``GUMBEL_SHIFT_FROM`` wide where the
    values carry slack: the noise must resolve such a row on the full-head path too, so it takes stock's row
    (docs/certificates.md §2.3), decided from the values alone, before the noise is read."""
    width = (hi - lo).masked_fill(~on, 0.0).nan_to_num(0.0).amax(1)
    return (width >= GUMBEL_SHIFT_FROM) & (slack > 0)


def _draw_undecided(tokens: torch.Tensor, g: torch.Tensor, law_lo: torch.Tensor, law_hi: torch.Tensor) -> torch.Tensor:
    """bool [N]: rows where the Gumbel-max winner ``tokens`` could lose for some law within [law_lo, law_hi]: it wins
    for every such law when fl(law_lo_w + g_w) > fl(law_hi_j + g_j) for every other j (fl(x + g) is non-decreasing in
    x). -inf entries never compete."""
    w = tokens[:, None]
    mine = (law_lo.gather(1, w) + g.gather(1, w))[:, 0]
    rest = (law_hi + g).scatter(1, w, float("-inf")).amax(1)
    return ~(mine > rest)
