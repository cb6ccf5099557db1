"""hf_csv.core.static (``StaticTopK``, the static-shape certified head) under torch.compile with a static cache
(docs/certificates.md §3.9): transformers compiles the decode forward; hf_csv's
static certified head is traced into it with no graph break, does not recompile for shorter generations, and
gives stock compiled generate's tokens. Calls it cannot certify inside a graph take stock's head, with a reason."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from transformers import CompileConfig

import hf_csv
from hf_csv import CSVConfig
from hf_csv.core.certificate import CertifiedHead, probe_subset_kernel
from hf_csv.core.static import StaticTopK
from hf_csv.transformers.heads import find_head, get_certified_head

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_stack_differential import _build  # noqa: E402

# these paths hand the values on S to stock (docs/certificates.md §2.0): their machinery under that property
pytestmark = pytest.mark.usefixtures("assume_subset_exact")

V = 512


def _compile_kw(**kw) -> dict:
    cc = CompileConfig(fullgraph=True, dynamic=False, mode="default")
    cc._compile_all_devices = True  # transformers compiles on accelerators only, unless told (its own tests do this)
    return dict(cache_implementation="static", compile_config=cc, do_sample=False, num_beams=1, **kw)


def _tiny(arch: str, seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        m = tf.LlamaForCausalLM(tf.LlamaConfig(**common, tie_word_embeddings=False))
    elif arch == "qwen2":
        m = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, tie_word_embeddings=True))
    elif arch == "gemma3":
        # full attention on every layer: with a sliding layer, stock compiled generate itself hits the recompile limit
        # in transformers 5.23 (its sliding static cache guards on the length), so there is nothing to compare with
        m = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**common, head_dim=16, sliding_window=16,
                                                     layer_types=["full_attention"] * 2))
    else:
        m = _build("whisper", seed)  # (its vocabulary size is drawn: 97, 256 or 512)
    m = m.eval().to(dtype)
    with torch.no_grad():
        m.get_output_embeddings().weight.mul_(12.0)  # spread the logits so that the certificate prunes
    m.generation_config.pad_token_id = 0
    return hf_csv.enable(m)


def _inputs(m, batch: int = 2, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    if m.config.is_encoder_decoder:
        return dict(input_features=torch.randn(batch, 80, 3000, generator=g).to(m.dtype))
    ids = torch.randint(3, m.config.vocab_size, (batch, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding on the first row
    return dict(input_ids=ids, attention_mask=mask)


def _gen(m, x, csv: bool, **kw):
    kw = _compile_kw(**kw)
    out = m.generate(**x, csv_config=CSVConfig(), **kw) if csv else m.generate(**x, **kw)
    return out, (m.csv_last_stats if csv else None)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "whisper"])
def test_compiled_greedy_is_stock_compiled(arch):
    torch._dynamo.reset()
    m = _tiny(arch)
    x = _inputs(m)
    ref, _ = _gen(m, x, False, max_new_tokens=10)
    got, st = _gen(m, x, True, max_new_tokens=10)
    assert torch.equal(ref, got)
    c = st["compiled_head"]
    assert c["rows"] > 0 and c["certified"] > 0, st
    assert st["mode"] == "topk" and not st["reasons"], st
    # a shorter generation and a second call reuse the graph: no recompilation
    with torch._dynamo.config.patch(error_on_recompile=True):
        got2, st2 = _gen(m, x, True, max_new_tokens=5)
        ref2, _ = _gen(m, x, False, max_new_tokens=5)
    assert torch.equal(ref2, got2)
    assert st2["compiled_head"]["rows"] > 0


@pytest.mark.slow
def test_no_graph_break():
    """The static head traces into one graph (fullgraph=True would raise otherwise; counted here too)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    m = _tiny("llama", seed=3)
    _gen(m, _inputs(m), True, max_new_tokens=4)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert m.csv_last_stats["compiled_head"]["certified"] > 0
    # the graph runs the head's own screen provider (its eager kernels, through hf_csv::screen_bounds)
    from hf_csv.transformers.heads import find_head, head_entry

    plans = list(head_entry(find_head(m)[1], CSVConfig()).static_plans.values())
    assert plans and all(p.screen_key is not None for p in plans)


@pytest.mark.slow
def test_compiled_call_that_needs_a_check_uses_the_stock_head():
    """A lowering processor needs the per-step check, which cannot run inside a graph: stock's head there, the
    reason logged, the tokens stock compiled's."""
    torch._dynamo.reset()
    m = _tiny("llama", seed=4)
    x = _inputs(m)
    ref, _ = _gen(m, x, False, max_new_tokens=8, repetition_penalty=1.3)
    got, st = _gen(m, x, True, max_new_tokens=8, repetition_penalty=1.3)
    assert torch.equal(ref, got)
    assert st["mode"] == "full" and any("torch.compile" in r for r in st["reasons"]), st
    assert "compiled_head" not in st


def _sampled(m, x, csv: bool, seed: int = 0, **kw):
    torch.manual_seed(seed)
    kw = {**_compile_kw(**kw), "do_sample": True}
    return m.generate(**x, csv_config=CSVConfig(), **kw) if csv else m.generate(**x, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("arch,kw", [
    ("llama", dict(top_k=20, temperature=0.8)),
    ("qwen2", dict(top_k=8, temperature=1.3, top_p=0.9)),
    ("gemma3", dict(top_k=50)),  # transformers' default sampling: top-k 50, no temperature warper
    ("whisper", dict(top_k=5, temperature=0.7, min_p=0.05)),
])
def test_compiled_top_k_sampling_is_stock_compiled(arch, kw):
    """Sampling with a top-k warper (temperature before it, top-p / min-p after): the static top-K head in the
    graph, every row certified, the same tokens as stock compiled sampling for the same seed, and no recompile for
    a shorter call (docs/certificates.md §3.9)."""
    torch._dynamo.reset()
    m = _tiny(arch, seed=5)
    x = _inputs(m)
    ref = _sampled(m, x, False, max_new_tokens=8, **kw)
    got = _sampled(m, x, True, max_new_tokens=8, **kw)
    st = m.csv_last_stats
    assert torch.equal(ref, got)
    W = m.get_output_embeddings().weight.detach()
    ch = get_certified_head(find_head(m)[1], CSVConfig())
    if probe_subset_kernel(W, None) != "gathered" or not all(ch._gather_probe.values()):
        # this host's BLAS rounds gathered rows (or the graph's own gather) otherwise than the full call, so the
        # graph's values would not be stock's: the call takes the full head and says so (docs/certificates.md §2.0)
        assert st["mode"] == "full" and any("torch.compile" in r and "gathered" in r for r in st["reasons"]), st
        return
    assert st["mode"] == "topk" and not st["reasons"], st
    c = st["compiled_head"]
    assert c["rows"] > 0 and c["certified"] == c["rows"], st
    with torch._dynamo.config.patch(error_on_recompile=True):
        got2 = _sampled(m, x, True, seed=1, max_new_tokens=5, **kw)
        ref2 = _sampled(m, x, False, seed=1, max_new_tokens=5, **kw)
    assert torch.equal(ref2, got2)


@pytest.mark.slow
@pytest.mark.parametrize("kw,why", [
    (dict(top_k=20, repetition_penalty=1.3), "lowering processors"),  # before the top-k: needs the per-step check
    (dict(top_k=0, top_p=0.9), "nucleus"),  # no top-k warper: the nucleus check
])
def test_compiled_sampling_that_needs_a_check_uses_the_stock_head(kw, why):
    torch._dynamo.reset()
    m = _tiny("llama", seed=5)
    x = _inputs(m)
    ref = _sampled(m, x, False, max_new_tokens=6, **kw)
    got = _sampled(m, x, True, max_new_tokens=6, **kw)
    st = m.csv_last_stats
    assert torch.equal(ref, got)
    assert st["mode"] == "full" and any("torch.compile" in r and why in r for r in st["reasons"]), st


# ----------------------------------------------------------------------------------- the static head itself
@pytest.mark.parametrize("screen", [False, True], ids=["weight-only", "provider"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_static_topk_against_stock(seed, dtype, screen):
    """Eager: argmax equals stock's F.linear argmax on every row; values on the returned set equal stock's; a row
    whose certified set exceeds the capacity gives stock's whole row."""
    g = torch.Generator().manual_seed(seed)
    W = (torch.randn(V, 48, generator=g) * (2.0 + seed)).to(dtype)
    ch = CertifiedHead(W)
    H = torch.randn(5, 48, generator=g).to(dtype)
    H[2] *= 0.01  # a flat row: its certified set is large
    stock = F.linear(H, W)
    for C in (8, 64, V - 1):
        plan = StaticTopK(W, ch.provider.rows, k=1, capacity=C, screen=ch.provider if screen else None)
        rows0 = plan.counters()
        out = plan(H)
        assert out.dtype == dtype and out.shape == stock.shape
        fin = torch.isfinite(out)
        # stock's op on other columns: equal up to the kernel's column-count dependence (§2.0; one ulp here)
        torch.testing.assert_close(out[fin], stock[fin], rtol=1e-5 if dtype == torch.float32 else 0, atol=0)
        top2 = stock.float().topk(2, dim=1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-4 * top2[:, 0].abs()  # not a near-tie at stock's precision
        assert torch.equal(out.float().argmax(1)[clear], stock.float().argmax(1)[clear])
        assert fin.sum(1).min() >= 1
        r, c, _ = plan.counters()
        assert r - rows0[0] == 5 and c - rows0[1] in (0, 5)
        if c - rows0[1] == 0:  # one row over the capacity: the whole call is stock's
            assert torch.equal(out, stock)


def test_static_topk_nonfinite_row_is_stock():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(V, 32, generator=g) * 5
    plan = StaticTopK(W, CertifiedHead(W).provider.rows, k=1, capacity=64)
    H = torch.randn(3, 32, generator=g)
    H[1, 4] = float("nan")
    out, ref = plan(H), F.linear(H, W)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))  # the whole call took stock's head
    assert torch.equal(out[~torch.isnan(ref)], ref[~torch.isnan(ref)])
    assert plan.counters()[1] == 0


def test_static_topk_rejects_bad_arguments():
    W = torch.randn(V, 16)
    rows = CertifiedHead(W).provider.rows
    with pytest.raises(ValueError):
        StaticTopK(W, rows, k=2, capacity=1)
    with pytest.raises(ValueError):
        StaticTopK(W, rows, k=1, capacity=V)


@pytest.mark.slow
def test_compiled_greedy_with_a_suppress_list():
    """Whisper's fixed suppress list is folded into the static certificate (the top-1 of the other tokens): with
    stock's own favourite tokens suppressed and a small capacity, the tokens are still stock compiled's."""
    torch._dynamo.reset()
    m = _tiny("llama", seed=6)
    x = _inputs(m)
    free, _ = _gen(m, x, False, max_new_tokens=8)
    sup = sorted(set(free[:, x["input_ids"].shape[1]:].reshape(-1).tolist()))[:6]
    kw = dict(max_new_tokens=8, suppress_tokens=sup)
    ref, _ = _gen(m, x, False, **kw)
    got = m.generate(**x, **_compile_kw(**kw), csv_config=CSVConfig(compile_capacity=3))
    st = m.csv_last_stats
    assert torch.equal(ref, got)
    assert not set(got[:, x["input_ids"].shape[1]:].reshape(-1).tolist()) & set(sup)
    assert st["compiled_head"]["certified"] > 0 and st["compiled_head"]["capacity"] == 3, st


def test_static_topk_suppressed_tokens():
    """With each row's stock winner suppressed, the certified top-1 of the other tokens is stock's (capacity 1:
    a certificate that ignored the suppressed set would return only the suppressed winner)."""
    certified = 0
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        W = torch.randn(V, 32, generator=g) * 6
        H = torch.randn(4, 32, generator=g)
        stock = F.linear(H, W)
        sup = stock.argmax(1).unique()
        plan = StaticTopK(W, CertifiedHead(W).provider.rows, k=1, capacity=1, suppress=sup)
        out = plan(H)
        mask = torch.zeros(V, dtype=torch.bool)
        mask[sup] = True
        want = stock.masked_fill(mask, float("-inf")).argmax(1)
        assert torch.equal(out.masked_fill(mask, float("-inf")).argmax(1), want)
        certified += plan.counters()[1]
    assert certified > 0  # (some calls certified, not all the fallback)


def test_compiled_plan_only_for_a_lone_call():
    """A graph cannot tell calls apart: the static head is installed only while one certified call is active on the
    model; a second call, or a compiled caller without a session, makes every compiled caller use stock's head until
    the last call exits (docs/certificates.md §3.9)."""
    from hf_csv.transformers.heads import set_static_plan, swapped_head

    m = _tiny("llama", seed=7)
    W = m.lm_head.weight
    plan = StaticTopK(W.detach(), CertifiedHead(W.detach()).provider.rows, k=1, capacity=8)
    with swapped_head(m, object()):
        wrapper = m.lm_head
        assert set_static_plan(m, plan, own=True) and wrapper.static_plan is plan
        with swapped_head(m, object()):  # a second, concurrent certified call
            assert not set_static_plan(m, plan, own=True) and wrapper.static_plan is None
        assert not set_static_plan(m, plan, own=True) and wrapper.static_plan is None  # until the last exits
    assert m.lm_head is not wrapper and wrapper.static_plan is None
    with swapped_head(m, object()):
        assert m.lm_head is wrapper  # the kept wrapper: a compiled graph's guard on the head module still holds
        assert set_static_plan(m, plan, own=True)
        assert not set_static_plan(m, None, own=False) and wrapper.static_plan is None  # a stock compiled caller
    assert not set_static_plan(m, plan, own=True)  # no call active: nothing to install into


@pytest.mark.slow
def test_compiled_stats_when_the_eager_prefill_used_the_full_head(monkeypatch):
    """The eager prefill may take the full head (a large head's screen still being packed); the compiled steps'
    rows are still counted, and the call's stats are well formed (they divided by a zero vocabulary size)."""
    from hf_csv.core.certificate import CertifiedHead as CH

    torch._dynamo.reset()
    monkeypatch.setattr(CH, "ready", lambda self, H: False)
    m = _tiny("llama", seed=5)
    x = _inputs(m)
    ref, _ = _gen(m, x, False, max_new_tokens=6)
    got, st = _gen(m, x, True, max_new_tokens=6)
    assert torch.equal(ref, got)
    assert st["compiled_head"]["certified"] > 0 and st["certified"] == st["compiled_head"]["certified"], st
    assert 0 < st["mean_subvocab_fraction"] < 1, st


# ------------------------------------------------------------------ the differential fuzzer, compiled
# Random compiled cases against stock compiled generate: architecture, dtype, batch (left-padded), length, capacity,
# suppress lists, and processors the compiled head declines. Count: max(6, fuzz cases / 50) (CI: 6).
COMPILED_RESULTS: list = []


def pytest_generate_tests(metafunc):
    if "compiled_case" in metafunc.fixturenames:
        n = metafunc.config.getoption("fuzz_cases", None) or int(os.environ.get("HF_CSV_FUZZ_CASES", "300"))
        metafunc.parametrize("compiled_case", range(max(6, int(n) // 50)))


def _compiled_case(i: int) -> dict:
    import random

    rng = random.Random(6007 * i + 11)
    c = {"arch": rng.choice(["llama", "qwen2", "gemma3", "whisper"]), "seed": rng.randrange(4),
         "dtype": rng.choice([torch.float32, torch.bfloat16]), "batch": rng.choice([1, 2, 3]),
         "capacity": rng.choice([1, 3, 8, 64]), "kw": {"max_new_tokens": rng.randint(2, 8)}}
    if rng.random() < 0.4:  # sampling with a top-k warper (temperature before it, top-p after it): same seed
        c["sample"] = rng.randrange(1 << 16)
        c["kw"]["top_k"] = rng.choice([1, 5, 20, 50])
        c["kw"]["temperature"] = rng.choice([1.0, 0.7, 1.3])
        if rng.random() < 0.5:
            c["kw"]["top_p"] = 0.9
    extra = rng.random()
    if extra < 0.15:
        c["kw"]["repetition_penalty"] = 1.3  # declined in the graph: stock's head, a reason
    elif extra < 0.3 and c["arch"] != "whisper":
        c["kw"]["suppress_tokens"] = [rng.randrange(3, 90) for _ in range(rng.randint(1, 8))]
    return c


@pytest.mark.slow
def test_compiled_differential_case(compiled_case):
    c = _compiled_case(compiled_case)
    torch._dynamo.reset()
    m = _tiny(c["arch"], seed=c["seed"], dtype=c["dtype"])
    x = _inputs(m, batch=c["batch"], seed=compiled_case)
    if "input_features" in x:
        x["input_features"] = x["input_features"].to(c["dtype"])
    kw = {**_compile_kw(**c["kw"]), "do_sample": "sample" in c}
    torch.manual_seed(c.get("sample", 0))
    ref = m.generate(**x, **kw)
    torch.manual_seed(c.get("sample", 0))
    got = m.generate(**x, **kw, csv_config=CSVConfig(compile_capacity=c["capacity"]))
    st = m.csv_last_stats
    COMPILED_RESULTS.append({"case": compiled_case, "arch": c["arch"], "mode": st["mode"], "sampled": "sample" in c,
                             "compiled": st.get("compiled_head"), "reasons": st["reasons"]})
    assert torch.equal(ref, got), f"compiled case {compiled_case} {c}: tokens differ from stock compiled generate"
    if "repetition_penalty" in c["kw"]:
        assert st["mode"] == "full" and any("torch.compile" in r for r in st["reasons"]), st
    elif st["mode"] != "full":
        assert st["compiled_head"]["rows"] > 0, st


def test_compiled_differential_summary():
    """Runs after the compiled cases: most of them must have run the certified compiled head (declining or
    falling back everywhere must not pass for success)."""
    if not COMPILED_RESULTS:
        pytest.skip("no compiled fuzz case ran in this session")
    n = len(COMPILED_RESULTS)
    cert = sum(bool(r["compiled"] and r["compiled"]["certified"] > 0) for r in COMPILED_RESULTS)
    print(f"\nhf_csv compiled fuzzer: {n} cases, {cert} with certified compiled rows, "
          f"{sum(r['mode'] == 'full' for r in COMPILED_RESULTS)} declined; sampled: "
          f"{sum(r['sampled'] for r in COMPILED_RESULTS)} cases, "
          f"{sum(bool(r['sampled'] and r['compiled'] and r['compiled']['certified'] > 0) for r in COMPILED_RESULTS)} "
          "with certified compiled rows")
    assert cert >= n / 2, COMPILED_RESULTS


@pytest.mark.slow
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "top-k-sampling"])
def test_compiled_takes_stock_head_where_the_speed_guard_measured_it_faster(sampled):
    """A compiled step cannot be timed: where the head's speed guard measured the full head faster on the eager steps
    (same mode and batch), the graph gets stock's head, the session stays certified for its eager steps (which keep
    feeding the guard), the reason is logged, and the tokens are stock compiled's."""
    from hf_csv.transformers.heads import find_head, head_entry
    from hf_csv.core.speed import SpeedGuard
    from hf_csv.core.speed import rows_bucket

    torch._dynamo.reset()
    m = _tiny("llama", seed=6)
    x = _inputs(m)
    if sampled and probe_subset_kernel(m.get_output_embeddings().weight.detach(), None) != "gathered":
        pytest.skip("this host's BLAS rounds gathered rows otherwise than the full call: compiled top-k sampling "
                    "keeps the full head before any speed-guard verdict (test_compiled_top_k_sampling_is_stock_compiled)")
    kw = dict(max_new_tokens=6, top_k=10, temperature=0.9) if sampled else dict(max_new_tokens=6)
    run = (lambda csv: _sampled(m, x, csv, **kw)) if sampled else (lambda csv: _gen(m, x, csv, **kw)[0])
    entry = head_entry(find_head(m)[1], CSVConfig())
    entry.guard = g = SpeedGuard()  # (tiny heads have none: MIN_WEIGHTS)
    try:
        tag = ("topk", 0, 10, True) if sampled else ("topk", 0, 1, False)  # (TopK.guard_tag: a checked top-10, top-1)
        key = (*tag, rows_bucket(x["input_ids"].shape[0]), torch.float32, torch.get_num_threads())
        for _ in range(4):
            g.certified(key)
            g.record(key, True, 1.0)
        for _ in range(2):
            g.certified(key)
            g.record(key, False, 0.01)
        assert g.prefers_full(key)
        ref = run(False)
        got = run(True)
        st = m.csv_last_stats
        assert torch.equal(ref, got)
        assert st["mode"] == "topk" and "compiled_head" not in st, st
        assert any("speed guard" in r and "inside the graph" in r for r in st["reasons"]), st
        # the guard now prefers the certified head: the next call runs the plan in the graph
        g._state.clear()
        got = run(True)
        assert torch.equal(ref, got)
        assert m.csv_last_stats["compiled_head"]["rows"] > 0
    finally:
        entry.guard = None


def _eager_backend(gm, example_inputs):
    """A compile backend that runs the traced graph's own ops: a backend hf_csv does not know."""
    return gm.forward


def test_graph_gemm_reason_reads_the_calls_compile_config(monkeypatch):
    """A sampled compiled head hands the graph's values on S to stock's sampler; only inductor's default lowering
    (the eager BLAS GEMM that ``graph_gather_exact`` probes) or an eager backend keeps that probe meaningful."""
    from torch._inductor import config as inductor_config
    from hf_csv.transformers.scope import _graph_gemm_reason

    def reason(**cc) -> "str | None":
        gc = tf.GenerationConfig(compile_config=CompileConfig(**cc))
        return _graph_gemm_reason(({}, gc), {})

    assert reason() is None and reason(mode="default") is None and reason(backend="aot_eager") is None
    assert _graph_gemm_reason(({},), {"generation_config": tf.GenerationConfig()}) is None  # no compile_config
    assert "max-autotune" in reason(mode="max-autotune-no-cudagraphs")
    assert "max-autotune" in reason(options={"max_autotune_gemm": True})
    assert "_eager_backend" in reason(backend=_eager_backend)
    monkeypatch.setattr(inductor_config, "max_autotune", True)
    assert "max-autotune" in reason(mode="default")
    assert reason(backend="eager") is None  # no inductor lowering at all


def test_compiled_sampling_under_another_gemm_lowering_uses_the_stock_head():
    """Sampling through a backend whose GEMM lowering hf_csv has not probed: the full head, with the reason, and
    stock's tokens; greedy decoding (decided within the values' slack) keeps the static certified head."""
    torch._dynamo.reset()
    m = _tiny("llama", seed=5)
    x = _inputs(m)

    def run(csv: bool, do_sample: bool = False, **kw):
        torch.manual_seed(0)
        kw = {**_compile_kw(**kw), "do_sample": do_sample}
        kw["compile_config"].backend = _eager_backend
        return m.generate(**x, csv_config=CSVConfig(), **kw) if csv else m.generate(**x, **kw)

    ref = run(False, max_new_tokens=6, do_sample=True, top_k=20, temperature=0.8)
    got = run(True, max_new_tokens=6, do_sample=True, top_k=20, temperature=0.8)
    st = m.csv_last_stats
    assert torch.equal(ref, got)
    assert st["mode"] == "full" and any("torch.compile" in r and "_eager_backend" in r for r in st["reasons"]), st
    ref = run(False, max_new_tokens=6)
    got = run(True, max_new_tokens=6)
    st = m.csv_last_stats
    assert torch.equal(ref, got)
    assert st["mode"] == "topk" and st["compiled_head"]["certified"] > 0, st
