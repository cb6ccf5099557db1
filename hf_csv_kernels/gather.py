"""Exact recompute of a ragged set of (row, token) logits: a gather-GEMV."""
from __future__ import annotations

import torch

__all__ = ["gather_gemv_reference"]


@torch.no_grad()
def gather_gemv_reference(weight: torch.Tensor, tokens: torch.Tensor, batch: torch.Tensor, H: torch.Tensor,
                          chunk: int = 8192) -> torch.Tensor:
    """out[m] = <weight[tokens[m]], H[batch[m]]> in fp32 (weights upcast exactly).

    The fp32 result errs from the real inner product by at most γ_d·Σ_j |W_ij h_j|.
    """
    out = torch.empty(tokens.numel(), dtype=torch.float32, device=H.device)
    Hf = H.float()
    for lo in range(0, tokens.numel(), chunk):
        t = tokens[lo : lo + chunk]
        b = batch[lo : lo + chunk]
        out[lo : lo + chunk] = (weight[t].float() * Hf[b]).sum(-1)
    return out
