"""hf_csv.transformers.enable: ``model.generate(..., csv_config=...)`` on an enabled model (or after ``install()``, undone
by ``uninstall()``): stock's tokens (batches with padding, streamers, real weights), bitwise stock without
``csv_config``, an untested transformers version."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

import hf_csv
from hf_csv import CSVConfig
from conftest import _ids, model_dir, SHARED, tiny_llama, tokenizer


def test_untested_transformers_version_warns_once_and_uses_the_full_head(monkeypatch):
    """A newer transformers: no refusal at import or enable; one warning; stock tokens; the reason in stats."""
    import sys

    import hf_csv.transformers.enable as g

    monkeypatch.delenv("HF_CSV_ALLOW_UNTESTED", raising=False)
    ref = tiny_llama(scale=20.0)
    # the module hf_csv reads: transformers 5 puts a new lazy module into sys.modules when a model class is first
    # imported, so a reference taken before that is not the one `import transformers` returns after
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.99.0")
    monkeypatch.setattr(g, "_WARNED", [])
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
        assert st["mode"] == "topk" and (st["certified"] + st["near_ties"] + st["verify_reruns"]) / st["rows"] > 0.9
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


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.detach().clone().reshape(-1))

    def end(self):
        self.chunks.append(None)


def test_streamer_sees_the_same_tokens():
    m = hf_csv.enable(tiny_llama(scale=20.0))
    ids = _ids(batch=1)
    a, b = Collect(), Collect()
    x = m.generate(**ids, max_new_tokens=12, do_sample=False, streamer=a)
    y = m.generate(**ids, max_new_tokens=12, do_sample=False, streamer=b, csv_config=CSVConfig())
    assert torch.equal(x, y)
    assert len(a.chunks) == len(b.chunks) and a.chunks[-1] is None and b.chunks[-1] is None
    assert all(torch.equal(u, v) for u, v in zip(a.chunks[:-1], b.chunks[:-1]))
    assert m.csv_last_stats["certified"] > 0


@pytest.mark.parametrize("mode", ["greedy", "top_k", "assisted"])
def test_calls_under_inference_mode_and_outside_it_alternate(mode, monkeypatch):
    """``torch.inference_mode()`` around ``generate`` (a common wrapper): the first certified call builds the
    model's head there, on two threads (a head of several quantization chunks); later calls outside it and inside
    it again reuse that head. Every call certifies rows and the greedy ones give stock's tokens; none raises (inference
    tensors cannot be updated in place outside inference mode, nor by a worker thread, which does not inherit
    the mode)."""
    monkeypatch.setenv("HF_CSV_SPEED_GUARD", "0")  # certification asserted, not the speed choice
    n = torch.get_num_threads()
    torch.set_num_threads(2)  # quantization runs one Python worker per thread: 2 workers, 3 chunks
    try:
        ref = tiny_llama(vocab=20000, scale=20.0)
        m = hf_csv.enable(copy.deepcopy(ref))
        # 5 rows a call: the screen's column re-choice (after 8 rows) is still open when the next call, in the other
        # mode, updates what the first one kept
        kw: dict = dict(max_new_tokens=5, do_sample=mode == "top_k", top_k=20 if mode == "top_k" else None)
        ref_kw = dict(kw)
        if mode == "assisted":
            draft = tiny_llama(vocab=20000, scale=20.0, seed=3)
            kw["assistant_model"] = hf_csv.enable(copy.deepcopy(draft))
            ref_kw["assistant_model"] = draft
        ids = _ids(batch=1, vocab=20000)
        for inference in (True, False, True):
            ctx = torch.inference_mode() if inference else torch.no_grad()
            torch.manual_seed(5)
            with ctx:
                out = m.generate(**ids, **kw, csv_config=CSVConfig())
            st = m.csv_last_stats
            torch.manual_seed(5)
            with torch.no_grad():
                want = ref.generate(**ids, **ref_kw)
            if mode != "top_k":  # a seeded top-k draw is stock's law, its stream only where the BLAS allows
                assert torch.equal(out, want), (mode, inference)
            assert out.shape == want.shape
            assert st["certified"] > 0, st
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(num_beams=2, num_return_sequences=3),
                                 dict(csv_config=CSVConfig(index="./no-such-artifact"))],
                         ids=["max_new_tokens_0", "more_sequences_than_beams", "missing_artifact"])
def test_a_call_that_raises_leaves_no_stale_csv_last_stats(bad):
    """A certified call that raises leaves ``csv_last_stats`` None, not the previous call's stats; a call without
    csv_config does not touch it, and the next certified call sets it again."""
    m = hf_csv.enable(tiny_llama(scale=20.0))
    ids = torch.tensor([[5, 17, 33, 9]])
    m.generate(ids, max_new_tokens=3, do_sample=False, csv_config=CSVConfig())
    first = m.csv_last_stats
    assert first is not None and first["certified"] > 0
    m.generate(ids, max_new_tokens=2, do_sample=False)  # stock: leaves it as it is
    assert m.csv_last_stats is first
    kw = {"csv_config": CSVConfig(), "do_sample": False, **bad}
    with pytest.raises((ValueError, hf_csv.CSVError)):
        m.generate(ids, **{"max_new_tokens": 3, **kw})
    assert m.csv_last_stats is None
    m.generate(ids, max_new_tokens=3, do_sample=False, csv_config=CSVConfig(stats=False))
    assert m.csv_last_stats is None  # stats=False: nothing collected, nothing stale
    m.generate(ids, max_new_tokens=3, do_sample=False, csv_config=CSVConfig())
    assert m.csv_last_stats is not None and m.csv_last_stats is not first


def test_install_is_idempotent_and_uninstall_restores_the_class_functions():
    """install() makes every model's generate accept csv_config (GenerationMixin's and Whisper's, through
    hf_csv.transformers.patches.pin); a second install changes nothing; uninstall puts the original functions back."""
    from transformers.generation.utils import GenerationMixin
    from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

    owners = (GenerationMixin, WhisperGenerationMixin)
    stock = [o.__dict__["generate"] for o in owners]
    m = tiny_llama(scale=20.0)
    x = _ids()
    ref = m.generate(**x, max_new_tokens=4, do_sample=False)
    try:
        hf_csv.install()
        ours = [o.__dict__["generate"] for o in owners]
        assert all(getattr(f, "_hf_csv", False) for f in ours)
        hf_csv.install()
        assert [o.__dict__["generate"] for o in owners] == ours
        out = m.generate(**x, max_new_tokens=4, do_sample=False, csv_config=CSVConfig())
        assert torch.equal(out, ref) and m.csv_last_stats["certified"] > 0
    finally:
        hf_csv.uninstall()
    assert [o.__dict__["generate"] for o in owners] == stock
    hf_csv.uninstall()  # (nothing installed: a no-op)
    assert [o.__dict__["generate"] for o in owners] == stock
