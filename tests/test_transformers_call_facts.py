"""hf_csv.transformers.call_facts: the facts a call's plan depends on, gathered in one place, and the decision the
choice returns (a frozen value: each step returns a new one)."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig, MinLengthLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper

from hf_csv import CSVConfig
from hf_csv.transformers.call_facts import FULL_LEAD, Decision, gather_facts, whisper_log_prob_reason
from hf_csv.transformers.plans import FULL, TopK
from hf_csv.transformers.posthead import PostHead
from hf_csv.transformers.session import CSVSession


class _Head:
    """A certified head's face as the facts read it; counts the column-subset probes asked."""

    def __init__(self, dtype=torch.bfloat16):
        self.weight, self.vocab_size, self.probes = torch.zeros(2, 2, dtype=dtype), 1000, 0

    def subset_exact(self):
        self.probes += 1
        return True


def _session(**kw) -> CSVSession:
    head = kw.pop("head", _Head())
    return CSVSession(model=None, config=CSVConfig(), head=head, out_dtype=torch.float32, post=PostHead(), **kw)


def test_gather_reads_the_generation_config_as_generate_does():
    sess = _session(input_len=5)
    gc = GenerationConfig(do_sample=True, num_beams=1, output_scores=True, guidance_scale=1.0,
                          assistant_confidence_threshold=None)
    procs = [MinLengthLogitsProcessor(5, 2), TemperatureLogitsWarper(0.7), TopKLogitsWarper(20)]
    f = gather_facts(sess, gc, procs)
    assert f.do_sample and f.num_beams == 1 and f.processors == tuple(procs)
    assert not f.output_scores  # (scores are returned only with return_dict_in_generate)
    assert not f.guidance and f.confidence_threshold == 0.0 and not f.coupled
    # a minimum length reached at the input length lowers nothing: no 'lower' kind
    assert f.kinds == {"order": ["TemperatureLogitsWarper"], "topk": ["TopKLogitsWarper"]}
    gc2 = GenerationConfig(return_dict_in_generate=True, output_scores=True, guidance_scale=1.5)
    f2 = gather_facts(_session(gumbel=object()), gc2, [])
    assert f2.output_scores and f2.guidance and f2.gumbel and not f2.coupled  # (coupled: sampling only)


def test_the_probe_and_the_generation_mode_are_asked_only_where_a_step_needs_them():
    head = _Head()
    f = gather_facts(_session(head=head), GenerationConfig(num_beams=3), [])
    assert head.probes == 0
    assert f.subset_exact() and head.probes == 1
    assert str(getattr(f.generation_mode(), "value", None)) == "beam_search"


def test_reduced_fp32_matmul_precision_is_a_fact_for_fp32_heads_only():
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        assert gather_facts(_session(head=_Head(torch.float32)), GenerationConfig(), []).fp32_reason is not None
        assert gather_facts(_session(head=_Head(torch.bfloat16)), GenerationConfig(), []).fp32_reason is None
    finally:
        torch.set_float32_matmul_precision(prev)


def test_decision_notes_each_reason_once_and_says_it_once():
    d = Decision().note("a").note("b", "lead: ").note("a")
    assert d.reasons == ("a", "b") and d.said == (("", "a"), ("lead: ", "b"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.plan = FULL  # type: ignore[misc]


def test_decision_full_drops_the_plan_and_whispers_record():
    d = dataclasses.replace(Decision(), plan=TopK(k=1), whisper_record=True).full("why")
    assert d.plan is FULL and not d.whisper_record and d.reasons == ("why",) and d.said == ((FULL_LEAD, "why"),)
    assert Decision().warn_beams(1).beams_warned == 0 and Decision().warn_beams(5).beams_warned == 5


def test_whisper_log_prob_reason_reads_kwargs_and_every_config():
    assert whisper_log_prob_reason(None, SimpleNamespace()) is None
    assert "return_token_timestamps" in whisper_log_prob_reason(SimpleNamespace(return_token_timestamps=True))
    assert whisper_log_prob_reason(SimpleNamespace(), kwargs={"return_token_timestamps": True}) is not None
