"""The CPU speed paths change speed only: thread tuning, chunked fbgemm packs, the chunked quantizer."""
import math
import threading

import pytest
import torch
import torch.nn.functional as F

import hf_csv_kernels.screen as scr
from hf_csv_kernels import native
from hf_csv.certificate import CertifiedHead
from hf_csv_kernels import quantize_rows_fp8, quantize_rows_int8
from hf_csv_kernels.quantize import rows_from_codes
from hf_csv.speed import ThreadTuner, caller_threads


def _tiny_llama():
    """A 1-layer Llama with V = 300 and a 4-token prompt (no GPU, no files)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval(), torch.tensor([[1, 5, 9, 2]])


def test_tuner_picks_the_faster_count_and_reprobes():
    tu = ThreadTuner(window=4, probe=4, max_probe=8)
    T = 2
    seen = []
    for i in range(40):  # one thread "takes" 1 ms, two threads 5 ms (a loaded machine)
        n = tu._pick("k", T)
        seen.append(n)
        tu._record("k", n, T, 0.001 if n == 1 else 0.005)
    assert tu.choice("k") == 1
    tail = seen[10:]
    # mostly one thread, still probing the other: bursts of three calls, max_probe (8) calls apart
    assert 0 < tail.count(2) <= len(tail) // 3
    for i in range(60):  # the load goes away: two threads become faster
        n = tu._pick("k", T)
        tu._record("k", n, T, 0.001 if n == 2 else 0.005)
    assert tu.choice("k") == 2


def test_tuner_forgets_a_passing_load_at_the_next_probe():
    """A load (or hf_csv's own background pack) that made two threads slow for a while must not keep the head
    on one thread long after it is gone: the next probe re-measures two threads afresh. With the old samples
    kept, four probes (up to 4 x 64 calls) were needed to outvote them."""
    tu = ThreadTuner()  # the defaults: window 6, probe 8 doubling to 64
    T = 2
    for _ in range(400):  # loaded: two threads 16 ms, one thread 12 ms; the probe interval grows to 64
        n = tu._pick("k", T)
        tu._record("k", n, T, 0.012 if n == 1 else 0.016)
    assert tu.choice("k") == 1
    switched = None
    for i in range(80):  # quiet again: two threads 8 ms
        n = tu._pick("k", T)
        tu._record("k", n, T, 0.012 if n == 1 else 0.008)
        if switched is None and tu.choice("k") == 2:
            switched = i
    assert switched is not None and switched < 70, switched
    assert tu.choice("k") == 2


def test_tuner_margin_keeps_one_thread_on_a_draw():
    tu = ThreadTuner(window=4, probe=4)
    for _ in range(20):
        n = tu._pick("k", 2)
        tu._record("k", n, 2, 0.001)
    assert tu.choice("k") == 1


def test_tuner_restores_threads_also_on_error(monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setenv("HF_CSV_HEAD_THREADS", "1")
        tu = ThreadTuner()
        with pytest.raises(RuntimeError):
            with tu("k") as n:
                assert n == 1 and torch.get_num_threads() == 1
                with caller_threads():
                    assert torch.get_num_threads() == 2  # the exact recompute runs as the caller does
                assert torch.get_num_threads() == 1
                raise RuntimeError("boom")
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("HF_CSV_HEAD_THREADS", "zero")
        with pytest.raises(ValueError, match="HF_CSV_HEAD_THREADS"):
            with tu("k"):
                pass
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", ["1", "auto"])
def test_certified_topk_is_the_same_on_any_thread_count(monkeypatch, threads):
    monkeypatch.setenv("HF_CSV_HEAD_THREADS", threads)
    g = torch.Generator().manual_seed(0)
    W = torch.randn(3000, 64, generator=g)
    H = torch.randn(5, 64, generator=g) * 3
    ch = CertifiedHead(W)
    ref = torch.nn.functional.linear(H, W)
    for _ in range(12):  # through the tuner's warm-up and its choice
        out = ch.topk(H, 3).logits
        top = out.topk(3, dim=1)
        assert torch.equal(top.indices, ref.topk(3, dim=1).indices)
        assert torch.equal(top.values, ref.topk(3, dim=1).values)


@pytest.mark.skipif(not scr.fbgemm_available(), reason="needs fbgemm")
def test_chunked_packs_give_the_same_screen_and_swap_to_one(monkeypatch):
    g = torch.Generator().manual_seed(1)
    W = torch.randn(1000, 48, generator=g)
    H = torch.randn(3, 48, generator=g)
    H[:, 5] *= 200  # a massive activation, kept exact as an outlier column
    rows = quantize_rows_int8(W, progress=False)
    cols = torch.tensor([5])
    whole = scr.prepare_screen(rows, cols, native=False)  # fbgemm's packs (the native kernel needs none)
    assert len(whole.packed) == 1
    monkeypatch.setattr(scr, "_PACK_ROWS", 96)
    started = []
    real_thread = threading.Thread

    def spy(*a, **k):
        t = real_thread(*a, **k)
        started.append(t)
        return t

    monkeypatch.setattr(scr.threading, "Thread", spy)
    chunked = scr.prepare_screen(rows, cols, native=False)
    e1, r1 = scr.screen_int8_cpu(whole, H)
    for t in started:
        t.join()
    assert len(chunked.packed) == 1  # consolidated in the background
    nocons = scr.prepare_screen(rows, cols, consolidate=False, native=False)
    assert len(nocons.packed) == 11
    e2, r2 = scr.screen_int8_cpu(nocons, H)
    assert torch.equal(e1, e2) and torch.equal(r1, r2)
    ex = H.double() @ W.double().T
    assert ((ex - e2.double()).abs() <= r2.double()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantizer_and_recompute_agree_bit_for_bit(dtype, fmt, monkeypatch):
    """An artifact's stored terms and their float32 recompute from the live head must match exactly
    (the artifact check compares them), whatever the chunking. (hf_csv's C recompute is checked below.)"""
    import hf_csv_kernels.quantize as qz

    monkeypatch.setattr(qz, "_native_terms_ok", lambda *a: False)
    g = torch.Generator().manual_seed(2)
    W = (torch.randn(777, 40, generator=g) * torch.logspace(-3, 1, 777)[:, None]).to(dtype)
    W[3] = 0
    quant = quantize_rows_int8 if fmt == "int8" else quantize_rows_fp8
    r = quant(W, chunk_rows=64, progress=False)
    r2 = rows_from_codes(W, r.q, r.scale, chunk_rows=100, progress=False)
    for k in ("err_l2", "l1", "abs_l1"):
        assert torch.equal(getattr(r, k), getattr(r2, k)), k
    deq = r.q.double() * r.scale.double()[:, None]
    assert (r.err_l2.double() >= (W.double() - deq).norm(dim=1)).all()
    assert (r.l1.double() >= deq.abs().sum(1)).all()
    assert (r.abs_l1.double() >= W.double().abs().sum(1)).all()
    r3 = quant(W, progress=False)  # default chunking: same codes
    assert torch.equal(r3.q.view(torch.int8), r.q.view(torch.int8))


def test_native_row_terms_are_rigorous_and_within_the_artifact_check():
    """hf_csv's one-pass C recompute (float64 sums): every term bounds its exact quantity (checked in exact
    rational arithmetic on a few rows and in float64 on all), and none exceeds the quantizer's stored float32 term
    beyond the artifact check's slack (so a saved screen still loads)."""
    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.why_unavailable()}")
    from fractions import Fraction

    from hf_csv.artifact import _TERM_SLACK

    g = torch.Generator().manual_seed(5)
    W = torch.randn(1234, 77, generator=g) * torch.logspace(-4, 2, 1234)[:, None]
    W[3] = 0
    W[7, 5] = 1e-30  # a tiny entry beside large ones
    r = quantize_rows_int8(W, progress=False)
    r2 = rows_from_codes(W, r.q, r.scale, progress=False)
    assert r2.err_l2 is not r.err_l2
    deq = r.q.double() * r.scale.double()[:, None]
    assert (r2.err_l2.double() >= (W.double() - deq).norm(dim=1)).all()
    assert (r2.l1.double() >= deq.abs().sum(1)).all()
    assert (r2.abs_l1.double() >= W.double().abs().sum(1)).all()
    for k in ("err_l2", "l1", "abs_l1"):
        got, stored = getattr(r2, k), getattr(r, k)
        assert (got <= stored * (1 + _TERM_SLACK) + 1e-30).all(), k
    for i in (0, 3, 7, 500, 1233):  # exact arithmetic: sum of squares below err_l2², sums below the l1 terms
        w = [Fraction(float(x)) for x in W[i]]
        dq = [Fraction(float(r.scale[i])) * int(c) for c in r.q[i]]
        assert sum((a - b) ** 2 for a, b in zip(w, dq)) <= Fraction(float(r2.err_l2[i])) ** 2
        assert sum(abs(b) for b in dq) <= Fraction(float(r2.l1[i]))
        assert sum(abs(a) for a in w) <= Fraction(float(r2.abs_l1[i]))


def _certified_greedy(m, ids, ref):
    """6 greedy tokens with csv_config on an enabled model: stock's tokens; returns the call's stats."""
    import hf_csv

    out = m.generate(ids, max_new_tokens=6, do_sample=False, csv_config=hf_csv.CSVConfig())
    assert torch.equal(out, ref)
    return m.csv_last_stats


@pytest.mark.skipif(not scr.fbgemm_available(), reason="needs fbgemm")
def test_background_packing_uses_the_full_head_until_ready(monkeypatch):
    """A large head is packed in the background; until then the certified head says not ready and
    generate's head wrapper uses the full head (exact); a direct call waits instead."""
    import hf_csv

    monkeypatch.setattr(scr, "_PACK_ROWS", 64)
    gate = threading.Event()
    real_pack = scr._pack

    def slow_pack(q, s):
        gate.wait(30)
        return real_pack(q, s)

    monkeypatch.setattr(scr, "_pack", slow_pack)
    monkeypatch.setattr(scr, "_use_native", lambda rows: False)  # fbgemm's path (the native kernel needs no pack)
    m, ids = _tiny_llama()
    ref = m.generate(ids, max_new_tokens=6, do_sample=False)
    hf_csv.enable(m)
    try:
        st = _certified_greedy(m, ids, ref)
        assert st["full_head_calls"] == st["head_calls"] == 6 and st["rows"] == 0
        assert any("still being packed" in r for r in st["reasons"])
        gate.set()
        from hf_csv.head import find_head, get_certified_head

        ch = get_certified_head(find_head(m)[1], hf_csv.CSVConfig())
        ch.provider.state.ready.wait(30)
        st = _certified_greedy(m, ids, ref)
        assert st["full_head_calls"] == 0 and st["certified"] == 6
    finally:
        gate.set()
        hf_csv.disable(m)


@pytest.mark.skipif(not native.available(), reason="needs hf_csv's native kernel (x86-64 AVX2 and a C compiler)")
def test_native_kernel_certifies_the_first_call_and_serves_calls_of_several_rows(monkeypatch):
    """With the native kernel a head is certified from its first step (no prepack to wait for), and calls of several
    rows stay on it: fbgemm's pack is never built (docs/benchmarks.md §9.12: the native kernel is at least as fast
    up to 8 rows, and its 8-bit activations bound tighter). fbgemm's path, where the native kernel does not serve,
    is as sound."""
    import hf_csv

    packs = []
    real_pack = scr._pack
    monkeypatch.setattr(scr, "_pack", lambda q, s: packs.append(1) or real_pack(q, s))
    m, ids = _tiny_llama()
    ref = m.generate(ids, max_new_tokens=6, do_sample=False)
    hf_csv.enable(m)
    try:
        st = _certified_greedy(m, ids, ref)
        assert st["full_head_calls"] == 0 and st["certified"] == 6
        assert not any("still being packed" in r for r in st["reasons"])
        from hf_csv.head import find_head, get_certified_head

        ch = get_certified_head(find_head(m)[1], hf_csv.CSVConfig())
        state = ch.provider.state
        assert state.native is not None and packs == []
        W = find_head(m)[1].weight
        H = torch.randn(3, W.shape[1]) * 3
        e0, r0 = scr.screen_int8_cpu(state, H)  # native, three rows
        assert scr.screen_bounds_cpu(state, H) is not None  # the fused native pass serves several rows too
        assert packs == [] and state.packed is None
        fb = scr.prepare_screen(state.rows, state.outlier_cols, native=False)  # fbgemm's path
        e1, r1 = scr.screen_int8_cpu(fb, H)
        ex = H.double() @ W.double().T
        for e, r in ((e0, r0), (e1, r1)):
            assert ((ex - e.double()).abs() <= r.double()).all()
        assert not torch.equal(e0, e1)  # two different kernels ran
    finally:
        hf_csv.disable(m)


@pytest.mark.slow
def test_native_kernel_builds_into_an_empty_cache_and_can_be_turned_off(tmp_path):
    """A fresh machine: the library is compiled into $HF_CSV_KERNEL_CACHE on first use and loaded from there;
    HF_CSV_NATIVE=0 turns it off with the reason (the screen then uses fbgemm)."""
    import os
    import shutil
    import subprocess
    import sys

    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.why_unavailable()}")
    code = ("from hf_csv_kernels import native; import json; "
            "print(json.dumps([native.available(), native.why_unavailable()]))")
    env = dict(os.environ, HF_CSV_KERNEL_CACHE=str(tmp_path / "k"))
    env.pop("HF_CSV_NATIVE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("[true, null]"), out.stdout
    assert len(list((tmp_path / "k").glob(f"screen_{native.path()}-*.so"))) == 1
    env["HF_CSV_NATIVE"] = "0"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "HF_CSV_NATIVE=0" in out.stdout and "false" in out.stdout
    shutil.rmtree(tmp_path / "k")


def test_native_kernel_is_exact_and_refuses_code_minus_128():
    """The kernel's integer dot products are exact (bit for bit against int64 arithmetic and the same float
    steps), in both layouts, for any thread count, with tails in V and d; a −128 code keeps fbgemm."""
    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.why_unavailable()}")
    g = torch.Generator().manual_seed(3)
    for V, d in [(103, 70), (64, 32), (1001, 576), (7, 5)]:
        q = torch.randint(-127, 128, (V, d), generator=g, dtype=torch.int8)
        s = torch.rand(V, generator=g)
        qi, mn = native.interleave(q)
        assert mn == int(q.min()) and native.min_code(q) == int(q.min())
        for N in (1, 3):
            A = torch.randint(-127, 128, (N, d), generator=g, dtype=torch.int8)
            cr = torch.rand(N, generator=g)
            ref = ((A.long() @ q.long().T).float() * s) * cr[:, None]
            for il, qq in ((False, q), (True, qi)):
                for th in (1, 3):
                    assert torch.equal(native.screen_i8(qq, s, A, cr, il, threads=th, chunk=8), ref), (V, d, N, il)
    q = torch.randint(-127, 128, (40, 64), generator=g, dtype=torch.int8)
    W = q.float() * 0.01
    rows = quantize_rows_int8(W, progress=False)
    assert scr.prepare_screen(rows).native is not None
    rows.q[3, 7] = -128  # a foreign code (from a file, say): the sign trick would overflow on it
    st_ = scr.prepare_screen(rows)
    assert st_.native is None and st_.packed is not None


def test_tuner_follows_a_changed_caller_thread_count(monkeypatch):
    monkeypatch.setenv("HF_CSV_HEAD_THREADS", "auto")
    before = torch.get_num_threads()
    tu = ThreadTuner()
    try:
        for T in (2, 3, 2):
            torch.set_num_threads(T)
            for _ in range(8):
                with tu("k") as n:
                    assert n in (1, T)
                assert torch.get_num_threads() == T
            assert tu.choice("k", T) in (1, T)
    finally:
        torch.set_num_threads(before)


def test_one_controller_serves_the_guard_and_the_tuner():
    """Issue 38 property 6: the guard and the thread choice are two settings of one controller. Its statistic is
    the setting's: the tuner's mean sees a stall that the guard's median ignores."""
    from hf_csv.speed import Controller, SpeedGuard

    assert isinstance(SpeedGuard()._ctl, Controller) and isinstance(ThreadTuner()._ctl, Controller)
    with pytest.raises(ValueError, match="median"):
        Controller(4, 4, 8, 0.9, stat="mode")
    for stat, want in (("median", "b"), ("mean", "a")):
        ctl = Controller(window=5, probe=4, max_probe=8, margin=0.95, stat=stat, warm={"a": 5, "b": 5})
        for i in range(40):  # b: 1 ms with one 50 ms stall in each window; a: 3 ms
            arm = ctl.pick("k", "a", "b")
            ctl.record("k", arm, 0.003 if arm == "a" else (0.050 if i % 5 == 0 else 0.001))
        assert ctl.best("k") == want, stat


def test_speed_guard_unit():
    from hf_csv.speed import SpeedGuard

    g = SpeedGuard(window=4, probe=4, max_probe=8)
    picks = []
    for _ in range(2000):  # the certified head takes 5 ms, the full head 1 ms
        c = g.certified("k")
        picks.append(c)
        g.record("k", c, 0.005 if c else 0.001)
    assert g.summary("k")["choice"] == "full"
    assert sum(picks[:10]) <= 4  # the warm-up: 1 + 3 certified calls, then the full head
    # still probing, one certified call at a time, 100·(5 − 1) = 400 calls apart (issue 36: probes cost what they
    # measure, so a clearly slower certified head is probed rarely): under 2 % of the time on top of stock's
    late = sum(picks[20:])
    assert 0 < late <= 1980 // 400 + 1, late
    assert late * (0.005 - 0.001) / (1980 * 0.001) < 0.02
    for _ in range(60):  # now the certified head is faster
        c = g.certified("k")
        g.record("k", c, 0.001 if c else 0.005)
    assert g.summary("k")["choice"] == "certified"


def test_speed_guard_declines_cuda_heads_before_building_a_screen(monkeypatch):
    """On CUDA the certified head was measured slower than stock's head at every shape (docs/benchmarks.md §4): a
    guarded head there runs the full head, decided before any screen is built; HF_CSV_SPEED_GUARD=0 lifts it. (The
    device is only read off ``weight.device``; tests/test_cuda.py runs the real thing on a GPU.)"""
    from types import SimpleNamespace

    from hf_csv.speed import MIN_WEIGHTS, cuda_reason

    def w(dev, n):
        return SimpleNamespace(device=torch.device(dev), numel=lambda: n)

    assert "CUDA" in cuda_reason(w("cuda", MIN_WEIGHTS))
    assert cuda_reason(w("cuda", MIN_WEIGHTS - 1)) is None  # tiny heads are not guarded
    assert cuda_reason(w("cpu", MIN_WEIGHTS)) is None
    monkeypatch.setenv("HF_CSV_SPEED_GUARD", "0")
    assert cuda_reason(w("cuda", MIN_WEIGHTS)) is None


def test_speed_guard_probes_a_much_slower_full_head_rarely_and_still_reacts_to_a_slowdown():
    """Certified 12 ms against full 60 ms (Gemma-3's head): probes about every 400 calls, so the full calls cost
    about 2 % of the certified time (every 128 calls it was 6 %); a certified head that turns slower than the full
    one loses at once, with no probe needed."""
    from hf_csv.speed import SpeedGuard

    g = SpeedGuard()
    full = 0
    for i in range(4000):
        c = g.certified("k")
        full += not c
        g.record("k", c, 0.012 if c else 0.060)
    assert g.summary("k")["choice"] == "certified"
    assert full <= 2 + 2 * (4000 // 384) + 2, full  # warm-up + two-call probes at least 384 calls apart
    assert full * (0.060 - 0.012) / (4000 * 0.012) < 0.03
    for i in range(20):  # the certified head slows to 90 ms: the full head takes over within the window
        c = g.certified("k")
        g.record("k", c, 0.090 if c else 0.060)
    assert g.summary("k")["choice"] == "full"


def test_speed_guard_forgets_a_passing_slowdown_at_the_next_probe():
    """The certified head slowed for a while (a load, the screen's background pack) must win again at the next
    probe once it is fast: with its old samples kept, the guard needed several probes, up to 128 calls apart."""
    from hf_csv.speed import SpeedGuard

    g = SpeedGuard()  # the defaults: window 6, probe 16 doubling to 128
    for _ in range(600):  # slowed: certified 30 ms, full 20 ms
        c = g.certified("k")
        g.record("k", c, 0.030 if c else 0.020)
    assert g.summary("k")["choice"] == "full"
    switched = None
    for i in range(160):  # fast again: certified 8 ms
        c = g.certified("k")
        g.record("k", c, 0.008 if c else 0.020)
        if switched is None and g.summary("k")["choice"] == "certified":
            switched = i
    assert switched is not None and switched <= 130, switched


def test_speed_guard_uses_the_full_head_where_it_is_faster(monkeypatch):
    """Never slower than stock: a certified head made artificially slow loses to the full head; tokens
    stay stock's either way and the stats say which ran."""
    import time as _time

    import hf_csv
    import hf_csv.speed as speed
    from hf_csv.certificate import CertifiedHead as CH

    monkeypatch.setattr(speed, "MIN_WEIGHTS", 0)
    real_topk = CH.topk

    def slow_topk(self, *a, **k):
        _time.sleep(0.01)
        return real_topk(self, *a, **k)

    monkeypatch.setattr(CH, "topk", slow_topk)
    m, ids = _tiny_llama()
    ref = m.generate(ids, max_new_tokens=20, do_sample=False)
    hf_csv.enable(m)
    try:
        out = m.generate(ids, max_new_tokens=20, do_sample=False, csv_config=hf_csv.CSVConfig())
        st = m.csv_last_stats
        assert torch.equal(out, ref)
        assert st["speed_guard"]["choice"] == "full", st
        assert st["full_head_calls"] >= 12 and any("measured faster" in r for r in st["reasons"])
        monkeypatch.setenv("HF_CSV_SPEED_GUARD", "0")
        out = m.generate(ids, max_new_tokens=5, do_sample=False, csv_config=hf_csv.CSVConfig())
        assert torch.equal(out, ref[:, : out.shape[1]]) and m.csv_last_stats["full_head_calls"] == 0
    finally:
        hf_csv.disable(m)


def test_speed_guard_counts_the_processor_step(monkeypatch, assume_subset_exact):  # nucleus mode
    """The guard compares whole steps: in nucleus mode the CSVLogitsProcessor takes the top-p warper's place, so
    a certified row's check belongs to the certified side's cost. Made slow here (the head itself is not), it
    must make the guard pick the full head; timing the head call alone would keep the certified one."""
    import time as _time

    import hf_csv
    import hf_csv.plan as plan
    import hf_csv.speed as speed

    monkeypatch.setattr(speed, "MIN_WEIGHTS", 0)
    real = plan.Nucleus.check

    def slow_nucleus(self, *a, **k):
        _time.sleep(0.02)
        return real(self, *a, **k)

    monkeypatch.setattr(plan.Nucleus, "check", slow_nucleus)
    m, ids = _tiny_llama()
    gen = dict(max_new_tokens=24, do_sample=True, top_k=0, top_p=0.9, temperature=0.7)
    torch.manual_seed(3)
    ref = m.generate(ids, **gen)
    hf_csv.enable(m)
    try:
        torch.manual_seed(3)
        out = m.generate(ids, **gen, csv_config=hf_csv.CSVConfig())
        st = m.csv_last_stats
        assert st["mode"] == "nucleus", st
        assert torch.equal(out, ref)
        assert st["speed_guard"]["choice"] == "full", st
        assert st["full_head_calls"] >= 12 and st["speed_guard"]["certified_ms"] >= 20, st
    finally:
        hf_csv.disable(m)


def test_native_fused_bounds_round_up_and_match_the_plain_kernel():
    """The fused call from the hidden states: est is the plain kernel's value on the same int8 activations plus
    the outlier dot and the bias (within the float rounding the proof allows), top is the first largest est,
    and upper is never below the real sum est + Σ c_t·terms_t (+ c_3·|b|), checked in rational arithmetic on
    every lane (vector body and scalar tail), with and without outlier columns, bias and a third term, for 1 and 3
    rows and 1 and 3 threads. (Rounded to nearest without the final step up, about half the lanes fall short.)"""
    from fractions import Fraction

    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.why_unavailable()}")
    g = torch.Generator().manual_seed(5)
    F = lambda x: Fraction(float(x))  # noqa: E731
    for V, d, k, with_bias, three in [(103, 70, 4, True, True), (1001, 64, 0, False, False), (29, 33, 9, False, True)]:
        q = torch.randint(-127, 128, (V, d), generator=g, dtype=torch.int8)
        s = torch.rand(V, generator=g) * 1e-2
        cols = torch.randperm(d, generator=g)[:k].sort().values
        wJ = torch.randn(V, k, generator=g)
        bias = torch.randn(V, generator=g) * 10 if with_bias else None
        terms = [torch.rand(V, generator=g) * 3 for _ in range(3 if three else 2)]
        K = (1.0 + 1e-6, 0.004, 1e-5, 1e-6, 1e-7)
        for N in (1, 3):
            H = torch.randn(N, d, generator=g)
            H[:, cols] *= 50  # massive activations on the outlier columns
            rest = H.clone()
            rest[:, cols] = 0
            m = rest.abs().amax(1, keepdim=True)
            A = (rest / m).mul_(127.0).round_().to(torch.int8)
            plain = native.screen_i8(q, s, A, (m / 127.0).view(-1).contiguous(), False, threads=1)
            for th in (1, 3):
                for rest_norm in (True, False):
                    est, up, top = native.screen_bounds(q, s, False, H, cols, native.block8(wJ), rest_norm, K, terms,
                                                        bias, threads=th, chunk=16)
                    ref = plain.double() + H[:, cols].double() @ wJ.double().T + (0 if bias is None else bias.double())
                    tol = 1e-5 * (plain.double().abs() + H[:, cols].double().abs() @ wJ.double().abs().T + 1)
                    assert ((est.double() - ref).abs() <= tol).all()
                    assert torch.equal(top, est.argmax(1))
                    for r in range(N):
                        hinf = F(H[r].abs().max())
                        norm = math.sqrt(sum(F(x) ** 2 for x in (rest[r] if rest_norm else H[r])))
                        c = [F(norm) * F(K[0]), F(m[r, 0]) * F(K[1]) + hinf * F(K[2]), hinf * F(K[3]), F(K[4])]
                        for i in range(V):
                            real = F(est[r, i]) + sum(c[t] * F(terms[t][i]) for t in range(len(terms)))
                            if bias is not None:
                                real += c[3] * abs(F(bias[i]))
                            # the norm: float64 within 1e-12 of the real one, the kernel's own raised by 1e-10
                            assert F(up[r, i]) >= real, (V, r, i)


def test_prepare_packs_now_and_keeps_the_later_work_in_the_background():
    """CertifiedHead.prepare (an engine's load step: hf_csv.vllm_plugin.prebuild) calibrates and packs in the calling
    thread, so the first certified call finds the screen ready; the provider's background setting is left as it was
    (the columns' re-choice from the first real rows stays off the decode path), and results are the same."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(70000, 64, generator=g) * 0.05
    H = torch.randn(3, 64, generator=g) * 3
    a, b = CertifiedHead(W, background=True), CertifiedHead(W)
    a.prepare(torch.randn(1, 64, generator=g))
    assert a.provider.ready() and a.provider.background
    st = a.provider.state
    assert st.outliers.err_rest is not None  # the exact outlier columns (a large head defers them otherwise)
    if st.native is not None:  # the native kernel: the interleaved codes already in place
        assert st.native[1] and st.packed is None
    ra, rb = a.topk(H), b.topk(H)
    assert torch.equal(ra.logits.argmax(1), rb.logits.argmax(1))
    assert torch.equal(ra.logits.argmax(1), F.linear(H, W).argmax(1))
