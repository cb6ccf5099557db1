"""``model.generate(..., csv_config=CSVConfig(...))``: the certified head inside transformers generation.

Use::

    import hf_csv
    model = hf_csv.enable(model)                      # once; returns the same model
    out = model.generate(**inputs, csv_config=hf_csv.CSVConfig())

``enable`` sets an instance-level ``generate`` that pops ``csv_config`` before the class's
``generate`` (whose ``_validate_model_kwargs`` rejects unknown kwargs, DESIGN.md §5). Without
``csv_config`` it calls the class's ``generate`` directly: bitwise stock, modules untouched.
``install()`` does the same for every model by patching ``GenerationMixin.generate`` (and
Whisper's override); ``uninstall()`` restores them.

During a certified call two narrow, scoped, restoring patches are active for that model only
(docs/processors.md): the output head is swapped for :class:`hf_csv.head.CSVHead`, and an
instance-level ``_get_logits_processor`` inspects the processors generate built, picks the
certificate (:func:`decide_mode`) and appends a :class:`CSVLogitsProcessor` when needed.
"""
from __future__ import annotations

import functools
import contextlib
import threading
from typing import Any, Callable, Optional

import torch
from torch import nn

from ._compat import check_transformers_version
from .config import CSVConfig
from .head import (CSVSession, active_session, find_head, get_certified_head, model_out_dtype,
                   model_softcap, swapped_head)
from .processors import CSVLogitsProcessor

check_transformers_version()

__all__ = ["enable", "disable", "install", "uninstall", "decide_mode", "classify_processor", "csv_generate"]

# How each stock processor relates to the certificate (docs/processors.md has the table).
#   order: the same increasing map on every token (commutes with any certificate)
#   topk:  keeps the K largest (exact with a top-K certificate, K known)
#   lower: lowers (or sets to constants) particular tokens; commutes with top-k after a check
#   norm:  depends on the whole distribution (top-p, min-p, typical, ...): ε-certificate or full
#   full:  may raise uncomputed tokens or reads all logits: full head
_KIND = {
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
    "WhisperTimeStampLogitsProcessor": "full",
    "WhisperNoSpeechDetection": "full",
    "BarkEosPrioritizerLogitsProcessor": "full",
    "AlternatingCodebooksLogitsProcessor": "full",
}


def classify_processor(p: Any) -> str:
    """``order`` | ``topk`` | ``lower`` | ``norm`` | ``full`` | ``csv`` for one logits processor.

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
    return _KIND.get(name, "full")


def decide_mode(session: CSVSession, generation_config: Any, processors: list) -> CSVSession:
    """Pick the certificate for this decoding call from the generation config and processors.

    Sets ``session.mode`` (``topk`` / ``beam`` / ``sample`` / ``epsilon`` / ``full``), ``k``,
    ``temperature``, ``top_k`` and ``verify``; every fallback to the full head logs its reason.
    """
    gc = generation_config
    cfg = session.config
    session.reasons.clear()
    session.verify = False
    if session.force_full:
        session.set_full(session.force_full)
        return session
    if getattr(gc, "return_dict_in_generate", False) and getattr(gc, "output_logits", False):
        session.set_full("output_logits=True: the raw logits must be the full head's")
        return session
    if getattr(gc, "watermarking_config", None) is not None:
        session.set_full("watermarking reads every logit")
        return session
    gs = getattr(gc, "guidance_scale", None)
    if gs is not None and gs != 1:
        session.set_full("classifier-free guidance mixes two heads' logits")
        return session
    kinds = {}
    for p in processors:
        kinds.setdefault(classify_processor(p), []).append(type(p).__name__)
    if "full" in kinds:
        session.set_full(f"processors that can raise uncomputed scores or read all logits: {kinds['full']}")
        return session
    num_beams = int(getattr(gc, "num_beams", 1) or 1)
    do_sample = bool(getattr(gc, "do_sample", False))
    temperature, top_k = 1.0, None
    for p in processors:
        if type(p).__name__ == "TemperatureLogitsWarper":
            temperature *= float(p.temperature)
        elif type(p).__name__ == "TopKLogitsWarper":
            top_k = int(p.top_k) if top_k is None else min(top_k, int(p.top_k))
    session.temperature, session.top_k = temperature, top_k
    lower = "lower" in kinds
    norm = "norm" in kinds
    if session.softcap and (do_sample or num_beams > 1):
        session.set_full("final_logit_softcapping maps -inf to -cap; only greedy is certified")
        return session
    if (session.assisted or session.draft) and getattr(gc, "assistant_ensemble_weight", None) is not None:
        session.set_full("assistant_ensemble_weight mixes the target's and the draft's softmax over the full "
                         "vocabulary")
        return session
    if session.draft:
        return _decide_draft(session, gc, kinds, do_sample, top_k)
    if session.assisted and do_sample:
        session.set_full("assisted sampling (speculative sampling) needs the full target distribution")
        return session
    if not do_sample and num_beams == 1:
        # greedy: argmax of processed scores; normalizers keep order, lower-only ones need the check
        session.mode, session.k, session.verify = "topk", 1, lower
        return session
    if not do_sample and num_beams > 1:
        if norm and kinds["norm"] != ["LogitNormalization"]:
            session.set_full(f"beam search with normalizing processors {kinds['norm']}")
            return session
        # beam search takes a log_softmax over V: a top-k certificate leaves the normalizer (and so
        # every beam score) wrong. Only the ε-certificate bounds it, and with the int8 screen's
        # bounds it opens most of V (measured: docs/processors.md), so auto uses the full head.
        if cfg.mode == "auto":
            session.set_full("beam search's log_softmax needs the normalizer over all of V; "
                             "CSVConfig(mode='epsilon') tries the beam_epsilon certificate")
            return session
        # ε-certificate; the top-2·num_beams of every row is then checked by CSVLogitsProcessor
        session.mode, session.k, session.verify = "beam", 2 * num_beams, True
        return session
    if num_beams > 1:
        session.set_full("beam sampling is not certified")
        return session
    # multinomial sampling
    if lower:
        session.set_full(f"sampling with token-specific processors {kinds['lower']} (they must act "
                         "before the draw)")
        return session
    if norm:
        if cfg.mode == "epsilon":
            session.mode = "epsilon"
            return session
        session.set_full(f"normalizing warpers {kinds['norm']} need the whole distribution "
                         "(CSVConfig(mode='epsilon') allows TV <= epsilon)")
        return session
    if cfg.mode == "topk" and top_k is not None:
        # exact top-K values, stock sampler samples from them: exact top-K sampling
        session.mode, session.k = "topk", top_k
        return session
    session.mode = "sample"
    return session


def _decide_draft(session: CSVSession, gc: Any, kinds: dict, do_sample: bool, top_k: Optional[int]) -> CSVSession:
    """The assistant's head inside assisted generation (hf_csv.candidate).

    Greedy drafts: certified top-1, so the drafted tokens are the stock draft's (plus the tail
    fill for the confidence stop). Sampled drafts: exact logits on a certified top-k set, -inf
    elsewhere; the draft samples from exactly the logits it returns as candidate logits, which is
    all speculative sampling needs to stay lossless (the target's verification is exact).
    """
    cfg = session.config
    lower = "lower" in kinds
    if not do_sample:
        session.mode, session.k, session.verify = "topk", 1, lower
        thr = getattr(gc, "assistant_confidence_threshold", None)
        session.fill_tail = bool(thr) and not lower and not session.softcap
        return session
    # token-specific processors (min-length, bad words, ...) may lower tokens of S: the draft then
    # samples from what they leave, which is still what it returns; CSVLogitsProcessor only
    # re-runs a row with the full head if they leave nothing finite in it.
    k = min(cfg.draft_top_k, session.head.vocab_size, top_k or cfg.draft_top_k)
    session.mode, session.k, session.verify = "topk", k, lower
    return session


def _make_session(model: nn.Module, config: CSVConfig, kwargs: dict) -> CSVSession:
    _, head = find_head(model)
    offloaded = head.weight.device.type == "meta"  # accelerate offload: weights exist only inside its hook
    sess = CSVSession(model=model, config=config, head=None if offloaded else get_certified_head(head, config),
                      out_dtype=model_out_dtype(model, head), softcap=model_softcap(model))
    if offloaded:
        sess.force_full = ("the output head is offloaded (device_map 'cpu'/'disk' offload): its weights are "
                           "loaded only inside accelerate's hook")
    sess.assisted = kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens") is not None
    gc = kwargs.get("generation_config")
    if gc is not None and getattr(gc, "prompt_lookup_num_tokens", None) is not None:
        sess.assisted = True
    if sess.assisted:
        from .candidate import user_assistant_settings

        sess.extra["_user_assistant_settings"] = user_assistant_settings(kwargs)
    for key in ("logprob_threshold", "no_speech_threshold", "return_token_timestamps", "return_timestamps"):
        if kwargs.get(key) not in (None, False):
            sess.force_full = f"Whisper's {key} reads log-probabilities over the full vocabulary"
    return sess


def _patched_get_logits_processor(model: nn.Module, orig: Callable) -> Callable:
    """Instance-level ``_get_logits_processor``: stock list, then the mode decision for the session."""

    def _get_logits_processor(*args: Any, **kwargs: Any):
        procs = orig(*args, **kwargs)
        sess = active_session(model)
        if sess is None:
            return procs
        gc = kwargs.get("generation_config", args[0] if args else None)
        # one CSVLogitsProcessor, last (a user's instance is reused, keeping its records)
        # an assistant's generate receives the target's processors, whose CSVLogitsProcessor is bound
        # to the target's session: a draft session never takes it over, it gets its own
        mine = [] if sess.draft else [p for p in procs if isinstance(p, CSVLogitsProcessor)]
        others = [p for p in procs if not isinstance(p, CSVLogitsProcessor)]
        decide_mode(sess, gc, others)
        modes = getattr(sess.head, "modes", None)
        if modes is not None and sess.mode != "full" and sess.mode not in modes:
            sess.set_full(f"the vocabulary-parallel head certifies {sorted(modes)} only, not {sess.mode!r}")
        verifier = (mine[-1] if mine else CSVLogitsProcessor()).bind(sess)
        procs[:] = others + ([verifier] if (sess.verify or mine) else [])
        sess.processors = procs
        return procs

    return _get_logits_processor


def _verify_patch(sess: CSVSession, config: CSVConfig):
    """Assisted calls get hf_csv's speculative verify (``config.speculative``); others nothing."""
    if not sess.assisted or config.speculative == "stock":
        return contextlib.nullcontext()
    from .verify import patch_speculative_sampling

    return patch_speculative_sampling(mode=config.speculative)


_OVERRIDE_LOCK = threading.RLock()
_OVERRIDES: dict[tuple, list] = {}  # (id(model), attribute) -> [refcount]


@contextlib.contextmanager
def instance_override(model: nn.Module, name: str, make: Callable[[Callable], Callable]):
    """Scoped instance-level override ``model.<name> = make(class method bound to model)``.

    Reference-counted per (model, name) so that nested or concurrent scopes share one override;
    the last exit removes it, also after an exception. The override itself must consult the
    calling context (hf_csv.head.active_session) to act only for certified calls.
    """
    key = (id(model), name)
    with _OVERRIDE_LOCK:
        entry = _OVERRIDES.get(key)
        if entry is None:
            entry = [0]
            _OVERRIDES[key] = entry
            model.__dict__[name] = make(getattr(type(model), name).__get__(model))
        entry[0] += 1
    try:
        yield
    finally:
        with _OVERRIDE_LOCK:
            entry[0] -= 1
            if entry[0] == 0:
                model.__dict__.pop(name, None)
                del _OVERRIDES[key]


@contextlib.contextmanager
def certified(model: nn.Module, sess: CSVSession):
    """Make ``sess`` active for ``model`` in this context: the instance-level
    ``_get_logits_processor`` (mode decision) and the head swap. Both are restored on exit,
    also on exceptions; concurrent activations on one model are reference-counted."""
    hook = model.register_forward_pre_hook(_track_length(sess), with_kwargs=True)
    try:
        with instance_override(model, "_get_logits_processor", lambda orig: _patched_get_logits_processor(model, orig)), \
                swapped_head(model, sess):
            yield sess
    finally:
        hook.remove()


def _track_length(sess: CSVSession) -> Callable:
    """Forward pre-hook: how many tokens the model has consumed once this forward is done (cache + new).

    The head call then knows the token index of each of its positions (StepStash.position), which
    CSVLogitsProcessor needs when one call produces several positions (assisted verification).
    """

    def pre(module: nn.Module, args: tuple, kwargs: dict):
        ids = kwargs.get("decoder_input_ids")
        if ids is None:
            ids = kwargs.get("input_ids", args[0] if args and torch.is_tensor(args[0]) else None)
        if ids is None or kwargs.get("inputs_embeds") is not None or kwargs.get("decoder_inputs_embeds") is not None:
            sess.fed_total = None
            return None
        pkv = kwargs.get("past_key_values")
        try:
            past = int(pkv.get_seq_length()) if pkv is not None else 0
        except (AttributeError, TypeError):
            sess.fed_total = None
            return None
        sess.fed_total = past + int(ids.shape[-1])
        return None

    return pre


def _assist_patch(model: nn.Module, sess: CSVSession, config: CSVConfig):
    """Assisted calls with an assistant model get the sub-vocabulary draft head (hf_csv.candidate)."""
    if not sess.assisted:
        return contextlib.nullcontext()
    from .candidate import patched_candidate_generator

    return patched_candidate_generator(model, sess, config)


def csv_generate(model: nn.Module, call: Callable, config: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``call(*args, **kwargs)`` (a class-level generate) with ``config`` active for ``model``."""
    if isinstance(config, dict):
        config = CSVConfig(**config)
    if not isinstance(config, CSVConfig):
        raise TypeError(f"csv_config must be a CSVConfig or a dict, got {type(config).__name__}")
    sess = _make_session(model, config, kwargs)
    with certified(model, sess), _verify_patch(sess, config), _assist_patch(model, sess, config):
        out = call(*args, **kwargs)
    summary = sess.summary()
    if config.stats:
        try:
            object.__setattr__(out, "csv_stats", summary) if not isinstance(out, torch.Tensor) else None
        except (AttributeError, TypeError):
            pass
        model.__dict__["csv_last_stats"] = summary
    return out


def enable(model: nn.Module) -> nn.Module:
    """Make ``model.generate(..., csv_config=CSVConfig(...))`` work for this model; returns it.

    Without ``csv_config`` the class's generate runs unchanged. Idempotent; undo with :func:`disable`.
    """
    check_transformers_version()
    find_head(model)  # fail now for unsupported models
    if getattr(model.__dict__.get("generate"), "_hf_csv", False):
        return model
    cls_generate = type(model).generate

    @functools.wraps(cls_generate)
    def generate(*args: Any, csv_config: Optional[CSVConfig] = None, **kwargs: Any):
        if csv_config is None:
            return cls_generate(model, *args, **kwargs)
        return csv_generate(model, functools.partial(cls_generate, model), csv_config, args, kwargs)

    generate._hf_csv = True
    model.__dict__["generate"] = generate
    return model


def disable(model: nn.Module) -> nn.Module:
    """Undo :func:`enable` (the class's generate is used again)."""
    if getattr(model.__dict__.get("generate"), "_hf_csv", False):
        del model.__dict__["generate"]
    return model


_INSTALLED: list = []  # (owner class, original function)


def install() -> None:
    """Global switch: every model's ``generate`` accepts ``csv_config`` (patches ``GenerationMixin.generate``
    and ``WhisperGenerationMixin.generate``). Calls without ``csv_config`` run the original function."""
    check_transformers_version()
    if _INSTALLED:
        return
    from transformers.generation.utils import GenerationMixin
    from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

    for owner in (GenerationMixin, WhisperGenerationMixin):
        orig = owner.__dict__["generate"]

        def make(orig=orig):
            @functools.wraps(orig)
            def generate(self, *args: Any, csv_config: Optional[CSVConfig] = None, **kwargs: Any):
                if csv_config is None:
                    return orig(self, *args, **kwargs)
                return csv_generate(self, functools.partial(orig, self), csv_config, args, kwargs)

            generate._hf_csv = True
            return generate

        _INSTALLED.append((owner, orig))
        owner.generate = make()


def uninstall() -> None:
    """Restore the functions :func:`install` patched."""
    while _INSTALLED:
        owner, orig = _INSTALLED.pop()
        owner.generate = orig
