"""The plans' checks of stock's own rules that read the values: Whisper's timestamp rule (which of text or timestamp
stock picks, docs/certificates.md §3.4), Whisper's avg-logprob record (the temperature fallback, §3.6) and a beam
step's processed log-prob intervals (token-identical beam search, §3.10).

:class:`hf_csv.transformers.plans.TopK` and :class:`hf_csv.transformers.plans.ExactBeam` run them in their checks,
:mod:`hf_csv.transformers.step` records a step its head left to stock; :mod:`hf_csv.transformers.whisper` and
:mod:`hf_csv.transformers.beam` read what they record. Every bound is the one of its section, for float32 processed
scores.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from hf_csv.core import checks

__all__ = ["timestamp_unsure", "BeamStep", "beam_logprob_box", "record_lp"]


def timestamp_unsure(sess: Any, proc: Any, input_ids: torch.Tensor, x: torch.Tensor, ob: torch.Tensor,
                     computed: torch.Tensor) -> tuple:
    """Rows where Whisper's timestamp processor, run next on this vector, might not give stock's argmax
    (:func:`hf_csv.core.checks.timestamp_decision`, docs/certificates.md §3.4).

    The processor (a) masks tokens by rules that read only ``input_ids`` and (b), after them, masks all text
    tokens when logsumexp(timestamps) > max(text) in log-probabilities. Its masks are read by running it on a
    probe on which (b) cannot fire unless the text is already all masked."""
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



@dataclass
class BeamStep:
    """One beam step's processed log-probs as intervals (the ExactBeam plan; read by hf_csv.transformers.beam).

    ``lo`` <= stock's value <= ``hi`` on every token the head computed (float32, [N, V]); ``rep`` (what stock's own
    bookkeeping receives) lies inside; every other token's stock value is <= ``ob`` ([N], -inf on complete rows)."""

    lo: torch.Tensor
    hi: torch.Tensor
    rep: torch.Tensor
    ob: torch.Tensor
    subvocab: bool = True  # some row is a sub-vocabulary row (False: every row is stock's, the step is exact)


def beam_logprob_box(sess: Any, input_ids: torch.Tensor, last: Any, p: int, stop: Any = None):
    """(lo [N, V], hi [N, V], ob [N]) for one beam step (docs/certificates.md §3.10): the interval of stock's
    log_softmax (:func:`hf_csv.core.checks.logprob_box`), then the processors. Those allowed here
    (hf_csv.transformers.method_plans) act token by token, monotone and never raising, so running them on the lo row
    and on the hi row brackets stock's processed value, and ``ob`` stays a bound on every token outside S."""
    lo, hi, ob = checks.logprob_box(last.logits[:, p], last.mask[:, p],
                                    checks.raise_by_dtype(last.upper[:, p].double(), sess.out_dtype))
    for proc in sess.processors or ():
        if proc is stop:
            break
        if not (getattr(proc, "csv_check", False) or getattr(proc, "csv_identity", False)):
            lo, hi = proc(input_ids, lo), proc(input_ids, hi)
    return lo, hi, ob


def record_lp(sess: Any, input_ids: torch.Tensor, out: Optional[torch.Tensor], last, p: int,
               exact: Optional[torch.Tensor], ts=None) -> None:
    """One greedy step of a Whisper round with ``logprob_threshold`` (read by hf_csv.transformers.whisper): per row, an upper
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
