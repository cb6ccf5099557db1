"""The two values of a call's plan choice (:func:`hf_csv.transformers.decision.choose_plan`): :class:`CallFacts`, what
the choice reads, gathered from the session, the generation config and the processors in one place
(:func:`gather_facts`, the only part that reads live state), and :class:`Decision`, what it returns: the plan, the
reasons the call's stats list, and the lines said on the way.

Both are frozen: the choice's steps take a Decision and return a new one, never touching the session; the session takes
the result in one place (:func:`hf_csv.transformers.decision.set_plan`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch

from hf_csv.core.certificate import fp32_matmul_reason
from hf_csv.core.config import CSVConfig
from hf_csv.transformers.plans import FULL, Plan
from hf_csv.transformers.posthead import PostHead
from hf_csv.transformers.processor_kinds import classify_processor, inert
from hf_csv.transformers.step import call_guard

__all__ = ["CallFacts", "Decision", "gather_facts", "whisper_log_prob_reason", "FULL_LEAD"]

# Whisper settings that read log-probabilities over the whole vocabulary (token timestamps' scores). Timestamps are
# certified (the timestamp plan), and so is the temperature-fallback decision in greedy rounds
# (hf_csv.transformers.whisper).
_WHISPER_LOGPROB_KEYS = ("return_token_timestamps",)

# how a reason that sends the call to the full head is said (the session's log line: "hf_csv: <lead><reason>")
FULL_LEAD = "full LM head for this call: "


def whisper_log_prob_reason(*configs: Any, kwargs: Optional[dict] = None) -> Optional[str]:
    """A reason when Whisper's thresholds or timestamps are set, in kwargs or on any generation config."""
    for key in _WHISPER_LOGPROB_KEYS:
        vals = [(kwargs or {}).get(key)] + [getattr(c, key, None) for c in configs if c is not None]
        if any(v not in (None, False) for v in vals):
            return f"Whisper's {key} reads log-probabilities over the full vocabulary"
    return None


@dataclass(frozen=True)
class CallFacts:
    """Everything the plan of one ``generate`` call depends on: the session's flags, the generation config's settings,
    the processors generate built (in list order) and the certified head's properties.

    Two facts are asked only where a step needs them, since asking may do work or log: ``subset_exact`` (the
    column-subset probe, :meth:`hf_csv.core.certificate.CertifiedHead.subset_exact`: cached per head and setting, and
    it warns once) and ``generation_mode`` (transformers' ``GenerationConfig.get_generation_mode``, which may warn).
    Everything else is read once, here; the steps of the choice only read these fields."""

    config: CSVConfig
    # the session
    force_full: Optional[str]  # a reason decided before generate started
    fp32_reason: Optional[str]  # why the head's fp32 / fp16 matmuls may round otherwise than the IEEE bound
    post: Optional[PostHead]  # the post-head map (None: unknown)
    assisted: bool  # an assistant model or prompt lookup drafts for this (target) call
    draft: bool  # this is the assistant's call inside a candidate generator
    gumbel: bool  # Gumbel-coupled assisted sampling (CSVConfig(speculative="gumbel") with an assistant model)
    spec_ok: bool  # hf_csv's exact verify checks an assistant model's drafts
    caller_cache: bool  # the caller passed its own KV cache
    beam_restart: Optional[str]  # why this call's beam search already re-ran on the full head
    stock_drafts: Optional[str]  # a draft of a declined target call: why its drafts must be stock's
    stock_rows: Optional[str]  # a draft whose rows stock reads whole: why
    whisper_scores_internal: bool  # generate's kept scores feed only Whisper's avg-logprob decision
    input_len: Optional[int]  # the length generate's sequences start at
    # the certified head
    vocab_size: int
    vocab_parallel: bool  # the vocabulary-parallel head (it certifies some modes only)
    subset_exact: Callable[[], bool]
    # the generation config
    do_sample: bool
    num_beams: int
    output_logits: bool  # return_dict_in_generate with output_logits
    output_scores: bool  # return_dict_in_generate with output_scores
    logprob_threshold: Optional[float]  # Whisper's temperature fallback
    whisper_logprob_reason: Optional[str]  # Whisper's token timestamps' scores
    watermarking: bool
    guidance: bool  # classifier-free guidance (guidance_scale set and not 1)
    ensemble: bool  # assistant_ensemble_weight set
    confidence_threshold: float  # assistant_confidence_threshold (0: none)
    eos_token_id: Any
    generation_mode: Callable[[], Any]
    # the processors
    processors: tuple
    # the speed guard: whether the call has one (a large head on CPU, HF_CSV_SPEED_GUARD not 0), and the probe's
    # verdict as far as it has run (CertifiedHead.subset_verdict: True, False or None, not probed yet; asking does
    # no work); together they let the values gate leave the probe to a shape's first certified step
    guarded: bool = False
    subset_verdict: Callable[[], Optional[bool]] = lambda: None

    @functools.cached_property
    def kinds(self) -> dict:
        """kind -> the class names of the processors of that kind (:func:`classify_processor`), in list order; a
        processor that returns its input unchanged at every step of this call (:func:`inert`) counts as none."""
        kinds: dict = {}
        for p in self.processors:
            if not inert(p, self.input_len):  # (an assistant's minimum length at its input length: no 'lower' kind)
                kinds.setdefault(classify_processor(p), []).append(type(p).__name__)
        return kinds

    @property
    def coupled(self) -> bool:
        """Gumbel-coupled sampling: the target and its drafts each draw argmax(stock's processed row + the token
        index's noise)."""
        return self.do_sample and self.gumbel


def gather_facts(session: Any, generation_config: Any, processors: list) -> CallFacts:
    """The facts of one call, read from its session (:class:`hf_csv.transformers.session.CSVSession`), generation
    config and processors (those generate built, without hf_csv's own check)."""
    gc, head = generation_config, session.head
    w = getattr(head, "weight", None)
    # fp32: stock's own head; fp16: the certificate's fp32 GEMMs on fp16 values (bf16 values stay exact in bf16
    # passes): both leave the IEEE fp32 bound the certificates prove against
    fp32 = fp32_matmul_reason(w.device) if torch.is_tensor(w) and w.dtype in (torch.float32, torch.float16) else None
    dict_out = bool(getattr(gc, "return_dict_in_generate", False))
    gs = getattr(gc, "guidance_scale", None)

    def subset_exact() -> bool:
        probe = getattr(session.head, "subset_exact", None)
        return bool(probe()) if callable(probe) else False

    def subset_verdict() -> Optional[bool]:
        known = getattr(session.head, "subset_verdict", None)
        return known() if callable(known) else False

    return CallFacts(
        config=session.config, force_full=session.force_full, fp32_reason=fp32, post=session.post,
        assisted=session.assisted, draft=session.draft, gumbel=session.gumbel is not None, spec_ok=session.spec_ok,
        caller_cache=session.caller_cache, beam_restart=session.beam.restart,
        stock_drafts=session.assist.stock_drafts, stock_rows=session.assist.stock_rows,
        whisper_scores_internal=session.whisper.scores_internal, input_len=session.input_len,
        vocab_size=getattr(head, "vocab_size", 0), vocab_parallel=getattr(head, "modes", None) is not None,
        subset_exact=subset_exact,
        do_sample=bool(getattr(gc, "do_sample", False)), num_beams=int(getattr(gc, "num_beams", 1) or 1),
        output_logits=dict_out and bool(getattr(gc, "output_logits", False)),
        output_scores=dict_out and bool(getattr(gc, "output_scores", False)),
        logprob_threshold=getattr(gc, "logprob_threshold", None), whisper_logprob_reason=whisper_log_prob_reason(gc),
        watermarking=getattr(gc, "watermarking_config", None) is not None, guidance=gs is not None and gs != 1,
        ensemble=getattr(gc, "assistant_ensemble_weight", None) is not None,
        confidence_threshold=float(getattr(gc, "assistant_confidence_threshold", None) or 0.0),
        eos_token_id=getattr(gc, "eos_token_id", None),
        generation_mode=lambda: gc.get_generation_mode() if hasattr(gc, "get_generation_mode") else None,
        processors=tuple(processors), guarded=call_guard(session) is not None, subset_verdict=subset_verdict)


@dataclass(frozen=True)
class Decision:
    """A call's plan as the choice's steps leave it: ``plan``; ``reasons``, what the call's stats list (each once);
    ``said``, every reason as it was first given, (lead, reason) in order, each logged once by the session (a later
    step may drop a reason from ``reasons``: the values gate restates the call's one reason); ``own_draw``, sampling
    through the head's own exact draw where stock's values cannot be had; ``whisper_record``, the check records
    Whisper's avg-logprob terms; ``beams_warned``, the beam count of a beam search left on the full head (one
    warning, 0: none); ``values_probe``, the probe of stock's values is left to each shape's first certified step."""

    plan: Plan = FULL
    reasons: tuple = ()
    said: tuple = ()
    own_draw: bool = False
    whisper_record: bool = False
    beams_warned: int = 0
    # the plan hands its values on S to stock's code and the column-subset probe is left to each shape's first
    # certified step (hf_csv.transformers.step.head_step), where the speed guard tries the certified head
    values_probe: bool = False

    def to(self, plan: Plan) -> "Decision":
        """This decision with ``plan``."""
        return replace(self, plan=plan)

    def note(self, reason: str, lead: str = "") -> "Decision":
        """This decision with ``reason`` recorded (once) and said."""
        if reason in self.reasons:
            return self
        return replace(self, reasons=self.reasons + (reason,), said=self.said + ((lead, reason),))

    def full(self, reason: str) -> "Decision":
        """The full head for the call, and why (the kept rows are stock's: Whisper's own avg-logprob applies)."""
        return replace(self, plan=FULL, whisper_record=False).note(reason, FULL_LEAD)

    def warn_beams(self, num_beams: int) -> "Decision":
        """One warning where beam search leaves the whole call on the full head: the ASR pipeline asks for 5 beams by
        default, so its users would otherwise get nothing certified and no word of it (INFO is silent)."""
        return replace(self, beams_warned=num_beams) if num_beams > 1 else self
