"""The head swap: a module that stands in for ``lm_head`` / ``proj_out`` during one ``generate`` call.

Guarantee: while a :class:`CSVSession` is active *in the calling context* for a model, the
model's output head returns dense logits that are exact (fp32 accumulation of the head's own
weights, cast to the model dtype) on a certified sub-vocabulary S and ``-inf`` outside it,
where S is certified for the decoding method in play (docs/processors.md). In every other
context — other threads, other calls, no session — the wrapper calls the original module, so
its output is bitwise the stock output.

* The swap is scoped: :func:`swapped_head` installs the wrapper on entry and puts the original
  module back on exit, also when ``generate`` raises. Concurrent calls on one model are
  reference-counted under a lock, and the session lives in a :mod:`contextvars` variable, so a
  stock ``generate`` running in another thread at the same time is not affected.
* :class:`CertifiedHead` objects (whose int8 screen is the expensive part to build) are cached
  per head module and per config key, so quantization happens once per model.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import nn

from hf_csv_kernels.threads import rows_bucket

from .certificate import CertifiedHead, CertStats
from .config import CSVConfig
from .errors import CSVError
from .posthead import PostHead, check_output

logger = logging.getLogger(__name__)

__all__ = ["CSVSession", "CSVHead", "swapped_head", "get_certified_head", "find_head", "active_session"]

# model id -> session, per context (thread / task). A dict so that an assistant model and the
# main model can both be certified inside one call.
_ACTIVE: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("hf_csv_active", default=None)
_LOCK = threading.RLock()
_SWAPS: dict[int, list] = {}  # id(model) -> [attr name, original module, wrapper, refcount, shared-compile flag]
_HEADS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()
# spec mode: S holds all but about this fraction of a row's mass (upper bound), so the verify's interval for
# the normalizer is a few % wide and few accept/reject decisions need the full row. Speed only: 1e-2 sent flat
# rows of Qwen-1.5B over the budget (full head), 5e-2 keeps |S| <= ~1,700 there (measured, docs/benchmarks.md §3)
SPEC_EPS = 5e-2
# beam_exact mode: S holds all but about this fraction of a row's mass (upper bounds), so the normalizer's interval is
# ~1e-3 wide. Measured on whisper-base (docs/benchmarks.md §9.9): 1e-3 restarted no call, 1e-2 and 5e-2 restarted some
# and still sent most beam rows over the budget (the screen bounds a row's tail mass too loosely to do better)
BEAM_EPS = 1e-3


@dataclass
class StepStash:
    """What the last head call saw, for :class:`~hf_csv.processors.CSVLogitsProcessor`.

    All P positions of the call are kept: assisted decoding verifies L+1 positions from one head
    call and runs the processors once per position. ``fed_total`` is the sequence length the model
    had consumed after this call (cache + new tokens); position p of the call predicts the token
    at index ``fed_total - (P - 1 - p)``, which is how the processor finds its row.
    """

    H: torch.Tensor  # [B, P, d] hidden states (views, not copies), in the model dtype
    logits: torch.Tensor  # [B, P, V] the dense certified logits returned (model dtype, before the post map)
    mask: Optional[torch.Tensor]  # [B, P, V] bool: certified S (all True on fallback rows)
    fed_total: Optional[int] = None
    # [B, P] every token outside S has a stock logit (model dtype, before the post map) <= bound
    bound: Optional[torch.Tensor] = None
    noise: Optional[torch.Tensor] = None  # [B, P, V] sample mode, draw after the processors: Gumbel noise
    cut: Optional[torch.Tensor] = None  # [B, P] ... and the cut every uncomputed token stays below
    shift: Optional[torch.Tensor] = None  # [B, P] ... in units shifted by this (CertResult.shift)
    upper: Optional[torch.Tensor] = None  # [B, P, V] spec mode: bound on stock's fp32 logit of every token
    # [B, P, V] stock's head on all B·P rows, computed once by the first re-run that needs it: assisted decoding
    # checks up to P positions of one call, and each re-run used to repeat the whole GEMM (~0.2 s on Qwen-1.5B)
    stock_full: Optional[torch.Tensor] = None
    # [B, P] fp32: each value of the row comes from an accumulator within slack of stock's (0: stock's own row)
    slack: Optional[torch.Tensor] = None
    acc: Optional[torch.Tensor] = None  # [B, P, V] fp32: our accumulators on S (hf_csv.certificate.value_interval)

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
class WhisperRecord:
    """Whisper's temperature-fallback decision in one call (hf_csv.whisper, docs/certificates.md §3.6)."""

    scores_internal: bool = False  # the scores generate keeps feed only the avg-logprob decision, which hf_csv certifies
    threshold: Optional[float] = None  # the logprob_threshold certified
    record: bool = False  # the check records each greedy step's normalizer bounds ...
    steps: list = field(default_factory=list)  # ... here (hf_csv.processors._record_lp)
    index: Optional[int] = None  # the batch row Whisper's _need_fallback decides


@dataclass
class BeamRecord:
    """Token-identical beam search in one call (hf_csv.beam, docs/certificates.md §3.10)."""

    step: Any = None  # this step's processed log-prob intervals (hf_csv.processors.BeamStep)
    state: Any = None  # the intervals of stock's beam bookkeeping (hf_csv.beam)
    restart: Optional[str] = None  # why the call re-ran its beam search on the full head


@dataclass
class AssistRecord:
    """Assisted decoding in one call (hf_csv.candidate, hf_csv.processors.GumbelCoupledDraw)."""

    conf: dict = field(default_factory=dict)  # token index -> the certified draw's probability (a draft, sample mode)
    conf_last: Optional[float] = None  # the last drafted token's probability (the coupled confidence stop reads it)
    no_drafts: bool = False  # target: a round without drafts, stock samples from the row (the keyed draw makes it)
    user_settings: Optional[dict] = None  # the caller's assistant settings, applied to the candidate generator


@dataclass
class CompiledRecord:
    """A compiled static-cache decode in one call (hf_csv.scope, hf_csv.policy.decide_compiled)."""

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
    mode: str = "full"  # full | topk | threshold | beam | beam_exact | sample | epsilon | spec | nucleus (policy.decide_mode)
    k: int = 1
    # topk mode: the K the head certifies, when larger than ``k`` (the warper's k, which the check uses). Lowering
    # processors before the top-k warper (repetition penalty) can push stock's k-th score below the bound on the
    # uncomputed tokens; a wider certified set keeps that rare (speed only: the check decides correctness)
    k_head: int = 0
    temperature: float = 1.0
    warps: list = field(default_factory=list)  # sample mode: ("temperature", T) / ("top_k", k) in list order
    verify: bool = False  # a CSVLogitsProcessor must check the certificate after other processors
    reasons: list = field(default_factory=list)
    stats: CertStats = field(default_factory=CertStats)
    head_calls: int = 0
    full_calls: int = 0
    declined_rows: int = 0  # rows computed by the full head because the call was declined (see reasons)
    verify_reruns: int = 0
    post_checked: bool = False  # the run-time guard of the post-head map ran for this call
    last_out: Optional[torch.Tensor] = None  # what the head returned last (for the guard)
    force_full: Optional[str] = None  # a reason decided before generate started
    processors: Any = None  # the LogitsProcessorList generate built (when known)
    check_after: Any = None  # the processor the CSVLogitsProcessor check follows (None: the end of the list)
    check_before: Any = None  # ... or precedes (threshold mode: the min-p warper)
    min_p: float = 0.0  # threshold mode: the min-p warper's min_p
    delta: float = 0.0  # threshold mode: the head computes every token within delta (raw logits) of the max
    delta_rel: float = 0.0  # ... plus delta_rel·|max| (lowering processors may lower the top token)
    draw_after: bool = False  # sample mode: the Gumbel draw happens in the CSVLogitsProcessor, after lowering ones
    ts_proc: Any = None  # Whisper timestamps: the WhisperTimeStampLogitsProcessor the check runs right before
    always: int = 0  # topk mode: the last `always` tokens are computed exactly on every row (the timestamp block)
    top_p_proc: Any = None  # nucleus mode: the TopPLogitsWarper whose place the CSVLogitsProcessor takes
    check_replaces: Any = None  # the processor the CSVLogitsProcessor replaces in the list (nucleus mode)
    nucleus_eps: float = 0.05  # nucleus mode: the head's S leaves about this fraction of a row's mass outside
    last: Optional[StepStash] = None
    assisted: bool = False  # generate(assistant_model=...) or prompt lookup on this (target) model
    draft: bool = False  # this is the assistant model's session inside a candidate generator
    spec_ok: bool = False  # assisted by a model with hf_csv's exact verify: the target may use mode "spec"
    spec_pending: bool = False  # spec mode: a head call's bounds wait for the verify (hf_csv.verify)
    spec_full_next: bool = False  # spec mode: the next head call is read by stock's sampler itself (no drafts)
    fill_tail: bool = False  # greedy draft: give uncomputed tokens their estimated mass (see _fill_tail)
    fill_est: bool = False  # sampled draft without a top-k: uncomputed tokens get the screen's estimate (see forward)
    fed_total: Optional[int] = None  # tokens consumed after the current forward (set by a pre-hook)
    # the speed guard's record of the last head call, completed with the CSVLogitsProcessor's time of the same
    # step (hf_csv.speed): (guard, key, certified, seconds in the head) or None
    guard_pending: Optional[tuple] = None
    whisper: WhisperRecord = field(default_factory=lambda: WhisperRecord())
    beam: BeamRecord = field(default_factory=lambda: BeamRecord())
    assist: AssistRecord = field(default_factory=lambda: AssistRecord())
    compiled: CompiledRecord = field(default_factory=lambda: CompiledRecord())
    caller_cache: bool = False  # the caller passed its own past_key_values
    own_draw: bool = False  # sampling through the head's own exact draw where stock's values on S cannot be had
    check_prefix: Any = None  # the processors before the CSVLogitsProcessor, sorted once (hf_csv.processors._Prefix)
    exact_depth: int = 0  # > 0: a processor's own forward (Whisper's no-speech detection) runs on the full head
    # Gumbel-coupled assisted sampling (CSVConfig(speculative="gumbel")): the call's noise per token index
    # (hf_csv_kernels.verify.KeyedGumbel), shared by the target's session and its draft sessions
    gumbel: Any = None
    reports: dict = field(default_factory=dict)  # the summary's named reports (e.g. the draft head's stats), public

    def note(self, reason: str, what: str = "") -> None:
        """Record a reason once per call and log it (transformers logging)."""
        if reason not in self.reasons:
            self.reasons.append(reason)
            _tlog().info("hf_csv: %s%s", what, reason)

    def set_full(self, reason: str) -> None:
        """Use the full head for the rest of this decoding call, and say why."""
        self.mode = "full"
        self.verify = False
        self.whisper.record = False  # the kept rows are stock's: Whisper's own avg-logprob applies (hf_csv.whisper)
        self.note(reason, "full LM head for this call: ")

    def summary(self) -> dict:
        """The call's statistics. ``certified_fraction`` is certified rows over every head row of the call (the
        certified head's and those the speed guard sent to the full head); no field is None or NaN. ``summary``
        is one line for people."""
        d = self.stats.as_dict()
        total = self.stats.rows + self.declined_rows
        d.update(mode=self.mode, reasons=list(self.reasons), head_calls=self.head_calls,
                 full_head_calls=self.full_calls, declined_rows=self.declined_rows,
                 verify_reruns=self.verify_reruns, head_rows=total,
                 certified_fraction=self.stats.certified / total if total else 0.0)
        d.update(self.reports)
        full = total - self.stats.certified
        if self.mode == "full":
            d["summary"] = f"full head ({self.reasons[0] if self.reasons else 'declined'})"
            return d
        why = []
        if self.declined_rows:
            why.append(f"speed guard {self.declined_rows}")
        if self.stats.fallback:
            why.append(f"certificate {self.stats.fallback}")
        d["summary"] = (f"certified {self.stats.certified}/{total} rows" + (f" (full head: {full}, " + ", ".join(why) + ")"
                        if full and why else (f" (full head: {full})" if full else "")) +
                        (f", mean |S| {100 * self.stats.mean_subvocab_fraction:.3g} % of V" if self.stats.certified else ""))
        return d


def _tlog():
    from transformers.utils import logging as tlogging

    return tlogging.get_logger("hf_csv")


def active_session(model: nn.Module) -> Optional[CSVSession]:
    act = _ACTIVE.get()
    return None if act is None else act.get(id(model))


def find_head(model: nn.Module) -> tuple[str, nn.Linear]:
    """The attribute name and module of the model's output head (``lm_head`` or ``proj_out``)."""
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(out, CSVHead):
        out = out.inner
    for name in ("lm_head", "proj_out"):
        mod = model._modules.get(name)
        if isinstance(mod, CSVHead):
            mod = mod.inner
        if mod is not None and (out is None or mod is out):
            if not isinstance(mod, nn.Linear):
                raise CSVError(f"{type(model).__name__}.{name} is a {type(mod).__name__}, not nn.Linear; "
                               "hf_csv cannot certify it")
            return name, mod
    raise CSVError(f"{type(model).__name__} has no lm_head/proj_out output head that hf_csv supports")


def _weight_key(head: nn.Linear) -> tuple:
    """What must be unchanged for a cached screen to stay valid: storage, shape, dtype and the tensors'
    version counters (bumped by every in-place write: ``optimizer.step()``, ``load_state_dict``,
    ``copy_``). Writes through ``.data`` bypass version counters: call :func:`hf_csv.refresh` then."""
    key = []
    for w in (head.weight, head.bias):
        if w is None:
            key.append(None)
            continue
        local = w.to_local() if hasattr(w, "to_local") else w  # DTensor (tensor parallel): its local shard
        key.append((local.data_ptr(), tuple(w.shape), w.dtype, local._version))
    return tuple(key)


def forget_heads(head: nn.Module) -> None:
    """Drop the cached certified heads (screens) of ``head``: the next call rebuilds them."""
    with _LOCK:
        _HEADS.pop(head, None)


def get_certified_head(head: nn.Linear, config: CSVConfig):
    """The cached certified head for this head module and config (built once): a
    :class:`CertifiedHead`, or a :class:`hf_csv.distributed.VocabParallelHead` when the head is
    sharded by vocabulary (tensor parallel) or ``config.vocab_parallel`` is set."""
    key = config.head_key()
    with _LOCK:
        per = _HEADS.setdefault(head, {})
        ch = per.get(key)
        # the cache is keyed on the module; a changed or updated weight tensor invalidates it
        if ch is None or getattr(ch, "_src_key", None) != _weight_key(head):
            art, index = _artifact_of(config)
            from .distributed import local_shard_of

            if (art or index) is not None and local_shard_of(head.weight) is None:
                # any artifact given must be the one built for this head, whatever the provider
                (art or index).check_head(head.weight.detach(), None if head.bias is None else head.bias.detach())
            try:
                if config.vocab_parallel is not None or local_shard_of(head.weight) is not None:
                    ch = _vocab_parallel_head(head, config, index)
                else:
                    kw = {}
                    if config.provider == "screen":
                        # a large head is packed in the background; its first steps use the full head meanwhile
                        kw = {"num_outliers": config.num_outliers, "quant": config.screen_quant, "background": True}
                        if art is not None and art.screen is not None and art.screen.quant == config.screen_quant:
                            # skip the quantization: the stored codes, error terms recomputed from this head
                            # (its columns were calibrated on a dummy input: re-chosen from the first 8 real rows)
                            kw.update(rows=art.screen.rows_for(head.weight), outlier_cols=art.screen.outlier_cols,
                                      recalibrate=True)
                    elif index is None:
                        raise CSVError("provider='cluster' needs a cluster index; this artifact has none "
                                       "(hf-csv build --index)")
                    ch = CertifiedHead(head.weight, head.bias, provider=config.provider, index=index,
                                       budget=config.budget, **kw)
            except BaseException:
                if art is not None:  # a damaged file is reported as such, not as what it broke
                    art.wait_verified()
                raise
            if art is not None:
                art.wait_verified()  # its sha256 ran beside the recompute (CSVArtifact.from_pretrained)
            ch._src_key = _weight_key(head)
            from .speed import MIN_WEIGHTS, SpeedGuard

            if isinstance(ch, CertifiedHead) and head.weight.numel() >= MIN_WEIGHTS and SpeedGuard.enabled():
                ch._speed_guard = SpeedGuard()  # never slower than stock (hf_csv.speed)
            per[key] = ch
    return ch


def _artifact_of(config: CSVConfig) -> tuple:
    """(artifact or None, cluster index or None) from ``config.index``: a directory or Hub repo id, a
    :class:`hf_csv.artifact.CSVArtifact`, or a :class:`hf_csv.index.VocabIndex`."""
    index = config.index
    if index is None:
        return None, None
    if not hasattr(index, "check_head"):
        from .artifact import CSVArtifact

        index = CSVArtifact.from_pretrained(index, revision=config.revision, defer_verify=True)
    if hasattr(index, "screen"):  # a CSVArtifact
        return index, index.index
    return None, index


def _vocab_parallel_head(head: nn.Linear, config: CSVConfig, index: Any):
    import torch.distributed as dist

    from .distributed import VocabParallelHead, local_shard_of, shard_tokens

    if not (dist.is_available() and dist.is_initialized()):
        raise CSVError("CSVConfig(vocab_parallel=...) needs an initialized torch.distributed process group "
                       "(torchrun, or torch.distributed.init_process_group)")
    V = head.weight.shape[0]
    sh = local_shard_of(head.weight)
    bias = head.bias
    if sh is not None:  # transformers' tensor-parallel plan sharded lm_head by rows: use it as is
        rows, start = sh
        ids = torch.arange(start, start + rows.shape[0], device=rows.device)
        if bias is not None:
            bias = bias.to_local() if hasattr(bias, "to_local") else bias[ids]
    else:
        if isinstance(index, (str, bytes)) or hasattr(index, "__fspath__"):
            from .artifact import CSVArtifact

            index = CSVArtifact.from_pretrained(index).index
        ids = shard_tokens(V, dist.get_world_size(), config.vocab_parallel, index)[dist.get_rank()]
        ids = ids.to(head.weight.device)
        contiguous = ids.numel() == 0 or int(ids[-1] - ids[0]) + 1 == ids.numel()
        rows = head.weight.detach()[int(ids[0]):int(ids[-1]) + 1] if contiguous and ids.numel() else \
            head.weight.detach().index_select(0, ids)
        if bias is not None:
            bias = bias.detach()[ids]
    if config.provider != "screen":
        _tlog().info("hf_csv: the vocabulary-parallel head uses the screen provider on each shard")
    return VocabParallelHead(rows, ids, V, bias_rows=bias, budget=config.budget, num_outliers=config.num_outliers)


class CSVHead(nn.Module):
    """Stands in for the output head; certified only for the session of the calling context."""

    def __init__(self, inner: nn.Linear, model: nn.Module):
        super().__init__()
        self.inner = inner
        self._model_id = id(model)
        # the head traced into a compiled forward (set by hf_csv.scope's _valid_auto_compile_criteria override through
        # set_static_plan): a StaticTopK, or None for stock's
        self.static_plan = None

    # keep attribute access that code may do on the head working (weight/bias/in_features...)
    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return self.inner.bias

    def _full(self, sess: CSVSession, hidden: torch.Tensor) -> torch.Tensor:
        """This head call uses the full head (counted); the processor's check then has nothing to check."""
        sess.full_calls += 1
        sess.declined_rows += hidden.numel() // hidden.shape[-1] if hidden.numel() else 0
        if sess.verify:
            sess.last = None
        sess.last_out = None
        return self.inner(hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # traced into a compiled forward: no per-call Python state can be read here (a graph replays
            # without it); the plan set for this model's compiled decode, or stock's head
            plan = self.static_plan
            return self.inner(hidden) if plan is None else plan(hidden)
        act = _ACTIVE.get()
        sess = None if act is None else act.get(self._model_id)
        if sess is None:
            return self.inner(hidden)
        if sess.exact_depth:  # a processor's own model call (WhisperNoSpeechDetection): stock's head, state untouched
            sess.reports["processor_forwards"] = sess.reports.get("processor_forwards", 0) + 1
            return self.inner(hidden)
        sess.head_calls += 1
        if sess.mode == "full" or hidden.numel() == 0 or (
                sess.verify and hidden.dim() == 3 and hidden.shape[1] > 1 and sess.fed_total is None):
            # (the last case: several positions whose token index is unknown, e.g. inputs_embeds;
            # the processor could not find its row, so this call uses the full head)
            return self._full(sess, hidden)
        if sess.spec_full_next:
            # no drafts this round (hf_csv.candidate): stock samples from this row itself, so it must be complete
            sess.spec_full_next = False
            return self._full(sess, hidden)
        keys = None
        if sess.mode == "sample" and sess.gumbel is not None:
            # Gumbel-coupled draws: the noise of each row is that of the token index it predicts
            keys = _token_keys(sess, hidden)
            if keys is None:
                sess.note("Gumbel-coupled draw with unknown token indices (inputs_embeds or batch > 1): full head "
                          "for those steps (the draw then happens on the full row, with the same noise)")
                return self._full(sess, hidden)
        lead, d = hidden.shape[:-1], hidden.shape[-1]
        H = hidden.reshape(-1, d)
        ch = sess.head
        if H.device != ch.weight.device:  # device_map: the head may live on another device than the body
            H = H.to(ch.weight.device)
        ready = getattr(ch, "ready", None)  # (the vocabulary-parallel head builds synchronously on every rank)
        if ready is not None and not ready(H):  # first call on a large head: the screen is still being packed
            sess.note("the int8 screen is still being packed (first call): full head for these steps")
            return self._full(sess, hidden)
        guard = getattr(ch, "_speed_guard", None)
        gkey = None
        if guard is not None and guard.enabled():
            flush_guard(sess)  # a record the processor did not complete (it did not run after that head call)
            gkey = guard_key(sess, H.shape[0])
            if not guard.certified(gkey, rows=H.shape[0]):
                sess.note("the full head is measured faster than the certified one for this shape, or is being "
                          "re-measured (a periodic probe of the speed guard, hf_csv.speed)")
                t0 = time.perf_counter()
                out = self._full(sess, hidden)
                _guard_record(sess, guard, gkey, False, time.perf_counter() - t0, hidden)
                return out
            t0 = time.perf_counter()
        mode = sess.mode
        if mode == "beam_exact":
            # S holds all but about BEAM_EPS of each row's mass (upper bounds): the normalizer's interval is then
            # ~BEAM_EPS wide (hf_csv.processors.beam_logprob_box)
            res = ch.spec(H, BEAM_EPS, out_dtype=sess.out_dtype)
            out = res.logits
        elif mode == "topk":
            kw = {"always": sess.always} if sess.always else {}
            if sess.whisper.record:
                kw["with_upper"] = True
            if sess.k_head > sess.k:  # a wider set where it fits the budget, else the warper's k (policy._lowered_k)
                kw.update(k_min=sess.k)
            res = ch.topk(H, max(sess.k, sess.k_head), out_dtype=sess.out_dtype, **kw)
            out = res.logits
            if sess.fill_tail and res.est is not None:
                out = _fill_tail(out, res.est, res.mask)
            elif sess.fill_est and res.est is not None:
                # a sampled draft may sample from any law it returns (the verify reads the same scores as q); the
                # screen's estimates outside S keep q's tail, which a -inf tail drops: without a top-k that tail
                # holds target mass the verify could otherwise never accept, and the confidence stop reads it
                out = torch.where(res.mask, out, res.est.to(out.dtype))
        elif mode == "threshold":
            res = ch.threshold(H, sess.delta, out_dtype=sess.out_dtype, rel=sess.delta_rel)
            out = res.logits
        elif mode in ("beam", "epsilon"):
            eps = sess.config.beam_epsilon if mode == "beam" else sess.config.epsilon
            res = ch.epsilon(H, eps, temperature=sess.temperature, out_dtype=sess.out_dtype)
            out = res.logits
        elif mode == "nucleus":
            res = ch.spec(H, sess.nucleus_eps, temperature=sess.temperature, out_dtype=sess.out_dtype)
            out = res.logits
        elif mode == "spec":
            if sess.spec_pending:
                # the bounds of the previous call were never read by hf_csv's verify: something other than
                # it consumed -inf-padded logits; refuse rather than let a restricted row be sampled from
                raise CSVError("hf_csv: the certified verify did not run after a 'spec' head call; "
                               "please report this (generate without csv_config meanwhile)")
            res = ch.spec(H, SPEC_EPS, temperature=sess.temperature, out_dtype=sess.out_dtype)
            out = res.logits
        elif mode == "sample":
            post = None if sess.post is None or sess.post.identity else sess.post.apply
            # (the drawn token's probability only for a draft: its confidence stop reads it)
            kw = {} if keys is None else {"noise": sess.gumbel.rows(keys, ch.vocab_size, H.device),
                                          "with_conf": sess.draft}
            res = ch.sample(H, out_dtype=sess.out_dtype, post=post, warps=sess.warps, **kw)
            if keys is not None and res.conf is not None and sess.draft:
                # the assistant's confidence stop reads the drawn token's probability (hf_csv.candidate)
                sess.assist.conf = dict(zip(keys, res.conf.tolist()))
            # draw_after: exact logits on S; the CSVLogitsProcessor draws after the lowering processors
            out = res.logits if sess.draw_after else _one_hot_logits(res.logits, res.tokens, sess.out_dtype)
        else:  # pragma: no cover - decide_mode only sets the modes above
            raise CSVError(f"unknown hf_csv mode {mode!r}")
        if sess.config.stats:
            sess.stats.merge(res.stats)
        out = out.view(*lead, out.shape[-1])
        sess.last_out = out
        if sess.verify:
            B, P = (hidden.shape[0], hidden.shape[1]) if hidden.dim() == 3 else (H.shape[0], 1)
            V = out.shape[-1]
            bound = None if res.bound is None else res.bound.view(B, P)
            noise = None if res.noise is None else res.noise.view(B, P, V)
            cut = None if res.cut is None else res.cut.view(B, P)
            shift = None if res.shift is None else res.shift.view(B, P)
            upper = None if res.upper is None else res.upper.view(B, P, V)
            slack = None if res.slack is None else res.slack.view(B, P)
            acc = res.acc_dense().view(B, P, V) if res.slack is not None and res.acc is not None else None
            sess.last = StepStash(H=hidden.reshape(B, P, d), logits=out.reshape(B, P, V),
                                  mask=res.mask.view(B, P, V), fed_total=sess.fed_total, bound=bound,
                                  noise=noise, cut=cut, shift=shift, upper=upper, slack=slack, acc=acc)
            sess.spec_pending = mode == "spec"
        if gkey is not None:
            _guard_record(sess, guard, gkey, True, time.perf_counter() - t0, hidden)
        return out


def _token_keys(sess: CSVSession, hidden: torch.Tensor) -> Optional[list]:
    """The token index each row of a head call predicts (see :meth:`StepStash.position`): batch size 1 only (as
    assisted decoding), None when unknown."""
    P = hidden.shape[1] if hidden.dim() == 3 else 1
    B = hidden.shape[0] if hidden.dim() >= 2 else 1
    if B != 1 or sess.fed_total is None:
        return None
    return [sess.fed_total - (P - 1 - p) for p in range(P)]


def guard_key(sess: CSVSession, rows: int) -> tuple:
    """The speed guard's key of a head call of ``rows`` rows in this session (hf_csv.speed)."""
    return (sess.mode, sess.always, rows_bucket(rows), sess.out_dtype, torch.get_num_threads())


def _guard_record(sess: CSVSession, guard: Any, gkey: tuple, certified: bool, seconds: float,
                  hidden: torch.Tensor) -> None:
    """Record a head call's time with the speed guard, or leave it for the step's CSVLogitsProcessor to complete.

    When a CSVLogitsProcessor runs after a one-position head call (``sess.verify``, not assisted), the step's cost
    of each side includes what the processor does for it: the certificate's check on a certified row, stock's
    warper on a full one (nucleus mode replaces stock's top-p warper, whose sort over V costs about a third of
    SmolLM2's head). The guard then compares whole steps, not head calls (hf_csv.speed)."""
    sess.guard_pending = (guard, gkey, certified, seconds)
    one = hidden.dim() < 3 or hidden.shape[-2] == 1
    if not (sess.verify and one and not (sess.assisted or sess.draft)):
        flush_guard(sess)  # no processor step completes this one: record the head call alone


def flush_guard(sess: CSVSession, extra_seconds: float = 0.0) -> None:
    """Complete the pending speed-guard record of the last head call (adding ``extra_seconds``, the processor's
    time of the same step) and report the guard's current choice in the call's stats."""
    got, sess.guard_pending = sess.guard_pending, None
    if got is None:
        return
    guard, gkey, certified, seconds = got
    guard.record(gkey, certified, seconds + extra_seconds)
    summ = guard.summary(gkey)
    if summ is not None:
        sess.reports["speed_guard"] = summ


def guard_post_head(sess: CSVSession, model_logits: Optional[torch.Tensor]) -> None:
    """Run-time guard (once per call): the model returned ``post(head output)`` as registered in
    :mod:`hf_csv.posthead`. A model whose code does something else raises instead of decoding on."""
    out = sess.last_out
    if sess.post_checked or out is None or model_logits is None or sess.post is None:
        return
    sess.post_checked = True
    if not check_output(sess.post, out, model_logits):
        raise CSVError(f"hf_csv: {type(sess.model).__name__} returned logits that are not "
                       f"{sess.post.describe()!r} of its head's output; its post-head transform is not the one "
                       "hf_csv proved. Please report this; generate without csv_config meanwhile.")


def _fill_tail(out: torch.Tensor, est: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
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


def _one_hot_logits(logits: torch.Tensor, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
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


@contextlib.contextmanager
def swapped_head(model: nn.Module, session: CSVSession) -> Iterator[CSVSession]:
    """Activate ``session`` for ``model`` in this context, with the head wrapper installed.

    The original head module is put back when the last concurrent session on the model exits,
    including on exceptions; the context variable is reset in every case.
    """
    name, inner = find_head(model)
    key = id(model)
    with _LOCK:
        entry = _SWAPS.get(key)
        if entry is None:
            # one wrapper per model, reused by later calls: a compiled forward guards on the head module's
            # identity, so a fresh wrapper per call would recompile every call
            wrapper = model.__dict__.get("_hf_csv_head")
            if not (isinstance(wrapper, CSVHead) and wrapper.inner is inner and wrapper._model_id == key):
                wrapper = CSVHead(inner, model)
                model.__dict__["_hf_csv_head"] = wrapper  # (not a registered submodule: state_dict is unchanged)
            wrapper.static_plan = None
            entry = [name, inner, wrapper, 0, False]
            _SWAPS[key] = entry
            setattr(model, name, wrapper)
        entry[3] += 1
    act = dict(_ACTIVE.get() or {})
    act[key] = session
    token = _ACTIVE.set(act)
    try:
        yield session
    finally:
        _ACTIVE.reset(token)
        with _LOCK:
            entry[3] -= 1
            if entry[3] == 0:
                entry[2].static_plan = None
                setattr(model, entry[0], entry[1])
                del _SWAPS[key]


def set_static_plan(model: nn.Module, plan: Any, own: bool) -> bool:
    """Make ``plan`` (a :class:`hf_csv.static.StaticTopK`, or None: stock's head) what a compiled forward of
    ``model`` traces and runs as its head. A graph reads no per-call state, so a plan is installed only while
    the calling session (``own``) is the only generate call active on the model; any other compiled caller
    (a second session, or a stock call while the head is swapped) sets stock's head for every caller until the
    last session exits. Returns whether ``plan`` was installed."""
    with _LOCK:
        entry = _SWAPS.get(id(model))
        if entry is None:
            return False
        if not own or entry[3] > 1:
            entry[4] = True
        ok = plan is not None and not entry[4]
        entry[2].static_plan = plan if ok else None
        return ok


def model_out_dtype(model: nn.Module, head: nn.Linear) -> torch.dtype:
    return head.weight.dtype if head.weight.is_floating_point() else torch.float32
