"""The plan of each decoding method, from the call's facts (:class:`hf_csv.transformers.call_facts.CallFacts`): step 2
of :func:`hf_csv.transformers.decision.choose_plan`, after the call-wide declines.

Each rule takes the facts and the decision so far and returns the decision with its plan, or with the full head and
the reason (docs/processors.md has the table). Every rule is pure: it reads the facts and the processors' settings
only. What can be proven exact gets its certificate; approximation only under ``CSVConfig(mode="epsilon")``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from hf_csv.core.config import lowered_k
from hf_csv.transformers.call_facts import CallFacts, Decision
from hf_csv.transformers.plans import Bounded, Epsilon, ExactBeam, Nucleus, Sample, Threshold, TopK
from hf_csv.transformers.processor_kinds import BEAM_PROCESSORS, LAW_ORDERS, classify_processor

__all__ = ["method_plan", "warps_of"]

# min-p's kept set is {p_i >= min_p · p_max} = {x_i − max >= ln(min_p)}; below this, min_p would keep
# tokens whose probability underflows (docs/certificates.md §3.3)
_MIN_LOG_MIN_P = -60.0


def method_plan(facts: CallFacts, d: Decision) -> Decision:
    """The decoding method's plan, in this order: Whisper timestamps; a declined assistant ensemble; an assistant's
    draft head (not Gumbel-coupled); assisted sampling (not coupled); greedy; beam search; beam sampling (declined);
    multinomial sampling (coupled sampling included: its plans are plain sampling's)."""
    if "timestamps" in facts.kinds:
        return _timestamp_plan(facts, d)
    temperature, top_k, warps = warps_of(facts.processors)
    if (facts.assisted or facts.draft) and facts.ensemble:
        return d.full("assistant_ensemble_weight mixes the target's and the draft's softmax over the full vocabulary")
    # Gumbel-coupled assisted sampling (CSVConfig(speculative="gumbel")): the target and its drafts each draw
    # argmax(stock's processed row + the token index's noise); the plans of plain sampling give exactly that (their
    # rows are stock's processed rows, or the certified draw itself with the keyed noise), and the verify compares
    # (docs/speculative.md)
    if facts.draft and not facts.coupled:
        return _draft_plan(facts, d, top_k)
    if facts.assisted and facts.do_sample and not facts.coupled:
        return _assisted_sampling_plan(facts, d, temperature)
    if not facts.do_sample and facts.num_beams == 1:
        return _greedy_plan(facts, d)
    if not facts.do_sample:
        return _beam_plan(facts, d, temperature)
    if facts.num_beams > 1:
        return d.full("beam sampling is not certified")
    return _sampling_plan(facts, d, temperature, warps)


def warps_of(processors: tuple) -> tuple[float, Optional[int], list]:
    """(the product of the temperatures, the smallest top-k or None, the warps (("temperature", T) / ("top_k", k)) in
    list order) of the processors: what the head's own draw models."""
    temperature, top_k, warps = 1.0, None, []
    for p in processors:
        if type(p).__name__ == "TemperatureLogitsWarper":
            temperature *= float(p.temperature)
            warps.append(("temperature", float(p.temperature)))
        elif classify_processor(p) == "topk":
            k = int(p.top_k)
            top_k = k if top_k is None else min(top_k, k)
            warps.append(("top_k", k))
    return temperature, top_k, warps


def _own_draw(facts: CallFacts, d: Decision) -> bool:
    """Sampling through the head's own exact draw (``CSVConfig(mode="sample")``, or Gumbel-coupled sampling where
    stock's values on S cannot be had bit for bit)."""
    return facts.config.mode == "sample" or d.own_draw


def _topks(processors: tuple) -> list:
    """The positions of the top-k warpers in the list."""
    return [i for i, p in enumerate(processors) if classify_processor(p) == "topk"]


def _greedy_plan(facts: CallFacts, d: Decision) -> Decision:
    """Greedy: argmax of the processed scores. The post map and lowering processors need the per-row check (rounding
    in the post map can tie an uncomputed token with the winner)."""
    if "norm" in facts.kinds:
        # log-softmax renormalization shifts every score by a normalizer only the full head knows
        return d.full(f"greedy with normalizing processors {facts.kinds['norm']}")
    lower = "lower" in facts.kinds
    return d.to(TopK(k=1, check_processed=lower or not facts.post.identity,
                     k_head=lowered_k(1, facts.vocab_size) if lower else 0))


def _beam_plan(facts: CallFacts, d: Decision, temperature: float) -> Decision:
    """Beam search: token-identical (:class:`ExactBeam`, docs/certificates.md §3.10) where asked for and admitted,
    else the full head by default, or the approximate ε-certificate under ``CSVConfig(mode="epsilon")``."""
    cfg, kinds, num_beams = facts.config, facts.kinds, facts.num_beams
    if facts.output_scores:
        # (CSVConfig(scores='subvocab') too, exact or ε: a beam row's scores and sequences_scores are log-softmax
        # values, which need each row's normalizer over all of V)
        return d.full("beam search with output_scores: its scores and sequences_scores need each row's full "
                      "normalizer").warn_beams(num_beams)
    # the exact certificate wins when asked for, also under mode='epsilon' (which then covers only what it cannot)
    if cfg.mode != "epsilon" or cfg.beam_search == "exact":
        why = _beam_exact_reason(facts) if cfg.beam_search == "exact" else (
            "beam search runs the full head by default (its log_softmax needs each row's normalizer); "
            "CSVConfig(beam_search='exact') runs the token-identical certificate, measured slower on real heads "
            "(docs/benchmarks.md §9.9), and CSVConfig(mode='epsilon') the approximate beam_epsilon one")
        if why is None:
            # token-identical beam search (docs/certificates.md §3.10): S holds every row's top beams_to_keep
            eos = facts.eos_token_id
            n_eos = 0 if eos is None else (1 if isinstance(eos, int) else len(torch.as_tensor(eos).reshape(-1)))
            return d.to(ExactBeam(k=max(2, 1 + n_eos) * num_beams))
        if cfg.mode != "epsilon":
            return d.full(why).warn_beams(num_beams)
        d = d.note(f"token-identical beam search declined ({why}): CSVConfig(mode='epsilon') runs the "
                   "approximate beam_epsilon certificate instead")
    if "norm" in kinds and kinds["norm"] != ["LogitNormalization"]:
        return d.full(f"beam search with normalizing processors {kinds['norm']}")
    if not facts.post.identity:
        return d.full(f"beam search after a post-head transform ({facts.post.describe()})")
    # ε-certificate (approximate); the top-2·num_beams of every row is then checked
    return d.to(Epsilon(check_processed=True, eps=cfg.beam_epsilon, temperature=temperature, beams=num_beams))


def _beam_exact_reason(facts: CallFacts) -> Optional[str]:
    """Why this beam search cannot run the token-identical certificate (None: it can)."""
    if facts.assisted or facts.draft:
        return "assisted beam search is not certified"
    mode = facts.generation_mode()
    if str(getattr(mode, "value", mode)) != "beam_search":
        return f"{getattr(mode, 'value', mode)} is not certified (plain beam search is)"
    if not facts.post.identity:
        return f"beam search after a post-head transform ({facts.post.describe()})"
    if facts.caller_cache:
        return ("beam search with a cache passed by the caller: a call hf_csv cannot certify is re-run on the full "
                "head, which needs a fresh cache")
    if facts.beam_restart:
        return facts.beam_restart
    # (an admitted name can still classify "full": a repetition penalty < 1 or a positive sequence bias raises scores)
    other = sorted({type(p).__name__ for p in facts.processors if classify_processor(p) != "csv"
                    and (type(p).__name__ not in BEAM_PROCESSORS or classify_processor(p) == "full")})
    if other:
        return f"beam search with processors {other} (token-identical beam search takes per-token lowering ones)"
    return None


def _sampling_plan(facts: CallFacts, d: Decision, temperature: float, warps: list) -> Decision:
    """Multinomial sampling, in this order: the checked top-K after the first top-k warper, min-p's threshold, top-p's
    nucleus, the head's own draw after lowering processors, the ε-certificate for other normalizing warpers
    (``mode="epsilon"``), the head's own draw under temperature and one top-k; else the full head."""
    processors, kinds, post = facts.processors, facts.kinds, facts.post
    topks = _topks(processors)
    got = _top_k_plan(facts, d, topks) or _min_p_plan(facts, d, topks) or _top_p_plan(facts, d, topks, temperature)
    if got is not None:
        return got
    if not post.keeps_neg_inf:
        return d.full(f"sampling after {post.describe()}: the map turns uncomputed -inf logits into finite "
                      "scores that keep probability")
    lower, norm = "lower" in kinds, "norm" in kinds
    orders = {type(p).__name__ for p in processors if classify_processor(p) == "order"}
    if lower and not norm and len(topks) == 0 and orders <= LAW_ORDERS:
        # lazy Gumbel with the draw after the lowering processors (docs/certificates.md §2.3): they only lower
        # scores, so the head's upper bounds stay upper bounds; the CSVLogitsProcessor (last) draws and checks
        return d.to(Sample(check_processed=True, warps=tuple(warps), draw_after=True))
    if lower:
        return d.full(f"sampling with token-specific processors {kinds['lower']} and a normalizing warper "
                      "or several top-k warpers")
    if norm:
        if facts.config.mode == "epsilon" and post.identity:
            return d.to(Epsilon(eps=facts.config.epsilon, temperature=temperature))
        return d.full(f"normalizing warpers {kinds['norm']} without a top-k before them need the whole "
                      "distribution (CSVConfig(mode='epsilon') allows TV <= epsilon)")
    if len(topks) > 1:
        return d.full("several top-k warpers")
    if orders - LAW_ORDERS:
        # "order" means argmax-invariant, not law-invariant: x -> 3x keeps every argmax and changes the law, and the
        # head's own draw models temperature and the top-k filter only (docs/certificates.md §2.3)
        return d.full(f"sampling with order-preserving processors {sorted(orders - LAW_ORDERS)} whose effect on "
                      "the law the certified draw does not model")
    return d.to(Sample(warps=tuple(warps)))


def _timestamp_plan(facts: CallFacts, d: Decision) -> Decision:
    """Greedy Whisper decoding with timestamps (docs/certificates.md §3.4): certified top-1 of the text
    tokens plus the exact logits of every token from the first special token (eos) on, timestamps
    included, on every row; the check right before the WhisperTimeStampLogitsProcessor proves that the
    processor takes stock's decision (timestamp or text) and that the argmax after it is stock's."""
    processors = facts.processors
    if facts.assisted or facts.draft:
        return d.full("Whisper timestamps in assisted generation: not certified (full head)")
    if facts.do_sample or facts.num_beams > 1:
        return d.full("Whisper timestamps with sampling (temperature fallback) or beam search: the timestamp "
                      "rule's logsumexp is certified for greedy decoding only").warn_beams(facts.num_beams)
    names = [type(p).__name__ for p in processors]
    ts = [i for i, n in enumerate(names) if classify_processor(processors[i]) == "timestamps"]
    if len(ts) != 1 or ts[0] != len(processors) - 1:
        return d.full(f"Whisper's timestamp processor not last, or more than one: {names}")
    if {classify_processor(p) for p in processors[:-1]} - {"order", "lower"}:
        return d.full(f"Whisper timestamps with normalizing processors {facts.kinds.get('norm')}")
    if facts.vocab_parallel:
        return d.full("the vocabulary-parallel head does not compute Whisper's timestamp block")
    proc = processors[-1]
    V = facts.vocab_size
    eos = getattr(proc, "eos_token_id", None)
    eos = min(eos) if isinstance(eos, (list, tuple)) and eos else eos
    tb = int(proc.timestamp_begin)
    start = min(tb, int(eos)) if isinstance(eos, int) and eos >= 0 else tb
    if not (0 < start <= tb < V):
        return d.full(f"Whisper timestamps with an unexpected vocabulary layout (timestamp_begin {tb}, V {V})")
    return d.to(TopK(k=1, check_processed=True, ts_proc=proc, always=V - start))


def _top_k_plan(facts: CallFacts, d: Decision, topks: list) -> Optional[Decision]:
    """Certified top-K checked right after the first top-k warper (docs/certificates.md §3.2), when only
    order-preserving or lowering processors come before it: from there on every processor (top-p, min-p, a second
    top-k, ...), stock's sampler and the speculative verify see exactly stock's vector. (An assistant's list holds
    the target's warpers and its own again: transformers 5.x passes the target's processors to the assistant's
    generate.) K is the first warper's k. None where it does not apply."""
    processors = facts.processors
    if not topks or _own_draw(facts, d):
        return None
    i = topks[0]
    top_k = int(processors[i].top_k)
    if top_k >= facts.vocab_size:
        return None
    if not {classify_processor(p) for p in processors[:i]} <= {"order", "lower"}:
        return None
    lowered = any(classify_processor(p) == "lower" for p in processors[:i])
    return d.to(TopK(k=top_k, check_processed=True, check_after=processors[i],
                     k_head=lowered_k(top_k, facts.vocab_size) if lowered else 0))


def _min_p_plan(facts: CallFacts, d: Decision, topks: list) -> Optional[Decision]:
    """Threshold mode for min-p sampling without a top-k (docs/certificates.md §3.3): the head computes
    every token within ``delta`` of the max, and the check right before the min-p warper proves that
    the warper keeps exactly stock's tokens. None where it does not apply: a top-k, the own draw, a min-p warper that
    is not alone, not generate's (min_tokens_to_keep, filter_value), too small to certify, or with processors other
    than order-preserving or lowering ones before or after it."""
    processors = facts.processors
    if topks or _own_draw(facts, d):
        return None
    names = [type(p).__name__ for p in processors]
    norms = [i for i, p in enumerate(processors) if classify_processor(p) == "norm"]
    if len(norms) != 1 or names[norms[0]] != "MinPLogitsWarper":
        return None
    i = norms[0]
    mp = processors[i]
    if int(getattr(mp, "min_tokens_to_keep", 1)) != 1 or getattr(mp, "filter_value", float("-inf")) != float("-inf"):
        return None
    min_p = float(mp.min_p)
    if not (min_p > 0 and math.log(min_p) >= _MIN_LOG_MIN_P):
        return None
    if {classify_processor(p) for p in processors[:i]} - {"order", "lower"}:
        return None
    if any(classify_processor(p) not in ("order", "lower") for p in processors[i + 1:]):
        return None
    temp = 1.0
    for p in processors[:i]:
        if type(p).__name__ == "TemperatureLogitsWarper":
            temp *= float(p.temperature)
    # delta: raw-logit width of the kept band (S's size only; the check decides correctness), plus slack.
    # delta_rel: a lowering processor (repetition penalty, ...) may lower the top token itself, and with it the
    # threshold: widen the band by 10 % of the top logit (a 1.1 penalty's effect) so the check rarely fails
    return d.to(Threshold(min_p=min_p, delta=-math.log(min_p) * temp * 1.001 + 1e-3,
                          delta_rel=0.1 if any(classify_processor(p) == "lower" for p in processors[:i]) else 0.0,
                          min_p_proc=mp))


def _top_p_plan(facts: CallFacts, d: Decision, topks: list, temperature: float) -> Optional[Decision]:
    """Nucleus mode for top-p sampling without a top-k (docs/certificates.md §3.5): the head returns exact logits
    on S and an upper bound on every other token; the CSVLogitsProcessor takes the top-p warper's place and
    computes stock's nucleus from them where the bounds decide it (else the row gets the full head and stock's
    warper). None where it does not apply."""
    processors = facts.processors
    if topks or _own_draw(facts, d) or not facts.post.identity:
        return None
    norms = [i for i, p in enumerate(processors) if classify_processor(p) == "norm"]
    if len(norms) != 1 or type(processors[norms[0]]).__name__ != "TopPLogitsWarper" or norms[0] != len(processors) - 1:
        return None
    tp = processors[norms[0]]
    if int(getattr(tp, "min_tokens_to_keep", 1)) != 1 or getattr(tp, "filter_value", float("-inf")) != float("-inf"):
        return None
    if {classify_processor(p) for p in processors[:-1]} - {"order", "lower"}:
        return None
    top_p = float(tp.top_p)
    if not 0.0 < top_p < 1.0:
        return None
    # the head's S leaves at most about a tenth of the removed mass (1 − top_p) outside: the decisions then
    # rarely need the full row (speed only; the check decides correctness)
    return d.to(Nucleus(top_p_proc=tp, eps=min(5e-2, max(1e-3, 0.2 * (1.0 - top_p))), temperature=temperature))


def _assisted_sampling_plan(facts: CallFacts, d: Decision, temperature: float) -> Decision:
    """The target's head in assisted sampling (speculative sampling; docs/speculative.md).

    * One top-k warper with only order-preserving or lowering processors before it: certified top-K,
      checked right after the warper at each verified position, so every later warper and the verify
      see exactly stock's processed vector (the default and chat-model sampling paths).
    * Temperature only, hf_csv's exact verify, an assistant model: mode ``"spec"``; the head returns exact
      logits on S and bounds for the rest, and the verify decides from the bounds where they decide and
      completes rows with the full head where they do not.
    * Anything else: the full head, with the reason.
    """
    post = facts.post
    if facts.num_beams > 1:
        return d.full("assisted beam sampling is not certified")
    got = _top_k_plan(facts, d, _topks(facts.processors))
    if got is not None:
        return got
    names = {type(p).__name__ for p in facts.processors}
    if not facts.spec_ok:
        return d.full("assisted sampling without a top-k warper needs the full target distribution unless "
                      "hf_csv's exact verify checks an assistant model's drafts (CSVConfig(speculative='exact'))")
    if not names <= {"TemperatureLogitsWarper"}:
        return d.full(f"assisted sampling with processors {sorted(names - {'TemperatureLogitsWarper'})} and no "
                      "single top-k warper before them: the certified verify handles temperature only")
    if not post.identity:
        return d.full(f"assisted sampling after {post.describe()}")
    return d.to(Bounded(temperature=temperature))


def _draft_plan(facts: CallFacts, d: Decision, top_k: Optional[int]) -> Decision:
    """The assistant's head inside assisted generation (hf_csv.transformers.drafts): greedy drafts
    (:func:`_greedy_draft_plan`) or sampled ones (:func:`_sampled_draft_plan`)."""
    return _sampled_draft_plan(facts, d, top_k) if facts.do_sample else _greedy_draft_plan(facts, d)


def _greedy_draft_plan(facts: CallFacts, d: Decision) -> Decision:
    """Greedy drafts: certified top-1, so the drafted tokens are the stock draft's, and the confidence stop's
    decisions proved on each row or made on stock's row (docs/certificates.md §3.11), so each round drafts as many
    tokens as stock's."""
    post = facts.post
    if facts.stock_rows is not None:
        # greedy drafts return rows finite on S only: stock's softmax over them is not stock's probability
        return d.full(f"greedy draft: {facts.stock_rows}")
    if "norm" in facts.kinds:
        return d.full(f"greedy draft with normalizing processors {facts.kinds['norm']}")
    # the confidence stop decides how many tokens a round drafts, hence the shapes of the target's verify
    # forwards, whose results (float16, bfloat16, float32 scores) depend on them: its decisions must be stock's
    thr = facts.confidence_threshold
    if thr and not post.identity:
        return d.full(f"greedy draft with a confidence stop after {post.describe()}: its decisions are proved "
                      "on the head's own logits only")
    # (a confidence stop reads the row's normalizer: a wider set leaves less mass bounded from the screen, so
    # fewer rows for stock's head; the draft's token is still the certified top-1)
    lower = "lower" in facts.kinds
    return d.to(TopK(k=1, check_processed=lower or not post.identity or thr > 0,
                     k_head=lowered_k(1, facts.vocab_size) if lower or thr else 0, confidence=thr))


def _sampled_draft_plan(facts: CallFacts, d: Decision, top_k: Optional[int]) -> Decision:
    """Sampled drafts with one top-k warper of at most ``draft_top_k``: the target's checked top-K plan
    (:func:`_top_k_plan`), so the draft's processed scores are stock's draft's and, with the target on the same plan
    and stock's verify, assisted sampling returns stock's tokens for the same seed. Other sampled drafts: exact
    logits on a certified top-k set, and elsewhere -inf (with a top-k warper) or the screen's estimate (without
    one); the draft samples from exactly the logits it returns as candidate logits, which is all speculative
    sampling needs to stay lossless (the target's verification is exact). Those drafts are not stock's draws, so
    where the target's call is declined (``stock_drafts``: it must return stock's tokens) the draft takes the full
    head instead. Where stock reads the draft's rows whole (``stock_rows``: the confidence threshold's ROC
    adaptation with scikit-learn installed), only the checked top-k plan, whose processed rows are stock's bits,
    stays certified."""
    cfg, post, V = facts.config, facts.post, facts.vocab_size
    if not post.keeps_neg_inf:
        return d.full(f"sampled draft after {post.describe()}")
    # token-specific processors (min-length, bad words, ...) may lower tokens of S: the draft then
    # samples from what they leave, which is still what it returns; CSVLogitsProcessor only
    # re-runs a row with the full head if they leave nothing finite in it.
    got = _top_k_plan(facts, d, _topks(facts.processors)) if top_k and top_k <= cfg.draft_top_k else None
    if got is not None:
        return got
    if facts.stock_drafts is not None:
        # the target's call is declined, so it returns stock's tokens: the drafts below have the exact law but not
        # stock's draws, and stock's verify would then accept other tokens
        return d.full(f"sampled draft of a declined target call ({facts.stock_drafts}): only the checked "
                      "top-k plan keeps stock's drafts")
    if facts.stock_rows is not None:
        return d.full(f"sampled draft: {facts.stock_rows}; only the checked top-k plan returns stock's "
                      "processed rows")
    k = min(cfg.draft_top_k, V, top_k or cfg.draft_top_k)
    # no top-k warper on the draft: its law is the whole softmax, whose tail outside the certified top-k the screen
    # estimates (with a top-k warper the tail is cut anyway: the estimates lie below the k-th exact logit)
    return d.to(TopK(k=k, check_processed="lower" in facts.kinds, fill_est=not top_k or top_k >= V))
