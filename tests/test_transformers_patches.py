"""hf_csv.transformers.patches: the list of touch points in code, the call sites and docs/design.md agree, nothing is
installed on transformers outside patches.py, an unlisted touch point is refused, the mechanism shares and restores
(nested, concurrent, after an exception), and every per-call touch point is gone after a call of each kind; the beam
overrides are there only on calls that run the exact beam plan."""
from __future__ import annotations

import ast
import copy
import threading
import types
import warnings
from pathlib import Path

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

import hf_csv
from hf_csv import CSVConfig
from hf_csv.core.errors import CSVError
from hf_csv.transformers import patches
from hf_csv.transformers.patches import TOUCH_POINTS, instance_override

from conftest import tiny_llama

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_csv" / "transformers"
INSTANCE = {p.target: p for p in TOUCH_POINTS if p.kind == "instance"}
POINTS = {p.key: p for p in TOUCH_POINTS}
# each function of patches that takes (owner, touch point) -> the kind of point it installs (None: any listed one)
KINDS = {"instance_override": "instance", "swapped_module": "module", "forward_hooks": "hooks",
         "global_override": "global", "pin": "enable", "unpin": "enable", "object_override": "object",
         "installed": None}


# ------------------------------------------------------------------ code, table, call sites and docs agree
def _calls(tree: ast.AST):
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            name = getattr(n.func, "id", getattr(n.func, "attr", None))
            if name in KINDS:
                yield name, n


def _sites() -> dict[str, set[tuple[str, str]]]:
    """touch point -> {(hf_csv module, patches function)} of every call outside patches.py."""
    sites: dict[str, set] = {}
    for path in sorted(PACKAGE.glob("*.py")):
        if path.stem == "patches":
            continue
        for fn, n in _calls(ast.parse(path.read_text())):
            key = n.args[1] if len(n.args) > 1 else None
            assert isinstance(key, ast.Constant) and isinstance(key.value, str), \
                f"{path.name}:{n.lineno}: {fn} without a literal touch point"
            sites.setdefault(key.value, set()).add((path.stem, fn))
    return sites


def test_every_site_is_a_listed_point_of_its_owner_and_kind_and_every_point_is_used():
    sites = _sites()
    assert set(sites) == set(POINTS), sorted(set(sites) ^ set(POINTS))
    for key, where in sites.items():
        p = POINTS[key]
        for mod, fn in where:
            assert mod == p.owner, (key, mod, p.owner)
            assert KINDS[fn] in (None, p.kind), (key, fn, p.kind)
        assert any(KINDS[fn] is not None for _, fn in where), f"{key}: only read, never installed"


# hf_csv's own attributes, which replace nothing of transformers': the call's stats on the model and on the output
# (a documented result), and the mask processors.mask_once keeps on its own copy of a processor
OWN = {"csv_last_stats", "csv_stats", "_csv_mask"}
TOUCHED = set(POINTS) | {"lm_head", "proj_out", "forward"}


def _const(n) -> object:
    return n.value if isinstance(n, ast.Constant) else None


def _is_dict_of(n) -> bool:
    """``X.__dict__`` or ``vars(X)``."""
    return (isinstance(n, ast.Attribute) and n.attr == "__dict__") or \
        (isinstance(n, ast.Call) and getattr(n.func, "id", None) == "vars")


def installs(source: str) -> list[str]:
    """What ``source`` installs on an object of transformers' (or anything else): ``setattr``/``delattr``
    (also ``object.__setattr__``), writes to an object's ``__dict__`` (item assignment, ``del``, ``pop``,
    ``setdefault``, ``update``), hook registrations, and assignments to a listed touch point's name; hf_csv's own
    attributes (:data:`OWN`) aside. Empty for a module that installs nothing."""
    found = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Call):
            f = n.func
            name = getattr(f, "id", getattr(f, "attr", None))
            if name in ("setattr", "delattr", "__setattr__", "__delattr__"):
                if not (len(n.args) > 1 and _const(n.args[1]) in OWN):
                    found.append(f"{n.lineno}: {name}")
            elif name and name.startswith("register_") and "hook" in name:
                found.append(f"{n.lineno}: {name}")
            elif isinstance(f, ast.Attribute) and _is_dict_of(f.value) and \
                    name in ("pop", "setdefault", "update", "__setitem__", "__delitem__", "clear", "popitem"):
                if not (n.args and _const(n.args[0]) in OWN):
                    found.append(f"{n.lineno}: __dict__.{name}")
        targets = n.targets if isinstance(n, (ast.Assign, ast.Delete)) else \
            [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(e, ast.Subscript) and _is_dict_of(e.value) and _const(e.slice) not in OWN:
                    found.append(f"{e.lineno}: __dict__[...]")
                elif isinstance(e, ast.Attribute) and e.attr in TOUCHED:
                    found.append(f"{e.lineno}: .{e.attr} =")
    return found


def test_nothing_is_installed_outside_patches():
    found = {path.name: installs(path.read_text()) for path in sorted(PACKAGE.glob("*.py")) if path.stem != "patches"}
    assert not {k: v for k, v in found.items() if v}, found


@pytest.mark.parametrize("source", [
    'model.__dict__["_get_logits_processor"] = f',
    "model.__dict__.setdefault('_get_stopping_criteria', f)",
    'vars(model)["_new_point"] = f',
    "del model.__dict__['generate']",
    "setattr(model, 'lm_head', wrapper)",
    "object.__setattr__(model, name, value)",
    "gen_utils._speculative_sampling = dispatch",
    "GenerationMixin.generate = generate",
    "gen.get_candidates = get_candidates",
    "model.lm_head = wrapper",
    "handle = model.register_forward_hook(hook)",
    "model.lm_head.register_forward_pre_hook(hook)",
])
def test_a_touch_point_installed_outside_patches_fails(source):
    """The check above catches each way of installing a touch point by hand."""
    assert installs(source), source


def test_hf_csvs_own_attributes_are_not_touch_points():
    assert not installs('model.__dict__["csv_last_stats"] = s\nout.__dict__.pop("_csv_mask", None)\n'
                        'object.__setattr__(out, "csv_stats", s)\nsess.plan = plan\nwrapper.static_plan = None')


def _table_rows(section: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("|") and not line.startswith("|---") and not line.startswith("| point")]


def test_design_doc_lists_every_touch_point_with_its_owner():
    text = (ROOT / "docs" / "design.md").read_text()
    section = text[text.index("## Where transformers is touched"):text.index("## Where the proofs live")]
    rows = _table_rows(section)
    # the row of each point: its name in backticks (attributes), or the words the row says it with
    label = {"output head": "the output head module", "forward hooks": "forward pre- and post-hooks",
             "_speculative_sampling": "`transformers.generation.utils._speculative_sampling`"}
    for p in TOUCH_POINTS:
        mine = [r for r in rows if label.get(p.key, f"`{p.key}`") in r[0]]
        assert len(mine) == 1, (p.key, mine)
        assert mine[0][1].startswith(f"`{p.owner}`"), (p.key, mine[0][1], p.owner)
    assert len(rows) == len({tuple(r) for r in rows})


# ------------------------------------------------------------------ the mechanism
def test_an_unlisted_or_mislabelled_touch_point_is_refused():
    m = tiny_llama()
    with pytest.raises(CSVError, match="not a documented instance touch point"):
        with instance_override(m, "_prepare_cache_for_generation", lambda orig: orig):
            pass
    assert "_prepare_cache_for_generation" not in m.__dict__
    with pytest.raises(CSVError, match="not a documented enable touch point"):
        patches.pin(m, "_get_logits_processor", types.SimpleNamespace(_hf_csv=True))
    with pytest.raises(CSVError, match="not a documented global touch point"):
        with patches.global_override(types.SimpleNamespace(f=len), "f", len):
            pass


def test_nested_and_concurrent_scopes_share_one_installation_restored_by_the_last_exit():
    m = tiny_llama()
    made = []

    def make(orig):
        made.append(orig)
        return lambda *a, **k: orig(*a, **k)

    inner_seen, errors = threading.Event(), []
    with instance_override(m, "_get_stopping_criteria", make) as outer:
        installed = m.__dict__["_get_stopping_criteria"]

        def other_thread():
            try:
                with instance_override(m, "_get_stopping_criteria", make) as inst:
                    assert inst is outer and inst.users == 2 and m.__dict__["_get_stopping_criteria"] is installed
                    inner_seen.set()
            except BaseException as e:  # (reported to the main thread)
                errors.append(e)

        t = threading.Thread(target=other_thread)
        t.start(), t.join()
        assert inner_seen.is_set() and not errors, errors
        with pytest.raises(RuntimeError):
            with instance_override(m, "_get_stopping_criteria", make):  # nested, and raising
                raise RuntimeError("boom")
        assert m.__dict__["_get_stopping_criteria"] is installed and outer.users == 1
    assert len(made) == 1 and "_get_stopping_criteria" not in m.__dict__
    with patches.installed(m, "_get_stopping_criteria") as inst:
        assert inst is None


def test_a_module_global_is_restored_unless_replaced_inside_the_scope():
    mod = types.SimpleNamespace(_speculative_sampling=len)

    def ours(*a):
        return ours.__hf_csv_original__(*a)

    with patches.global_override(mod, "_speculative_sampling", ours) as inst:
        assert mod._speculative_sampling is ours and inst.state["original"] is len and ours("ab") == 2
    assert mod._speculative_sampling is len
    with pytest.warns(RuntimeWarning, match="replaced by another patch"):
        with patches.global_override(mod, "_speculative_sampling", ours):
            mod._speculative_sampling = ord  # another patch on top: restoring would clobber it
    assert mod._speculative_sampling is ord
    mod._speculative_sampling = ours  # left behind by a foreign restore order: its recorded original is reused
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with patches.global_override(mod, "_speculative_sampling", ours) as inst:
            assert inst.state["original"] is len
    assert mod._speculative_sampling is len


def test_pin_is_idempotent_and_unpin_restores_on_classes_instances_and_copies():
    class Owner:
        def generate(self):
            return "stock"

    def value(self):
        return "ours"

    value._hf_csv = True
    assert patches.pin(Owner, "generate", value) and not patches.pin(Owner, "generate", value)
    assert Owner().generate() == "ours"
    assert patches.unpin(Owner, "generate") and Owner().generate() == "stock" and not patches.unpin(Owner, "generate")
    m = tiny_llama()
    assert patches.pin(m, "generate", types.MethodType(value, m)) and m.generate() == "ours"
    twin = copy.deepcopy(m)
    assert twin.generate.__self__ is twin  # (the bound method follows the copy)
    assert patches.unpin(twin, "generate") and "generate" not in twin.__dict__
    assert patches.unpin(m, "generate") and "generate" not in m.__dict__
    with pytest.raises(CSVError, match="marked"):
        patches.pin(m, "generate", lambda: None)


# ------------------------------------------------------------------ during and after real calls
def _left_behind(m) -> list:
    left = [name for name in INSTANCE if name in m.__dict__]
    if not isinstance(m.lm_head, torch.nn.Linear) or type(m.lm_head).__name__ != "Linear":
        left.append("lm_head")
    if m._forward_hooks or m._forward_pre_hooks:
        left.append("hooks")
    from transformers.generation import utils as gen_utils

    if getattr(gen_utils._speculative_sampling, "__module__", "").startswith("hf_csv"):
        left.append("_speculative_sampling")
    for key in POINTS:
        with patches.installed(m, key) as inst:
            if inst is not None:
                left.append(f"installation {key}")
    return left


def _installed_now(m) -> set:
    return {name for name in INSTANCE if name in m.__dict__}


class _Seen(StoppingCriteria):
    """Records which per-call touch points are installed on the model at each step (a stopping criterion that stops
    nothing: a custom logits processor would send a beam call to the full head)."""

    csv_safe = True  # reads no scores

    def __init__(self, m):
        self.m, self.seen = m, set()

    def __call__(self, ids, scores, **kwargs):
        self.seen |= _installed_now(self.m)
        return torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)


_CALL = {"_get_logits_processor", "_get_stopping_criteria", "_valid_auto_compile_criteria"}
_BEAM = {"_get_top_k_continuations", "_get_running_beams_for_next_iteration", "_update_finished_beams",
         "_check_early_stop_heuristic"}


@pytest.mark.parametrize("kind,expect", [
    ("greedy", _CALL),
    ("beam_exact", _CALL | _BEAM),
    ("beam_full", _CALL),
    ("assisted_sample", _CALL | {"_get_candidate_generator"}),
    ("raises", _CALL)])
def test_installed_during_the_call_and_nothing_left_behind(kind, expect):
    """Each call has exactly its touch points installed while it runs: the beam overrides only where the plan is the
    exact beam plan (not on a greedy call, nor on a beam call that runs the full head); none is left after."""
    torch.manual_seed(0)
    m = hf_csv.enable(tiny_llama(scale=20.0))
    x = {"input_ids": torch.tensor([[1, 5, 9, 3]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    probe = _Seen(m)
    gen = dict(x, max_new_tokens=4, pad_token_id=0, stopping_criteria=StoppingCriteriaList([probe]))
    if kind == "greedy":
        out = m.generate(**gen, do_sample=False, repetition_penalty=1.2, csv_config=CSVConfig(),
                         return_dict_in_generate=True)
        assert out.csv_stats["mode"] != "full"
    elif kind.startswith("beam"):
        cfg = CSVConfig(beam_search="exact") if kind == "beam_exact" else CSVConfig()
        out = m.generate(**gen, num_beams=2, do_sample=False, csv_config=cfg, return_dict_in_generate=True)
        assert (out.csv_stats["mode"] == "full") == (kind == "beam_full"), out.csv_stats["mode"]
    elif kind == "assisted_sample":
        draft = tiny_llama(scale=20.0)
        m.generate(**gen, do_sample=True, top_k=0, temperature=0.8, assistant_model=draft, csv_config=CSVConfig())
        assert not _left_behind(draft), _left_behind(draft)
    else:
        class Boom(LogitsProcessor):
            csv_kind = "lower"

            def __call__(self, ids, s):
                probe.seen |= _installed_now(m)
                raise RuntimeError("boom")

        gen["logits_processor"] = LogitsProcessorList([Boom()])
        with pytest.raises(RuntimeError, match="boom"):
            m.generate(**gen, csv_config=CSVConfig())
    assert probe.seen == expect, (kind, sorted(probe.seen ^ expect))
    assert not _left_behind(m), _left_behind(m)
