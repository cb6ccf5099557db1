"""Every point where hf_csv touches transformers, and the one mechanism that installs and restores the per-call ones.

The table :data:`TOUCH_POINTS` is the list (docs/design.md "Where transformers is touched" prints it): what is
replaced, which hf_csv module builds the replacement, and when it is installed. Per-call overrides go through
:func:`instance_override` only, which refuses a name that is not in the table, so a new patch cannot land without
being listed here. Each is scoped to one model and one certified call: an instance attribute that shadows the
class's method, reference-counted per (model, name) so nested and concurrent calls share one installation, removed
by the last exit, also after an exception. The overrides consult the calling context
(:func:`hf_csv.transformers.step.active_session`), so a stock call on the same model in another thread is unaffected.

Which transformers versions each point was checked against is :mod:`hf_csv.transformers.compat`'s business (the one place that
knows the versions). No transformers code is copied: every wrapper calls the original.
"""
from __future__ import annotations

import contextlib
import inspect
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from hf_csv.core.errors import CSVError

__all__ = ["TouchPoint", "TOUCH_POINTS", "instance_override", "shared"]


@dataclass(frozen=True)
class TouchPoint:
    """One point where hf_csv replaces something of transformers'."""

    target: str  # what is replaced
    kind: str  # "instance" (an instance attribute for one call), "module" (an attribute of the model), "hooks",
    #            "global" (a module global of transformers, per scope) or "enable" (until disable/uninstall)
    owner: str  # the hf_csv module that builds the replacement
    when: str  # when it is installed


TOUCH_POINTS: tuple[TouchPoint, ...] = (
    TouchPoint("generate (instance attribute) / GenerationMixin.generate and Whisper's (install())", "enable",
               "enable", "hf_csv.enable(model) / hf_csv.install(), until disable / uninstall"),
    TouchPoint("the output head module (lm_head / proj_out) -> step.CSVHead", "module", "step",
               "every certified call (swapped by hf_csv.transformers.session.swapped_head)"),
    TouchPoint("_get_logits_processor", "instance", "scope", "every certified call"),
    TouchPoint("_get_stopping_criteria", "instance", "scope", "every certified call"),
    TouchPoint("_valid_auto_compile_criteria", "instance", "scope",
               "every certified call (acts only when transformers compiles)"),
    TouchPoint("forward pre- and post-hooks on the model", "hooks", "step", "every certified call (installed by hf_csv.transformers.scope)"),
    TouchPoint("_get_top_k_continuations", "instance", "beam", "CSVConfig(beam_search='exact') beam calls"),
    TouchPoint("_get_running_beams_for_next_iteration", "instance", "beam", "CSVConfig(beam_search='exact') beam calls"),
    TouchPoint("_update_finished_beams", "instance", "beam", "CSVConfig(beam_search='exact') beam calls"),
    TouchPoint("_check_early_stop_heuristic", "instance", "beam", "CSVConfig(beam_search='exact') beam calls"),
    TouchPoint("_need_fallback", "instance", "whisper", "Whisper calls with logprob_threshold"),
    TouchPoint("_retrieve_avg_logprobs", "instance", "whisper", "Whisper calls with logprob_threshold"),
    TouchPoint("_get_candidate_generator", "instance", "drafts", "assisted calls"),
    TouchPoint("transformers.generation.utils._speculative_sampling", "global", "acceptance",
               "assisted sampling (and hf_csv.patch_speculative_sampling scopes)"),
)
_INSTANCE = frozenset(p.target for p in TOUCH_POINTS if p.kind == "instance")

_LOCK = threading.RLock()
_OVERRIDES: dict[tuple, list] = {}  # (id(model), attribute) -> [undo, refcount]


@contextlib.contextmanager
def shared(table: dict, key: Any, install: Callable[[], Callable[[], None]]) -> Iterator[None]:
    """Run ``install`` on the first enter for ``key`` and the undo it returns on the last exit
    (reference-counted under one lock, so nested and concurrent scopes share one installation)."""
    with _LOCK:
        entry = table.get(key)
        if entry is None:
            entry = table[key] = [install(), 0]
        entry[1] += 1
    try:
        yield
    finally:
        with _LOCK:
            entry[1] -= 1
            if entry[1] == 0:
                entry[0]()
                del table[key]


def instance_override(model: Any, name: str, make: Callable[[Callable], Callable]):
    """Scoped instance-level override ``model.<name> = make(class method bound to model)`` of a touch point listed
    in :data:`TOUCH_POINTS` (anything else raises)."""
    if name not in _INSTANCE:
        raise CSVError(f"hf_csv: {name!r} is not a documented touch point (hf_csv.transformers.patches.TOUCH_POINTS)")

    def install() -> Callable[[], None]:
        fn = getattr(type(model), name)
        static = isinstance(inspect.getattr_static(type(model), name), staticmethod)
        model.__dict__[name] = make(fn if static else fn.__get__(model))
        return lambda: model.__dict__.pop(name, None)

    return shared(_OVERRIDES, (id(model), name), install)
