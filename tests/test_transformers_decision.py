"""hf_csv.transformers.decision: which certificate a ``generate`` call gets (``set_plan``), and the calls it declines with a
logged reason (processors, warpers, stopping criteria, assisted sampling without a certificate)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import (GenerationConfig, StoppingCriteria, StoppingCriteriaList, TemperatureLogitsWarper,
                          TopKLogitsWarper)

import hf_csv
from hf_csv import CSVConfig
from hf_csv.transformers.call_facts import gather_facts
from hf_csv.transformers.decision import choose_plan
from hf_csv.transformers.plans import Full, Sample
from hf_csv.transformers.posthead import PostHead
from hf_csv.transformers.session import CSVSession
from conftest import ALPHA, _ids, spec_llama, tiny_llama


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
    """The beam-search notice goes through transformers' logging (logger ``transformers.hf_csv.transformers.decision``), so
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
        assert len(got) == 1 and got[0].name == "transformers.hf_csv.transformers.decision" and got[0].levelno == logging.WARNING
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


# ------------------------------------------------------------------ value-reading sampling and the column-subset probe
_PROBE_WARNING = "uses the full head here"


@pytest.mark.parametrize("kw", [
    dict(top_k=50),
    dict(top_k=50, temperature=0.7),
    dict(top_k=20, temperature=0.8),
    dict(top_k=50, top_p=0.9),
    dict(top_k=40, temperature=0.7, repetition_penalty=1.2),
    dict(top_k=0, min_p=0.1),
    dict(top_k=0, top_p=0.9),
], ids=["top_k", "top_k_temperature", "top_k20_temperature", "top_k_top_p", "top_k_penalty", "min_p", "top_p"])
def test_value_reading_sampling_where_the_probe_finds_no_kernel_is_stocks_full_head(monkeypatch, caplog, kw):
    """Issue: on a head whose column-subset probe fails (a tiny Llama, V 4099, d 64: every MKL code path of this
    project's host), the probe warned that value-reading sampling "uses the full head here", but top-k sampling (with
    or without a temperature) ran hf_csv's own draw (``mode=sample``, 9 of 10 rows certified): the law, not stock's
    tokens for the seed, which README and the user guide promise. Now every sampling call the docs promise stock's
    tokens for takes the full head with the probe's reason, on the first call (which runs the probe) and later
    ones, and returns stock's tokens for the same seed."""
    import copy
    import logging

    from hf_csv.core.certificate import probes
    monkeypatch.setattr(probes, "probe_subset_kernel", lambda *a, **k: None)  # no kernel matches, on any host
    ref = tiny_llama(vocab=4099, scale=20.0)
    m = hf_csv.enable(copy.deepcopy(ref))
    x = _ids(batch=1, vocab=4099)
    gen = dict(max_new_tokens=10, do_sample=True, **kw)
    for call in ("first", "later"):
        torch.manual_seed(0)
        want = ref.generate(**x, **gen)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hf_csv"):
            torch.manual_seed(0)
            got = m.generate(**x, **gen, csv_config=CSVConfig())
        st = m.csv_last_stats
        assert torch.equal(got, want), (call, got, want)
        assert st["mode"] == "full" and st.get("certified", 0) == 0, (call, st)
        assert len(st["reasons"]) == 1 and "column subset" in st["reasons"][0], (call, st["reasons"])
        assert "the full head, stock's tokens for the seed" in st["reasons"][0], (call, st["reasons"])
        warned = [r.getMessage() for r in caplog.records if "column subset" in r.getMessage()]
        if call == "first":  # the probe runs (once per head and setting) and says what the call then does
            assert len(warned) == 1 and _PROBE_WARNING in warned[0], warned
        else:
            assert warned == [], warned


def test_sample_mode_keeps_the_own_draw_where_the_probe_finds_no_kernel(monkeypatch):
    """``CSVConfig(mode="sample")`` asks for hf_csv's own draw (stock's law, not its stream) on any host: it reads no
    value bit for bit, so a failing probe leaves it as it is, and the stats say so (``mode=sample``)."""
    from hf_csv.core.certificate import probes
    monkeypatch.setattr(probes, "probe_subset_kernel", lambda *a, **k: None)
    m = hf_csv.enable(tiny_llama(vocab=4099, scale=20.0))
    m.generate(**_ids(batch=1, vocab=4099), max_new_tokens=4, do_sample=True, top_k=50,
               csv_config=CSVConfig(mode="sample"))
    st = m.csv_last_stats
    assert st["mode"] == "sample" and st["certified"] > 0 and st["reasons"] == [], st


def test_top_k_sampling_where_the_probe_finds_a_kernel_is_certified_and_stocks_tokens():
    """The positive control: where this host's probe finds a kernel (a tiny Llama, V 1031: the blocked kernel on
    this project's host, every MKL code path), top-k sampling runs the certified top-K plan and stock's sampler on
    stock's values: stock's tokens for the seed, rows certified, no reason."""
    import copy

    from hf_csv.core.certificate import probe_subset_kernel

    ref = tiny_llama(vocab=1031, scale=20.0)
    if probe_subset_kernel(ref.lm_head.weight.detach(), None) is None:
        pytest.skip("this host's BLAS matches no subset kernel on this head")
    m = hf_csv.enable(copy.deepcopy(ref))
    x = _ids(batch=1, vocab=1031)
    for kw in (dict(top_k=50), dict(top_k=20, temperature=0.8)):
        gen = dict(max_new_tokens=10, do_sample=True, **kw)
        torch.manual_seed(0)
        want = ref.generate(**x, **gen)
        torch.manual_seed(0)
        got = m.generate(**x, **gen, csv_config=CSVConfig())
        st = m.csv_last_stats
        assert torch.equal(got, want), (kw, got, want)
        assert st["mode"] == "topk" and st["certified"] > 0 and st["reasons"] == [], (kw, st)


class ConfidenceStop(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        if not scores:
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)
        return torch.softmax(scores[-1].float(), -1).amax(-1) > 0.5


def test_stopping_criterion_reading_scores_declines(assume_subset_exact):  # scores="subvocab"
    m = hf_csv.enable(tiny_llama(scale=2.0))
    x = _ids(batch=1)
    kw = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_scores=True,
              stopping_criteria=StoppingCriteriaList([ConfidenceStop()]))
    a = m.generate(**x, **kw)
    b = m.generate(**x, **kw, csv_config=CSVConfig(scores="subvocab"))
    assert torch.equal(a.sequences, b.sequences)
    st = m.csv_last_stats
    assert st["mode"] == "full" and any("ConfidenceStop" in r for r in st["reasons"]) and st["declined_rows"] > 0
    ConfidenceStop.csv_safe = True  # a declared-safe criterion keeps the certificate
    try:
        m.generate(**x, max_new_tokens=4, do_sample=False, stopping_criteria=StoppingCriteriaList([ConfidenceStop()]),
                   csv_config=CSVConfig())
        assert m.csv_last_stats["mode"] == "topk"
    finally:
        del ConfidenceStop.csv_safe


@pytest.mark.parametrize("mode", ["auto", "topk", "sample"])
def test_beam_search_is_never_approximate_outside_epsilon_mode(mode, assume_subset_exact):
    m = hf_csv.enable(tiny_llama(scale=20.0))
    x = _ids()
    a = m.generate(**x, max_new_tokens=6, num_beams=3, do_sample=False)
    b = m.generate(**x, max_new_tokens=6, num_beams=3, do_sample=False, csv_config=CSVConfig(mode=mode))
    assert torch.equal(a, b)
    st = m.csv_last_stats
    assert st["mode"] == "full" and any("beam" in r for r in st["reasons"])
    m.generate(**x, max_new_tokens=2, num_beams=3, do_sample=False, csv_config=CSVConfig(mode="epsilon"))
    assert m.csv_last_stats["mode"] == "beam"


@pytest.mark.parametrize("kw", [{"do_sample": False}, {"do_sample": True, "top_k": 10}])
def test_output_scores_and_transition_scores_are_stock(kw):
    m = hf_csv.enable(tiny_llama(scale=5.0))
    x = _ids()
    torch.manual_seed(0)
    a = m.generate(**x, max_new_tokens=6, return_dict_in_generate=True, output_scores=True, **kw)
    torch.manual_seed(0)
    b = m.generate(**x, max_new_tokens=6, return_dict_in_generate=True, output_scores=True,
                   csv_config=CSVConfig(), **kw)
    assert torch.equal(a.sequences, b.sequences)
    assert all(torch.equal(s, t) for s, t in zip(a.scores, b.scores))
    ta = m.compute_transition_scores(a.sequences, a.scores, normalize_logits=True)
    tb = m.compute_transition_scores(b.sequences, b.scores, normalize_logits=True)
    assert torch.equal(ta, tb) and (ta < 0).all()
    assert any("output_scores" in r for r in m.csv_last_stats["reasons"])


def test_custom_order_processor_reaches_the_sampling_law():
    """A processor declaring csv_kind="order" (x -> 3x keeps every argmax, changes the law) was ignored by the head's
    own draw with do_sample=True, top_k=0: chi-square p = 0 against stock's law. Now such a call uses the full head."""
    import numpy as np
    from scipy import stats as sps
    from transformers import LogitsProcessor, LogitsProcessorList

    class Triple(LogitsProcessor):
        csv_kind = "order"

        def __call__(self, input_ids, scores):
            return scores * 3

    m = hf_csv.enable(tiny_llama(scale=2.0))
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        law = torch.softmax(m(ids).logits[0, -1].float() * 3, -1).numpy().astype(np.float64)
    draws = []
    torch.manual_seed(0)
    for _ in range(5):
        out = m.generate(ids.repeat(400, 1), max_new_tokens=1, do_sample=True, top_k=0,
                         logits_processor=LogitsProcessorList([Triple()]), csv_config=CSVConfig())
        draws.append(out[:, -1].numpy())
    st = m.csv_last_stats
    assert st["mode"] == "full" and "Triple" in " ".join(st["reasons"])
    n = np.bincount(np.concatenate(draws), minlength=len(law))
    keep = law * n.sum() >= 5
    obs = np.append(n[keep], n[~keep].sum()).astype(float)
    exp = np.append(law[keep], law[~keep].sum()) * n.sum()
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    assert sps.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > ALPHA


def test_masks_only_recognises_exactly_the_masking_processors():
    from transformers import (MinNewTokensLengthLogitsProcessor, NoRepeatNGramLogitsProcessor,
                              RepetitionPenaltyLogitsProcessor, SuppressTokensLogitsProcessor,
                              TemperatureLogitsWarper)

    from hf_csv.transformers.processor_kinds import masks_only

    sup = SuppressTokensLogitsProcessor([5, 7])
    assert masks_only([sup, NoRepeatNGramLogitsProcessor(2), MinNewTokensLengthLogitsProcessor(3, 2, 2)])
    assert masks_only([])
    assert not masks_only([sup, TemperatureLogitsWarper(0.7)])  # a value map, not a mask
    assert not masks_only([RepetitionPenaltyLogitsProcessor(1.3)])  # lowers by an amount

    class Mine(SuppressTokensLogitsProcessor):  # a subclass may do anything: not trusted by name
        pass

    class Declared:
        csv_masks_only = True

    assert not masks_only([Mine([1])])
    assert masks_only([Declared()])


# ------------------------------------------------------------------ choose_plan on hand-built facts (pure)
class _Head:
    weight, vocab_size = torch.zeros(2, 2, dtype=torch.bfloat16), 1000

    def subset_exact(self):
        return True


def _facts(*processors, config=None, **kw):
    """The facts of a plain call on a bf16 head with ``processors``, then ``kw`` set."""
    sess = CSVSession(model=None, config=config or CSVConfig(), head=_Head(), out_dtype=torch.bfloat16,
                      post=PostHead())
    return dataclasses.replace(gather_facts(sess, GenerationConfig(), list(processors)), **kw)


def test_choose_plan_is_the_same_decision_for_the_same_facts():
    f = _facts(TopKLogitsWarper(20), do_sample=True)
    assert choose_plan(f) == choose_plan(f)
    assert choose_plan(f).plan.name == "topk" and choose_plan(f).reasons == ()


def test_the_values_gate_sends_value_reading_plans_to_the_full_head_or_the_coupled_draw():
    top_k = TopKLogitsWarper(20)
    d = choose_plan(_facts(top_k, do_sample=True, subset_exact=lambda: False))
    assert isinstance(d.plan, Full) and len(d.reasons) == 1 and not d.own_draw
    assert d.reasons[0].startswith("top-k sampling with stock's sampler: needs stock's values on S bit for bit")
    d = choose_plan(_facts(top_k, do_sample=True, gumbel=True, subset_exact=lambda: False))
    assert d.plan == Sample(warps=(("top_k", 20),)) and d.own_draw and "draws in the head itself" in d.reasons[0]
    # greedy reads no value: the head's own values serve, probe or not
    assert choose_plan(_facts(subset_exact=lambda: False)).plan.own_values


def test_whispers_steps_and_whose_values_serve():
    d = choose_plan(_facts(whisper_scores_internal=True, logprob_threshold=-1.0))
    assert d.whisper_record and d.plan.check_processed and not d.plan.own_values  # the avg-logprob rule reads them
    d = choose_plan(_facts(TemperatureLogitsWarper(0.7), do_sample=True, whisper_scores_internal=True,
                           logprob_threshold=-1.0))
    assert isinstance(d.plan, Full) and "certified for greedy rounds only" in d.reasons[0]

    class WhisperNoSpeechDetection:  # read by name, like transformers' own
        start_of_trans_offset = 1

    assert choose_plan(_facts(WhisperNoSpeechDetection())).plan.check_processed
    d = choose_plan(_facts(draft=True, confidence_threshold=0.4))
    assert d.plan.stock_values and not d.plan.own_values  # the probe gives stock's bits to the confidence stop
