"""Which certificate a ``generate`` call gets: :func:`decide_mode` returns its :mod:`hf_csv.transformers.plans` value from the
generation config and the processors (classified by the tables in :mod:`hf_csv.transformers.plans`); no patching here
(:mod:`hf_csv.transformers.scope` calls it).

Everything that cannot be proven exact goes to the full head with a logged reason
(docs/processors.md has the table). Approximation is reserved for ``CSVConfig(mode="epsilon")``.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Optional

import torch

from hf_csv.core.certificate import fp32_matmul_reason
from hf_csv.core.config import lowered_k
from hf_csv.transformers.session import CSVSession, _tlog
from hf_csv.transformers.plans import (BEAM_PROCESSORS, LAW_ORDERS, Bounded, Epsilon, ExactBeam, Full, Nucleus, Plan, Sample, Threshold,
                   TopK, classify_processor, classify_stopping_criterion, inert, masks_only)
from hf_csv.core.static import StaticTopK
from hf_csv.transformers.step import call_guard, guard_key

# Whisper settings that read log-probabilities over the whole vocabulary (token timestamps' scores). Timestamps
# are certified (``_timestamp_plan``), and so is the temperature-fallback decision in greedy rounds (hf_csv.transformers.whisper).
_WHISPER_LOGPROB_KEYS = ("return_token_timestamps",)

__all__ = ["classify_processor", "masks_only", "classify_stopping_criterion", "decide_mode", "check_stopping_criteria",
           "whisper_log_prob_reason", "decide_compiled"]


def check_stopping_criteria(session: CSVSession, criteria: Any) -> None:
    """Send the call to the full head if a stopping criterion may read the (sub-vocabulary) scores."""
    unsafe = [type(c).__name__ for c in criteria or ()
              if classify_stopping_criterion(c) == "full"
              and not (session.draft and type(c).__name__ == "ConfidenceCriteria")]
    if unsafe and not isinstance(session.plan, Full):
        session.set_full(f"stopping criteria that may read the scores: {unsafe} (declare csv_safe = True on a "
                         "custom criterion that ignores them)")


def whisper_log_prob_reason(*configs: Any, kwargs: Optional[dict] = None) -> Optional[str]:
    """A reason when Whisper's thresholds or timestamps are set, in kwargs or on any generation config."""
    for key in _WHISPER_LOGPROB_KEYS:
        vals = [(kwargs or {}).get(key)] + [getattr(c, key, None) for c in configs if c is not None]
        if any(v not in (None, False) for v in vals):
            return f"Whisper's {key} reads log-probabilities over the full vocabulary"
    return None


def _warn_beams(session: CSVSession, num_beams: int) -> None:
    """One warning per call where beam search leaves the whole call on the full head: the ASR pipeline asks for
    5 beams by default, so its users would otherwise get nothing certified and no word of it (INFO is silent)."""
    if num_beams > 1:
        _tlog(__name__).warning("hf_csv: num_beams=%d runs the full LM head for this call (nothing certified). Pass "
                        "num_beams=1 for the certified path (ASR pipeline: generate_kwargs={'num_beams': 1}).",
                        num_beams)


def _beam_exact_reason(session: CSVSession, gc: Any, processors: list) -> Optional[str]:
    """Why this beam search cannot run the token-identical certificate (None: it can)."""
    if session.assisted or session.draft:
        return "assisted beam search is not certified"
    mode = gc.get_generation_mode() if hasattr(gc, "get_generation_mode") else None
    if str(getattr(mode, "value", mode)) != "beam_search":
        return f"{getattr(mode, 'value', mode)} is not certified (plain beam search is)"
    if not session.post.identity:
        return f"beam search after a post-head transform ({session.post.describe()})"
    if session.caller_cache:
        return ("beam search with a cache passed by the caller: a call hf_csv cannot certify is re-run on the full "
                "head, which needs a fresh cache")
    if session.beam.restart:
        return session.beam.restart
    # (an admitted name can still classify "full": a repetition penalty < 1 or a positive sequence bias raises scores)
    other = sorted({type(p).__name__ for p in processors if classify_processor(p) != "csv"
                    and (type(p).__name__ not in BEAM_PROCESSORS or classify_processor(p) == "full")})
    if other:
        return f"beam search with processors {other} (token-identical beam search takes per-token lowering ones)"
    return None


def decide_mode(session: CSVSession, generation_config: Any, processors: list) -> Plan:
    """Pick the certificate for this decoding call from the generation config and processors.

    Sets ``session.plan`` (a :mod:`hf_csv.transformers.plans` value) and returns it; every fallback to the full head logs its
    reason.

    Whisper's ``logprob_threshold`` (the temperature-fallback decision reads the kept scores): greedy rounds keep
    the certified top-1 and record per-step normalizer bounds (hf_csv.transformers.whisper); sampling rounds use the full head.
    """
    session.whisper.record, session.whisper.steps = False, []
    session.own_draw = False
    _decide(session, generation_config, processors)
    why = _reads_values(session, generation_config)
    if why is not None and not _subset_exact(session):
        # stock's values on S are not this process's values (docs/certificates.md §2.0): a path that hands them to
        # stock's sampler or scores is not exact here. Where the call promises stock's tokens for the seed (top-k,
        # min-p, top-p sampling: README, docs/user_guide.md) it runs stock's full head, as the probe's warning says;
        # hf_csv's own draw (exact law, another random stream, decided within the slack) stands in only where the
        # call promises the law alone: Gumbel-coupled assisted sampling (CSVConfig(speculative="gumbel")).
        # (CSVConfig(mode="sample") asks for the own draw on any host: _decide picked it, and it reads no values.)
        if isinstance(session.plan, TopK) and getattr(generation_config, "do_sample", False) \
                and session.gumbel is not None:
            session.own_draw = True
            _decide(session, generation_config, processors)
            if isinstance(session.plan, Sample):
                session.note(f"{why}: this CPU's BLAS rounds a column subset differently from the full call, so "
                             "Gumbel-coupled sampling (CSVConfig(speculative='gumbel'), stock's law, not its random "
                             "stream) draws in the head itself")
        if not isinstance(session.plan, Sample):
            session.reasons.clear()
            session.set_full(f"{why}: needs stock's values on S bit for bit, and this CPU's BLAS rounds a column "
                             "subset differently from the full call: the full head, stock's tokens for the seed "
                             "(docs/certificates.md §2.0)")
            return session.plan
    plan = session.plan
    if session.whisper.scores_internal and getattr(generation_config, "logprob_threshold", None) is not None \
            and not isinstance(plan, Full):
        if isinstance(plan, TopK) and plan.k == 1 and not getattr(generation_config, "do_sample", False) \
                and session.post is not None and session.post.identity:
            session.whisper.record, session.plan = True, replace(plan, verify=True)
        else:
            session.set_full(f"Whisper's logprob_threshold in a {plan.name!r} round (temperature fallback): the "
                             "avg-logprob decision is certified for greedy rounds only")
    plan = session.plan
    if not isinstance(plan, Full) and any(type(p).__name__ == "WhisperNoSpeechDetection"
                                          and int(getattr(p, "start_of_trans_offset", 2)) <= 1 for p in processors):
        # the detector reads the first step's scores: FullHeadDuring gives it stock's row from the stashed step
        if isinstance(plan, TopK):
            session.plan = replace(plan, verify=True)
        else:
            session.set_full(f"Whisper's no-speech detection reads the first step's scores in a {plan.name!r} "
                             "round: full head")
    plan = session.plan
    if isinstance(plan, TopK) and plan.confidence and _subset_exact(session):
        # the draft's confidence stop reads its values: stock's bits (the probed kernel) give the check its tight
        # interval, where the head's own values would leave it their slack and send more rows to stock's head
        session.plan = replace(plan, stock_values=True)
        return session.plan
    if isinstance(plan, TopK) and plan.k == 1 and plan.k_head <= 1 and _reads_values(session, generation_config) is None:
        # every decision on its values is proven within their slack: hf_csv's own values serve (the native epilogue)
        session.plan = replace(plan, own_values=True)
    return session.plan


def _own_draw(session: CSVSession) -> bool:
    """Sampling through the head's own exact draw (``CSVConfig(mode="sample")``, or Gumbel-coupled sampling where
    stock's values on S cannot be had bit for bit)."""
    return session.config.mode == "sample" or session.own_draw


def _subset_exact(session: CSVSession) -> bool:
    probe = getattr(session.head, "subset_exact", None)
    return bool(probe()) if callable(probe) else False


def _reads_values(session: CSVSession, gc: Any) -> Optional[str]:
    """Why this plan needs the values on S to be stock's bit for bit (it hands them to stock's sampler, verify or
    timestamp / log-prob rules, or returns them as scores), or ``None`` where it only takes decisions that the
    values' slack is checked against (greedy argmax and a greedy draft's confidence stop, hf_csv's own draws) or
    serves a draft whose law is all that counts. A sampled draft on the checked top-k plan hands its rows to stock's
    sampler and verify as stock's draft's (docs/speculative.md, "top-k path, same tokens"): it reads them."""
    plan = session.plan
    if isinstance(plan, (Full, Sample)):
        return None
    if session.draft:
        if isinstance(plan, TopK) and plan.check_after is not None:
            return "a sampled draft on the checked top-k plan (stock's sampler and verify read its values)"
        return None
    if isinstance(plan, (Threshold, Nucleus, Bounded, ExactBeam)) or (isinstance(plan, Epsilon) and plan.beams):
        return f"mode {plan.name!r} (stock's warper or verify reads the values)"
    if isinstance(plan, TopK):
        if getattr(gc, "do_sample", False):
            return "top-k sampling with stock's sampler"
        if plan.ts_proc is not None or plan.always:
            return "Whisper's timestamp rule (it reads the timestamp block's values)"
        if session.whisper.record:
            return "Whisper's avg-logprob rule"
        if getattr(gc, "return_dict_in_generate", False) and getattr(gc, "output_scores", False):
            return "output_scores with CSVConfig(scores='subvocab')"
        if plan.k != 1:
            return f"a certified top-{plan.k} read by later processors"
    return None


def _decide(session: CSVSession, generation_config: Any, processors: list) -> CSVSession:
    gc = generation_config
    cfg = session.config
    session.reasons.clear()
    if session.assisted and session.gumbel is None and cfg.speculative == "gumbel":
        session.note("CSVConfig(speculative='gumbel') couples an assistant model's drafts; this call has none "
                     "(prompt lookup): hf_csv's exact verify")
    if session.force_full:
        session.set_full(session.force_full)
        return session
    w = getattr(session.head, "weight", None)
    # fp32: stock's own head; fp16: the certificate's fp32 GEMMs on fp16 values (bf16 values stay exact in bf16
    # passes): both leave the IEEE fp32 bound the certificates prove against
    why = fp32_matmul_reason(w.device) if torch.is_tensor(w) and w.dtype in (torch.float32, torch.float16) else None
    if why is not None:
        session.set_full(f"{why}: fp32 matmuls then round otherwise than the certificates' IEEE bound "
                         "(docs/certificates.md §2.0)")
        return session
    if session.post is None:
        session.set_full("unknown post-head transform")
        return session
    if getattr(gc, "return_dict_in_generate", False) and getattr(gc, "output_logits", False):
        session.set_full("output_logits=True: the raw logits must be the full head's")
        return session
    if (getattr(gc, "return_dict_in_generate", False) and getattr(gc, "output_scores", False)
            and cfg.scores != "subvocab" and not session.draft
            and not (session.whisper.scores_internal and getattr(gc, "logprob_threshold", None) is not None)):
        session.set_full("output_scores=True: stock's scores need every logit (CSVConfig(scores='subvocab') returns "
                         "the certified sub-vocabulary scores instead, -inf elsewhere)")
        return session
    reason = whisper_log_prob_reason(gc)
    if reason:
        session.set_full(reason)
        return session
    if getattr(gc, "watermarking_config", None) is not None:
        session.set_full("watermarking reads every logit")
        return session
    gs = getattr(gc, "guidance_scale", None)
    if gs is not None and gs != 1:
        session.set_full("classifier-free guidance mixes two heads' logits")
        return session
    kinds: dict = {}
    for p in processors:
        if not inert(p, session.input_len):  # (an assistant's minimum length at its input length: no 'lower' kind)
            kinds.setdefault(classify_processor(p), []).append(type(p).__name__)
    if "full" in kinds:
        session.set_full(f"processors that can raise uncomputed scores or read all logits: {kinds['full']}")
        return session
    num_beams = int(getattr(gc, "num_beams", 1) or 1)
    do_sample = bool(getattr(gc, "do_sample", False))
    if "timestamps" in kinds:
        return _timestamp_plan(session, processors, kinds, do_sample, num_beams)
    temperature, top_k, warps = 1.0, None, []
    for p in processors:
        if type(p).__name__ == "TemperatureLogitsWarper":
            temperature *= float(p.temperature)
            warps.append(("temperature", float(p.temperature)))
        elif classify_processor(p) == "topk":
            k = int(p.top_k)
            top_k = k if top_k is None else min(top_k, k)
            warps.append(("top_k", k))
    lower = "lower" in kinds
    norm = "norm" in kinds
    post = session.post
    if (session.assisted or session.draft) and getattr(gc, "assistant_ensemble_weight", None) is not None:
        session.set_full("assistant_ensemble_weight mixes the target's and the draft's softmax over the full "
                         "vocabulary")
        return session
    # Gumbel-coupled assisted sampling (CSVConfig(speculative="gumbel")): the target and its drafts each draw
    # argmax(stock's processed row + the token index's noise); the plans of plain sampling give exactly that (their
    # rows are stock's processed rows, or the certified draw itself with the keyed noise), and the verify compares
    # (docs/speculative.md)
    coupled = do_sample and session.gumbel is not None
    if session.draft and not coupled:
        return _decide_draft(session, gc, kinds, do_sample, top_k, processors)
    if session.assisted and do_sample and not coupled:
        return _assisted_sampling_plan(session, processors, kinds, num_beams, temperature)
    if not do_sample and num_beams == 1:
        if norm:
            # log-softmax renormalization shifts every score by a normalizer only the full head knows
            session.set_full(f"greedy with normalizing processors {kinds['norm']}")
            return session
        # greedy: argmax of processed scores. The post map and lowering processors need the per-row
        # check (rounding in the post map can tie an uncomputed token with the winner).
        session.plan = TopK(k=1, verify=lower or not post.identity,
                            k_head=lowered_k(1, session.head.vocab_size) if lower else 0)
        return session
    if not do_sample and num_beams > 1:
        if getattr(gc, "return_dict_in_generate", False) and getattr(gc, "output_scores", False):
            # (CSVConfig(scores='subvocab') too, exact or ε: a beam row's scores and sequences_scores are log-softmax
            # values, which need each row's normalizer over all of V)
            session.set_full("beam search with output_scores: its scores and sequences_scores need each row's full "
                             "normalizer")
            _warn_beams(session, num_beams)
            return session
        # the exact certificate wins when asked for, also under mode='epsilon' (which then covers only what it cannot)
        if cfg.mode != "epsilon" or cfg.beam_search == "exact":
            why = _beam_exact_reason(session, gc, processors) if cfg.beam_search == "exact" else (
                "beam search runs the full head by default (its log_softmax needs each row's normalizer); "
                "CSVConfig(beam_search='exact') runs the token-identical certificate, measured slower on real heads "
                "(docs/benchmarks.md §9.9), and CSVConfig(mode='epsilon') the approximate beam_epsilon one")
            if why is None:
                # token-identical beam search (docs/certificates.md §3.10): S holds every row's top beams_to_keep
                eos = getattr(gc, "eos_token_id", None)
                n_eos = 0 if eos is None else (1 if isinstance(eos, int) else len(torch.as_tensor(eos).reshape(-1)))
                session.plan = ExactBeam(k=max(2, 1 + n_eos) * num_beams)
                return session
            if cfg.mode != "epsilon":
                session.set_full(why)
                _warn_beams(session, num_beams)
                return session
            session.note(f"token-identical beam search declined ({why}): CSVConfig(mode='epsilon') runs the "
                         "approximate beam_epsilon certificate instead")
        if norm and kinds["norm"] != ["LogitNormalization"]:
            session.set_full(f"beam search with normalizing processors {kinds['norm']}")
            return session
        if not post.identity:
            session.set_full(f"beam search after a post-head transform ({post.describe()})")
            return session
        # ε-certificate (approximate); the top-2·num_beams of every row is then checked
        session.plan = Epsilon(verify=True, eps=cfg.beam_epsilon, temperature=temperature, beams=num_beams)
        return session
    if num_beams > 1:
        session.set_full("beam sampling is not certified")
        return session
    # multinomial sampling
    topks = [i for i, p in enumerate(processors) if classify_processor(p) == "topk"]
    if _top_k_plan(session, processors, topks):
        return session
    why = _min_p_plan(session, processors, topks)
    if why is None:
        return session
    if _top_p_plan(session, processors, topks, temperature):
        return session
    if not post.keeps_neg_inf:
        session.set_full(f"sampling after {post.describe()}: the map turns uncomputed -inf logits into finite "
                         "scores that keep probability")
        return session
    orders = {type(p).__name__ for p in processors if classify_processor(p) == "order"}
    if lower and not norm and len(topks) == 0 and orders <= LAW_ORDERS:
        # lazy Gumbel with the draw after the lowering processors (docs/certificates.md §2.3): they only lower
        # scores, so the head's upper bounds stay upper bounds; the CSVLogitsProcessor (last) draws and checks
        session.plan = Sample(verify=True, warps=tuple(warps), draw_after=True)
        return session
    if lower:
        session.set_full(f"sampling with token-specific processors {kinds['lower']} and a normalizing warper "
                         "or several top-k warpers")
        return session
    if norm:
        if cfg.mode == "epsilon" and post.identity:
            session.plan = Epsilon(eps=cfg.epsilon, temperature=temperature)
            return session
        session.set_full(f"normalizing warpers {kinds['norm']} without a top-k before them need the whole "
                         "distribution (CSVConfig(mode='epsilon') allows TV <= epsilon)")
        return session
    if len(topks) > 1:
        session.set_full("several top-k warpers")
        return session
    if orders - LAW_ORDERS:
        # "order" means argmax-invariant, not law-invariant: x -> 3x keeps every argmax and changes the law, and the
        # head's own draw models temperature and the top-k filter only (docs/certificates.md §2.3)
        session.set_full(f"sampling with order-preserving processors {sorted(orders - LAW_ORDERS)} whose effect on "
                         "the law the certified draw does not model")
        return session
    session.plan = Sample(warps=tuple(warps))
    return session


def _timestamp_plan(session: CSVSession, processors: list, kinds: dict, do_sample: bool,
                    num_beams: int) -> CSVSession:
    """Greedy Whisper decoding with timestamps (docs/certificates.md §3.4): certified top-1 of the text
    tokens plus the exact logits of every token from the first special token (eos) on, timestamps
    included, on every row; the check right before the WhisperTimeStampLogitsProcessor proves that the
    processor takes stock's decision (timestamp or text) and that the argmax after it is stock's."""
    if session.assisted or session.draft:
        session.set_full("Whisper timestamps in assisted generation: not certified (full head)")
        return session
    if do_sample or num_beams > 1:
        session.set_full("Whisper timestamps with sampling (temperature fallback) or beam search: the timestamp "
                         "rule's logsumexp is certified for greedy decoding only")
        _warn_beams(session, num_beams)
        return session
    names = [type(p).__name__ for p in processors]
    ts = [i for i, n in enumerate(names) if classify_processor(processors[i]) == "timestamps"]
    if len(ts) != 1 or ts[0] != len(processors) - 1:
        session.set_full(f"Whisper's timestamp processor not last, or more than one: {names}")
        return session
    if {classify_processor(p) for p in processors[:-1]} - {"order", "lower"}:
        session.set_full(f"Whisper timestamps with normalizing processors {kinds.get('norm')}")
        return session
    if getattr(session.head, "modes", None) is not None:
        session.set_full("the vocabulary-parallel head does not compute Whisper's timestamp block")
        return session
    proc = processors[-1]
    V = session.head.vocab_size
    eos = getattr(proc, "eos_token_id", None)
    eos = min(eos) if isinstance(eos, (list, tuple)) and eos else eos
    tb = int(proc.timestamp_begin)
    start = min(tb, int(eos)) if isinstance(eos, int) and eos >= 0 else tb
    if not (0 < start <= tb < V):
        session.set_full(f"Whisper timestamps with an unexpected vocabulary layout (timestamp_begin {tb}, V {V})")
        return session
    session.plan = TopK(k=1, verify=True, ts_proc=proc, always=V - start)
    return session


def _top_k_plan(session: CSVSession, processors: list, topks: list) -> bool:
    """Certified top-K checked right after the first top-k warper (docs/certificates.md §3.2), when only
    order-preserving or lowering processors come before it: from there on every processor (top-p, min-p, a second
    top-k, ...), stock's sampler and the speculative verify see exactly stock's vector. (An assistant's list holds
    the target's warpers and its own again: transformers 5.x passes the target's processors to the assistant's
    generate.) K is the first warper's k. Returns whether it was set."""
    if not topks or _own_draw(session):
        return False
    i = topks[0]
    top_k = int(processors[i].top_k)
    if top_k >= session.head.vocab_size:
        return False
    if not {classify_processor(p) for p in processors[:i]} <= {"order", "lower"}:
        return False
    lowered = any(classify_processor(p) == "lower" for p in processors[:i])
    session.plan = TopK(k=top_k, verify=True, check_after=processors[i],
                        k_head=lowered_k(top_k, session.head.vocab_size) if lowered else 0)
    return True



# min-p's kept set is {p_i >= min_p · p_max} = {x_i − max >= ln(min_p)}; below this, min_p would keep
# tokens whose probability underflows (docs/certificates.md §3.3)
_MIN_LOG_MIN_P = -60.0


def _min_p_plan(session: CSVSession, processors: list, topks: list) -> Optional[str]:
    """Threshold mode for min-p sampling without a top-k (docs/certificates.md §3.3): the head computes
    every token within ``delta`` of the max, and the check right before the min-p warper proves that
    the warper keeps exactly stock's tokens. Returns None when set, else why not (the caller goes on)."""
    if topks or _own_draw(session):
        return "top-k present or sample mode requested"
    names = [type(p).__name__ for p in processors]
    norms = [i for i, p in enumerate(processors) if classify_processor(p) == "norm"]
    if len(norms) != 1 or names[norms[0]] != "MinPLogitsWarper":
        return "not min-p alone"
    i = norms[0]
    mp = processors[i]
    if int(getattr(mp, "min_tokens_to_keep", 1)) != 1 or getattr(mp, "filter_value", float("-inf")) != float("-inf"):
        return "min_tokens_to_keep or filter_value differ from generate's"
    min_p = float(mp.min_p)
    if not (min_p > 0 and math.log(min_p) >= _MIN_LOG_MIN_P):
        return "min_p too small to certify"
    if {classify_processor(p) for p in processors[:i]} - {"order", "lower"}:
        return "processors before min-p that are not order-preserving or lowering"
    if any(classify_processor(p) not in ("order", "lower") for p in processors[i + 1:]):
        return "processors after min-p"
    temp = 1.0
    for p in processors[:i]:
        if type(p).__name__ == "TemperatureLogitsWarper":
            temp *= float(p.temperature)
    # delta: raw-logit width of the kept band (S's size only; the check decides correctness), plus slack.
    # delta_rel: a lowering processor (repetition penalty, ...) may lower the top token itself, and with it the
    # threshold: widen the band by 10 % of the top logit (a 1.1 penalty's effect) so the check rarely fails
    session.plan = Threshold(min_p=min_p, delta=-math.log(min_p) * temp * 1.001 + 1e-3,
                             delta_rel=0.1 if any(classify_processor(p) == "lower" for p in processors[:i]) else 0.0,
                             min_p_proc=mp)
    return None


def _top_p_plan(session: CSVSession, processors: list, topks: list, temperature: float) -> bool:
    """Nucleus mode for top-p sampling without a top-k (docs/certificates.md §3.5): the head returns exact logits
    on S and an upper bound on every other token; the CSVLogitsProcessor takes the top-p warper's place and
    computes stock's nucleus from them where the bounds decide it (else the row gets the full head and stock's
    warper). Returns whether it was set."""
    if topks or _own_draw(session) or not session.post.identity:
        return False
    norms = [i for i, p in enumerate(processors) if classify_processor(p) == "norm"]
    if len(norms) != 1 or type(processors[norms[0]]).__name__ != "TopPLogitsWarper" or norms[0] != len(processors) - 1:
        return False
    tp = processors[norms[0]]
    if int(getattr(tp, "min_tokens_to_keep", 1)) != 1 or getattr(tp, "filter_value", float("-inf")) != float("-inf"):
        return False
    if {classify_processor(p) for p in processors[:-1]} - {"order", "lower"}:
        return False
    top_p = float(tp.top_p)
    if not 0.0 < top_p < 1.0:
        return False
    # the head's S leaves at most about a tenth of the removed mass (1 − top_p) outside: the decisions then
    # rarely need the full row (speed only; the check decides correctness)
    session.plan = Nucleus(top_p_proc=tp, eps=min(5e-2, max(1e-3, 0.2 * (1.0 - top_p))), temperature=temperature)
    return True


def _assisted_sampling_plan(session: CSVSession, processors: list, kinds: dict, num_beams: int,
                            temperature: float) -> CSVSession:
    """The target's head in assisted sampling (speculative sampling; docs/speculative.md).

    * One top-k warper with only order-preserving or lowering processors before it: certified top-K,
      checked right after the warper at each verified position, so every later warper and the verify
      see exactly stock's processed vector (the default and chat-model sampling paths).
    * Temperature only, hf_csv's exact verify, an assistant model: mode ``"spec"``; the head returns exact
      logits on S and bounds for the rest, and the verify decides from the bounds where they decide and
      completes rows with the full head where they do not.
    * Anything else: the full head, with the reason.
    """
    post = session.post
    if num_beams > 1:
        session.set_full("assisted beam sampling is not certified")
        return session
    topks = [i for i, p in enumerate(processors) if classify_processor(p) == "topk"]
    if _top_k_plan(session, processors, topks):
        return session
    names = {type(p).__name__ for p in processors}
    if not session.spec_ok:
        session.set_full("assisted sampling without a top-k warper needs the full target distribution unless "
                         "hf_csv's exact verify checks an assistant model's drafts (CSVConfig(speculative='exact'))")
    elif not names <= {"TemperatureLogitsWarper"}:
        session.set_full(f"assisted sampling with processors {sorted(names - {'TemperatureLogitsWarper'})} and no "
                         "single top-k warper before them: the certified verify handles temperature only")
    elif not post.identity:
        session.set_full(f"assisted sampling after {post.describe()}")
    else:
        session.plan = Bounded(temperature=temperature)
    return session


def _decide_draft(session: CSVSession, gc: Any, kinds: dict, do_sample: bool, top_k: Optional[int],
                  processors: list = ()) -> CSVSession:
    """The assistant's head inside assisted generation (hf_csv.transformers.drafts).

    Greedy drafts: certified top-1, so the drafted tokens are the stock draft's, and the confidence stop's
    decisions proved on each row or made on stock's row (docs/certificates.md §3.11), so each round drafts as many
    tokens as stock's. Sampled drafts with one top-k warper of at most ``draft_top_k``: the
    target's checked top-K plan (:func:`_top_k_plan`), so the draft's processed scores are stock's draft's and,
    with the target on the same plan and stock's verify, assisted sampling returns stock's tokens for the same
    seed. Other sampled drafts: exact logits on a certified top-k set, and elsewhere
    -inf (with a top-k warper) or the screen's estimate (without one); the draft samples from exactly the
    logits it returns as candidate logits, which is all speculative sampling needs to stay lossless (the
    target's verification is exact). Those drafts are not stock's draws, so where the target's call is declined
    (``session.assist.stock_drafts``: it must return stock's tokens) the draft takes the full head instead. Where
    stock reads the draft's rows whole (``session.assist.stock_rows``: the confidence threshold's ROC adaptation with
    scikit-learn installed), only the checked top-k plan, whose processed rows are stock's bits, stays certified.
    """
    cfg = session.config
    lower = "lower" in kinds
    post = session.post
    if not do_sample:
        if session.assist.stock_rows is not None:
            # greedy drafts return rows finite on S only: stock's softmax over them is not stock's probability
            session.set_full(f"greedy draft: {session.assist.stock_rows}")
            return session
        if "norm" in kinds:
            session.set_full(f"greedy draft with normalizing processors {kinds['norm']}")
            return session
        # the confidence stop decides how many tokens a round drafts, hence the shapes of the target's verify
        # forwards, whose results (float16, bfloat16, float32 scores) depend on them: its decisions must be stock's
        thr = float(getattr(gc, "assistant_confidence_threshold", None) or 0.0)
        if thr and not post.identity:
            session.set_full(f"greedy draft with a confidence stop after {post.describe()}: its decisions are proved "
                             "on the head's own logits only")
            return session
        # (a confidence stop reads the row's normalizer: a wider set leaves less mass bounded from the screen, so
        # fewer rows for stock's head; the draft's token is still the certified top-1)
        session.plan = TopK(k=1, verify=lower or not post.identity or thr > 0,
                            k_head=lowered_k(1, session.head.vocab_size) if lower or thr else 0, confidence=thr)
        return session
    if not post.keeps_neg_inf:
        session.set_full(f"sampled draft after {post.describe()}")
        return session
    # token-specific processors (min-length, bad words, ...) may lower tokens of S: the draft then
    # samples from what they leave, which is still what it returns; CSVLogitsProcessor only
    # re-runs a row with the full head if they leave nothing finite in it.
    topks = [i for i, p in enumerate(processors) if classify_processor(p) == "topk"]
    if top_k and top_k <= cfg.draft_top_k and _top_k_plan(session, list(processors), topks):
        return session
    if session.assist.stock_drafts is not None:
        # the target's call is declined, so it returns stock's tokens: the drafts below have the exact law but not
        # stock's draws, and stock's verify would then accept other tokens
        session.set_full(f"sampled draft of a declined target call ({session.assist.stock_drafts}): only the checked "
                         "top-k plan keeps stock's drafts")
        return session
    if session.assist.stock_rows is not None:
        session.set_full(f"sampled draft: {session.assist.stock_rows}; only the checked top-k plan returns stock's "
                         "processed rows")
        return session
    k = min(cfg.draft_top_k, session.head.vocab_size, top_k or cfg.draft_top_k)
    # no top-k warper on the draft: its law is the whole softmax, whose tail outside the certified top-k the screen
    # estimates (with a top-k warper the tail is cut anyway: the estimates lie below the k-th exact logit)
    session.plan = TopK(k=k, verify=lower, fill_est=not top_k or top_k >= session.head.vocab_size)
    return session


# lowering processors a compiled step can take without the per-step check: a fixed set to -inf at every step
# (folded into the static head's certificate), and one that fires only at the first generated step (the eager
# prefill; CSVLogitsProcessor checks that it never fires on a compiled step)
_STATIC_LOWER = {"SuppressTokensLogitsProcessor", "SuppressTokensAtBeginLogitsProcessor"}
# a compiled sampled call with top_k = K gets a candidate capacity of at least this many times K
_SAMPLED_CAPACITY = 40


def decide_compiled(session: CSVSession, batch: Optional[int] = None, gemm_reason: Optional[str] = None) -> Any:
    """The plan of a call whose decode steps transformers runs through a compiled forward (static cache).

    Inside a compiled graph no per-step Python runs: no stash for :class:`CSVLogitsProcessor`'s check, no
    re-run. So only calls whose check is not needed there get a static certified head
    (:class:`hf_csv.core.static.StaticTopK`, docs/certificates.md §3.9): greedy calls, and sampled calls whose single
    top-k warper has at most a temperature warper before it (the cut is made strict after the temperature, so every
    later warper and the sampler see stock's vector); no lowering processor other than Whisper's suppress lists
    before the top-k, an identity post-head map, a screen head without a bias. Every other call uses the full head
    (in the graph and out of it), with the reason logged. Returns the plan, or ``None`` after ``set_full``.

    ``gemm_reason``: why the graph's GEMM may round otherwise than eager BLAS (``hf_csv.transformers.scope._graph_gemm_reason``:
    max-autotune, a backend other than inductor or eager); a sampled call hands the graph's values to stock's
    sampler, so it then takes the full head (greedy calls are decided within the values' slack and keep the head).

    Speed: a compiled step cannot be timed, so where the head's speed guard has measured the full head faster on
    this call's eager steps (the prefill, same mode and ``batch`` rows), the graph gets stock's head while the
    session stays certified for its eager steps, which keep feeding (and probing) the guard; ``None`` is returned
    and ``session.compiled.stock`` is set.
    """
    plan = session.plan
    if isinstance(plan, Full):
        return None
    why = None
    ch = session.head
    rows = getattr(getattr(ch, "provider", None), "rows", None)
    procs = [p for p in session.processors or () if getattr(p, "csv_kind", None) != "csv"]
    topk_proc = plan.check_after if isinstance(plan, TopK) else None
    sampled = topk_proc is not None and classify_processor(topk_proc) == "topk" and any(p is topk_proc for p in procs)
    # sampled: what runs before the top-k warper is what the certificate must survive; after it, stock's vector
    before = procs[:next(i for i, p in enumerate(procs) if p is topk_proc)] if sampled else procs
    lowering = sorted({type(p).__name__ for p in before if classify_processor(p) == "lower"} - _STATIC_LOWER)
    temps = [p for p in before if classify_processor(p) == "order"]
    k = max(int(plan.k), int(getattr(topk_proc, "top_k", 0))) if sampled else 1
    if not isinstance(plan, TopK) or (plan.k != 1 and not sampled) or plan.always or session.whisper.record or (
            plan.ts_proc is not None):
        why = f"mode {plan.name!r} (k={getattr(plan, 'k', 1)}) with its per-step check"
    elif sampled and (len(temps) > 1 or any(type(p).__name__ != "TemperatureLogitsWarper" for p in temps)):
        why = f"the order processors {[type(p).__name__ for p in temps]} before the top-k warper"
    elif lowering:
        why = f"the lowering processors {lowering} with their per-step check"
    elif not session.post.identity:
        why = f"the post-head transform {session.post.describe()} with its per-step check"
    elif session.assisted or session.draft:
        why = "assisted generation"
    elif rows is None or getattr(rows, "q", None) is None or rows.q.dtype != torch.int8:
        why = "the compiled head needs the int8 screen (provider='screen', screen_quant='int8')"
    elif getattr(ch, "bias", None) is not None:
        why = "a head with a bias"
    elif sampled and gemm_reason is not None:
        why = f"top-k sampling under {gemm_reason}, whose GEMM on the gathered candidate rows is not the one probed"
    elif sampled and getattr(ch, "subset_kernel", lambda probe=False: None)(probe=True) != "gathered":
        # the graph computes S's values on gathered rows: they are stock's only where the probe, run now under this
        # call's setting, found the gathered kernel matching the full call (docs/certificates.md §2.0); elsewhere
        # only the eager head's blocked kernel, or none, gives stock's values
        why = "top-k sampling on a CPU whose BLAS rounds gathered rows differently from the full call"
    if why is not None:
        session.set_full(f"torch.compile (static cache): {why} is certified only in eager decoding")
        return None
    sup = sorted({int(t) for p in procs if type(p).__name__ == "SuppressTokensLogitsProcessor"
                  for t in p.suppress_tokens.reshape(-1).tolist() if 0 <= int(t) < ch.vocab_size})
    # a top-K set is wider than a top-1 set (about 10·K tokens on real heads, docs/benchmarks.md §9.8)
    C = min(max(session.config.compile_capacity, _SAMPLED_CAPACITY * k if sampled else 0), ch.vocab_size - 1 - len(sup))
    if C < k:
        session.set_full("torch.compile (static cache): the suppressed tokens leave no room for a candidate set")
        return None
    if sampled and not ch.graph_gather_exact(C, batch or 1):
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
    temperature = float(temps[0].temperature) if sampled and temps else None
    plans = session.entry.static_plans if session.entry is not None else {}
    key = (C, tuple(sup), k, temperature)
    plan = plans.get(key)
    if plan is None:  # one per head, capacity, suppressed set, k and temperature: a reused plan keeps dynamo's guards
        screen = ch.provider if getattr(ch.provider, "name", None) == "screen" else None
        plan = plans[key] = StaticTopK(ch.weight, rows, k=k, capacity=C,
                                       suppress=torch.tensor(sup, dtype=torch.long) if sup else None, screen=screen,
                                       temperature=temperature)
    return plan
