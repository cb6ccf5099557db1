"""hf_csv.policy: which certificate a ``generate`` call gets (``decide_mode``), and the calls it declines with a
logged reason (processors, warpers, stopping criteria, assisted sampling without a certificate)."""
from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_csv
from hf_csv import CSVConfig

from conftest import _ids, spec_llama, tiny_llama


@pytest.mark.parametrize("kw,mode,reason", [
    ({}, "topk", None),
    ({"repetition_penalty": 1.2}, "topk", None),
    ({"do_sample": True}, "topk", None),  # transformers' default top_k=50: checked top-K, stock sampler
    ({"do_sample": True, "temperature": 0.7, "top_k": 20}, "topk", None),
    ({"do_sample": True, "top_k": 20, "top_p": 0.8, "temperature": 0.7, "repetition_penalty": 1.05}, "topk", None),
    ({"do_sample": True, "top_k": 0}, "sample", None),
    ({"do_sample": True, "top_k": 0, "temperature": 0.7}, "sample", None),
    ({"do_sample": True, "top_k": 0, "top_p": 0.9}, "nucleus", None),
    ({"do_sample": True, "top_k": 0, "min_p": 0.1}, "threshold", None),  # min-p alone: threshold certificate
    ({"do_sample": True, "top_k": 0, "min_p": 0.1, "temperature": 0.8, "repetition_penalty": 1.3}, "threshold", None),
    ({"do_sample": True, "top_k": 0, "min_p": 0.1, "top_p": 0.9}, "full", "TopPLogitsWarper"),
    ({"do_sample": True, "top_k": 0, "repetition_penalty": 1.2}, "sample", None),  # draw after the lowering processors
    ({"do_sample": True, "top_k": 0, "repetition_penalty": 1.2, "top_p": 0.9}, "nucleus", None),
    ({"do_sample": True, "top_k": 0, "typical_p": 0.9}, "full", "normalizing warper"),
    ({"num_beams": 2}, "full", "log_softmax"),
    ({"output_logits": True, "return_dict_in_generate": True}, "full", "output_logits"),
    ({"repetition_penalty": 0.8}, "full", "RepetitionPenalty"),
    ({"sequence_bias": {(5,): 3.0}}, "full", "SequenceBias"),
    ({"exponential_decay_length_penalty": (2, 1.5), "eos_token_id": 2}, "full", "ExponentialDecay"),
])
def test_processor_matrix(llama, kw, mode, reason, assume_subset_exact):  # the stock-stream plans
    llama.generate(**_ids(), max_new_tokens=2, csv_config=CSVConfig(), **kw)
    st = llama.csv_last_stats
    assert st["mode"] == mode, st
    if reason:
        assert any(reason in r for r in st["reasons"]), st["reasons"]
    else:
        assert st["reasons"] == []


def test_epsilon_mode_for_typical_and_exact_nucleus_for_top_p(llama, assume_subset_exact):
    llama.generate(**_ids(), max_new_tokens=2, do_sample=True, top_k=0, typical_p=0.9, csv_config=CSVConfig(mode="epsilon"))
    assert llama.csv_last_stats["mode"] == "epsilon"
    # an exact certificate exists for top-p: mode="epsilon" allows approximation, it does not ask for it
    llama.generate(**_ids(), max_new_tokens=2, do_sample=True, top_k=0, top_p=0.9, csv_config=CSVConfig(mode="epsilon"))
    assert llama.csv_last_stats["mode"] == "nucleus"


class ReadsScores(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.usefixtures("assume_subset_exact")
def test_declined_after_the_list_is_built_still_applies_top_p():
    """A stopping criterion that may read scores declines the call after the processors were built (the
    CSVLogitsProcessor already sits in the top-p warper's place): it must run stock's warper then."""
    m = hf_csv.enable(tiny_llama(scale=30.0))
    ids = _ids(batch=2)
    kw = dict(max_new_tokens=12, do_sample=True, top_p=0.6, top_k=0, stopping_criteria=StoppingCriteriaList([ReadsScores()]))
    torch.manual_seed(0)
    x = m.generate(**ids, **kw)
    torch.manual_seed(0)
    y = m.generate(**ids, **kw, csv_config=CSVConfig(budget=0.3))
    assert torch.equal(x, y)
    assert m.csv_last_stats["mode"] == "full"


@pytest.mark.usefixtures("assume_subset_exact")
@pytest.mark.parametrize("kw, why", [
    (dict(top_p=0.9, top_k=0, min_p=0.1), "normalizing warpers"),
    (dict(top_p=0.9, top_k=0, typical_p=0.9), "normalizing warpers"),
])
def test_other_normalizing_warpers_with_top_p_are_declined(kw, why):
    m = hf_csv.enable(tiny_llama(scale=30.0))
    torch.manual_seed(0)
    x = m.generate(**_ids(batch=2), max_new_tokens=6, do_sample=True, **kw)
    torch.manual_seed(0)
    y = m.generate(**_ids(batch=2), max_new_tokens=6, do_sample=True, csv_config=CSVConfig(), **kw)
    assert torch.equal(x, y)
    st = m.csv_last_stats
    assert st["mode"] == "full" and any(why in r for r in st["reasons"]), st["reasons"]


@pytest.mark.usefixtures("assume_subset_exact")
@pytest.mark.parametrize("extra,why", [
    (dict(top_p=0.9, top_k=0), "TopPLogitsWarper"),
    (dict(top_k=0, repetition_penalty=1.2), "RepetitionPenaltyLogitsProcessor"),
])
def test_uncertified_assisted_sampling_says_why(spec_pair, extra, why):
    target, draft = spec_pair
    ids = torch.tensor([[5, 17, 33, 2, 9]])
    out = target.generate(ids, assistant_model=draft, do_sample=True, max_new_tokens=6, csv_config=CSVConfig(),
                          return_dict_in_generate=True, **extra)
    assert out.csv_stats["mode"] == "full"
    assert any(why in r for r in out.csv_stats["reasons"]), out.csv_stats["reasons"]


@pytest.mark.usefixtures("assume_subset_exact")
def test_prompt_lookup_sampling_never_uses_spec(spec_pair):
    """Prompt lookup has no draft logits: stock samples from the target's row itself, so it must be complete
    (or certified top-k), never the "spec" -inf-padded row."""
    target, _ = spec_pair
    ids = torch.tensor([[5, 17, 33, 5, 17, 33, 5, 17]])
    out = target.generate(ids, prompt_lookup_num_tokens=3, do_sample=True, top_k=0, max_new_tokens=6,
                          csv_config=CSVConfig(), return_dict_in_generate=True)
    assert out.csv_stats["mode"] == "full"
    out = target.generate(ids, assistant_model=spec_llama(1), do_sample=True, top_k=0, max_new_tokens=6,
                          csv_config=CSVConfig(speculative="stock"), return_dict_in_generate=True)
    assert out.csv_stats["mode"] == "full"


def test_beam_notice_is_a_transformers_log_record_the_user_can_filter(caplog):
    """The beam-search notice goes through transformers' logging (logger ``transformers.hf_csv.policy``), so
    transformers' verbosity applies: ``set_verbosity_error()`` silences it. Under the old ``hf_csv`` logger it
    ignored that and reached stderr through Python's last-resort handler as a bare line."""
    import logging

    from transformers.utils import logging as tlogging

    import hf_csv
    from conftest import tiny_llama

    m = hf_csv.enable(tiny_llama())
    ids = torch.tensor([[1, 2, 3]])

    def notices():
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            m.generate(input_ids=ids, max_new_tokens=2, num_beams=3, do_sample=False, csv_config=hf_csv.CSVConfig())
        return [r for r in caplog.records if "num_beams=3 runs the full LM head" in r.getMessage()]

    level = tlogging.get_verbosity()
    tlogging.enable_propagation()
    try:
        tlogging.set_verbosity_warning()
        got = notices()
        assert len(got) == 1 and got[0].name == "transformers.hf_csv.policy" and got[0].levelno == logging.WARNING
        tlogging.set_verbosity_error()
        assert notices() == []
        tlogging.set_verbosity_warning()
        logging.getLogger("transformers.hf_csv").setLevel(logging.ERROR)  # hf_csv's notices alone
        try:
            assert notices() == []
        finally:
            logging.getLogger("transformers.hf_csv").setLevel(logging.NOTSET)
    finally:
        tlogging.set_verbosity(level)
        tlogging.disable_propagation()
