"""hf_csv.transformers.processor_kinds: how each processor and stopping criterion relates to a certificate (the kinds of
docs/processors.md), and the processors before a check sorted by kind once per call."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import (LogitsProcessor, MaxLengthCriteria, MinLengthLogitsProcessor,
                          MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                          SequenceBiasLogitsProcessor, StoppingCriteria, SuppressTokensLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from hf_csv.transformers.enable import classify_processor
from hf_csv.transformers.processor_kinds import classify_stopping_criterion, inert, orders, prefix


def test_classify_custom_processor():
    class Mine(LogitsProcessor):
        def __call__(self, ids, s):
            return s

    assert classify_processor(Mine()) == "full"
    Mine.csv_kind = "lower"
    assert classify_processor(Mine()) == "lower"


@pytest.mark.parametrize("proc, kind", [
    (TemperatureLogitsWarper(0.7), "order"),
    (TopKLogitsWarper(5), "topk"),
    (TopKLogitsWarper(5, filter_value=-1e4), "full"),  # a finite filter value leaves the filtered tokens mass
    (TopPLogitsWarper(0.9), "norm"),
    (RepetitionPenaltyLogitsProcessor(1.3), "lower"),
    (RepetitionPenaltyLogitsProcessor(0.8), "full"),  # < 1 raises the seen tokens' scores
    (SequenceBiasLogitsProcessor({(5,): -2.0}), "lower"),
    (SequenceBiasLogitsProcessor({(5,): 2.0}), "full"),
    (SuppressTokensLogitsProcessor([3]), "lower"),
])
def test_stock_processors_classify_by_what_they_do_to_uncomputed_scores(proc, kind):
    assert classify_processor(proc) == kind


def test_a_minimum_length_already_reached_is_inert():
    """transformers gives every assistant call min_new_tokens=0 (a MinLengthLogitsProcessor at the input length):
    it lowers nothing in the call, so it counts as no processor."""
    assert inert(MinLengthLogitsProcessor(5, 2), input_len=5)
    assert not inert(MinLengthLogitsProcessor(6, 2), input_len=5)
    assert not inert(MinLengthLogitsProcessor(5, 2), input_len=None)
    assert inert(MinNewTokensLengthLogitsProcessor(3, 0, 2), input_len=None)
    assert not inert(TemperatureLogitsWarper(0.7), input_len=5)


def test_stopping_criteria_are_safe_only_when_they_never_read_the_scores():
    class Reads(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return scores

    assert classify_stopping_criterion(MaxLengthCriteria(10)) == "safe"
    assert classify_stopping_criterion(Reads()) == "full"
    Reads.csv_safe = True
    assert classify_stopping_criterion(Reads()) == "safe"


def test_prefix_sorts_the_processors_before_the_check_once_per_call():
    """The processors before the check ``c``: every one, the order-preserving ones the bounds run through, those a
    re-run repeats (not identity wrappers, not inert ones), and whether they only mask; cached on the session."""
    temp, pen, sup = TemperatureLogitsWarper(0.7), RepetitionPenaltyLogitsProcessor(1.3), SuppressTokensLogitsProcessor([3])
    ident = SimpleNamespace(csv_identity=True)
    done = MinLengthLogitsProcessor(3, 2)  # reached at the input length: inert
    c, after = object(), TopPLogitsWarper(0.9)
    sess = SimpleNamespace(check_prefix=None, processors=[temp, ident, done, pen, c, after], input_len=5)
    got = prefix(c, sess)
    assert got.every == (temp, ident, done, pen) and got.orders == (temp,) and got.runs == (temp, pen)
    assert not got.masks_only and orders(c, sess) == (temp,)
    assert prefix(c, sess) is got and sess.check_prefix is got  # once per call
    sess2 = SimpleNamespace(check_prefix=None, processors=[sup, c], input_len=None)
    assert prefix(c, sess2).masks_only
