"""Cluster upper bounds and the segmented GEMV over a cluster-ordered head layout."""
from __future__ import annotations

import torch

__all__ = ["cluster_upper_reference", "segmented_gemv_reference"]


@torch.no_grad()
def cluster_upper_reference(centroids: torch.Tensor, radius: torch.Tensor, bias_max: torch.Tensor,
                            H: torch.Tensor, norm_min: torch.Tensor | None = None,
                            norm_max: torch.Tensor | None = None) -> torch.Tensor:
    """U[r, c] >= max_{i in c} <W_i, h_r> + b_i.

    Euclidean (norm_min/norm_max None): U = <μ_c, h> + R_c ||h|| + b_c.
    Spherical (unit μ_c, R_c bounds ||W_i/||W_i|| − μ_c||): B = <μ_c, h> + R_c ||h|| bounds
    <W_i/||W_i||, h>, so W_i·h <= norm_max·B if B >= 0 else norm_min·B.
    A slack of 4(d+2)u·(|<μ,h>| + R||h|| + ||μ||_1||h||_∞), plus 2u·(|B| + |b_c|) for the final add, covers fp32 rounding.
    """
    Hf = H.float()
    hn = Hf.norm(dim=1, keepdim=True)
    dot = Hf @ centroids.float().T
    d = H.shape[1]
    u = torch.finfo(torch.float32).eps / 2
    slack = 4 * (d + 2) * u * (dot.abs() + radius * hn + centroids.float().abs().sum(1) * Hf.abs().amax(1, keepdim=True))
    B = dot + radius * hn + slack
    if norm_min is not None:
        B = torch.where(B >= 0, B * norm_max, B * norm_min)
        B = B + B.abs() * (2 * u)
    # the final add rounds at the magnitude of B and the bias
    return B + bias_max + (B.abs() + bias_max.abs()) * (2 * u)


@torch.no_grad()
def segmented_gemv_reference(weight_perm: torch.Tensor, offsets: torch.Tensor, cluster_ids: torch.Tensor,
                             batch: torch.Tensor, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact logits of whole clusters in a cluster-contiguous row layout.

    For each pair m = (cluster_ids[m], batch[m]) computes <weight_perm[j], H[batch[m]]> for every
    j in offsets[c]..offsets[c+1]. Returns (values f32 [T], perm_pos int64 [T], pair int64 [T]).
    """
    starts = offsets[cluster_ids]
    sizes = offsets[cluster_ids + 1] - starts
    pair = torch.repeat_interleave(torch.arange(cluster_ids.numel(), device=H.device), sizes)
    first = torch.cumsum(sizes, 0) - sizes
    pos = starts[pair] + torch.arange(pair.numel(), device=H.device) - first[pair]
    vals = (weight_perm[pos].float() * H.float()[batch[pair]]).sum(-1)
    return vals, pos, pair
