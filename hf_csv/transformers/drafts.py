"""Assisted generation with a sub-vocabulary draft head: ``generate(assistant_model=draft, csv_config=...)``.

What it does, during one certified assisted ``generate`` call on the target model:

* **Draft head.** The stock :class:`~transformers.generation.candidate_generator.AssistedCandidateGenerator`
  is kept (nothing of transformers is copied); only its ``get_candidates`` is wrapped, on that one
  instance, so that the assistant's own ``generate`` runs with a *draft session* of the certified
  head (``hf_csv.transformers.enable._decide_draft``):

  - greedy drafts use the certified top-1: the drafted tokens are exactly the stock draft's;
  - sampled drafts draw from the exact logits on a certified top-``draft_top_k`` set (``-inf``
    elsewhere) and those same logits are returned as the candidate logits. Speculative sampling
    is lossless for *any* draft distribution q as long as q is the one the draft sampled from, so
    the output distribution stays exactly the target's.

* **Settings passed to the main generate.** ``num_assistant_tokens``, ``num_assistant_tokens_schedule``
  and ``assistant_confidence_threshold`` given to the *target's* ``generate`` are applied to the
  candidate generator for this call (stock reads them only from the assistant's generation config
  and silently ignores them here: transformers issue #40739). A ``"heuristic"`` schedule passed
  this way is per call (the assistant's saved ``generation_config`` is not modified).

* **Where it patches.** An instance-level ``_get_candidate_generator`` on the target model, active
  only in contexts with a certified session on that model (:mod:`contextvars`), reference-counted
  and removed on exit, also after an exception. Other candidate generators (prompt lookup,
  different tokenizers, early exit, ...) are left stock, with a logged reason.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

from torch import nn

from hf_csv.transformers.compat import SUPPORTED, adapts_confidence_threshold, support
from hf_csv.core.certificate import CertStats
from hf_csv.core.config import CSVConfig
from hf_csv.core.errors import CSVError
from hf_csv.transformers.heads import find_head, head_decline_reason
from hf_csv.transformers.session import CSVSession, full_head_reason, row_totals, summary_line
from hf_csv.transformers.plans import Bounded, Full
from hf_csv.transformers.processors import CSVLogitsProcessor, GumbelCoupledDraw
from hf_csv.transformers.patches import instance_override, object_override
from hf_csv.transformers.scope import certified, new_session
from hf_csv.transformers.step import active_session

__all__ = ["patched_candidate_generator", "apply_main_assistant_settings", "user_assistant_settings",
           "truncated_assistant", "quantized_assistant"]

ASSISTANT_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


def user_assistant_settings(kwargs: dict) -> dict:
    """The assistant settings the caller passed to the *main* ``generate``: as keyword arguments, or
    set (not ``None``) on a ``generation_config`` they passed. transformers fills unset fields with
    global defaults later, so this must be read from the caller's arguments."""
    out = {}
    gc = kwargs.get("generation_config")
    for key in ASSISTANT_KEYS:
        if gc is not None and getattr(gc, key, None) is not None:
            out[key] = getattr(gc, key)
        if kwargs.get(key) is not None:
            out[key] = kwargs[key]
    return out


def apply_main_assistant_settings(gen: Any, settings: dict, sess: Optional[CSVSession] = None) -> dict:
    """Apply ``settings`` (see :func:`user_assistant_settings`) to the candidate generator; returns them.

    Keys not in ``settings`` are left as the assistant's own generation config decided them. On a
    transformers version whose generator has no config of its own (:mod:`hf_csv.transformers.compat`), the schedule
    and the threshold are left alone (stock reads them from the assistant model's shared config) and
    ``sess`` notes why.
    """
    n = settings.get("num_assistant_tokens")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"num_assistant_tokens must be an int >= 1, got {n!r}")
    sched = settings.get("num_assistant_tokens_schedule")
    if sched is not None and sched not in ("heuristic", "heuristic_transient", "constant"):
        raise ValueError(f"num_assistant_tokens_schedule must be 'heuristic', 'heuristic_transient' or "
                         f"'constant', got {sched!r}")
    thr = settings.get("assistant_confidence_threshold")
    if thr is not None and (isinstance(thr, bool) or not isinstance(thr, (int, float)) or not 0 <= thr < 1):
        raise ValueError(f"assistant_confidence_threshold must be a number in [0, 1), got {thr!r}")
    applied = {}
    if n is not None:
        gen.num_assistant_tokens = n
        applied["num_assistant_tokens"] = n
    own = (support() or SUPPORTED[max(SUPPORTED)]).assistant_config_attr
    if own is None or not hasattr(gen, own):
        skipped = [k for k, v in (("num_assistant_tokens_schedule", sched), ("assistant_confidence_threshold", thr))
                   if v is not None]
        if skipped and sess is not None:
            sess.note(f"{', '.join(skipped)} passed to the main generate not applied: this transformers version's "
                      "candidate generator reads them from the assistant model's generation_config (set them there)")
        return applied
    if sched is not None:
        getattr(gen, own).num_assistant_tokens_schedule = sched
        applied["num_assistant_tokens_schedule"] = sched
    if thr is not None:
        gen.assistant_confidence_threshold = thr
        getattr(gen, own).assistant_confidence_threshold = thr
        gen.generation_config.assistant_confidence_threshold = thr  # what ConfidenceCriteria reads
        if thr and not hasattr(gen, "probs"):  # stock's ROC adaptation (with scikit-learn) keeps these
            gen.probs, gen.matches = [], []
        applied["assistant_confidence_threshold"] = thr
    return applied


def _attach_draft_head(gen: Any, config: CSVConfig, main: CSVSession) -> None:
    """Wrap ``gen.get_candidates`` (this instance only) so the assistant drafts with the certified head."""
    assistant = gen.assistant_model
    inner: Callable = gen.get_candidates
    stats = CertStats()
    last: dict = {"full": False, "approx": []}  # the latest draft call that ran its head: its plan decides the line
    # every draft head row is counted as in the target's own summary (head.row_totals)
    summary = main.reports["draft"] = {"mode": "none", "calls": 0, "head_calls": 0, "full_head_calls": 0,
                                     "verify_reruns": 0, "reasons": [], "rows": 0, "declined_rows": 0,
                                     "head_rows": 0, "certified_fraction": 0.0,
                                     "summary": summary_line(stats, 0)}

    def get_candidates(input_ids, **kwargs):
        sess = new_session(assistant, config)
        sess.draft = True
        sess.gumbel = main.gumbel
        if main.gumbel is None and isinstance(main.plan, Full):  # a declined call returns stock's tokens
            sess.assist.stock_drafts = main.reasons[0] if main.reasons else "the target's call is declined"
        if main.gumbel is None and adapts_confidence_threshold(gen):
            sess.assist.stock_rows = ("the assistant's confidence threshold adapts from the draft's full softmax "
                                      "after each round (scikit-learn is installed)")
        if main.gumbel is not None and config.draft_head == "full" and sess.force_full is None:
            sess.force_full = "CSVConfig(draft_head='full'): the draft's coupled draw runs on the full head"
        with certified(assistant, sess), _coupled_confidence(gen, sess):
            out = inner(input_ids, **kwargs)
        summary["calls"] += 1
        summary["head_calls"] += sess.head_calls
        summary["full_head_calls"] += sess.full_calls
        summary["verify_reruns"] += sess.verify_reruns
        summary["declined_rows"] += sess.declined_rows
        if sess.head_calls:  # a call that returned early (max_new_tokens == 0) decided nothing
            summary["mode"] = sess.mode
            last["full"] = isinstance(sess.plan, Full)
            last["approx"] = sess.approximations()
        summary["reasons"] += [r for r in sess.reasons if r not in summary["reasons"]]
        stats.merge(sess.stats)
        summary.update(stats.as_dict())  # every key, zeros included, as the target's summary has (every row counted)
        summary.update(row_totals(stats, summary["declined_rows"]))
        # the one line for people, built as the target's (head.summary_line)
        summary["summary"] = summary_line(stats, summary["declined_rows"],
                                          full_reason=full_head_reason(last["full"], summary["reasons"]),
                                          approx=last["approx"])
        return out

    object_override(gen, "get_candidates", get_candidates)


class DraftConfidenceStop:
    """The assistant's confidence stop in Gumbel-coupled drafting: stock's ``ConfidenceCriteria`` reads the drafted
    token's probability from the returned scores, which are one-hot there (:class:`hf_csv.transformers.processors.GumbelCoupledDraw`);
    this criterion reads the probability that draw recorded instead. It only decides how many tokens are drafted."""

    csv_safe = True  # reads no scores

    def __init__(self, threshold: float, sess: CSVSession) -> None:
        self.threshold, self.sess = float(threshold), sess

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        conf = self.sess.assist.conf_last
        stop = conf is not None and conf < self.threshold
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


@contextlib.contextmanager
def _coupled_confidence(gen: Any, sess: CSVSession):
    """During one ``get_candidates`` of Gumbel-coupled drafting: stock's confidence stop off, ours on (same
    threshold); both restored after, also on an exception."""
    gc = getattr(gen, "generation_config", None)
    thr = getattr(gc, "assistant_confidence_threshold", None)
    kw = getattr(gen, "assistant_kwargs", None)
    if sess.gumbel is None or not thr or not isinstance(kw, dict) or "stopping_criteria" in kw:
        yield
        return
    from transformers import StoppingCriteriaList

    gc.assistant_confidence_threshold = 0.0
    kw["stopping_criteria"] = StoppingCriteriaList([DraftConfidenceStop(thr, sess)])
    try:
        yield
    finally:
        gc.assistant_confidence_threshold = thr
        kw.pop("stopping_criteria", None)


def _full_head_without_drafts(gen: Any, sess: CSVSession) -> None:
    """When the generator returns no draft logits (its last call, once no new token fits: stock then samples
    from the target's row itself), the target's next head call must be complete: Bounded-plan rows are -inf off
    S and only hf_csv's verify may read them. In Gumbel-coupled sampling that row must be the keyed draw.
    Wraps this instance's ``get_candidates`` (outermost)."""
    inner: Callable = gen.get_candidates

    def get_candidates(*args: Any, **kwargs: Any):
        ids, logits = inner(*args, **kwargs)
        if logits is None and isinstance(sess.plan, Bounded):
            sess.step.spec_full_next = True
        if logits is None and sess.gumbel is not None:
            sess.assist.no_drafts = True  # stock samples from the target's row: the keyed draw makes it
        return ids, logits

    object_override(gen, "get_candidates", get_candidates)


def _take_user_settings(sess: CSVSession) -> dict:
    """The caller's assistant settings, once (they are applied to this call's candidate generator)."""
    got, sess.assist.user_settings = sess.assist.user_settings, None
    return got or {}


def _patched(model: nn.Module, orig: Callable) -> Callable:
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    def _get_candidate_generator(*args: Any, **kwargs: Any):
        gen = orig(*args, **kwargs)
        sess = active_session(model)
        if sess is None or sess.draft:
            return gen
        procs = getattr(gen, "logits_processor", None)
        if procs is not None and any(isinstance(p, (CSVLogitsProcessor, GumbelCoupledDraw)) for p in procs):
            # the generator hands the target's processors to the assistant's generate: the target's check (bound to
            # the target's session and stash) must not run on the draft's scores; a certified draft session adds
            # its own, a stock draft head needs none
            gen.logits_processor = type(procs)([p for p in procs
                                                if not isinstance(p, (CSVLogitsProcessor, GumbelCoupledDraw))])
        if type(gen) is not AssistedCandidateGenerator:
            sess.note(f"{type(gen).__name__} candidates: the draft head stays stock")
            if isinstance(sess.plan, Bounded):  # its candidates may come without the draft logits the certified verify needs
                sess.set_full(f"{type(gen).__name__} candidates: the target's certified verify needs an "
                              "AssistedCandidateGenerator's draft logits")
            return gen
        _full_head_without_drafts(gen, sess)
        applied = apply_main_assistant_settings(gen, _take_user_settings(sess), sess)
        if applied:
            sess.reports["assistant_settings"] = applied
        if sess.config.draft_head == "subvocab" or sess.gumbel is not None:
            try:
                name, head = find_head(gen.assistant_model)
            except CSVError as e:
                sess.note(f"draft head stays stock: {e}")
                return gen
            why = head_decline_reason(head, name)
            if why is not None:  # (each draft session is declined with it: new_session)
                sess.note(f"draft head stays stock: {why}")
                if sess.gumbel is None:
                    return gen  # stock's drafting; Gumbel-coupled drafts draw on the full head (a draft session)
            _attach_draft_head(gen, sess.config, sess)
        return gen

    _get_candidate_generator._hf_csv = True
    return _get_candidate_generator


def patched_candidate_generator(model: nn.Module, sess: CSVSession, config: CSVConfig):
    """Scoped, restoring instance-level patch of ``model._get_candidate_generator`` (see module doc)."""
    return instance_override(model, "_get_candidate_generator", lambda orig: _patched(model, orig))


def truncated_assistant(model: nn.Module, num_layers: int) -> nn.Module:
    """A draft built from the first ``num_layers`` decoder layers of ``model`` (shared weights copied).

    * decoder-only models: the same class with ``num_hidden_layers = num_layers``;
    * Whisper: a ``WhisperForCausalLM`` decoder (distil-whisper style) that reads the target's
      encoder outputs, which assisted generation passes to it.

    Untrained truncation: the draft agrees with the target less often than a distilled draft would;
    it exists so the API can be exercised on real weights without downloading one.
    """
    import copy

    cfg = copy.deepcopy(model.config)
    if getattr(cfg, "model_type", None) == "whisper":
        from transformers import WhisperForCausalLM

        if not 1 <= num_layers <= cfg.decoder_layers:
            raise ValueError(f"num_layers must be in [1, {cfg.decoder_layers}], got {num_layers}")
        cfg.decoder_layers = num_layers
        cfg.is_encoder_decoder = False
        draft = WhisperForCausalLM(cfg)
    else:
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        n = getattr(text, "num_hidden_layers", None)
        if n is None:
            raise ValueError(f"{type(model).__name__}: no num_hidden_layers in its config")
        if not 1 <= num_layers <= n:
            raise ValueError(f"num_layers must be in [1, {n}], got {num_layers}")
        text.num_hidden_layers = num_layers
        if hasattr(text, "layer_types") and text.layer_types is not None:
            text.layer_types = list(text.layer_types)[:num_layers]
        draft = type(model)(cfg)
    missing, _ = draft.load_state_dict(model.state_dict(), strict=False)
    missing = [k for k in missing if k not in getattr(draft, "_tied_weights_keys", {}) and "proj_out" not in k
               and "lm_head" not in k]
    if missing:
        raise CSVError(f"truncated assistant: weights not found in the target: {missing[:5]}")
    draft.tie_weights() if hasattr(draft, "tie_weights") else None
    draft.generation_config = copy.deepcopy(model.generation_config)
    return draft.to(next(model.parameters()).dtype).eval()


def quantized_assistant(model: nn.Module) -> nn.Module:
    """A same-vocabulary assistant that CPU users can build from the model itself: a copy whose Linear layers,
    except the output head, are int8 dynamically quantized (``torch.ao.quantization.quantize_dynamic``: int8
    weights, activations quantized per call, fbgemm kernels on x86).

    * decoder-only models: a copy of the whole model;
    * Whisper: a decoder-only ``WhisperForCausalLM`` (as :func:`truncated_assistant` with every layer) that
      reads the target's encoder outputs, so the encoder runs once, in full precision.

    The head stays a float ``nn.Linear`` (tied to the embedding where the model ties them) so hf_csv's draft
    head certifies it. The assistant proposes, the target decides: assisted greedy decoding stays the
    target's greedy output and assisted sampling the target's law, whatever the quantization does to the
    assistant's own predictions (it only changes the acceptance rate).

    Limits: float32 models only (dynamic quantization quantizes float32 Linear layers); CPU. Returns the
    assistant in eval mode; the model is not modified.
    """
    import copy
    import warnings

    import torch
    from torch.ao.quantization import default_dynamic_qconfig, quantize_dynamic

    if next(model.parameters()).dtype != torch.float32:
        raise ValueError("quantized_assistant needs a float32 model (load it with dtype=torch.float32); "
                         f"got {next(model.parameters()).dtype}")
    if getattr(model.config, "model_type", None) == "whisper":
        draft = truncated_assistant(model, model.config.decoder_layers)
    else:
        draft = copy.deepcopy(model)
        draft.generation_config = copy.deepcopy(model.generation_config)
    _, head = find_head(draft)
    keep = {id(m) for m in head.modules()}  # the head and, for a wrapper (a peft LoRA layer), what it wraps
    spec = {name: default_dynamic_qconfig for name, mod in draft.named_modules()
            if isinstance(mod, nn.Linear) and id(mod) not in keep}
    if not spec:
        raise CSVError(f"{type(model).__name__}: no Linear layers besides the head to quantize")
    with warnings.catch_warnings():
        # torch 2.10+ warns that its quantized tensor type is deprecated; dynamic quantization still works
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        quantize_dynamic(draft, qconfig_spec=spec, dtype=torch.qint8, inplace=True)
    return draft.eval()
