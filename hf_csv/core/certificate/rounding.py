"""The float32 rounding steps the certificates' proofs rest on (docs/certificates.md §2.0, §2.1, §3.9): directed
roundings (:func:`_down`, :func:`_f32_down`, :func:`_f32_up`, :func:`_to_dtype`), the cut that turns a lower bound
on stock's seed into a threshold on the upper bounds and a bound on every token left out (:func:`_cut`,
:func:`_cut_at`, :func:`_cut_order`), and the interval that holds stock's value given ours and its slack
(:func:`value_interval`). Pure functions of tensors: each states the inequality it guarantees."""
from __future__ import annotations

import math

import torch

__all__ = ["value_interval"]


def _down(x: torch.Tensor, n: int = 1) -> torch.Tensor:
    """x moved n fp32 ulps toward -inf (covers the rounding of the op that produced x)."""
    for _ in range(n):
        x = torch.nextafter(x, torch.full_like(x, float("-inf")))
    return x


def _f32_up_n(x: torch.Tensor, n: int = 1) -> torch.Tensor:
    for _ in range(n):
        x = torch.nextafter(x, torch.full_like(x, float("inf")))
    return x


def _f32_down(x: torch.Tensor) -> torch.Tensor:
    """The largest float32 <= x (float64 input)."""
    f = x.float()
    return torch.where(f.double() > x, torch.nextafter(f, torch.full_like(f, float("-inf"))), f)


def _f32_up(x: torch.Tensor) -> torch.Tensor:
    """The smallest float32 >= x (float64 input)."""
    f = x.float()
    return torch.where(f.double() < x, torch.nextafter(f, torch.full_like(f, float("inf"))), f)


def _to_dtype(x: torch.Tensor, d: torch.dtype, up: bool) -> torch.Tensor:
    """fp32 ``x`` rounded to ``d`` toward +inf (``up``) or -inf, as fp32 holding a ``d`` value."""
    if d == torch.float32:
        return x
    v = x.to(d)
    step = torch.full_like(v, float("inf") if up else float("-inf"))
    off = v.float() < x if up else v.float() > x
    return torch.where(off, torch.nextafter(v, step), v).float()


def value_interval(acc: torch.Tensor, slack: torch.Tensor, d: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi), fp32 holding ``d`` values, with lo <= stock's value <= hi, for values the head computed from an fp32
    accumulator ``acc`` [N, m] within ``slack`` [N] of stock's accumulator, which stock rounds to ``d`` (round to
    nearest, non-decreasing): lo = ``acc − slack`` rounded down to ``d``, hi = ``acc + slack`` rounded up, each
    non-decreasing in ``acc`` (docs/certificates.md §2.0). Where slack is 0 (stock's own rows, ``acc`` its value)
    lo = hi = acc. -inf stays -inf."""
    y = acc.float()
    s = slack.float()[:, None]
    lo = _to_dtype(_down(y - s, 1), d, up=False)
    hi = _to_dtype(_f32_up_n(y + s, 1), d, up=True)
    exact = (s == 0) | ~torch.isfinite(y)
    return torch.where(exact, y, lo), torch.where(exact, y, hi)


def _cut(lo: torch.Tensor, E: torch.Tensor, d: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Threshold t and bound b per row such that any token with upper bound U_i < t has a stock
    logit (rounded to d) <= b < round_d(lo), where lo <= stock's fp32 accumulator of the seeds: :func:`_cut_at`
    with b the predecessor of round_d(lo) in d."""
    r = lo if d == torch.float32 else lo.to(d)
    return _cut_at(torch.nextafter(r, torch.full_like(r, float("-inf"))).float(), E, d)


def _cut_at(b: torch.Tensor, E: torch.Tensor, d: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Threshold t per row such that any token with upper bound U_i < t has a stock logit (rounded to d) <= b,
    for a cap b that is a value of d (as fp32). Returns (t, b); rows where t, b or the edge is not finite get
    t = -inf, b = inf (nothing certified). An infinite edge is b = d's largest finite value: its successor in d is
    +inf, and a stock logit above d's overflow threshold rounds to +inf > b, so no finite t caps it (a float16 head
    whose seed logit overflows: those rows take the full head; docs/certificates.md §2.1).

    U_i < t <= edge − E gives x_i <= ℓ_i + E <= U_i + E < edge; in fp32, edge = succ(b), so x_i <= b; in d, edge
    is the midpoint between b and its successor in d, so round-to-nearest gives round_d(x_i) <= b (a value
    exactly at the midpoint is excluded by the strict '<').
    """
    if d == torch.float32:
        edge = torch.nextafter(b, torch.full_like(b, float("inf")))
    else:
        bd = b.to(d)
        edge = (b + torch.nextafter(bd, torch.full_like(bd, float("inf"))).float()) / 2  # exact in fp32
    t = _down(edge - E, 2)
    ok = torch.isfinite(t) & torch.isfinite(b) & torch.isfinite(edge)
    return t.masked_fill(~ok, float("-inf")), b.masked_fill(~ok, float("inf"))


def _cut_order(lo: torch.Tensor, E: torch.Tensor, d: torch.dtype, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_cut` that also survives any later float32 map x -> fl(x·c) or fl(x/c) (c > 0; transformers'
    temperature warper, in any of its implementations): every token with U_i < t has a stock logit x_i (in d)
    whose processed value is *strictly* below the processed value of round_d(lo), whatever the kernel that
    processes them (docs/certificates.md §3.9).

    Such a map is monotone with relative error at most 3u (u = 2^-24: one rounding of 1/c, one of the product),
    while the result is a normal number. The cap b <= L − 8u|L|, L = round_d(lo), then gives fl(b·/c) < fl(L·/c):
    for L > 0, (1 − 8u)(1 + 3u) < 1 − 3u, and for L < 0, (1 + 8u)(1 − 3u) > 1 + 3u. Rows where |L|/c is outside
    [2^-100, 2^100] (subnormal or overflowing results, and L = 0) get t = -inf, b = inf (not certified: the caller
    treats them as full rows), as do rows with a non-finite lo. ``temperature`` is c.
    """
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    L = lo if d == torch.float32 else lo.to(d).float()
    cap = L.double() * (1.0 - 8.0 * 2.0 ** -24 * torch.sign(L.double()))  # L − 8u|L|, exact enough in fp64
    b = _f32_down(cap)  # largest fp32 <= cap
    if d != torch.float32:  # largest value of d <= b
        r = b.to(d)
        b = torch.where(r.float() > b, torch.nextafter(r, torch.full_like(r, float("-inf"))), r).float()
    mag = L.double().abs() / temperature
    b = b.masked_fill(~((mag >= 2.0 ** -100) & (mag <= 2.0 ** 100)), float("inf"))  # not certified
    return _cut_at(b, E, d)
