"""hf_csv.transformers.patches: the list of touch points in code, the call sites and docs/design.md agree, an unlisted override is
refused, and every per-call touch point is gone after a call of each kind, also after an exception."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import hf_csv
from hf_csv import CSVConfig
from hf_csv.core.errors import CSVError
from hf_csv.transformers.patches import TOUCH_POINTS, instance_override

from conftest import tiny_llama

ROOT = Path(__file__).resolve().parents[1]
INSTANCE = {p.target: p for p in TOUCH_POINTS if p.kind == "instance"}


def _override_sites() -> dict[str, set[str]]:
    """hf_csv module -> the names it passes to instance_override (string literals)."""
    sites: dict[str, set[str]] = {}
    for path in (ROOT / "hf_csv" / "transformers").glob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == "instance_override":
                if path.stem == "patches":
                    continue
                name = n.args[1]
                assert isinstance(name, ast.Constant), f"{path.name}: instance_override with a computed name"
                sites.setdefault(path.stem, set()).add(name.value)
    return sites


def test_every_override_site_is_a_listed_point_of_its_owner_and_every_point_is_used():
    sites = _override_sites()
    used = {name: mod for mod, names in sites.items() for name in names}
    assert set(used) == set(INSTANCE), (sorted(set(used) ^ set(INSTANCE)))
    for name, mod in used.items():
        assert INSTANCE[name].owner == mod, (name, mod, INSTANCE[name].owner)


def test_design_doc_lists_every_touch_point():
    text = (ROOT / "docs" / "design.md").read_text()
    section = text[text.index("## Where transformers is touched"):text.index("## Where the proofs live")]
    for p in TOUCH_POINTS:
        if p.kind == "instance":
            assert f"`{p.target}`" in section, p.target
    assert "_speculative_sampling" in section and "hooks" in section and "CSVHead" in section


def test_an_unlisted_override_is_refused():
    m = tiny_llama()
    with pytest.raises(CSVError, match="not a documented touch point"):
        with instance_override(m, "_prepare_cache_for_generation", lambda orig: orig):
            pass
    assert "_prepare_cache_for_generation" not in m.__dict__


def _left_behind(m) -> list:
    left = [name for name in INSTANCE if name in m.__dict__]
    if not isinstance(m.lm_head, torch.nn.Linear) or type(m.lm_head).__name__ != "Linear":
        left.append("lm_head")
    if m._forward_hooks or m._forward_pre_hooks:
        left.append("hooks")
    from transformers.generation import utils as gen_utils

    if getattr(gen_utils._speculative_sampling, "__module__", "").startswith("hf_csv"):
        left.append("_speculative_sampling")
    return left


class _Seen(LogitsProcessor):
    """Records which per-call touch points are installed on the model while a step runs (returns its input)."""

    csv_kind = "order"
    csv_identity = True

    def __init__(self, m):
        self.m, self.seen = m, set()

    def __call__(self, ids, s):
        self.seen |= {name for name in INSTANCE if name in self.m.__dict__}
        return s


_CALL = {"_get_logits_processor", "_get_stopping_criteria", "_valid_auto_compile_criteria"}


@pytest.mark.parametrize("kind,expect", [
    ("greedy", _CALL),
    ("beam_exact", _CALL | {"_get_top_k_continuations", "_get_running_beams_for_next_iteration",
                            "_update_finished_beams", "_check_early_stop_heuristic"}),
    ("assisted_sample", _CALL | {"_get_candidate_generator"}),
    ("raises", _CALL)])
def test_installed_during_the_call_and_nothing_left_behind(kind, expect):
    torch.manual_seed(0)
    m = hf_csv.enable(tiny_llama(scale=20.0))
    x = {"input_ids": torch.tensor([[1, 5, 9, 3]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    probe = _Seen(m)
    gen = dict(x, max_new_tokens=4, pad_token_id=0, logits_processor=LogitsProcessorList([probe]))
    if kind == "greedy":
        m.generate(**gen, do_sample=False, repetition_penalty=1.2, csv_config=CSVConfig())
    elif kind == "beam_exact":
        m.generate(**gen, num_beams=2, do_sample=False, csv_config=CSVConfig(beam_search="exact"))
    elif kind == "assisted_sample":
        draft = tiny_llama(scale=20.0)
        m.generate(**gen, do_sample=True, top_k=0, temperature=0.8, assistant_model=draft, csv_config=CSVConfig())
        assert not _left_behind(draft), _left_behind(draft)
    else:
        class Boom(LogitsProcessor):
            csv_kind = "lower"

            def __call__(self, ids, s):
                raise RuntimeError("boom")

        gen["logits_processor"].append(Boom())
        with pytest.raises(RuntimeError, match="boom"):
            m.generate(**gen, csv_config=CSVConfig())
    assert probe.seen >= expect, (kind, sorted(expect - probe.seen))
    assert not _left_behind(m), _left_behind(m)


def test_the_cached_head_gets_no_attributes_from_other_modules(monkeypatch):
    """Per-weight state other modules keep (the speed guard, compiled static heads, the weights' key) lives in the
    cache entry (hf_csv.transformers.session.HeadEntry), not on the CertifiedHead: after certified calls the head holds only what its
    own methods set (the same attributes as after calling them directly)."""
    import hf_csv.core.speed as speed
    from hf_csv.transformers.session import find_head, head_entry

    monkeypatch.setattr(speed, "MIN_WEIGHTS", 0)  # (a guard for the tiny head)
    m = hf_csv.enable(tiny_llama(scale=20.0))
    x = {"input_ids": torch.tensor([[1, 5, 9, 3]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    for kw in (dict(do_sample=False), dict(do_sample=False, repetition_penalty=1.3), dict(do_sample=True, top_k=5)):
        m.generate(**x, max_new_tokens=5, pad_token_id=0, csv_config=CSVConfig(), **kw)
    entry = head_entry(find_head(m)[1], CSVConfig())
    assert entry.guard is not None and entry.guard._state, "the speed guard was not used"
    ch = entry.head
    fresh = type(ch)(m.lm_head.weight if not hasattr(m.lm_head, "inner") else m.lm_head.inner.weight)
    fresh.topk(torch.randn(2, ch.weight.shape[1]), 3)
    fresh.sample(torch.randn(2, ch.weight.shape[1]))
    extra = set(vars(ch)) - set(vars(fresh))
    assert not extra, f"attributes on the cached certified head that its own calls do not set: {sorted(extra)}"
