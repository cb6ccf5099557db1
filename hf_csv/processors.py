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
        if sess is not None and sess.check_replaces is not None and (
                sess.mode != "nucleus" or not sess.verify or sess.last is None):
            # this processor took the top-p warper's place, and this step's row is stock's (the call or the head
            # call went to the full head, e.g. a stopping criterion declined it after the list was built)
            return sess.top_p_proc(input_ids, scores)
        if sess is None or not sess.verify or sess.mode not in ("topk", "beam", "threshold", "sample", "nucleus"):
            return scores
        last = sess.last
        if last is None:
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
        if sess.draft and k > 1:
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
                if classify_processor(proc) == "order":  # e.g. temperature: the same increasing map on all
                    ob = proc(input_ids, ob)
            ob = ob[:, 0].masked_fill(bound == float("-inf"), float("-inf"))  # complete rows: nothing outside
            if sess.mode == "threshold":
                bad = _min_p_unsure(scores.float(), ob, sess.min_p)
            elif sess.ts_proc is not None:
                bad = _timestamp_unsure(sess, input_ids, scores, ob, last.mask[:, p])
            else:
                kth = scores.amax(1).float() if k == 1 else scores.float().topk(k, dim=1).values[:, -1]
                bad = ~(kth > ob)
        else:  # beam, ε-certificate (mode="epsilon"): bound in log-prob space
            r = raw.float()
            ob = r.amax(1) - torch.logsumexp(r, 1) + math.log(sess.config.beam_epsilon / 2)
            ob = torch.where(last.mask[:, p].all(1), torch.full_like(ob, float("-inf")), ob)
            kth = scores.float().topk(k, dim=1).values[:, -1]
            bad = ~(kth > ob)
        return self._rerun(input_ids, scores, sess, last, p, bad)

    def _draw(self, input_ids, scores, sess, last, p):
        """Sampling with lowering processors (docs/certificates.md §2.3): the Gumbel-max draw over the final
        scores, exact because every uncomputed token's final score plus its noise is below the head's cut
        (lowering processors only lower) and the winner here reaches it; rows where it does not are
        recomputed with the full head (the same noise, so the law stays exact). Returns a one-hot row
        (the winner keeps its score) from which stock's sampler can only draw the winner."""
        g = last.noise[:, p]
        val = scores.float() + g
        win = val.max(1)
        bad = ~(win.values >= last.cut[:, p]) | ~torch.isfinite(win.values)
        tok = win.indices
        if bool(bad.any()):
            idx = bad.nonzero(as_tuple=True)[0]
            full = self._rerun(input_ids, scores, sess, last, p, bad)
            tok = tok.clone()
            tok[idx] = (full[idx].float() + g[idx]).argmax(1)
            scores = full
        elif self.record:
            self.records.append({"rows": int(scores.shape[0]), "reruns": 0})
        out = torch.full_like(scores, float("-inf"))
        r = torch.arange(scores.shape[0], device=scores.device)
        # the winner's own score, finite (a row whose every score is -inf keeps stock's behaviour: all -inf)
        out[r, tok] = scores[r, tok]
        return out

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
            if classify_processor(proc) == "order":  # temperature; lowering processors only lower, bounds stay bounds
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
    return ~ok


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
