"""hf_csv.transformers.method_plans: the plan of each decoding method, a pure function of the call's facts (built here
by hand: no model, no generate)."""
from __future__ import annotations

import dataclasses

import torch
from transformers import (GenerationConfig, LogitNormalization, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, TypicalLogitsWarper)

from hf_csv import CSVConfig
from hf_csv.core.config import lowered_k
from hf_csv.transformers.call_facts import FULL_LEAD, CallFacts, Decision, gather_facts
from hf_csv.transformers.method_plans import method_plan, warps_of
from hf_csv.transformers.plans import Bounded, Epsilon, ExactBeam, Full, Nucleus, Sample, Threshold, TopK
from hf_csv.transformers.posthead import PostHead
from hf_csv.transformers.session import CSVSession

V = 1000


class _Head:
    weight, vocab_size = torch.zeros(2, 2, dtype=torch.bfloat16), V

    def subset_exact(self):
        return True


def facts(*processors, config: CSVConfig = CSVConfig(), **kw) -> CallFacts:
    """The facts of a plain call on a bf16 head of V tokens with ``processors``, then ``kw`` set."""
    sess = CSVSession(model=None, config=config, head=_Head(), out_dtype=torch.bfloat16, post=PostHead())
    return dataclasses.replace(gather_facts(sess, GenerationConfig(), list(processors)), **kw)


class WhisperTimeStampLogitsProcessor:  # read by name, like transformers' own
    timestamp_begin, eos_token_id = 900, 899


def test_greedy_is_certified_top_1_checked_only_after_lowering_processors_or_a_post_map():
    assert method_plan(facts(), Decision()).plan == TopK(k=1)
    pen = RepetitionPenaltyLogitsProcessor(1.3)
    assert method_plan(facts(pen), Decision()).plan == TopK(k=1, check_processed=True, k_head=lowered_k(1, V))
    assert method_plan(facts(post=PostHead("softcap", 30.0)), Decision()).plan == TopK(k=1, check_processed=True)
    d = method_plan(facts(LogitNormalization()), Decision())
    assert isinstance(d.plan, Full) and d.reasons == ("greedy with normalizing processors ['LogitNormalization']",)


def test_sampling_plans_in_their_order():
    temp, top_k, top_p = TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.9)
    d = method_plan(facts(temp, top_k, top_p, do_sample=True), Decision())
    assert d.plan == TopK(k=20, check_processed=True, check_after=top_k) and d.reasons == ()
    assert isinstance(method_plan(facts(MinPLogitsWarper(0.1), do_sample=True), Decision()).plan, Threshold)
    assert isinstance(method_plan(facts(temp, top_p, do_sample=True), Decision()).plan, Nucleus)
    assert method_plan(facts(temp, do_sample=True), Decision()).plan == Sample(warps=(("temperature", 0.7),))
    pen = RepetitionPenaltyLogitsProcessor(1.3)
    assert method_plan(facts(pen, do_sample=True), Decision()).plan == Sample(check_processed=True, draw_after=True)
    # CSVConfig(mode="sample"): the head's own draw models the top-k filter too
    d = method_plan(facts(temp, top_k, config=CSVConfig(mode="sample"), do_sample=True), Decision())
    assert d.plan == Sample(warps=(("temperature", 0.7), ("top_k", 20)))
    typical = TypicalLogitsWarper(0.9)
    assert isinstance(method_plan(facts(typical, do_sample=True), Decision()).plan, Full)
    assert isinstance(method_plan(facts(typical, config=CSVConfig(mode="epsilon"), do_sample=True),
                                  Decision()).plan, Epsilon)


def test_warps_are_what_the_own_draw_models():
    assert warps_of((TemperatureLogitsWarper(0.5), TopKLogitsWarper(7), TopKLogitsWarper(3))) == (
        0.5, 3, [("temperature", 0.5), ("top_k", 7), ("top_k", 3)])


def test_beam_search_takes_the_full_head_by_default_and_warns():
    d = method_plan(facts(num_beams=3), Decision())
    assert isinstance(d.plan, Full) and d.beams_warned == 3 and d.said[0][0] == FULL_LEAD
    exact = CSVConfig(beam_search="exact")
    d = method_plan(facts(config=exact, num_beams=3, eos_token_id=[2, 3],
                          generation_mode=lambda: "beam_search"), Decision())
    assert d.plan == ExactBeam(k=3 * 3) and d.reasons == ()  # S holds every row's top (1 + eos count)·beams
    d = method_plan(facts(config=CSVConfig(beam_search="exact", mode="epsilon"), num_beams=2, caller_cache=True,
                          generation_mode=lambda: "beam_search"), Decision())
    assert isinstance(d.plan, Epsilon) and d.plan.beams == 2 and d.beams_warned == 0
    assert d.reasons[0].startswith("token-identical beam search declined (beam search with a cache passed")


def test_whisper_timestamps_keep_the_timestamp_block_in_greedy_rounds_only():
    ts = WhisperTimeStampLogitsProcessor()
    assert method_plan(facts(ts), Decision()).plan == TopK(k=1, check_processed=True, ts_proc=ts, always=V - 899)
    d = method_plan(facts(ts, num_beams=2), Decision())
    assert isinstance(d.plan, Full) and d.beams_warned == 2


def test_drafts_and_assisted_sampling():
    d = method_plan(facts(draft=True, confidence_threshold=0.4), Decision())
    assert d.plan == TopK(k=1, check_processed=True, k_head=lowered_k(1, V), confidence=0.4)
    d = method_plan(facts(TemperatureLogitsWarper(0.7), draft=True, do_sample=True), Decision())
    assert d.plan == TopK(k=CSVConfig().draft_top_k, fill_est=True)  # the screen's estimates keep q's tail
    d = method_plan(facts(draft=True, do_sample=True, stock_drafts="declined"), Decision())
    assert isinstance(d.plan, Full) and "declined" in d.reasons[0]
    temp = TemperatureLogitsWarper(0.7)
    assert method_plan(facts(temp, assisted=True, do_sample=True, spec_ok=True), Decision()).plan == \
        Bounded(temperature=0.7)
    d = method_plan(facts(temp, assisted=True, do_sample=True), Decision())
    assert isinstance(d.plan, Full) and "CSVConfig(speculative='exact')" in d.reasons[0]
