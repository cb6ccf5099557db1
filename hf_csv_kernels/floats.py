"""Floating-point facts every rigorous bound of the kernels rests on: the unit roundoff, Higham's γ_n, rounding a
float64 bound up to float32, and the refusal of a weight that is not finite (no rounding bound holds on NaN or ∞).

Shared by the quantizers (:mod:`hf_csv_kernels.quantize`, the torch path; :mod:`hf_csv_kernels.native`, the C one)
and the screen; plain torch, no other import.
"""
from __future__ import annotations

import torch

__all__ = ["unit_roundoff", "gamma", "round_up_f32", "NonFiniteWeightError"]


class NonFiniteWeightError(ValueError):
    """A head weight is NaN or infinite: no row bound holds (the callers take the full head, with this reason)."""


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
