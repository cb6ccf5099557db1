"""Scoped, restoring patches that make one certified call active on one model.

* every touch point is installed and restored by :mod:`hf_csv.transformers.patches` (the list of every touch point
  and the one mechanism that installs and restores them); this module says which, for one call.
* :func:`certified` — the head swap (:func:`hf_csv.transformers.heads.swapped_head`) plus the
  ``_get_logits_processor`` / ``_get_stopping_criteria`` overrides (mode decision) and one pair of forward hooks per
  model that act on the session of the calling context: the pre-hook records how many tokens the forward consumes
  (per-position processor checks in assisted decoding), the post-hook runs the post-head guard. Where the plan
  chosen is the exact beam plan, ``_get_logits_processor`` has the beam overrides installed for the rest of the
  call (``sess.beam.install``, :func:`hf_csv.transformers.beam.beam_decisions`).
* the ``_valid_auto_compile_criteria`` override: when transformers compiles the decode forward (static
  cache), the head traced into that graph is the static certified head or stock's
  (:func:`hf_csv.transformers.decision.choose_compiled_plan`, :func:`hf_csv.transformers.heads.set_static_plan`); the hooks
  do nothing there.
* :func:`new_session` — a session for a model and config (head from the cache, dtype, post map).

Per-call state lives in the :class:`~hf_csv.transformers.session.CSVSession` of the call, never on shared objects.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
from torch import nn

from hf_csv_kernels.quantize import NonFiniteWeightError

from hf_csv.transformers.compat import cache_kwarg
from hf_csv.core.certificate import CertStats
from hf_csv.core.config import CSVConfig
from hf_csv.transformers.heads import (find_head, head_decline_reason, head_entry, model_out_dtype, set_static_plan,
                                      swapped_head)
from hf_csv.transformers.session import CSVSession
from hf_csv.transformers.patches import forward_hooks, instance_override
from hf_csv.transformers.plans import ExactBeam, Full
from hf_csv.transformers.decision import check_stopping_criteria, choose_compiled_plan, set_plan
from hf_csv.transformers.posthead import post_head_of
from hf_csv.transformers.processors import CSVLogitsProcessor, FullHeadDuring, GumbelCoupledDraw, binding_scope, mask_once
from hf_csv.core.speed import cuda_reason
from hf_csv.transformers.step import active_session, check_post, track_length

__all__ = ["certified", "new_session"]

def new_session(model: nn.Module, config: CSVConfig) -> CSVSession:
    """A session of ``config`` on ``model``: the cached certified head, the model dtype and the
    architecture's post-head map (a head hf_csv cannot certify, e.g. offloaded, wrapped or quantized, or an unknown
    map: the call is declined, with a reason; hf_csv.transformers.heads.head_decline_reason)."""
    name, head = find_head(model)
    unfit = head_decline_reason(head, name)  # (before any weight is read: a wrapper's may be no tensor)
    post, why = post_head_of(model)
    on_cuda = None if unfit else cuda_reason(head.weight)  # decided before any screen is built (hf_csv.core.speed)
    nonfinite = None
    try:
        entry = None if unfit or post is None or on_cuda else head_entry(head, config)
    except NonFiniteWeightError:  # (no screen is cached: a head repaired in place certifies again)
        entry, nonfinite = None, ("the head's weights hold NaN or infinite values: no bound holds, stock's head "
                                  "computes the call")
    sess = CSVSession(model=model, config=config, head=None if entry is None else entry.head, entry=entry,
                      out_dtype=model_out_dtype(model, head), post=post, cache_kwarg=cache_kwarg())
    if nonfinite is not None:
        sess.force_full = nonfinite
    elif unfit:
        sess.force_full = unfit
    elif post is None:
        sess.force_full = why
    elif on_cuda:
        sess.force_full = on_cuda
    elif head.bias is not None and sess.out_dtype != torch.float32:
        # measured (tests/test_stack_differential.py, Phi in bf16): torch rounds a biased bf16 head differently on a
        # subset of its columns, and a non-contiguous input takes an unfused path (round, add the bias,
        # round again); stock's values then cannot be reproduced or bounded by one rounding
        sess.force_full = (f"a head bias in {sess.out_dtype}: the rounding of stock's bias add depends on its "
                           "kernel path (exact in float32)")
    return sess


@contextlib.contextmanager
def certified(model: nn.Module, sess: CSVSession):
    """Make ``sess`` active for ``model`` in this context (head swap, mode decision, hooks). Restored on
    exit, also on exceptions; concurrent activations on one model are reference-counted."""
    with binding_scope(), forward_hooks(model, "forward hooks", track_length, check_post), \
            instance_override(model, "_get_logits_processor", lambda orig: _patched_get_logits_processor(model, orig)), \
            instance_override(model, "_get_stopping_criteria", lambda orig: _patched_get_stopping_criteria(model, orig)), \
            instance_override(model, "_valid_auto_compile_criteria", lambda orig: _patched_compile_criteria(model, orig)), \
            swapped_head(model, sess):
        try:
            yield sess
        finally:
            _compiled_stats(sess)
            sess.step.guard_pending = None  # (a head call no processor step followed: its time alone would mislead)
            sess.step.last = None  # drop the stashed tensors with the call
            sess.step.last_out = None


def _patched_get_logits_processor(model: nn.Module, orig: Callable) -> Callable:
    """Instance-level ``_get_logits_processor``: stock list, then the mode decision for the session."""

    def _get_logits_processor(*args: Any, **kwargs: Any):
        procs = orig(*args, **kwargs)
        sess = active_session(model)
        if sess is None:
            return procs
        gc = kwargs.get("generation_config", args[0] if args else None)
        n = kwargs.get("input_ids_seq_length", args[1] if len(args) > 1 else None)
        sess.input_len = int(n) if isinstance(n, int) else None
        # one CSVLogitsProcessor, last (a user's instance is reused, keeping its records)
        # an assistant's generate receives the target's processors, whose CSVLogitsProcessor is bound
        # to the target's session: a draft session never takes it over, it gets its own
        mine = [] if sess.draft else [p for p in procs if isinstance(p, CSVLogitsProcessor)]
        others = [p for p in procs if not isinstance(p, CSVLogitsProcessor)]
        if sess.draft and sess.gumbel is not None and getattr(gc, "do_sample", False):
            others = _once_each_warper(others)
        plan = set_plan(sess, gc, others)
        if not isinstance(plan, Full):
            # Whisper's no-speech detection reads stock's logits (its own forward on the stock head, or stock's row)
            # and Whisper's suppress-token mask built once per call instead of at every position (the same scores)
            others = [FullHeadDuring(p, sess) if type(p).__name__ == "WhisperNoSpeechDetection"
                      else mask_once(p) if type(p).__name__ == "SuppressTokensLogitsProcessor" else p for p in others]
        if not plan.supported_by(sess.head):
            sess.set_full(f"the vocabulary-parallel head certifies {sorted(sess.head.modes)} only, not {plan.name!r}")
        if sess.check_processed and not getattr(sess.head, "bounds_uncomputed", True):
            sess.set_full("the vocabulary-parallel head gives no per-row bound on uncomputed logits, which the check "
                          "after lowering processors or a post-head transform needs")
        if isinstance(sess.plan, ExactBeam) and sess.beam.install is not None:
            sess.beam.install()  # the beam overrides, for the calls that run this plan only (hf_csv.transformers.beam)
        verifier = (mine[-1] if mine else CSVLogitsProcessor()).bind(sess)
        if sess.check_processed or mine:
            # the check's place in the list (after the top-k warper in sampling, so that every later warper sees stock's vector; before min-p or
            # Whisper's timestamp rule; in the top-p warper's place, which it calls where needed: hf_csv.transformers.plans)
            at, skip = sess.plan.placement(others)
            sess.replaced = others[at] if skip else None
            others = others[:at] + [verifier] + others[at + skip:]
        scores_out = getattr(gc, "return_dict_in_generate", False) and getattr(gc, "output_scores", False)
        if sess.gumbel is not None and getattr(gc, "do_sample", False):
            # the coupled draw, after everything: the draft's proposal, and the target's row as the one-hot keyed draw
            # (also the row stock samples from itself when a round has no drafts). With output_scores the target keeps
            # its processed rows (returned as scores; the verify draws from them with the same noise) except in a
            # round without drafts
            others = others + [GumbelCoupledDraw(sess, always=sess.draft or not scores_out)]
        procs[:] = others
        sess.processors, sess.check_prefix = procs, None  # (the check's prefix is sorted again for this list)
        return procs

    return _get_logits_processor


_WARPERS = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
            "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "TopHLogitsWarper"}


def _once_each_warper(procs: list) -> list:
    """A Gumbel-coupled draft's list with each warper type once (the first: the target's). transformers hands the
    assistant the target's list and then appends the assistant's own warpers, copies of the same settings, so stock's
    draft applies temperature twice (T²) and top-p twice. Any draft rule keeps the coupled verify exact; the closer
    the draft's law is to the target's, the more of its drafts the target's draws accept."""
    seen, out = set(), []
    for p in procs:
        name = type(p).__name__
        if name in _WARPERS:
            if name in seen:
                continue
            seen.add(name)
        out.append(p)
    return out


def _patched_compile_criteria(model: nn.Module, orig: Callable) -> Callable:
    """Instance-level ``_valid_auto_compile_criteria``: stock's answer; when it compiles, the head that the
    compiled decode forward traces (docs/certificates.md §3.9). Called by every decoding loop before its prefill."""

    def _valid_auto_compile_criteria(*args: Any, **kwargs: Any) -> bool:
        res = orig(*args, **kwargs)
        if res:
            sess = active_session(model)
            plan = None if sess is None else choose_compiled_plan(sess, _batch_of(args, kwargs),
                                                                  gemm_reason=_graph_gemm_reason(args, kwargs))
            installed = set_static_plan(model, plan, own=sess is not None)
            if sess is not None and plan is not None and not installed:
                sess.set_full("torch.compile (static cache) while another generate call is active on this model: "
                              "a compiled graph cannot tell the calls apart")
            if sess is not None and installed:
                if sess.compiled.start is None:
                    sess.compiled.start = (plan, plan.counters())
        return res

    return _valid_auto_compile_criteria


_EAGER_BACKENDS = ("eager", "aot_eager")  # graphs that run torch's own ops: the eager BLAS call


def _graph_gemm_reason(args: tuple, kwargs: dict) -> Optional[str]:
    """Why the compiled graph's GEMM on gathered candidate rows may round otherwise than the eager call that
    :meth:`~hf_csv.core.certificate.CertifiedHead.graph_gather_exact` probes, or ``None``. Inductor's default CPU lowering
    of that matmul calls the same BLAS GEMM (``extern_kernels.mm``); under max-autotune it may pick its own C++ GEMM
    template, and another backend lowers it as it likes. Read from the call's ``compile_config`` (the second argument
    of ``_valid_auto_compile_criteria(model_kwargs, generation_config)``) and inductor's global config."""
    gc = kwargs.get("generation_config", args[1] if len(args) > 1 else None)
    cc = getattr(gc, "compile_config", None)
    backend = getattr(cc, "backend", "inductor")
    if backend in _EAGER_BACKENDS:
        return None
    if backend != "inductor":
        return f"the compile backend {backend!r}"
    from torch._inductor import config as inductor_config

    mode = getattr(cc, "mode", None) or ""
    options = getattr(cc, "options", None) or {}
    if "max-autotune" in mode or any(options.get(k) or getattr(inductor_config, k, False)
                                     for k in ("max_autotune", "max_autotune_gemm")):
        return "inductor's max-autotune (its own GEMM kernels)"
    return None


def _batch_of(args: tuple, kwargs: dict) -> Optional[int]:
    """The batch size of a ``_valid_auto_compile_criteria(model_kwargs, generation_config)`` call, when it shows."""
    mk = kwargs.get("model_kwargs", args[0] if args else None)
    if isinstance(mk, dict):
        for name in ("attention_mask", "input_ids", "inputs_embeds", "decoder_input_ids"):
            t = mk.get(name)
            if torch.is_tensor(t) and t.dim() >= 1:
                return int(t.shape[0])
    return None


def _compiled_stats(sess: CSVSession) -> None:
    """The compiled head's rows of this call (its counters' change) into the session's stats."""
    got, sess.compiled.start = sess.compiled.start, None
    if got is None:
        return
    plan, (r0, c0, s0) = got
    r1, c1, s1 = plan.counters()
    rows, cert = r1 - r0, c1 - c0
    sess.reports["compiled_head"] = {"rows": rows, "certified": cert, "capacity": plan.capacity,
                                   "mean_subvocab": (s1 - s0) / cert if cert else None}
    # (vocab_size too: when the eager prefill used the full head, e.g. while the screen was being packed, nothing
    # else set it)
    sess.stats.merge(CertStats(rows=rows, certified=cert, fallback=rows - cert, subvocab_sum=s1 - s0,
                               vocab_size=plan.vocab_size))


def _patched_get_stopping_criteria(model: nn.Module, orig: Callable) -> Callable:
    """Instance-level ``_get_stopping_criteria``: stock list; a criterion that may read scores declines."""

    def _get_stopping_criteria(*args: Any, **kwargs: Any):
        criteria = orig(*args, **kwargs)
        sess = active_session(model)
        if sess is not None:
            check_stopping_criteria(sess, criteria)
        return criteria

    return _get_stopping_criteria
