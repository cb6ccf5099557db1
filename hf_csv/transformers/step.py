"""One decode step of a certified call, in order (the only place the step's flow lives):

0. **Before the forward** (:func:`track_length`, a forward pre-hook on the model): how many tokens the model will
   have consumed, so that a head call of several positions knows each one's token index.
1. **Head step** (:func:`head_step`, called by the swapped head :class:`CSVHead`, which transformers calls in the
   model's forward): stock's head where the call's plan is :class:`~hf_csv.transformers.plans.Full`, the rows' token indices are
   unknown, a round has no drafts, the screen is still being packed or the speed guard measured stock's head
   faster; else the plan's head call (:meth:`hf_csv.transformers.plans.Plan.head`) on the certified head, and a
   :class:`StepStash` of what the check needs.
2. **After the forward** (:func:`check_post`, a forward hook, once per call): the model returned the registered
   post-head map of what the head returned (:func:`guard_post_head`).
3. **Check step** (:func:`check_step`, called by :class:`hf_csv.transformers.processors.CSVLogitsProcessor` at its place in the
   processor list, :meth:`~hf_csv.transformers.plans.Plan.placement`): nothing on a step the head left to stock or a compiled
   graph certified; else the plan's check (:meth:`hf_csv.transformers.plans.Plan.check`), which proves each row's outcome stock's
   or recomputes the row with stock's head.
4. transformers picks the token (argmax or its sampler) from a row that is provably stock's.

Which session a call runs is read from the calling context (:func:`active_session`; hf_csv.transformers.heads.swapped_head sets
it for the call's extent), so a stock call on the same model in another thread runs stock's head. Per-step state is
the call's (:class:`hf_csv.transformers.session.CSVSession`: ``step``); the plan is a frozen value. Core: no transformers import.
"""
from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import nn

from hf_csv.core.errors import CSVError
from hf_csv.transformers.plans import Bounded, ExactBeam, Full, Nucleus, Sample
from hf_csv.transformers.whisper_beam_checks import record_lp
from hf_csv.transformers.posthead import check_output
from hf_csv.core.speed import CANNOT_WIN, rows_bucket

__all__ = ["CSVHead", "StepStash", "StepState", "activated", "active_session", "call_guard", "check_post", "check_step",
           "flush_guard", "guard_key", "guard_post_head", "head_step", "track_length"]


@dataclass
class StepStash:
    """What the last head call saw, for the check step.

    All P positions of the call are kept: assisted decoding verifies L+1 positions from one head
    call and runs the processors once per position. ``fed_total`` is the sequence length the model
    had consumed after this call (cache + new tokens); position p of the call predicts the token
    at index ``fed_total - (P - 1 - p)``, which is how the check finds its row.
    """

    H: torch.Tensor  # [B, P, d] hidden states (views, not copies), in the model dtype
    logits: torch.Tensor  # [B, P, V] the dense certified logits returned (model dtype, before the post map)
    mask: Optional[torch.Tensor]  # [B, P, V] bool: certified S (all True on fallback rows)
    fed_total: Optional[int] = None
    # [B, P] every token outside S has a stock logit (model dtype, before the post map) <= bound
    bound: Optional[torch.Tensor] = None
    noise: Optional[torch.Tensor] = None  # [B, P, V] Sample plan, draw after the processors: Gumbel noise
    cut: Optional[torch.Tensor] = None  # [B, P] ... and the cut every uncomputed token stays below
    shift: Optional[torch.Tensor] = None  # [B, P] ... in units shifted by this (CertResult.shift)
    upper: Optional[torch.Tensor] = None  # [B, P, V] bound on stock's fp32 logit of every token (Nucleus, beams)
    # [B, P, V] stock's head on all B·P rows, computed once by the first re-run that needs it: assisted decoding
    # checks up to P positions of one call, and each re-run would otherwise repeat the whole GEMM
    stock_full: Optional[torch.Tensor] = None
    # [B, P] fp32: each value of the row comes from an accumulator within slack of stock's (0: stock's own row)
    slack: Optional[torch.Tensor] = None
    acc: Optional[torch.Tensor] = None  # [B, P, V] fp32: our accumulators on S (hf_csv.core.certificate.value_interval)

    def position(self, input_len: int) -> int:
        """Index p of the position whose logits the processor sees with ``input_len`` input tokens."""
        P = self.logits.shape[1]
        if P == 1:
            return 0
        if self.fed_total is None:
            raise CSVError("hf_csv: cannot tell which of several positions is being processed")
        p = P - 1 - (self.fed_total - input_len)
        if not 0 <= p < P:
            raise CSVError(f"hf_csv: processor input length {input_len} does not match the head call "
                           f"({P} positions ending at {self.fed_total})")
        return p


@dataclass
class StepState:
    """The per-step state of one call (``CSVSession.step``): what one part of a decode step hands to the next."""

    fed_total: Optional[int] = None  # tokens consumed after the current forward (set by a pre-hook, hf_csv.transformers.scope)
    last: Optional[StepStash] = None  # the last certified head call, for the check step
    last_out: Optional[torch.Tensor] = None  # what the head returned last (the post-head guard, guard_post_head)
    # the speed guard's record of the last head call, completed with the check step's time of the same step
    # (hf_csv.core.speed): (guard, key, certified, seconds in the head) or None
    guard_pending: Optional[tuple] = None
    guard_last: Optional[tuple] = None  # (guard, key) of the last completed record: the call's summary reports it
    # the call's speed guard, read once per call (None: not guarded, or HF_CSV_SPEED_GUARD=0 when the call began),
    # and the last guard key with what it was built from (plan, rows bucket, threads): :func:`guard_key`
    guard: Any = None
    guard_read: bool = False
    gkey: Optional[tuple] = None
    spec_pending: bool = False  # Bounded plan: a head call's bounds wait for hf_csv's verify
    spec_full_next: bool = False  # Bounded plan: the next head call is read by stock's sampler itself (no drafts)


# ------------------------------------------------------------------ the step's entries from transformers
# model id -> session, per context (thread / task). A dict so that an assistant model and the main model can both be
# certified inside one call. Set by :func:`activated` (hf_csv.transformers.heads.swapped_head) for the call's extent.
_ACTIVE: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("hf_csv_active", default=None)


def active_session(model: nn.Module) -> Any:
    """The :class:`hf_csv.transformers.session.CSVSession` active for ``model`` in the calling context (thread / task), or None."""
    return _session_of(id(model))


def _session_of(model_id: int) -> Any:
    act = _ACTIVE.get()
    return None if act is None else act.get(model_id)


@contextlib.contextmanager
def activated(model: nn.Module, session: Any) -> Iterator[None]:
    """Make ``session`` the one :func:`active_session` finds for ``model`` in this context, until the block exits
    (reset also after an exception)."""
    act = dict(_ACTIVE.get() or {})
    act[id(model)] = session
    token = _ACTIVE.set(act)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


class CSVHead(nn.Module):
    """Stands in for the output head; certified only for the session of the calling context."""

    def __init__(self, inner: nn.Linear, model: nn.Module):
        super().__init__()
        self.inner = inner
        self._model_id = id(model)
        # the head traced into a compiled forward (set by hf_csv.transformers.scope's _valid_auto_compile_criteria override through
        # set_static_plan): a StaticTopK, or None for stock's
        self.static_plan = None

    # keep attribute access that code may do on the head working (weight/bias/in_features...)
    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return self.inner.bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # traced into a compiled forward: no per-call Python state can be read here (a graph replays
            # without it); the plan set for this model's compiled decode, or stock's head
            plan = self.static_plan
            return self.inner(hidden) if plan is None else plan(hidden)
        sess = _session_of(self._model_id)
        if sess is None:
            return self.inner(hidden)
        if sess.exact_depth:  # a processor's own model call (WhisperNoSpeechDetection): stock's head, state untouched
            sess.reports["processor_forwards"] = sess.reports.get("processor_forwards", 0) + 1
            return self.inner(hidden)
        return head_step(sess, self.inner, hidden)


def track_length(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: how many tokens the model has consumed once this forward is done (cache + new).

    The head call then knows the token index of each of its positions (StepStash.position), which
    CSVLogitsProcessor needs when one call produces several positions (assisted verification).
    """
    if torch.compiler.is_compiling():  # traced into a compiled forward: the static head keeps no stash
        return None
    sess = active_session(module)
    if sess is None or sess.exact_depth:
        return None
    ids = kwargs.get("decoder_input_ids")
    if ids is None:
        ids = kwargs.get("input_ids", args[0] if args and torch.is_tensor(args[0]) else None)
    if ids is None or kwargs.get("inputs_embeds") is not None or kwargs.get("decoder_inputs_embeds") is not None:
        sess.step.fed_total = None
        return None
    pkv = kwargs.get(sess.cache_kwarg)  # (the version's keyword, set by the call: hf_csv.transformers.compat.cache_kwarg)
    try:
        past = int(pkv.get_seq_length()) if pkv is not None else 0
    except (AttributeError, TypeError):
        sess.step.fed_total = None
        return None
    sess.step.fed_total = past + int(ids.shape[-1])
    return None


def check_post(module: nn.Module, args: tuple, output: Any):
    """Forward hook: the post-head guard on the model's returned logits (once per call)."""
    if torch.compiler.is_compiling():  # (the eager prefill of the same call runs the guard)
        return None
    sess = active_session(module)
    if sess is not None and not sess.exact_depth and not sess.post_checked and sess.step.last_out is not None:
        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, tuple) and output and torch.is_tensor(output[0]):
            logits = output[0]
        guard_post_head(sess, logits)
    return None


def guard_post_head(sess: Any, model_logits: Optional[torch.Tensor]) -> None:
    """Run-time guard (once per call): the model returned ``post(head output)`` as registered in
    :mod:`hf_csv.transformers.posthead`. A model whose code does something else raises instead of decoding on."""
    out = sess.step.last_out
    if sess.post_checked or out is None or model_logits is None or sess.post is None:
        return
    sess.post_checked = True
    if not check_output(sess.post, out, model_logits):
        raise CSVError(f"hf_csv: {type(sess.model).__name__} returned logits that are not "
                       f"{sess.post.describe()!r} of its head's output; its post-head transform is not the one "
                       "hf_csv proved. Please report this; generate without csv_config meanwhile.")


def _full(sess: Any, inner: Any, hidden: torch.Tensor) -> torch.Tensor:
    """This head call uses stock's head (counted); the check then has nothing to check."""
    sess.full_calls += 1
    sess.declined_rows += hidden.numel() // hidden.shape[-1] if hidden.numel() else 0
    if sess.check_processed:
        sess.step.last = None
    sess.step.last_out = None
    return inner(hidden)


def head_step(sess: Any, inner: Any, hidden: torch.Tensor) -> torch.Tensor:
    """One head call of a certified call: dense logits [..., V] in the model dtype, exact on the plan's certified
    set S and what the plan says elsewhere (−inf, or the one-hot draw); stock's where this step cannot be certified.
    ``inner`` is stock's head module."""
    sess.head_calls += 1
    plan = sess.plan
    if isinstance(plan, Full) or hidden.numel() == 0 or (
            plan.check_processed and hidden.dim() == 3 and hidden.shape[1] > 1 and sess.step.fed_total is None):
        # (the last case: several positions whose token index is unknown, e.g. inputs_embeds; the check could
        # not find its row)
        return _full(sess, inner, hidden)
    if sess.step.spec_full_next:
        # no drafts this round (hf_csv.transformers.drafts): stock samples from this row itself, so it must be complete
        sess.step.spec_full_next = False
        return _full(sess, inner, hidden)
    keys = None
    if isinstance(plan, Sample) and sess.gumbel is not None:
        # Gumbel-coupled draws: the noise of each row is that of the token index it predicts
        keys = _token_keys(sess, hidden)
        if keys is None:
            sess.note("Gumbel-coupled draw with unknown token indices (inputs_embeds or batch > 1): full head "
                      "for those steps (the draw then happens on the full row, with the same noise)")
            return _full(sess, inner, hidden)
    lead, d = hidden.shape[:-1], hidden.shape[-1]
    H = hidden.reshape(-1, d)
    ch = sess.head
    if H.device != ch.weight.device:  # device_map: the head may live on another device than the body
        H = H.to(ch.weight.device)
    guard = call_guard(sess)
    gkey = None
    if guard is not None:
        flush_guard(sess)  # a record the check did not complete (it did not run after that head call)
        gkey = guard_key(sess, H.shape[0])
        start_full = True if _starts_full(sess, guard, gkey, H.shape[0]) else None
        if not guard.certified(gkey, rows=H.shape[0], start_full=start_full, wait=start_full):
            sess.note("the full head is measured faster than the certified one for this shape, or the shape is "
                      "new or being re-measured (the speed guard, hf_csv.core.speed)")
            t0 = time.perf_counter()
            out = _full(sess, inner, hidden)
            _guard_record(sess, guard, gkey, False, time.perf_counter() - t0, hidden)
            return out
    if sess.values_probe and not ch.subset_exact_rows(H.shape[0]):  # (may probe now: before the step is timed)
        sess.note("the values on S go to stock's sampler, and this CPU's BLAS rounds a column subset of "
                  f"{H.shape[0]} rows differently from the full call: the full head for these steps, stock's tokens "
                  "for the seed (docs/certificates.md §2.0)")
        return _full(sess, inner, hidden)
    # after the guard: a call it keeps on the full head (a large batch's prior) starts no packing beside it; a
    # certified pick that finds the screen unready is not recorded (the guard asks again)
    if not plan.ready(ch, H):  # first call on a large head: the screen is still being packed
        sess.note("the int8 screen is still being packed (first call): full head for these steps")
        if gkey is not None:
            guard.untimed(gkey)
        return _full(sess, inner, hidden)
    # the first calls' one-off work (the screen's packing, its columns' re-choice from the first rows) is no sample of
    # the certified head's speed: the guard judges it once settled (read before the call, which may finish that work)
    settled = gkey is not None and ch.settled()
    if gkey is not None and not settled:
        guard.untimed(gkey)
    t0 = time.perf_counter()
    if sess.step.spec_pending and isinstance(plan, Bounded):
        # the bounds of the previous call were never read by hf_csv's verify: something other than it consumed
        # -inf-padded logits; refuse rather than let a restricted row be sampled from
        raise CSVError("hf_csv: the certified verify did not run after a 'spec' head call; "
                       "please report this (generate without csv_config meanwhile)")
    res, out = plan.head(ch, H, sess, keys)
    if sess.config.stats:
        sess.stats.merge(res.stats)
    out = out.view(*lead, out.shape[-1])
    sess.step.last_out = out
    if plan.check_processed:
        sess.step.last = _stash(res, hidden, H, out, sess.step.fed_total)
        sess.step.spec_pending = isinstance(plan, Bounded)
    if settled:
        _guard_record(sess, guard, gkey, True, time.perf_counter() - t0, hidden)
    return out


def _stash(res: Any, hidden: torch.Tensor, H: torch.Tensor, out: torch.Tensor, fed_total: Optional[int]) -> StepStash:
    B, P = (hidden.shape[0], hidden.shape[1]) if hidden.dim() == 3 else (H.shape[0], 1)
    V, d = out.shape[-1], hidden.shape[-1]

    def bp(t: Optional[torch.Tensor], *rest: int) -> Optional[torch.Tensor]:
        return None if t is None else t.view(B, P, *rest)

    acc = res.acc_dense().view(B, P, V) if res.slack is not None and res.acc is not None else None
    return StepStash(H=hidden.reshape(B, P, d), logits=out.reshape(B, P, V), mask=res.mask.view(B, P, V),
                     fed_total=fed_total, bound=bp(res.bound), noise=bp(res.noise, V), cut=bp(res.cut),
                     shift=bp(res.shift), upper=bp(res.upper, V), slack=bp(res.slack), acc=acc)


def check_step(c: Any, sess: Any, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """The check at the CSVLogitsProcessor ``c``'s place: ``scores`` as stock's processors left them up to there,
    provably (rows it cannot prove are recomputed with stock's head and re-processed)."""
    if sess is None:
        return scores
    plan = sess.plan
    if sess.replaced is not None and (not isinstance(plan, Nucleus) or sess.step.last is None):
        # the check took the top-p warper's place, and this step's row is stock's (the call or the head call went
        # to the full head, e.g. a stopping criterion declined it after the list was built)
        return sess.replaced(input_ids, scores)
    if sess.compiled.start is not None and c.compiled_step(sess, input_ids):
        return scores
    if sess.compiled.stock and c.compiled_step(sess, input_ids, stock=True):
        return scores  # stock's head ran in the graph (the speed guard's choice): stock's row, nothing to check
    if not plan.check_processed or not plan.checks_rows:
        return scores
    last = sess.step.last
    if last is None and not isinstance(plan, ExactBeam):
        if sess.whisper.record:
            record_lp(sess, input_ids, None, None, 0, None)
        return scores  # the head call of this step used the full head: nothing to check
    p = None
    if last is not None:
        if last.logits.shape[0] != scores.shape[0]:  # pragma: no cover - invariant of generate
            raise CSVError(f"hf_csv: processor batch {scores.shape[0]} != head batch {last.logits.shape[0]}")
        p = last.position(input_ids.shape[1])
    return plan.check(c, sess, input_ids, scores, last, p)


# ------------------------------------------------------------------ the speed guard's record of a step
def _token_keys(sess: Any, hidden: torch.Tensor) -> Optional[list]:
    """The token index each row of a head call predicts (see :meth:`StepStash.position`): batch size 1 only (as
    assisted decoding), None when unknown."""
    P = hidden.shape[1] if hidden.dim() == 3 else 1
    B = hidden.shape[0] if hidden.dim() >= 2 else 1
    if B != 1 or sess.step.fed_total is None:
        return None
    return [sess.step.fed_total - (P - 1 - p) for p in range(P)]


def call_guard(sess: Any) -> Any:
    """The call's speed guard (the head entry's, where ``HF_CSV_SPEED_GUARD`` allowed it when the call first asked:
    the plan choice or the first head step), or None."""
    st = sess.step
    if not st.guard_read:
        guard = None if sess.entry is None else sess.entry.guard
        st.guard, st.guard_read = (guard if guard is not None and guard.enabled() else None), True
    return st.guard


def _starts_full(sess: Any, guard: Any, gkey: tuple, rows: int) -> bool:
    """Whether a shape the guard has not seen starts on the full head and tries the certified head only a
    ``max_probe`` in (hf_csv.core.speed.SpeedGuard.certified), rather than on the guard's prior: where its first
    certified step would run the column-subset probe (a value-reading plan whose rows were not probed: 2 to 7 full
    head calls of work on host E, docs/benchmarks.md "Value slack"), or where fewer rows of the same plan keep the
    full head by more than ``hf_csv.core.speed.CANNOT_WIN`` (a certified head's per-row work grows faster than
    stock's GEMM): tries that cannot pay."""
    if guard.has(gkey):
        return False
    if sess.values_probe and sess.head.subset_rows_verdict(rows) is None:
        return True
    # (the key: plan tag, rows bucket, dtype, threads: guard_key)
    return guard.lost(guard.smaller_keys(gkey, rows_at=-3), by=CANNOT_WIN)


def guard_key(sess: Any, rows: int) -> tuple:
    """The speed guard's key of a head call of ``rows`` rows in this session (hf_csv.core.speed)."""
    plan, bucket, threads = sess.plan, rows_bucket(rows), torch.get_num_threads()
    got = sess.step.gkey
    if got is not None and got[0] is plan and got[1] == bucket and got[2] == threads:
        return got[3]  # (a decode step's key is the previous step's)
    key = (*plan.guard_tag, bucket, sess.out_dtype, threads)
    sess.step.gkey = (plan, bucket, threads, key)
    return key


def _guard_record(sess: Any, guard: Any, gkey: tuple, certified: bool, seconds: float, hidden: torch.Tensor) -> None:
    """Record a head call's time with the speed guard, or leave it for the step's check to complete.

    When a check runs after a one-position head call (``plan.check_processed``, not assisted), the step's cost of each side
    includes what the check does for it: the certificate's check on a certified row, stock's warper on a full one
    (the Nucleus check replaces stock's top-p warper and its sort over V). The
    guard then compares whole steps, not head calls (hf_csv.core.speed)."""
    sess.step.guard_pending = (guard, gkey, certified, seconds)
    one = hidden.dim() < 3 or hidden.shape[-2] == 1
    if not (sess.check_processed and one and not (sess.assisted or sess.draft)):
        flush_guard(sess)  # no check step completes this one: record the head call alone


def flush_guard(sess: Any, extra_seconds: float = 0.0) -> None:
    """Complete the pending speed-guard record of the last head call (adding ``extra_seconds``, the check's time of
    the same step); the call's stats report the guard's choice for its key (``CSVSession.summary``)."""
    got, sess.step.guard_pending = sess.step.guard_pending, None
    if got is None:
        return
    guard, gkey, certified, seconds = got
    guard.record(gkey, certified, seconds + extra_seconds)
    sess.step.guard_last = (guard, gkey)  # the summary reads the guard's choice for it once, at the call's end
