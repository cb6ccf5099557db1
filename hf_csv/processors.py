"""``CSVLogitsProcessor``: checks the sub-vocabulary certificate *after* the other processors.

Why it is needed: the head certifies the top-k (or the ε-mass) of the *raw* logits. A processor
that lowers particular tokens (repetition penalty, suppress tokens, bad words, min-length, ...)
can push a certified token below tokens that were never computed (they hold -inf). Such
processors only lower scores, so every token outside S still satisfies
``processed_i <= raw_i <= ob`` where ``ob`` is the certificate's bound on uncomputed logits:

* top-k certificate: ``ob`` = the k-th largest exact logit in S (S = {U_i >= τ}, τ <= that value);
* beam (ε-certificate, T = 1): ``ob`` = max log-prob in S + ln(ε/2) (each uncomputed token's
  upper bound carries at most ε/2 of the mass relative to the top).

So if the k-th largest *processed* score exceeds ``ob`` the selected tokens are provably the
stock ones. Rows that fail are recomputed with the full head and all preceding processors are
re-run on the batch (counted as ``verify_reruns``), so the output is always certified.

Standalone use (``logits_processor=[CSVLogitsProcessor()]`` without a ``csv_config``) is the
identity; with ``record=True`` it keeps one record per step of what was verified.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from transformers import LogitsProcessor

from .errors import CSVError
from .head import CSVSession, StepStash

__all__ = ["CSVLogitsProcessor"]


class CSVLogitsProcessor(LogitsProcessor):
    """Enforces / records the per-step certificate of the certified head (put last in the list).

    Args:
        record: keep ``self.records`` (one dict per step: rows, rows re-run with the full head).
    """

    csv_kind = "csv"  # how hf_csv.generation classifies it: its own processor, always safe

    def __init__(self, record: bool = False):
        self.record = record
        self.records: list = []
        self.session: Optional[CSVSession] = None  # bound by hf_csv.generation for one call

    def bind(self, session: Optional[CSVSession]) -> "CSVLogitsProcessor":
        self.session = session
        return self

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
        st = StepStash(H=last.H[:, p], logits=last.logits[:, p], mask=last.mask[:, p])
        raw = st.logits.float()
        k = min(sess.k, raw.shape[1])
        if sess.draft and k > 1:
            # a sampled draft may use any distribution it returns; it only needs a finite row
            bad = ~torch.isfinite(scores.amax(1).float())
            return self._rerun(input_ids, scores, sess, st, raw, bad)
        if sess.mode == "topk":
            # k-th largest (a max for greedy: ~10x cheaper than topk over V)
            ob = raw.amax(1) if k == 1 else raw.topk(k, dim=1).values[:, -1]
            if sess.softcap:
                ob = torch.tanh(ob / sess.softcap) * sess.softcap
        else:  # beam: bound in log-prob space
            ob = raw.amax(1) - torch.logsumexp(raw, 1) + math.log(sess.config.beam_epsilon / 2)
        # rows that fell back already hold the full head: nothing outside S
        ob = torch.where(st.mask.all(1), torch.full_like(ob, float("-inf")), ob)
        kth = scores.amax(1).float() if k == 1 else scores.float().topk(k, dim=1).values[:, -1]
        # top-k: uncomputed tokens are < τ <= ob, so equality is still certified; beam: <= ob
        bad = ~(kth >= ob) if sess.mode == "topk" else ~(kth > ob)
        return self._rerun(input_ids, scores, sess, st, raw, bad)

    def _rerun(self, input_ids, scores, sess, st, raw, bad):
        """Recompute the ``bad`` rows with the full head and re-run the preceding processors."""
        nbad = int(bad.sum())
        if self.record:
            self.records.append({"rows": int(scores.shape[0]), "reruns": nbad})
        if nbad == 0:
            return scores
        sess.verify_reruns += nbad
        raw = raw.clone()  # the stash views the model's output logits: never write into them
        idx = bad.nonzero(as_tuple=True)[0]
        full = sess.head.full(st.H[idx]).to(st.logits.dtype).float()
        if sess.softcap:
            full = torch.tanh(full / sess.softcap) * sess.softcap
        if sess.softcap:
            raw = torch.tanh(raw / sess.softcap) * sess.softcap
        raw[idx] = full
        new = torch.log_softmax(raw, dim=-1) if sess.mode == "beam" else raw
        for p in sess.processors or ():
            if p is self:
                break
            new = p(input_ids, new)
        return new
