"""Token-identical beam search on the certified head (docs/certificates.md §3.10).

Stock beam search scores a candidate by ``fl(log_softmax(logits)[i] processed) + running beam score`` and takes
every decision with a ``topk`` or a ``>`` on such values. The certified head knows stock's logits on a set S that
holds every row's top-K (K = transformers' ``beams_to_keep``) and bounds the rest, so each processed log-prob is
known to a float interval [lo, hi] (:class:`hf_csv.transformers.processors.CSVLogitsProcessor` computes it per step; the
normalizer's interval covers stock's float32 summation in any order). This module carries those intervals through
stock's bookkeeping, applying to ``lo`` and ``hi`` the same monotone float ops stock applies to its values
(``+``, division by a positive length penalty, the ``-1e9`` masks), and checks at each decision that every value
in the box gives stock's decision:

* a ``topk`` selection is certified when the selected entries are strictly ordered and strictly above every
  other entry's upper end (any correct ``topk`` then returns the same indices), or, for the small bookkeeping
  vectors, when every pair of entries is strictly separated or both are known exactly (the vectors are then
  order-isomorphic, and a comparison-based ``topk`` returns the same indices, ties included);
* the early-stop heuristic's ``>`` is certified when the intervals do not straddle it.

A decision that cannot be certified is never guessed: :class:`BeamUncertified` is raised inside ``generate`` and
:func:`hf_csv.transformers.enable.csv_generate` runs the call again on the full head (counted and logged). So tokens are
always stock's. The intervals themselves are returned nowhere: calls that return scores use the full head.

Patch points (instance-level, installed where the call's plan is the exact beam plan, restored at the call's end:
:func:`beam_decisions`): ``_get_top_k_continuations``,
``_get_running_beams_for_next_iteration``, ``_update_finished_beams`` and ``_check_early_stop_heuristic`` of
``GenerationMixin`` (the same helpers, called the same way, in transformers 4.57 and 5.20–5.24:
:mod:`hf_csv.transformers.compat`). Each wrapper calls stock's method and validates, bit for bit, that its replay of stock's
arithmetic on the representative values reproduces what stock computed; a mismatch raises :class:`CSVError`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from hf_csv.core.errors import CSVError
from hf_csv.transformers.session import CSVSession
from hf_csv.transformers.plans import ExactBeam, Full
from hf_csv.transformers.patches import instance_override
from hf_csv.transformers.step import active_session

__all__ = ["BeamUncertified", "beam_decisions"]

_MASK = -1.0e9  # stock's mask constant in the beam bookkeeping


class BeamUncertified(Exception):
    """A beam-search decision the intervals cannot certify (internal: the call re-runs on the full head)."""


@dataclass
class _State:
    rbs: tuple  # running beam scores (lo, hi, rep) [B, nb]
    fin: tuple  # finished beam scores (lo, hi) [B, nb]
    topk: Optional[tuple] = None  # this step's top-K continuations (lo, hi) [B, K]


def _exact(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return lo == hi


def _unique_top(lo: torch.Tensor, hi: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Per batch row: the entries at ``idx`` (the representative's top-n, in order) are strictly ordered and
    strictly above every other entry for every value in the box, so any correct topk returns ``idx``."""
    L = lo.gather(1, idx)
    H = hi.gather(1, idx)
    ok = (L[:, :-1] > H[:, 1:]).all(1) if idx.shape[1] > 1 else torch.ones(idx.shape[0], dtype=torch.bool)
    if idx.shape[1] < lo.shape[1]:
        rest = hi.scatter(1, idx, float("-inf")).amax(1)
        ok &= L[:, -1] > rest
    return ok


def _order_isomorphic(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Per batch row: every pair of entries is strictly separated or both are exact (then equal to stock's), so
    the representative vector and stock's have the same order relations (a small vector: O(n²))."""
    ex = _exact(lo, hi)
    sep = (lo[:, :, None] > hi[:, None, :]) | (lo[:, None, :] > hi[:, :, None])
    both = ex[:, :, None] & ex[:, None, :]
    n = lo.shape[1]
    eye = torch.eye(n, dtype=torch.bool)[None]
    return (sep | both | eye).all(2).all(1)


def _certify_topk(lo, hi, idx, what: str, small: bool, live: Optional[torch.Tensor] = None) -> None:
    ok = _unique_top(lo, hi, idx)
    if small and not bool(ok.all()):
        ok |= _order_isomorphic(lo, hi)
    if live is not None:
        ok |= ~live
    if not bool(ok.all()):
        raise BeamUncertified(f"beam search: {what} is within the certified width of the normalizer")


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if not (a.shape == b.shape and torch.equal(a, b)):
        raise CSVError(f"hf_csv: stock's beam bookkeeping computed {what} differently from hf_csv's replay of it; "
                       "this transformers version is not the one hf_csv checked. Please report this; generate "
                       "without csv_config meanwhile.")


def _stats(sess: CSVSession) -> dict:
    st = sess.reports.setdefault("beam", {})
    # certified_steps: steps decided by the checks (subvocab_steps of them had a sub-vocabulary row; the others only
    # stock's rows); full_steps: steps of beam searches re-run on the full head; aborted_*: work of the runs re-run
    for k in ("certified_steps", "subvocab_steps", "full_steps", "restarts", "aborted_steps", "aborted_rows"):
        st.setdefault(k, 0)
    return st


def _top_k_continuations(model: nn.Module, orig: Callable) -> Callable:
    def _get_top_k_continuations(*args: Any, **kw: Any):
        sess = active_session(model)
        if sess is None or not isinstance(sess.plan, ExactBeam):
            if sess is not None and sess.reports.get("beam") is not None and isinstance(sess.plan, Full):
                _stats(sess)["full_steps"] += 1
            return orig(*args, **kw)
        acc = kw["accumulated_log_probs"]
        B, nb, K = int(kw["batch_size"]), int(kw["num_beams"]), int(kw["beams_to_keep"])
        if kw.get("do_sample") or args:
            raise CSVError("hf_csv: beam search helpers called in an unexpected way; please report this")
        step, sess.beam.step = sess.beam.step, None  # a hf_csv.transformers.whisper_beam_checks.BeamStep
        if step is None:
            raise CSVError("hf_csv: a certified beam step reached the top-k without its intervals; please report this")
        V = step.lo.shape[-1]
        st: Optional[_State] = sess.beam.state
        if int(kw["cur_len"]) == int(kw["decoder_prompt_len"]) or st is None:
            # stock's initial scores: beam 0 at 0, the others at -1e9 (checked against stock's sum just below)
            init = torch.zeros(B, nb, dtype=torch.float32, device=acc.device)
            init[:, 1:] = _MASK
            fin = torch.full((B, nb), _MASK, dtype=torch.float32, device=acc.device)
            st = sess.beam.state = _State(rbs=(init, init, init), fin=(fin, fin))
        r_lo, r_hi, r_rep = st.rbs
        _same((step.rep.view(B, nb, V) + r_rep[:, :, None]).view(B, -1), acc, "the accumulated log-probs")
        lo = (step.lo.view(B, nb, V) + r_lo[:, :, None]).view(B, -1)
        hi = (step.hi.view(B, nb, V) + r_hi[:, :, None]).view(B, -1)
        out = orig(*args, **kw)
        vals, idx = torch.topk(acc, k=K)  # stock's op on stock's input: its selection
        _same(vals, out[0], "the top-k scores")
        ok = _unique_top(lo, hi, idx)
        # every token the head did not compute: stock's value <= ob + the beam's running score (upper end)
        off = (step.ob.view(B, nb) + r_hi).amax(1)
        ok &= lo.gather(1, idx)[:, -1] > off
        if not bool(ok.all()):
            raise BeamUncertified("beam search: the top-k continuations are within the certified width")
        st.topk = (lo.gather(1, idx), hi.gather(1, idx))
        _stats(sess)["certified_steps"] += 1
        _stats(sess)["subvocab_steps"] += int(step.subvocab)
        return out

    return _get_top_k_continuations


def _running_beams(model: nn.Module, orig: Callable) -> Callable:
    def _get_running_beams_for_next_iteration(*args: Any, **kw: Any):
        sess = active_session(model)
        st = None if sess is None or not isinstance(sess.plan, ExactBeam) else sess.beam.state
        out = orig(*args, **kw)
        if st is None:
            return out
        hits = kw["next_token_hits_stopping_criteria"].to(torch.float32) * _MASK
        rep = kw["topk_log_probs"] + hits
        lo, hi = st.topk[0] + hits, st.topk[1] + hits
        nb = int(kw["num_beams"])
        idx = torch.topk(rep, k=nb)[1]
        _same(rep.gather(1, idx), out[1], "the running beam scores")
        # every continuation hit a stopping criterion: the loop ends and the running beams are not read again
        if not bool(kw["next_token_hits_stopping_criteria"].all()):
            _certify_topk(lo, hi, idx, "the choice of running beams", small=True)
        st.rbs = (lo.gather(1, idx), hi.gather(1, idx), out[1])
        return out

    return _get_running_beams_for_next_iteration


def _finished_beams(model: nn.Module, orig: Callable) -> Callable:
    def _update_finished_beams(*args: Any, **kw: Any):
        sess = active_session(model)
        st = None if sess is None or not isinstance(sess.plan, ExactBeam) else sess.beam.state
        out = orig(*args, **kw)
        if st is None:
            return out
        did = kw["next_token_hits_stopping_criteria"] & kw["top_num_beam_mask"][None, :]
        den = (int(kw["cur_len"]) + 1 - int(kw["decoder_prompt_len"])) ** kw["length_penalty"]
        full = torch.all(kw["is_sent_finished"], dim=-1, keepdim=True) & (kw["early_stopping"] is True)
        stop = ~kw["is_early_stop_heuristic_unsatisfied"]

        def f(t: torch.Tensor) -> torch.Tensor:  # stock's ops on the new candidates' scores, in its order
            t = t / den
            t += full.to(torch.float32) * _MASK
            t += stop.to(torch.float32) * _MASK
            t += (~did) * _MASK
            return t

        nb = int(kw["num_beams"])
        rep = torch.cat((kw["beam_scores"], f(kw["topk_log_probs"])), dim=1)
        lo = torch.cat((st.fin[0], f(st.topk[0])), dim=1)
        hi = torch.cat((st.fin[1], f(st.topk[1])), dim=1)
        idx = torch.topk(rep, k=nb)[1]
        _same(rep.gather(1, idx), out[1], "the finished beam scores")
        _certify_topk(lo, hi, idx, "the choice of finished beams", small=True)
        st.fin = (lo.gather(1, idx), hi.gather(1, idx))
        return out

    return _update_finished_beams


def _early_stop(model: nn.Module, orig: Callable) -> Callable:
    def _check_early_stop_heuristic(*args: Any, **kw: Any):
        sess = active_session(model)
        st = None if sess is None or not isinstance(sess.plan, ExactBeam) else sess.beam.state
        out = orig(*args, **kw)
        if st is None:
            return out
        lp, es = kw["length_penalty"], kw["early_stopping"]
        dpl = int(kw["decoder_prompt_len"])
        n = (int(kw["max_length"]) if es == "never" and lp > 0.0 else int(kw["cur_len"])) - dpl
        fin = kw["is_sent_finished"]
        unsat = kw["is_early_stop_heuristic_unsatisfied"]

        def best_worst(r: torch.Tensor, b: torch.Tensor) -> tuple:
            return r[:, :1] / (n ** lp), torch.where(fin, torch.min(b, dim=1, keepdim=True)[0], _MASK)

        b_rep, w_rep = best_worst(kw["running_beam_scores"], kw["beam_scores"])
        _same(unsat & torch.any(b_rep > w_rep, dim=-1, keepdim=True), out, "the early-stop heuristic")
        b_lo, w_lo = best_worst(st.rbs[0], st.fin[0])
        b_hi, w_hi = best_worst(st.rbs[1], st.fin[1])
        surely = torch.any(b_lo > w_hi, dim=-1, keepdim=True)
        never = torch.all(b_hi <= w_lo, dim=-1, keepdim=True)
        if not bool((surely | never | ~unsat).all()):
            raise BeamUncertified("beam search: the early-stop comparison is within the certified width")
        return out

    return _check_early_stop_heuristic


@contextlib.contextmanager
def _overrides(model: nn.Module) -> Iterator[None]:
    """The four scoped beam overrides on ``model`` (restored by the last exit, also after an exception)."""
    with instance_override(model, "_get_top_k_continuations", lambda o: _top_k_continuations(model, o)), \
            instance_override(model, "_get_running_beams_for_next_iteration", lambda o: _running_beams(model, o)), \
            instance_override(model, "_update_finished_beams", lambda o: _finished_beams(model, o)), \
            instance_override(model, "_check_early_stop_heuristic", lambda o: _early_stop(model, o)):
        yield


@contextlib.contextmanager
def beam_decisions(model: nn.Module, sess: CSVSession) -> Iterator[None]:
    """The checked beam bookkeeping for ``sess`` on ``model``, for the calls that run the exact beam plan only.

    generate chooses the plan inside the call (``_get_logits_processor``, :mod:`hf_csv.transformers.scope`), so this
    scope installs nothing itself: it sets ``sess.beam.install``, which scope calls once the plan is
    :class:`~hf_csv.transformers.plans.ExactBeam`, and the four overrides stay until this scope exits (the call's end,
    also after an exception; a beam search re-run on the full head keeps them and counts its steps). A call on any
    other plan leaves transformers' beam helpers untouched."""
    with contextlib.ExitStack() as stack:
        def install() -> None:
            sess.beam.install = None  # (once per call: Whisper's generate chooses a plan per segment)
            stack.enter_context(_overrides(model))

        sess.beam.install = install
        try:
            yield
        finally:
            sess.beam.install = None
            sess.beam.step = sess.beam.state = None
