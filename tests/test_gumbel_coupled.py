"""Gumbel-coupled assisted sampling, ``CSVConfig(speculative="gumbel")`` (docs/speculative.md).

The claim: the token at index t is argmax(stock's processed target row at t + g_t), where g_t is the call's keyed
Gumbel noise of index t, whatever the assistant drafts. So

* the tokens equal those of a *stock* reference (plain sampling, no assistant, no hf_csv, with a last processor
  that makes that same keyed draw on stock's full rows), for several processor settings and seeds;
* they do not depend on the assistant (two very different drafts give the same tokens);
* the law of the first two tokens equals stock assisted sampling's (two-sample chi-square, α = 1e-3, fixed seeds).
"""
import copy
from collections import Counter

import pytest
import torch

from hf_csv import CSVConfig
from hf_csv.verify import gumbel_reference
from hf_csv_kernels.verify import KeyedGumbel, gumbel_coupled_verify
from test_assisted_sampling import ALPHA, _llama, _two_sample_p

# these paths hand the values on S to stock (docs/certificates.md §2.0): their machinery under that property
pytestmark = pytest.mark.usefixtures("assume_subset_exact")

IDS = torch.tensor([[5, 17, 33, 2, 9]])

SETTINGS = {
    "plain_T1": dict(top_k=0, temperature=1.0),
    "T0.7": dict(top_k=0, temperature=0.7),
    "penalty_T1": dict(top_k=0, temperature=1.0, repetition_penalty=1.3),
    "qwen_chat": dict(top_k=20, top_p=0.8, temperature=0.7, repetition_penalty=1.05),
    "top_p_only": dict(top_k=0, top_p=0.9),
}


@pytest.fixture(scope="module")
def trio():
    """A target, a close draft (its layers perturbed) and an unrelated one (V = 4096)."""
    import hf_csv

    target = hf_csv.enable(_llama(0, V=4096))
    close = copy.deepcopy(target)
    with torch.no_grad():
        for p in close.model.layers.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return target, close, _llama(5, V=4096)


def _reference(model, seed: int, kw: dict) -> torch.Tensor:
    """Stock plain sampling (hf_csv not involved) with the call's keyed draw last (hf_csv.verify.gumbel_reference)."""
    return gumbel_reference(model, seed, input_ids=IDS, **kw)


def test_keyed_gumbel_rows_are_a_function_of_seed_and_key():
    a, b = KeyedGumbel(123, cache=2), KeyedGumbel(123, cache=2)
    r5 = a.row(5, 1000).clone()
    for k in (6, 7, 8):  # evict key 5 from a's cache: regenerated, identical
        a.row(k, 1000)
    assert torch.equal(a.row(5, 1000), r5) and torch.equal(b.row(5, 1000), r5)
    assert not torch.equal(a.row(6, 1000), r5)
    assert not torch.equal(KeyedGumbel(124).row(5, 1000), r5)
    # standard Gumbel: mean γ ≈ 0.5772, variance π²/6 (200k draws; 6 standard errors)
    x = KeyedGumbel(9).rows(range(200), 1000).double().flatten()
    assert abs(x.mean().item() - 0.5772) < 6 * (1.645 / 2e5) ** 0.5
    assert abs(x.var().item() - 1.6449) < 0.05


def test_gumbel_coupled_verify_accepts_the_matching_prefix():
    g = torch.Generator().manual_seed(0)
    L, V = 4, 50
    rows = torch.randn(L + 1, V, generator=g)
    noise = KeyedGumbel(1).rows(range(L + 1), V)
    y = (rows + noise).argmax(1)
    full = gumbel_coupled_verify(y[:L].clone(), rows, noise)
    assert full.n_accepted == L and full.tokens.tolist() == y.tolist()  # all accepted, then the bonus draw
    x = y[:L].clone()
    x[2] = (x[2] + 1) % V
    res = gumbel_coupled_verify(x, rows, noise)
    assert res.n_accepted == 2 and res.tokens.tolist() == y[:3].tolist()  # the target's own token at the mismatch
    one_hot = torch.full((L + 1, V), float("-inf"))
    one_hot[torch.arange(L + 1), y] = 0.0  # hf_csv's certified draws arrive as one-hot rows
    assert gumbel_coupled_verify(x, one_hot, noise).tokens.tolist() == y[:3].tolist()
    with pytest.raises(ValueError):
        gumbel_coupled_verify(x, rows[:L], noise[:L])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_gumbel_assisted_sampling_is_the_stock_keyed_draw_for_any_draft(trio, name):
    """Token for token: the certified assisted call (target and draft heads certified) equals the stock reference,
    with a close draft and with an unrelated one."""
    target, close, other = trio
    kw = dict(SETTINGS[name], max_new_tokens=24)
    cfg = CSVConfig(speculative="gumbel", budget=0.3)
    for seed in range(3):
        ref = _reference(target, seed, kw)
        for draft in (close, other):
            torch.manual_seed(seed)
            out = target.generate(IDS, assistant_model=draft, do_sample=True, csv_config=cfg,
                                  return_dict_in_generate=True, **kw)
            assert torch.equal(out.sequences, ref), (name, seed, out.sequences, ref)
            st = out.csv_stats
            assert st["mode"] != "full" and st["certified"] > 0, st["reasons"]
            assert st["draft"]["mode"] != "full" and st["draft"]["certified"] > 0, st["draft"]
            assert st["speculative"]["certified_verify_calls"] == st["speculative"]["verify_calls"] > 0
    # the coupling itself: a draft with the target's weights draws the target's tokens (same rows, same noise), so
    # nearly every draft is accepted (not all: its one-token forwards round differently from the verify's L + 1)
    torch.manual_seed(0)
    acc = target.generate(IDS, assistant_model=copy.deepcopy(target), do_sample=True, csv_config=cfg,
                          return_dict_in_generate=True, **kw).csv_stats["speculative"]["acceptance_rate"]
    assert acc > 0.9, acc


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


@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain_T1", "qwen_chat"])
def test_gumbel_assisted_sampling_law_matches_stock(name):
    """First two tokens: stock assisted sampling vs Gumbel-coupled (certified heads), two-sample chi-square,
    α = 1e-3, fixed seeds (V = 256, so that the law has few categories)."""
    import hf_csv

    target = hf_csv.enable(_llama(0))
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for p in draft.model.layers.parameters():
            p.add_(0.05 * torch.randn_like(p))
    kw = dict(SETTINGS[name], do_sample=True, max_new_tokens=2, num_assistant_tokens=3,
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


def test_gumbel_needs_an_assistant_model(trio):
    """Prompt lookup has no assistant to couple with: hf_csv's exact verify, with the reason."""
    target, _, _ = trio
    ids = torch.tensor([[5, 17, 33, 5, 17, 33, 5, 17]])
    out = target.generate(ids, prompt_lookup_num_tokens=3, do_sample=True, top_k=0, max_new_tokens=6,
                          csv_config=CSVConfig(speculative="gumbel"), return_dict_in_generate=True)
    assert any("couples an assistant" in r for r in out.csv_stats["reasons"])
    from hf_csv.verify import patch_speculative_sampling

    with pytest.raises(ValueError, match="keyed noise"):
        patch_speculative_sampling("gumbel")


# ----------------------------------------------------------------------------- differential fuzzer
import os  # noqa: E402
import random  # noqa: E402

from test_differential import _build  # noqa: E402

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


def test_gumbel_differential_summary():
    """Runs after the cases: the certified heads must have run in most of them."""
    if not GUMBEL_RESULTS:
        pytest.skip("no Gumbel-coupled fuzz case ran in this session")
    n = len(GUMBEL_RESULTS)
    cert = sum(r["certified"] > 0 for r in GUMBEL_RESULTS)
    print(f"\nhf_csv Gumbel-coupled fuzzer: {n} cases, {cert} with certified target rows")
    assert cert >= n / 2, GUMBEL_RESULTS


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
