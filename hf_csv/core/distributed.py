"""Vocabulary-parallel certified head on ``torch.distributed`` (the paper's Algorithm 2, done soundly).

Each rank holds a shard of the vocabulary (rows of the head), computes its *own* screen bounds and
candidates, and the ranks agree on the certified top-k with collectives of O(k) numbers per row —
never an all-gather of the V logits.

Certificate (top-k, per row h; proof in docs/distributed.md):

1. rank r: screen ``(est, U)`` on its rows; seeds = its local top-k of ``est``; exact values with
   a rigorous rounding bound give lower bounds ``lb = val - err`` of true logits of k distinct tokens.
2. all_gather the k lower bounds of every rank (padded with -inf). τ = k-th largest gathered lb.
   There are k distinct tokens whose true logit is >= their lb >= τ, so τ <= ℓ_(k) (the global k-th
   largest true logit).
3. rank r: S_r = {i on r : U_i >= τ}. A token in the global top-k has U_i >= ℓ_i >= ℓ_(k) >= τ, so the
   global top-k lies in ∪_r S_r.
4. all_reduce Σ_r |S_r|; rows over the global budget compute their full local shard instead (still
   local: correct whatever any one shard's size is).
5. rank r: exact logits on S_r (or the whole shard), local top-k (value, global id); all_gather them;
   the global top-k of the union is the global top-k of the full head (ties: smaller id first, as
   ``argmax``). Every rank builds the same dense logits: exact at those k ids, -inf elsewhere.

Bytes per step and row: W·k·(4 + 4 + 8) + 8 (all_gather of lb, values, ids; all_reduce of a count),
against 4·V for an all-gather of the logits.

Sharding is derived at load from the vocabulary size or a :class:`~hf_csv.core.index.VocabIndex`
(:func:`shard_tokens`), so one index artifact serves every world size. A head that transformers'
tensor-parallel plan already sharded by vocabulary (a ``DTensor`` with ``Shard(0)``) is used as is.

This module does not import transformers.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.distributed as dist

from hf_csv.core.certificate import H_MAX, H_MIN, CertifiedHead, CertResult, CertStats
from hf_csv.core.config import DEFAULT_BUDGET
from hf_csv.core.index import VocabIndex

logger = logging.getLogger(__name__)

__all__ = ["STRATEGIES", "shard_tokens", "VocabParallelHead", "CommStats", "local_shard_of"]

STRATEGIES = ("contiguous", "round_robin", "size_balanced")


def shard_tokens(vocab_size: int, world_size: int, strategy: str = "size_balanced",
                 index: Optional[VocabIndex] = None) -> list[torch.Tensor]:
    """Global token ids held by each rank (sorted int64 tensors that partition ``range(vocab_size)``).

    * ``contiguous``: equal ranges, as a tensor-parallel ``lm_head`` sharded by rows is laid out.
    * ``round_robin``: with an index, cluster c goes to rank c mod W (clusters stay whole, so per-cluster
      quantities stay local); without one, token i goes to rank i mod W.
    * ``size_balanced``: with an index, clusters largest first to the rank with the fewest tokens
      (LPT); without one, the contiguous equal split (already balanced).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown shard strategy {strategy!r}; choose one of {STRATEGIES}")
    if index is not None and index.config.vocab_size != vocab_size:
        raise ValueError(f"index covers {index.config.vocab_size} tokens, the head has {vocab_size}")
    ids = torch.arange(vocab_size)
    if strategy == "contiguous" or (strategy == "size_balanced" and index is None):
        bounds = [(r * vocab_size) // world_size for r in range(world_size + 1)]
        return [ids[bounds[r]:bounds[r + 1]] for r in range(world_size)]
    if index is None:  # round robin over tokens
        return [ids[r::world_size] for r in range(world_size)]
    assign = index.assignment.long().cpu()
    C = int(index.centroids.shape[0])
    sizes = torch.bincount(assign, minlength=C)
    owner = torch.empty(C, dtype=torch.long)
    if strategy == "round_robin":
        owner = torch.arange(C) % world_size
    else:
        load = [0] * world_size
        for c in torch.argsort(sizes, descending=True, stable=True).tolist():
            r = min(range(world_size), key=lambda j: (load[j], j))
            owner[c] = r
            load[r] += int(sizes[c])
    tok_owner = owner[assign]
    return [ids[tok_owner == r] for r in range(world_size)]


def local_shard_of(weight: torch.Tensor) -> Optional[tuple[torch.Tensor, int]]:
    """If ``weight`` is a DTensor sharded by rows (tensor parallel over the vocabulary), return the local
    rows and the global id of the first one; else None."""
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # pragma: no cover - old torch
        return None
    if not isinstance(weight, DTensor):
        return None
    pl = weight.placements
    if len(pl) != 1 or not isinstance(pl[0], Shard) or pl[0].dim != 0:
        return None
    local = weight.to_local()
    # torch's row sharding: ceil-sized chunks in rank order
    V = weight.shape[0]
    mesh = weight.device_mesh
    W, r = mesh.size(), mesh.get_local_rank()
    chunk = math.ceil(V / W)
    return local, min(r * chunk, V)


@dataclass
class CommStats:
    """What the collectives moved (per rank, payload bytes sent) and how many steps."""

    steps: int = 0
    rows: int = 0
    bytes_sent: int = 0
    full_logits_bytes: int = 0  # what an all-gather of the V logits would have sent for the same rows
    fallback_rows: int = 0
    calls: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"steps": self.steps, "rows": self.rows, "bytes_sent": self.bytes_sent,
                "full_logits_bytes": self.full_logits_bytes, "fallback_rows": self.fallback_rows,
                "ratio": self.bytes_sent / max(1, self.full_logits_bytes)}


class VocabParallelHead:
    """Certified top-k of ℓ = W h + b where this rank holds rows ``token_ids`` of W.

    Args:
        weight_rows: this rank's rows [V_r, d] (V_r may be 0).
        token_ids: their global ids [V_r] (int64); the shards of all ranks partition range(vocab_size).
        vocab_size: global V.
        bias_rows: this rank's bias entries, or None.
        budget: global max Σ_r |S_r| per row (int, or fraction of V) before the full shards are used.
        group: process group (default: the world).

    Every rank must call :meth:`topk` with the same hidden states (as in tensor parallelism, where
    the body's output is replicated). Only ``topk`` and ``full`` are offered: ``modes = {"topk"}``.
    """

    modes = frozenset({"topk"})
    bounds_uncomputed = False  # CertResult.bound is not provided: calls that need the per-row check decline

    def __init__(self, weight_rows: torch.Tensor, token_ids: torch.Tensor, vocab_size: int,
                 bias_rows: Optional[torch.Tensor] = None, budget: Union[int, float] = DEFAULT_BUDGET, group=None,
                 num_outliers: int = 16):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("VocabParallelHead needs an initialized torch.distributed process group")
        if weight_rows.dim() != 2 or token_ids.dim() != 1 or token_ids.shape[0] != weight_rows.shape[0]:
            raise ValueError(f"weight_rows [V_r, d] and token_ids [V_r] disagree: {tuple(weight_rows.shape)} "
                             f"vs {tuple(token_ids.shape)}")
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.vocab_size = int(vocab_size)
        self.hidden_size = weight_rows.shape[1]
        self.weight = weight_rows
        self.token_ids = token_ids.to(weight_rows.device, torch.long)
        self.budget = max(1, math.ceil(budget * vocab_size)) if isinstance(budget, float) else int(budget)
        # the local certified head: its screen and exact recompute (its own budget never triggers)
        self.local = (CertifiedHead(weight_rows, bias_rows, provider="screen", budget=1.0, num_outliers=num_outliers)
                      if weight_rows.shape[0] > 0 else None)
        self.comm = CommStats()
        sizes = self._all_gather(torch.tensor([weight_rows.shape[0]], dtype=torch.long, device=weight_rows.device))
        if int(sizes.sum()) != self.vocab_size:
            raise ValueError(f"shards hold {int(sizes.sum())} rows in total, the vocabulary has {self.vocab_size}")
        self.shard_sizes = sizes.view(-1).tolist()
        self.comm = CommStats()  # the size check above is setup, not per-step traffic

    # ------------------------------------------------------------ collectives
    def _all_gather(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t, group=self.group)
        self.comm.bytes_sent += t.numel() * t.element_size()
        return torch.stack(out)  # [W, ...]

    def _all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        self.comm.bytes_sent += t.numel() * t.element_size()
        return t

    # ------------------------------------------------------------ head
    def _check(self, H: torch.Tensor) -> torch.Tensor:
        if H.dim() != 2 or H.shape[1] != self.hidden_size or not H.is_floating_point():
            raise ValueError(f"hidden states must be floating [N, {self.hidden_size}], got {tuple(H.shape)}")
        return H.float()

    @torch.no_grad()
    def full(self, H: torch.Tensor) -> torch.Tensor:
        """Full fp32 logits [N, V] on every rank (an all-gather of O(V): only for rare re-runs)."""
        H = self._check(H)
        N = H.shape[0]
        width = max(self.shard_sizes)
        loc = torch.full((N, width), float("-inf"), device=H.device)
        if self.local is not None:
            loc[:, : self.weight.shape[0]] = self.local.full(H)
        ids = torch.full((width,), -1, dtype=torch.long, device=H.device)
        ids[: self.weight.shape[0]] = self.token_ids
        vals, gids = self._all_gather(loc), self._all_gather(ids)
        out = torch.empty(N, self.vocab_size, device=H.device)
        for r in range(self.world_size):
            n = self.shard_sizes[r]
            out[:, gids[r, :n]] = vals[r, :, :n]
        return out

    @torch.no_grad()
    def topk(self, H: torch.Tensor, k: int = 1, out_dtype: Optional[torch.dtype] = None,
             own_values: bool = False) -> CertResult:
        """Dense logits [N, V], identical on every rank: the exact global top-k values, -inf elsewhere.
        (``own_values``: accepted as :meth:`hf_csv.core.certificate.CertifiedHead.topk` takes it; the values here are
        always the full gather's.)"""
        H = self._check(H)
        if not 1 <= k <= self.vocab_size:
            raise ValueError(f"k must be in [1, {self.vocab_size}], got {k}")
        out_dtype = out_dtype or torch.float32
        N, dev = H.shape[0], H.device
        stats = CertStats(vocab_size=self.vocab_size)
        amax = H.float().abs().amax(1)
        finite = (amax >= H_MIN) & (amax <= H_MAX)  # NaN / inf / out-of-range rows: the full logits (below)
        Hs = torch.where(finite[:, None], H, torch.zeros_like(H))  # non-finite rows: handled below
        tau, U = self._global_tau(Hs, k, out_dtype)
        # 3-4: local candidate sets, global size
        if U is not None:
            S = U >= tau[:, None]
            counts = S.sum(1)
        else:
            S, counts = None, torch.zeros(N, dtype=torch.long, device=dev)
        total = self._all_reduce_sum(counts)
        over = (total > self.budget) | ~finite
        cand_v, cand_i = self._local_topk(H, Hs, S, over, k)
        logits, mask, sorted_key = self._global_topk(cand_v, cand_i, k, out_dtype)
        # non-finite rows: the gathered values are garbage; give them the (rare) full logits like stock
        if not bool(finite.all()):
            bad = (~finite).nonzero(as_tuple=True)[0]
            # every rank gets here (H is replicated), so the all-gather inside full() matches up
            logits[bad] = self.full(H[bad]).to(out_dtype)
            mask[bad] = True
            stats.nonfinite += len(bad)
        self._count(stats, over, total, k, sorted_key, out_dtype)
        return CertResult(logits=logits, stats=stats, mask=mask)

    def _global_tau(self, Hs: torch.Tensor, k: int, out_dtype: torch.dtype
                    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Steps 1-2: τ [N], the k-th largest lower bound gathered from every rank's seeds (<= the global k-th largest
        logit), lowered for a head of lower precision; and this rank's upper bounds U [N, V_r] (None on an empty
        shard)."""
        N, dev = Hs.shape[0], Hs.device
        kk = min(k, self.weight.shape[0])
        lb = torch.full((N, k), float("-inf"), device=dev)
        U = None
        if kk > 0:
            est, U = self.local.provider(Hs)
            seeds = est.topk(kk, dim=1).indices
            rows = torch.arange(N, device=dev).repeat_interleave(kk)
            val, err = self.local.exact(seeds.reshape(-1), rows, Hs)
            lb[:, :kk] = (val - err).view(N, kk)
        all_lb = self._all_gather(lb).permute(1, 0, 2).reshape(N, -1)
        tau = all_lb.topk(k, dim=1).values[:, -1]
        if out_dtype != torch.float32:  # keep tokens that round to a tie in a lower-precision head
            tau = tau - tau.abs() * torch.finfo(out_dtype).eps - torch.finfo(out_dtype).tiny
        return tau, U

    def _local_topk(self, H: torch.Tensor, Hs: torch.Tensor, S: Optional[torch.Tensor], over: torch.Tensor,
                    k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 5, on this rank: the exact top-k over S_r (the whole shard on the rows ``over``), as (values [N, k],
        global ids [N, k]), padded with (-inf, -1)."""
        N, dev = H.shape[0], H.device
        ninf = float("-inf")
        Vr = self.weight.shape[0]
        kk = min(k, Vr)
        cand_v = torch.full((N, k), ninf, device=dev)
        cand_i = torch.full((N, k), -1, dtype=torch.long, device=dev)
        if Vr > 0:
            dense = torch.full((N, Vr), ninf, device=dev)
            r_idx, t_idx = (S & ~over[:, None]).nonzero(as_tuple=True)
            if r_idx.numel():
                v, _ = self.local.exact(t_idx, r_idx, Hs)
                dense[r_idx, t_idx] = v
            if bool(over.any()):
                o = over.nonzero(as_tuple=True)[0]
                dense[o] = self.local.full(H[o])
            if kk == 1:  # max returns the first maximal index: ties go to the smaller id, as argmax
                tv, ti = dense.max(1, keepdim=True)
            else:
                tv, ti = dense.topk(kk, dim=1)
            cand_v[:, :kk] = tv
            cand_i[:, :kk] = torch.where(torch.isfinite(tv) | over[:, None], self.token_ids[ti], -1)
        return cand_v, cand_i

    def _global_topk(self, cand_v: torch.Tensor, cand_i: torch.Tensor, k: int, out_dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step 5, across the ranks: the global top-k of every rank's candidates, as (dense logits [N, V] in
        ``out_dtype``, the mask of the k tokens, the gathered values sorted in descending order)."""
        N, dev = cand_v.shape[0], cand_v.device
        ninf = float("-inf")
        all_v = self._all_gather(cand_v).permute(1, 0, 2).reshape(N, -1)
        all_i = self._all_gather(cand_i).permute(1, 0, 2).reshape(N, -1)
        # global top-k, ties broken by the smaller token id (as argmax / topk on a dense row)
        order = torch.argsort(all_i, dim=1, stable=True)
        all_v, all_i = all_v.gather(1, order), all_i.gather(1, order)
        valid = all_i >= 0
        key = torch.where(valid, all_v, torch.full_like(all_v, ninf))
        sorted_key, order = torch.sort(key, dim=1, descending=True, stable=True)
        top = order[:, :k]
        gv, gi = all_v.gather(1, top), all_i.gather(1, top)
        logits = torch.full((N, self.vocab_size), ninf, dtype=out_dtype, device=dev)
        mask = torch.zeros(N, self.vocab_size, dtype=torch.bool, device=dev)
        ok = gi >= 0
        rr = torch.arange(N, device=dev)[:, None].expand_as(gi)
        logits[rr[ok], gi[ok]] = gv[ok].to(out_dtype)
        mask[rr[ok], gi[ok]] = True
        return logits, mask, sorted_key

    def _count(self, stats: CertStats, over: torch.Tensor, total: torch.Tensor, k: int, sorted_key: torch.Tensor,
               out_dtype: torch.dtype) -> None:
        """The call's traffic (``self.comm``) and its stats: rows, fallbacks (``over``), |S| summed over the ranks
        (``total``), and for k = 1 the near ties among the gathered exact values."""
        N = over.shape[0]
        self.comm.steps += 1
        self.comm.rows += N
        self.comm.full_logits_bytes += N * self.vocab_size * 4
        self.comm.fallback_rows += int(over.sum())
        stats.rows += N
        stats.fallback += int(over.sum())
        stats.certified += int((~over).sum())
        sizes = total[~over]
        stats.subvocab_sum += int(sizes.sum())
        stats.subvocab_sizes.extend(sizes.tolist())
        if k == 1 and N:
            # near-ties between the winner and the runner-up among the gathered exact values
            top2 = sorted_key[:, :2]
            if top2.shape[1] == 2:
                gap = top2[:, 0] - top2[:, 1]
                tol = top2[:, 0].abs() * (torch.finfo(out_dtype).eps if out_dtype != torch.float32 else 1e-6)
                stats.near_ties += int((gap <= tol).sum())
