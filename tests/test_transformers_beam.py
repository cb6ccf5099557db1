"""Token-identical beam search (``CSVConfig(beam_search="exact")``, docs/certificates.md §3.10).

* outputs equal stock's on tiny models of four architectures, fp32 and bf16, batch 1 and 3 (left-padded), with the
  lowering processors the certificate admits, length penalties and early-stopping settings;
* the intervals contain stock's processed log-probs at every step (the soundness the decisions rest on);
* an undecidable decision re-runs the call on the full head: stock's tokens, counted, with the reason;
* a replay of stock's bookkeeping that does not match it bit for bit raises instead of decoding on.
"""
from __future__ import annotations

import inspect

import pytest
import torch

import hf_csv
import hf_csv.transformers.beam as hb
import hf_csv.transformers.plans as hplan
from hf_csv import CSVConfig
from hf_csv.core.errors import CSVError

from test_stack_differential import _inputs, _model, _seqs

# these paths hand the values on S to stock (docs/certificates.md §2.0): their machinery under that property
pytestmark = pytest.mark.usefixtures("assume_subset_exact")

EXACT = {"beam_search": "exact", "budget": 0.5}

CASES = [
    # (arch, dtype, num_beams, batch, extra generate kwargs)
    ("llama", torch.float32, 2, 1, {}),
    ("llama", torch.float32, 5, 3, {"repetition_penalty": 1.3}),
    ("llama", torch.bfloat16, 3, 3, {"no_repeat_ngram_size": 2, "length_penalty": 0.0}),
    ("qwen2", torch.float32, 4, 1, {"min_new_tokens": 3, "num_return_sequences": 2}),
    ("qwen2", torch.bfloat16, 2, 3, {"early_stopping": True}),
    ("gemma3", torch.float32, 3, 1, {"early_stopping": "never", "length_penalty": 2.0}),
    ("gemma3", torch.bfloat16, 5, 1, {"bad_words_ids": [[5], [7]]}),
    ("whisper", torch.float32, 5, 1, {}),
    ("whisper", torch.float32, 3, 3, {"repetition_penalty": 1.3}),
    ("whisper", torch.bfloat16, 2, 1, {}),
]


def _run(arch, dtype, nb, batch, extra, seed=1, **csv) -> tuple:
    m = _model(arch, dtype, seed)
    x = _inputs({"id": nb * 7 + batch, "arch": arch, "batch": batch}, m)
    kw = dict(max_new_tokens=8, num_beams=nb, do_sample=False, **extra)
    a = m.generate(**x, **kw)
    b = m.generate(**x, **kw, csv_config=CSVConfig(**{**EXACT, **csv}))
    return m, a, b, m.csv_last_stats


RAN: list = []


@pytest.mark.slow
@pytest.mark.parametrize("eps", [1e-3, 0.05, 0.5])
@pytest.mark.parametrize("arch,dtype,nb,batch,extra", CASES)
def test_beam_exact_matches_stock(monkeypatch, arch, dtype, nb, batch, extra, eps):
    # eps: how much of a row's mass S may leave out (hf_csv.transformers.plans.BEAM_EPS). The tiny heads put most rows over the
    # budget at the default 1e-3; at 0.05 the decisions are taken from the intervals of sub-vocabulary rows
    monkeypatch.setattr(hplan, "BEAM_EPS", eps)
    m, a, b, st = _run(arch, dtype, nb, batch, extra)
    assert torch.equal(_seqs(a), _seqs(b)), f"tokens differ: {_seqs(a).tolist()} vs {_seqs(b).tolist()}"
    if "beam" not in st:  # declined before decoding (e.g. Gemma-3's softcap): the reason says why
        assert st["mode"] == "full" and any("post-head transform" in r for r in st["reasons"]), st["reasons"]
        return
    RAN.append(st)


def test_beam_exact_certifies_some_calls():
    """The cases above must not all have been re-run on the full head (declining everything is not success)."""
    if not RAN:
        pytest.skip("no beam case ran")
    ok = [s for s in RAN if s["mode"] == "beam_exact" and s["beam"]["certified_steps"] > 0]
    assert len(ok) >= len(RAN) // 3, [(s["mode"], s["beam"]) for s in RAN]
    # ... and some steps were decided from the intervals of sub-vocabulary rows, not only from stock's rows
    assert sum(s["beam"]["subvocab_steps"] for s in ok) >= 5, [(s["mode"], s["beam"]["subvocab_steps"], s.get("fallback")) for s in RAN]


def test_default_beam_search_uses_the_full_head():
    m = _model("llama", torch.float32, 1)
    x = _inputs({"id": 3, "arch": "llama", "batch": 1}, m)
    a = m.generate(**x, max_new_tokens=4, num_beams=2)
    b = m.generate(**x, max_new_tokens=4, num_beams=2, csv_config=CSVConfig())
    st = m.csv_last_stats
    assert torch.equal(a, b) and st["mode"] == "full"
    assert any("beam_search='exact'" in r for r in st["reasons"])


@pytest.mark.slow
@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("whisper", torch.float32),
                                        ("llama", torch.bfloat16)])
def test_intervals_contain_stock(monkeypatch, arch, dtype):
    """At every certified step, stock's processed log-prob (stock's head on the step's hidden states, its
    log_softmax, the call's processors) lies in [lo, hi] on the computed tokens and below ob elsewhere."""
    checked = []
    orig = hplan.ExactBeam.check

    def box(self, c, sess, input_ids, scores, last, p):
        out = orig(self, c, sess, input_ids, scores, last, p)
        st = sess.beam.step
        if last is not None:
            B, P, d = last.H.shape
            raw = sess.head.stock(last.H.reshape(B * P, d)).view(B, P, -1)[:, p]
            ref = torch.log_softmax(raw.float(), dim=-1)
            for proc in sess.processors:
                if proc is c:
                    break
                ref = proc(input_ids, ref)
            S = last.mask[:, p]
            fin = torch.isfinite(ref) & S
            assert bool((st.lo[fin] <= ref[fin]).all() and (ref[fin] <= st.hi[fin]).all())
            off = ~S & torch.isfinite(ref)
            if bool(off.any()):
                assert bool((ref <= st.ob[:, None]).masked_select(off).all())
            # rows whose stock mass outside S is not negligible: there the interval's R term is what contains stock
            mass = torch.softmax(raw.float(), -1).masked_fill(S, 0).sum(1)
            checked.append(int(((mass > 1e-5) & ~S.all(1)).sum()))
        return out

    monkeypatch.setattr(hplan.ExactBeam, "check", box)
    monkeypatch.setattr(hplan, "BEAM_EPS", 0.3)  # leave real mass outside S, so that the R term of the interval is tested
    for nb, batch in ((2, 1), (4, 3)):
        _, a, b, _ = _run(arch, dtype, nb, batch, {"repetition_penalty": 1.2})
        assert torch.equal(_seqs(a), _seqs(b))
    assert sum(checked) >= 3, f"too few certified beam rows with mass outside S were checked: {checked}"


def test_an_undecided_step_reruns_on_the_full_head(monkeypatch):
    """Every top-k check fails: the call runs again on the full head, with stock's tokens and the reason."""
    monkeypatch.setattr(hb, "_unique_top", lambda lo, hi, idx: torch.zeros(lo.shape[0], dtype=torch.bool))
    m, a, b, st = _run("llama", torch.float32, 3, 3, {})
    assert torch.equal(_seqs(a), _seqs(b))
    assert st["mode"] == "full" and st["beam"]["restarts"] == 1 and st["beam"]["full_steps"] > 0
    assert st["beam"]["certified_steps"] == 0
    assert any("re-ran its beam search on the full head" in r for r in st["reasons"])


def test_a_wrong_replay_of_stock_bookkeeping_raises(monkeypatch):
    """hf_csv replays stock's arithmetic on the interval ends; if its replay of stock's values is not bit for bit
    stock's (another transformers version, say), it refuses rather than certify the wrong computation."""
    monkeypatch.setattr(hb, "_MASK", -2.0e9)
    with pytest.raises(CSVError, match="differently from hf_csv's replay"):
        _run("llama", torch.float32, 2, 1, {})


def test_a_caller_cache_declines_the_certificate():
    from transformers import DynamicCache

    m = _model("llama", torch.float32, 1)
    x = _inputs({"id": 3, "arch": "llama", "batch": 1}, m)
    out = m.generate(**x, max_new_tokens=3, num_beams=2, past_key_values=DynamicCache(),
                     csv_config=CSVConfig(**EXACT))
    st = m.csv_last_stats
    assert out.shape[1] == x["input_ids"].shape[1] + 3
    assert st["mode"] == "full" and any("cache passed by the caller" in r for r in st["reasons"])


def test_unsupported_processors_decline():
    m = _model("llama", torch.float32, 1)
    x = _inputs({"id": 3, "arch": "llama", "batch": 1}, m)
    m.generate(**x, max_new_tokens=3, num_beams=2, renormalize_logits=True, csv_config=CSVConfig(**EXACT))
    st = m.csv_last_stats
    assert st["mode"] == "full" and any("LogitNormalization" in r for r in st["reasons"]), st["reasons"]


def _audit_llama(vocab: int, scale: float, seed: int):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, eos_token_id=2, bos_token_id=1,
                                   pad_token_id=0)
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(scale)
    return hf_csv.enable(m)


def test_output_scores_with_subvocab_scores_keep_stocks_beam_scores():
    """A beam row's scores and sequences_scores are log-softmax values (each row's normalizer over all of V):
    CSVConfig(scores='subvocab') does not make them certifiable. Before: certified, sequences_scores off by 9e-5."""
    m = _audit_llama(500, 40.0, 0)
    x = dict(input_ids=torch.tensor([[1, 5, 9, 13]]), attention_mask=torch.ones(1, 4, dtype=torch.long))
    kw = dict(max_new_tokens=8, num_beams=3, do_sample=False, return_dict_in_generate=True, output_scores=True)
    a = m.generate(**x, **kw)
    for mode in ("auto", "epsilon"):
        b = m.generate(**x, **kw, csv_config=CSVConfig(beam_search="exact", scores="subvocab", mode=mode))
        st = m.csv_last_stats
        assert st["mode"] == "full" and any("output_scores" in r for r in st["reasons"]), st["reasons"]
        assert torch.equal(a.sequences, b.sequences) and torch.equal(a.sequences_scores, b.sequences_scores)
        assert all(torch.equal(p, q) for p, q in zip(a.scores, b.scores))


def test_exact_beam_search_wins_over_mode_epsilon():
    """CSVConfig(mode='epsilon', beam_search='exact'): the token-identical certificate runs (exact certificates win
    under mode='epsilon'). Before: the approximate beam_epsilon plan ran and its tokens differed from stock's."""
    m = _audit_llama(256, 30.0, 427)
    ids = torch.randint(3, 256, (1, 4), generator=torch.Generator().manual_seed(427))
    x = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    kw = dict(max_new_tokens=11, num_beams=2, do_sample=False, eos_token_id=2, pad_token_id=0)
    a = m.generate(**x, **kw)
    b = m.generate(**x, **kw, csv_config=CSVConfig(mode="epsilon", beam_search="exact", beam_epsilon=0.2))
    st = m.csv_last_stats
    assert torch.equal(a, b) and st["mode"] == "beam_exact" and st["exact"], st
    # the approximate plan alone says so in the stats
    m.generate(**x, **kw, csv_config=CSVConfig(mode="epsilon", beam_epsilon=0.2))
    st = m.csv_last_stats
    assert st["mode"] == "beam" and st["exact"] is False and st["summary"].startswith("approximate (ε-softmax")


def test_rerun_rows_leave_the_certified_rows_sizes():
    """Rows the per-row check re-ran count as fallbacks, and their |S| leaves the certified rows' mean (before: a
    mean |S| of 103 % of V)."""
    m = _audit_llama(2000, 20.0, 328)
    ids = torch.randint(3, 2000, (1, 4), generator=torch.Generator().manual_seed(328))
    m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=13, num_beams=3, do_sample=False,
               eos_token_id=2, pad_token_id=0, csv_config=CSVConfig(mode="epsilon", beam_epsilon=0.4))
    st = m.csv_last_stats
    assert st["verify_reruns"] > 0 and st["certified"] + st["fallback"] == st["rows"], st
    assert 0.0 < st["mean_subvocab_fraction"] <= 1.0, st


def test_config_rejects_unknown_beam_search():
    with pytest.raises(ValueError, match="beam_search"):
        CSVConfig(beam_search="fast")
    assert hf_csv.CSVConfig(beam_search="exact").beam_search == "exact"



# ---------------------------------------------------------------- the decisions, on crafted intervals
def _topk_call(lo_rows, hi_rows, rep_rows, ob, rbs, K):
    """Run hf_csv's top-k wrapper on one crafted step (batch 1): rows are per beam, rbs the running scores."""
    from transformers.generation.utils import GenerationMixin

    from hf_csv.transformers.session import CSVSession
    from hf_csv.transformers.step import activated
    from hf_csv.transformers.plans import BeamStep

    m = _model("llama", torch.float32, 1)
    nb, V = rep_rows.shape
    sess = CSVSession(model=m, config=CSVConfig(**EXACT), head=None, out_dtype=torch.float32, plan=hplan.ExactBeam())
    sess.beam.step = BeamStep(lo=lo_rows, hi=hi_rows, rep=rep_rows, ob=ob)
    r = torch.tensor([rbs], dtype=torch.float32)
    sess.beam.state = hb._State(rbs=(r, r, r), fin=(torch.full((1, nb), -1e9),) * 2)
    wrapped = hb._top_k_continuations(m, GenerationMixin._get_top_k_continuations.__get__(m))
    acc = (rep_rows + r[0][:, None]).view(1, -1)
    seqs = torch.zeros(1, nb, 6, dtype=torch.long)
    extra = {}
    if "vocab_size" in inspect.signature(GenerationMixin._get_top_k_continuations).parameters:
        extra["vocab_size"] = V  # (transformers 4.57 passes it; 5.x derives it)
    with activated(m, sess):
        return wrapped(accumulated_log_probs=acc, running_sequences=seqs,
                       running_beam_indices=torch.full((1, nb, 4), -1, dtype=torch.int32), cur_len=3,
                       decoder_prompt_len=2, do_sample=False, beams_to_keep=K, num_beams=nb, batch_size=1, **extra)


REP = torch.tensor([[-0.1, -2.0, -3.0, -4.0], [-0.2, -2.5, -3.2, -5.0]])
NO_OFF = torch.full((2,), float("-inf"))


def test_topk_decision_separated_intervals_pass():
    lo, hi = REP - torch.tensor([[0.0], [0.1]]), REP.clone()  # beam 1 known to 0.1
    vals, _, _ = _topk_call(lo, hi, REP, NO_OFF, [-1.0, -1.05], K=4)
    assert vals.tolist() == [[-1.100000023841858, -1.25, -3.0, -3.549999952316284]]


def test_topk_decision_overlapping_intervals_raise():
    lo, hi = REP.clone(), REP + torch.tensor([[0.0], [0.3]])  # beam 1's first candidate may beat beam 0's
    with pytest.raises(hb.BeamUncertified):
        _topk_call(lo, hi, REP, NO_OFF, [-1.0, -1.05], K=4)


def test_topk_decision_an_uncomputed_token_that_may_enter_raises():
    ob = torch.tensor([-2.5, float("-inf")])  # beam 0 may hide a token at -2.5 + -1.0 > the 4th candidate
    with pytest.raises(hb.BeamUncertified):
        _topk_call(REP.clone(), REP.clone(), REP, ob, [-1.0, -1.05], K=4)
    _topk_call(REP.clone(), REP.clone(), REP, torch.tensor([-2.6, -9.0]), [-1.0, -1.05], K=4)  # below it: fine


def test_small_vector_decisions():
    lo = torch.tensor([[-1.0, -1e9, -1e9, -2.0]])
    hi = lo.clone()
    hb._certify_topk(lo, hi, torch.tensor([[0, 3, 1]]), "x", small=True)  # exact ties at -1e9: order-isomorphic
    hi2 = hi.clone()
    hi2[0, 3] = -0.9  # the third entry may now beat the first
    with pytest.raises(hb.BeamUncertified):
        hb._certify_topk(lo, hi2, torch.tensor([[0, 3, 1]]), "x", small=True)
    lo3, hi3 = lo.clone(), hi.clone()
    lo3[0, 1], hi3[0, 1] = -1e9 - 64.0, -1e9  # an inexact entry tied with an exact one, inside the selection
    with pytest.raises(hb.BeamUncertified):
        hb._certify_topk(lo3, hi3, torch.tensor([[0, 3, 1]]), "x", small=True)


@pytest.mark.slow
@pytest.mark.parametrize("arch,dtype,nb,batch,extra", [CASES[1], CASES[2], CASES[3], CASES[8]])
def test_any_point_of_the_box_gives_stock_tokens(monkeypatch, arch, dtype, nb, batch, extra):
    """The certificate's claim: every value in the intervals gives stock's decisions. So stock's bookkeeping run on
    the box's *ends* (rows alternately at lo and hi, a poor representative on purpose) must still return stock's
    tokens, or re-run the call. (On these tiny heads the decisions are far apart, so this holds even without the
    checks; the crafted tests above are the ones that fail when a check is removed.)"""
    orig = hplan.ExactBeam.check

    def box(self, c, sess, input_ids, scores, last, p):
        out = orig(self, c, sess, input_ids, scores, last, p)
        st = sess.beam.step
        if not st.subvocab:
            return out
        odd = (torch.arange(st.lo.shape[0]) % 2 == 1)[:, None]
        rep = torch.where(odd, st.hi, st.lo)
        rep = torch.where(torch.isfinite(rep), rep, st.rep)  # (rows whose interval is unbounded keep theirs)
        st.rep = rep
        return rep.to(out.dtype)

    monkeypatch.setattr(hplan.ExactBeam, "check", box)
    monkeypatch.setattr(hplan, "BEAM_EPS", 0.5)
    m, a, b, st = _run(arch, dtype, nb, batch, extra)
    assert torch.equal(_seqs(a), _seqs(b)), f"tokens differ: {_seqs(a).tolist()} vs {_seqs(b).tolist()}"
