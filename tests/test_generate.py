"""model.generate(..., csv_config=...): token identity with stock, mode choice, restore, exact sampling."""
from __future__ import annotations

import copy
import json
import threading

import numpy as np
import pytest
import torch
from scipy import stats as sps
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

import hf_csv
from hf_csv import CSVConfig
from hf_csv._compat import check_transformers_version, unsupported_reason
from hf_csv.errors import UnsupportedVersionError
from hf_csv.generation import classify_processor

from conftest import SHARED, model_dir, tokenizer

ALPHA = 1e-3  # significance level of the chi-square tests (fixed seeds)


def tiny_llama(vocab: int = 256, scale: float = 1.0, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(scale)  # spread the logits so certificates prune
    m.generation_config.pad_token_id = 0
    return m


@pytest.fixture(scope="module")
def llama():
    return hf_csv.enable(tiny_llama(scale=20.0))


def _ids(batch=2, length=7, seed=1, vocab=256):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:  # left padding on row 0
        ids[0, :3] = 0
        mask[0, :3] = 0
    return {"input_ids": ids, "attention_mask": mask}


# ------------------------------------------------------------------ config / compat
@pytest.mark.parametrize("kw,field", [({"mode": "fast"}, "mode"), ({"epsilon": 0.0}, "epsilon"),
                                      ({"epsilon": 1.5}, "epsilon"), ({"provider": "x"}, "provider"),
                                      ({"budget": 0}, "budget"), ({"budget": 1.5}, "budget"),
                                      ({"num_outliers": -1}, "num_outliers"), ({"stats": "yes"}, "stats"),
                                      ({"provider": "cluster"}, "index"), ({"index": 3}, "index")])
def test_config_rejects_bad_values(kw, field):
    with pytest.raises(ValueError, match=field):
        CSVConfig(**kw)


def test_version_gate():
    for v in ("4.57.0", "4.57.6", "5.20.0", "5.21.1", "5.22.3", "5.23.1"):
        assert check_transformers_version(v) == v and unsupported_reason(v) is None
    for v in ("4.56.2", "5.19.0", "5.24.0", "6.0.0"):
        assert "not a tested version" in unsupported_reason(v)
        with pytest.raises(UnsupportedVersionError, match=v.replace(".", r"\.")):
            check_transformers_version(v)


def test_untested_transformers_version_warns_once_and_uses_the_full_head(monkeypatch):
    """A newer transformers: no refusal at import or enable; one warning; stock tokens; the reason in stats."""
    import transformers
    import hf_csv.generation as g

    monkeypatch.delenv("HF_CSV_ALLOW_UNTESTED", raising=False)
    monkeypatch.setattr(transformers, "__version__", "5.99.0")
    monkeypatch.setattr(g, "_WARNED", [])
    ref = tiny_llama(scale=20.0)
    with pytest.warns(UserWarning, match="5.99.0"):
        m = hf_csv.enable(copy.deepcopy(ref))
    ids = torch.randint(0, 200, (2, 5))
    import warnings as w
    with w.catch_warnings():
        w.simplefilter("error")  # once per process: the certified call does not warn again
        out = m.generate(ids, max_new_tokens=6, do_sample=False, csv_config=CSVConfig())
    assert torch.equal(out, ref.generate(ids, max_new_tokens=6, do_sample=False))
    st = m.csv_last_stats
    assert st["mode"] == "full" and st["head_calls"] == 0 and "5.99.0" in st["reasons"][0]
    assert m.lm_head is m._modules["lm_head"] and type(m.lm_head) is torch.nn.Linear  # nothing swapped


# ------------------------------------------------------------------ stock without csv_config
@pytest.mark.slow
def test_no_csv_config_is_stock_and_modules_untouched():
    ref = tiny_llama(scale=20.0)
    m = tiny_llama(scale=20.0)
    head = m.lm_head
    names = [n for n, _ in m.named_modules()]
    hf_csv.enable(m)
    x = _ids()
    a = ref.generate(**x, max_new_tokens=12, do_sample=False)
    b = m.generate(**x, max_new_tokens=12, do_sample=False)
    assert torch.equal(a, b)
    assert m.lm_head is head and [n for n, _ in m.named_modules()] == names
    m.generate(**x, max_new_tokens=3, do_sample=False, csv_config=CSVConfig())
    assert m.lm_head is head and [n for n, _ in m.named_modules()] == names
    assert "_get_logits_processor" not in m.__dict__
    torch.manual_seed(5)
    s1 = ref.generate(**x, max_new_tokens=8, do_sample=True)
    torch.manual_seed(5)
    s2 = m.generate(**x, max_new_tokens=8, do_sample=True)
    assert torch.equal(s1, s2)
    hf_csv.disable(m)
    assert "generate" not in m.__dict__


# ------------------------------------------------------------------ greedy, tiny model, batch + padding
def test_greedy_batch_left_padding_identical(llama, assume_subset_exact):  # scores="subvocab" reads the values
    x = _ids(batch=3)
    x["input_ids"][1, :2] = 0
    x["attention_mask"][1, :2] = 0
    a = llama.generate(**x, max_new_tokens=16, do_sample=False)
    out = llama.generate(**x, max_new_tokens=16, do_sample=False, csv_config=CSVConfig(scores="subvocab"),
                         return_dict_in_generate=True, output_scores=True)
    assert torch.equal(a, out.sequences)
    st = out.csv_stats
    assert st["mode"] == "topk" and st["rows"] == 3 * 16 and st["certified"] + st["fallback"] == st["rows"]
    assert st["certified_fraction"] > 0.5 and st["mean_subvocab_fraction"] < 0.5
    # opt-in: output_scores hold -inf outside the certified sub-vocabulary
    assert any(torch.isinf(s).any() for s in out.scores)


@pytest.mark.parametrize("kw", [{"repetition_penalty": 3.0}, {"no_repeat_ngram_size": 1},
                                {"min_new_tokens": 10, "eos_token_id": 2}])
def test_lowering_processors_verified(llama, kw):
    x = _ids()
    a = llama.generate(**x, max_new_tokens=12, do_sample=False, **kw)
    b = llama.generate(**x, max_new_tokens=12, do_sample=False, csv_config=CSVConfig(), **kw)
    assert torch.equal(a, b)
    assert llama.csv_last_stats["mode"] == "topk"


def test_suppressing_the_top_token_forces_a_rerun(llama):
    """Suppress the stock greedy tokens and the first step's top-16: the processed winner of the first step
    lies outside the (2-3 token) certified set, so the check must catch it and re-run that row."""
    x = _ids(batch=1)
    first = llama.generate(**x, max_new_tokens=6, do_sample=False)[0, x["input_ids"].shape[1]:].tolist()
    with torch.no_grad():
        top16 = llama(**x).logits[0, -1].topk(16).indices.tolist()
    kw = {"suppress_tokens": sorted(set(first + top16))}
    a = llama.generate(**x, max_new_tokens=6, do_sample=False, **kw)
    b = llama.generate(**x, max_new_tokens=6, do_sample=False, csv_config=CSVConfig(), **kw)
    assert torch.equal(a, b)
    assert llama.csv_last_stats["verify_reruns"] > 0


# ------------------------------------------------------------------ processor matrix
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


def test_classify_custom_processor():
    class Mine(LogitsProcessor):
        def __call__(self, ids, s):
            return s

    assert classify_processor(Mine()) == "full"
    Mine.csv_kind = "lower"
    assert classify_processor(Mine()) == "lower"


# ------------------------------------------------------------------ restore / threads
def test_head_restored_after_exception(llama):
    class Boom(LogitsProcessor):
        csv_kind = "lower"

        def __call__(self, ids, s):
            raise RuntimeError("boom")

    head = llama.lm_head
    with pytest.raises(RuntimeError, match="boom"):
        llama.generate(**_ids(), max_new_tokens=3, logits_processor=LogitsProcessorList([Boom()]),
                       csv_config=CSVConfig())
    assert llama.lm_head is head and isinstance(head, torch.nn.Linear)
    assert "_get_logits_processor" not in llama.__dict__
    x = _ids()
    assert torch.equal(llama.generate(**x, max_new_tokens=4, do_sample=False),
                       tiny_llama(scale=20.0).generate(**x, max_new_tokens=4, do_sample=False))


def test_other_threads_see_the_stock_head(llama):
    """While a certified call runs, another thread calling the (swapped) head gets stock logits."""
    seen = {}
    h = torch.randn(1, 64)

    class Probe(LogitsProcessor):
        csv_kind = "order"

        def __call__(self, ids, s):
            if "diff" not in seen:
                wrapper = llama.lm_head
                t = threading.Thread(target=lambda: seen.setdefault("other", wrapper(h)))
                t.start(), t.join()
                seen["swapped"] = wrapper is not wrapper_inner()
                seen["diff"] = True
            return s

    def wrapper_inner():
        from hf_csv.head import find_head
        return find_head(llama)[1]

    stock = wrapper_inner()(h)
    llama.generate(**_ids(), max_new_tokens=2, logits_processor=LogitsProcessorList([Probe()]),
                   csv_config=CSVConfig())
    assert seen["swapped"]
    assert torch.equal(seen["other"], stock)


# ------------------------------------------------------------------ exact sampling
def test_sampling_distribution_exact():
    """Chi-square (α = 1e-3, fixed seeds): csv samples vs the exact softmax(ℓ/T) and vs stock samples."""
    V, n, T = 48, 3000, 0.8
    m = hf_csv.enable(tiny_llama(vocab=V, scale=10.0, seed=3))
    x = {"input_ids": torch.tensor([[5, 9, 17, 4]]).repeat(n, 1)}
    with torch.no_grad():
        logits = m(input_ids=x["input_ids"][:1]).logits[0, -1].double()
    p = torch.softmax(logits / T, 0).numpy()
    cfg = CSVConfig(budget=1.0)
    torch.manual_seed(0)
    out = m.generate(**x, max_new_tokens=1, do_sample=True, temperature=T, top_k=0, csv_config=cfg)
    st = m.csv_last_stats
    # (rows whose draw the values' slack leaves open take the full head: near_ties, docs/certificates.md §2.0)
    assert st["mode"] == "sample" and st["fallback"] == st["near_ties"] and st["mean_subvocab_fraction"] < 1.0
    torch.manual_seed(1)
    ref = m.generate(**x, max_new_tokens=1, do_sample=True, temperature=T, top_k=0)
    c_csv = np.bincount(out[:, -1].numpy(), minlength=V)
    c_ref = np.bincount(ref[:, -1].numpy(), minlength=V)
    keep = p * n >= 5  # pool rare tokens into one cell
    exp = np.append(p[keep] * n, p[~keep].sum() * n)
    for c in (c_csv, c_ref):
        obs = np.append(c[keep], c[~keep].sum())
        if exp[-1] < 5:
            obs, e = obs[:-1], exp[:-1] * obs[:-1].sum() / exp[:-1].sum()
        else:
            e = exp
        assert sps.chisquare(obs, e).pvalue > ALPHA
    table = np.stack([np.append(c_csv[keep], c_csv[~keep].sum()), np.append(c_ref[keep], c_ref[~keep].sum())])
    table = table[:, table.sum(0) > 0]
    assert sps.chi2_contingency(table).pvalue > ALPHA


@pytest.mark.parametrize("scale,budget", [(10.0, 1.0), (10.0, 0.05), (1.0, 0.05)])
def test_sampling_with_lowering_processors_law_exact(scale, budget):
    """top_k=0 with repetition penalty and a bad word: the Gumbel draw after the processors (docs/certificates.md
    §2.3) follows stock's law, softmax(processed scores / T) (chi-square, α = 1e-3, fixed seeds), also where
    the check re-runs rows with the full head (a lowered top token, small budgets)."""
    V, n, T = 48, 3000, 0.8
    m = hf_csv.enable(tiny_llama(vocab=V, scale=scale, seed=3))
    ids = torch.tensor([[5, 9, 17, 4]])
    with torch.no_grad():
        logits = m(input_ids=ids).logits[0, -1].double()
    top = int(logits.argmax())
    ids = torch.tensor([[5, top, 17, 4]])  # the top token is in the context: the penalty lowers it
    with torch.no_grad():
        x = m(input_ids=ids).logits[0, -1].double()
    pen, bad = 1.5, (top + 1) % V
    for t in set(ids[0].tolist()):
        x[t] = x[t] / pen if x[t] > 0 else x[t] * pen
    x[bad] = float("-inf")
    p = torch.softmax(x / T, 0).numpy()
    kw = dict(max_new_tokens=1, do_sample=True, temperature=T, top_k=0, repetition_penalty=pen, bad_words_ids=[[bad]])
    torch.manual_seed(0)
    out = m.generate(input_ids=ids.repeat(n, 1), csv_config=CSVConfig(budget=budget), **kw)
    st = m.csv_last_stats
    assert st["mode"] == "sample" and st["reasons"] == [], st
    c = np.bincount(out[:, -1].numpy(), minlength=V)
    assert c[bad] == 0
    keep = p * n >= 5
    obs = np.append(c[keep], c[~keep].sum())
    exp = np.append(p[keep] * n, p[~keep].sum() * n)
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1] * obs[:-1].sum() / exp[:-1].sum()
    assert sps.chisquare(obs, exp).pvalue > ALPHA


# ------------------------------------------------------------------ real models
def _prompts(k=3):
    return [json.loads(line)["prompt"] for line in (SHARED / "models" / "prompts.jsonl").read_text().splitlines()[:k]]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_smollm2_greedy_identical(dtype, monkeypatch):
    # an exactness test: the speed guard's timing-dependent choice would make the certified-row counts vacuous
    monkeypatch.setenv("HF_CSV_SPEED_GUARD", "0")
    from transformers import AutoModelForCausalLM

    d = model_dir("smollm2-135m")
    tok = tokenizer(d)
    m = hf_csv.enable(AutoModelForCausalLM.from_pretrained(d, dtype=dtype).eval())
    for prompt in _prompts(2):
        x = tok(prompt, return_tensors="pt")
        a = m.generate(**x, max_new_tokens=20, do_sample=False)
        b = m.generate(**x, max_new_tokens=20, do_sample=False, csv_config=CSVConfig())
        st = m.csv_last_stats
        # (a bf16 near-tie whose order the values' slack leaves open takes the full head: near_ties)
        assert st["mode"] == "topk" and (st["certified"] + st["near_ties"]) / st["rows"] > 0.9
        # bf16 too: the certificate bounds stock's bf16 rounding and S holds stock's own values
        assert torch.equal(a, b)
    if dtype != torch.float32:
        return
    # beam search (auto: full head, logged) and the ε-beam path with its per-row check
    x = tok(_prompts(1)[0], return_tensors="pt")
    a = m.generate(**x, max_new_tokens=12, num_beams=2, do_sample=False)
    for cfg in (CSVConfig(), CSVConfig(mode="epsilon")):
        b = m.generate(**x, max_new_tokens=12, num_beams=2, do_sample=False, csv_config=cfg)
        assert torch.equal(a, b)
    if True:  # pipeline route
        from transformers import pipeline

        pipe = pipeline("text-generation", model=m, tokenizer=tok)
        r1 = pipe(_prompts(1)[0], max_new_tokens=8, do_sample=False)
        r2 = pipe(_prompts(1)[0], max_new_tokens=8, do_sample=False, csv_config=CSVConfig())
        assert r1 == r2 and m.csv_last_stats["mode"] == "topk"


@pytest.mark.slow
def test_whisper_tiny_greedy_identical(monkeypatch):
    # an exactness test: the speed guard's timing-dependent choice would make the certified-row counts vacuous
    monkeypatch.setenv("HF_CSV_SPEED_GUARD", "0")
    from scipy.io import wavfile
    from transformers import AutoModelForSpeechSeq2Seq, AutoProcessor

    d = model_dir("whisper-tiny.en")
    proc = AutoProcessor.from_pretrained(d)
    m = hf_csv.enable(AutoModelForSpeechSeq2Seq.from_pretrained(d).eval())
    for name in ("en_fox.wav", "en_draft.wav"):
        sr, a = wavfile.read(SHARED / "models" / "speech" / name)
        a = a.astype("float32") / (32768.0 if a.dtype.kind == "i" else 1.0)
        f = proc(a, sampling_rate=sr, return_tensors="pt").input_features
        x = m.generate(f, max_new_tokens=32)
        y = m.generate(f, max_new_tokens=32, csv_config=CSVConfig())
        assert torch.equal(x, y)
        st = m.csv_last_stats
        # of the certified head's rows (the speed guard may send others to the full head: declined_rows)
        assert st["mode"] == "topk" and st["certified"] + st["near_ties"] > 0.9 * st["rows"]


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    {"min_p": 0.1},
    {"min_p": 0.05, "temperature": 0.7},
    {"min_p": 0.3, "temperature": 1.3, "repetition_penalty": 1.3, "no_repeat_ngram_size": 2},
    {"min_p": 0.02, "top_k": 0, "bad_words_ids": [[7], [9]]},
])
@pytest.mark.parametrize("scale", [20.0, 3.0])
def test_min_p_sampling_same_tokens_as_stock(kw, scale, assume_subset_exact):
    """min-p without top-k (threshold certificate, docs/certificates.md §3.3): the same tokens as stock for
    the same seed, with most rows certified on a spread head and the check catching the rest."""
    m = hf_csv.enable(tiny_llama(scale=scale, seed=3))
    kw = dict(kw, do_sample=True, top_k=0, max_new_tokens=12)
    cert = 0
    for seed in range(4):
        torch.manual_seed(seed)
        ref = m.generate(**_ids(batch=3, seed=seed), **kw)
        torch.manual_seed(seed)
        out = m.generate(**_ids(batch=3, seed=seed), csv_config=CSVConfig(), **kw)
        assert torch.equal(out, ref), (seed, kw)
        st = m.csv_last_stats
        assert st["mode"] == "threshold", st
        cert += st["certified"] - st["verify_reruns"]
    if scale == 20.0:
        assert cert > 0
