"""hf_csv_kernels.cluster: the cluster upper bound never under-estimates a member's logit (Euclidean and spherical),
and the segmented GEMV returns every row of the requested clusters with its position and pair."""
import torch

from hf_csv_kernels.cluster import cluster_upper_reference, segmented_gemv_reference


def _clusters(seed=0, V=60, d=8, C=5):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(V, d, generator=g) * torch.rand(V, 1, generator=g) * 4
    bias = torch.randn(V, generator=g)
    assign = torch.arange(V) % C
    H = torch.randn(4, d, generator=g) * 3
    return W, bias, assign, H, C


def test_euclidean_bound_covers_every_member():
    W, bias, assign, H, C = _clusters()
    mu = torch.stack([W[assign == c].mean(0) for c in range(C)])
    R = torch.stack([(W[assign == c] - mu[c]).norm(dim=1).max() for c in range(C)])
    bmax = torch.stack([bias[assign == c].max() for c in range(C)])
    U = cluster_upper_reference(mu, R, bmax, H)
    logits = H.double() @ W.double().T + bias.double()
    for c in range(C):
        assert (U[:, c].double() >= logits[:, assign == c].max(1).values).all()
    # a bound, not the max: a far centroid is not mistaken for a member
    assert (U.double() >= torch.stack([logits[:, assign == c].max(1).values for c in range(C)], 1)).all()


def test_spherical_bound_covers_every_member():
    W, bias, assign, H, C = _clusters(seed=1)
    n = W.norm(dim=1)
    unit = W / n[:, None]
    mu = torch.stack([unit[assign == c].mean(0) for c in range(C)])
    mu = mu / mu.norm(dim=1, keepdim=True)
    R = torch.stack([(unit[assign == c] - mu[c]).norm(dim=1).max() for c in range(C)]) * (1 + 1e-6)
    nmin = torch.stack([n[assign == c].min() for c in range(C)])
    nmax = torch.stack([n[assign == c].max() for c in range(C)])
    bmax = torch.stack([bias[assign == c].max() for c in range(C)])
    U = cluster_upper_reference(mu, R, bmax, H, norm_min=nmin, norm_max=nmax)
    logits = H.double() @ W.double().T + bias.double()
    for c in range(C):
        assert (U[:, c].double() >= logits[:, assign == c].max(1).values).all()


def test_segmented_gemv_enumerates_whole_clusters():
    g = torch.Generator().manual_seed(2)
    Wp = torch.randn(10, 4, generator=g)
    H = torch.randn(2, 4, generator=g)
    offsets = torch.tensor([0, 3, 7, 10])
    vals, pos, pair = segmented_gemv_reference(Wp, offsets, torch.tensor([2, 0]), torch.tensor([1, 0]), H)
    assert pos.tolist() == [7, 8, 9, 0, 1, 2] and pair.tolist() == [0, 0, 0, 1, 1, 1]
    want = torch.cat([Wp[7:10] @ H[1], Wp[0:3] @ H[0]])
    assert vals.dtype == torch.float32 and torch.allclose(vals, want, rtol=1e-6, atol=1e-6)
    empty = segmented_gemv_reference(Wp, offsets, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), H)
    assert all(t.numel() == 0 for t in empty)
