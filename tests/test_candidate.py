"""The sub-vocabulary draft head in assisted generation (hf_csv.candidate), Llama-family and Whisper."""
import numpy as np
import pytest
import torch
from scipy import stats as sstats
from transformers import LlamaConfig, LlamaForCausalLM, WhisperForCausalLM

import hf_csv
from conftest import SHARED, model_dir, tokenizer
from hf_csv import CSVConfig
from hf_csv._compat import support
from hf_csv.candidate import truncated_assistant
from test_generate_extra import _tiny_whisper


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
    assert d["mode"] == "topk" and d["rows"] > 0 and d["certified"] == d["rows"]
    assert d["mean_subvocab_fraction"] < 0.5
    assert out.csv_stats["mode"] == "topk"  # the target verifies with the certified top-1 too


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

    import hf_csv.verify as hv

    def spying(orig):
        def spy(*a, **k):
            seen.append((a[0][0, -a[2]:].clone(), a[1].clone()))
            return orig(*a, **k)
        spy.__wrapped__ = orig  # (hf_csv._compat checks stock's signature through it)
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
    import hf_csv.verify as hv
    from hf_csv.head import find_head, get_certified_head

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
    """First new token of assisted sampling with a *truncated* (top-2) draft follows the target's
    softmax exactly. 1500 draws, chi-square at significance level 0.001, fixed seed."""
    V = 12
    target = hf_csv.enable(_llama(1, 3, V=V, scale=1.5))
    draft = _llama(1, 4, V=V, scale=1.5)
    ids = torch.tensor([[3, 7, 1]])
    with torch.no_grad():
        p = torch.softmax(target(ids).logits[0, -1].double(), -1).numpy()
    torch.manual_seed(1234)
    counts = np.zeros(V)
    cfg = CSVConfig(draft_top_k=2, budget=1.0)  # budget: never fall back to the full draft head
    drafted = 0
    for _ in range(1500):
        out = target.generate(ids, assistant_model=draft, max_new_tokens=2, do_sample=True, csv_config=cfg,
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


# ------------------------------------------------------------------------------------------ Whisper


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
def test_real_whisper_truncated_assistant_identical(monkeypatch):
    # an exactness test: the speed guard's timing-dependent choice would make the certified-row counts vacuous
    monkeypatch.setenv("HF_CSV_SPEED_GUARD", "0")
    from scipy.io import wavfile
    from transformers import AutoModelForSpeechSeq2Seq, AutoProcessor

    d = model_dir("whisper-tiny.en")
    proc = AutoProcessor.from_pretrained(d)
    m = hf_csv.enable(AutoModelForSpeechSeq2Seq.from_pretrained(d).eval())
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
    plain = m.generate(**x, max_new_tokens=32, do_sample=False)
    for assistant in (draft, m):
        out = m.generate(**x, max_new_tokens=32, do_sample=False, assistant_model=assistant, csv_config=CSVConfig())
        assert torch.equal(out, plain)
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
