"""Torch references of the verify-step ops that have Triton kernels: row logsumexp and the fused
residual + exponential race (argmax_i max(0, p_i − q_i)/E_i, an exact draw from norm(max(0, p − q)))."""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["row_logsumexp_reference", "residual_race_reference"]


def row_logsumexp_reference(X: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim, in fp32."""
    return torch.logsumexp(X.float(), dim=-1)


def residual_race_reference(zp: torch.Tensor, zq: torch.Tensor, lse_p: float, lse_q: float, E: torch.Tensor,
                            sigmoid: Optional[tuple[float, float]] = None) -> tuple[torch.Tensor, bool]:
    """(index, ok): the race winner over max(0, p − q); ok is False when the residual is all 0.

    p = exp(zp − lse_p) (or σ((zp − α)/(β − α)) with ``sigmoid=(α, β)``), likewise q.
    """
    if sigmoid is None:
        p, q = (zp.float() - lse_p).exp(), (zq.float() - lse_q).exp()
    else:
        a, b = sigmoid
        p, q = torch.sigmoid((zp.float() - a) / (b - a)), torch.sigmoid((zq.float() - a) / (b - a))
    key = (p - q).clamp_min(0) / E
    i = key.argmax()
    return i, bool(key[i] > 0)
