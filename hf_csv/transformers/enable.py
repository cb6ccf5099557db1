"""``model.generate(..., csv_config=CSVConfig(...))``: the certified head inside transformers generation.

Use::

    import hf_csv
    model = hf_csv.enable(model)                      # once; returns the same model
    out = model.generate(**inputs, csv_config=hf_csv.CSVConfig())

``enable`` sets an instance-level ``generate`` that pops ``csv_config`` before the class's
``generate`` (whose ``_validate_model_kwargs`` rejects unknown kwargs). Without
``csv_config`` it calls the class's ``generate`` directly: bitwise stock, modules untouched.
``install()`` does the same for every model by patching ``GenerationMixin.generate`` (and
Whisper's override); ``uninstall()`` restores them. Both go through :func:`hf_csv.transformers.patches.pin`.

During a certified call narrow, scoped, restoring patches are active for that model only
(:mod:`hf_csv.transformers.scope`, docs/processors.md; every touch point: :mod:`hf_csv.transformers.patches`): the
output head is swapped for :class:`hf_csv.transformers.step.CSVHead`;
instance-level ``_get_logits_processor`` / ``_get_stopping_criteria`` inspect what generate built,
pick the certificate (:func:`hf_csv.transformers.decision.set_plan`) and append a :class:`CSVLogitsProcessor`
when needed. Modules import one way: enable -> drafts -> scope -> decision/processors -> heads -> session -> step.
"""
from __future__ import annotations

import contextlib
import functools
import types
import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn

from hf_csv.transformers.compat import caller_passed_cache, unsupported_reason
from hf_csv.transformers.beam import BeamUncertified, beam_decisions
from hf_csv.transformers.drafts import patched_candidate_generator, user_assistant_settings
from hf_csv.core.config import CSVConfig
from hf_csv.core.errors import CSVError
from hf_csv.transformers.heads import find_head, forget_heads, forget_kept_head, model_out_dtype
from hf_csv.transformers.session import CSVSession
from hf_csv.transformers.patches import pin, unpin
from hf_csv.transformers.call_facts import whisper_log_prob_reason
from hf_csv.transformers.decision import set_plan
from hf_csv.transformers.processor_kinds import classify_processor
from hf_csv.transformers.scope import certified, new_session
from hf_csv.transformers.whisper import threshold_of, whisper_decisions

__all__ = ["enable", "disable", "install", "uninstall", "refresh", "set_plan", "classify_processor",
           "csv_generate", "custom_generate"]


_WARNED: list = []


def _version_reason() -> Optional[str]:
    """Why this transformers version takes the full head (None when tested); warns once per process."""
    why = unsupported_reason()
    if why is not None and not _WARNED:
        _WARNED.append(why)
        warnings.warn(f"hf_csv: {why}", UserWarning, stacklevel=3)
    return why


def _make_session(model: nn.Module, config: CSVConfig, kwargs: dict) -> CSVSession:
    sess = new_session(model, config)
    sess.caller_cache = caller_passed_cache(kwargs)
    sess.assisted = kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens") is not None
    gc = kwargs.get("generation_config")
    if gc is not None and getattr(gc, "prompt_lookup_num_tokens", None) is not None:
        sess.assisted = True
    if sess.assisted:
        sess.assist.user_settings = user_assistant_settings(kwargs)
    # the target may leave uncomputed tokens -inf only where hf_csv's exact verify reads its bounds
    sess.spec_ok = kwargs.get("assistant_model") is not None and config.speculative == "exact"
    if kwargs.get("assistant_model") is not None and config.speculative == "gumbel":
        from hf_csv.core.speculative import KeyedGumbel

        # one seed per call from torch's global generator: torch.manual_seed(s) reproduces the call's tokens
        sess.gumbel = KeyedGumbel(int(torch.randint(0, 2 ** 62, (1,))))
    # Whisper's thresholds and timestamps, set as kwargs, on a passed config or on the model's own
    # (set_plan checks the final config again for each segment's generate)
    reason = whisper_log_prob_reason(gc, getattr(model, "generation_config", None), kwargs=kwargs)
    if reason and sess.force_full is None:
        sess.force_full = reason
    threshold = threshold_of(model, kwargs)
    if threshold is not None:
        # Whisper's logprob_threshold keeps every step's scores for its fallback decision (certified, hf_csv.transformers.whisper);
        # a call that also returns them to the caller would return sub-vocabulary rows: full head. Read from every
        # source threshold_of reads (the keyword, a passed config, the model's own config).
        own = getattr(model, "generation_config", None)
        asked = [k for k in ("return_dict_in_generate", "return_segments", "output_scores", "output_logits")
                 if kwargs.get(k) or getattr(gc, k, False) or getattr(own, k, False)]
        if asked and sess.force_full is None:
            sess.force_full = (f"Whisper's logprob_threshold with {asked}: the returned scores would be the "
                               "certified sub-vocabulary rows, not stock's")
        if sess.assisted and sess.force_full is None:
            # the fallback decision pairs one recorded head step with each kept score row; a verify call records
            # every candidate position, rejected drafts included, so the records would not be the kept rows'
            sess.force_full = ("Whisper's logprob_threshold in assisted decoding: the fallback decision is certified "
                               "for plain decoding only")
        sess.whisper.scores_internal = not asked
        sess.whisper.threshold = threshold
    return sess


def _verify_patch(sess: CSVSession, config: CSVConfig):
    """Assisted calls get hf_csv's speculative verify (``config.speculative``); others nothing."""
    if not sess.assisted or config.speculative == "stock":
        return contextlib.nullcontext()
    from hf_csv.transformers.acceptance import patch_speculative_sampling

    if config.speculative == "gumbel" and sess.gumbel is None:  # prompt lookup: no assistant to couple with
        return patch_speculative_sampling(mode="exact", session=sess)  # (the reason: hf_csv.transformers.decision)
    return patch_speculative_sampling(mode=config.speculative, session=sess)


def _assist_patch(model: nn.Module, sess: CSVSession, config: CSVConfig):
    """Assisted calls with an assistant model get the sub-vocabulary draft head (hf_csv.transformers.drafts)."""
    if not sess.assisted:
        return contextlib.nullcontext()
    return patched_candidate_generator(model, sess, config)


def csv_generate(model: nn.Module, call: Callable, config: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``call(*args, **kwargs)`` (a class-level generate) with ``config`` active for ``model``.

    ``model.csv_last_stats`` is reset to ``None`` when the call starts and set to the call's summary when it
    returns (with ``config.stats``): after a call that raised (a bad argument such as ``max_new_tokens=0``, an
    invalid ``csv_config``, a damaged artifact) or that ran with ``stats=False`` it is ``None``, never a previous
    call's stats. Calls without ``csv_config`` leave it as it is."""
    model.__dict__["csv_last_stats"] = None
    if isinstance(config, dict):
        config = CSVConfig(**config)
    if not isinstance(config, CSVConfig):
        raise TypeError(f"csv_config must be a CSVConfig or a dict, got {type(config).__name__}")
    why = _version_reason()
    if why is not None:  # untested transformers: stock generate, untouched, and the reason in the stats
        sess = CSVSession(model=model, config=config, head=None, out_dtype=model_out_dtype(model, find_head(model)[1]))
        sess.set_full(why)
        out = call(*args, **kwargs)
        return _attach_stats(model, out, sess.summary(), config)
    sess = _make_session(model, config, kwargs)
    with certified(model, sess), _verify_patch(sess, config) as spec, _assist_patch(model, sess, config), \
            whisper_decisions(model, sess), beam_decisions(model, sess):
        try:
            out = call(*args, **kwargs)
        except BeamUncertified as e:
            # a beam decision the intervals could not certify (hf_csv.transformers.beam): never guess, run the call again with
            # stock's head for its beam searches (a fresh start: the caller passed no cache, generate is deterministic)
            _beam_restart(sess, str(e))
            out = call(*args, **kwargs)
    if spec is not None and spec.calls:
        sess.reports["speculative"] = spec.summary()
    if sess.step.spec_pending:  # pragma: no cover - hf_csv.transformers.drafts makes this call complete; never return it silently
        raise CSVError("hf_csv: the last certified head call of assisted sampling was not read by hf_csv's verify; "
                       "its tokens may not follow the model's law. Please report this; generate without "
                       "csv_config meanwhile.")
    return _attach_stats(model, out, sess.summary(), config)


def _beam_restart(sess: CSVSession, why: str) -> None:
    st = sess.reports.setdefault("beam", {})
    st["restarts"] = st.get("restarts", 0) + 1
    st["aborted_steps"] = st.get("aborted_steps", 0) + st.get("certified_steps", 0)
    st["aborted_rows"] = st.get("aborted_rows", 0) + sess.stats.rows
    st["certified_steps"] = st["subvocab_steps"] = 0
    sess.stats = type(sess.stats)()  # the returned tokens come from the re-run: its rows are what count
    sess.beam.step = sess.beam.state = None
    sess.step.last = None
    sess.step.guard_pending = None
    sess.beam.restart = f"{why}; this call re-ran its beam search on the full head"


def _attach_stats(model: nn.Module, out: Any, summary: dict, config: CSVConfig) -> Any:
    if config.stats:
        try:
            object.__setattr__(out, "csv_stats", summary) if not isinstance(out, torch.Tensor) else None
        except (AttributeError, TypeError):
            pass
        model.__dict__["csv_last_stats"] = summary
    return out


def _generate(self: nn.Module, *args: Any, csv_config: Optional[CSVConfig] = None, **kwargs: Any):
    """``generate`` with ``csv_config`` (see :func:`enable`); without it the class's generate, unchanged."""
    cls_generate = type(self).generate
    if csv_config is None:
        return cls_generate(self, *args, **kwargs)
    return csv_generate(self, functools.partial(cls_generate, self), csv_config, args, kwargs)


_generate._hf_csv = True


def _called_from(fn: Callable, depth: int = 4) -> bool:
    """Whether ``fn`` is among the nearest callers (the custom_generate module sits in between)."""
    import sys

    import inspect

    code = getattr(inspect.unwrap(fn), "__code__", None)  # generate is wrapped by torch.no_grad: its own body
    f = sys._getframe(2)
    for _ in range(depth):
        if f is None:
            return False
        if f.f_code is code:
            return True
        f = f.f_back
    return False


@functools.lru_cache(maxsize=16)
def _parameters(fn: Callable) -> tuple:
    """The parameter names of ``fn`` (a class's ``generate``), read once per function."""
    import inspect

    return tuple(inspect.signature(fn).parameters)


def custom_generate(model: nn.Module, *args: Any, csv_config: Optional[CSVConfig] = None,
                    defaults: Optional[dict] = None, **kwargs: Any) -> Any:
    """The body of the Hub ``custom_generate/generate.py`` template (``hf-csv push-model``).

    transformers calls it with ``model=`` and every argument of ``generate`` (``None`` where unset),
    per call (``generate(..., custom_generate=REPO, trust_remote_code=True)``) or as the model's
    ``generate`` (a model repository with a ``custom_generate`` folder, loaded with
    ``trust_remote_code=True``). ``csv_config``: the caller's, else ``defaults`` (what the repository
    stores: its own artifact), else an artifact saved beside the model's weights, else ``CSVConfig()``.
    Runs the class's ``generate`` under :func:`csv_generate`: the guarantees are those of a certified call.
    """
    if csv_config is None:
        csv_config = dict(defaults or {})
        if "index" not in csv_config:
            from pathlib import Path

            from hf_csv.hub.artifact import CONFIG_NAME

            src = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", "")
            if src and (Path(src) / CONFIG_NAME).is_file():
                csv_config["index"] = src
    from transformers.generation.utils import GenerationMixin

    # transformers passes generate's own unset parameters as None; a None among the other kwargs was passed on
    # purpose (Whisper's generate overrides begin_suppress_tokens / suppress_tokens with None: dropping those would
    # restore the model's defaults, and a duplicate SuppressTokensAtBegin processor with its warning)
    named = _parameters(GenerationMixin.generate)
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k not in named}
    cls_generate = type(model).generate

    if _called_from(GenerationMixin.generate):
        # per call: GenerationMixin.generate handed over its own arguments, after any subclass's generate
        # (Whisper's) prepared them; run the same function without custom_generate, not the subclass's again
        cls_generate = GenerationMixin.generate
    elif "inputs" in kwargs:
        params = _parameters(cls_generate)
        if "inputs" not in params and "input_features" in params:  # Whisper's generate names its input so
            kwargs["input_features"] = kwargs.pop("inputs")
    return csv_generate(model, functools.partial(cls_generate, model), csv_config, args, kwargs)


def enable(model: nn.Module) -> nn.Module:
    """Make ``model.generate(..., csv_config=CSVConfig(...))`` work for this model; returns it.

    Without ``csv_config`` the class's generate runs unchanged. Idempotent; undo with :func:`disable`.
    The instance attribute is a method bound to ``model``, so ``copy.deepcopy(model)`` gives a copy
    whose ``generate`` runs on the copy.
    """
    _version_reason()
    target = _head_owner(model)  # fail now for a model without an output head (a head hf_csv cannot certify is
    # accepted: its calls run stock's head with the reason, hf_csv.transformers.heads.head_decline_reason)
    pin(target, "generate", types.MethodType(_generate, target))  # (a no-op where enabled already)
    return model


def _head_owner(model: nn.Module) -> nn.Module:
    """The model that holds the output head: ``model``, or, for a peft ``PeftModel`` (which has no head of its
    own, and whose ``generate`` calls its base model's with the same keywords), its base model."""
    try:
        find_head(model)
        return model
    except CSVError:
        base = getattr(model, "get_base_model", None)
        inner = base() if callable(base) and type(model).__module__.startswith("peft.") else None
        if not isinstance(inner, nn.Module) or inner is model:
            raise
        find_head(inner)
        return inner


def refresh(model: nn.Module) -> nn.Module:
    """Forget the cached screens of ``model``'s head. Needed only after writing its weights through
    ``.data`` (which bypasses the version counters the cache checks; peft's LoRA merge does), which the cache's
    sampled row check (:class:`hf_csv.transformers.heads.WeightProbe`) may not see; returns the model."""
    forget_heads(find_head(_head_owner(model))[1])
    return model


def disable(model: nn.Module) -> nn.Module:
    """Undo :func:`enable` (the class's generate is used again)."""
    try:
        model = _head_owner(model)
    except CSVError:
        pass
    unpin(model, "generate")
    forget_kept_head(model)  # the head wrapper kept for compiled graphs (hf_csv.transformers.heads.swapped_head)
    return model


def _install_owners() -> tuple:
    """The classes whose ``generate`` :func:`install` replaces."""
    from transformers.generation.utils import GenerationMixin
    from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

    return GenerationMixin, WhisperGenerationMixin


def install() -> None:
    """Global switch: every model's ``generate`` accepts ``csv_config`` (patches ``GenerationMixin.generate``
    and ``WhisperGenerationMixin.generate``, through :func:`hf_csv.transformers.patches.pin`). Calls without
    ``csv_config`` run the original function. Idempotent; undo with :func:`uninstall`."""
    _version_reason()
    for owner in _install_owners():
        orig = owner.__dict__["generate"]
        if not getattr(orig, "_hf_csv", False):  # (else installed already)
            pin(owner, "generate", _class_generate(orig))


def _class_generate(orig: Callable) -> Callable:
    """A class's ``generate`` that accepts ``csv_config`` (see :func:`install`); without it ``orig``, unchanged."""

    @functools.wraps(orig)
    def generate(self, *args: Any, csv_config: Optional[CSVConfig] = None, **kwargs: Any):
        if csv_config is None:
            return orig(self, *args, **kwargs)
        return csv_generate(self, functools.partial(orig, self), csv_config, args, kwargs)

    generate._hf_csv = True
    return generate


def uninstall() -> None:
    """Restore the functions :func:`install` replaced."""
    for owner in reversed(_install_owners()):
        unpin(owner, "generate")
