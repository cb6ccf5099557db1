"""The vocabulary index: FAISS k-means clusters of the head rows, plus a head fingerprint.

An index is one part of an :class:`hf_csv.hub.artifact.CSVArtifact` (which saves, loads and pushes it:
``CSVArtifact.build(W, index=True)``, ``CSVArtifact.from_pretrained(DIR_OR_REPO).index``). It never
stores the head itself; it records a fingerprint of it so that it can never be used with a different head.

Stored tensors (V = vocab, C = clusters, d = hidden size):

* ``centroids`` [C, d] – k-means centroids (unit vectors for ``metric="spherical"``);
* ``radius`` [C] – Euclidean: max ||W_i − μ_c||; spherical: max ||W_i/||W_i|| − μ_c||;
* ``norm_min``/``norm_max`` [C] – min/max ||W_i|| per cluster (spherical bound);
* ``bias_max`` [C], ``bias_topm`` [C, m] – per-cluster largest biases (0 without bias);
* ``perm`` [V] – row ids in cluster order; ``offsets`` [C+1] – cluster c is perm[offsets[c]:offsets[c+1]];
* ``assignment`` [V] – cluster of each row.

This module does not import transformers.
"""
from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np
import torch

from hf_csv.core.errors import FingerprintMismatchError, IndexFormatError

logger = logging.getLogger(__name__)

__all__ = ["IndexConfig", "VocabIndex", "head_fingerprint", "check_head_identity", "default_num_clusters"]

FORMAT_VERSION = 1
_TENSOR_KEYS = ("centroids", "radius", "norm_min", "norm_max", "bias_max", "bias_topm", "perm", "offsets", "assignment")


def default_num_clusters(vocab_size: int) -> int:
    """About 2·sqrt(V) rounded to a power of two, in [16, 1024]: minutes on 2 cores for V = 262k."""
    c = 2 ** round(math.log2(max(1.0, 2 * math.sqrt(vocab_size))))
    return int(min(vocab_size, 1024, max(16, c)))


@torch.no_grad()
def head_fingerprint(weight: torch.Tensor, bias: Optional[torch.Tensor] = None, sample_rows: int = 4096) -> str:
    """A sha256 over the head's shape and the fp32 values of a fixed stride of rows (and the bias).

    Dtype-agnostic for values exactly representable in fp32 (a bf16 head and its fp32
    upcast share a fingerprint); any change to a sampled row or the shape changes it.
    """
    V, d = weight.shape
    step = max(1, V // sample_rows)
    rows = weight[::step].detach().to("cpu", torch.float32).contiguous()
    h = hashlib.sha256()
    h.update(f"hf_csv-head-v1:{V}x{d}:bias={bias is not None}".encode())
    h.update(rows.numpy().tobytes())
    h.update(weight[-1].detach().to("cpu", torch.float32).numpy().tobytes())
    if bias is not None:
        h.update(bias.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:32]


def check_head_identity(what: str, config: Any, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
    """Raise :class:`FingerprintMismatchError` unless ``config`` (vocab_size, hidden_size, fingerprint,
    base_model) describes this head: its shape and its sampled-row fingerprint. ``what`` names the artifact."""
    V, d = weight.shape
    c = config
    if (V, d) != (c.vocab_size, c.hidden_size):
        raise FingerprintMismatchError(f"{what} was built for a {c.vocab_size}x{c.hidden_size} head, this head is "
                                       f"{V}x{d} ({what} fingerprint {c.fingerprint})")
    fp = head_fingerprint(weight, bias)
    if fp != c.fingerprint:
        raise FingerprintMismatchError(
            f"{what} fingerprint {c.fingerprint} does not match this model's head fingerprint {fp}: "
            f"the {what} was built for another model (base_model={c.base_model!r})")


@dataclass
class IndexConfig:
    """Build parameters and identity of a :class:`VocabIndex` (saved as JSON)."""

    vocab_size: int
    hidden_size: int
    num_clusters: int
    metric: str = "euclidean"
    niter: int = 10
    seed: int = 0
    top_m_bias: int = 4
    has_bias: bool = False
    fingerprint: str = ""
    head_dtype: str = "float32"
    base_model: Optional[str] = None
    format_version: int = FORMAT_VERSION
    tensors_sha256: Optional[str] = None
    stats: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        if self.metric not in ("euclidean", "spherical"):
            raise ValueError(f"IndexConfig.metric must be 'euclidean' or 'spherical', got {self.metric!r}")
        for name in ("vocab_size", "hidden_size", "num_clusters", "niter"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"IndexConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_clusters > self.vocab_size:
            raise ValueError(f"IndexConfig.num_clusters ({self.num_clusters}) exceeds vocab_size ({self.vocab_size})")
        if self.format_version > FORMAT_VERSION:
            raise IndexFormatError(f"index format {self.format_version} is newer than this hf_csv ({FORMAT_VERSION})")


class VocabIndex:
    """Clusters of LM-head rows with per-cluster bound data and the head's fingerprint."""

    def __init__(self, config: IndexConfig, tensors: dict[str, torch.Tensor]):
        config.validate()
        missing = [k for k in _TENSOR_KEYS if k not in tensors]
        if missing:
            raise IndexFormatError(f"index tensors missing: {missing}")
        C, V, d = config.num_clusters, config.vocab_size, config.hidden_size
        expect = {"centroids": (C, d), "radius": (C,), "norm_min": (C,), "norm_max": (C,), "bias_max": (C,),
                  "perm": (V,), "offsets": (C + 1,), "assignment": (V,)}
        for k, shape in expect.items():
            if tuple(tensors[k].shape) != shape:
                raise IndexFormatError(f"index tensor {k!r} has shape {tuple(tensors[k].shape)}, expected {shape}")
        self.config = config
        self.tensors = tensors

    def __getattr__(self, name: str) -> torch.Tensor:
        tensors = self.__dict__.get("tensors", {})
        if name in tensors:
            return tensors[name]
        raise AttributeError(name)

    def __repr__(self) -> str:
        c = self.config
        return (f"VocabIndex(V={c.vocab_size}, d={c.hidden_size}, C={c.num_clusters}, metric={c.metric!r}, "
                f"fingerprint={c.fingerprint!r})")

    # ------------------------------------------------------------------ build
    @classmethod
    @torch.no_grad()
    def build(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, num_clusters: Optional[int] = None,
              metric: str = "euclidean", niter: int = 10, seed: int = 0, top_m_bias: int = 4,
              base_model: Optional[str] = None, progress: bool = True, use_gpu: Optional[bool] = None) -> "VocabIndex":
        """Cluster the rows of ``weight`` [V, d] with FAISS k-means.

        GPU FAISS is used when importable and ``weight`` is on CUDA (or ``use_gpu=True``).
        """
        try:  # local: heavy import, only needed to build (and optional for the package)
            import faiss
        except ImportError as e:
            raise ImportError("building a cluster index needs FAISS: pip install faiss-cpu") from e
        from tqdm.auto import tqdm

        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"weight must be a floating [V, d] tensor, got {tuple(weight.shape)} {weight.dtype}")
        V, d = weight.shape
        if bias is not None and tuple(bias.shape) != (V,):
            raise ValueError(f"bias must have shape ({V},), got {tuple(bias.shape)}")
        C = num_clusters or default_num_clusters(V)
        cfg = IndexConfig(vocab_size=V, hidden_size=d, num_clusters=C, metric=metric, niter=niter, seed=seed,
                          top_m_bias=top_m_bias, has_bias=bias is not None,
                          fingerprint=head_fingerprint(weight, bias), head_dtype=str(weight.dtype).replace("torch.", ""),
                          base_model=base_model)
        cfg.validate()
        W = weight.detach().to("cpu", torch.float32).contiguous()
        if not torch.isfinite(W).all():
            raise ValueError("head weight contains non-finite values")
        norms = W.norm(dim=1)
        X = W / norms.clamp(min=1e-30)[:, None] if metric == "spherical" else W
        Xn = np.ascontiguousarray(X.numpy())
        gpu = use_gpu if use_gpu is not None else (weight.is_cuda and hasattr(faiss, "StandardGpuResources"))
        bar = tqdm(total=niter + 2, desc=f"hf_csv index (V={V}, C={C})", disable=not progress)
        km = faiss.Kmeans(d, C, niter=niter, seed=seed, spherical=(metric == "spherical"), gpu=bool(gpu),
                          verbose=False, max_points_per_centroid=max(256, (V + C - 1) // C))
        km.train(Xn)
        bar.update(niter)
        _, assign = km.index.search(Xn, 1)
        bar.update(1)
        a = torch.from_numpy(assign[:, 0].astype(np.int64))
        cent = torch.from_numpy(km.centroids.copy())
        cnt = torch.bincount(a, minlength=C)
        # Bounds are computed against the stored centroid (whatever it is), so they are sound
        # even for empty clusters or an imperfect k-means; recompute means for Euclidean.
        if metric == "euclidean":
            sums = torch.zeros(C, d, dtype=torch.float64).index_add_(0, a, W.double())
            mean = (sums / cnt.clamp(min=1)[:, None]).float()
            cent = torch.where(cnt[:, None] > 0, mean, cent)
        else:
            cent = cent / cent.norm(dim=1, keepdim=True).clamp(min=1e-30)
        dev = (X.double() - cent.double()[a]).norm(dim=1)
        radius = torch.zeros(C, dtype=torch.float64).scatter_reduce_(0, a, dev, "amax", include_self=True)
        radius = (radius * (1 + 1e-6) + 1e-7).float()
        inf = torch.tensor(float("inf"))
        norm_min = torch.full((C,), inf).scatter_reduce_(0, a, norms, "amin", include_self=True)
        norm_max = torch.zeros(C).scatter_reduce_(0, a, norms, "amax", include_self=True)
        norm_min = torch.where(cnt > 0, norm_min * (1 - 1e-6), torch.zeros(C))
        norm_max = norm_max * (1 + 1e-6)
        b = bias.detach().to("cpu", torch.float32) if bias is not None else torch.zeros(V)
        perm = torch.argsort(a * V + torch.arange(V), stable=True)  # stable cluster order
        offsets = torch.zeros(C + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(cnt, 0)
        bias_max = torch.full((C,), -inf).scatter_reduce_(0, a, b, "amax", include_self=True)
        bias_max = torch.where(cnt > 0, bias_max, torch.full((C,), -inf))
        m = max(1, top_m_bias)
        bias_topm = torch.full((C, m), -inf)
        order = torch.argsort(b, descending=True, stable=True)
        order = order[torch.argsort(a[order], stable=True)]  # by cluster, then decreasing bias
        rank = torch.arange(V) - offsets[a[order]]
        keep = rank < m
        bias_topm[a[order][keep], rank[keep]] = b[order][keep]
        bar.update(1)
        bar.close()
        cfg.stats = {"radius_mean": float(radius.mean()), "cluster_size_max": int(cnt.max()),
                     "empty_clusters": int((cnt == 0).sum())}
        tensors = {"centroids": cent.float().contiguous(), "radius": radius, "norm_min": norm_min, "norm_max": norm_max,
                   "bias_max": bias_max, "bias_topm": bias_topm, "perm": perm, "offsets": offsets, "assignment": a}
        return cls(cfg, tensors)

    # -------------------------------------------------------------- identity
    def check_head(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        """Raise :class:`FingerprintMismatchError` unless this index was built for this head."""
        check_head_identity("index", self.config, weight, bias)

    def for_head(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> "VocabIndex":
        """This index with every quantity the cluster bound's soundness needs recomputed from the live head:
        radius (against the stored centroids and assignment), the norm range (spherical) and each cluster's
        largest bias (docs/certificates.md §1.2). The fingerprint samples rows, so a head edited in an unsampled
        row passed it, and a stale stored radius no longer bounded that row. Raises
        :class:`FingerprintMismatchError` when a recomputed term exceeds the stored one (built for another head),
        :class:`IndexFormatError` for a non-finite centroid or an assignment out of range."""

        V, d = weight.shape
        C = int(self.centroids.shape[0])
        a = self.assignment.to("cpu", torch.int64)
        if tuple(a.shape) != (V,) or (V and (int(a.min()) < 0 or int(a.max()) >= C)):
            raise IndexFormatError(f"the index's assignment must hold {V} cluster ids in [0, {C})")
        cent = self.centroids.to("cpu", torch.float32)
        if not bool(torch.isfinite(cent).all()):
            raise IndexFormatError("the index's centroids are not finite")
        W = weight.detach().to("cpu", torch.float32)
        norms = W.norm(dim=1)
        spherical = self.config.metric == "spherical"
        cnt = torch.bincount(a, minlength=C)
        radius = torch.zeros(C, dtype=torch.float64)
        for lo in range(0, V, 16384):  # chunked: no V x d float64 copy
            hi = min(V, lo + 16384)
            X = W[lo:hi]
            if spherical:  # normalized in float32, as build() does
                X = X / norms[lo:hi].clamp(min=1e-30)[:, None]
            X = X.double()
            radius.scatter_reduce_(0, a[lo:hi], (X - cent.double()[a[lo:hi]]).norm(dim=1), "amax", include_self=True)
        radius = (radius * (1 + 1e-6) + 1e-7).float()  # as build(): the same head gives the same bits
        inf = torch.tensor(float("inf"))
        norm_min = torch.full((C,), inf).scatter_reduce_(0, a, norms, "amin", include_self=True)
        norm_min = torch.where(cnt > 0, norm_min * (1 - 1e-6), torch.zeros(C))
        norm_max = torch.zeros(C).scatter_reduce_(0, a, norms, "amax", include_self=True) * (1 + 1e-6)
        b = bias.detach().to("cpu", torch.float32) if bias is not None else torch.zeros(V)
        bias_max = torch.full((C,), -inf).scatter_reduce_(0, a, b, "amax", include_self=True)
        bias_max = torch.where(cnt > 0, bias_max, torch.full((C,), -inf))
        stored = self.radius.to("cpu", torch.float32)
        over = ~(radius <= stored)  # NaN stored radii count as over
        if bool(over.any()):
            c = int(over.nonzero()[0, 0])
            raise FingerprintMismatchError(
                f"the cluster index does not fit this head: cluster {c} has radius {float(radius[c]):.6g} > stored "
                f"{float(stored[c]):.6g} ({int(over.sum())} clusters): built for another head, or the head was edited")
        tensors = dict(self.tensors, radius=radius, norm_min=norm_min, norm_max=norm_max, bias_max=bias_max)
        return VocabIndex(self.config, {k: v.to(self.centroids.device) for k, v in tensors.items()})

    def to(self, device: Union[str, torch.device]) -> "VocabIndex":
        return VocabIndex(self.config, {k: v.to(device) for k, v in self.tensors.items()})
