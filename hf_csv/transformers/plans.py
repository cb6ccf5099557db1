"""Plans: which certificate one decoding call runs, as a frozen value (core: no transformers import).

A plan holds only its own parameters and knows its head call (:meth:`Plan.head`: which method of
:class:`hf_csv.core.certificate.CertifiedHead` computes a step's rows, and what the returned logits are), its check
(:meth:`Plan.check`: the per-row proof of :mod:`hf_csv.core.checks` it runs after the processors, and the re-run of the
rows it cannot prove) and where that check goes in the logits-processor list (:meth:`Plan.placement`).
:func:`hf_csv.transformers.decision.choose_plan` picks one per call; :mod:`hf_csv.transformers.step` runs it, one step
at a time. The checks of stock's Whisper and beam rules live in :mod:`hf_csv.transformers.whisper_beam_checks`, the
processor-kind tables in :mod:`hf_csv.transformers.processor_kinds`. Limits: the checks take float32 processed scores;
every guarantee is the one of its docs/certificates.md section (below), for the dtypes stated there.

| plan | certificate (docs/certificates.md) | returns | check after the processors |
|---|---|---|---|
| :class:`Full` | none: stock's head | stock's logits | none |
| :class:`TopK` | exact top-K (§2.1), timestamps (§3.4) | exact on S, −inf elsewhere | top-k / timestamp rule (§3.2, §3.4) |
| :class:`Threshold` | every token within δ of the max (§3.3) | exact on S, −inf elsewhere | min-p's kept set (§3.3) |
| :class:`Nucleus` | S leaves ε of the mass (§3.5) | exact on S, −inf elsewhere | stock's nucleus from the bounds (§3.5) |
| :class:`Bounded` | S leaves ε of the mass, bounds elsewhere (docs/speculative.md) | exact on S, −inf elsewhere | none here: hf_csv's verify reads the bounds |
| :class:`Sample` | exact lazy-Gumbel draw (§2.3) | the draw (one-hot), or exact on S | the draw after lowering processors (§2.3) |
| :class:`ExactBeam` | S leaves ε of the mass (§3.10) | exact on S, −inf elsewhere | log-prob intervals for the beam bookkeeping (§3.10) |
| :class:`Epsilon` | ε-softmax, approximate (§2.2) | exact on S, −inf elsewhere | beam search: top-2·beams (§3.2) |
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional

import torch

from hf_csv.core import checks
from hf_csv.core.certificate import value_interval
from hf_csv.core.errors import CSVError
from hf_csv.transformers.processor_kinds import orders, prefix
from hf_csv.transformers.whisper_beam_checks import BeamStep, beam_logprob_box, record_lp, timestamp_unsure

__all__ = ["Plan", "Full", "TopK", "Threshold", "Nucleus", "Bounded", "Sample", "ExactBeam", "Epsilon", "FULL",
           "SPEC_EPS", "BEAM_EPS", "one_hot_logits"]

# Bounded plan (assisted sampling): S holds all but about this fraction of a row's mass (upper bound), so the verify's
# interval for the normalizer is a few % wide and few accept/reject decisions need the full row. Speed only (the
# verify decides correctness; docs/benchmarks.md §3)
SPEC_EPS = 5e-2
# ExactBeam plan: S holds all but about this fraction of a row's mass (upper bounds), so the normalizer's interval is
# ~1e-3 wide. Speed only (docs/benchmarks.md §9.9)
BEAM_EPS = 1e-3


@dataclass(frozen=True)
class Plan:
    """One call's certificate. ``check_processed``: each step's processed scores are checked after the processors (a
    :class:`hf_csv.transformers.processors.CSVLogitsProcessor` sits in the list and each head call stashes what the
    check reads): :meth:`check` proves each row there and recomputes with stock's head the rows it cannot prove
    (``checks_rows``), or, for :class:`Bounded`, hf_csv's verify reads the stashed bounds. ``False``: no check runs
    after the processors (e.g. greedy top-1 with no lowering processor and an identity post-head map, the head's own
    one-hot draw)."""

    name: ClassVar[str] = ""
    # whether :meth:`check` runs in the processor list (Bounded: hf_csv's verify reads its bounds instead)
    checks_rows: ClassVar[bool] = True
    check_processed: bool = False

    def check(self, c: Any, sess: Any, input_ids: torch.Tensor, scores: torch.Tensor, last: Any,
              p: Optional[int]) -> torch.Tensor:
        """The step's check at the CSVLogitsProcessor ``c``'s place (hf_csv.transformers.step.check_step): ``scores`` with every
        row provably stock's, the rows it cannot prove recomputed by ``c.rerun``. ``last``: the head call's
        StepStash (None only for ExactBeam), ``p`` the position in it."""
        return scores

    def head(self, ch: Any, H: torch.Tensor, sess: Any, keys: Optional[list] = None) -> tuple[Any, torch.Tensor]:
        """(CertResult, dense logits [N, V] in the model dtype) of one head call on rows ``H`` [N, d]."""
        raise NotImplementedError

    def ready(self, ch: Any, H: torch.Tensor) -> bool:
        """Whether ``ch`` can run this plan's head call now (False while a large head's screen is being packed in
        the background; the vocabulary-parallel head builds synchronously on every rank)."""
        ready = getattr(ch, "ready", None)
        return ready is None or bool(ready(H))

    def placement(self, procs: list) -> tuple[int, int]:
        """(index, how many processors it replaces) of the check in the call's processor list: last by default."""
        return len(procs), 0

    @property
    def log_softmax_rows(self) -> bool:
        """Whether stock runs log_softmax on the head's rows before the processors (beam search's scores)."""
        return False

    @property
    def guard_tag(self) -> tuple:
        """What the speed guard keys a head call's timing on, besides its shape (hf_csv.core.speed)."""
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
    ``ts_proc``: Whisper's timestamp processor the check runs right before. ``confidence``: a greedy draft's
    confidence-stop threshold, whose decision the check proves on each row or gives the row stock's head (§3.11).
    A sampled draft without a top-k: ``fill_est`` gives the uncomputed tokens the screen's estimates.
    ``own_values``: the call proves every decision on the values within their slack and never hands them to stock's
    code as stock's (hf_csv.transformers.decision sets it where no reason to read them exists), so
    the head may compute them itself (``CertifiedHead.topk(own_values=True)``). ``stock_values``: the values on S
    are stock's bits, through the kernel the column-subset probe found for this head (docs/certificates.md §2.0,
    the premise every value-reading plan runs on): the confidence check then takes them as stock's; without it,
    it takes them within their slack."""

    name: ClassVar[str] = "topk"
    k: int = 1
    k_head: int = 0
    always: int = 0
    check_after: Any = None
    ts_proc: Any = None
    confidence: float = 0.0
    fill_est: bool = False
    own_values: bool = False
    stock_values: bool = False

    def head(self, ch, H, sess, keys=None):
        kw: dict = {"always": self.always} if self.always else {}
        if self.own_values:
            kw["own_values"] = True
        if sess.whisper.record or self.confidence:
            kw["with_upper"] = True
        if self.k_head > self.k:  # a wider set where it fits the budget, else the warper's k (config.lowered_k)
            kw.update(k_min=self.k)
        res = ch.topk(H, max(self.k, self.k_head), out_dtype=sess.out_dtype, **kw)
        out = res.logits
        if self.fill_est and res.est is not None:
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
        # a sampled top-k row (k tokens, stock's values for its warper) costs more than a greedy one: timed apart
        return (self.name, self.always, self.k, self.check_after is not None)

    def check(self, c, sess, input_ids, scores, last, p):
        """Top-k after the processors (docs/certificates.md §3.2), Whisper's timestamp rule (§3.4), the values' slack
        (§2.0); records Whisper's avg-logprob terms when the call keeps them (§3.6)."""
        k = min(self.k, last.logits.shape[2])
        if sess.draft and k > 1 and self.check_after is None:
            # a sampled draft may use any distribution it returns; it only needs a finite row
            return rerun(c, input_ids, scores, sess, last, p, ~torch.isfinite(scores.amax(1).float()))
        ob = outside_bound(c, input_ids, sess, last, p)
        # the processed bounds of stock's values at p, computed at most once (the set check and the confidence
        # stop's may both read them)
        box = functools.cache(lambda: processed_interval(c, input_ids, sess, last, p, scores))
        ts = None
        if self.ts_proc is not None:
            bad, ts = timestamp_unsure(sess, self.ts_proc, input_ids, scores, ob, last.mask[:, p])
        else:
            bad = checks.topk_unsure(scores, ob, k)
            # values within their slack of stock's (§2.0): the set after the processors is proven within it. A
            # draft's own tokens count too (they fix the target's verify shapes, §3.11); a draft's top-1 call with no
            # processor before the check has the head's argmax, which the head proved within the slack itself (a
            # wider call, k_head, does not); values that are stock's bits (the probed kernel) need no interval
            head_proved = sess.draft and self.k_head <= self.k and not prefix(c, sess).runs
            if last.slack is not None and not (head_proved or self.stock_values):
                bad |= set_undecided(scores, last, p, k, ob, box)
        if self.confidence:
            up = checks.raise_by_dtype(last.upper[:, p].double(), sess.out_dtype)
            lo = hi = None
            if (not self.stock_values and last.slack is not None and last.acc is not None
                    and bool((last.slack[:, p] > 0).any())):
                lo, hi = box()  # stock's values on S lie within
            bad |= checks.confidence_unsure(scores, last.mask[:, p], up, self.confidence, lo, hi)
        out = rerun(c, input_ids, scores, sess, last, p, bad)
        if sess.whisper.record:
            record_lp(sess, input_ids, out, last, p, bad, ts)
        return out


@dataclass(frozen=True)
class Threshold(Plan):
    """Min-p sampling without a top-k (docs/certificates.md §3.3): every token within ``delta`` (+ ``delta_rel``·|max|)
    of the max raw logit is computed; the check right before the min-p warper ``min_p_proc`` proves that the warper
    keeps exactly stock's tokens."""

    name: ClassVar[str] = "threshold"
    check_processed: bool = True
    min_p: float = 0.0
    delta: float = 0.0
    delta_rel: float = 0.0
    min_p_proc: Any = None

    def head(self, ch, H, sess, keys=None):
        res = ch.threshold(H, self.delta, out_dtype=sess.out_dtype, rel=self.delta_rel)
        return res, res.logits

    def check(self, c, sess, input_ids, scores, last, p):
        bad = checks.min_p_unsure(scores.float(), outside_bound(c, input_ids, sess, last, p), self.min_p)
        return rerun(c, input_ids, scores, sess, last, p, bad)

    def placement(self, procs):
        i = _index(procs, self.min_p_proc)
        return (len(procs) if i is None else i), 0


@dataclass(frozen=True)
class Nucleus(Plan):
    """Top-p without a top-k (docs/certificates.md §3.5): exact logits on S, which leaves about ``eps`` of a row's
    mass outside, and an upper bound on every other token; the check takes the top-p warper's place."""

    name: ClassVar[str] = "nucleus"
    check_processed: bool = True
    top_p_proc: Any = None
    eps: float = 0.05
    temperature: float = 1.0

    def head(self, ch, H, sess, keys=None):
        res = ch.spec(H, self.eps, temperature=self.temperature, out_dtype=sess.out_dtype)
        return res, res.logits

    def placement(self, procs):
        i = _index(procs, self.top_p_proc)
        return (len(procs), 0) if i is None else (i, 1)

    def check(self, c, sess, input_ids, scores, last, p):
        """In the top-p warper's place (docs/certificates.md §3.5): stock's warper output where the bounds decide
        every token's membership of the nucleus, else the full row through stock's warper."""
        warper = self.top_p_proc
        S = last.mask[:, p]
        up = checks.raise_by_dtype(last.upper[:, p], sess.out_dtype)
        for proc in orders(c, sess):  # temperature
            up = proc(input_ids, up)
        complete = S.all(1)
        remove, bad = checks.nucleus_decide(scores, S, up, float(warper.top_p))
        bad &= ~complete
        st = sess.reports.setdefault("nucleus", {"rows": 0, "decided_by_bounds": 0, "complete_rows": 0,
                                               "rows_rerun": 0})
        st["rows"] += int(scores.shape[0])
        st["complete_rows"] += int(complete.sum())
        st["rows_rerun"] += int(bad.sum())
        st["decided_by_bounds"] += int((~bad & ~complete).sum())
        out = scores.masked_fill(remove, warper.filter_value)
        fix = bad | complete
        if bool(fix.any()):
            src = rerun(c, input_ids, scores, sess, last, p, bad) if bool(bad.any()) else scores
            idx = fix.nonzero(as_tuple=True)[0]
            out[idx] = warper(input_ids[idx], src[idx])  # stock's warper on stock's rows (it works row by row)
        else:
            log_step(c, int(scores.shape[0]), 0)
        return out


@dataclass(frozen=True)
class Bounded(Plan):
    """The target's head in assisted sampling with hf_csv's exact verify (docs/speculative.md): exact logits on S
    (all but about ``SPEC_EPS`` of the mass) and bounds for the rest, which the certified verify reads
    (hf_csv.transformers.acceptance); no check in the processor list."""

    name: ClassVar[str] = "spec"
    checks_rows: ClassVar[bool] = False
    check_processed: bool = True
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
            # the assistant's confidence stop reads the drawn token's probability (hf_csv.transformers.drafts)
            sess.assist.conf = dict(zip(keys, res.conf.tolist()))
        return res, (res.logits if self.draw_after else one_hot_logits(res.logits, res.tokens, sess.out_dtype))

    def check(self, c, sess, input_ids, scores, last, p):
        """The Gumbel-max draw after lowering processors (docs/certificates.md §2.3), exact because every uncomputed
        token's final score plus its noise is below the head's cut (they only lower) and the winner here reaches it;
        rows where it does not are recomputed with the full head (the same noise, so the law stays exact). Returns a
        one-hot row (the winner keeps its score) from which stock's sampler can only draw the winner."""
        g = last.noise[:, p]
        slack = last.slack[:, p] if last.slack is not None and last.acc is not None else None
        bad, tok, m = checks.gumbel_unsure(
            scores, g, last.cut[:, p], None if last.shift is None else last.shift[:, p], slack,
            lambda: processed_interval(c, input_ids, sess, last, p, scores))
        if bool(bad.any()):
            idx = bad.nonzero(as_tuple=True)[0]
            full = rerun(c, input_ids, scores, sess, last, p, bad)
            tok = tok.clone()
            tok[idx] = ((full[idx].float() - m[idx]) + g[idx]).argmax(1)
            scores = full
        else:
            log_step(c, int(scores.shape[0]), 0)
        return checks.winner_only(scores, tok)


@dataclass(frozen=True)
class ExactBeam(Plan):
    """Token-identical beam search (docs/certificates.md §3.10): S holds all but about ``BEAM_EPS`` of each row's
    mass, so the normalizer's interval is ~``BEAM_EPS`` wide; ``k`` is how many top tokens a row must decide."""

    name: ClassVar[str] = "beam_exact"
    check_processed: bool = True
    k: int = 2

    def head(self, ch, H, sess, keys=None):
        res = ch.spec(H, BEAM_EPS, out_dtype=sess.out_dtype)
        return res, res.logits

    def check(self, c, sess, input_ids, scores, last, p):
        """Stash, for hf_csv.transformers.beam, an interval [lo, hi] around stock's processed log-prob of every computed token
        and a bound ``ob`` on every other token's (docs/certificates.md §3.10); return the scores unchanged (the
        representative row stock's bookkeeping runs on)."""
        if sess.beam.step is not None:
            raise CSVError("hf_csv: a certified beam step's intervals were not read by the beam bookkeeping; please "
                           "report this (generate without csv_config meanwhile)")
        x = scores.float()
        complete = None if last is None else last.mask[:, p].all(1)
        if last is None or bool(complete.all()):  # the full head, or every row over the budget: stock's rows
            sess.beam.step = BeamStep(lo=x, hi=x, rep=x, ob=torch.full_like(x[:, 0], float("-inf")), subvocab=False)
            return scores
        lo, hi, ob = beam_logprob_box(sess, input_ids, last, p, stop=c)
        lo = torch.where(complete[:, None], x, torch.minimum(lo, x))
        hi = torch.where(complete[:, None], x, torch.maximum(hi, x))
        sess.beam.step = BeamStep(lo=lo, hi=hi, rep=x, ob=ob.masked_fill(complete, float("-inf")))
        log_step(c, int(scores.shape[0]), 0)
        return scores


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

    @property
    def log_softmax_rows(self) -> bool:
        return bool(self.beams)

    def head(self, ch, H, sess, keys=None):
        res = ch.epsilon(H, self.eps, temperature=self.temperature, out_dtype=sess.out_dtype)
        return res, res.logits

    def check(self, c, sess, input_ids, scores, last, p):
        """Beam search (approximate): the bound in log-prob space, then each row's top-2·beams (§3.2)."""
        raw = last.logits[:, p]
        ob = checks.epsilon_bound(raw, last.mask[:, p].all(1), self.eps)
        bad = checks.topk_unsure(scores, ob, min(self.k, raw.shape[1]))
        return rerun(c, input_ids, scores, sess, last, p, bad)


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


# ------------------------------------------------------------------ what a check needs at its place in the list
# (``c`` is the call's CSVLogitsProcessor: the processors before it are the ones the check runs through)
def log_step(c: Any, rows: int, reruns: int) -> None:
    """One record of the check processor ``c`` (``CSVLogitsProcessor(record=True)``)."""
    if c.record:
        c.records.append({"rows": rows, "reruns": reruns})


def outside_bound(c: Any, input_ids: torch.Tensor, sess: Any, last, p: int) -> torch.Tensor:
    """[B] fp32: a bound on every uncomputed token's processed score at this place (docs/certificates.md §3.2):
    the head's bound through the post-head map and the order-preserving processors before this one (lowering
    ones only lower it); −inf on complete rows."""
    bound = last.bound[:, p]
    ob = bound.to(last.logits.dtype)
    if sess.post is not None and not sess.post.identity:
        ob = sess.post.apply(ob)
    ob = ob.float()[:, None]
    for proc in orders(c, sess):  # e.g. temperature
        ob = proc(input_ids, ob)
    return ob[:, 0].masked_fill(bound == float("-inf"), float("-inf"))  # complete rows: nothing outside


def _before_me(c: Any, input_ids: torch.Tensor, x: torch.Tensor, sess: Any) -> torch.Tensor:
    """``x`` through the processors that run before this one (each maps every token's score by a non-decreasing
    function of that score: "order" and "lower" kinds), as stock runs them."""
    for proc in prefix(c, sess).every:
        x = proc(input_ids, x)
    return x


def processed_interval(c: Any, input_ids, sess, last, p, scores: Optional[torch.Tensor] = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(f(lo), f(hi)) fp32 [B, V]: the processors before this one applied to the bounds of stock's values at
    position ``p`` (hf_csv.core.certificate.value_interval); each token's processed score lies between them.

    Where every processor before this one only masks (:func:`hf_csv.transformers.processor_kinds.masks_only`: each token's output is
    its input or −inf, the set chosen from ``input_ids`` alone) or returns its input, f is one mask M, read off
    this step's processed ``scores`` = f(raw): on a finite raw value, M holds the token iff its score is −inf
    (where raw is −inf so are lo and hi). Then f(x) = where(M, −inf, x) on lo and hi, without running the
    processors twice over V (Whisper's suppressions read all of V once per call)."""
    raw = last.logits[:, p]
    lo, hi = value_interval(last.acc[:, p], last.slack[:, p], raw.dtype)
    lo, hi = lo.to(raw.dtype), hi.to(raw.dtype)
    if scores is not None and prefix(c, sess).masks_only:
        M = (scores == float("-inf")) & torch.isfinite(raw)
        return lo.float().masked_fill(M, float("-inf")), hi.float().masked_fill(M, float("-inf"))
    return (_before_me(c, input_ids, lo, sess).float(), _before_me(c, input_ids, hi, sess).float())


def set_undecided(scores, last, p, k, ob, box: Callable[[], tuple]) -> torch.Tensor:
    """Rows whose processed top-``k`` set could differ from stock's (docs/certificates.md §2.0): the values on S
    are within their slack of stock's, so each token's processed score lies in [f(lo), f(hi)] = ``box()``
    (:func:`processed_interval`); the set T of our top k is stock's when min over T of f(lo) exceeds every other
    token's f(hi) and the bound outside S."""
    slack = last.slack[:, p]
    if last.acc is None or not bool((slack > 0).any()):
        return torch.zeros(scores.shape[0], dtype=torch.bool, device=scores.device)
    f_lo, f_hi = box()
    return checks.set_unsure(scores, f_lo, f_hi, k, ob, slack)


def rerun(c: Any, input_ids, scores, sess, last, p, bad):
    """Recompute the ``bad`` rows with the stock head and re-run the preceding processors."""
    nbad = int(bad.sum())
    log_step(c, int(scores.shape[0]), nbad)
    if nbad == 0:
        return scores
    sess.verify_reruns += nbad
    if sess.config.stats:
        # a re-run sub-vocabulary row's token now comes from stock's row: counted as the full head's, not certified
        # (a row whose set already held every token was counted where the head computed it)
        sess.stats.uncertify(last.mask[:, p][bad & ~last.mask[:, p].all(-1)].sum(-1).tolist())
    B, P, d = last.H.shape
    raw = last.logits[:, p].clone()  # the stash views the model's output logits: never write into them
    idx = bad.nonzero(as_tuple=True)[0]
    # stock's values: its GEMM over all B·P rows (a GEMM on fewer rows may round differently), once per head call
    if last.stock_full is None:
        last.stock_full = sess.head.stock(last.H.reshape(B * P, d)).view(B, P, -1)
    full = last.stock_full[:, p]
    raw[idx] = full[idx].to(raw.dtype)
    if sess.post is not None and not sess.post.identity:
        raw = sess.post.apply(raw)
    new = raw.float()
    if sess.plan.log_softmax_rows:
        new = torch.log_softmax(new, dim=-1)
    for proc in prefix(c, sess).runs:  # (not a no-speech detector's forward: once is enough)
        new = proc(input_ids, new)
    return new
