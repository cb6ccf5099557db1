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

import contextlib
import contextvars
import copy
import time
from typing import Optional

import torch
from transformers import LogitsProcessor

from hf_csv.core.speculative import gumbel_shift, row_max_finite

from hf_csv.core import checks
from hf_csv.core.errors import CSVError
from hf_csv.transformers.session import CSVSession
from hf_csv.transformers.step import check_step, flush_guard

__all__ = ["CSVLogitsProcessor", "GumbelCoupledDraw"]

# id(processor) -> session, per context: a processor instance reused by concurrent calls (threads)
# sees the session of its own call
_BOUND: contextvars.ContextVar[dict] = contextvars.ContextVar("hf_csv_bound_processors", default={})


@contextlib.contextmanager
def binding_scope():
    """Bindings made inside (by :meth:`CSVLogitsProcessor.bind`) end with the block, also on exceptions: a
    finished call's session is not reachable from its thread's context (no call outlives its ``generate``)."""
    token = _BOUND.set(dict(_BOUND.get()))
    try:
        yield
    finally:
        _BOUND.reset(token)


class CSVLogitsProcessor(LogitsProcessor):
    """Enforces / records the per-step certificate of the certified head (placed last in the list, or right
    after the top-k warper in sampling: every later warper then sees stock's vector).

    Args:
        record: keep ``self.records`` (one dict per step: rows, rows re-run with the full head).
    """

    csv_kind = "csv"  # how hf_csv.transformers.plans classifies it: its own processor, always safe
    csv_check = True  # the check's place (beam_logprob_box stops here)

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

    @staticmethod
    def compiled_step(sess: CSVSession, input_ids: torch.Tensor, stock: bool = False) -> bool:
        """Whether this step's row came from the compiled graph (no eager head call since the last step), whose
        static head certified it with Whisper's fixed suppress list folded in (docs/certificates.md §3.9): nothing
        to check, no stash to read. A processor that lowers only at the first generated step must not fire here."""
        calls = sess.head_calls
        compiled = calls == sess.compiled.calls_seen
        sess.compiled.calls_seen = calls
        if compiled and not stock:
            for p in sess.processors or ():
                if type(p).__name__ == "SuppressTokensAtBeginLogitsProcessor" and input_ids.shape[-1] == p.begin_index:
                    raise CSVError("hf_csv: a compiled decode step reached SuppressTokensAtBeginLogitsProcessor's "
                                   "begin index, which the certified compiled head does not cover. Please report "
                                   "this; generate without csv_config meanwhile.")
        return compiled

    @torch.no_grad()
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        sess = self.session
        if sess is None or sess.step.guard_pending is None:
            return check_step(self, sess, input_ids, scores)
        t0 = time.perf_counter()
        out = check_step(self, sess, input_ids, scores)
        flush_guard(sess, time.perf_counter() - t0)  # the speed guard compares whole steps (hf_csv.transformers.step)
        return out


_MASK_ONCE: dict = {}  # stock class -> its mask-once subclass (same name)


def mask_once(p: LogitsProcessor) -> LogitsProcessor:
    """A copy of transformers' ``SuppressTokensLogitsProcessor`` ``p`` that takes its vocabulary mask once per call list
    instead of on every call. Stock's processor rebuilds the mask each time (``arange(V)`` and ``isin`` over the whole
    vocabulary), and assisted decoding calls it for every drafted and verified position (docs/benchmarks.md §10.1).
    The mask is read off stock's own processor (its output on a row of zeros: −inf exactly where it suppresses; a
    masking processor, ``hf_csv.transformers.plans.MASKS_ONLY``, whose mask comes from its settings alone, not from the scores or
    the input ids), then applied as stock applies it, ``where(mask, −inf, scores)``: the same
    scores bit for bit, in any dtype.
    The copy's class is a subclass with the same name (hf_csv.transformers.plans reads processors by class name); the caller's
    instance is untouched."""
    cls = type(p)
    sub = _MASK_ONCE.get(cls)
    if sub is None:
        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
            mask = self.__dict__.get("_csv_mask")
            if mask is None or mask.shape[-1] != scores.shape[-1] or mask.device != scores.device:
                probe = cls.__call__(self, input_ids[:1], scores.new_zeros(1, scores.shape[-1]))
                mask = self._csv_mask = torch.isneginf(probe[0])
            return torch.where(mask, -float("inf"), scores)

        sub = _MASK_ONCE[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": __name__,
                                                            "__qualname__": cls.__qualname__})
    out = copy.copy(p)
    out.__class__ = sub
    out.__dict__.pop("_csv_mask", None)
    return out


class FullHeadDuring(LogitsProcessor):
    """Wraps Whisper's no-speech detection so that it reads stock's logits: at the first step of a segment it
    either runs the model itself (a decoder prompt longer than one token), which then uses the stock head, or reads
    the scores of that step, which it is then given as stock computes them (the stock head on this step's hidden
    states, then the processors before it). It returns the scores unchanged (``csv_identity``), so the
    certificate's checks skip it."""

    csv_kind = "order"
    csv_identity = True

    def __init__(self, inner: LogitsProcessor, session: CSVSession):
        self.inner, self.session = inner, session

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        sess = self.session
        inner = self.inner
        if (int(getattr(inner, "start_of_trans_offset", 2)) <= 1 and sess.step.last is not None
                and input_ids.shape[1] == getattr(inner, "begin_index", -1)):
            inner(input_ids, self._stock_scores(input_ids, sess))  # reads that row, returns it unchanged
            return scores
        fed = sess.step.fed_total
        sess.exact_depth += 1
        try:
            return inner(input_ids, scores)
        finally:
            sess.exact_depth -= 1
            sess.step.fed_total = fed

    def _stock_scores(self, input_ids: torch.Tensor, sess: CSVSession) -> torch.Tensor:
        last = sess.step.last
        B, P, d = last.H.shape
        p = last.position(input_ids.shape[1])
        sess.reports["processor_stock_rows"] = sess.reports.get("processor_stock_rows", 0) + B
        raw = sess.head.stock(last.H.reshape(B * P, d)).view(B, P, -1)[:, p]
        return stock_processed(sess, raw, input_ids, stop=self)


def stock_processed(sess: CSVSession, raw: torch.Tensor, input_ids: torch.Tensor,
                    stop: Optional[LogitsProcessor] = None) -> torch.Tensor:
    """Stock's processed scores from stock's head output ``raw``: the post-head map, then the call's processors in
    order (up to ``stop``; hf_csv's own check and identity wrappers skipped)."""
    if sess.post is not None and not sess.post.identity:
        raw = sess.post.apply(raw)
    x = raw.float()
    for proc in sess.processors or ():
        if proc is stop:
            break
        if not (isinstance(proc, CSVLogitsProcessor) or getattr(proc, "csv_identity", False)):
            x = proc(input_ids, x)
    return x


class GumbelCoupledDraw(LogitsProcessor):
    """Last processor of both models' lists in Gumbel-coupled assisted sampling (``CSVConfig(speculative="gumbel")``,
    docs/speculative.md): the token at index t is argmax(processed scores + g_t), with the call's noise g_t of index
    t. Returns a one-hot row (the winner keeps its score) so that stock's sampler and the verify can only take it.
    On the draft it makes the proposal; on the target it turns each verified row into its keyed draw (a no-op on
    a row the certified head already drew, mode ``"sample"``), also the row stock samples from itself in a round
    without drafts.

    The draft's token may come from any rule: the emitted tokens are the target's draws whatever the draft
    proposes (only the acceptance rate depends on it). Records the drawn token's probability for the assistant's
    confidence stop (:class:`hf_csv.transformers.drafts.DraftConfidenceStop`): exact from the row when the row has more than
    one finite score, else the certified head's estimate for the same draw (mode ``"sample"``). Batch size 1.
    """

    csv_kind = "csv"

    def __init__(self, session: CSVSession, always: bool = True) -> None:
        self.session = session
        # False: the target keeps its processed rows (output_scores) and this draws only in a round without drafts,
        # where stock samples from the row itself (hf_csv.transformers.drafts sets the flag)
        self.always = always

    @torch.no_grad()
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        sess = self.session
        if not self.always:
            if not sess.assist.no_drafts:
                return scores
            sess.assist.no_drafts = False
        if scores.shape[0] != 1:
            raise CSVError("hf_csv: Gumbel-coupled drafting supports batch size 1 only (as assisted decoding)")
        key = int(input_ids.shape[1])
        x = scores.float()
        g = sess.gumbel.row(key, x.shape[1], x.device)
        tok = int(((x[0] - gumbel_shift(row_max_finite(x))[0]) + g).argmax())
        if sess.draft:  # (the target's rows need no confidence)
            if int(torch.isfinite(x[0]).sum()) > 1:
                conf = float(torch.softmax(x[0], 0)[tok])
            else:
                conf = float(sess.assist.conf.get(key, 1.0))
            sess.assist.conf_last = conf
        return checks.winner_only(scores, torch.tensor([tok], device=scores.device))
