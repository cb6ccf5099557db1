"""Plans: which certificate one decoding call runs, as a frozen value (core: no transformers import).

A plan holds only its own parameters and knows its head call (:meth:`Plan.head`: which method of
:class:`hf_csv.certificate.CertifiedHead` computes a step's rows, and what the returned logits are) and where its
check goes in the logits-processor list (:meth:`Plan.placement`). :func:`hf_csv.policy.decide_mode` picks one per
call; :mod:`hf_csv.step` runs it. The processor-kind tables that the decision reads live here, in one place.

| plan | certificate (docs/certificates.md) | returns | check after the processors |
|---|---|---|---|
| :class:`Full` | none: stock's head | stock's logits | none |
| :class:`TopK` | exact top-K (§2.1), timestamps (§3.4) | exact on S, −inf elsewhere | top-k / timestamp rule (§3.2, §3.4) |
| :class:`Threshold` | every token within δ of the max (§3.3) | exact on S, −inf elsewhere | min-p's kept set (§3.3) |
| :class:`Nucleus` | S leaves ε of the mass (§3.5) | exact on S, −inf elsewhere | stock's nucleus from the bounds (§3.5) |
| :class:`Bounded` | S leaves ε of the mass (§2.4) | exact on S, −inf elsewhere | hf_csv's verify (docs/speculative.md) |
| :class:`Sample` | exact lazy-Gumbel draw (§2.3) | the draw (one-hot), or exact on S | the draw after lowering processors (§2.3) |
| :class:`ExactBeam` | S leaves ε of the mass (§3.10) | exact on S, −inf elsewhere | log-prob intervals for the beam bookkeeping (§3.10) |
| :class:`Epsilon` | ε-softmax, approximate (§2.2) | exact on S, −inf elsewhere | beam search: top-2·beams (§3.2) |
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

__all__ = ["Plan", "Full", "TopK", "Threshold", "Nucleus", "Bounded", "Sample", "ExactBeam", "Epsilon", "FULL",
           "classify_processor", "masks_only", "classify_stopping_criterion", "SPEC_EPS", "BEAM_EPS"]

# Bounded plan (assisted sampling): S holds all but about this fraction of a row's mass (upper bound), so the verify's
# interval for the normalizer is a few % wide and few accept/reject decisions need the full row. Speed only (the
# verify decides correctness; docs/benchmarks.md §3)
SPEC_EPS = 5e-2
# ExactBeam plan: S holds all but about this fraction of a row's mass (upper bounds), so the normalizer's interval is
# ~1e-3 wide. Speed only (docs/benchmarks.md §9.9)
BEAM_EPS = 1e-3


@dataclass(frozen=True)
class Plan:
    """One call's certificate. ``verify``: a :class:`hf_csv.processors.CSVLogitsProcessor` checks each step after
    the processors (and recomputes with stock's head the rows it cannot prove)."""

    name: ClassVar[str] = ""
    verify: bool = False

    def head(self, ch: Any, H: torch.Tensor, sess: Any, keys: Optional[list] = None) -> tuple[Any, torch.Tensor]:
        """(CertResult, dense logits [N, V] in the model dtype) of one head call on rows ``H`` [N, d]."""
        raise NotImplementedError

    def placement(self, procs: list) -> tuple[int, int]:
        """(index, how many processors it replaces) of the check in the call's processor list: last by default."""
        return len(procs), 0

    @property
    def guard_tag(self) -> tuple:
        """What the speed guard keys a head call's timing on, besides its shape (hf_csv.speed)."""
        return (self.name, 0)

    def supported_by(self, head: Any) -> bool:
        """Whether ``head`` offers this plan's head call (the vocabulary-parallel head offers top-k only)."""
        modes = getattr(head, "modes", None)
        return modes is None or self.name in modes


@dataclass(frozen=True)
class Full(Plan):
    """Stock's head for the whole call (the reasons are the call's, not the plan's)."""

    name: ClassVar[str] = "full"


FULL = Full()


def _index(procs: list, proc: Any) -> Optional[int]:
    return next((i for i, p in enumerate(procs) if p is proc), None)


@dataclass(frozen=True)
class TopK(Plan):
    """Exact top-K: the head computes exactly a set S holding the k (``k_head`` when larger: lowering processors
    before the warper) largest logits, and the last ``always`` tokens (Whisper's timestamp block) on every row.

    ``check_after``: the top-k warper the check follows (sampling: every later warper sees stock's vector);
    ``ts_proc``: Whisper's timestamp processor the check runs right before. A draft's tail: ``fill_tail`` (greedy,
    confidence stop) raises the uncomputed tokens to their estimated mass, ``fill_est`` (sampled draft, no top-k)
    gives them the screen's estimates."""

    name: ClassVar[str] = "topk"
    k: int = 1
    k_head: int = 0
    always: int = 0
    check_after: Any = None
    ts_proc: Any = None
    fill_tail: bool = False
    fill_est: bool = False

    def head(self, ch, H, sess, keys=None):
        kw: dict = {"always": self.always} if self.always else {}
        if sess.whisper.record:
            kw["with_upper"] = True
        if self.k_head > self.k:  # a wider set where it fits the budget, else the warper's k (policy._lowered_k)
            kw.update(k_min=self.k)
        res = ch.topk(H, max(self.k, self.k_head), out_dtype=sess.out_dtype, **kw)
        out = res.logits
        if self.fill_tail and res.est is not None:
            out = fill_tail(out, res.est, res.mask)
        elif self.fill_est and res.est is not None:
            # a sampled draft may sample from any law it returns (the verify reads the same scores as q); the
            # screen's estimates outside S keep q's tail, which a -inf tail drops: without a top-k that tail
            # holds target mass the verify could otherwise never accept, and the confidence stop reads it
            out = torch.where(res.mask, out, res.est.to(out.dtype))
        return res, out

    def placement(self, procs):
        i = None if self.check_after is None else _index(procs, self.check_after)
        at = len(procs) if i is None else i + 1
        if self.ts_proc is not None:
            i = _index(procs, self.ts_proc)
            at = at if i is None else i
        return at, 0

    @property
    def guard_tag(self):
        return (self.name, self.always)


@dataclass(frozen=True)
class Threshold(Plan):
    """Min-p sampling without a top-k (docs/certificates.md §3.3): every token within ``delta`` (+ ``delta_rel``·|max|)
    of the max raw logit is computed; the check right before the min-p warper ``min_p_proc`` proves that the warper
    keeps exactly stock's tokens."""

    name: ClassVar[str] = "threshold"
    verify: bool = True
    min_p: float = 0.0
    delta: float = 0.0
    delta_rel: float = 0.0
    min_p_proc: Any = None

    def head(self, ch, H, sess, keys=None):
        res = ch.threshold(H, self.delta, out_dtype=sess.out_dtype, rel=self.delta_rel)
        return res, res.logits

    def placement(self, procs):
        i = _index(procs, self.min_p_proc)
        return (len(procs) if i is None else i), 0


@dataclass(frozen=True)
class Nucleus(Plan):
    """Top-p without a top-k (docs/certificates.md §3.5): exact logits on S, which leaves about ``eps`` of a row's
    mass outside, and an upper bound on every other token; the check takes the top-p warper's place."""

    name: ClassVar[str] = "nucleus"
    verify: bool = True
    top_p_proc: Any = None
    eps: float = 0.05
    temperature: float = 1.0

    def head(self, ch, H, sess, keys=None):
        res = ch.spec(H, self.eps, temperature=self.temperature, out_dtype=sess.out_dtype)
        return res, res.logits

    def placement(self, procs):
        i = _index(procs, self.top_p_proc)
        return (len(procs), 0) if i is None else (i, 1)


@dataclass(frozen=True)
class Bounded(Plan):
    """The target's head in assisted sampling with hf_csv's exact verify (docs/speculative.md): exact logits on S
    (all but about ``SPEC_EPS`` of the mass) and bounds for the rest, which the certified verify reads."""

    name: ClassVar[str] = "spec"
    verify: bool = True
    temperature: float = 1.0

    def head(self, ch, H, sess, keys=None):
        res = ch.spec(H, SPEC_EPS, temperature=self.temperature, out_dtype=sess.out_dtype)
        return res, res.logits


@dataclass(frozen=True)
class Sample(Plan):
    """Exact lazy-Gumbel sampling in the head (docs/certificates.md §2.3) under ``warps`` (("temperature", T) /
    ("top_k", k) in list order). ``draw_after``: the head returns exact logits on S and the check draws after the
    lowering processors; else the head returns the drawn token alone (one-hot) for stock's sampler."""

    name: ClassVar[str] = "sample"
    warps: tuple = ()
    draw_after: bool = False

    def head(self, ch, H, sess, keys=None):
        post = None if sess.post is None or sess.post.identity else sess.post.apply
        # (the drawn token's probability only for a draft: its confidence stop reads it)
        kw = {} if keys is None else {"noise": sess.gumbel.rows(keys, ch.vocab_size, H.device), "with_conf": sess.draft}
        res = ch.sample(H, out_dtype=sess.out_dtype, post=post, warps=list(self.warps), **kw)
        if keys is not None and res.conf is not None and sess.draft:
            # the assistant's confidence stop reads the drawn token's probability (hf_csv.candidate)
            sess.assist.conf = dict(zip(keys, res.conf.tolist()))
        return res, (res.logits if self.draw_after else one_hot_logits(res.logits, res.tokens, sess.out_dtype))


@dataclass(frozen=True)
class ExactBeam(Plan):
    """Token-identical beam search (docs/certificates.md §3.10): S holds all but about ``BEAM_EPS`` of each row's
    mass, so the normalizer's interval is ~``BEAM_EPS`` wide; ``k`` is how many top tokens a row must decide."""

    name: ClassVar[str] = "beam_exact"
    verify: bool = True
    k: int = 2

    def head(self, ch, H, sess, keys=None):
        res = ch.spec(H, BEAM_EPS, out_dtype=sess.out_dtype)
        return res, res.logits


@dataclass(frozen=True)
class Epsilon(Plan):
    """The ε-softmax certificate (``CSVConfig(mode="epsilon")``, approximate: TV ≤ ``eps``, docs/certificates.md
    §2.2). ``beams``: beam search (name ``beam``), whose check proves each row's top-2·beams; 0: sampling."""

    eps: float = 1e-3
    temperature: float = 1.0
    beams: int = 0

    @property
    def name(self) -> str:  # type: ignore[override]
        return "beam" if self.beams else "epsilon"

    @property
    def k(self) -> int:
        return 2 * self.beams

    def head(self, ch, H, sess, keys=None):
        res = ch.epsilon(H, self.eps, temperature=self.temperature, out_dtype=sess.out_dtype)
        return res, res.logits


def fill_tail(out: torch.Tensor, est: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """Greedy drafting: raise the uncomputed tokens to one value c, chosen so that the tokens outside
    S carry about the mass the screen *estimates* for them, Σ_{i∉S} exp(est_i).

    Why: the assistant's confidence stop (``assistant_confidence_threshold``) reads
    ``softmax(scores)`` at the drafted token; with -inf outside S that probability would be
    inflated and drafts would run longer than stock's. With the fill it matches stock's up to the
    screen's estimate error. The argmax is unchanged: c <= max_{i∉S} est_i <= max U_i < τ <= the
    top exact logit, and c is kept 4 ulps (of the output dtype) below the top so rounding cannot
    create a tie. (In-place ``clamp(min=c)``: tokens of S below c are raised too; they are not the
    argmax, and the value only feeds the confidence estimate.) Greedy verification reads only the
    target's logits, so tokens stay exact.
    """
    # tail mass = total - mass on S, from one logsumexp pass over est (S is tiny)
    lse = torch.logsumexp(est, dim=1)
    r, t = S.nonzero(as_tuple=True)
    n_out = S.shape[1] - torch.bincount(r, minlength=S.shape[0])
    on_s = torch.zeros_like(lse).index_add_(0, r, torch.exp(est[r, t] - lse[r]))
    tail = torch.log((1 - on_s).clamp(min=0)) + lse  # -inf when S holds (numerically) all the mass
    c = tail - torch.log(n_out.clamp(min=1).float())
    top = out.float().amax(1)
    eps = torch.finfo(out.dtype).eps if out.dtype != torch.float32 else 1e-6
    c = torch.minimum(c, top - 4 * eps * top.abs().clamp(min=1.0))
    c = torch.where((n_out > 0) & torch.isfinite(c), c, torch.full_like(c, float("-inf")))
    return out.clamp_(min=c[:, None].to(out.dtype))


def one_hot_logits(logits: torch.Tensor, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Logits that make the stock multinomial sampler return ``tokens``: the drawn token keeps its
    exact logit, every other token is -inf. Rows without a draw (tokens == -1, non-finite hidden
    states) keep their full-head logits, which the stock sampler then samples from."""
    N, V = logits.shape
    out = torch.full((N, V), float("-inf"), dtype=dtype, device=logits.device)
    ok = tokens >= 0
    if bool(ok.all()):
        r = torch.arange(N, device=logits.device)
        out[r, tokens] = logits[r, tokens].to(dtype)
    else:
        r = ok.nonzero(as_tuple=True)[0]
        out[r, tokens[r]] = logits[r, tokens[r]].to(dtype)
        bad = (~ok).nonzero(as_tuple=True)[0]
        out[bad] = logits[bad].to(dtype)
    return out


# ------------------------------------------------------------------ how each processor relates to a certificate
# (docs/processors.md has the table)
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
# input_ids (and the processor's settings) alone, never from the scores (transformers 4.57 and 5.20-5.23: torch.where /
# masked_fill with -inf). A custom processor may declare ``csv_masks_only = True`` (a promise of exactly that).
MASKS_ONLY = frozenset({"SuppressTokensLogitsProcessor", "SuppressTokensAtBeginLogitsProcessor",
                        "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor",
                        "NoRepeatNGramLogitsProcessor"})

# Stock stopping criteria that never read ``scores`` (transformers 5.23): safe with any certificate.
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
        # given to it as stock computes it (hf_csv.processors.FullHeadDuring)
        return "order" if not getattr(p, "is_scores_logprobs", False) else "full"
    if name == "TopKLogitsWarper" and getattr(p, "filter_value", -math.inf) != -math.inf:
        return "full"  # a finite filter value leaves the filtered tokens some mass
    return KIND.get(name, "full")


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
    provides it (hf_csv.candidate), so it is safe only inside a draft session.
    """
    if getattr(c, "csv_safe", False) is True:
        return "safe"
    return "safe" if type(c).__name__ in SAFE_CRITERIA else "full"
