"""The certified call's session: :class:`CSVSession`, the state of one certified ``generate`` call on one model.

A session holds everything that is per call: the config, the certified head it uses (from the per-weight cache,
:mod:`hf_csv.transformers.heads`), the plan chosen for it (:mod:`hf_csv.transformers.plans`), the state one decode step
hands to the next (:class:`hf_csv.transformers.step.StepState`), the records of Whisper, beam search, assisted decoding
and compiled decodes, and the call's statistics (:meth:`CSVSession.summary`). It lives in a :mod:`contextvars`
variable for the call's extent (:func:`hf_csv.transformers.step.active_session`), never on a shared object, so
concurrent calls and other threads do not see it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from hf_csv.core.certificate import CertifiedHead, CertStats
from hf_csv.core.config import CSVConfig
from hf_csv.transformers.plans import FULL, Epsilon, Full, Plan
from hf_csv.transformers.posthead import PostHead
from hf_csv.transformers.step import StepState

__all__ = ["CSVSession", "WhisperRecord", "BeamRecord", "AssistRecord", "CompiledRecord", "full_head_reason",
           "summary_line", "row_totals"]


@dataclass
class WhisperRecord:
    """Whisper's temperature-fallback decision in one call (hf_csv.transformers.whisper, docs/certificates.md §3.6)."""

    scores_internal: bool = False  # the scores generate keeps feed only the avg-logprob decision, which hf_csv certifies
    threshold: Optional[float] = None  # the logprob_threshold certified
    record: bool = False  # the check records each greedy step's normalizer bounds ...
    steps: list = field(default_factory=list)  # ... here (hf_csv.transformers.whisper_beam_checks.record_lp)
    index: Optional[int] = None  # the batch row Whisper's _need_fallback decides


@dataclass
class BeamRecord:
    """Token-identical beam search in one call (hf_csv.transformers.beam, docs/certificates.md §3.10)."""

    step: Any = None  # this step's processed log-prob intervals (hf_csv.transformers.whisper_beam_checks.BeamStep)
    state: Any = None  # the intervals of stock's beam bookkeeping (hf_csv.transformers.beam)
    restart: Optional[str] = None  # why the call re-ran its beam search on the full head
    # installs the beam overrides for the rest of the call once its plan is ExactBeam (set by
    # hf_csv.transformers.beam.beam_decisions, called by hf_csv.transformers.scope where generate chooses the plan)
    install: Optional[Callable[[], None]] = None


@dataclass
class AssistRecord:
    """Assisted decoding in one call (hf_csv.transformers.drafts, hf_csv.transformers.processors.GumbelCoupledDraw)."""

    conf: dict = field(default_factory=dict)  # token index -> the certified draw's probability (a draft, sample mode)
    conf_last: Optional[float] = None  # the last drafted token's probability (the coupled confidence stop reads it)
    no_drafts: bool = False  # target: a round without drafts, stock samples from the row (the keyed draw makes it)
    user_settings: Optional[dict] = None  # the caller's assistant settings, applied to the candidate generator
    # a draft session whose target call was declined (the target's reason): its drafts must be stock's draft's, so
    # that the declined call returns stock's tokens (hf_csv.transformers.method_plans._sampled_draft_plan)
    stock_drafts: Optional[str] = None
    # a draft session whose returned rows stock reads whole (why: stock's ROC adaptation of the confidence threshold,
    # hf_csv.transformers.compat.adapts_confidence_threshold): only a plan whose processed rows are stock's bits keeps certified
    stock_rows: Optional[str] = None


@dataclass
class CompiledRecord:
    """A compiled static-cache decode in one call (hf_csv.transformers.scope, hf_csv.transformers.decision.choose_compiled_plan)."""

    start: Optional[tuple] = None  # (the static plan, its counters) when the compiled decode started
    stock: bool = False  # the graph runs stock's head (the speed guard's choice)
    calls_seen: Any = None  # the plan's call counter at the check's last step


@dataclass
class CSVSession:
    """State of one certified ``generate`` call on one model."""

    model: nn.Module
    config: CSVConfig
    head: Optional[CertifiedHead]  # None when the full head is forced before generate (e.g. offloaded)
    out_dtype: torch.dtype
    post: Optional[PostHead] = None  # the architecture's post-head map (None: unknown, full head)
    # the head's per-weight entry (guard, static heads; hf_csv.transformers.heads.HeadEntry), None where ``head`` is
    entry: Optional["HeadEntry"] = None
    plan: Plan = FULL  # the call's certificate (hf_csv.transformers.plans), chosen by hf_csv.transformers.decision.set_plan
    step: StepState = field(default_factory=lambda: StepState())  # what one step hands to the next part of it
    reasons: list = field(default_factory=list)
    stats: CertStats = field(default_factory=CertStats)
    head_calls: int = 0
    full_calls: int = 0
    declined_rows: int = 0  # rows computed by the full head because the call was declined (see reasons)
    verify_reruns: int = 0
    post_checked: bool = False  # the run-time guard of the post-head map ran for this call
    force_full: Optional[str] = None  # a reason decided before generate started
    processors: Any = None  # the LogitsProcessorList generate built (when known)
    input_len: Optional[int] = None  # the length generate's sequences start at (its processors only see longer)
    replaced: Any = None  # the processor whose place the CSVLogitsProcessor took in that list (Nucleus: top-p)
    assisted: bool = False  # generate(assistant_model=...) or prompt lookup on this (target) model
    draft: bool = False  # this is the assistant model's session inside a candidate generator
    spec_ok: bool = False  # assisted by a model with hf_csv's exact verify: the target may use the Bounded plan
    whisper: WhisperRecord = field(default_factory=lambda: WhisperRecord())
    beam: BeamRecord = field(default_factory=lambda: BeamRecord())
    assist: AssistRecord = field(default_factory=lambda: AssistRecord())
    compiled: CompiledRecord = field(default_factory=lambda: CompiledRecord())
    caller_cache: bool = False  # the caller passed its own KV cache (``past_key_values``, or 5.24's ``cache``)
    cache_kwarg: str = "past_key_values"  # the model forward's KV-cache keyword on this version (hf_csv.transformers.compat)
    own_draw: bool = False  # Gumbel-coupled sampling: the head's own draw where stock's values on S cannot be had
    # the plan hands its values on S to stock's code and each shape's first certified step runs the column-subset
    # probe (hf_csv.transformers.decision._probe_per_shape, hf_csv.transformers.step.head_step)
    values_probe: bool = False
    check_prefix: Any = None  # the processors before the CSVLogitsProcessor, sorted once (hf_csv.transformers.processor_kinds.prefix)
    exact_depth: int = 0  # > 0: a processor's own forward (Whisper's no-speech detection) runs on the full head
    # Gumbel-coupled assisted sampling (CSVConfig(speculative="gumbel")): the call's noise per token index
    # (hf_csv.core.speculative.KeyedGumbel), shared by the target's session and its draft sessions
    gumbel: Any = None
    reports: dict = field(default_factory=dict)  # the summary's named reports (e.g. the draft head's stats), public

    @property
    def mode(self) -> str:
        """The plan's name, for reports (``csv_stats["mode"]``); decisions read :attr:`plan`."""
        return self.plan.name

    @property
    def check_processed(self) -> bool:
        """Whether a CSVLogitsProcessor checks each step of this call after the processors."""
        return self.plan.check_processed

    def note(self, reason: str, what: str = "") -> None:
        """Record a reason once per call and log it (transformers logging)."""
        if reason not in self.reasons:
            self.reasons.append(reason)
            _tlog(__name__).info("hf_csv: %s%s", what, reason)

    def set_full(self, reason: str) -> None:
        """Use the full head for the rest of this decoding call, and say why."""
        self.plan = FULL
        self.whisper.record = False  # the kept rows are stock's: Whisper's own avg-logprob applies (hf_csv.transformers.whisper)
        self.note(reason, "full LM head for this call: ")

    def summary(self) -> dict:
        """The call's statistics. ``certified_fraction`` is certified rows over every head row of the call (the
        certified head's and those the speed guard sent to the full head); no field is None or NaN. ``summary``
        is one line for people."""
        d = self.stats.as_dict()
        d.update(mode=self.mode, reasons=list(self.reasons), head_calls=self.head_calls,
                 full_head_calls=self.full_calls, verify_reruns=self.verify_reruns,
                 **row_totals(self.stats, self.declined_rows))
        d.update(self.reports)
        if self.step.guard_last is not None:
            guard, key = self.step.guard_last
            summ = guard.summary(key)
            if summ is not None:
                d["speed_guard"] = summ
        approx = self.approximations()
        d["exact"] = not approx
        d["summary"] = summary_line(self.stats, self.declined_rows,
                                    full_reason=full_head_reason(isinstance(self.plan, Full), self.reasons),
                                    approx=approx)
        return d

    def approximations(self) -> list:
        """What the caller opted into that is not stock's law or tokens (empty for an exact call): such a call's
        "certified" rows are the approximate certificate's."""
        approx = []
        if isinstance(self.plan, Epsilon):
            approx.append(f"ε-softmax, TV ≤ {self.plan.eps:g} a row")
        if self.assisted and self.config.speculative == "sigmoid":
            approx.append("the lossy sigmoid verify")
        return approx


def full_head_reason(full: bool, reasons: list) -> Optional[str]:
    """What :func:`summary_line` says of a call (or a draft head) that took the full head: its first reason."""
    return (reasons[0] if reasons else "declined") if full else None


def summary_line(stats: CertStats, declined_rows: int, full_reason: Optional[str] = None,
                 approx: Optional[list] = None) -> str:
    """The one line for people in a call's stats (``csv_stats["summary"]``, and the draft head's
    ``csv_stats["draft"]["summary"]``): "certified C/T rows (full head: F, why), mean |S| x % of V", or
    "full head (reason)" when ``full_reason`` says the call took the full head; led by "approximate (...): " when
    ``approx`` lists what the call opted into that is not exact."""
    lead = f"approximate ({', '.join(approx)}): " if approx else ""
    if full_reason is not None:
        return lead + f"full head ({full_reason})"
    total = stats.rows + declined_rows
    full = total - stats.certified
    why = []
    if declined_rows:
        why.append(f"speed guard {declined_rows}")
    if stats.fallback:
        why.append(f"certificate {stats.fallback}")
    return lead + (f"certified {stats.certified}/{total} rows" + (f" (full head: {full}, " + ", ".join(why) + ")"
                   if full and why else (f" (full head: {full})" if full else "")) +
                   (f", mean |S| {100 * stats.mean_subvocab_fraction:.3g} % of V" if stats.certified else ""))


def row_totals(stats: CertStats, declined_rows: int) -> dict:
    """Every head row of a call counted: ``head_rows`` = the certified head's ``rows`` + ``declined_rows`` (those the
    speed guard or a decline sent to the full head), and ``certified_fraction`` over all of them (0.0 when none)."""
    total = stats.rows + declined_rows
    return {"declined_rows": declined_rows, "head_rows": total,
            "certified_fraction": stats.certified / total if total else 0.0}


def _tlog(name: str = "hf_csv"):
    """The logger of the transformers integration, ``transformers.<name>`` (``name``: the calling module's
    ``__name__``): a child of transformers' library logger, so its handler and verbosity apply
    (``transformers.logging.set_verbosity_error()`` or ``TRANSFORMERS_VERBOSITY=error`` silence hf_csv's notices,
    ``logging.getLogger("transformers.hf_csv")`` filters them alone). A logger outside that tree (``hf_csv``)
    ignored transformers' verbosity and reached stderr through Python's last-resort handler, as a bare line."""
    from transformers.utils import logging as tlogging

    return tlogging.get_logger(f"transformers.{name}")
