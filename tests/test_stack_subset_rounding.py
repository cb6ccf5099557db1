"""Values on a column subset S that are not the full call's bits (docs/certificates.md §2.0): BLAS kernels (MKL's
AVX-512 path, row-blocked kernels, reduced fp32 matmul precision) round a subset GEMM otherwise than stock's full call.
The probe finds the kernel that gives the full call's bits (gathered rows, aligned row blocks) or none; plans that hand
values to stock's sampler run only where one was found; ties and masks keep stock's tokens when the values on S move
one ulp. CI runs this file again under MKL's other code paths (.ci/run)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hf_csv
from conftest import _ids, tiny_llama
from hf_csv import CSVConfig


def _perturbing_values(monkeypatch, seed=0):
    """Make the head's recompute round like a BLAS whose column-subset GEMV differs from the full call in the last
    bit (MKL's AVX-512 path does; docs/certificates.md §2.0): every value moves one fp32 ulp up or down at random."""
    from hf_csv.core import certificate as C
    orig = C.CertifiedHead._values
    g = torch.Generator().manual_seed(seed)

    def values(self, *a, **kw):
        out = orig(self, *a, **kw)
        vals = out[0] if isinstance(out, tuple) else out
        if vals.numel():
            up = torch.rand(vals.shape, generator=g) < 0.5
            nudged = torch.where(up, torch.nextafter(vals, torch.full_like(vals, float("inf"))),
                                 torch.nextafter(vals, torch.full_like(vals, float("-inf"))))
            vals = nudged
        return (vals, *out[1:]) if isinstance(out, tuple) else vals

    monkeypatch.setattr(C.CertifiedHead, "_values", values)


def test_exact_ties_stay_stock_when_subset_values_differ_in_the_last_bit(monkeypatch):
    """Duplicated head rows tie exactly in stock (argmax takes the lower index). With values on S one ulp off, a
    certified greedy row returned 474 where stock returns 204; rows whose order the values' slack cannot decide now
    take the full head."""
    from hf_csv import CertifiedHead
    import torch.nn.functional as F

    _perturbing_values(monkeypatch)
    torch.manual_seed(0)
    W = torch.randn(4099, 64)
    W[474] = W[204]
    H = W[204][None].repeat(40, 1) + 0.05 * torch.randn(40, 64)
    head = CertifiedHead(W)
    res = head.topk(H, k=1)
    stock = F.linear(H, W).argmax(1)
    assert (stock == 204).sum() > 30
    assert torch.equal(res.logits.argmax(1), stock)
    assert res.stats.near_ties >= int((stock == 204).sum())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rep", [1.0, 1.3])
def test_greedy_with_duplicated_rows_is_stock_when_subset_values_differ(monkeypatch, dtype, rep):
    """End to end: a tiny Llama whose head has duplicated rows (exact ties), greedy with and without a repetition
    penalty, values on S nudged one ulp: stock's tokens."""
    import copy

    _perturbing_values(monkeypatch, seed=1)
    ref = tiny_llama(vocab=512, scale=20.0)
    with torch.no_grad():
        W = ref.lm_head.weight
        W[256:] = W[:256]  # every token has a twin above it
    ref = ref.to(dtype)
    m = hf_csv.enable(copy.deepcopy(ref))
    for seed in range(3):
        ids = torch.randint(3, 256, (2, 6), generator=torch.Generator().manual_seed(seed))
        kw = dict(max_new_tokens=8, do_sample=False, repetition_penalty=rep)
        want = ref.generate(ids, **kw)
        got = m.generate(ids, **kw, csv_config=CSVConfig())
        assert torch.equal(got, want), (seed, got, want)
        if rep == 1.0:
            assert (want[:, 6:] < 256).all()  # stock takes the lower twin (a penalty lowers it once generated)


@pytest.mark.parametrize("exact", [True, False])
def test_value_reading_plans_need_the_subset_probe(monkeypatch, exact):
    """Where a probe found a column subset rounding differently from the full call, plans that hand the values to
    stock's sampler (top-k with temperature, min-p, top-k with top-p) use the full head, so sampling keeps stock's
    tokens for the seed as the docs promise, and greedy stays certified; where it found none, the stock-stream plans
    run. (Before, top-k with temperature ran hf_csv's own draw there: stock's law, not its tokens.)"""
    from hf_csv.core.certificate import CertifiedHead

    monkeypatch.setattr(CertifiedHead, "subset_exact", lambda self: exact)
    m = hf_csv.enable(tiny_llama(scale=20.0))
    x = _ids()
    want = {"greedy": "topk", "topk": "topk" if exact else "full", "minp": "threshold" if exact else "full",
            "topk_topp": "topk" if exact else "full"}
    calls = {"greedy": dict(do_sample=False), "topk": dict(do_sample=True, top_k=20, temperature=0.8),
             "minp": dict(do_sample=True, top_k=0, min_p=0.1), "topk_topp": dict(do_sample=True, top_k=20, top_p=0.9)}
    for name, kw in calls.items():
        m.generate(**x, max_new_tokens=3, csv_config=CSVConfig(), **kw)
        st = m.csv_last_stats
        assert st["mode"] == want[name], (name, st["mode"], st["reasons"])
        if not exact and name != "greedy":
            assert any("column subset" in r for r in st["reasons"]), st["reasons"]


def test_subset_probe_finds_a_kernel_that_rounds_subsets_differently(monkeypatch):
    """The probe itself: a linear whose subset calls differ in the last bit is found (neither kernel passes); an exact
    one is not."""
    import torch.nn.functional as F
    from hf_csv.core import certificate as C
    W = torch.randn(300, 16)
    assert C.probe_subset_kernel(W, None) in (None, *C.SUBSET_KERNELS)  # this host's answer, whichever it is
    real = F.linear

    def nudged(h, w, b=None):
        out = real(h, w, b)
        return out if w.shape[0] == W.shape[0] else torch.nextafter(out, torch.full_like(out, float("inf")))

    monkeypatch.setattr(F, "linear", nudged)
    assert C.probe_subset_kernel(W, None) is None
    assert C.subset_mismatches(W, None, C.gathered_kernel(W, None), first=False) == 3 * len(C.PROBE_ROWS) * len(C.PROBE_SIZES)


def _blas_standin(seed: int, off):
    """(generator, W [300, 16], its CertifiedHead, the real F.linear, a stand-in F.linear that rounds a *subset* GEMM
    one ulp up where ``off(h)`` holds and is the real one elsewhere, full calls included)."""
    import torch.nn.functional as F
    from hf_csv.core import certificate as C
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(300, 16, generator=g)
    real = F.linear

    def linear(h, w, b=None):
        out = real(h, w, b)
        return out if (w.shape[0] == W.shape[0] or not off(h)) else torch.nextafter(out, out + 1)
    return g, W, C.CertifiedHead(W, num_outliers=4), real, linear


def test_a_row_count_or_setting_the_probe_did_not_try_gets_its_own_probe(monkeypatch):
    """A BLAS that rounds 2-row subset GEMMs differently: the probe's own row counts (1, 3, 16) pass, so a plan that
    hands the values to stock's sampler may be chosen; a 2-row call is then probed on 2 rows, finds no kernel, and
    its values are the full call's columns (stock's bits), not an unprobed gather's. A thread count first met inside
    a call is probed too (its own key)."""
    from hf_csv.core import certificate as C
    g, W, ch, real, two_rows_off = _blas_standin(1, lambda h: h.shape[0] == 2)

    if not ch.subset_exact():
        pytest.skip("this host's BLAS has no subset kernel for this head")
    monkeypatch.setattr(F, "linear", two_rows_off)
    assert ch.subset_exact()  # the probe's own row counts still pass
    H = torch.randn(2, 16, generator=g)
    r, t = torch.tensor([0, 0, 1, 1]), torch.tensor([5, 7, 5, 299])
    Hf, Hn = ch._check(H)
    vals = ch._values(r, t, Hf, Hn, torch.float32)
    assert ch.subset_kernel(rows=2) is None  # probed on 2 rows: no kernel matches there
    assert torch.equal(vals, real(H, W)[r, t])  # the full call's bits
    n = len(ch._subset_probe)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads != 1 else 2)
        ch._values(r[:1], t[:1], Hf[:1], Hn[:1], torch.float32)
    finally:
        torch.set_num_threads(threads)
    assert len(ch._subset_probe) == n + 1  # the new thread count's own probe


def test_values_of_a_strided_or_offset_h_are_the_full_calls_where_a_plan_relies_on_stocks_bits(monkeypatch):
    """The probes multiply fresh, contiguous h; a prefill step's last positions are a strided view (or, for one row,
    one at an offset). Where a plan relies on stock's bits, such an h gets the full call's columns on that very h,
    no probed kernel (a BLAS stand-in that rounds subset GEMMs otherwise on offset h only would pass every probe)."""
    from hf_csv.core import certificate as C
    g, W, ch, real, offset_off = _blas_standin(3, lambda h: not (h.is_contiguous() and h.data_ptr() % 64 == 0))

    if not ch.subset_exact():
        pytest.skip("this host's BLAS has no subset kernel for this head")
    monkeypatch.setattr(F, "linear", offset_off)
    assert ch.subset_exact()  # fresh h: every probe passes
    seq = torch.randn(2, 5, 17, generator=g)[..., :16]  # [B, L, d] with a row stride of 5·17: the last positions
    H = seq[:, -1, :]
    assert not H.is_contiguous()
    r, t = torch.tensor([0, 0, 1, 1]), torch.tensor([5, 7, 5, 299])
    Hf, Hn = ch._check(H)
    assert torch.equal(ch._values(r, t, Hf, Hn, torch.float32), real(H, W)[r, t])
    one = torch.randn(40, generator=g)[3:19]  # one row at an offset of 12 bytes
    Hf, Hn = ch._check(one[None])
    assert torch.equal(ch._values(r[:2], t[:2], Hf, Hn, torch.float32), real(one[None], W)[r[:2], t[:2]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reduced_fp32_matmul_precision_declines_to_the_full_head(dtype):
    """torch.set_float32_matmul_precision("medium") changes stock's fp32 logits on CPU (oneDNN's bf16 passes): the
    certificates' bound is for IEEE fp32 dot products, so a certified call declines, says why, and returns stock's
    tokens under the same setting. An fp16 head too: stock's fp16 GEMM ignores the setting, but the certificate's
    own fp32 GEMMs on fp16 values (its accumulators and Σ|W h|) would run as bf16 passes, which drop fp16's bits."""
    m = hf_csv.enable(tiny_llama(scale=20.0).to(dtype))
    x = _ids()
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        want = m.generate(**x, max_new_tokens=4, do_sample=False)
        got = m.generate(**x, max_new_tokens=4, do_sample=False, csv_config=CSVConfig())
        st = m.csv_last_stats
    finally:
        torch.set_float32_matmul_precision(before)
    assert torch.equal(got, want)
    assert st["mode"] == "full" and any("matmul_precision" in r for r in st["reasons"]), st
    if dtype == torch.float32:
        m.generate(**x, max_new_tokens=2, do_sample=False, csv_config=CSVConfig())
        assert m.csv_last_stats["mode"] == "topk"  # back at "highest": certified again


def test_compiled_sampling_probes_the_graphs_own_gather(monkeypatch):
    """The values a sampled compiled head hands to stock's sampler come from one GEMM over the unsorted gathered
    candidate rows: probed as such; a BLAS that rounds such a gather differently from the full call fails it."""
    import torch.nn.functional as F
    from hf_csv.core import certificate as C
    W = torch.randint(-3, 4, (500, 16)).float()  # integer products: every kernel gives the full call's bits
    assert C.CertifiedHead(W, num_outliers=4).graph_gather_exact(64, rows=2)
    real = F.linear

    def gathered_off(h, w, b=None):
        out = real(h, w, b)
        return out if w.shape[0] == W.shape[0] else torch.nextafter(out, out + 1)

    monkeypatch.setattr(F, "linear", gathered_off)
    W2 = torch.randn(500, 16)
    assert not C.graph_gather_matches_full(W2, 64, rows=1)
    assert C.subset_probe_key()[-2] == torch.get_float32_matmul_precision()


def _shape_free_linear(h, w, b=None):
    """F.linear whose value of each entry does not depend on the call's shape: fp64 products of fp32 inputs are exact
    and a 32-term fp64 sum is far inside one fp32 rounding step, so the fakes below are the only shape effect (this
    host's own BLAS rounds small calls by their size: tiny heads fail the smaller blocks for real)."""
    out = h.double() @ w.double().T
    return (out if b is None else out + b.double()).float()


def _block_rounding(monkeypatch, W):
    """F.linear as a BLAS whose rounding of a row depends on its place in a row block of 8 (MKL on host D, docs/
    certificates.md §2.0): a call whose row count is not a multiple of 8 (nor V) is one ulp off."""
    from hf_csv.core import certificate as C
    def blocky(h, w, b=None):
        out = _shape_free_linear(h, w, b)
        ok = w.shape[0] == W.shape[0] or w.shape[0] % 8 == 0
        return out if ok else torch.nextafter(out, torch.full_like(out, float("inf")))

    monkeypatch.setattr(F, "linear", blocky)


@pytest.mark.parametrize("block", [8, 16, 64])
@pytest.mark.parametrize("V", [300, 256, 1000])
def test_blocked_subset_kernel_returns_the_full_calls_columns(V, block):
    """The blocked kernel picks each requested column from its aligned block (the cut last block included), in the
    requested order, duplicates too: integer weights and inputs make every dot product exact, so any kernel's value is
    the full call's and only the indexing is tested."""
    from hf_csv.core import certificate as C
    g = torch.Generator().manual_seed(V)
    W = torch.randint(-3, 4, (V, 24), generator=g).float()
    b = torch.randint(-5, 6, (V,), generator=g).float()
    H = torch.randint(-2, 3, (3, 24), generator=g).float()
    full = torch.nn.functional.linear(H, W, b)
    k = C.blocked_kernel(W, b, block)
    for cols in (torch.tensor([V - 1]), torch.tensor([0, V - 1, 5, 5]), torch.randperm(V, generator=g)[:40],
                 torch.arange(V)):
        assert torch.equal(k(H, cols), full[:, cols])


def test_gathered_rows_keep_the_heads_alignment():
    """A head that starts off a 64-byte boundary (a memory-mapped checkpoint's may): the gathered rows start at the same
    address modulo 64, so a BLAS that peels each row up to an aligned address sums them as in the full call; the rows
    are the head's."""
    from hf_csv.core import certificate as C
    base = torch.randn(300 * 24 + 16)
    for shift in (0, 2, 10):  # floats: 0, 8 and 40 bytes
        W = base[shift:shift + 300 * 24].view(300, 24)
        idx = torch.tensor([5, 299, 0, 64, 5])
        got = C.rows_like(W, idx)
        assert got.data_ptr() % 64 == W.data_ptr() % 64 and torch.equal(got, W[idx])


def test_probe_picks_the_blocked_kernel_and_the_values_use_it(monkeypatch):
    """Where gathered rows round otherwise than the full call but aligned blocks do not, the probe picks the blocked
    kernel, and the values a value-reading plan hands to stock are then the full call's bit for bit."""
    from hf_csv.core import certificate as C
    torch.manual_seed(0)
    V = 1000  # not a multiple of 64: a cut last block
    W = torch.randn(V, 32)
    _block_rounding(monkeypatch, W)
    assert C.subset_mismatches(W, None, C.gathered_kernel(W, None)) == 1
    assert C.probe_subset_kernel(W, None) == "blocked8"  # the smallest block that keeps each row's place
    head = hf_csv.CertifiedHead(W)
    assert head.subset_kernel() is None and head.subset_exact() and head.subset_kernel() == "blocked8"
    H = torch.randn(2, 32)
    full = F.linear(H, W)
    r = torch.tensor([0, 0, 0, 1, 1])
    t = torch.tensor([3, 999, 500, 998, 3])
    vals = head._values(r, t, H, H, torch.float32)
    assert torch.equal(vals, full[r, t])


@pytest.mark.parametrize("period", [16, 32, 64])
def test_probe_takes_the_smallest_block_that_keeps_each_rows_place(monkeypatch, period):
    """A BLAS whose rounding of a row depends on the row's place modulo ``period`` in the call: the blocks smaller
    than the period move rows to other places and must fail the probe; the first block that is a multiple of it
    passes, and the values handed on are the full call's bits. Each row of W carries its own index in column 0 (exact
    small integers), so the fake sees where each row sits."""
    from hf_csv.core import certificate as C
    torch.manual_seed(period)
    V = 1024
    W = torch.randn(V, 32)
    W[:, 0] = torch.arange(V, dtype=torch.float32)

    def by_place(h, w, b=None):
        out = _shape_free_linear(h, w, b)
        moved = (w[:, 0].round().long() - torch.arange(w.shape[0])) % period != 0  # a row off its place
        return torch.where(moved, torch.nextafter(out, torch.full_like(out, float("inf"))), out)

    monkeypatch.setattr(F, "linear", by_place)
    want = f"blocked{period}"
    assert C.probe_subset_kernel(W, None) == want
    for name, make in C.SUBSET_KERNELS.items():  # every smaller kernel is caught, every larger one passes
        bad = C.subset_mismatches(W, None, make(W, None))
        assert bad == (0 if name.startswith("blocked") and int(name[7:]) % period == 0 else 1), name
    head = hf_csv.CertifiedHead(W)
    assert head.subset_exact() and head.subset_kernel() == want
    H = torch.randn(3, 32)
    full = by_place(H, W)
    r = torch.tensor([0, 0, 1, 2, 2])
    t = torch.tensor([3, 1023, 500, 17, 640])
    assert torch.equal(head._values(r, t, H, H, torch.float32), full[r, t])


def test_compiled_sampling_declines_where_only_the_blocked_kernel_matches(monkeypatch):
    """The compiled head computes S's values on gathered rows: where the probe found only the blocked kernel exact,
    a sampled compiled call keeps the full head (the reason says why)."""
    from types import SimpleNamespace

    from hf_csv.transformers import decision
    from hf_csv.core.certificate import CertifiedHead

    monkeypatch.setattr(CertifiedHead, "subset_kernel", lambda self, probe=False: "blocked64")
    seen = {}

    class Sess(SimpleNamespace):
        def set_full(self, why):
            seen["why"] = why

    from transformers import TopKLogitsWarper

    warper = TopKLogitsWarper(top_k=5)
    head = CertifiedHead(torch.randn(300, 16))
    from hf_csv.transformers.plans import TopK

    plan = TopK(k=5, check_after=warper)
    sess = Sess(plan=plan, head=head, processors=[warper], whisper=SimpleNamespace(record=False),
                post=SimpleNamespace(identity=True), assisted=False, draft=False)
    assert decision.choose_compiled_plan(sess) is None
    assert "rounds gathered rows differently" in seen["why"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mask_only_shortcut_equals_running_the_processors(monkeypatch, dtype):
    """With only masking processors before the check (suppressions, minimum lengths, no-repeat n-grams), the processed
    value interval is read off the step's scores instead of running them on lo and hi (hf_csv.transformers.processors): on every
    certified step it must equal what running them gives, bit for bit, and the tokens stay stock's (duplicated head
    rows: exact ties, values on S nudged one ulp so that the interval is wide)."""
    import copy

    import hf_csv.transformers.plans as plan

    _perturbing_values(monkeypatch, seed=2)
    orig = plan.processed_interval
    seen = {"fast": 0}

    def both(c, input_ids, sess, last, p, scores=None):
        got = orig(c, input_ids, sess, last, p, scores)
        ref = orig(c, input_ids, sess, last, p)  # no scores: the processors run on lo and hi
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        seen["fast"] += scores is not None
        return got

    monkeypatch.setattr(plan, "processed_interval", both)
    ref = tiny_llama(vocab=512, scale=20.0)
    with torch.no_grad():
        ref.lm_head.weight[256:] = ref.lm_head.weight[:256]
    ref = ref.to(dtype)
    m = hf_csv.enable(copy.deepcopy(ref))
    for seed in range(3):
        ids = torch.randint(3, 256, (2, 6), generator=torch.Generator().manual_seed(seed))
        first = ref.generate(ids, max_new_tokens=3, do_sample=False)[:, 6:].reshape(-1).tolist()
        kw = dict(max_new_tokens=10, do_sample=False, suppress_tokens=first[:2], begin_suppress_tokens=first[2:4],
                  no_repeat_ngram_size=2, min_new_tokens=4, eos_token_id=2)
        want = ref.generate(ids, **kw)
        got = m.generate(ids, **kw, csv_config=CSVConfig())
        assert torch.equal(got, want), (seed, got, want)
    assert seen["fast"] > 0


def test_the_probe_makes_each_full_call_once_for_all_its_kernels(monkeypatch):
    """The probe tries five kernels against the same full calls: they are made once per row count, not once per
    kernel (a failing 8-row probe of Gemma-3's head cost five 8-row GEMMs of it: docs/benchmarks.md, "Value slack")."""
    import torch.nn.functional as F

    import hf_csv.core.certificate.probes as C

    W = torch.randn(1000, 32)
    real, full_calls = F.linear, []

    def counting(h, w, b=None):
        if w.shape[0] == W.shape[0]:
            full_calls.append(h.shape[0])
        return real(h, w, b)

    monkeypatch.setattr(C.F, "linear", counting)
    monkeypatch.setattr(C, "SUBSET_KERNELS", {n: (lambda w, b: lambda H, cols: real(H, w[cols]) + 1)
                                              for n in C.SUBSET_KERNELS})  # every kernel differs at once
    assert C.probe_subset_kernel(W, None, rows=(8,)) is None
    assert full_calls == [8]
    full_calls.clear()
    assert C.probe_subset_kernel(W, None) is None
    assert full_calls == list(C.PROBE_ROWS)
