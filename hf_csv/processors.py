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
import time
from dataclasses import dataclass
from typing import Optional

import torch
from transformers import LogitsProcessor

from hf_csv_kernels.verify import gumbel_shift, row_max_finite

from . import checks
from .certificate import value_interval
from .errors import CSVError
from .head import CSVSession, flush_guard
from .plan import Epsilon, ExactBeam, Nucleus, Sample, Threshold, TopK, classify_processor, masks_only

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


@dataclass(frozen=True)
class _Prefix:
    """The processors a CSVLogitsProcessor follows in one call: all of them (``every``), the order-preserving ones
    the bound ``ob`` runs through (``orders``), those a full-head re-run repeats (``runs``: not identity wrappers),
    and whether all of them only mask (:func:`hf_csv.policy.masks_only`)."""

    owner: object
    every: tuple
    orders: tuple
    runs: tuple
    masks_only: bool


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

    @staticmethod
    def _compiled_step(sess: CSVSession, input_ids: torch.Tensor, stock: bool = False) -> bool:
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
        if sess is None or sess.guard_pending is None:
            return self._process(input_ids, scores, sess)
        t0 = time.perf_counter()
        out = self._process(input_ids, scores, sess)
        flush_guard(sess, time.perf_counter() - t0)  # the speed guard compares whole steps (hf_csv.head)
        return out

    def _process(self, input_ids: torch.LongTensor, scores: torch.FloatTensor,
                 sess: Optional[CSVSession]) -> torch.FloatTensor:
        if sess is not None and sess.replaced is not None and (
                not isinstance(sess.plan, Nucleus) or sess.last is None):
            # this processor took the top-p warper's place, and this step's row is stock's (the call or the head
            # call went to the full head, e.g. a stopping criterion declined it after the list was built)
            return sess.replaced(input_ids, scores)
        if sess is not None and sess.compiled.start is not None and self._compiled_step(sess, input_ids):
            return scores
        if sess is not None and sess.compiled.stock and self._compiled_step(sess, input_ids, stock=True):
            return scores  # stock's head ran in the graph (the speed guard's choice): stock's row, nothing to check
        plan = sess.plan if sess is not None else None
        if sess is None or not plan.verify or not isinstance(plan, (TopK, Epsilon, ExactBeam, Threshold, Sample,
                                                                     Nucleus)):
            return scores
        last = sess.last
        if isinstance(plan, ExactBeam):
            return self._beam_box(input_ids, scores, sess, last)
        if last is None:
            if sess.whisper.record:
                _record_lp(sess, input_ids, None, None, 0, None)
            return scores  # the head call of this step used the full head: nothing to check
        if last.logits.shape[0] != scores.shape[0]:  # pragma: no cover - invariant of generate
            raise CSVError(f"hf_csv: processor batch {scores.shape[0]} != head batch {last.logits.shape[0]}")
        p = last.position(input_ids.shape[1])
        if isinstance(plan, Sample):
            return self._draw(input_ids, scores, sess, last, p)
        if isinstance(plan, Nucleus):
            return self._nucleus(input_ids, scores, sess, last, p)
        raw = last.logits[:, p]
        k = min(getattr(plan, "k", 1), raw.shape[1])
        if sess.draft and k > 1 and getattr(plan, "check_after", None) is None:
            # a sampled draft may use any distribution it returns; it only needs a finite row
            bad = ~torch.isfinite(scores.amax(1).float())
            return self._rerun(input_ids, scores, sess, last, p, bad)
        if isinstance(plan, (TopK, Threshold)):
            bound = last.bound[:, p]
            ob = bound.to(raw.dtype)
            if sess.post is not None and not sess.post.identity:
                ob = sess.post.apply(ob)
            ob = ob.float()[:, None]
            for proc in self._prefix(sess).orders:  # e.g. temperature
                ob = proc(input_ids, ob)
            ob = ob[:, 0].masked_fill(bound == float("-inf"), float("-inf"))  # complete rows: nothing outside
            ts = None
            if isinstance(plan, Threshold):
                bad = checks.min_p_unsure(scores.float(), ob, plan.min_p)
            elif plan.ts_proc is not None:
                bad, ts = _timestamp_unsure(sess, input_ids, scores, ob, last.mask[:, p])
            else:
                bad = checks.topk_unsure(scores, ob, k)
                if last.slack is not None and not sess.draft:
                    bad |= self._set_undecided(input_ids, scores, sess, last, p, k, ob)
            if sess.whisper.record:
                out = self._rerun(input_ids, scores, sess, last, p, bad)
                _record_lp(sess, input_ids, out, last, p, bad, ts)
                return out
        else:  # beam, ε-certificate (mode="epsilon"): bound in log-prob space
            ob = checks.epsilon_bound(raw, last.mask[:, p].all(1), sess.config.beam_epsilon)
            bad = checks.topk_unsure(scores, ob, k)
        return self._rerun(input_ids, scores, sess, last, p, bad)

    def _prefix(self, sess: CSVSession) -> "_Prefix":
        """The processors before this one in the call's list, sorted once per call (the list is fixed per call)."""
        got = sess.check_prefix
        if got is None or got.owner is not self:
            every = []
            for proc in sess.processors or ():
                if proc is self:
                    break
                every.append(proc)
            ident = [getattr(proc, "csv_identity", False) for proc in every]
            got = sess.check_prefix = _Prefix(
                owner=self, every=tuple(every),
                orders=tuple(p for p, i in zip(every, ident) if not i and classify_processor(p) == "order"),
                runs=tuple(p for p, i in zip(every, ident) if not i), masks_only=masks_only(every))
        return got

    def _before_me(self, input_ids: torch.Tensor, x: torch.Tensor, sess: CSVSession) -> torch.Tensor:
        """``x`` through the processors that run before this one (each maps every token's score by a non-decreasing
        function of that score: "order" and "lower" kinds), as stock runs them."""
        for proc in self._prefix(sess).every:
            x = proc(input_ids, x)
        return x

    def _processed_interval(self, input_ids, sess, last, p, scores: Optional[torch.Tensor] = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(f(lo), f(hi)) fp32 [B, V]: the processors before this one applied to the bounds of stock's values at
        position ``p`` (hf_csv.certificate.value_interval); each token's processed score lies between them.

        Where every processor before this one only masks (:func:`hf_csv.policy.masks_only`: each token's output is
        its input or −inf, the set chosen from ``input_ids`` alone) or returns its input, f is one mask M, read off
        this step's processed ``scores`` = f(raw): on a finite raw value, M holds the token iff its score is −inf
        (where raw is −inf so are lo and hi). Then f(x) = where(M, −inf, x) on lo and hi, without running the
        processors twice over V (Whisper's suppressions: about a third of a certified step on whisper-tiny.en)."""
        raw = last.logits[:, p]
        lo, hi = value_interval(last.acc[:, p], last.slack[:, p], raw.dtype)
        lo, hi = lo.to(raw.dtype), hi.to(raw.dtype)
        if scores is not None and self._prefix(sess).masks_only:
            M = (scores == float("-inf")) & torch.isfinite(raw)
            return lo.float().masked_fill(M, float("-inf")), hi.float().masked_fill(M, float("-inf"))
        return (self._before_me(input_ids, lo, sess).float(), self._before_me(input_ids, hi, sess).float())

    def _set_undecided(self, input_ids, scores, sess, last, p, k, ob) -> torch.Tensor:
        """Rows whose processed top-``k`` set could differ from stock's (docs/certificates.md §2.0): the values on S
        are within their slack of stock's, so each token's processed score lies in [f(lo), f(hi)]; the set T of our
        top k is stock's when min over T of f(lo) exceeds every other token's f(hi) and the bound outside S."""
        slack = last.slack[:, p]
        if last.acc is None or not bool((slack > 0).any()):
            return torch.zeros(scores.shape[0], dtype=torch.bool, device=scores.device)
        f_lo, f_hi = self._processed_interval(input_ids, sess, last, p, scores)
        return checks.set_unsure(scores, f_lo, f_hi, k, ob, slack)

    def _draw(self, input_ids, scores, sess, last, p):
        """Sampling with lowering processors (docs/certificates.md §2.3): the Gumbel-max draw over the final
        scores, exact because every uncomputed token's final score plus its noise is below the head's cut
        (lowering processors only lower) and the winner here reaches it; rows where it does not are
        recomputed with the full head (the same noise, so the law stays exact). Returns a one-hot row
        (the winner keeps its score) from which stock's sampler can only draw the winner."""
        g = last.noise[:, p]
        slack = last.slack[:, p] if last.slack is not None and last.acc is not None else None
        bad, tok, m = checks.gumbel_unsure(
            scores, g, last.cut[:, p], None if last.shift is None else last.shift[:, p], slack,
            lambda: self._processed_interval(input_ids, sess, last, p, scores))
        if bool(bad.any()):
            idx = bad.nonzero(as_tuple=True)[0]
            full = self._rerun(input_ids, scores, sess, last, p, bad)
            tok = tok.clone()
            tok[idx] = ((full[idx].float() - m[idx]) + g[idx]).argmax(1)
            scores = full
        elif self.record:
            self.records.append({"rows": int(scores.shape[0]), "reruns": 0})
        return checks.winner_only(scores, tok)

    def _nucleus(self, input_ids, scores, sess, last, p):
        """Top-p without a top-k (docs/certificates.md §3.5), in the warper's place: stock's warper output where
        the bounds decide every token's membership of the nucleus, else the full row through stock's warper."""
        warper = sess.plan.top_p_proc
        S = last.mask[:, p]
        up = checks.raise_by_dtype(last.upper[:, p], sess.out_dtype)
        for proc in self._prefix(sess).orders:  # temperature
            up = proc(input_ids, up)
        complete = S.all(1)
        remove, bad = checks.nucleus_decide(scores, S, up, float(warper.top_p))
        bad &= ~complete
        st = sess.reports.setdefault("nucleus", {"rows": 0, "decided_by_bounds": 0, "complete_rows": 0,
                                               "rows_rerun": 0})
        st["rows"] += int(scores.shape[0])
        st["complete_rows"] += int(complete.sum())
        st["rows_rerun"] += int(bad.sum())
        st["decided_by_bounds"] += int((~bad & ~complete).sum())
        out = scores.masked_fill(remove, warper.filter_value)
        fix = bad | complete
        if bool(fix.any()):
            src = self._rerun(input_ids, scores, sess, last, p, bad) if bool(bad.any()) else scores
            idx = fix.nonzero(as_tuple=True)[0]
            out[idx] = warper(input_ids[idx], src[idx])  # stock's warper on stock's rows (it works row by row)
        elif self.record:
            self.records.append({"rows": int(scores.shape[0]), "reruns": 0})
        return out

    def _beam_box(self, input_ids, scores, sess, last):
        """Token-identical beam search (docs/certificates.md §3.10): stash, for hf_csv.beam, an interval
        [lo, hi] around stock's processed log-prob of every computed token and a bound ``ob`` on every other
        token's; return the scores unchanged (the representative row stock's bookkeeping runs on)."""
        if sess.beam.step is not None:
            raise CSVError("hf_csv: a certified beam step's intervals were not read by the beam bookkeeping; please "
                           "report this (generate without csv_config meanwhile)")
        x = scores.float()
        if last is None:  # the head call used the full head: stock's row, exactly
            sess.beam.step = BeamStep(lo=x, hi=x, rep=x, ob=torch.full_like(x[:, 0], float("-inf")), subvocab=False)
            return scores
        p = last.position(input_ids.shape[1])
        complete = last.mask[:, p].all(1)
        if bool(complete.all()):  # every row over the budget: the head returned stock's rows
            sess.beam.step = BeamStep(lo=x, hi=x, rep=x, ob=torch.full_like(x[:, 0], float("-inf")), subvocab=False)
            return scores
        lo, hi, ob = beam_logprob_box(sess, input_ids, last, p, stop=self)
        lo = torch.where(complete[:, None], x, torch.minimum(lo, x))
        hi = torch.where(complete[:, None], x, torch.maximum(hi, x))
        sess.beam.step = BeamStep(lo=lo, hi=hi, rep=x, ob=ob.masked_fill(complete, float("-inf")))
        if self.record:
            self.records.append({"rows": int(scores.shape[0]), "reruns": 0})
        return scores

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
        # stock's values: its GEMM over all B·P rows (a GEMM on fewer rows may round differently), once per head call
        if last.stock_full is None:
            last.stock_full = sess.head.stock(last.H.reshape(B * P, d)).view(B, P, -1)
        full = last.stock_full[:, p]
        raw[idx] = full[idx].to(raw.dtype)
        if sess.post is not None and not sess.post.identity:
            raw = sess.post.apply(raw)
        new = raw.float()
        if isinstance(sess.plan, Epsilon) and sess.plan.beams:
            new = torch.log_softmax(new, dim=-1)
        for proc in self._prefix(sess).runs:  # (not a no-speech detector's forward: once is enough)
            new = proc(input_ids, new)
        return new


def _timestamp_unsure(sess: CSVSession, input_ids: torch.Tensor, x: torch.Tensor, ob: torch.Tensor,
                      computed: torch.Tensor) -> torch.Tensor:
    """Rows where Whisper's timestamp processor, run next on this vector, might not give stock's argmax
    (:func:`hf_csv.checks.timestamp_decision`, docs/certificates.md §3.4).

    The processor (a) masks tokens by rules that read only ``input_ids`` and (b), after them, masks all text
    tokens when logsumexp(timestamps) > max(text) in log-probabilities. Its masks are read by running it on a
    probe on which (b) cannot fire unless the text is already all masked."""
    proc = sess.plan.ts_proc
    tb = int(proc.timestamp_begin)
    probe = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    probe[:, tb:] = -1e4
    M = proc(input_ids, probe) == float("-inf")
    xm = x.double().masked_fill(M, float("-inf"))
    alive = (~computed & ~M).any(1)
    ok, ts_won = checks.timestamp_decision(xm, tb, ob, alive, getattr(proc, "_detect_timestamp_from_logprob", True))
    st = sess.reports.setdefault("timestamps", {"rows": 0, "equal_after_rules": 0, "timestamp_decided": 0,
                                              "text_decided": 0, "rows_rerun": 0})
    n = int(x.shape[0])
    st["rows"] += n
    st["equal_after_rules"] += int((~alive).sum())
    st["timestamp_decided"] += int((alive & ok & ts_won).sum())
    st["text_decided"] += int((alive & ok & ~ts_won).sum())
    st["rows_rerun"] += int((~ok).sum())
    # for the avg-logprob record: the rule masks, and the rows whose text the logsumexp rule masks (in stock too)
    return ~ok, (M, ts_won)


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
        if (int(getattr(inner, "start_of_trans_offset", 2)) <= 1 and sess.last is not None
                and input_ids.shape[1] == getattr(inner, "begin_index", -1)):
            inner(input_ids, self._stock_scores(input_ids, sess))  # reads that row, returns it unchanged
            return scores
        fed = sess.fed_total
        sess.exact_depth += 1
        try:
            return inner(input_ids, scores)
        finally:
            sess.exact_depth -= 1
            sess.fed_total = fed

    def _stock_scores(self, input_ids: torch.Tensor, sess: CSVSession) -> torch.Tensor:
        last = sess.last
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


@dataclass
class BeamStep:
    """One beam step's processed log-probs as intervals (beam_exact mode; read by hf_csv.beam).

    ``lo`` <= stock's value <= ``hi`` on every token the head computed (float32, [N, V]); ``rep`` (what stock's own
    bookkeeping receives) lies inside; every other token's stock value is <= ``ob`` ([N], -inf on complete rows)."""

    lo: torch.Tensor
    hi: torch.Tensor
    rep: torch.Tensor
    ob: torch.Tensor
    subvocab: bool = True  # some row is a sub-vocabulary row (False: every row is stock's, the step is exact)


def beam_logprob_box(sess: CSVSession, input_ids: torch.Tensor, last, p: int, stop: Optional[LogitsProcessor] = None):
    """(lo [N, V], hi [N, V], ob [N]) for one beam step (docs/certificates.md §3.10): the interval of stock's
    log_softmax (:func:`hf_csv.checks.logprob_box`), then the processors. Those allowed here (hf_csv.policy) act
    token by token, monotone and never raising, so running them on the lo row and on the hi row brackets stock's
    processed value, and ``ob`` stays a bound on every token outside S."""
    lo, hi, ob = checks.logprob_box(last.logits[:, p], last.mask[:, p],
                                    checks.raise_by_dtype(last.upper[:, p].double(), sess.out_dtype))
    for proc in sess.processors or ():
        if proc is stop:
            break
        if not (isinstance(proc, CSVLogitsProcessor) or getattr(proc, "csv_identity", False)):
            lo, hi = proc(input_ids, lo), proc(input_ids, hi)
    return lo, hi, ob


def _record_lp(sess: CSVSession, input_ids: torch.Tensor, out: Optional[torch.Tensor], last, p: int,
               exact: Optional[torch.Tensor], ts=None) -> None:
    """One greedy step of a Whisper round with ``logprob_threshold`` (read by hf_csv.whisper): per row, an upper
    bound on the mass stock's kept score row has outside S (log R, absolute), a bound on its float32 summation
    error (log C, absolute), the hidden states (to replay the stock head where the decision needs it) and the input
    ids. Rows whose kept row is stock's own (full head, re-run) are marked exact."""
    if out is None:  # the head call used the full head: the kept rows are stock's
        sess.whisper.steps.append({"exact_all": True, "ids": input_ids})
        return
    B = out.shape[0]
    S = last.mask[:, p]
    up = checks.raise_by_dtype(last.upper[:, p].double(), sess.out_dtype)
    x = out.double()
    outside = ~S
    if ts is not None:
        M, text_masked = ts
        outside = outside & ~M
        outside[text_masked] = False  # stock's logsumexp rule masks all text on these rows too (certified)
    logR = torch.logsumexp(torch.where(outside, up, torch.full_like(up, float("-inf"))), 1)
    m, _, _, C = checks.normalizer_terms(x, up, outside)
    ex = exact.clone() if exact is not None else torch.zeros(B, dtype=torch.bool, device=out.device)
    ex |= S.all(1)
    sess.whisper.steps.append({"exact_all": False, "ids": input_ids, "H": last.H[:, p].detach().clone(),
                          "logR": logR.cpu(), "logC": (torch.log(C) + m).cpu(), "exact": ex.cpu()})


class GumbelCoupledDraw(LogitsProcessor):
    """Last processor of both models' lists in Gumbel-coupled assisted sampling (``CSVConfig(speculative="gumbel")``,
    docs/speculative.md): the token at index t is argmax(processed scores + g_t), with the call's noise g_t of index
    t. Returns a one-hot row (the winner keeps its score) so that stock's sampler and the verify can only take it.
    On the draft it makes the proposal; on the target it turns each verified row into its keyed draw (a no-op on
    a row the certified head already drew, mode ``"sample"``), also the row stock samples from itself in a round
    without drafts.

    The draft's token may come from any rule: the emitted tokens are the target's draws whatever the draft
    proposes (only the acceptance rate depends on it). Records the drawn token's probability for the assistant's
    confidence stop (:class:`hf_csv.candidate.DraftConfidenceStop`): exact from the row when the row has more than
    one finite score, else the certified head's estimate for the same draw (mode ``"sample"``). Batch size 1.
    """

    csv_kind = "csv"

    def __init__(self, session: CSVSession, always: bool = True) -> None:
        self.session = session
        # False: the target keeps its processed rows (output_scores) and this draws only in a round without drafts,
        # where stock samples from the row itself (hf_csv.candidate sets the flag)
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
