"""The certification of one batch in place of vLLM's head (:func:`certify_batch`): the rows of each plan
(``hf_csv.vllm.classify.RowPlan``) computed together through hf_csv's core, with vLLM's own head as "stock"
(docs/vllm.md, "What is exact, what is declined"; proofs docs/certificates.md §2, §2.0, §2.3, §3.2). No vLLM import:
vLLM's head, its kernel on a row subset and its steps after the head are passed in."""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Optional, Sequence

import torch

from hf_csv.core.certificate import H_MAX, H_MIN, CertifiedHead, value_interval
from hf_csv.core.checks import set_unsure, topk_unsure
from hf_csv.core.config import lowered_k
from hf_csv.vllm.classify import RowPlan
from hf_csv.vllm.sampler import sampler_boundary_unsure

__all__ = ["certify_batch"]

Process = Callable[[torch.Tensor], torch.Tensor]
Subset = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _Subset(Exception):
    """The core asked for stock's rows of a row subset (cannot happen after the range check): decline."""


class _Batch:
    """One call's logits for vLLM's sampler, and vLLM's own logits of the whole batch, computed at most once and
    only where some row needs stock's whole row (per-call state stays in the call)."""

    def __init__(self, H: torch.Tensor, vocab: int, stock: Callable[[], torch.Tensor]):
        self.out = torch.full((H.shape[0], vocab), float("-inf"), dtype=H.dtype, device=H.device)
        self._stock = stock
        self._logits: Optional[torch.Tensor] = None

    def stock_logits(self) -> torch.Tensor:
        if self._logits is None:
            self._logits = self._stock()
        return self._logits

    def stock_rows(self, idx: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """The core's ``stock=`` for the batch rows ``idx``: vLLM's rows, from its one call on the whole batch."""
        def fn(Hn: torch.Tensor) -> torch.Tensor:
            if Hn.shape[0] != len(idx):
                raise _Subset
            return self.stock_logits()[idx]
        return fn

    def to_vllm(self, idx: torch.Tensor, rows: torch.Tensor) -> int:
        """Hand these rows (bool over ``idx``) vLLM's own values; how many."""
        if not bool(rows.any()):
            return 0
        self.out[idx[rows]] = self.stock_logits()[idx[rows]]
        return int(rows.sum())


def certify_batch(head: CertifiedHead, H: torch.Tensor, plans: Sequence[RowPlan],
                  stock: Callable[[], torch.Tensor], process: Optional[Process] = None,
                  subset: Optional[Subset] = None) -> tuple[Optional[torch.Tensor], dict, Optional[str]]:
    """Logits [N, V] in ``H``'s dtype to hand to vLLM's sampler in place of its head's, or ``(None, counts,
    reason)`` when the batch must take vLLM's head (a hidden state out of the certificate's range).

    Greedy rows: exact values on a set S that provably holds stock's first maximum, −inf elsewhere. Sampling
    rows: 0 at one exact draw from stock's law (``RowPlan``), −inf elsewhere. ``stock()``: vLLM's own logits for
    the whole batch (called at most once, only when some row needs stock's whole row: those rows are then vLLM's
    values, and a draw that needs them uses them with the same noise, docs/certificates.md §2.3). ``counts``:
    ``certified`` rows decided from S, ``sampled`` (of those, sampling rows), ``stock_rows`` and their ``reasons``.

    ``process``: the batch's steps between the head and the sampler, every one lowering entries only
    (``hf_csv.vllm.classify.lowering_steps``; greedy rows only): fp32 [N, V] -> fp32 [N, V], vLLM's own code. A
    greedy row keeps its certificate when, processed, its winner stays above every other token within the values'
    slack and above the bound outside S (``hf_csv.core.checks.topk_unsure`` / ``set_unsure``, docs/certificates.md
    §3.2); otherwise it is vLLM's own row, which vLLM then processes as it would have.

    ``subset``: vLLM's kernel on a subset of the head's rows (``hf_csv.vllm.probe.engine_subset_matches`` passed), for
    the rows whose plan hands values to vLLM's sampler (``RowPlan.values``): vLLM's values on a set that holds
    stock's top-k after the temperature division (an uncomputed token must stay strictly below the k-th there, else
    the row is vLLM's own), −inf elsewhere: after vLLM's top-k, stock's padded row.
    """
    counts: dict[str, Any] = {"certified": 0, "sampled": 0, "stock_rows": 0, "reasons": Counter()}
    amax = H.detach().float().abs().amax(1)
    if not bool(((amax >= H_MIN) & (amax <= H_MAX)).all()):  # non-finite too
        return None, counts, "hidden state out of range"
    batch = _Batch(H, head.vocab_size, stock)
    groups: dict[RowPlan, list[int]] = {}
    for i, plan in enumerate(plans):
        groups.setdefault(plan, []).append(i)
    try:
        for plan, rows in groups.items():
            idx = torch.tensor(rows, dtype=torch.long, device=H.device)
            Hg = H if len(rows) == H.shape[0] else H[idx]
            moved: Counter = Counter()  # rows a check after the certificate hands to vLLM's own head, by reason
            if plan.temperature == 0.0:
                res = _greedy_rows(head, batch, idx, Hg, process, moved)
            elif plan.values:
                res = _values_rows(head, batch, plan, idx, Hg, subset, moved)
            else:
                res = head.sample(Hg, temperature=plan.temperature, top_k=plan.top_k, out_dtype=H.dtype,
                                  stock=batch.stock_rows(idx))
                batch.out[idx, res.tokens] = 0.0
            _tally(counts, plan, res.stats, moved)
    except _Subset:
        return None, counts, "hidden state out of range"
    return batch.out, counts, None


def _greedy_rows(head: CertifiedHead, batch: _Batch, idx: torch.Tensor, Hg: torch.Tensor,
                 process: Optional[Process], moved: Counter) -> Any:
    """Greedy rows ``idx``: the certified top-1 set's values into the batch's logits; after lowering steps
    (``process``) the rows whose processed winner is not proven stock's are vLLM's own (counted in ``moved``)."""
    d = batch.out.dtype
    # after lowering steps: a wider set (stock's top-k_head, or its top-1 where that is over the budget), so that the
    # processed winner is still in S (config.lowered_k; any set is sound)
    # (plain greedy: vLLM only takes the argmax, proven within the values' slack, so the head may compute the values
    # itself: own_values, the native one-row epilogue)
    kw = dict(k=lowered_k(1, head.vocab_size), k_min=1) if process is not None else dict(k=1, own_values=True)
    res = head.topk(Hg, out_dtype=d, stock=batch.stock_rows(idx), **kw)
    batch.out[idx] = res.logits.to(d)
    if process is not None:
        moved["processed near tie"] = batch.to_vllm(idx, _processed_unsure(res, idx, batch.out.shape[0], d, process))
    return res


def _values_rows(head: CertifiedHead, batch: _Batch, plan: RowPlan, idx: torch.Tensor, Hg: torch.Tensor,
                 subset: Optional[Subset], moved: Counter) -> Any:
    """Rows ``idx`` that hand vLLM's values on S to its sampler (``plan.values``): stock's padded row after vLLM's
    top-k, where no uncomputed token reaches the k-th and no token sits at the top-p or min-p cut; other rows are
    vLLM's own (counted in ``moved``)."""
    if subset is None:
        raise ValueError("a plan that hands values to vLLM's sampler needs its subset kernel")
    d = batch.out.dtype
    res = head.topk(Hg, k=plan.top_k, out_dtype=d, stock=batch.stock_rows(idx), subset=subset)
    batch.out[idx] = res.logits.to(d)
    # vLLM's top-k keeps the values >= the k-th after its fp32 division by T: a token outside S (at most the bound)
    # must stay strictly below it there too, or the row is vLLM's own
    T = torch.tensor(plan.temperature, dtype=torch.float32)
    x = res.logits.float() / T
    kth = x.topk(plan.top_k, dim=1).values[:, -1]
    open_ = ~((res.bound.float() / T) < kth) & (res.bound > float("-inf"))
    moved["top-k boundary"] = batch.to_vllm(idx, open_)
    # min-p and top-p after it act on the padded row as on stock's unless a token sits at their cut (vLLM's sort
    # orders equal values by the whole row)
    live = (res.bound > float("-inf")) & ~open_  # rows still on hf_csv's values
    if (plan.top_p < 1.0 or plan.min_p > 0.0) and bool(live.any()):
        cut = torch.zeros_like(live)
        cut[live] = sampler_boundary_unsure(x[live], plan.top_k, plan.top_p, plan.min_p)
        moved["top-p or min-p boundary"] = batch.to_vllm(idx, cut)
    return res


def _processed_unsure(res: Any, idx: torch.Tensor, N: int, d: torch.dtype, process: Process) -> torch.Tensor:
    """bool [len(idx)]: greedy rows of ``res`` (batch rows ``idx``) whose processed winner is not proven stock's."""
    V = res.logits.shape[1]

    def full(x: torch.Tensor) -> torch.Tensor:  # the batch's rows (the steps index rows by batch position)
        out = torch.full((N, V), float("-inf"), dtype=torch.float32, device=x.device)
        out[idx] = x.float()
        return process(out)[idx]

    scores = full(res.logits)
    lo, hi = value_interval(res.acc_dense(), res.slack, d)
    ob = res.bound.float()  # lowering steps keep every uncomputed token at or below the bound
    return topk_unsure(scores, ob, 1) | set_unsure(scores, full(lo), full(hi), 1, ob, res.slack)


def _tally(counts: dict, plan: RowPlan, st: Any, moved: Counter) -> None:
    """Add one plan's rows to ``counts``: its certified rows less those a later check ``moved`` to vLLM's head, the
    core's own fallback rows by reason (near tie, over budget)."""
    n_moved = sum(moved.values())
    counts["certified"] += st.certified - n_moved
    counts["sampled"] += st.certified if plan.temperature and not plan.values else 0
    counts["stock_rows"] += st.fallback + n_moved
    counts["reasons"].update(+moved)  # (reasons that moved no row are left out)
    near = min(max(st.near_ties, 0), st.fallback)
    if near:
        counts["reasons"]["near tie"] += near
    if st.fallback > near:
        counts["reasons"]["over budget"] += st.fallback - near
