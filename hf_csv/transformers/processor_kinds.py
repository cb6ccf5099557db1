"""How each transformers logits processor and stopping criterion relates to a certificate: the name tables and the
classifiers that :mod:`hf_csv.transformers.method_plans` reads (docs/processors.md has the table), and the processors
before a check sorted by kind once per call (:func:`prefix`), which the plans' checks run through.

Processors are read by class name and settings, never imported: a class these tables do not name classifies
``full`` (the full head) unless it declares ``csv_kind`` itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["KIND", "LAW_ORDERS", "MASKS_ONLY", "SAFE_CRITERIA", "BEAM_PROCESSORS", "classify_processor", "inert",
           "masks_only", "classify_stopping_criterion", "prefix", "orders"]

# the kinds (docs/processors.md):
#   order: the same increasing map on every token (commutes with any certificate)
#   topk:  keeps the K largest (exact with a top-K certificate, K known)
#   lower: lowers (or sets to constants) particular tokens; commutes with top-k after a check
#   norm:  depends on the whole distribution (top-p, min-p, typical, ...): ε-certificate or full
#   timestamps: Whisper's timestamp rules and its logsumexp decision (greedy: checked right before it)
#   full:  may raise uncomputed tokens or reads all logits: full head
# the order-preserving processors whose effect on the sampling law the head's own draw (Sample) reproduces:
# temperature is one of its warps; InfNanRemove changes no finite score
LAW_ORDERS = frozenset({"TemperatureLogitsWarper", "InfNanRemoveLogitsProcessor"})

KIND = {
    "TemperatureLogitsWarper": "order",
    "InfNanRemoveLogitsProcessor": "order",
    "TopKLogitsWarper": "topk",
    "MinLengthLogitsProcessor": "lower",
    "MinNewTokensLengthLogitsProcessor": "lower",
    "NoRepeatNGramLogitsProcessor": "lower",
    "EncoderNoRepeatNGramLogitsProcessor": "lower",
    "NoBadWordsLogitsProcessor": "lower",
    "PrefixConstrainedLogitsProcessor": "lower",
    "ForcedBOSTokenLogitsProcessor": "lower",
    "ForcedEOSTokenLogitsProcessor": "lower",
    "SuppressTokensLogitsProcessor": "lower",
    "SuppressTokensAtBeginLogitsProcessor": "lower",
    "HammingDiversityLogitsProcessor": "lower",
    "LogitNormalization": "norm",
    "TopPLogitsWarper": "norm",
    "TopHLogitsWarper": "norm",
    "MinPLogitsWarper": "norm",
    "TypicalLogitsWarper": "norm",
    "EpsilonLogitsWarper": "norm",
    "EtaLogitsWarper": "norm",
    "EncoderRepetitionPenaltyLogitsProcessor": "full",
    "ExponentialDecayLengthPenalty": "full",
    "ClassifierFreeGuidanceLogitsProcessor": "full",
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "full",
    "WatermarkLogitsProcessor": "full",
    "SynthIDTextWatermarkLogitsProcessor": "full",
    "WhisperTimeStampLogitsProcessor": "timestamps",
    "WhisperNoSpeechDetection": "full",
    "BarkEosPrioritizerLogitsProcessor": "full",
    "AlternatingCodebooksLogitsProcessor": "full",
}

# "lower" processors that only mask: each token's output is its input unchanged or -inf, the masked set chosen from
# input_ids (and the processor's settings) alone, never from the scores (transformers 4.57 and 5.20-5.24: torch.where /
# masked_fill with -inf). A custom processor may declare ``csv_masks_only = True`` (a promise of exactly that).
MASKS_ONLY = frozenset({"SuppressTokensLogitsProcessor", "SuppressTokensAtBeginLogitsProcessor",
                        "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor",
                        "NoRepeatNGramLogitsProcessor"})

# Stock stopping criteria that never read ``scores`` (transformers 5.23 and 5.24): safe with any certificate.
SAFE_CRITERIA = frozenset({"MaxLengthCriteria", "MaxTimeCriteria", "StopStringCriteria", "EosTokenCriteria"})

# Processors token-identical beam search runs with (docs/certificates.md §3.10): each maps a token's score through a
# non-decreasing function of that score alone (given the input ids) and never raises it, so hf_csv can run them on
# the ends of an interval. Named here, not by kind: a custom "lower" processor promises less than that.
BEAM_PROCESSORS = frozenset({
    "RepetitionPenaltyLogitsProcessor", "SequenceBiasLogitsProcessor", "MinLengthLogitsProcessor",
    "MinNewTokensLengthLogitsProcessor", "NoRepeatNGramLogitsProcessor", "EncoderNoRepeatNGramLogitsProcessor",
    "NoBadWordsLogitsProcessor", "PrefixConstrainedLogitsProcessor", "SuppressTokensLogitsProcessor",
    "SuppressTokensAtBeginLogitsProcessor"})


def classify_processor(p: Any) -> str:
    """``order`` | ``topk`` | ``lower`` | ``norm`` | ``timestamps`` | ``full`` | ``csv`` for one logits processor.

    Custom processors may declare ``csv_kind`` (one of the above) to opt in; unknown ones are
    ``full`` (they might raise an uncomputed token).
    """
    kind = getattr(p, "csv_kind", None)
    if kind in ("order", "topk", "lower", "norm", "full", "csv"):
        return kind
    name = type(p).__name__
    if name == "RepetitionPenaltyLogitsProcessor":
        # penalty >= 1 lowers the scores of seen tokens; < 1 raises them
        return "lower" if float(getattr(p, "penalty", 1.0)) >= 1.0 else "full"
    if name == "SequenceBiasLogitsProcessor":
        bias = getattr(p, "sequence_bias", None) or {}
        vals = bias.values() if isinstance(bias, dict) else [v for _, v in bias]
        return "lower" if all(float(v) <= 0 for v in vals) else "full"
    if name == "WhisperNoSpeechDetection":
        # it returns the scores unchanged; what it reads (its own forward's logits, or the first step's scores) is
        # given to it as stock computes it (hf_csv.transformers.processors.FullHeadDuring)
        return "order" if not getattr(p, "is_scores_logprobs", False) else "full"
    if name == "TopKLogitsWarper" and getattr(p, "filter_value", -math.inf) != -math.inf:
        return "full"  # a finite filter value leaves the filtered tokens some mass
    return KIND.get(name, "full")


def inert(p: Any, input_len: Optional[int]) -> bool:
    """Whether stock's processor ``p`` returns its input unchanged at every step of a call whose sequences start at
    ``input_len`` tokens (they only grow; None: unknown): a minimum length already reached. transformers gives every
    assistant call ``min_new_tokens=0``, which becomes a ``MinLengthLogitsProcessor`` at the input length (it masks
    EOS only while ``input_ids.shape[-1] < min_length``, 4.57 and 5.x). Such a processor lowers nothing in the call."""
    name = type(p).__name__
    if name == "MinLengthLogitsProcessor" and input_len is not None:
        return int(getattr(p, "min_length", 1 << 62)) <= input_len
    if name == "MinNewTokensLengthLogitsProcessor":  # masks while (length − prompt) < min_new_tokens
        return int(getattr(p, "min_new_tokens", 1)) <= 0
    return False


def masks_only(processors: Any) -> bool:
    """Whether the composition of ``processors`` maps each token's score to itself or to −inf, the set fixed by the
    inputs alone (so it is read off any one processed row): every one is a masking processor (``MASKS_ONLY``, or
    declares ``csv_masks_only = True``) or returns its input unchanged (``csv_identity``)."""
    return all(getattr(p, "csv_identity", False) is True or getattr(p, "csv_masks_only", False) is True
               or (type(p).__name__ in MASKS_ONLY and classify_processor(p) == "lower") for p in processors)


def classify_stopping_criterion(c: Any) -> str:
    """``safe`` (never reads ``scores``) or ``full`` (may read them: the call uses the full head).

    A custom criterion can declare ``csv_safe = True`` (a promise that it ignores ``scores``).
    ``ConfidenceCriteria`` (assisted drafting) reads the drafted token's probability; the draft head
    provides it (hf_csv.transformers.drafts), so it is safe only inside a draft session.
    """
    if getattr(c, "csv_safe", False) is True:
        return "safe"
    return "safe" if type(c).__name__ in SAFE_CRITERIA else "full"


# ------------------------------------------------------------------ the processors before the check, by kind
# (``c`` is the call's CSVLogitsProcessor: the processors before it are the ones the check runs through)
@dataclass(frozen=True)
class _Prefix:
    """The processors a CSVLogitsProcessor follows in one call: all of them (``every``), the order-preserving ones
    the bound ``ob`` runs through (``orders``), those a full-head re-run repeats (``runs``: not identity wrappers),
    and whether all of them only mask (:func:`masks_only`)."""

    owner: object
    every: tuple
    orders: tuple
    runs: tuple
    masks_only: bool


def prefix(c: Any, sess: Any) -> _Prefix:
    """The processors before the check ``c`` in the call's list, sorted once per call (the list is fixed per call)."""
    got = sess.check_prefix
    if got is None or got.owner is not c:
        every = []
        for proc in sess.processors or ():
            if proc is c:
                break
            every.append(proc)
        ident = [getattr(proc, "csv_identity", False) or inert(proc, sess.input_len) for proc in every]
        got = sess.check_prefix = _Prefix(
            owner=c, every=tuple(every),
            orders=tuple(p for p, i in zip(every, ident) if not i and classify_processor(p) == "order"),
            runs=tuple(p for p, i in zip(every, ident) if not i), masks_only=masks_only(every))
    return got


def orders(c: Any, sess: Any) -> tuple:
    """The order-preserving processors before the check ``c`` (e.g. temperature), which bounds run through."""
    return prefix(c, sess).orders
