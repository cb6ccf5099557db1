"""Which certificate a ``generate`` call gets: :func:`choose_plan`, a pure function from the call's facts
(:class:`hf_csv.transformers.call_facts.CallFacts`) to its plan and reasons (a
:class:`hf_csv.transformers.call_facts.Decision`), and :func:`set_plan`, which gathers the facts, chooses and sets the
session's plan in one place (:mod:`hf_csv.transformers.scope` calls it; no patching here). Also the plan of a compiled
static-cache decode (:func:`choose_compiled_plan`) and the stopping criteria's check.

Everything that cannot be proven exact goes to the full head with a logged reason
(docs/processors.md has the table). Approximation is reserved for ``CSVConfig(mode="epsilon")``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from hf_csv.core.static import StaticTopK
from hf_csv.transformers.call_facts import CallFacts, Decision, gather_facts
from hf_csv.transformers.method_plans import method_plan
from hf_csv.transformers.plans import Bounded, Epsilon, ExactBeam, Full, Nucleus, Plan, Sample, Threshold, TopK
from hf_csv.transformers.processor_kinds import classify_processor, classify_stopping_criterion
from hf_csv.transformers.session import CSVSession, _tlog
from hf_csv.transformers.step import call_guard, guard_key

__all__ = ["choose_plan", "set_plan", "check_stopping_criteria", "choose_compiled_plan"]


def choose_plan(facts: CallFacts) -> Decision:
    """The plan of one call and its reasons, from its facts alone: no session, no log line of its own (the facts'
    two asked values may do work or warn: :class:`hf_csv.transformers.call_facts.CallFacts`). The steps, in order:

    1. The base plan (:func:`_base_plan`): the call-wide declines (a reason decided before generate, reduced fp32
       matmul precision, an unknown post-head map, raw logits or stock's scores returned, Whisper's token
       timestamps, watermarking, guidance, processors that can raise uncomputed scores), then the decoding method's
       plan (:func:`hf_csv.transformers.method_plans.method_plan`).
    2. The values gate (:func:`_values_gate`): a plan that hands the values on S to stock's code as stock's needs
       them bit for bit (the column-subset probe; in a guarded sampling call left to each shape's first certified
       step, :func:`_probe_per_shape`); where this CPU cannot give them, Gumbel-coupled sampling takes the head's own
       draw, anything else the full head.
    3. Whisper's ``logprob_threshold`` (:func:`_whisper_logprob`): greedy top-1 rounds record the avg-logprob
       terms (hf_csv.transformers.whisper); other rounds take the full head.
    4. Whisper's no-speech detection (:func:`_no_speech`): it reads the first step's scores, so a top-k plan
       checks its rows; any other plan takes the full head.
    5. Whose values a top-k plan serves (:func:`_values_source`): stock's bits for a draft's confidence stop where
       the probe gives them, the head's own for a top-1 plan whose values nothing reads.
    """
    d = _base_plan(facts, Decision())
    d = _values_gate(facts, d)
    d = _whisper_logprob(facts, d)
    d = _no_speech(facts, d)
    return _values_source(facts, d)


def set_plan(session: CSVSession, generation_config: Any, processors: list) -> Plan:
    """Choose the certificate of this decoding call (:func:`choose_plan` on the facts of ``session``,
    ``generation_config`` and ``processors``) and set it on the session: ``session.plan``, its reasons (each logged
    once, transformers logging), ``own_draw`` and Whisper's record flag; beam search left on the full head warns
    once. Returns the plan."""
    d = choose_plan(gather_facts(session, generation_config, processors))
    session.whisper.steps = []
    # each reason said once, in order, as the session says one (its logger and format): the list is emptied before
    # each (a reason the values gate dropped is still said), then holds the reasons the decision keeps
    for lead, reason in d.said:
        session.reasons.clear()
        session.note(reason, lead)
    session.reasons[:] = d.reasons
    session.plan, session.own_draw, session.whisper.record = d.plan, d.own_draw, d.whisper_record
    session.values_probe = d.values_probe and not isinstance(d.plan, Full)
    if d.beams_warned:
        _tlog(__name__).warning("hf_csv: num_beams=%d runs the full LM head for this call (nothing certified). Pass "
                                "num_beams=1 for the certified path (ASR pipeline: generate_kwargs={'num_beams': 1}).",
                                d.beams_warned)
    return session.plan


def check_stopping_criteria(session: CSVSession, criteria: Any) -> None:
    """Send the call to the full head if a stopping criterion may read the (sub-vocabulary) scores."""
    unsafe = [type(c).__name__ for c in criteria or ()
              if classify_stopping_criterion(c) == "full"
              and not (session.draft and type(c).__name__ == "ConfidenceCriteria")]
    if unsafe and not isinstance(session.plan, Full):
        session.set_full(f"stopping criteria that may read the scores: {unsafe} (declare csv_safe = True on a "
                         "custom criterion that ignores them)")


# ------------------------------------------------------------------ the steps of choose_plan
def _base_plan(facts: CallFacts, d: Decision) -> Decision:
    """Step 1: the call-wide declines (:func:`_decline_reason`), then the decoding method's plan."""
    cfg = facts.config
    if facts.assisted and not facts.gumbel and cfg.speculative == "gumbel":
        d = d.note("CSVConfig(speculative='gumbel') couples an assistant model's drafts; this call has none "
                   "(prompt lookup): hf_csv's exact verify")
    why = _decline_reason(facts)
    return d.full(why) if why is not None else method_plan(facts, d)


def _decline_reason(facts: CallFacts) -> Optional[str]:
    """Why the whole call takes the full head whatever its decoding method (None: the method decides)."""
    if facts.force_full:
        return facts.force_full
    if facts.fp32_reason is not None:
        return (f"{facts.fp32_reason}: fp32 matmuls then round otherwise than the certificates' IEEE bound "
                "(docs/certificates.md §2.0)")
    if facts.post is None:
        return "unknown post-head transform"
    if facts.output_logits:
        return "output_logits=True: the raw logits must be the full head's"
    if (facts.output_scores and facts.config.scores != "subvocab" and not facts.draft
            and not (facts.whisper_scores_internal and facts.logprob_threshold is not None)):
        return ("output_scores=True: stock's scores need every logit (CSVConfig(scores='subvocab') returns "
                "the certified sub-vocabulary scores instead, -inf elsewhere)")
    if facts.whisper_logprob_reason:
        return facts.whisper_logprob_reason
    if facts.watermarking:
        return "watermarking reads every logit"
    if facts.guidance:
        return "classifier-free guidance mixes two heads' logits"
    if "full" in facts.kinds:
        return f"processors that can raise uncomputed scores or read all logits: {facts.kinds['full']}"
    return None


def _values_gate(facts: CallFacts, d: Decision) -> Decision:
    """Step 2. Stock's values on S are not this process's values (docs/certificates.md §2.0): a path that hands them
    to stock's sampler or scores is not exact here. Where the call promises stock's tokens for the seed (top-k,
    min-p, top-p sampling: README, docs/user_guide.md) it runs stock's full head, as the probe's warning says;
    hf_csv's own draw (exact law, another random stream, decided within the slack) stands in only where the call
    promises the law alone: Gumbel-coupled assisted sampling (CSVConfig(speculative="gumbel")).
    (CSVConfig(mode="sample") asks for the own draw on any host: step 1 picked it, and it reads no values.) In a
    guarded sampling call the probe is not run here (:func:`_probe_per_shape`): unless it already failed, the plan
    stays and each shape's first certified step asks it, its steps on the full head until a kernel matched."""
    why = _reads_values(facts, d.plan, d.whisper_record)
    if why is None:
        return d
    if _probe_per_shape(facts):
        if facts.subset_verdict() is not False:  # passed, or not probed yet: each shape's first certified step asks
            return replace(d, values_probe=True)
    elif facts.subset_exact():
        return d
    if isinstance(d.plan, TopK) and facts.do_sample and facts.gumbel:
        own = _base_plan(facts, Decision(own_draw=True))
        d = replace(own, said=d.said + own.said)
        if isinstance(d.plan, Sample):
            d = d.note(f"{why}: this CPU's BLAS rounds a column subset differently from the full call, so "
                       "Gumbel-coupled sampling (CSVConfig(speculative='gumbel'), stock's law, not its random "
                       "stream) draws in the head itself")
    if isinstance(d.plan, Sample):
        return d
    return replace(d, reasons=()).full(
        f"{why}: needs stock's values on S bit for bit, and this CPU's BLAS rounds a column subset differently from "
        "the full call: the full head, stock's tokens for the seed (docs/certificates.md §2.0)")


def _probe_per_shape(facts: CallFacts) -> bool:
    """Whether the values gate leaves the column-subset probe to each shape's first certified step: in a guarded
    call (a large head on CPU) that samples without an assistant or beams. The speed guard then starts a shape whose
    rows were not probed on stock's head and tries the certified head a ``max_probe`` in (hf_csv.transformers.step),
    so the probe (a few full-head calls of work, docs/benchmarks.md "Value slack") is paid once, there, and a call the
    guard keeps on stock's head never pays it. Elsewhere the probe runs here, before the plan is chosen."""
    return facts.guarded and facts.do_sample and facts.num_beams == 1 and not (facts.assisted or facts.draft)


def _whisper_logprob(facts: CallFacts, d: Decision) -> Decision:
    """Step 3. Whisper's ``logprob_threshold`` (the temperature-fallback decision reads the kept scores): greedy
    rounds keep the certified top-1 and record per-step normalizer bounds (hf_csv.transformers.whisper); sampling
    rounds use the full head."""
    plan = d.plan
    if not facts.whisper_scores_internal or facts.logprob_threshold is None or isinstance(plan, Full):
        return d
    if isinstance(plan, TopK) and plan.k == 1 and not facts.do_sample \
            and facts.post is not None and facts.post.identity:
        return replace(d, whisper_record=True, plan=replace(plan, check_processed=True))
    return d.full(f"Whisper's logprob_threshold in a {plan.name!r} round (temperature fallback): the avg-logprob "
                  "decision is certified for greedy rounds only")


def _no_speech(facts: CallFacts, d: Decision) -> Decision:
    """Step 4. Whisper's no-speech detection reads the first step's scores: FullHeadDuring gives it stock's row from
    the stashed step, which a top-k plan's check keeps; any other plan takes the full head."""
    plan = d.plan
    if isinstance(plan, Full) or not any(type(p).__name__ == "WhisperNoSpeechDetection"
                                         and int(getattr(p, "start_of_trans_offset", 2)) <= 1
                                         for p in facts.processors):
        return d
    if isinstance(plan, TopK):
        return d.to(replace(plan, check_processed=True))
    return d.full(f"Whisper's no-speech detection reads the first step's scores in a {plan.name!r} round: full head")


def _values_source(facts: CallFacts, d: Decision) -> Decision:
    """Step 5. The draft's confidence stop reads its values: stock's bits (the probed kernel) give the check its tight
    interval, where the head's own values would leave it their slack and send more rows to stock's head. A top-1
    plan whose every decision on its values is proven within their slack serves hf_csv's own values (the native
    epilogue)."""
    plan = d.plan
    if not isinstance(plan, TopK):
        return d
    if plan.confidence and facts.subset_exact():
        return d.to(replace(plan, stock_values=True))
    if plan.k == 1 and plan.k_head <= 1 and _reads_values(facts, plan, d.whisper_record) is None:
        return d.to(replace(plan, own_values=True))
    return d


def _reads_values(facts: CallFacts, plan: Plan, whisper_record: bool) -> Optional[str]:
    """Why ``plan`` needs the values on S to be stock's bit for bit (it hands them to stock's sampler, verify or
    timestamp / log-prob rules, or returns them as scores), or ``None`` where it only takes decisions that the
    values' slack is checked against (greedy argmax and a greedy draft's confidence stop, hf_csv's own draws) or
    serves a draft whose law is all that counts. A sampled draft on the checked top-k plan hands its rows to stock's
    sampler and verify as stock's draft's (docs/speculative.md, "top-k path, same tokens"): it reads them."""
    if isinstance(plan, (Full, Sample)):
        return None
    if facts.draft:
        if isinstance(plan, TopK) and plan.check_after is not None:
            return "a sampled draft on the checked top-k plan (stock's sampler and verify read its values)"
        return None
    if isinstance(plan, (Threshold, Nucleus, Bounded, ExactBeam)) or (isinstance(plan, Epsilon) and plan.beams):
        return f"mode {plan.name!r} (stock's warper or verify reads the values)"
    if isinstance(plan, TopK):
        if facts.do_sample:
            return "top-k sampling with stock's sampler"
        if plan.ts_proc is not None or plan.always:
            return "Whisper's timestamp rule (it reads the timestamp block's values)"
        if whisper_record:
            return "Whisper's avg-logprob rule"
        if facts.output_scores:
            return "output_scores with CSVConfig(scores='subvocab')"
        if plan.k != 1:
            return f"a certified top-{plan.k} read by later processors"
    return None


# ------------------------------------------------------------------ a compiled static-cache decode
# lowering processors a compiled step can take without the per-step check: a fixed set to -inf at every step
# (folded into the static head's certificate), and one that fires only at the first generated step (the eager
# prefill; CSVLogitsProcessor checks that it never fires on a compiled step)
_STATIC_LOWER = {"SuppressTokensLogitsProcessor", "SuppressTokensAtBeginLogitsProcessor"}
# a compiled sampled call with top_k = K gets a candidate capacity of at least this many times K
_SAMPLED_CAPACITY = 40


@dataclass(frozen=True)
class _CompiledCall:
    """What a compiled decode runs around the head: the processors (without hf_csv's check), whether it samples
    after a checked top-k warper (``sampled``), the order-preserving processors before that warper (``temps``), the
    lowering ones the static head cannot fold (``lowering``) and the set size ``k``."""

    procs: list
    sampled: bool
    temps: list
    lowering: list
    k: int


def _compiled_call(session: CSVSession, plan: Plan) -> _CompiledCall:
    procs = [p for p in session.processors or () if getattr(p, "csv_kind", None) != "csv"]
    topk_proc = plan.check_after if isinstance(plan, TopK) else None
    sampled = topk_proc is not None and classify_processor(topk_proc) == "topk" and any(p is topk_proc for p in procs)
    # sampled: what runs before the top-k warper is what the certificate must survive; after it, stock's vector
    before = procs[:next(i for i, p in enumerate(procs) if p is topk_proc)] if sampled else procs
    lowering = sorted({type(p).__name__ for p in before if classify_processor(p) == "lower"} - _STATIC_LOWER)
    temps = [p for p in before if classify_processor(p) == "order"]
    k = max(int(plan.k), int(getattr(topk_proc, "top_k", 0))) if sampled else 1
    return _CompiledCall(procs=procs, sampled=sampled, temps=temps, lowering=lowering, k=k)


def choose_compiled_plan(session: CSVSession, batch: Optional[int] = None, gemm_reason: Optional[str] = None) -> Any:
    """The plan of a call whose decode steps transformers runs through a compiled forward (static cache).

    Inside a compiled graph no per-step Python runs: no stash for :class:`CSVLogitsProcessor`'s check, no
    re-run. So only calls whose check is not needed there get a static certified head
    (:class:`hf_csv.core.static.StaticTopK`, docs/certificates.md §3.9): greedy calls, and sampled calls whose single
    top-k warper has at most a temperature warper before it (the cut is made strict after the temperature, so every
    later warper and the sampler see stock's vector); no lowering processor other than Whisper's suppress lists
    before the top-k, an identity post-head map, a screen head without a bias. Every other call uses the full head
    (in the graph and out of it), with the reason logged (:func:`_compiled_decline_reason`). Returns the plan, or
    ``None`` after ``set_full``.

    ``gemm_reason``: why the graph's GEMM may round otherwise than eager BLAS
    (``hf_csv.transformers.scope._graph_gemm_reason``: max-autotune, a backend other than inductor or eager); a
    sampled call hands the graph's values to stock's sampler, so it then takes the full head (greedy calls are
    decided within the values' slack and keep the head).

    Speed: a compiled step cannot be timed, so where the head's speed guard has measured the full head faster on
    this call's eager steps (the prefill, same mode and ``batch`` rows), the graph gets stock's head while the
    session stays certified for its eager steps, which keep feeding (and probing) the guard; ``None`` is returned
    and ``session.compiled.stock`` is set.
    """
    plan = session.plan
    if isinstance(plan, Full):
        return None
    ch = session.head
    rows = getattr(getattr(ch, "provider", None), "rows", None)
    call = _compiled_call(session, plan)
    why = _compiled_decline_reason(session, plan, call, rows, gemm_reason)
    if why is not None:
        session.set_full(f"torch.compile (static cache): {why} is certified only in eager decoding")
        return None
    sup = sorted({int(t) for p in call.procs if type(p).__name__ == "SuppressTokensLogitsProcessor"
                  for t in p.suppress_tokens.reshape(-1).tolist() if 0 <= int(t) < ch.vocab_size})
    # a top-K set is wider than a top-1 set (about 10·K tokens on real heads, docs/benchmarks.md §9.8)
    C = min(max(session.config.compile_capacity, _SAMPLED_CAPACITY * call.k if call.sampled else 0),
            ch.vocab_size - 1 - len(sup))
    if C < call.k:
        session.set_full("torch.compile (static cache): the suppressed tokens leave no room for a candidate set")
        return None
    if call.sampled and not ch.graph_gather_exact(C, batch or 1):
        session.set_full("torch.compile (static cache): top-k sampling hands the graph's values on S to stock's "
                         "sampler, and this CPU's BLAS computes the graph's gathered candidate rows otherwise than "
                         "the full call (CertifiedHead.graph_gather_exact); certified only in eager decoding")
        return None
    guard = call_guard(session)
    if batch is not None and guard is not None and guard.prefers_full(guard_key(session, batch)):
        session.note("torch.compile (static cache): the speed guard measured the full head faster for this shape on "
                     "the eager steps: stock's head inside the graph")
        session.compiled.stock = True
        return None
    temperature = float(call.temps[0].temperature) if call.sampled and call.temps else None
    return _static_plan(session, rows, C, sup, call.k, temperature)


def _compiled_decline_reason(session: CSVSession, plan: Plan, call: _CompiledCall, rows: Any,
                             gemm_reason: Optional[str]) -> Optional[str]:
    """Why this compiled decode cannot run the static certified head (None: it can)."""
    ch, sampled = session.head, call.sampled
    if not isinstance(plan, TopK) or (plan.k != 1 and not sampled) or plan.always or session.whisper.record or (
            plan.ts_proc is not None):
        return f"mode {plan.name!r} (k={getattr(plan, 'k', 1)}) with its per-step check"
    if sampled and (len(call.temps) > 1 or any(type(p).__name__ != "TemperatureLogitsWarper" for p in call.temps)):
        return f"the order processors {[type(p).__name__ for p in call.temps]} before the top-k warper"
    if call.lowering:
        return f"the lowering processors {call.lowering} with their per-step check"
    if not session.post.identity:
        return f"the post-head transform {session.post.describe()} with its per-step check"
    if session.assisted or session.draft:
        return "assisted generation"
    if rows is None or getattr(rows, "q", None) is None or rows.q.dtype != torch.int8:
        return "the compiled head needs the int8 screen (provider='screen', screen_quant='int8')"
    if getattr(ch, "bias", None) is not None:
        return "a head with a bias"
    if sampled and gemm_reason is not None:
        return f"top-k sampling under {gemm_reason}, whose GEMM on the gathered candidate rows is not the one probed"
    if sampled and getattr(ch, "subset_kernel", lambda probe=False: None)(probe=True) != "gathered":
        # the graph computes S's values on gathered rows: they are stock's only where the probe, run now under this
        # call's setting, found the gathered kernel matching the full call (docs/certificates.md §2.0); elsewhere
        # only the eager head's blocked kernel, or none, gives stock's values
        return "top-k sampling on a CPU whose BLAS rounds gathered rows differently from the full call"
    return None


def _static_plan(session: CSVSession, rows: Any, C: int, sup: list, k: int, temperature: Optional[float]) -> StaticTopK:
    """The head's static plan for this capacity, suppressed set, k and temperature: one per head and key, so a
    reused plan keeps dynamo's guards."""
    ch = session.head
    plans = session.entry.static_plans if session.entry is not None else {}
    key = (C, tuple(sup), k, temperature)
    plan = plans.get(key)
    if plan is None:
        screen = ch.provider if getattr(ch.provider, "name", None) == "screen" else None
        plan = plans[key] = StaticTopK(ch.weight, rows, k=k, capacity=C,
                                       suppress=torch.tensor(sup, dtype=torch.long) if sup else None, screen=screen,
                                       temperature=temperature)
    return plan
