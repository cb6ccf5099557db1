"""Whisper's temperature-fallback decision (``logprob_threshold``, ``no_speech_threshold``) on the certified head.

After each segment's greedy round Whisper computes ``avg_logprob`` = mean over the segment's steps of
log_softmax(kept scores)[chosen token] and falls back to sampling, or skips the segment, when it is below
``logprob_threshold``. The certified head keeps stock's logits on S only, so the normalizer of each kept row is known
to an interval (hf_csv.transformers.processors records it per step). Guarantee (docs/certificates.md §3.6): the decision Whisper
takes is stock's. Where the intervals decide it, from them; elsewhere the steps are replayed on the stock head
(widest interval first) until they do, and when every step is replayed the value is stock's own function on stock's
rows. The value returned to Whisper is then not stock's number, only on its side of the threshold: it is compared
and never returned (a call that would return the scores, ``return_dict_in_generate`` / ``return_segments``, uses the
full head). The no-speech probability comes from the detector's own forward, which runs on the stock head
(:class:`hf_csv.transformers.processors.FullHeadDuring`).

Patch points (scoped to one certified call on one model, restored on exit): the instance's
``_need_fallback`` (to learn which row is decided) and ``_retrieve_avg_logprobs``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from hf_csv.core.errors import CSVError
from hf_csv.transformers.session import CSVSession
from hf_csv.core.checks import avg_logprob_interval
from hf_csv.transformers.processors import stock_processed
from hf_csv.transformers.patches import instance_override
from hf_csv.transformers.step import active_session

__all__ = ["threshold_of", "whisper_decisions"]


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


def _replay(sess: CSVSession, st: dict, index: int) -> torch.Tensor:
    """Stock's kept score row of one step: the stock head on the step's hidden states (all rows, as stock ran it),
    then every processor of the call but hf_csv's own, on this row's input ids."""
    raw = sess.head.stock(st["H"])[index:index + 1]
    return stock_processed(sess, raw, st["ids"][index:index + 1])[0]


def _certified_avg(sess: CSVSession, orig, scores: Any, tokens: torch.Tensor, temperature: float):
    """Stock's decision for one sequence of a greedy round, or None when the kept rows are stock's own (a round on
    the full head): then stock's function runs on them."""
    if not sess.whisper.record:
        return None
    index = sess.whisper.index
    steps = sess.whisper.steps
    rows = list(scores)
    if index is None or len(rows) > len(steps) or (temperature or 0.0) > 0.0:
        raise CSVError("hf_csv: Whisper's avg-logprob was requested outside the decision hf_csv certifies "
                       f"({len(rows)} kept rows, {len(steps)} recorded steps); please report this and generate "
                       "without csv_config meanwhile")
    if len(rows) > tokens.shape[0]:  # stock's trimming (scores past the tokens, or tokens before the scores)
        rows = rows[: tokens.shape[0]]
    else:
        tokens = tokens[-len(rows):]
    thr = float(sess.whisper.threshold)
    st = sess.reports.setdefault("whisper_thresholds", {"decisions": 0, "decided_by_bounds": 0, "replayed_steps": 0,
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
    ``logprob_threshold`` hf_csv certifies (``sess.whisper.scores_internal``, threshold in ``sess.whisper``)."""
    if not sess.whisper.scores_internal:
        yield
        return

    def need_fallback(orig):
        def _need_fallback(seek_sequence, seek_outputs, index, *args, **kwargs):
            s = active_session(model)
            if s is None:
                return orig(seek_sequence, seek_outputs, index, *args, **kwargs)
            s.whisper.index = int(index)
            try:
                return orig(seek_sequence, seek_outputs, index, *args, **kwargs)
            finally:
                s.whisper.index = None
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
