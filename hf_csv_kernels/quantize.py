"""Symmetric per-row int8 quantization of a head with rigorous per-row error terms.

For every row W_i we store q_i (int8) and s_i with Ŵ_i = s_i q_i, and the exact
(rounded up) quantities

* ``err_l2[i]  >= ||W_i - Ŵ_i||_2``  (weight quantization error)
* ``l1[i]      >= ||Ŵ_i||_1``        (multiplies the per-coordinate activation error)
* ``abs_l1[i]  >= ||W_i||_1``        (floating-point accumulation margins of the recompute)

They are computed in float64 and rounded *up* to float32, so every bound built
from them is an over-estimate of the real-number quantity.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Int8Rows", "QuantRows", "quantize_rows_int8", "quantize_rows_fp8", "rows_from_codes", "unit_roundoff",
           "gamma", "round_up_f32", "FP8_E4M3_MAX"]

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """Unit roundoff u of a floating dtype (half the machine epsilon)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's γ_n = n·u / (1 − n·u): the relative error bound of an n-term float sum."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"gamma({n}) undefined for {dtype}: n·u >= 1")
    return nu / (1 - nu)


def round_up_f32(x: torch.Tensor) -> torch.Tensor:
    """Round a float64 tensor to the next float32 value that is >= it."""
    y = x.to(torch.float32)
    return torch.where(y.double() < x, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


@dataclass
class Int8Rows:
    """Quantized rows (int8, or fp8 e4m3 from :func:`quantize_rows_fp8`) plus the per-row terms the
    screen's error bound needs. Ŵ_i = scale_i · float(q_i) is exact in fp32 for both formats."""

    q: torch.Tensor  # int8 or float8_e4m3fn [V, d]
    scale: torch.Tensor  # float32 [V]
    err_l2: torch.Tensor  # float32 [V], >= ||W_i - s_i q_i||_2
    l1: torch.Tensor  # float32 [V], >= ||s_i q_i||_1
    abs_l1: torch.Tensor  # float32 [V], >= ||W_i||_1

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]


def _quantize_rows(weight: torch.Tensor, chunk_rows: int, qdtype: torch.dtype, qmax: float, encode) -> Int8Rows:
    """Per-row symmetric quantization with scale_i = max|W_i| / qmax; ``encode(w / s)`` gives the codes.

    The error terms are computed in float64 from the decoded codes (exact for int8 and e4m3 times a
    float32 scale) and rounded up to float32, chunked so that at most ``chunk_rows`` rows are held.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, d], got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise TypeError(f"weight must be floating point, got {weight.dtype}")
    V, d = weight.shape
    q = torch.empty(V, d, dtype=qdtype, device=weight.device)
    scale = torch.empty(V, dtype=torch.float32, device=weight.device)
    err_l2 = torch.empty_like(scale)
    l1 = torch.empty_like(scale)
    abs_l1 = torch.empty_like(scale)
    for lo in range(0, V, chunk_rows):
        w = weight[lo : lo + chunk_rows].float()
        if not torch.isfinite(w).all():
            raise ValueError("head weight contains non-finite values")
        s = w.abs().amax(1) / qmax
        s = torch.where(s > 0, s, torch.ones_like(s))  # all-zero row: any scale is exact
        qi = encode(w / s[:, None])
        q[lo : lo + chunk_rows] = qi
        scale[lo : lo + chunk_rows] = s
        wd = w.double()
        deq = qi.double() * s.double()[:, None]  # code times scale is exact in float64
        err_l2[lo : lo + chunk_rows] = round_up_f32((wd - deq).norm(dim=1) * (1 + 1e-12))
        l1[lo : lo + chunk_rows] = round_up_f32(deq.abs().sum(1) * (1 + 1e-12))
        abs_l1[lo : lo + chunk_rows] = round_up_f32(wd.abs().sum(1) * (1 + 1e-12))
    return Int8Rows(q=q, scale=scale, err_l2=err_l2, l1=l1, abs_l1=abs_l1)


@torch.no_grad()
def quantize_rows_int8(weight: torch.Tensor, chunk_rows: int = 16384) -> Int8Rows:
    """Quantize ``weight`` [V, d] to symmetric per-row int8 (levels −127..127)."""
    return _quantize_rows(weight, chunk_rows, torch.int8, 127.0,
                          lambda x: torch.round(x).clamp_(-127, 127).to(torch.int8))


QuantRows = Int8Rows  # the same container serves both formats


@torch.no_grad()
def quantize_rows_fp8(weight: torch.Tensor, chunk_rows: int = 16384) -> Int8Rows:
    """Per-row scaled fp8 e4m3 rows (scale_i = max|W_i| / 448), with the same rigorous error terms.

    e4m3 keeps 3 mantissa bits at every magnitude, so small weights keep their relative precision
    (int8 rounds them to a uniform step of max|W_i|/127). Both are one byte per weight: on a GPU
    the screen reads the same bytes; which bound is tighter is an empirical question per head
    (scripts/certify_report.py --quant fp8 measures it).
    """
    if not hasattr(torch, "float8_e4m3fn"):  # pragma: no cover - old torch
        raise RuntimeError("this torch has no float8_e4m3fn dtype")
    return _quantize_rows(weight, chunk_rows, torch.float8_e4m3fn, FP8_E4M3_MAX,
                          lambda x: x.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn))


@torch.no_grad()
def rows_from_codes(weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, chunk_rows: int = 16384) -> Int8Rows:
    """Rebuild :class:`Int8Rows` for ``weight`` from stored codes ``q`` and scales, recomputing every
    error term from ``weight`` itself in float32 with rigorous rounding margins.

    The returned terms bound the real quantities for *these* codes whatever they are: codes loaded
    from a file need no trust for soundness (a corrupt or foreign code only loosens the bound; callers
    compare the terms with the stored ones to detect that). One pass over ``weight``.

    Margins (u = 2^-24, n = d): a computed difference d_j = fl(w_j − fl(s·q_j)) is within
    u·|ŵ_j|(1+u) + u·|w_j − ŵ_j| + u²|ŵ_j| of the real e_j = w_j − ŵ_j, so
    ||e||_2 <= ||d||_2/(1−u) + 3u·||ŵ||_2, and fl(sqrt(Σ d_j²)) errs by at most γ_{n+2} relatively;
    ||ŵ||_2 <= ||ŵ||_1 = s·Σ|q_j| (an integer sum, exact in float32 below 2^24, or bounded by γ_n).
    """
    if weight.shape != q.shape or scale.shape != (q.shape[0],):
        raise ValueError(f"codes {tuple(q.shape)} / scales {tuple(scale.shape)} do not fit a head of shape "
                         f"{tuple(weight.shape)}")
    V, d = weight.shape
    u = unit_roundoff()
    g = gamma(d + 3)
    err_l2 = torch.empty(V, dtype=torch.float32, device=weight.device)
    l1 = torch.empty_like(err_l2)
    abs_l1 = torch.empty_like(err_l2)
    s_all = scale.float()
    for lo in range(0, V, chunk_rows):
        w = weight[lo: lo + chunk_rows].float()  # may be the weight itself (float32): never written
        s = s_all[lo: lo + chunk_rows]
        qf = q[lo: lo + chunk_rows].float()
        l1_c = qf.abs().sum(1).mul_(s).mul_((1 + g) * (1 + 4 * u))  # >= s·Σ|q| = ||ŵ||_1
        diff = torch.sub(w, qf.mul_(s[:, None]))
        err_l2[lo: lo + chunk_rows] = diff.norm(dim=1).mul_(1 + g).add_(l1_c * (3 * u)).mul_(1 + 4 * u)
        l1[lo: lo + chunk_rows] = l1_c
        abs_l1[lo: lo + chunk_rows] = w.abs().sum(1).mul_((1 + g) * (1 + 4 * u))
    return Int8Rows(q=q, scale=s_all, err_l2=err_l2, l1=l1, abs_l1=abs_l1)
