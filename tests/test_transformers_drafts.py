"""hf_csv.transformers.drafts: the sub-vocabulary draft head in assisted generation (Llama-family and Whisper; truncated and
quantized assistants, the draft's confidence stop), and assisted top-k sampling with both heads certified: stock's
tokens, token for token, also under a differential fuzzer."""
import contextlib
import copy
import functools
import os
import random

import numpy as np
import pytest
import torch
from scipy import stats as sstats
from transformers import LlamaConfig, LlamaForCausalLM, WhisperForCausalLM

import hf_csv
from hf_csv import CSVConfig
from hf_csv.transformers.compat import support
from hf_csv.transformers.drafts import truncated_assistant

from conftest import model_dir, roc_adapts, SHARED, spec_llama, tiny_llama, _tiny_whisper, tokenizer
from test_stack_differential import _build


@pytest.fixture(autouse=True)
def _threshold_as_without_sklearn(request):
    """The certified draft head's tests run stock's fixed threshold in either environment (conftest.fixed_threshold);
    tests marked ``roc`` run stock's ROC adaptation wherever scikit-learn is installed."""
    if request.node.get_closest_marker("roc") is None:
        request.getfixturevalue("fixed_threshold")


def _llama(layers, seed, V=512, scale=8.0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=V - 1,
                      tie_word_embeddings=False)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(scale)  # peaked distributions, so that the screen prunes
    return m


@pytest.fixture(scope="module")
def pair():
    return hf_csv.enable(_llama(2, 0)), _llama(1, 1)


IDS = torch.tensor([[5, 17, 33, 2, 9]])


def _count_target_calls(model):
    calls = []
    h = model.register_forward_hook(lambda m, i, o: calls.append(1))
    return calls, h


def test_greedy_identical_and_draft_head_certified(pair):
    target, draft = pair
    plain = target.generate(IDS, max_new_tokens=24, do_sample=False)
    out = target.generate(IDS, assistant_model=draft, max_new_tokens=24, do_sample=False, csv_config=CSVConfig(),
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    d = out.csv_stats["draft"]
    # (a row whose confidence-stop decision the bounds leave open is stock's row: a fallback)
    assert d["mode"] == "topk" and d["rows"] > 0 and d["certified"] + d["fallback"] == d["rows"]
    assert d["certified"] >= 0.75 * d["rows"] and d["mean_subvocab_fraction"] < 0.5
    assert out.csv_stats["mode"] == "topk"  # the target verifies with the certified top-1 too


def _audit_pair(V, dtype, scale, seed, noise, noise_seed):
    """A target and a draft that is the target with its layers perturbed (an assistant that agrees often), drafting
    up to 20 tokens a round."""
    t = tiny_llama(vocab=V, scale=scale, seed=seed, eos=V - 1).to(dtype)
    d = copy.deepcopy(t)
    d.generation_config.num_assistant_tokens = 20
    d.generation_config.num_assistant_tokens_schedule = "constant"
    g = torch.Generator().manual_seed(noise_seed)
    with torch.no_grad():
        for prm in d.model.layers.parameters():
            prm.add_((noise * torch.randn(prm.shape, generator=g)).to(prm.dtype))
    return hf_csv.enable(t), d


def _lengths_and_out(t, ids, cfg, **kw):
    lens = []
    h = t.register_forward_pre_hook(lambda m, a, k: lens.append(
        (k.get("input_ids") if k.get("input_ids") is not None else a[0]).shape[1]), with_kwargs=True)
    try:
        out = t.generate(ids, **kw) if cfg is None else t.generate(ids, csv_config=cfg, **kw)
    finally:
        h.remove()
    return out, lens


@pytest.mark.parametrize("dtype,seed,ids", [
    (torch.float16, 2, [[447, 94, 1745, 934, 396]]),
    (torch.bfloat16, 1, [[1583, 81, 825, 1425, 1555, 1557, 1387, 1877]])])
def test_the_drafts_confidence_stop_takes_stocks_decisions(dtype, seed, ids):
    """The assistant's confidence stop decides how many tokens a round drafts, so the shapes of the target's verify
    forwards, whose float16/bfloat16 results depend on them. Its decisions are proved on each draft row or taken on
    stock's row (docs/certificates.md §3.11). Before: the draft's estimated tail gave other draft lengths, and
    certified greedy tokens differed from stock assisted's (the audit's pairs)."""
    t, d = _audit_pair(2048, dtype, 2.0, seed, 0.1, seed + 50)
    d.generation_config.assistant_confidence_threshold = 0.1
    ids = torch.tensor(ids)
    kw = dict(assistant_model=d, max_new_tokens=40, do_sample=False, pad_token_id=0)
    ref, lr = _lengths_and_out(t, ids, None, **kw)
    out, lo = _lengths_and_out(t, ids, CSVConfig(), **kw)
    st = t.csv_last_stats
    assert lo == lr and torch.equal(out, ref)
    assert st["mode"] == "topk" and st["certified"] > 0 and st["draft"]["certified"] > 0, st


def test_a_declined_target_with_a_certified_draft_keeps_stocks_scores():
    """output_scores declines the target, whose scores must be stock's; its draft stays certified, and its
    confidence stop must then draft as stock's does (other verify shapes gave other float32 scores)."""
    t, d = _audit_pair(97, torch.float32, 10.0, 2, 0.02, 102)
    d.generation_config.assistant_confidence_threshold = 0.4
    ids = torch.randint(2, 97, (1, 2), generator=torch.Generator().manual_seed(499))
    kw = dict(assistant_model=d, max_new_tokens=22, do_sample=False, no_repeat_ngram_size=3,
              return_dict_in_generate=True, output_scores=True, pad_token_id=0)
    ref, lr = _lengths_and_out(t, ids, None, **kw)
    out, lo = _lengths_and_out(t, ids, CSVConfig(), **kw)
    st = t.csv_last_stats
    assert st["mode"] == "full" and st["draft"]["certified"] > 0, st
    assert lo == lr and torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(ref.scores, out.scores)) and len(ref.scores) == len(out.scores)


def _values_anywhere_in_their_slack(monkeypatch, slack, top_up=True):
    """The head's contract for its own values (docs/certificates.md §2.0): each lies within its reported slack of
    stock's accumulator, nothing more. Here every value of a sub-vocabulary row is stock's accumulator moved by half a
    slack of at least ``slack`` (the reported slack raised to it): the row's top up and the others down (``top_up``),
    else even tokens up and odd ones down. Both are values the proofs must take on a host whose BLAS rounds a column
    subset otherwise than the full call, where the probe finds no kernel with stock's bits (so no plan takes them as
    stock's); the top-1 epilogue is off, so every row runs through ``_values``."""
    from hf_csv.core.certificate import CertifiedHead

    orig = CertifiedHead._values

    def values(self, r, t, Hf, Hn, value_dtype, sorted_one_row=False, with_slack=False, subset=None):
        got = orig(self, r, t, Hf, Hn, value_dtype, sorted_one_row=sorted_one_row, with_slack=with_slack,
                   subset=subset)
        if not with_slack or self.weight.dtype != torch.float32 or t.numel() == 0:
            return got
        ent = got[2].clamp(min=slack)
        stock = torch.nn.functional.linear(Hf, self.weight, self.bias)
        if top_up:
            sign = torch.where(t == stock.argmax(1)[r], 1.0, -1.0)
        else:
            sign = torch.where(t % 2 == 0, 1.0, -1.0)
        new = stock[r, t] + 0.5 * ent * sign
        return new, new, ent

    monkeypatch.setattr(CertifiedHead, "_values", values)
    monkeypatch.setattr(CertifiedHead, "_top1_native", lambda self, *a, **k: None)
    monkeypatch.setattr(CertifiedHead, "subset_exact", lambda self: False)


def _first_draft_probability(t, ids, **kw):
    """Stock's probability of the first drafted token of the first round, as its ``ConfidenceCriteria`` reads it."""
    from transformers.generation.stopping_criteria import ConfidenceCriteria

    seen, orig = [], ConfidenceCriteria.__call__

    def rec(self, input_ids, scores, **k):
        seen.append(float(scores[-1].softmax(-1)[0, input_ids[0, -1]]))
        return orig(self, input_ids, scores, **k)

    ConfidenceCriteria.__call__ = rec
    try:
        t.generate(ids, **kw)
    finally:
        ConfidenceCriteria.__call__ = orig
    return seen[0]


def test_the_drafts_confidence_stop_holds_wherever_its_values_lie_in_their_slack(monkeypatch):
    """The head's own values are only within their slack of stock's (a BLAS rounds a column subset otherwise, §2.0).
    The confidence stop's interval must hold for any such values: with the draft's top value raised and the others
    lowered by half a slack, and the threshold between stock's first draft probability and the one on those values,
    stock stops after one token. Before: the interval was taken around the values as if they were stock's, the row
    was called sure, and the draft went on (7 target positions for stock's 5)."""
    t, d = _audit_pair(97, torch.float32, 40.0, 0, 0.02, 100)
    ids = torch.tensor([[37, 24, 44, 53]])
    kw = dict(assistant_model=d, max_new_tokens=6, do_sample=False, pad_token_id=0)
    d.generation_config.assistant_confidence_threshold = 1e-9
    p_stock = _first_draft_probability(t, ids, **kw)
    d.generation_config.assistant_confidence_threshold = p_stock * 1.006  # the moved values give ~1.2 % more
    ref, lr = _lengths_and_out(t, ids, None, **kw)
    _values_anywhere_in_their_slack(monkeypatch, 0.05)
    out, lo = _lengths_and_out(t, ids, CSVConfig(), **kw)
    st = t.csv_last_stats
    assert lr[0] == ids.shape[1] + 1  # stock's first round drafted one token (the premise)
    assert lo == lr and torch.equal(out, ref)
    assert st["draft"]["verify_reruns"] > 0, st["draft"]


@pytest.mark.parametrize("rep,thr", [(1.6, 0.0), (1.0, 0.3)], ids=["penalty", "confidence_set"])
def test_a_greedy_drafts_tokens_hold_wherever_its_values_lie_in_their_slack(monkeypatch, rep, thr):
    """A greedy draft's tokens fix the target's verify shapes, so its argmax must be stock's draft's for any values
    within their slack, as the target's is (§2.0): after a repetition penalty, and where a confidence stop widens
    the head's set (a top-k call: the head proves no argmax itself). With even tokens' values raised and odd ones'
    lowered by half a slack of 0.05, rounds drafted other tokens before: the draft's check skipped the slack (target
    positions [.., 21, 17, 16] for stock's [.., 21, 20, 17, 16]), and, once the assistant's inert minimum length was
    no processor, the widened set's argmax went unchecked ([24, 4, 21, 15, ..] for stock's [24, 4, 21, 21, 14, ..])."""
    t, d = _audit_pair(97, torch.float32, 40.0, 2, 0.02, 102)
    d.generation_config.assistant_confidence_threshold = thr
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(2))
    kw = dict(assistant_model=d, max_new_tokens=24, do_sample=False, pad_token_id=0, repetition_penalty=rep)
    ref, lr = _lengths_and_out(t, ids, None, **kw)
    _values_anywhere_in_their_slack(monkeypatch, 0.05, top_up=False)
    out, lo = _lengths_and_out(t, ids, CSVConfig(), **kw)
    assert lo == lr and torch.equal(out, ref)
    assert t.csv_last_stats["draft"]["certified"] > 0


@pytest.mark.parametrize("thr,exact", [(0.0, True), (0.4, True), (0.4, False)])
def test_a_greedy_drafts_plan_follows_its_confidence_stop_and_the_probe(pair, monkeypatch, thr, exact):
    """transformers gives every assistant call a ``MinLengthLogitsProcessor`` at its input length, which never
    masks: it is no lowering processor, so a draft without a confidence stop runs the plain top-1 on its own values
    (the native epilogue where built). A confidence stop reads the row's normalizer: a wider set (less mass bounded
    from the screen), and stock's bits where the column-subset probe finds its kernel, else the values within their
    slack (§3.11). Tokens are stock's either way."""
    from hf_csv.transformers import scope
    from hf_csv.core.certificate import CertifiedHead

    target, draft = pair
    monkeypatch.setattr(CertifiedHead, "subset_exact", lambda self: exact)
    plans, decide = [], scope.set_plan

    def spy(sess, gc, procs):
        plan = decide(sess, gc, procs)
        if sess.draft:
            plans.append((plan, [type(p).__name__ for p in procs]))
        return plan

    monkeypatch.setattr(scope, "set_plan", spy)
    draft.generation_config.assistant_confidence_threshold = thr
    try:
        plain = target.generate(IDS, max_new_tokens=16, do_sample=False)
        out = target.generate(IDS, assistant_model=draft, max_new_tokens=16, do_sample=False, csv_config=CSVConfig())
    finally:
        draft.generation_config.assistant_confidence_threshold = 0.4
    assert torch.equal(out, plain)
    assert plans and all("MinLengthLogitsProcessor" in names for _, names in plans)
    for plan, _ in plans:
        assert plan.name == "topk" and plan.k == 1 and plan.confidence == thr
        if not thr:
            assert plan.k_head == 0 and plan.own_values and not plan.stock_values, plan
        else:
            assert plan.k_head > 1 and not plan.own_values and plan.stock_values == exact, plan


def test_draft_stats_count_the_rows_the_speed_guard_sent_to_the_full_head(monkeypatch):
    """The draft's summary counts every head row, as the target's does: where the speed guard picks the full head,
    its rows are ``declined_rows`` and ``head_rows`` = ``rows`` + ``declined_rows`` (a summary that left them out
    reported 100 % certified for a draft that mostly ran the full head)."""
    import hf_csv.core.speed
    from hf_csv.core.speed import SpeedGuard

    monkeypatch.setattr(hf_csv.core.speed, "MIN_WEIGHTS", 0)  # these tiny heads get a guard too (fresh models: no cache)
    target, draft = hf_csv.enable(_llama(2, 0)), _llama(1, 1)
    calls, pick = {}, SpeedGuard.certified

    def every_other(self, key, rows=1, **prior):  # each head's guard: the certified head on every other call
        pick(self, key, rows, **prior)  # (the guard's own state for the key, which its record reads)
        calls[id(self)] = calls.get(id(self), 0) + 1
        return calls[id(self)] % 2 == 0

    monkeypatch.setattr(SpeedGuard, "certified", every_other)
    plain = target.generate(IDS, max_new_tokens=16, do_sample=False)
    out = target.generate(IDS, assistant_model=draft, max_new_tokens=16, do_sample=False, csv_config=CSVConfig(),
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    for d in (out.csv_stats, out.csv_stats["draft"]):
        assert d["declined_rows"] > 0 and d["rows"] > 0, d
        assert d["head_rows"] == d["rows"] + d["declined_rows"]
        assert d["certified_fraction"] == pytest.approx(d["certified"] / d["head_rows"]) and d["certified_fraction"] < 1


def test_draft_head_full_option_is_stock_draft(pair):
    target, draft = pair
    plain = target.generate(IDS, max_new_tokens=12, do_sample=False)
    out = target.generate(IDS, assistant_model=draft, max_new_tokens=12, do_sample=False,
                          csv_config=CSVConfig(draft_head="full"), return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert "draft" not in out.csv_stats


def test_all_accepted_self_drafting(pair):
    """A model drafting for itself: every draft is accepted (one target call per num_assistant_tokens)."""
    target, _ = pair
    plain = target.generate(IDS, max_new_tokens=20, do_sample=False)
    calls, h = _count_target_calls(target)
    own_config = support().assistant_config_attr is not None
    if not own_config:  # transformers 4.57 reads the threshold from the assistant's own config only
        old = target.generation_config.assistant_confidence_threshold
        target.generation_config.assistant_confidence_threshold = 0.0
    try:
        out = target.generate(IDS, assistant_model=target, max_new_tokens=20, do_sample=False,
                              csv_config=CSVConfig(), num_assistant_tokens=5, assistant_confidence_threshold=0.0,
                              return_dict_in_generate=True)
    finally:
        h.remove()
        if not own_config:
            target.generation_config.assistant_confidence_threshold = old
    assert torch.equal(out.sequences, plain)
    # 20 tokens, 5 drafts + 1 bonus per verification: 4 verifications; the rest are draft calls
    st = out.csv_stats
    if own_config:
        assert st["assistant_settings"] == {"num_assistant_tokens": 5, "assistant_confidence_threshold": 0.0}
    else:
        assert st["assistant_settings"] == {"num_assistant_tokens": 5}
        assert any("assistant_confidence_threshold passed to the main generate not applied" in r for r in st["reasons"])
    assert st["head_calls"] <= 4
    assert st["draft"]["rows"] >= 15


def test_none_accepted_still_identical():
    """A draft whose head is negated proposes the target's *least* likely tokens: none is accepted."""
    target = hf_csv.enable(_llama(2, 0))
    draft = _llama(2, 0)
    with torch.no_grad():
        draft.lm_head.weight.neg_()
    plain = target.generate(IDS, max_new_tokens=10, do_sample=False)
    out = target.generate(IDS, assistant_model=draft, max_new_tokens=10, do_sample=False, csv_config=CSVConfig(),
                          num_assistant_tokens=3, assistant_confidence_threshold=0.0, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert out.csv_stats["head_calls"] == 10  # one new token per verification


def test_num_assistant_tokens_from_main_generate_is_honoured(pair):
    target, draft = pair
    plain = target.generate(IDS, max_new_tokens=16, do_sample=False)
    out = target.generate(IDS, assistant_model=draft, max_new_tokens=16, do_sample=False, csv_config=CSVConfig(),
                          num_assistant_tokens=1, num_assistant_tokens_schedule="constant",
                          assistant_confidence_threshold=0.0, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    d = out.csv_stats["draft"]
    assert d["head_calls"] <= d["calls"]  # at most one drafted token per call
    assert out.csv_stats["assistant_settings"]["num_assistant_tokens"] == 1


def test_bad_assistant_settings_raise_and_restore(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="num_assistant_tokens_schedule"):
        target.generate(IDS, assistant_model=draft, max_new_tokens=4, do_sample=False, csv_config=CSVConfig(),
                        num_assistant_tokens_schedule="sometimes")
    assert "_get_candidate_generator" not in target.__dict__
    assert "_get_logits_processor" not in target.__dict__
    assert type(target.lm_head).__name__ == "Linear" and type(draft.lm_head).__name__ == "Linear"


def test_eos_inside_the_draft_and_max_length_cut(pair):
    target, draft = pair
    plain = target.generate(IDS, max_new_tokens=24, do_sample=False)
    eos = int(plain[0, IDS.shape[1] + 6])  # a token the target emits 7th: generation stops there
    kw = dict(do_sample=False, eos_token_id=eos, pad_token_id=0)
    a = target.generate(IDS, max_new_tokens=24, **kw)
    b = target.generate(IDS, assistant_model=draft, max_new_tokens=24, csv_config=CSVConfig(), num_assistant_tokens=8,
                        **kw)
    assert torch.equal(a, b) and a.shape[1] <= IDS.shape[1] + 7
    # max_length cut in the middle of a draft
    for n in (1, 2, 3):
        a = target.generate(IDS, max_new_tokens=n, do_sample=False)
        b = target.generate(IDS, assistant_model=draft, max_new_tokens=n, do_sample=False, csv_config=CSVConfig(),
                            num_assistant_tokens=6)
        assert torch.equal(a, b)


def test_sampled_draft_returns_the_logits_it_sampled_from(pair, monkeypatch):
    """Sampled drafts whose top-k exceeds ``draft_top_k`` use -inf outside their certified top-k set; the draft's
    tokens lie in that set and the verify step sees those logits (no NaN)."""
    target, draft = pair
    seen = []
    import transformers.generation.utils as gu

    import hf_csv.transformers.acceptance as hv

    def spying(orig):
        def spy(*a, **k):
            seen.append((a[0][0, -a[2]:].clone(), a[1].clone()))
            return orig(*a, **k)
        spy.__wrapped__ = orig  # (hf_csv.transformers.compat checks stock's signature through it)
        return spy

    # hf_csv's verify, and stock's (which the target's checked top-K plan hands its rows to)
    monkeypatch.setitem(hv._IMPLS, "exact", spying(hv._IMPLS["exact"]))
    monkeypatch.setattr(gu, "_speculative_sampling", spying(gu._speculative_sampling))
    torch.manual_seed(0)
    out = target.generate(IDS, assistant_model=draft, max_new_tokens=16, do_sample=True,
                          csv_config=CSVConfig(draft_top_k=4), return_dict_in_generate=True)
    assert seen and out.csv_stats["draft"]["mode"] == "topk"
    for ids, logits in seen:
        assert not torch.isnan(logits).any()
        finite = torch.isfinite(logits[0])
        assert finite.any(1).all()
        assert (finite.sum(1) < logits.shape[-1]).all()  # a sub-vocabulary, -inf elsewhere
        assert finite[torch.arange(len(ids)), ids].all()  # every drafted token was in it


def test_sampled_draft_without_top_k_keeps_its_tail(pair, monkeypatch):
    """Without a top-k warper the sampled draft's law is the whole softmax: outside the certified top-k its scores
    are the screen's estimates (finite, within the screen's radius of the exact logits), so the q the verify reads
    keeps its tail and the confidence stop reads a tail mass; with a top-k warper the tail stays -inf (above)."""
    target, draft = pair
    seen = []
    import hf_csv.transformers.acceptance as hv
    from hf_csv.transformers.heads import find_head, get_certified_head

    orig, orig_cert = hv._IMPLS["exact"], hv.speculative_sampling_certified

    def spy(candidate_input_ids, candidate_logits, candidate_length, new_logits, *a, **k):
        seen.append((candidate_input_ids.clone(), candidate_logits.clone(), int(candidate_length)))
        return orig(candidate_input_ids, candidate_logits, candidate_length, new_logits, *a, **k)

    def spy_cert(sess, candidate_input_ids, candidate_logits, candidate_length, new_logits, **k):
        seen.append((candidate_input_ids.clone(), candidate_logits.clone(), int(candidate_length)))
        return orig_cert(sess, candidate_input_ids, candidate_logits, candidate_length, new_logits, **k)

    monkeypatch.setitem(hv._IMPLS, "exact", spy)  # (the target's verify: stock rows, or certified in mode spec)
    monkeypatch.setattr(hv, "speculative_sampling_certified", spy_cert)
    torch.manual_seed(0)
    out = target.generate(IDS, assistant_model=draft, max_new_tokens=16, do_sample=True, top_k=0,
                          csv_config=CSVConfig(draft_top_k=4), return_dict_in_generate=True)
    assert seen and out.csv_stats["draft"]["mode"] == "topk" and out.csv_stats["draft"]["certified"] > 0
    head = draft.get_output_embeddings()
    for ids, logits, L in seen:
        assert torch.isfinite(logits).all()
        with torch.no_grad():  # the draft's exact logits at the drafted positions (fp32, temperature 1)
            body = draft.model(ids[:, :-1]).last_hidden_state[:, -L:]
            exact = head(body)
        est, up = get_certified_head(find_head(draft)[1], CSVConfig()).provider(body[0])
        tail = logits[0] != exact[0]
        assert tail.any()  # a sub-vocabulary was certified, the rest filled
        # (the call's own screen may have chosen other outlier columns than this one: twice the radius)
        assert bool(((logits[0] - exact[0]).abs()[tail] <= 2 * (up - est)[tail] + 1e-4).all())


@pytest.mark.slow
def test_sampled_draft_top_k_is_lossless_chi_square():
    """First new token of assisted sampling with a *truncated* (top-2) draft, narrower than the target's top-3,
    follows the target's top-3 law exactly (the target certified, its verify stock's). 1500 draws, chi-square at
    significance level 0.001, fixed seed. (A call whose target is declined keeps stock's drafts instead: the
    assisted fuzzer's declined cases.)"""
    V = 12
    target = hf_csv.enable(_llama(1, 3, V=V, scale=1.5))
    draft = _llama(1, 4, V=V, scale=1.5)
    ids = torch.tensor([[3, 7, 1]])
    with torch.no_grad():
        z = target(ids).logits[0, -1].double()
    z = z.masked_fill(z < z.topk(3).values[-1], float("-inf"))  # the target's top-3 warper
    p = torch.softmax(z, -1).numpy()
    torch.manual_seed(1234)
    counts = np.zeros(V)
    cfg = CSVConfig(draft_top_k=2, budget=1.0)  # budget: never fall back to the full draft head
    drafted = 0
    for _ in range(1500):
        out = target.generate(ids, assistant_model=draft, max_new_tokens=2, do_sample=True, top_k=3, csv_config=cfg,
                              num_assistant_tokens=2, assistant_confidence_threshold=0.0, eos_token_id=None,
                              pad_token_id=0)
        counts[int(out[0, ids.shape[1]])] += 1
        drafted += target.csv_last_stats.get("draft", {}).get("certified", 0)
    assert drafted >= 1000  # the first token went through a truncated draft + verify in (almost) every trial
    exp = p * counts.sum()
    keep = exp >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    e = np.append(exp[keep], exp[~keep].sum())
    obs, e = (obs[:-1], e[:-1]) if e[-1] == 0 else (obs, e)
    assert sstats.chisquare(obs, e * obs.sum() / e.sum()).pvalue > 1e-3


def test_tiny_whisper_assisted_encoder_decoder_and_decoder_only():
    m = hf_csv.enable(_tiny_whisper())
    feats = torch.randn(1, 80, 3000, generator=torch.Generator().manual_seed(0))
    plain = m.generate(feats, max_new_tokens=16, do_sample=False)
    # distil-whisper style: a decoder-only WhisperForCausalLM reading the target's encoder outputs
    d1 = truncated_assistant(m, 1)
    assert isinstance(d1, WhisperForCausalLM)
    # encoder-decoder assistant with its own (random) encoder
    d2 = _tiny_whisper(seed=5)
    for d in (d1, d2):
        out = m.generate(feats, max_new_tokens=16, do_sample=False, assistant_model=d, csv_config=CSVConfig())
        assert torch.equal(out, plain)
        assert m.csv_last_stats["draft"]["rows"] > 0


@pytest.mark.slow
def test_real_whisper_truncated_assistant_identical(whisper_tiny_en, monkeypatch):
    # an exactness test: the speed guard's timing-dependent choice would make the certified-row counts vacuous
    monkeypatch.setenv("HF_CSV_SPEED_GUARD", "0")
    from scipy.io import wavfile

    proc, m = whisper_tiny_en
    draft = truncated_assistant(m, 2)
    sr, a = wavfile.read(SHARED / "models" / "speech" / "en_fox.wav")
    feats = proc(a.astype("float32") / 32768.0, sampling_rate=sr, return_tensors="pt").input_features
    plain = m.generate(feats, num_beams=1, do_sample=False, max_new_tokens=40)
    out = m.generate(feats, num_beams=1, do_sample=False, max_new_tokens=40, assistant_model=draft,
                     csv_config=CSVConfig())
    assert torch.equal(out, plain)
    st = m.csv_last_stats
    assert st["draft"]["certified"] > 0 and st["certified"] > 0


@pytest.mark.slow
def test_real_smollm_truncated_self_draft_identical(monkeypatch):
    # an exactness test: the speed guard's timing-dependent choice would make the certified-row counts vacuous
    monkeypatch.setenv("HF_CSV_SPEED_GUARD", "0")
    from transformers import AutoModelForCausalLM

    d = model_dir("smollm2-135m")
    tok = tokenizer(d)
    m = hf_csv.enable(AutoModelForCausalLM.from_pretrained(d).eval())
    draft = truncated_assistant(m, 10)
    x = tok("def fibonacci(n):", return_tensors="pt")
    for assistant in (draft, m):
        # stock assisted's tokens: its verify forwards several positions at once, which a float32 body may round
        # otherwise than plain greedy's one-token forwards (on a Sapphire Rapids host the truncated draft's output
        # differs from plain greedy's at token 22, stock's and hf_csv's alike)
        stock = m.generate(**x, max_new_tokens=32, do_sample=False, assistant_model=assistant)
        out = m.generate(**x, max_new_tokens=32, do_sample=False, assistant_model=assistant, csv_config=CSVConfig())
        assert torch.equal(out, stock)
        assert m.csv_last_stats["draft"]["certified"] > 0


def test_processors_checked_at_every_verified_position(pair):
    """Repetition penalty (a 'lower' processor) during assisted greedy: the certificate is checked at each
    of the L+1 verified positions, against that position's own logits."""
    target, draft = pair
    kw = dict(max_new_tokens=24, do_sample=False, repetition_penalty=1.5, no_repeat_ngram_size=2)
    plain = target.generate(IDS, **kw)
    out = target.generate(IDS, assistant_model=draft, csv_config=CSVConfig(), num_assistant_tokens=4,
                          assistant_confidence_threshold=0.0, return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, plain)
    assert out.csv_stats["mode"] == "topk" and out.csv_stats["certified"] > 0


@pytest.mark.skipif(support().speculative_extra != "assistant_ensemble_weight",
                    reason="assistant_ensemble_weight is transformers 5.x")
def test_ensemble_weight_uses_the_full_target_head(pair):
    target, draft = pair
    kw = dict(max_new_tokens=8, do_sample=False)
    stock = target.generate(IDS, assistant_model=draft, assistant_ensemble_weight=0.5, **kw)
    out = target.generate(IDS, assistant_model=draft, assistant_ensemble_weight=0.5, csv_config=CSVConfig(),
                          return_dict_in_generate=True, **kw)
    assert out.csv_stats["mode"] == "full" and "ensemble" in out.csv_stats["reasons"][0]
    assert torch.equal(out.sequences, stock)


def test_greedy_assisted_with_csv_equals_plain_greedy(assist_pair):
    target, draft = assist_pair
    ids = torch.tensor([[5, 17, 33, 2, 9]])
    plain = target.generate(ids, max_new_tokens=20, do_sample=False)
    out = target.generate(ids, assistant_model=draft, max_new_tokens=20, do_sample=False, csv_config=CSVConfig(),
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert out.csv_stats["certified"] > 0 if isinstance(out.csv_stats, dict) else out.csv_stats.certified > 0


@pytest.mark.usefixtures("assume_subset_exact")
def test_quantized_assistant_llama_keeps_the_head_and_greedy_output(spec_pair):
    from torch.ao.nn.quantized.dynamic import Linear as DynLinear

    from hf_csv.transformers.drafts import quantized_assistant

    target, _ = spec_pair
    q = quantized_assistant(target)
    assert isinstance(q.lm_head, torch.nn.Linear) and not isinstance(q.lm_head, DynLinear)
    assert isinstance(q.model.layers[0].self_attn.q_proj, DynLinear)
    assert isinstance(target.model.layers[0].self_attn.q_proj, torch.nn.Linear)  # the model is untouched
    ids = torch.tensor([[5, 17, 33, 2, 9]])
    plain = target.generate(ids, max_new_tokens=16, do_sample=False)
    out = target.generate(ids, assistant_model=q, max_new_tokens=16, do_sample=False, csv_config=CSVConfig(budget=0.3),
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert out.csv_stats["draft"]["mode"] == "topk" and out.csv_stats["draft"]["certified"] > 0
    with pytest.raises(ValueError, match="float32"):
        quantized_assistant(copy.deepcopy(target).to(torch.bfloat16))


@pytest.mark.usefixtures("assume_subset_exact")
def test_quantized_assistant_whisper_reads_the_targets_encoder():
    from hf_csv.transformers.drafts import quantized_assistant

    m = hf_csv.enable(_tiny_whisper())
    q = quantized_assistant(m)
    assert isinstance(q, WhisperForCausalLM) and isinstance(q.proj_out, torch.nn.Linear)
    feats = torch.randn(1, 80, 3000, generator=torch.Generator().manual_seed(0))
    plain = m.generate(feats, max_new_tokens=12, do_sample=False)
    stock = m.generate(feats, assistant_model=q, max_new_tokens=12, do_sample=False)
    ours = m.generate(feats, assistant_model=q, max_new_tokens=12, do_sample=False, csv_config=CSVConfig())
    assert torch.equal(stock, plain) and torch.equal(ours, plain)


@contextlib.contextmanager
def _constant_draft_length(draft, n: int):
    """The assistant drafts ``n`` tokens per round while inside (restored after). On the assistant's own config: stock
    ignores num_assistant_tokens passed to the target's generate, hf_csv applies it (transformers #40739), and a
    different draft length is a different random stream."""
    gc = draft.generation_config
    saved = gc.num_assistant_tokens, gc.num_assistant_tokens_schedule
    gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = n, "constant"
    try:
        yield
    finally:
        gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = saved


@pytest.fixture(scope="module")
def wide_pair():
    """V = 4096: above the size where hf_csv's own verify races in two levels (hf_csv.core.speculative.RACE_BLOCK), so
    its random stream differs from stock's multinomial and only stock's verify gives stock's tokens."""
    target = spec_llama(0, V=4096)
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for p in draft.model.layers.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return hf_csv.enable(target), draft


@pytest.mark.parametrize("exact", [True, False])
def test_a_sampled_draft_on_the_checked_plan_needs_stocks_values(wide_pair, monkeypatch, exact):
    """A sampled draft on the checked top-k plan hands its rows to stock's sampler and verify as stock's draft's, so
    its values on S must be stock's bit for bit, as the target's must: where the column-subset probe finds no kernel
    that gives them, the draft takes the full head with that reason (the target keeps its own plan). Before, a
    draft never asked the probe: with values within their slack but not stock's, the candidate logits the verify
    read were not stock's draft's."""
    from hf_csv.core.certificate import CertifiedHead
    import transformers.generation.utils as gu

    target, draft = wide_pair
    monkeypatch.setattr(CertifiedHead, "subset_exact", lambda self: exact)
    seen, orig = [], gu._speculative_sampling

    @functools.wraps(orig)  # (its signature: hf_csv.transformers.compat checks the one it patches)
    def record(candidate_input_ids, candidate_logits, *a, **k):
        seen.append(candidate_logits.clone())
        return orig(candidate_input_ids, candidate_logits, *a, **k)

    monkeypatch.setattr(gu, "_speculative_sampling", record)
    ids = torch.tensor([[5, 17, 33, 2, 9]])
    gen = dict(do_sample=True, top_k=20, max_new_tokens=12, pad_token_id=0, assistant_model=draft)
    with _constant_draft_length(draft, 4):
        torch.manual_seed(0)
        ref = target.generate(ids, **gen)
        want, seen[:] = list(seen), []
        if not exact:
            _values_anywhere_in_their_slack(monkeypatch, 0.0, top_up=False)  # in-contract values, not stock's bits
        torch.manual_seed(0)
        out = target.generate(ids, csv_config=CSVConfig(), return_dict_in_generate=True, **gen)
    d = out.csv_stats["draft"]
    if exact:
        assert d["mode"] == "topk" and d["certified"] > 0, d
        return
    assert d["mode"] == "full" and any("column subset" in r for r in d["reasons"]), d
    assert torch.equal(out.sequences, ref) and len(seen) == len(want)
    assert all(torch.equal(a, b) for a, b in zip(seen, want))


@pytest.mark.usefixtures("assume_subset_exact")
@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(top_k=20, top_p=0.8, temperature=0.7, repetition_penalty=1.05),
                                dict(top_k=50), dict(top_k=5, temperature=1.3, min_p=0.1)],
                         ids=["qwen_chat", "default", "min_p_after_top_k"])
def test_assisted_top_k_sampling_is_stock_token_for_token(wide_pair, kw):
    """With a top-k warper (and only temperature / lowering processors before it) both heads run the checked top-K
    plan, so the draft's and the target's processed scores are stock's, and stock's verify draws from them: the same
    seed gives stock assisted sampling's tokens, token for token, with both heads certified (docs/speculative.md)."""
    target, draft = wide_pair
    ids = torch.tensor([[5, 17, 33, 2, 9], [7, 7, 40, 41, 3]])
    gen = dict(kw, do_sample=True, max_new_tokens=24, pad_token_id=0)
    rejections = 0
    with _constant_draft_length(draft, 4):
        for seed in range(3):
            row = ids[seed % 2:seed % 2 + 1]
            torch.manual_seed(seed)
            ref = target.generate(row, assistant_model=draft, **gen)
            torch.manual_seed(seed)
            out = target.generate(row, assistant_model=draft, csv_config=CSVConfig(budget=1.0), return_dict_in_generate=True,
                                  **gen)
            assert torch.equal(ref, out.sequences), (seed, ref, out.sequences)
            st = out.csv_stats
            assert st["mode"] == "topk" and st["certified"] > 0, st["reasons"]
            assert st["draft"]["mode"] == "topk" and st["draft"]["certified"] > 0, st["draft"]
            sp = st["speculative"]
            rejections += sp["drafted"] - sp["accepted"]
        assert rejections > 0  # residual draws happened (the part of the stream hf_csv's own verify draws differently)


@pytest.mark.usefixtures("assume_subset_exact")
@pytest.mark.slow
def test_lowering_processors_before_top_k_widen_the_certified_set(wide_pair, monkeypatch):
    """A repetition penalty before the top-k warper lowers tokens of the certified top-K, and the k-th processed
    score can then fall to the bound on the uncomputed tokens: the row re-runs stock's head. The head therefore
    certifies a wider set (hf_csv.core.config.lowered_k), and a call's re-runs share one stock GEMM (assisted decoding
    checks up to P positions of one head call). Tokens are stock's either way (the draft's list holds the target's
    warpers and its own: the check follows the first top-k warper, so the draft is token-identical too)."""
    import hf_csv.core.certificate as C
    import hf_csv.core.config as POL  # (lowered_k's constants)
    target, draft = wide_pair
    calls = {"n": 0}
    stock = C.CertifiedHead.stock

    def counted(self, H):
        calls["n"] += 1
        return stock(self, H)

    monkeypatch.setattr(C.CertifiedHead, "stock", counted)
    gen = dict(top_k=4, temperature=0.7, repetition_penalty=3.0, do_sample=True, max_new_tokens=40, pad_token_id=0)

    def run(factor, minimum):
        monkeypatch.setattr(POL, "LOWER_K_FACTOR", factor)
        monkeypatch.setattr(POL, "LOWER_K_MIN", minimum)
        reruns, heads, equal = 0, 0, True
        calls["n"] = 0
        for seed in range(4):
            row = torch.tensor([[5, 17, 33, 2, 9, 5, 17, 33]])
            torch.manual_seed(seed)
            ref = target.generate(row, assistant_model=draft, **gen)
            torch.manual_seed(seed)
            out = target.generate(row, assistant_model=draft, csv_config=CSVConfig(budget=1.0),
                                  return_dict_in_generate=True, **gen)
            equal &= torch.equal(ref, out.sequences)
            st = out.csv_stats
            assert st["mode"] == "topk", st["reasons"]
            reruns += st["verify_reruns"] + st["draft"]["verify_reruns"]
            heads += st["head_calls"] + st["draft"]["head_calls"]
        return reruns, calls["n"], heads, equal

    default = POL.LOWER_K_FACTOR, POL.LOWER_K_MIN
    with _constant_draft_length(draft, 6):
        narrow, narrow_gemms, heads, equal = run(1, 0)  # K = k: the set before the fix
        assert equal
        assert narrow > 0, "the case must exercise re-runs with K = k"
        # batch 1: one re-run per re-run row; assisted verify calls re-run several positions of one head call, which
        # share one stock GEMM (without the stash's cache: one GEMM per re-run)
        assert narrow_gemms < narrow <= heads, (narrow_gemms, narrow, heads)
        wide, _, _, equal = run(*default)
        assert equal
        assert wide < narrow / 2, (wide, narrow)  # measured 0 against 180


@pytest.mark.usefixtures("assume_subset_exact")
def test_stock_draft_head_in_assisted_sampling(wide_pair):
    """``draft_head="full"``: the assistant's generate receives the target's processors, and the target's check must
    not run on the draft's scores (it raised "processor input length ... does not match the head call" before);
    the target stays certified and the tokens are stock's."""
    target, draft = wide_pair
    gen = dict(top_k=20, temperature=0.7, top_p=0.8, repetition_penalty=1.05, do_sample=True, max_new_tokens=16,
               pad_token_id=0)
    with _constant_draft_length(draft, 4):
        row = torch.tensor([[5, 17, 33, 2, 9]])
        torch.manual_seed(3)
        ref = target.generate(row, assistant_model=draft, **gen)
        torch.manual_seed(3)
        out = target.generate(row, assistant_model=draft, csv_config=CSVConfig(draft_head="full"),
                              return_dict_in_generate=True, **gen)
        assert torch.equal(ref, out.sequences)
        assert out.csv_stats["mode"] == "topk" and out.csv_stats["certified"] > 0
        assert "draft" not in out.csv_stats  # the draft head stayed stock's


ASSISTED_RESULTS: list = []


def pytest_generate_tests(metafunc):
    if "greedy_case" in metafunc.fixturenames:
        n = metafunc.config.getoption("fuzz_cases", None) or int(os.environ.get("HF_CSV_FUZZ_CASES", "300"))
        metafunc.parametrize("greedy_case", range(max(12, int(n) // 20)))
    if "assisted_case" in metafunc.fixturenames:
        n = metafunc.config.getoption("fuzz_cases", None) or int(os.environ.get("HF_CSV_FUZZ_CASES", "300"))
        # the cases, then as many declined cases (ids from DECLINED_FROM) as a quarter of them, at least 3
        main = max(8, int(n) // 25)
        metafunc.parametrize("assisted_case", [*range(main), *range(DECLINED_FROM, DECLINED_FROM + max(3, main // 4))])


DECLINED_FROM = 10_000  # assisted fuzz cases from this id on decline the target's call (hf_csv must return stock's)


def _assisted_case(i: int) -> dict:
    rng = random.Random(7919 * i + 5)
    kw = {"top_k": rng.choice([5, 20, 50]), "max_new_tokens": rng.randint(4, 16)}
    if rng.random() < 0.7:
        kw["temperature"] = rng.choice([0.7, 1.3])
    if rng.random() < 0.4:
        kw["top_p"] = 0.8
    if rng.random() < 0.4:
        kw["repetition_penalty"] = rng.choice([1.05, 1.3])
    if rng.random() < 0.2:
        kw["min_p"] = 0.05
    return {"arch": rng.choice(["llama", "qwen2", "gemma2", "gemma3", "cohere", "granite", "phi"]),
            "seed": rng.randrange(4), "dtype": rng.choice([torch.float32, torch.bfloat16]),
            "draft_noise": rng.choice([0.01, 0.05, 0.2]), "n_draft": rng.choice([2, 4, 8]),
            "schedule": rng.choice(["constant", "heuristic"]), "budget": rng.choice([None, 1.0]),
            "prompt_len": rng.randint(2, 8), "kw": kw, "sample": rng.randrange(1 << 16),
            # (drawn last: the earlier draws, and so the earlier cases, stay what they were)
            "draft_head": rng.choice(["subvocab", "subvocab", "full"]),
            "strong_penalty": rng.random() < 0.15,
            # a setting that declines the target's call, which must then return stock's tokens too (its drafts and
            # its verify stock's: hf_csv.transformers.method_plans._sampled_draft_plan, hf_csv.transformers.acceptance._dispatch)
            "decline": None if i < DECLINED_FROM else ("scores", "top_p_only", "sequence_bias")[i % 3]}


@pytest.mark.roc
@pytest.mark.usefixtures("assume_subset_exact")
def test_assisted_top_k_sampling_differential(assisted_case):
    """Fuzz over architectures, dtypes, draft quality and length, and sampling settings with a top-k warper: stock
    assisted sampling and hf_csv's return the same tokens for the same seed (docs/speculative.md, top-k path)."""
    c = _assisted_case(assisted_case)
    # a declined case gets a vocabulary above 2,048: where stock's multinomial and hf_csv's exact verify (its
    # two-level exponential race) draw differently, so only stock's own verify returns stock's tokens
    vocab = 4099 if c["decline"] is not None else None
    target = hf_csv.enable(_build(c["arch"], c["seed"], vocab).to(c["dtype"]))
    draft = _build(c["arch"], c["seed"], vocab).to(c["dtype"])  # the same weights, then a perturbed body
    g = torch.Generator().manual_seed(assisted_case)
    # a declined case gets a far draft: rejections in most rounds, so the verify's residual draw runs
    noise = 1.0 if c["decline"] is not None else c["draft_noise"]
    with torch.no_grad():
        for prm in draft.model.layers.parameters():
            prm.add_((noise * torch.randn(prm.shape, generator=g)).to(prm.dtype))
    V = target.config.vocab_size
    ids = torch.randint(3, V, (1, c["prompt_len"]), generator=g)
    gen = dict(c["kw"], do_sample=True, pad_token_id=0)
    if c["strong_penalty"]:  # lowers most of a short prompt's top tokens: the checks before the top-k warper work
        gen["repetition_penalty"] = 3.0
    if c["decline"] == "scores":
        gen["output_scores"] = True
    elif c["decline"] == "top_p_only":  # no top-k warper: assisted top-p is declined
        gen.update(top_k=0, top_p=0.8)
    elif c["decline"] == "sequence_bias":  # a positive bias raises a score: declined
        gen["sequence_bias"] = {(int(ids[0, 0]),): 2.0}
    cfg = CSVConfig(draft_head=c["draft_head"]) if c["budget"] is None else CSVConfig(budget=c["budget"],
                                                                                     draft_head=c["draft_head"])

    def draft_config() -> None:  # before every call: the "heuristic" schedule writes its draft length back into it
        draft.generation_config.num_assistant_tokens = c["n_draft"]
        draft.generation_config.num_assistant_tokens_schedule = c["schedule"]

    draft_config()
    torch.manual_seed(c["sample"])
    ref = target.generate(ids, assistant_model=draft, **gen)
    draft_config()
    torch.manual_seed(c["sample"])
    out = target.generate(ids, assistant_model=draft, csv_config=cfg, return_dict_in_generate=True, **gen)
    st = out.csv_stats
    ASSISTED_RESULTS.append({"case": assisted_case, "arch": c["arch"], "mode": st["mode"],
                             "certified": st.get("certified", 0), "draft_certified": st.get("draft", {}).get("certified", 0),
                             "draft_head": c["draft_head"], "decline": c["decline"]})
    assert torch.equal(ref, out.sequences), f"assisted case {assisted_case} {c}: tokens differ from stock"
    if c["decline"] is not None:  # (a declined call is what this case tests)
        assert st["mode"] == "full", (c, st["mode"], st["reasons"])


GREEDY_RESULTS: list = []


def _greedy_case(i: int) -> dict:
    rng = random.Random(104723 * i + 29)
    kw: dict = {"max_new_tokens": rng.randint(6, 30)}
    if rng.random() < 0.25:
        kw["repetition_penalty"] = 1.3
    if rng.random() < 0.2:
        kw["no_repeat_ngram_size"] = 3
    if rng.random() < 0.15:
        kw.update(return_dict_in_generate=True, output_scores=True)  # declines the target: stock's scores
    return {"dtype": rng.choice([torch.float32, torch.bfloat16, torch.float16]), "vocab": rng.choice([97, 512, 2048, 4099]),
            "scale": rng.choice([2.0, 4.0, 10.0]), "seed": rng.randrange(5), "noise": rng.choice([0.02, 0.1, 0.3]),
            "threshold": rng.choice([0.0, 0.1, 0.4, 0.4, 0.9]), "n_draft": rng.choice([3, 8, 20]),
            "schedule": rng.choice(["constant", "heuristic"]), "prompt_len": rng.randint(2, 8), "kw": kw,
            # stock's ROC adaptation of the threshold where scikit-learn is installed, on its own stream (earlier
            # draws stay what they were); without scikit-learn stock never adapts
            "roc": random.Random(7 * i + 104729).random() < 0.5}


@pytest.mark.roc
def test_assisted_greedy_differential(greedy_case, request):
    """Greedy assisted generation over dtypes (float16 and bfloat16 included), vocabularies, draft quality, draft
    lengths and confidence thresholds: hf_csv's tokens (and scores where kept) are stock assisted's, and so is every
    round's draft length, read off the target's forward shapes (docs/certificates.md §3.11)."""
    c = _greedy_case(greedy_case)
    if not c["roc"]:
        request.getfixturevalue("fixed_threshold")
    roc = roc_adapts(c["threshold"])
    t, d = _audit_pair(c["vocab"], c["dtype"], c["scale"], c["seed"], c["noise"], 1000 + greedy_case)
    ids = torch.randint(2, c["vocab"], (1, c["prompt_len"]), generator=torch.Generator().manual_seed(greedy_case))
    kw = dict(c["kw"], assistant_model=d, do_sample=False, pad_token_id=0)
    runs = []
    for cfg in (None, CSVConfig()):
        d.generation_config.num_assistant_tokens = c["n_draft"]  # (the heuristic schedule writes it back)
        d.generation_config.num_assistant_tokens_schedule = c["schedule"]
        d.generation_config.assistant_confidence_threshold = c["threshold"]
        runs.append(_lengths_and_out(t, ids, cfg, **kw))
    (ref, lr), (out, lo) = runs
    st = t.csv_last_stats
    GREEDY_RESULTS.append({"case": greedy_case, "mode": st["mode"], "certified": st.get("certified", 0),
                           "draft_certified": st.get("draft", {}).get("certified", 0),
                           "draft_rows": st.get("draft", {}).get("rows", 0), "threshold": c["threshold"], "roc": roc})
    seq = (lambda o: o if torch.is_tensor(o) else o.sequences)
    assert lo == lr, f"greedy case {greedy_case} {c}: draft lengths differ from stock's ({lo} vs {lr})"
    assert torch.equal(seq(ref), seq(out)), f"greedy case {greedy_case} {c}: tokens differ from stock's"
    if not torch.is_tensor(ref):
        assert len(ref.scores) == len(out.scores) and all(torch.equal(a, b) for a, b in zip(ref.scores, out.scores))
    if roc and "draft" in st:  # stock reads the greedy draft's whole rows: they must be the full head's
        assert st["draft"]["mode"] == "full" and st["draft"]["certified"] == 0, (greedy_case, st["draft"])


def test_assisted_greedy_differential_summary():
    """Runs after the greedy cases: the draft's certified head ran in most of them (declining must not pass)."""
    if not GREEDY_RESULTS:
        pytest.skip("no greedy assisted case ran in this session")
    kept = [r for r in GREEDY_RESULTS if not r["roc"]]  # (where stock adapts the threshold the draft is full)
    n = len(kept)
    dcert = sum(r["draft_certified"] > 0 for r in kept)
    rows = sum(r["draft_rows"] for r in kept)
    share = sum(r["draft_certified"] for r in kept) / max(1, rows)
    print(f"\nhf_csv greedy assisted fuzzer: {len(GREEDY_RESULTS)} cases, {len(GREEDY_RESULTS) - n} with stock's ROC "
          f"adaptation (full draft head); of the other {n}, {dcert} with certified draft rows, {share:.0%} of draft "
          "rows certified")
    assert dcert >= n / 2, GREEDY_RESULTS


@pytest.mark.usefixtures("assume_subset_exact")
def test_assisted_differential_summary():
    """Runs after the cases: the certified heads must have run in most of them (declining everywhere must not pass)."""
    if not ASSISTED_RESULTS:
        pytest.skip("no assisted fuzz case ran in this session")
    kept = [r for r in ASSISTED_RESULTS if r["decline"] is None]  # (the declined cases test stock's tokens)
    n = len(kept)
    cert = sum(r["certified"] > 0 for r in kept)
    sub = [r for r in kept if r["draft_head"] == "subvocab"]
    dcert = sum(r["draft_certified"] > 0 for r in sub)
    print(f"\nhf_csv assisted fuzzer: {len(ASSISTED_RESULTS)} cases, {len(ASSISTED_RESULTS) - n} declined by design; of "
          f"the other {n}, {cert} with certified target rows, {dcert} of {len(sub)} with a sub-vocabulary draft head "
          "with certified draft rows")
    assert cert >= n / 2 and dcert >= len(sub) / 2, ASSISTED_RESULTS


@pytest.mark.usefixtures("assume_subset_exact")
@pytest.mark.slow
def test_gumbel_draft_confidence_stop(trio):
    """The drafts' returned scores are one-hot, so stock's confidence stop would never fire; hf_csv's reads the
    drawn token's probability. Threshold 0: every round drafts the full constant length; 0.999: one token. The
    assistant's config is restored."""
    target, close, _ = trio
    gc = close.generation_config
    saved = (gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold)
    drafted = {}
    try:
        gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = 4, "constant"
        for thr in (0.0, 0.999):
            gc.assistant_confidence_threshold = thr
            torch.manual_seed(0)
            out = target.generate(IDS, assistant_model=close, do_sample=True, top_k=0, max_new_tokens=40,
                                  csv_config=CSVConfig(speculative="gumbel"), return_dict_in_generate=True)
            sp = out.csv_stats["speculative"]
            drafted[thr] = sp["drafted"] / sp["verify_calls"]
            assert gc.assistant_confidence_threshold == thr
    finally:
        gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = saved
    assert drafted[0.0] > 3.0 and drafted[0.999] < 1.5, drafted


def _rounds(monkeypatch):
    """Each round's (probabilities kept, threshold after) of stock's ROC adaptation, spied on the generator class."""
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    seen, inner = [], AssistedCandidateGenerator.update_candidate_strategy

    def spy(self, *a, **k):
        inner(self, *a, **k)
        cfg = getattr(self, support().assistant_config_attr or "", None) or self.assistant_model.generation_config
        seen.append((list(getattr(self, "probs", [])), float(cfg.assistant_confidence_threshold)))

    monkeypatch.setattr(AssistedCandidateGenerator, "update_candidate_strategy", spy)
    return seen


@pytest.mark.roc
@pytest.mark.parametrize("seed", [2, 3])
def test_the_roc_adapted_threshold_is_stocks_where_scikit_learn_is_installed(monkeypatch, seed):
    """With scikit-learn importable, stock re-chooses the assistant's confidence threshold after every round from
    softmax(draft scores)[drafted token] (hf_csv.transformers.compat.adapts_confidence_threshold). A certified greedy draft's rows
    are finite on S only, so those probabilities, the thresholds and every later draft length differed from stock's
    (a tiny fp32 pair: 0.108 against stock's 0.0213, one token a round against 3, 2, 3). Such a draft now takes the
    full head, with the reason; the target stays certified."""
    pytest.importorskip("sklearn")
    t, d = _audit_pair(97, torch.float32, 10.0, seed, 0.02, 100 + seed)
    d.generation_config.assistant_confidence_threshold = 0.4
    ids = torch.randint(2, 97, (1, 4), generator=torch.Generator().manual_seed(seed))
    kw = dict(assistant_model=d, max_new_tokens=40, do_sample=False, pad_token_id=0)
    rounds = _rounds(monkeypatch)
    ref, lr = _lengths_and_out(t, ids, None, **kw)
    ref_rounds = rounds[:]
    rounds.clear()
    out, lo = _lengths_and_out(t, ids, CSVConfig(), **kw)
    got_rounds = rounds[:]
    st = t.csv_last_stats
    assert len({thr for _, thr in ref_rounds}) > 1, "stock's threshold never adapted: the test shows nothing"
    assert got_rounds == ref_rounds and lo == lr and torch.equal(out, ref)
    assert st["mode"] == "topk" and st["certified"] > 0, st
    assert st["draft"]["mode"] == "full", st["draft"]
    assert any("adapts from the draft's full softmax" in r for r in st["draft"]["reasons"]), st["draft"]["reasons"]


def test_draft_stats_have_a_summary_line_built_as_the_targets(pair, monkeypatch):
    """``csv_stats["draft"]`` carries a one-line ``summary`` like the top level's, from the same function
    (hf_csv.transformers.session.summary_line): certified rows, the rows sent to the full head and why, mean |S|."""
    import hf_csv.core.speed
    from hf_csv.core.speed import SpeedGuard

    target, draft = pair
    out = target.generate(IDS, assistant_model=draft, max_new_tokens=16, do_sample=False, csv_config=CSVConfig(),
                          return_dict_in_generate=True)
    d, top = out.csv_stats["draft"], out.csv_stats
    assert isinstance(d["summary"], str) and "\n" not in d["summary"]
    assert d["summary"].startswith(f"certified {d['certified']}/{d['head_rows']} rows"), d["summary"]
    assert "mean |S|" in d["summary"] and top["summary"].startswith(f"certified {top['certified']}/"), top["summary"]
    # the speed guard's rows are named as in the target's line
    monkeypatch.setattr(hf_csv.core.speed, "MIN_WEIGHTS", 0)
    calls, pick = {}, SpeedGuard.certified

    def every_other(self, key, rows=1, **prior):
        pick(self, key, rows, **prior)
        calls[id(self)] = calls.get(id(self), 0) + 1
        return calls[id(self)] % 2 == 0

    monkeypatch.setattr(SpeedGuard, "certified", every_other)
    t2, d2 = hf_csv.enable(_llama(2, 0)), _llama(1, 1)
    out = t2.generate(IDS, assistant_model=d2, max_new_tokens=16, do_sample=False, csv_config=CSVConfig(),
                      return_dict_in_generate=True)
    d = out.csv_stats["draft"]
    assert f"speed guard {d['declined_rows']}" in d["summary"], d["summary"]
