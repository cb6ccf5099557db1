"""Every point where hf_csv touches transformers, and the one mechanism that installs and restores them.

The table :data:`TOUCH_POINTS` is the list (docs/design.md "Where transformers is touched" prints it): what is
replaced, which hf_csv module installs it, and when. Every replacement goes through a function of this module, each
keyed by (owner object, touch point) and refusing a touch point that is not in the table, so a new patch cannot land
without being listed here (``tests/test_transformers_patches.py`` also checks that no other module installs one):

* per-call points, scoped to one certified call (:func:`instance_override`, :func:`swapped_module`,
  :func:`forward_hooks`, :func:`global_override`): reference-counted per (owner, touch point) under one lock, so
  nested calls (an assistant's certified call inside the target's) and concurrent calls on one model share one
  installation; the last exit restores what was there, also after an exception. The replacements consult the
  calling context (:func:`hf_csv.transformers.step.active_session`), so a stock call on the same model in another
  thread is unaffected.
* until undone (:func:`pin` / :func:`unpin`: ``hf_csv.enable`` / ``hf_csv.install``): the installed value is marked
  (``_hf_csv``), pinning again is a no-op and :func:`unpin` puts back what it replaced.
* on an object one call created and drops (:func:`object_override`: the call's candidate generator), nothing to
  restore.

Which transformers versions each point was checked against is :mod:`hf_csv.transformers.compat`'s business (the one
place that knows the versions). No transformers code is copied: every replacement calls the original.
"""
from __future__ import annotations

import contextlib
import inspect
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from hf_csv.core.errors import CSVError

__all__ = ["TouchPoint", "TOUCH_POINTS", "Installation", "instance_override", "swapped_module", "forward_hooks",
           "global_override", "installed", "pin", "unpin", "object_override"]


@dataclass(frozen=True)
class TouchPoint:
    """One point where hf_csv replaces something of transformers'."""

    key: str  # the name the functions of this module take (the attribute replaced, or what it stands for)
    target: str  # what is replaced
    kind: str  # "instance" (an instance attribute for one call), "module" (a submodule of the model, one call),
    #            "hooks" (forward hooks, one call), "global" (a module global of transformers, per scope),
    #            "enable" (until disable / uninstall) or "object" (an attribute of an object the call created)
    owner: str  # the hf_csv module that installs it (calls this module)
    when: str  # when it is installed


_BEAM = "calls whose plan is the exact beam plan (CSVConfig(beam_search='exact') beam calls), from the plan's choice"
TOUCH_POINTS: tuple[TouchPoint, ...] = (
    TouchPoint("generate", "generate (instance attribute) / GenerationMixin.generate and Whisper's (install())",
               "enable", "enable", "hf_csv.enable(model) / hf_csv.install(), until disable / uninstall"),
    TouchPoint("output head", "the output head module (lm_head / proj_out) -> step.CSVHead", "module", "heads",
               "every certified call"),
    TouchPoint("_get_logits_processor", "_get_logits_processor", "instance", "scope", "every certified call"),
    TouchPoint("_get_stopping_criteria", "_get_stopping_criteria", "instance", "scope", "every certified call"),
    TouchPoint("_valid_auto_compile_criteria", "_valid_auto_compile_criteria", "instance", "scope",
               "every certified call (acts only when transformers compiles)"),
    TouchPoint("forward hooks", "forward pre- and post-hooks on the model (step.track_length, step.check_post)",
               "hooks", "scope", "every certified call"),
    TouchPoint("_get_top_k_continuations", "_get_top_k_continuations", "instance", "beam", _BEAM),
    TouchPoint("_get_running_beams_for_next_iteration", "_get_running_beams_for_next_iteration", "instance", "beam",
               _BEAM),
    TouchPoint("_update_finished_beams", "_update_finished_beams", "instance", "beam", _BEAM),
    TouchPoint("_check_early_stop_heuristic", "_check_early_stop_heuristic", "instance", "beam", _BEAM),
    TouchPoint("_need_fallback", "_need_fallback", "instance", "whisper", "Whisper calls with logprob_threshold"),
    TouchPoint("_retrieve_avg_logprobs", "_retrieve_avg_logprobs", "instance", "whisper",
               "Whisper calls with logprob_threshold"),
    TouchPoint("_get_candidate_generator", "_get_candidate_generator", "instance", "drafts", "assisted calls"),
    TouchPoint("get_candidates", "get_candidates of the candidate generator built for the call (that instance)",
               "object", "drafts", "assisted calls with an assistant model"),
    TouchPoint("_speculative_sampling", "transformers.generation.utils._speculative_sampling", "global",
               "acceptance", "assisted sampling (and hf_csv.patch_speculative_sampling scopes)"),
)
_POINTS = {p.key: p for p in TOUCH_POINTS}


def _point(key: str, kind: str) -> TouchPoint:
    """The listed touch point ``key`` of ``kind``; anything else raises :class:`CSVError`."""
    p = _POINTS.get(key)
    if p is None or p.kind != kind:
        raise CSVError(f"hf_csv: {key!r} is not a documented {kind} touch point "
                       "(hf_csv.transformers.patches.TOUCH_POINTS)")
    return p


@dataclass
class Installation:
    """One per-call touch point installed on one owner: how to undo it, how many scopes hold it, and what its
    installer keeps while it stays installed (``state``). Holds the owner, so its id is not reused meanwhile."""

    owner: Any
    undo: Callable[[], None]
    state: dict = field(default_factory=dict)
    users: int = 0


_LOCK = threading.RLock()
_INSTALLED: dict[tuple, Installation] = {}  # (id(owner), touch point) -> its installation


@contextlib.contextmanager
def _scoped(owner: Any, key: str, install: Callable[[dict], Callable[[], None]]) -> Iterator[Installation]:
    """Run ``install(state)`` on the first enter for (owner, key) and the undo it returns on the last exit
    (reference-counted under one lock, so nested and concurrent scopes share one installation); the undo runs also
    when the body raises. Yields the installation."""
    k = (id(owner), key)
    with _LOCK:
        inst = _INSTALLED.get(k)
        if inst is None:
            state: dict = {}
            inst = _INSTALLED[k] = Installation(owner=owner, undo=install(state), state=state)
        inst.users += 1
    try:
        yield inst
    finally:
        with _LOCK:
            inst.users -= 1
            if inst.users == 0:
                del _INSTALLED[k]
                inst.undo()


@contextlib.contextmanager
def installed(owner: Any, key: str) -> Iterator[Optional[Installation]]:
    """The installation of the per-call touch point ``key`` on ``owner`` (None when none is), held under the
    mechanism's lock for the block: no scope enters or exits it meanwhile."""
    with _LOCK:
        yield _INSTALLED.get((id(owner), key))


def instance_override(model: Any, name: str, make: Callable[[Callable], Callable]):
    """Scoped instance-level override ``model.<name> = make(class method bound to model)`` of a touch point listed
    in :data:`TOUCH_POINTS` (anything else raises). A staticmethod is handed over as the plain function."""
    _point(name, "instance")

    def install(state: dict) -> Callable[[], None]:
        fn = getattr(type(model), name)
        static = isinstance(inspect.getattr_static(type(model), name), staticmethod)
        model.__dict__[name] = make(fn if static else fn.__get__(model))
        return lambda: model.__dict__.pop(name, None)

    return _scoped(model, name, install)


def swapped_module(model: Any, key: str, attr: str, original: Any, make: Callable[[], Any],
                   restored: Optional[Callable[[Any], None]] = None):
    """Scoped swap of the submodule ``model.<attr>`` for ``make()`` (touch point ``key``); the last exit puts
    ``original`` back and calls ``restored(replacement)``. The installation's state holds ``"module"``: the
    replacement."""
    _point(key, "module")

    def install(state: dict) -> Callable[[], None]:
        new = state["module"] = make()
        setattr(model, attr, new)

        def undo() -> None:
            if restored is not None:
                restored(new)
            setattr(model, attr, original)

        return undo

    return _scoped(model, key, install)


def forward_hooks(model: Any, key: str, pre: Callable, post: Callable):
    """Scoped forward pre-hook ``pre`` (with kwargs) and forward hook ``post`` on ``model`` (touch point ``key``):
    one pair per model while any scope holds it."""
    _point(key, "hooks")

    def install(state: dict) -> Callable[[], None]:
        handles = (model.register_forward_pre_hook(pre, with_kwargs=True), model.register_forward_hook(post))
        return lambda: [h.remove() for h in handles]

    return _scoped(model, key, install)


def global_override(module: Any, name: str, replacement: Callable):
    """Scoped replacement of the module global ``module.<name>`` by ``replacement``, which gets the function it
    replaces as ``replacement.__hf_csv_original__`` (the installation's state holds it as ``"original"``). A
    ``replacement`` left installed by a foreign restore order is replaced by its recorded original; the last exit
    restores the original unless another patch replaced ``replacement`` meanwhile (then it stays, with a warning:
    restoring would clobber it)."""
    _point(name, "global")

    def install(state: dict) -> Callable[[], None]:
        current = getattr(module, name)
        if current is replacement:  # left behind by a foreign restore order: reuse its original
            current = replacement.__hf_csv_original__  # type: ignore[attr-defined]
        replacement.__hf_csv_original__ = state["original"] = current  # type: ignore[attr-defined]
        setattr(module, name, replacement)

        def undo() -> None:
            if getattr(module, name) is replacement:
                setattr(module, name, current)
            else:
                warnings.warn(f"transformers' {name} was replaced by another patch inside an hf_csv scope; "
                              "leaving it in place", RuntimeWarning, stacklevel=4)

        return undo

    return _scoped(module, name, install)


_PINNED: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()  # owner -> {name: what pin replaced}
_ABSENT = object()


def pin(owner: Any, name: str, value: Any) -> bool:
    """Set ``owner``'s own attribute ``name`` (a class's, or an instance's ``__dict__`` entry) to ``value``, marked
    ``_hf_csv``, until :func:`unpin` (touch point ``name``, kind "enable"). A no-op returning False when an hf_csv
    value is already there. What it replaced is kept per owner (weakly: a pinned model can still be freed)."""
    _point(name, "enable")
    if not getattr(value, "_hf_csv", False):
        raise CSVError(f"hf_csv: a pinned {name!r} must be marked _hf_csv (so unpin and pin again recognize it)")
    with _LOCK:
        own = vars(owner)
        if getattr(own.get(name), "_hf_csv", False):
            return False
        if name in own:
            _PINNED.setdefault(owner, {})[name] = own[name]
        if isinstance(owner, type):
            setattr(owner, name, value)
        else:
            own[name] = value
        return True


def unpin(owner: Any, name: str) -> bool:
    """Undo :func:`pin` where ``owner.<name>`` is still hf_csv's (marked): put back what it replaced, or remove it
    where nothing was there (also on a copy of a pinned owner, ``copy.deepcopy(model)``). A value someone set over
    hf_csv's stays. Returns whether anything changed."""
    _point(name, "enable")
    with _LOCK:
        own = vars(owner)
        if not getattr(own.get(name), "_hf_csv", False):
            return False
        replaced = _PINNED.get(owner, {}).pop(name, _ABSENT)
        if isinstance(owner, type):  # (a class's __dict__ is read-only)
            if replaced is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, replaced)
        elif replaced is _ABSENT:
            del own[name]
        else:
            own[name] = replaced
        return True


def object_override(obj: Any, name: str, value: Callable) -> None:
    """``obj.<name> = value`` on an object the certified call itself created and drops with the call (touch point
    ``name``, kind "object": the call's candidate generator), so there is nothing to restore."""
    _point(name, "object")
    setattr(obj, name, value)
