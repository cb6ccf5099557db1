"""``CSVLogitsProcessor``: checks the sub-vocabulary certificate *after* the other processors.

Why it is needed: the head certifies the top-k of the head's raw logits. Between the head and the
token choice stand the architecture's post-head map (Cohere's scale, Gemma-2's softcap: rounding in
the model dtype can merge values into ties) and the logits processors; a processor that lowers
particular tokens (repetition penalty, suppress tokens, bad words, min-length, ...) can push a
certified token below tokens that were never computed. Every such step is monotone on the tokens it
does not lower, so each uncomputed token's final score is at most

    ob = order_processors(post(bound))

where ``bound`` is the head's per-row bound on uncomputed raw logits (``CertResult.bound``). If the
k-th largest final score is *strictly* above ``ob`` the selected tokens are provably stock's (strict,
because argmax breaks ties toward the lowest index, which may be an uncomputed token). Rows that
fail are recomputed with the stock head and all preceding processors are re-run on the batch
(counted as ``verify_reruns``), so the output is always stock's.

Beam search (``mode="epsilon"`` only, approximate): ``ob`` = max log-prob in S + ln(ε/2).

Standalone use (``logits_processor=[CSVLogitsProcessor()]`` without a ``csv_config``) is the
identity; with ``record=True`` it keeps one record per step of what was verified.
"""
from __future__ import annotations

import contextvars
import math
from typing import Optional

import torch
from transformers import LogitsProcessor

from .errors import CSVError
from .head import CSVSession
from .policy import classify_processor

__all__ = ["CSVLogitsProcessor"]

# id(processor) -> session, per context: a processor instance reused by concurrent calls (threads)
# sees the session of its own call
_BOUND: contextvars.ContextVar[dict] = contextvars.ContextVar("hf_csv_bound_processors", default={})


class CSVLogitsProcessor(LogitsProcessor):
    """Enforces / records the per-step certificate of the certified head (placed last in the list, or right
    after the top-k warper in sampling: every later warper then sees stock's vector).

    Args:
        record: keep ``self.records`` (one dict per step: rows, rows re-run with the full head).
    """

    csv_kind = "csv"  # how hf_csv.policy classifies it: its own processor, always safe

    def __init__(self, record: bool = False):
        self.record = record
        self.records: list = []

    def bind(self, session: Optional[CSVSession]) -> "CSVLogitsProcessor":
        """Bind to ``session`` in the calling context (the ``generate`` call that built the list)."""
        bound = dict(_BOUND.get())
        bound[id(self)] = session
        _BOUND.set(bound)
        return self

    @property
    def session(self) -> Optional[CSVSession]:
        return _BOUND.get().get(id(self))

    @torch.no_grad()
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        sess = self.session
        if sess is None or not sess.verify or sess.mode not in ("topk", "beam"):
            return scores
        last = sess.last
        if last is None:
            return scores  # the head call of this step used the full head: nothing to check
        if last.logits.shape[0] != scores.shape[0]:  # pragma: no cover - invariant of generate
            raise CSVError(f"hf_csv: processor batch {scores.shape[0]} != head batch {last.logits.shape[0]}")
        p = last.position(input_ids.shape[1])
        raw = last.logits[:, p]
        k = min(sess.k, raw.shape[1])
        if sess.draft and k > 1:
            # a sampled draft may use any distribution it returns; it only needs a finite row
            bad = ~torch.isfinite(scores.amax(1).float())
            return self._rerun(input_ids, scores, sess, last, p, bad)
        if sess.mode == "topk":
            bound = last.bound[:, p]
            ob = bound.to(raw.dtype)
            if sess.post is not None and not sess.post.identity:
                ob = sess.post.apply(ob)
            ob = ob.float()[:, None]
            for proc in sess.processors or ():
                if proc is self:
                    break
                if classify_processor(proc) == "order":  # e.g. temperature: the same increasing map on all
                    ob = proc(input_ids, ob)
            ob = ob[:, 0].masked_fill(bound == float("-inf"), float("-inf"))  # complete rows: nothing outside
            kth = scores.amax(1).float() if k == 1 else scores.float().topk(k, dim=1).values[:, -1]
            bad = ~(kth > ob)
        else:  # beam, ε-certificate (mode="epsilon"): bound in log-prob space
            r = raw.float()
            ob = r.amax(1) - torch.logsumexp(r, 1) + math.log(sess.config.beam_epsilon / 2)
            ob = torch.where(last.mask[:, p].all(1), torch.full_like(ob, float("-inf")), ob)
            kth = scores.float().topk(k, dim=1).values[:, -1]
            bad = ~(kth > ob)
        return self._rerun(input_ids, scores, sess, last, p, bad)

    def _rerun(self, input_ids, scores, sess, last, p, bad):
        """Recompute the ``bad`` rows with the stock head and re-run the preceding processors."""
        nbad = int(bad.sum())
        if self.record:
            self.records.append({"rows": int(scores.shape[0]), "reruns": nbad})
        if nbad == 0:
            return scores
        sess.verify_reruns += nbad
        B, P, d = last.H.shape
        raw = last.logits[:, p].clone()  # the stash views the model's output logits: never write into them
        idx = bad.nonzero(as_tuple=True)[0]
        # stock's values: its GEMM over all B·P rows (a GEMM on fewer rows may round differently)
        full = sess.head.stock(last.H.reshape(B * P, d)).view(B, P, -1)[:, p]
        raw[idx] = full[idx].to(raw.dtype)
        if sess.post is not None and not sess.post.identity:
            raw = sess.post.apply(raw)
        new = raw.float()
        if sess.mode == "beam":
            new = torch.log_softmax(new, dim=-1)
        for proc in sess.processors or ():
            if proc is self:
                break
            new = proc(input_ids, new)
        return new
