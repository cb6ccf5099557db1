"""Whisper's temperature-fallback decision (``logprob_threshold``, ``no_speech_threshold``) on the certified head.

After each segment's greedy round Whisper computes ``avg_logprob`` = mean over the segment's steps of
log_softmax(kept scores)[chosen token] and falls back to sampling, or skips the segment, when it is below
``logprob_threshold``. The certified head keeps stock's logits on S only, so the normalizer of each kept row is known
to an interval (hf_csv.processors records it per step). Guarantee (docs/certificates.md §3.6): the decision Whisper
takes is stock's. Where the intervals decide it, from them; elsewhere the steps are replayed on the stock head
(widest interval first) until they do, and when every step is replayed the value is stock's own function on stock's
rows. The value returned to Whisper is then not stock's number, only on its side of the threshold: it is compared
and never returned (a call that would return the scores, ``return_dict_in_generate`` / ``return_segments``, uses the
full head). The no-speech probability comes from the detector's own forward, which runs on the stock head
(:class:`hf_csv.processors.FullHeadDuring`).

Patch points (scoped to one certified call on one model, restored on exit): the instance's
``_need_fallback`` (to learn which row is decided) and ``_retrieve_avg_logprobs``.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .errors import CSVError
from .head import CSVSession, active_session
from .processors import _U32, stock_processed
from .scope import instance_override

__all__ = ["threshold_of", "whisper_decisions", "avg_logprob_interval"]


def threshold_of(model: nn.Module, kwargs: dict) -> Optional[float]:
    """The ``logprob_threshold`` a Whisper ``generate`` call will use (kwargs, passed config, model's config)."""
    if not hasattr(type(model), "_retrieve_avg_logprobs"):
        return None
    for src in (kwargs, kwargs.get("generation_config"), getattr(model, "generation_config", None)):
        v = src.get("logprob_threshold") if isinstance(src, dict) else getattr(src, "logprob_threshold", None)
        if v is not None:
            return float(v)
    return None


def _step_lp(row: torch.Tensor, tok: int) -> torch.Tensor:
    """Stock's log-prob of ``tok`` in one kept score row, with stock's op (row-wise, so the same bits)."""
    return F.log_softmax(row[None].float(), dim=-1)[0, tok].to(row.dtype)


def avg_logprob_interval(rows: list, tokens: torch.Tensor, steps: list, index: int,
                         exact_lp: dict) -> tuple[float, float, list]:
    """[lo, hi] containing stock's avg_logprob of one sequence, and per step the interval width.

    ``rows``: the kept score rows (this call's), ``steps``: hf_csv's per-step records, ``exact_lp``: step -> stock's
    own log-prob where known (replayed or exact steps). Widths are 0 on those."""
    n = len(rows)
    lo_sum = hi_sum = abs_sum = 0.0
    widths = []
    for t in range(n):
        tok = int(tokens[t])
        if t in exact_lp:
            v = float(exact_lp[t])
            lo_sum, hi_sum, abs_sum = lo_sum + v, hi_sum + v, abs_sum + abs(v)
            widths.append(0.0)
            continue
        st = steps[t]
        r = rows[t].double()
        x = float(r[tok])
        lse_s = float(torch.logsumexp(r, 0))  # the kept row's finite entries: stock's values on S
        lse_hi = float(torch.logaddexp(torch.tensor(lse_s, dtype=torch.float64), st["logR"][index]))
        rho = math.exp(min(0.0, float(st["logC"][index]) - lse_s))  # summation error, relative to Z >= Z_S
        if not (math.isfinite(x) and math.isfinite(lse_s)) or rho >= 0.5:
            lo, hi = -math.inf, math.inf
        else:
            slack = 4 * _U32 * (abs(x) + abs(lse_hi) + 1.0)
            if rows[t].dtype != torch.float32:
                slack += (abs(x - lse_s) + abs(x - lse_hi) + 1.0) * torch.finfo(rows[t].dtype).eps
            lo = x - lse_hi - math.log1p(rho) - slack
            hi = x - lse_s - math.log1p(-rho) + slack
        lo_sum, hi_sum, abs_sum = lo_sum + lo, hi_sum + hi, abs_sum + max(abs(lo), abs(hi))
        widths.append(hi - lo)
    # stock adds n float32 values in order and divides by n: within n·u·Σ|v| and one more rounding
    sum_slack = (n + 2) * _U32 * abs_sum
    lo, hi = (lo_sum - sum_slack) / n, (hi_sum + sum_slack) / n
    return lo - abs(lo) * 2 * _U32, hi + abs(hi) * 2 * _U32, widths


def _replay(sess: CSVSession, st: dict, index: int) -> torch.Tensor:
    """Stock's kept score row of one step: the stock head on the step's hidden states (all rows, as stock ran it),
    then every processor of the call but hf_csv's own, on this row's input ids."""
    raw = sess.head.stock(st["H"])[index:index + 1]
    return stock_processed(sess, raw, st["ids"][index:index + 1])[0]


def _certified_avg(sess: CSVSession, orig, scores: Any, tokens: torch.Tensor, temperature: float):
    """Stock's decision for one sequence of a greedy round, or None when the kept rows are stock's own (a round on
    the full head): then stock's function runs on them."""
    if not sess.lp_record:
        return None
    index = sess.extra.get("_lp_index")
    steps = sess.lp_steps
    rows = list(scores)
    if index is None or len(rows) > len(steps) or (temperature or 0.0) > 0.0:
        raise CSVError("hf_csv: Whisper's avg-logprob was requested outside the decision hf_csv certifies "
                       f"({len(rows)} kept rows, {len(steps)} recorded steps); please report this and generate "
                       "without csv_config meanwhile")
    if len(rows) > tokens.shape[0]:  # stock's trimming (scores past the tokens, or tokens before the scores)
        rows = rows[: tokens.shape[0]]
    else:
        tokens = tokens[-len(rows):]
    thr = float(sess.extra["_lp_threshold"])
    st = sess.extra.setdefault("whisper_thresholds", {"decisions": 0, "decided_by_bounds": 0, "replayed_steps": 0,
                                                      "fully_replayed": 0, "steps": 0})
    st["decisions"] += 1
    st["steps"] += len(rows)
    exact_lp: dict = {}
    for t, rec in enumerate(steps[: len(rows)]):
        if rec["exact_all"] or bool(rec["exact"][index]):
            exact_lp[t] = float(_step_lp(rows[t], int(tokens[t])))
    replayed = False
    while True:
        lo, hi, widths = avg_logprob_interval(rows, tokens, steps, index, exact_lp)
        if hi < thr or lo >= thr:
            st["decided_by_bounds"] += int(not replayed)
            # a value on stock's side of the threshold: Whisper only compares it with the threshold
            return torch.tensor(hi if hi < thr else lo, dtype=torch.float64)
        todo = sorted((t for t in range(len(rows)) if t not in exact_lp), key=lambda t: -widths[t])
        if not todo:
            break
        replayed = True
        for t in todo[: max(1, len(todo) // 4)]:  # widest first, a quarter at a time
            rows[t] = _replay(sess, steps[t], index).to(rows[t].dtype)
            exact_lp[t] = float(_step_lp(rows[t], int(tokens[t])))
            st["replayed_steps"] += 1
    st["fully_replayed"] += 1
    return orig(rows, tokens, temperature)  # every row is stock's: stock's own value


@contextlib.contextmanager
def whisper_decisions(model: nn.Module, sess: CSVSession):
    """Scoped instance overrides of ``_need_fallback`` and ``_retrieve_avg_logprobs`` for one certified call whose
    ``logprob_threshold`` hf_csv certifies (``sess.scores_internal``, threshold in ``sess.extra``)."""
    if not sess.scores_internal:
        yield
        return

    def need_fallback(orig):
        def _need_fallback(seek_sequence, seek_outputs, index, *args, **kwargs):
            s = active_session(model)
            if s is None:
                return orig(seek_sequence, seek_outputs, index, *args, **kwargs)
            s.extra["_lp_index"] = int(index)
            try:
                return orig(seek_sequence, seek_outputs, index, *args, **kwargs)
            finally:
                s.extra["_lp_index"] = None
        return _need_fallback

    def avg_logprobs(_bound):
        orig = getattr(type(model), "_retrieve_avg_logprobs")  # a staticmethod: the plain function
        def _retrieve_avg_logprobs(scores, tokens, temperature):
            s = active_session(model)
            out = None if s is None else _certified_avg(s, orig, scores, tokens, temperature)
            return orig(scores, tokens, temperature) if out is None else out
        return _retrieve_avg_logprobs

    with instance_override(model, "_need_fallback", need_fallback), \
            instance_override(model, "_retrieve_avg_logprobs", avg_logprobs):
        yield
