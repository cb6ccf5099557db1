"""hf_csv.transformers.acceptance: the scoped patch of transformers' ``_speculative_sampling`` (mechanics, stock's signature, versions)
and assisted sampling through it: the certified target ("spec", docs/speculative.md) with stock's law, and
Gumbel-coupled sampling, ``CSVConfig(speculative="gumbel")``, whose tokens are a stock keyed draw whatever the draft."""
from __future__ import annotations

import copy
import os
import random
import sys
import threading
import warnings
from collections import Counter

import pytest
import torch
import transformers
import transformers.generation.utils as gen_utils

from hf_csv import CSVConfig
from hf_csv.core.errors import UnsupportedVersionError
from hf_csv.transformers.acceptance import gumbel_reference, LossyVerifyWarning, patch_speculative_sampling, speculative_sampling_exact

from conftest import ALPHA, spec_llama, _two_sample_p
from test_stack_differential import _build
from verify_laws import draw_drafts, _EXTRA, make_case, run_stock, STOCK, stock, two_sample_pvalue, _X


def test_assisted_sampling_uses_the_patch_and_restores(assist_pair, monkeypatch):
    """Without a top-k warper assisted sampling runs hf_csv's exact verify (the certified one in mode spec, or the
    exact one on full rows); with one, the checked top-K rows go to stock's verify (test_transformers_drafts.py)."""
    target, draft = assist_pair
    ids = torch.tensor([[5, 17, 33, 2, 9]])
    stock = gen_utils._speculative_sampling
    calls = []
    import hf_csv.transformers.acceptance as hv
    orig_impl, orig_cert = hv._IMPLS["exact"], hv.speculative_sampling_certified
    monkeypatch.setitem(hv._IMPLS, "exact", lambda *a, **k: (calls.append(1), orig_impl(*a, **k))[1])
    monkeypatch.setattr(hv, "speculative_sampling_certified", lambda *a, **k: (calls.append(2), orig_cert(*a, **k))[1])
    out = target.generate(ids, assistant_model=draft, max_new_tokens=12, do_sample=True, top_k=0,
                          csv_config=CSVConfig())
    assert calls, "assisted sampling under csv_config must run hf_csv's exact verify"
    assert gen_utils._speculative_sampling is stock
    assert out.shape[1] > ids.shape[1] and (out >= 0).all() and (out < 96).all()
    with pytest.warns(LossyVerifyWarning):
        target.generate(ids, assistant_model=draft, max_new_tokens=6, do_sample=True,
                        csv_config=CSVConfig(speculative="sigmoid"))
    assert gen_utils._speculative_sampling is stock


SPEC_SETTINGS = {
    "plain_T1": dict(top_k=0, temperature=1.0),
    "T0.7": dict(top_k=0, temperature=0.7),
    "qwen_chat": dict(top_k=20, top_p=0.8, temperature=0.7, repetition_penalty=1.05),
}


@pytest.mark.usefixtures("assume_subset_exact")
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SPEC_SETTINGS))
def test_assisted_sampling_law_matches_stock(spec_pair, name):
    """First two tokens of assisted sampling, stock vs certified target (+ sub-vocabulary draft and exact
    verify): two-sample chi-square on the joint law, α = 1e-3, fixed seeds; the target's head is certified."""
    target, draft = spec_pair
    kw = dict(SPEC_SETTINGS[name], do_sample=True, max_new_tokens=2, num_assistant_tokens=3,
              num_assistant_tokens_schedule="constant")
    ids = torch.tensor([[5, 17, 33, 2, 9]])
    n = 700
    obs_s, obs_c = Counter(), Counter()
    stats = None
    torch.manual_seed(11)
    for _ in range(n):
        out = target.generate(ids, assistant_model=draft, **kw)
        obs_s[tuple(out[0, 5:7].tolist())] += 1
    torch.manual_seed(12)
    for i in range(n):
        out = target.generate(ids, assistant_model=draft, csv_config=CSVConfig(budget=0.3), return_dict_in_generate=True,
                              **kw)
        obs_c[tuple(out.sequences[0, 5:7].tolist())] += 1
        if i == 0:
            stats = out.csv_stats
    assert stats["mode"] == ("topk" if name == "qwen_chat" else "spec"), stats["reasons"]
    assert stats["certified"] > 0
    if stats["mode"] == "spec":
        sp = stats["speculative"]
        assert sp["certified_verify_calls"] >= 1 and sp["target_rows"] >= 1
    assert _two_sample_p(obs_s, obs_c) > ALPHA


@pytest.mark.usefixtures("assume_subset_exact")
def test_spec_mode_counts_rows_and_certifies(spec_pair):
    target, draft = spec_pair
    ids = torch.tensor([[5, 17, 33, 2, 9]])
    out = target.generate(ids, assistant_model=draft, do_sample=True, top_k=0, max_new_tokens=24,
                          csv_config=CSVConfig(budget=0.3), return_dict_in_generate=True)
    st = out.csv_stats
    assert st["mode"] == "spec" and st["certified"] > 0
    sp = st["speculative"]
    # every row looked at was decided by the bounds or completed (a row can be both: accepted by its bounds
    # and later... no: each counted row is decided once, the residual or bonus draw adds one more decision)
    assert sp["target_rows"] >= 1 and sp["target_rows_by_bounds"] + sp["target_rows_completed"] >= sp["target_rows"]
    assert sp["target_rows_by_bounds"] > 0
    assert 0 <= sp["acceptance_rate"] <= 1


IDS = torch.tensor([[5, 17, 33, 2, 9]])


GUMBEL_SETTINGS = {
    "plain_T1": dict(top_k=0, temperature=1.0),
    "T0.7": dict(top_k=0, temperature=0.7),
    "penalty_T1": dict(top_k=0, temperature=1.0, repetition_penalty=1.3),
    "qwen_chat": dict(top_k=20, top_p=0.8, temperature=0.7, repetition_penalty=1.05),
    "top_p_only": dict(top_k=0, top_p=0.9),
}


def _reference(model, seed: int, kw: dict) -> torch.Tensor:
    """Stock plain sampling (hf_csv not involved) with the call's keyed draw last (hf_csv.transformers.acceptance.gumbel_reference)."""
    return gumbel_reference(model, seed, input_ids=IDS, **kw)


@pytest.mark.usefixtures("assume_subset_exact")
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GUMBEL_SETTINGS))
def test_gumbel_assisted_sampling_is_the_stock_keyed_draw_for_any_draft(trio, name):
    """Token for token: the certified assisted call (target and draft heads certified) equals the stock reference,
    with a close draft and with an unrelated one."""
    target, close, other = trio
    kw = dict(GUMBEL_SETTINGS[name], max_new_tokens=24)
    cfg = CSVConfig(speculative="gumbel", budget=0.3)
    for seed in range(3):
        ref = _reference(target, seed, kw)
        for draft in (close, other):
            torch.manual_seed(seed)
            out = target.generate(IDS, assistant_model=draft, do_sample=True, csv_config=cfg,
                                  return_dict_in_generate=True, **kw)
            assert torch.equal(out.sequences, ref), (name, seed, out.sequences, ref)
            st = out.csv_stats
            # (top-p 0.9 alone on this small random head: the bounds decide no sub-vocabulary row's nucleus, and the
            # check re-runs each on stock's head, counted as fallback rows, not certified ones)
            ran = (lambda s: s["certified"] > 0 or (name == "top_p_only" and s["verify_reruns"] > 0))
            assert st["mode"] != "full" and ran(st), st["reasons"]
            assert st["draft"]["mode"] != "full" and ran(st["draft"]), st["draft"]
            assert st["speculative"]["certified_verify_calls"] == st["speculative"]["verify_calls"] > 0
    # the coupling itself: a draft with the target's weights draws the target's tokens (same rows, same noise), so
    # nearly every draft is accepted (not all: its one-token forwards round differently from the verify's L + 1)
    torch.manual_seed(0)
    acc = target.generate(IDS, assistant_model=copy.deepcopy(target), do_sample=True, csv_config=cfg,
                          return_dict_in_generate=True, **kw).csv_stats["speculative"]["acceptance_rate"]
    assert acc > 0.9, acc


@pytest.mark.usefixtures("assume_subset_exact")
@pytest.mark.slow
def test_gumbel_assisted_sampling_with_full_heads_is_the_same_draw(trio):
    """Where hf_csv uses stock's heads (draft_head='full'; the target's head over the budget) the coupled draws
    happen on the full rows with the same noise: the same tokens."""
    target, close, _ = trio
    kw = dict(top_k=0, temperature=1.0, max_new_tokens=16)
    ref = _reference(target, 3, kw)
    for cfg in (CSVConfig(speculative="gumbel", draft_head="full"), CSVConfig(speculative="gumbel", budget=1)):
        torch.manual_seed(3)
        out = target.generate(IDS, assistant_model=close, do_sample=True, csv_config=cfg,
                              return_dict_in_generate=True, **kw)
        assert torch.equal(out.sequences, ref)
    assert out.csv_stats["fallback"] > 0  # budget = 1 row: every row over it


@pytest.mark.usefixtures("assume_subset_exact")
def test_gumbel_with_output_scores_draws_from_the_processed_rows(trio):
    """output_scores=True: the target returns its processed rows as scores (here its checked top-K rows, not one-hot
    draws) and the verify makes the keyed draws on them itself: the same tokens as the reference."""
    target, close, _ = trio
    kw = dict(top_k=20, temperature=0.7, max_new_tokens=12)
    ref = _reference(target, 4, kw)
    torch.manual_seed(4)
    out = target.generate(IDS, assistant_model=close, do_sample=True, output_scores=True, return_dict_in_generate=True,
                          csv_config=CSVConfig(speculative="gumbel", scores="subvocab", budget=0.3), **kw)
    assert torch.equal(out.sequences, ref)
    finite = [int(torch.isfinite(s).sum()) for s in out.scores]
    assert max(finite) > 1, finite  # processed rows, not one-hot draws


@pytest.mark.usefixtures("assume_subset_exact")
@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain_T1", "qwen_chat"])
def test_gumbel_assisted_sampling_law_matches_stock(name):
    """First two tokens: stock assisted sampling vs Gumbel-coupled (certified heads), two-sample chi-square,
    α = 1e-3, fixed seeds (V = 256, so that the law has few categories)."""
    import hf_csv

    target = hf_csv.enable(spec_llama(0))
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for p in draft.model.layers.parameters():
            p.add_(0.05 * torch.randn_like(p))
    kw = dict(GUMBEL_SETTINGS[name], do_sample=True, max_new_tokens=2, num_assistant_tokens=3,
              num_assistant_tokens_schedule="constant")
    n = 700
    obs_s, obs_c = Counter(), Counter()
    torch.manual_seed(21)
    for _ in range(n):
        obs_s[tuple(target.generate(IDS, assistant_model=draft, **kw)[0, 5:7].tolist())] += 1
    torch.manual_seed(22)
    for i in range(n):
        out = target.generate(IDS, assistant_model=draft, csv_config=CSVConfig(speculative="gumbel", budget=0.3),
                              return_dict_in_generate=True, **kw)
        obs_c[tuple(out.sequences[0, 5:7].tolist())] += 1
        if i == 0:
            assert out.csv_stats["mode"] != "full" and out.csv_stats["certified"] > 0
    assert _two_sample_p(obs_s, obs_c) > ALPHA


@pytest.mark.usefixtures("assume_subset_exact")
def test_gumbel_needs_an_assistant_model(trio):
    """Prompt lookup has no assistant to couple with: hf_csv's exact verify, with the reason."""
    target, _, _ = trio
    ids = torch.tensor([[5, 17, 33, 5, 17, 33, 5, 17]])
    out = target.generate(ids, prompt_lookup_num_tokens=3, do_sample=True, top_k=0, max_new_tokens=6,
                          csv_config=CSVConfig(speculative="gumbel"), return_dict_in_generate=True)
    assert any("couples an assistant" in r for r in out.csv_stats["reasons"])
    from hf_csv.transformers.acceptance import patch_speculative_sampling

    with pytest.raises(ValueError, match="keyed noise"):
        patch_speculative_sampling("gumbel")


GUMBEL_RESULTS: list = []


def pytest_generate_tests(metafunc):
    if "gumbel_case" in metafunc.fixturenames:
        n = metafunc.config.getoption("fuzz_cases", None) or int(os.environ.get("HF_CSV_FUZZ_CASES", "300"))
        metafunc.parametrize("gumbel_case", range(max(8, int(n) // 25)))


def _gumbel_case(i: int) -> dict:
    rng = random.Random(104729 * i + 3)
    kw = {"top_k": rng.choice([0, 0, 20, 50]), "max_new_tokens": rng.randint(4, 16)}
    if rng.random() < 0.6:
        kw["temperature"] = rng.choice([0.7, 1.3])
    if rng.random() < 0.3:
        kw["top_p"] = 0.8
    if rng.random() < 0.4:
        kw["repetition_penalty"] = rng.choice([1.05, 1.3, 3.0])
    if rng.random() < 0.15:
        kw["min_p"] = 0.05
    return {"arch": rng.choice(["llama", "qwen2", "gemma2", "gemma3", "cohere", "granite", "phi"]),
            "seed": rng.randrange(4), "dtype": rng.choice([torch.float32, torch.bfloat16]),
            "draft_noise": rng.choice([0.01, 0.05, 0.2]), "n_draft": rng.choice([2, 4, 8]),
            "prompt_len": rng.randint(2, 8), "kw": kw, "sample": rng.randrange(1 << 16),
            "draft_head": rng.choice(["subvocab", "subvocab", "full"]),
            # the tiny fuzz heads' certified sets often exceed the default budget (V/8): mostly the whole V
            "budget": rng.choice([None, 1.0, 1.0])}


@pytest.mark.usefixtures("assume_subset_exact")
def test_gumbel_coupled_differential(gumbel_case):
    """Fuzz over architectures, dtypes, draft quality and sampling settings: the certified Gumbel-coupled call returns
    the tokens of the same call with stock's heads (output_logits for the target, draft_head='full'),
    i.e. the keyed draws on stock's processed rows (the assisted forwards are the same, so is their rounding)."""
    c = _gumbel_case(gumbel_case)
    target = __import__("hf_csv").enable(_build(c["arch"], c["seed"]).to(c["dtype"]))
    draft = _build(c["arch"], c["seed"]).to(c["dtype"])
    g = torch.Generator().manual_seed(gumbel_case)
    with torch.no_grad():
        for prm in draft.model.layers.parameters():
            prm.add_((c["draft_noise"] * torch.randn(prm.shape, generator=g)).to(prm.dtype))
    draft.generation_config.num_assistant_tokens = c["n_draft"]
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    ids = torch.randint(3, target.config.vocab_size, (1, c["prompt_len"]), generator=g)
    gen = dict(c["kw"], do_sample=True, pad_token_id=0)
    torch.manual_seed(c["sample"])
    # output_logits: the target's head is stock's for the call (the raw logits must be stock's); the draft's too
    ref = target.generate(ids, assistant_model=draft, return_dict_in_generate=True, output_logits=True, **gen,
                          csv_config=CSVConfig(speculative="gumbel", draft_head="full"))
    torch.manual_seed(c["sample"])
    out = target.generate(ids, assistant_model=draft, return_dict_in_generate=True, **gen,
                          csv_config=CSVConfig(speculative="gumbel", draft_head=c["draft_head"],
                                               **({} if c["budget"] is None else {"budget": c["budget"]})))
    st = out.csv_stats
    GUMBEL_RESULTS.append({"case": gumbel_case, "arch": c["arch"], "mode": st["mode"],
                           "certified": st.get("certified", 0), "draft_certified": st.get("draft", {}).get("certified", 0)})
    assert ref.csv_stats["mode"] == "full" and ref.csv_stats["draft"]["mode"] == "full"  # stock's rows
    assert torch.equal(ref.sequences, out.sequences), f"gumbel case {gumbel_case} {c}: tokens differ"


@pytest.mark.usefixtures("assume_subset_exact")
def test_gumbel_differential_summary():
    """Runs after the cases: the certified heads must have run in most of them."""
    if not GUMBEL_RESULTS:
        pytest.skip("no Gumbel-coupled fuzz case ran in this session")
    n = len(GUMBEL_RESULTS)
    cert = sum(r["certified"] > 0 for r in GUMBEL_RESULTS)
    print(f"\nhf_csv Gumbel-coupled fuzzer: {n} cases, {cert} with certified target rows")
    assert cert >= n / 2, GUMBEL_RESULTS


@pytest.mark.usefixtures("assume_subset_exact")
@pytest.mark.parametrize("source", ["default", "model_config", "passed_config"])
def test_gumbel_reference_reads_the_generation_config_warpers(trio, source):
    """The warpers the call does not name come from the generation config (transformers' default top_k = 50, a model's
    generation_config.json, or a generation_config passed): gumbel_reference ignored them before (issue 35, item 6)."""
    from transformers import GenerationConfig

    target, close, _ = trio
    model = copy.deepcopy(target)
    kw = dict(max_new_tokens=16)
    if source == "model_config":
        model.generation_config.top_k, model.generation_config.temperature = 7, 0.6
    elif source == "passed_config":
        kw["generation_config"] = GenerationConfig(top_k=5, top_p=0.9, max_new_tokens=16, pad_token_id=0)
    cfg = CSVConfig(speculative="gumbel", budget=0.3)
    for seed in range(2):
        ref = gumbel_reference(model, seed, input_ids=IDS, **kw)
        torch.manual_seed(seed)
        out = model.generate(IDS, assistant_model=close, do_sample=True, csv_config=cfg, **kw)
        assert torch.equal(out, ref), (source, seed)


@pytest.mark.usefixtures("one_thread")
def test_is_done_candidate_keeps_the_drafts_without_a_bonus(monkeypatch):
    """transformers 4.57's contract: when every draft is accepted and the last one ends the sequence,
    return the L drafts and n = L - 1 (no bonus token). Exercised on every version through the dispatch."""
    import hf_csv.transformers.acceptance as hv

    zp, zq, g = make_case(32, 3, seed=30)
    zp = torch.cat([zq, zp[-1:]])  # p == q on the drafted positions: every draft is accepted
    d = draw_drafts(zq, 1, g)[0]
    cand = torch.cat([torch.zeros(2, dtype=torch.long), d])[None]
    with patch_speculative_sampling():
        monkeypatch.setattr(hv, "_extra", "is_done_candidate")
        v, n = gen_utils._speculative_sampling(cand, zq[None], 3, zp[None], True)
        assert v[0].tolist() == d.tolist() and int(n) == 2
        v, n = gen_utils._speculative_sampling(cand, zq[None], 3, zp[None], False)
        assert v.shape[1] == 4 and v[0, :3].tolist() == d.tolist() and int(n) == 3
        monkeypatch.setattr(hv, "_extra", "assistant_ensemble_weight")


@pytest.mark.usefixtures("one_thread")
@pytest.mark.skipif(_EXTRA != "is_done_candidate", reason="transformers 4.57 only")
def test_is_done_candidate_law_matches_stock_457():
    """4.57, is_done_candidate=True: the patched verify's law equals stock's (alpha = ALPHA)."""
    zp, zq, g = make_case(12, 2, seed=31)
    drafts = draw_drafts(zq, 6000, g)
    with patch_speculative_sampling():
        ours = Counter(tuple(gen_utils._speculative_sampling(torch.cat([torch.zeros(1, 3, dtype=torch.long), d[None]], 1),
                                                             zq[None], 2, zp[None], True)[0][0].tolist())
                       for d in drafts)
    theirs = Counter(run_stock(zp, zq, drafts, 5, is_done_candidate=True))
    assert two_sample_pvalue(ours, theirs) > ALPHA


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("L", [1, 2, 5])
def test_stock_signature_shapes_and_dtypes(L):
    zp, zq, g = make_case(64, L, seed=17)
    d = draw_drafts(zq, 1, g)[0]
    cand = torch.cat([torch.zeros(4, dtype=torch.long), d])[None]
    v1, n1 = stock(cand, zq[None], L, zp[None])
    v2, n2 = speculative_sampling_exact(cand, zq[None], L, zp[None])
    assert v2.dtype == v1.dtype and v2.dim() == v1.dim() == 2 and v2.shape[0] == 1
    assert n2.dtype == n1.dtype and n2.dim() == n1.dim() == 0
    assert v2.shape[1] == int(n2) + 1 and v2[0, : int(n2)].tolist() == d[: int(n2)].tolist()
    with pytest.raises(ValueError):
        speculative_sampling_exact(cand.repeat(2, 1), zq[None].repeat(2, 1, 1), L, zp[None].repeat(2, 1, 1))


@pytest.mark.usefixtures("one_thread")
def test_sigmoid_patch_warns_on_entry():
    with pytest.warns(LossyVerifyWarning):
        with patch_speculative_sampling("sigmoid") as h:
            assert h.mode == "sigmoid"
    assert gen_utils._speculative_sampling is STOCK


@pytest.mark.usefixtures("one_thread")
def test_patch_restores_on_exit_and_exception_and_nests():
    assert gen_utils._speculative_sampling is STOCK
    with patch_speculative_sampling() as outer:
        patched = gen_utils._speculative_sampling
        assert patched is not STOCK
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LossyVerifyWarning)
            with patch_speculative_sampling("sigmoid") as inner:
                assert gen_utils._speculative_sampling is patched
        assert inner.mode == "sigmoid"
        assert gen_utils._speculative_sampling is patched  # outer scope still active
    assert outer.mode == "exact"
    assert gen_utils._speculative_sampling is STOCK
    with pytest.raises(RuntimeError, match="boom"):
        with patch_speculative_sampling():
            raise RuntimeError("boom")
    assert gen_utils._speculative_sampling is STOCK


@pytest.mark.usefixtures("one_thread")
def test_patch_is_thread_local():
    zp, zq, g = make_case(16, 2, seed=20)
    d = draw_drafts(zq, 1, g)[0]
    cand = torch.cat([torch.zeros(1, dtype=torch.long), d])[None]
    entered, release = threading.Event(), threading.Event()
    other: dict = {}

    def worker():
        with patch_speculative_sampling() as h:
            entered.set()
            release.wait(10)
            gen_utils._speculative_sampling(cand, zq[None], 2, zp[None], *_X)
            other["calls"] = h.calls

    t = threading.Thread(target=worker)
    t.start()
    assert entered.wait(10)
    assert gen_utils._speculative_sampling is not STOCK
    with patch_speculative_sampling() as mine:
        gen_utils._speculative_sampling(cand, zq[None], 2, zp[None], *_X)
    assert gen_utils._speculative_sampling is not STOCK  # the worker's scope keeps it installed
    gen_utils._speculative_sampling(cand, zq[None], 2, zp[None], *_X)  # this thread: no scope -> stock
    release.set()
    t.join(10)
    assert mine.calls == 1 and other["calls"] == 1
    assert gen_utils._speculative_sampling is STOCK


@pytest.mark.usefixtures("one_thread")
def test_unknown_transformers_version_fails_clearly(monkeypatch):
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "9.99.0")  # the module hf_csv reads now
    with pytest.raises(UnsupportedVersionError, match="9.99.0"):
        with patch_speculative_sampling():
            pass
    assert gen_utils._speculative_sampling is STOCK


@pytest.mark.usefixtures("one_thread")
def test_bad_mode():
    with pytest.raises(ValueError):
        patch_speculative_sampling("fast")  # type: ignore[arg-type]


def _tiny_llamas():
    from transformers import LlamaConfig, LlamaForCausalLM

    common = dict(vocab_size=96, max_position_embeddings=256, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, **common)).eval()
    assistant = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, **common)).eval()
    # make the draft resemble the target a little so that drafts get accepted sometimes
    with torch.no_grad():
        assistant.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight[:, :32])
    return target, assistant


@pytest.mark.usefixtures("one_thread")
def test_end_to_end_assisted_generate():
    target, assistant = _tiny_llamas()
    ids = torch.tensor([[1, 5, 9, 22, 40]])
    with patch_speculative_sampling() as h:
        torch.manual_seed(1)
        out = target.generate(ids, assistant_model=assistant, do_sample=True, max_new_tokens=24,
                              min_new_tokens=24)
    assert h.calls > 0 and h.drafted > 0
    assert out.shape == (1, ids.shape[1] + 24)
    assert out[0, : ids.shape[1]].tolist() == ids[0].tolist()
    assert ((out >= 0) & (out < 96)).all()
    assert gen_utils._speculative_sampling is STOCK
    # greedy assisted output equals plain greedy (inside the patch too)
    plain = target.generate(ids, do_sample=False, max_new_tokens=20, min_new_tokens=20)
    with patch_speculative_sampling():
        assisted = target.generate(ids, assistant_model=assistant, do_sample=False, max_new_tokens=20,
                                   min_new_tokens=20)
    assert torch.equal(plain, assisted)
