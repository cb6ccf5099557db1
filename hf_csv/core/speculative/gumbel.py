"""Gumbel noise for Gumbel-max draws: i.i.d. standard Gumbel variates, the per-row shift that keeps them resolved
in fp32, and :class:`KeyedGumbel`, noise that is a fixed function of (seed, token index).

Plain torch, no ``transformers`` import. Used by the certified head's lazy Gumbel draw
(:mod:`hf_csv.core.certificate`), the bounded acceptance and the Gumbel-coupled acceptance.
"""
from __future__ import annotations

import torch

__all__ = ["gumbel_noise", "GUMBEL_SHIFT_FROM", "gumbel_shift", "row_max_finite", "KeyedGumbel"]


def gumbel_noise(shape, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """i.i.d. standard Gumbel variates -log(-log u), u ~ U(0, 1) (torch.rand: ~10x cheaper per element than
    exponential_ on CPU), clamped away from 0 and 1 so G is finite; the change in probability is < 1e-38 per
    token. Shared by the certified head's lazy Gumbel draw and the bounded acceptance."""
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
    party that draws the token at index t — the draft, the target's head, the acceptance of the drafts
    (Gumbel-coupled acceptance, docs/speculative.md).

    ``rows(keys, V)`` returns [len(keys), V] i.i.d. standard Gumbel variates (:func:`gumbel_noise` from a CPU
    ``torch.Generator`` seeded with a SplitMix64 mix of (seed, key)); the same key always gives the same row, and
    different keys give rows from unrelated generator seeds (treated as independent, as any PRNG stream is).
    The last ``cache`` rows are kept, so the draft's row for index t is reused when the target accepts or rejects
    the draft at t.
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
