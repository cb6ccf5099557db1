"""The one place that knows each supported transformers version and its patch points.

hf_csv touches transformers at these documented points only (docs/processors.md):

* ``GenerationMixin._get_logits_processor`` / ``_get_stopping_criteria`` / ``_get_candidate_generator``
  (instance-level overrides: stock result first, then hf_csv inspects it);
* ``GenerationMixin._valid_auto_compile_criteria`` (instance-level override, stock answer first: when the
  decode forward is compiled, which head the graph traces; 4.57 and 5.x share its signature);
* ``GenerationMixin._get_top_k_continuations`` / ``_get_running_beams_for_next_iteration`` /
  ``_update_finished_beams`` / ``_check_early_stop_heuristic`` (instance-level wrappers, ``beam_search="exact"``
  only, stock result first; hf_csv.transformers.beam replays stock's score arithmetic on the interval ends and checks its replay
  bit for bit against stock's result on every call, so a version whose bookkeeping differs raises instead of
  certifying: 4.57 and 5.20–5.24 have the same helpers, keyword-called the same way; 5.24 changed only the
  ``do_sample`` branch of ``_get_top_k_continuations``, which beam sampling takes and hf_csv declines);
* the model's output head module (``lm_head`` / ``proj_out``) swapped for the call;
* the model's forward keyword that carries the KV cache, read by a forward pre-hook (the positions a call feeds):
  ``past_key_values`` up to 5.23, ``cache`` from 5.24 (which still takes the old name from callers, deprecated);
* the module global ``transformers.generation.utils._speculative_sampling`` (assisted sampling).

Each tested release series is listed in :data:`SUPPORTED` with what differs between them:

* the fifth parameter of ``_speculative_sampling``: 5.x passes ``assistant_ensemble_weight``; 4.57
  passes ``is_done_candidate`` (when the last drafted token ends the sequence and every draft is
  accepted, stock 4.57 keeps the L drafts and samples no bonus token);
* where the candidate generator reads the draft schedule: 5.x from its own copy of the assistant's
  generation config, 4.57 from the assistant model's (shared) generation config, which hf_csv does not
  write, so there a schedule or confidence threshold passed to the main ``generate`` is not applied
  (as in stock 4.57) and the call's stats say so;
* the model forward's KV-cache keyword (:func:`cache_kwarg`): ``past_key_values`` up to 5.23, ``cache`` in 5.24.
  A caller may pass its own cache to 5.24's ``generate`` under either name (:func:`caller_passed_cache`).

On a version not listed, hf_csv imports and :func:`hf_csv.enable` works, but certified calls run
the full head: it warns once and records the reason in the call's stats. ``HF_CSV_ALLOW_UNTESTED=1``
lets such a version take the certified path anyway (at your own risk: the patch points are then
checked by signature only).
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Optional

from hf_csv.core.errors import UnsupportedVersionError

__all__ = ["Support", "SUPPORTED", "CACHE_KWARGS", "cache_kwarg", "caller_passed_cache", "support", "unsupported_reason",
           "check_transformers_version", "generation_setting", "speculative_gen_utils", "transformers_version",
           "adapts_confidence_threshold"]


@dataclass(frozen=True)
class Support:
    """What hf_csv relies on in one transformers release series."""

    series: tuple[int, int]
    # name of ``_speculative_sampling``'s fifth parameter: "assistant_ensemble_weight" or "is_done_candidate"
    speculative_extra: str
    # the candidate generator's own copy of the assistant's generation config (5.x), or None (4.57 reads
    # the schedule and the confidence threshold from ``assistant_model.generation_config``, a shared object)
    assistant_config_attr: Optional[str] = "assistant_generation_config"
    # the keyword under which ``generate`` passes the KV cache to the model's forward (5.24 renamed it)
    cache_kwarg: str = "past_key_values"


_SPEC_5 = "assistant_ensemble_weight"
_SPEC_457 = "is_done_candidate"

#: tested series (CI runs the full suite on the series the install resolves, the exactness subset on the others:
#: .ci/smoke)
SUPPORTED: dict[tuple[int, int], Support] = {
    (4, 57): Support((4, 57), _SPEC_457, assistant_config_attr=None),
    **{(5, m): Support((5, m), _SPEC_5) for m in (20, 21, 22, 23)},
    (5, 24): Support((5, 24), _SPEC_5, cache_kwarg="cache"),
}
#: every name a caller may pass its own KV cache under, to ``generate`` (5.24 takes both, the old one deprecated)
CACHE_KWARGS = ("cache", "past_key_values")
_SPEC_HEAD = ("candidate_input_ids", "candidate_logits", "candidate_length", "new_logits")


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def _parse(v: str) -> tuple[int, int]:
    parts = v.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return (-1, -1)


def _untested_ok() -> bool:
    return os.environ.get("HF_CSV_ALLOW_UNTESTED") == "1"


def support(version: Optional[str] = None) -> Optional[Support]:
    """The :class:`Support` entry of ``version`` (default: the installed one), or None if untested.

    With ``HF_CSV_ALLOW_UNTESTED=1`` an untested version gets the entry its ``_speculative_sampling``
    signature matches (checked when a speculative patch is entered).
    """
    found = SUPPORTED.get(_parse(version or transformers_version()))
    if found is None and _untested_ok():
        from transformers.generation import utils as gen_utils

        fn = getattr(gen_utils, "_speculative_sampling", None)
        fn = getattr(fn, "__hf_csv_original__", fn)
        extra = tuple(inspect.signature(fn).parameters)[4:5] if fn is not None else ()
        found = Support(_parse(version or transformers_version()), extra[0] if extra else _SPEC_5)
    return found


def _tested() -> str:
    return ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED)


def unsupported_reason(version: Optional[str] = None) -> Optional[str]:
    """None on a tested version; otherwise why certified calls use the full head."""
    version = version or transformers_version()
    if support(version) is not None:
        return None
    return (f"transformers {version} is not a tested version ({_tested()}): its generate internals may have "
            "changed, so certified calls use the full head (HF_CSV_ALLOW_UNTESTED=1 to try anyway)")


def check_transformers_version(version: Optional[str] = None) -> str:
    """Return the version, or raise :class:`UnsupportedVersionError` (for callers that must not run
    on an untested version, such as an explicit ``patch_speculative_sampling``)."""
    version = version or transformers_version()
    why = unsupported_reason(version)
    if why is not None:
        raise UnsupportedVersionError(why)
    return version


def speculative_gen_utils() -> tuple[object, Support]:
    """``transformers.generation.utils`` and the version's :class:`Support`, after checking that
    ``_speculative_sampling`` exists with the signature that version is known to have.

    Raises:
        UnsupportedVersionError: untested version, missing global or another signature.
    """
    check_transformers_version()
    from transformers.generation import utils as gen_utils

    sup = support()
    assert sup is not None
    fn = getattr(gen_utils, "_speculative_sampling", None)
    if fn is None:
        raise UnsupportedVersionError("transformers.generation.utils._speculative_sampling not found")
    fn = getattr(fn, "__hf_csv_original__", fn)
    params = tuple(inspect.signature(fn).parameters)
    expected = _SPEC_HEAD + (sup.speculative_extra,)
    if params != expected:
        raise UnsupportedVersionError(f"unexpected _speculative_sampling signature {params}; expected {expected}")
    return gen_utils, sup


def cache_kwarg(version: Optional[str] = None) -> str:
    """The keyword under which ``generate`` passes the KV cache to the model's forward on ``version`` (default: the
    installed one). An untested version (whose calls take the full head unless ``HF_CSV_ALLOW_UNTESTED=1``) is read
    from the installed ``prepare_inputs_for_generation``'s parameters."""
    found = SUPPORTED.get(_parse(version or transformers_version()))
    if found is not None:
        return found.cache_kwarg
    from transformers.generation.utils import GenerationMixin

    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


def adapts_confidence_threshold(gen: object) -> bool:
    """Whether stock's candidate generator ``gen`` re-chooses its confidence threshold after every round.

    Stock does so exactly when scikit-learn is importable, the assistant's generation config has a non-zero
    ``assistant_confidence_threshold`` (transformers' default is 0.4) and ``gen`` is exactly an
    ``AssistedCandidateGenerator``: it keeps softmax(draft scores)[drafted token] of every drafted token and takes the
    ROC curve's best cut as the next threshold. Those probabilities read the draft's *whole* processed row, so a
    draft whose rows are finite only on a certified set would give other thresholds and other draft lengths. 5.x
    reads the config from the generator's own copy, 4.57 from the assistant model's
    (:attr:`Support.assistant_config_attr`)."""
    from transformers.generation import candidate_generator as cg

    if type(gen) is not cg.AssistedCandidateGenerator or not cg.is_sklearn_available():
        return False
    attr = (support() or SUPPORTED[max(SUPPORTED)]).assistant_config_attr
    config = getattr(gen, attr, None) if attr else None
    if config is None:
        config = getattr(getattr(gen, "assistant_model", None), "generation_config", None)
    return bool(getattr(config, "assistant_confidence_threshold", None))


def caller_passed_cache(kwargs: dict) -> bool:
    """Whether a ``generate`` call brings its own KV cache, under either name (:data:`CACHE_KWARGS`)."""
    return any(kwargs.get(name) is not None for name in CACHE_KWARGS)


def generation_setting(generation_config: object, key: str) -> object:
    """The value ``generate`` uses for ``key`` when the call does not name it: the config's, else transformers'
    global default (5.x leaves unset fields ``None`` and fills them from ``_get_default_generation_params``, e.g.
    ``top_k = 50``; 4.57 stores the defaults in the config itself)."""
    v = getattr(generation_config, key, None)
    if v is None:
        defaults = getattr(type(generation_config), "_get_default_generation_params", None)
        if callable(defaults):
            v = defaults().get(key)
    return v

