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
import math
import time
from dataclasses import dataclass
from typing import Optional

import torch
from transformers import LogitsProcessor

from hf_csv_kernels.verify import gumbel_shift, row_max_finite

from .certificate import _f32_down, _f32_up, value_interval
from .errors import CSVError
from .head import CSVSession, flush_guard
from .policy import classify_processor, masks_only

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
        compiled = calls == sess.extra.get("_calls_seen")
        sess.extra["_calls_seen"] = calls
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
        if sess is not None and sess.check_replaces is not None and (
                sess.mode != "nucleus" or not sess.verify or sess.last is None):
            # this processor took the top-p warper's place, and this step's row is stock's (the call or the head
            # call went to the full head, e.g. a stopping criterion declined it after the list was built)
            return sess.top_p_proc(input_ids, scores)
        if sess is not None and "_static_start" in sess.extra and self._compiled_step(sess, input_ids):
            return scores
        if sess is not None and sess.extra.get("_compiled_stock") and self._compiled_step(sess, input_ids, stock=True):
            return scores  # stock's head ran in the graph (the speed guard's choice): stock's row, nothing to check
        if sess is None or not sess.verify or sess.mode not in ("topk", "beam", "beam_exact", "threshold", "sample",
                                                                "nucleus"):
            return scores
        last = sess.last
        if sess.mode == "beam_exact":
            return self._beam_box(input_ids, scores, sess, last)
        if last is None:
            if sess.lp_record:
                _record_lp(sess, input_ids, None, None, 0, None)
            return scores  # the head call of this step used the full head: nothing to check
        if last.logits.shape[0] != scores.shape[0]:  # pragma: no cover - invariant of generate
            raise CSVError(f"hf_csv: processor batch {scores.shape[0]} != head batch {last.logits.shape[0]}")
        p = last.position(input_ids.shape[1])
        if sess.mode == "sample":
            return self._draw(input_ids, scores, sess, last, p)
        if sess.mode == "nucleus":
            return self._nucleus(input_ids, scores, sess, last, p)
        raw = last.logits[:, p]
        k = min(sess.k, raw.shape[1])
        if sess.draft and k > 1 and sess.check_after is None:
            # a sampled draft may use any distribution it returns; it only needs a finite row
            bad = ~torch.isfinite(scores.amax(1).float())
            return self._rerun(input_ids, scores, sess, last, p, bad)
        if sess.mode in ("topk", "threshold"):
            bound = last.bound[:, p]
            ob = bound.to(raw.dtype)
            if sess.post is not None and not sess.post.identity:
                ob = sess.post.apply(ob)
            ob = ob.float()[:, None]
            for proc in sess.processors or ():
                if proc is self:
                    break
                if classify_processor(proc) == "order" and not getattr(proc, "csv_identity", False):  # e.g. temperature
                    ob = proc(input_ids, ob)
            ob = ob[:, 0].masked_fill(bound == float("-inf"), float("-inf"))  # complete rows: nothing outside
            ts = None
            if sess.mode == "threshold":
                bad = _min_p_unsure(scores.float(), ob, sess.min_p)
            elif sess.ts_proc is not None:
                bad, ts = _timestamp_unsure(sess, input_ids, scores, ob, last.mask[:, p])
            else:
                kth = scores.amax(1).float() if k == 1 else scores.float().topk(k, dim=1).values[:, -1]
                bad = ~(kth > ob)
                if last.slack is not None and not sess.draft:
                    bad |= self._set_undecided(input_ids, scores, sess, last, p, k, ob)
            if sess.lp_record:
                out = self._rerun(input_ids, scores, sess, last, p, bad)
                _record_lp(sess, input_ids, out, last, p, bad, ts)
                return out
        else:  # beam, ε-certificate (mode="epsilon"): bound in log-prob space
            r = raw.float()
            ob = r.amax(1) - torch.logsumexp(r, 1) + math.log(sess.config.beam_epsilon / 2)
            ob = torch.where(last.mask[:, p].all(1), torch.full_like(ob, float("-inf")), ob)
            kth = scores.float().topk(k, dim=1).values[:, -1]
            bad = ~(kth > ob)
        return self._rerun(input_ids, scores, sess, last, p, bad)

    def _before_me(self, input_ids: torch.Tensor, x: torch.Tensor, sess: CSVSession) -> torch.Tensor:
        """``x`` through the processors that run before this one (each maps every token's score by a non-decreasing
        function of that score: "order" and "lower" kinds), as stock runs them."""
        for proc in sess.processors or ():
            if proc is self:
                break
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
        before = []
        for proc in sess.processors or ():
            if proc is self:
                break
            before.append(proc)
        if scores is not None and masks_only(before):
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
        top = scores.float().topk(k, dim=1).indices
        inside = f_lo.gather(1, top).amin(1)
        others = f_hi.scatter(1, top, float("-inf")).amax(1)
        return ~((inside > others) & (inside > ob)) & (slack > 0)

    def _draw(self, input_ids, scores, sess, last, p):
        """Sampling with lowering processors (docs/certificates.md §2.3): the Gumbel-max draw over the final
        scores, exact because every uncomputed token's final score plus its noise is below the head's cut
        (lowering processors only lower) and the winner here reaches it; rows where it does not are
        recomputed with the full head (the same noise, so the law stays exact). Returns a one-hot row
        (the winner keeps its score) from which stock's sampler can only draw the winner."""
        g = last.noise[:, p]
        cut = last.cut[:, p]
        # the shift the head fixed with the cut (its units); a row without a cut (a full row) uses its own max
        m = gumbel_shift(row_max_finite(scores))
        if last.shift is not None:
            m = torch.where(torch.isfinite(cut), last.shift[:, p], m)
        m = m[:, None]
        val = (scores.float() - m) + g
        win = val.max(1)
        bad = ~(win.values >= cut) | ~torch.isfinite(win.values)
        tok = win.indices
        slack = last.slack[:, p] if last.slack is not None else None
        if slack is not None and last.acc is not None and bool((slack > 0).any()):
            # the winner must win for every processed score within the values' slack, and reach the cut (§2.0)
            f_lo, f_hi = self._processed_interval(input_ids, sess, last, p, scores)
            mine = ((f_lo - m).gather(1, tok[:, None]) + g.gather(1, tok[:, None]))[:, 0]
            rest = ((f_hi - m) + g).scatter(1, tok[:, None], float("-inf")).amax(1)
            bad |= ~((mine > rest) & (mine >= cut)) & (slack > 0)
        if bool(bad.any()):
            idx = bad.nonzero(as_tuple=True)[0]
            full = self._rerun(input_ids, scores, sess, last, p, bad)
            tok = tok.clone()
            tok[idx] = ((full[idx].float() - m[idx]) + g[idx]).argmax(1)
            scores = full
        elif self.record:
            self.records.append({"rows": int(scores.shape[0]), "reruns": 0})
        return _winner_only(scores, tok)

    def _nucleus(self, input_ids, scores, sess, last, p):
        """Top-p without a top-k (docs/certificates.md §3.5), in the warper's place: stock's warper output where
        the bounds decide every token's membership of the nucleus, else the full row through stock's warper."""
        warper = sess.top_p_proc
        S = last.mask[:, p]
        up = last.upper[:, p]
        if sess.out_dtype != torch.float32:  # stock's logit is the fp32 accumulator rounded to the model dtype
            up = up + up.abs() * torch.finfo(sess.out_dtype).eps
        for proc in sess.processors or ():
            if proc is self:
                break
            if classify_processor(proc) == "order" and not getattr(proc, "csv_identity", False):  # temperature
                up = proc(input_ids, up)
        complete = S.all(1)
        remove, bad = _nucleus_decide(scores, S, up, float(warper.top_p))
        bad &= ~complete
        st = sess.extra.setdefault("nucleus", {"rows": 0, "decided_by_bounds": 0, "complete_rows": 0,
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
        if sess.beam_step is not None:
            raise CSVError("hf_csv: a certified beam step's intervals were not read by the beam bookkeeping; please "
                           "report this (generate without csv_config meanwhile)")
        x = scores.float()
        if last is None:  # the head call used the full head: stock's row, exactly
            sess.beam_step = BeamStep(lo=x, hi=x, rep=x, ob=torch.full_like(x[:, 0], float("-inf")), subvocab=False)
            return scores
        p = last.position(input_ids.shape[1])
        complete = last.mask[:, p].all(1)
        if bool(complete.all()):  # every row over the budget: the head returned stock's rows
            sess.beam_step = BeamStep(lo=x, hi=x, rep=x, ob=torch.full_like(x[:, 0], float("-inf")), subvocab=False)
            return scores
        lo, hi, ob = beam_logprob_box(sess, input_ids, last, p, stop=self)
        lo = torch.where(complete[:, None], x, torch.minimum(lo, x))
        hi = torch.where(complete[:, None], x, torch.maximum(hi, x))
        sess.beam_step = BeamStep(lo=lo, hi=hi, rep=x, ob=ob.masked_fill(complete, float("-inf")))
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
        if sess.mode == "beam":
            new = torch.log_softmax(new, dim=-1)
        for proc in sess.processors or ():
            if proc is self:
                break
            if not getattr(proc, "csv_identity", False):  # (a no-speech detector's forward: once is enough)
                new = proc(input_ids, new)
        return new


# Slack of the timestamp decision (docs/certificates.md §3.4): stock compares fl(logsumexp(fl(log_softmax(x))[ts]))
# with fl(max(fl(log_softmax(x))[text])) under its normalizer, this vector under another; each side is within a few
# ulps of its magnitude plus the logsumexp's summation error over <= ~1,500 terms (γ_1500 < 1e-4) of the exact
# difference. 1e-3 + 1e-5·magnitude is a ten-fold margin over that.
_TS_SLACK_ABS, _TS_SLACK_REL = 1e-3, 1e-5


def _timestamp_unsure(sess: CSVSession, input_ids: torch.Tensor, x: torch.Tensor, ob: torch.Tensor,
                      computed: torch.Tensor) -> torch.Tensor:
    """Rows where Whisper's timestamp processor, run next on this vector, might not give stock's argmax.

    The processor (a) masks tokens by rules that read only ``input_ids`` and (b), after them, masks all text
    tokens when logsumexp(timestamps) > max(text) in log-probabilities (the normalizer cancels). Its masks are
    read by running it on a probe on which (b) cannot fire unless the text is already all masked. Sure when
    * no uncomputed token survives the masks: both vectors are then equal after them; or
    * the text max here is above ``ob`` (so it is stock's) and clear of the timestamp logsumexp by the slack:
      the same decision, and the same argmax after it (uncomputed tokens <= ob < that max); or
    * the timestamp logsumexp (exact: the block is always computed) clears max(text max, ob): both mask the
      text and keep equal timestamp blocks.
    """
    proc = sess.ts_proc
    tb = int(proc.timestamp_begin)
    probe = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    probe[:, tb:] = -1e4
    M = proc(input_ids, probe) == float("-inf")
    xm = x.double().masked_fill(M, float("-inf"))
    alive = (~computed & ~M).any(1)
    ob = ob.double()
    if not getattr(proc, "_detect_timestamp_from_logprob", True):  # rules only: a lowering processor
        ok = ~alive | (xm.amax(1) > ob)
        ts_won = torch.zeros_like(ok)
    else:
        a = xm[:, :tb].amax(1)
        t = torch.logsumexp(xm[:, tb:], 1)
        mag = torch.where(torch.isfinite(a), a.abs(), 0) + torch.where(torch.isfinite(t), t.abs(), 0)
        slack = _TS_SLACK_ABS + _TS_SLACK_REL * mag
        clear = (t - a).abs() > slack
        ts_won = (t - torch.maximum(a, ob)) > slack
        ok = ~alive | ((a > ob) & clear) | ts_won
        ts_won = ts_won | ((a > ob) & clear & (t > a))
    st = sess.extra.setdefault("timestamps", {"rows": 0, "equal_after_rules": 0, "timestamp_decided": 0,
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
        sess.extra["processor_stock_rows"] = sess.extra.get("processor_stock_rows", 0) + B
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


_U32 = 2.0 ** -24


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
    """(lo [N, V], hi [N, V], ob [N]) for one beam step (docs/certificates.md §3.10).

    Stock computes fl(log_softmax(fp32(logits))) over V, then the processors. On S the logits are stock's; the
    normalizer lies in [LSE_S, log(e^{LSE_S} + R)] with R = Σ_{i∉S} e^{upper_i}, and stock's float32 summation in any
    order errs by at most C (the §3.6 charge), so stock's log-prob of i ∈ S lies in
    [x_i − LSE_hi − log1p(ρ) − s_i, x_i − LSE_S − log1p(−ρ) + s_i], ρ = C/Z_S, s_i = 4u(|x_i| + |LSE_hi| + 1), rounded
    outward to float32. The processors allowed here (hf_csv.policy) act token by token, monotone and never raising,
    so running them on the lo row and on the hi row brackets stock's processed value; a token outside S has stock
    value <= bound − LSE_S − log1p(−ρ) + s (bound: the head's per-row bound on uncomputed logits)."""
    raw = last.logits[:, p]
    S = last.mask[:, p]
    up = last.upper[:, p].double()
    if sess.out_dtype != torch.float32:  # stock's logit is the fp32 accumulator rounded to the model dtype
        up = up + up.abs() * torch.finfo(sess.out_dtype).eps
    up = up + up.abs() * 4 * _U32  # (U + E was summed in float32)
    bound = torch.where(S, torch.full_like(up, float("-inf")), up).amax(1)  # every token outside S is below
    x = raw.double()
    neg = torch.full_like(x, float("-inf"))
    fin = torch.isfinite(x)
    m = torch.where(fin, x, neg).amax(1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    out = ~S
    t_s = torch.exp(torch.where(fin, x - m[:, None], neg))
    t_o = torch.where(out, torch.exp((up - m[:, None]).clamp(max=700.0)), torch.zeros_like(up))
    zs, R = t_s.sum(1), t_o.sum(1)
    z_hi = zs + R
    d_s = torch.where(fin, m[:, None] - x, torch.zeros_like(x))
    d_o = torch.where(out, (m[:, None] - up).clamp(min=0.0), torch.zeros_like(up))
    C = _round_charge(t_s, d_s, z_hi) + _round_charge(t_o, d_o, z_hi) + 64 * _U32 * z_hi
    rho = C / zs
    lse_s = m + torch.log(zs)
    lse_hi = m + torch.log(z_hi)
    ok = (rho < 0.5) & torch.isfinite(lse_hi) & (zs > 0)
    rho = torch.where(ok, rho, torch.zeros_like(rho))
    a = (lse_hi + torch.log1p(rho))[:, None]
    b = (lse_s + torch.log1p(-rho))[:, None]
    s = 4 * _U32 * (x.abs() + lse_hi.abs()[:, None] + 1.0)
    lo64 = torch.where(fin, x - a - s, neg)
    hi64 = torch.where(fin, x - b + s, neg)
    ob = bound - b[:, 0] + 4 * _U32 * (bound.abs() + lse_hi.abs() + 1.0)
    # rows whose normalizer interval is not usable: every decision on them fails (hf_csv.beam restarts the call)
    lo64 = torch.where(ok[:, None] & fin, lo64, torch.where(fin, torch.full_like(x, float("-inf")), neg))
    hi64 = torch.where(ok[:, None] & fin, hi64, torch.where(fin, torch.full_like(x, float("inf")), neg))
    ob = torch.where(ok, ob, torch.full_like(ob, float("inf")))
    lo, hi = _f32_down(lo64), _f32_up(hi64)
    for proc in sess.processors or ():
        if proc is stop:
            break
        if not (isinstance(proc, CSVLogitsProcessor) or getattr(proc, "csv_identity", False)):
            lo, hi = proc(input_ids, lo), proc(input_ids, hi)
    return lo, hi, _f32_up(ob)


def _round_charge(t: torch.Tensor, d: torch.Tensor, z_hi: torch.Tensor) -> torch.Tensor:
    """Per row, a bound (in units of the row's max term) on the rounding error of stock's float32 sum of the terms
    exp(x_k − max) whose upper bounds are ``t`` (``d``: lower bounds on max − x_k), in *any* summation order
    (docs/certificates.md §3.6). Each addition errs by at most min(u·Z, its smaller operand), which charges a term
    t >= τ = u·Z at most 3τ and a smaller one t·(3 + log2(τ/t)); exp within 1 ulp and the rounded subtraction
    x_k − max add u·(2t + max_{d' >= d} d'·e^{−d'})."""
    tau = (_U32 * z_hi)[:, None]
    small = t < tau
    ratio = torch.where(small, tau / t.clamp(min=1e-300), torch.ones_like(t))
    c = torch.where(small, t * (3.0 + torch.log2(ratio)), 3.0 * tau.expand_as(t))
    g = torch.where(d >= 1.0, d * torch.exp(-d), torch.full_like(d, math.exp(-1.0)))
    c = c + _U32 * (2.0 * t + g)
    return torch.where(t > 0, c, torch.zeros_like(c)).sum(1)


def _record_lp(sess: CSVSession, input_ids: torch.Tensor, out: Optional[torch.Tensor], last, p: int,
               exact: Optional[torch.Tensor], ts=None) -> None:
    """One greedy step of a Whisper round with ``logprob_threshold`` (read by hf_csv.whisper): per row, an upper
    bound on the mass stock's kept score row has outside S (log R, absolute), a bound on its float32 summation
    error (log C, absolute), the hidden states (to replay the stock head where the decision needs it) and the input
    ids. Rows whose kept row is stock's own (full head, re-run) are marked exact."""
    if out is None:  # the head call used the full head: the kept rows are stock's
        sess.lp_steps.append({"exact_all": True, "ids": input_ids})
        return
    B = out.shape[0]
    S = last.mask[:, p]
    up = last.upper[:, p].double()
    if sess.out_dtype != torch.float32:  # stock's logit is the fp32 accumulator rounded to the model dtype
        up = up + up.abs() * torch.finfo(sess.out_dtype).eps
    x = out.double()
    fin = torch.isfinite(x)
    m = torch.where(fin, x, torch.full_like(x, float("-inf"))).amax(1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    outside = ~S
    if ts is not None:
        M, text_masked = ts
        outside = outside & ~M
        outside[text_masked] = False  # stock's logsumexp rule masks all text on these rows too (certified)
    neg = torch.full_like(up, float("-inf"))
    logR = torch.logsumexp(torch.where(outside, up, neg), 1)
    t_s = torch.exp(torch.where(fin, x - m[:, None], neg))
    t_o = torch.where(outside, torch.exp((up - m[:, None]).clamp(max=700.0)), torch.zeros_like(up))
    z_hi = t_s.sum(1) + t_o.sum(1)
    d_s = torch.where(fin, m[:, None] - x, torch.zeros_like(x))
    d_o = torch.where(outside, (m[:, None] - up).clamp(min=0.0), torch.zeros_like(up))
    C = _round_charge(t_s, d_s, z_hi) + _round_charge(t_o, d_o, z_hi) + 64 * _U32 * z_hi
    ex = exact.clone() if exact is not None else torch.zeros(B, dtype=torch.bool, device=out.device)
    ex |= S.all(1)
    sess.lp_steps.append({"exact_all": False, "ids": input_ids, "H": last.H[:, p].detach().clone(),
                          "logR": logR.cpu(), "logC": (torch.log(C) + m).cpu(), "exact": ex.cpu()})


def _nucleus_sigma(V: int) -> float:
    """Relative slack of the top-p decision (docs/certificates.md §3.5): stock's float cumulative probability
    C'_j = fl(cumsum(fl(softmax(sorted x))))_j is within a factor 1 ± (γ_{V−1} + γ_{j−1} + 6u) of the exact C_j
    in any summation order (exp within 1 ulp); 3·V·u + 1e-3 is a margin of more than 1.4 over that."""
    return 3.0 * V * 2.0 ** -24 + 1e-3


def _nucleus_decide(scores: torch.Tensor, S: torch.Tensor, up: torch.Tensor, top_p: float):
    """(remove [B, V], unsure [B]) for the top-p warper on stock's vector, from this vector (exact on S, -inf
    elsewhere) and ``up`` (>= stock's final score of every token outside S).

    Stock removes token i iff C_i = mass of the tokens sorted at or below it <= 1 − top_p. With Z_S the exact mass
    on S and R >= the mass outside S (both relative to the row's max on S), for i in S:
    C_i >= (Σ_{j∈S, x_j<x_i} + e_i) / (Z_S + R) and C_i <= (Σ_{j∈S, x_j<=x_i} + R) / Z_S (ties in any order); every
    token outside S has C <= (R + Σ_{j∈S, x_j<=ob}) / Z_S, ob = its largest bound. A row is sure when every
    decision clears 1 − top_p by the relative slack σ."""
    B, V = scores.shape
    thr = 1.0 - top_p
    sig = _nucleus_sigma(V)
    x = scores.double()
    remove = torch.zeros(B, V, dtype=torch.bool, device=scores.device)
    bad = torch.zeros(B, dtype=torch.bool, device=scores.device)
    for b in range(B):  # rows are few; each works on its (small) computed set only
        fin = torch.isfinite(x[b])
        idx = fin.nonzero(as_tuple=True)[0]
        if idx.numel() == 0:
            bad[b] = True
            continue
        v = x[b, idx]
        m = v.max()
        e = torch.exp(v - m)
        zs = e.sum()
        unc = ~S[b]
        ub = up[b].double()[unc]
        R = torch.exp(ub - m).sum() if ub.numel() else torch.zeros((), dtype=torch.float64)
        if not bool(torch.isfinite(R)):
            bad[b] = True
            continue
        sv, order = torch.sort(v)
        cum = torch.cat([torch.zeros(1, dtype=torch.float64, device=v.device), torch.cumsum(e[order], 0)])
        lt = cum[torch.searchsorted(sv, v, right=False)]
        le = cum[torch.searchsorted(sv, v, right=True)]
        lo = (lt + e) / (zs + R)
        hi = (le + R) / zs
        rm = hi < thr * (1 - sig)
        keep = lo > thr * (1 + sig)
        ok = bool((rm | keep).all())
        if ub.numel():
            ob = ub.max()
            below = cum[torch.searchsorted(sv, ob.reshape(1), right=True)][0]
            ok &= bool((R + below) / zs < thr * (1 - sig))
        if ok:
            remove[b, idx[rm]] = True
        else:
            bad[b] = True
    return remove, bad


# Relative slack of the min-p decision in float arithmetic (docs/certificates.md §3.3): the warper compares
# fl(fl(exp(fl(x_i − m)))·r) with fl(min_p·r), r = fl(1/Z); the rounding moves x_i − m by at most
# ~8u + u·|x_i − m| in log space (exp within 1 ulp). 1e-5 is a 20-fold margin over that, which also
# covers an exp accurate to ~100 ulps.
_MIN_P_SLACK = 1e-5


def _min_p_unsure(x: torch.Tensor, ob: torch.Tensor, min_p: float) -> torch.Tensor:
    """Rows where the min-p warper's decision on this vector might differ from its decision on stock's.

    Sure when (a) every uncomputed token's final score (<= ``ob``) is clearly below m + ln(min_p), so stock
    removes it, as it is removed here (-inf, or a post-map value <= ob); and (b) every finite computed score
    is clear of the threshold, so both vectors give it the same decision (the normalizer cancels).
    m is the row max here, which is stock's max since every uncomputed score is below m.
    """
    lm = math.log(min_p)
    m = x.amax(1)
    gap_out = (m + lm) - ob
    out_ok = (ob == float("-inf")) | (gap_out > _MIN_P_SLACK * (1 + (m - ob).abs()))
    fin = torch.isfinite(x)
    dist = (x - m[:, None] - lm).abs()
    near = fin & ~(dist > _MIN_P_SLACK * (1 + (x - m[:, None]).abs()))
    return ~out_ok | near.any(1) | ~torch.isfinite(m)


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
            if not sess.extra.pop("_gumbel_no_drafts", False):
                return scores
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
                conf = float(sess.extra.get("_draft_conf", {}).get(key, 1.0))
            sess.extra["_draft_conf_last"] = conf
        return _winner_only(scores, torch.tensor([tok], device=scores.device))


def _winner_only(scores: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """The row stock's sampler can only draw ``tok`` from: the winner keeps its own score, every other token -inf
    (a row whose every score is -inf keeps stock's behaviour: all -inf)."""
    out = torch.full_like(scores, float("-inf"))
    r = torch.arange(scores.shape[0], device=scores.device)
    out[r, tok] = scores[r, tok]
    return out
