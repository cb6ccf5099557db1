"""hf_csv.core.speed: the one speed controller and its two settings, the thread tuner and the speed guard; they change
speed only (tokens are stock's whichever way they choose)."""
import pytest
import torch

from hf_csv.core.certificate import CertifiedHead
from hf_csv.core.speed import caller_threads, ThreadTuner

from conftest import _tiny_llama


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
    from hf_csv.core.speed import Controller, SpeedGuard

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
    from hf_csv.core.speed import SpeedGuard

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


def test_speed_guard_lists_the_keys_it_has_seen():
    """``has`` / ``keys``: read-only views of the keys asked so far (a caller, e.g. the vLLM plugin, relates a new
    key to the ones already measured), in the order of their first call; a key is there from its first call."""
    from hf_csv.core.speed import SpeedGuard

    g = SpeedGuard()
    assert g.keys() == [] and not g.has("a")
    g.certified("b")
    g.certified("a", rows=64)
    g.certified("b")
    assert g.keys() == ["b", "a"] and g.has("a") and g.has("b") and not g.has("c")
    keys = g.keys()
    g.certified("c")
    assert keys == ["b", "a"] and g.keys() == ["b", "a", "c"]  # (a snapshot)
    assert g.summary("c") is None  # (listed before any measurement)


def test_speed_guard_declines_cuda_heads_before_building_a_screen(monkeypatch):
    """On CUDA the certified head was measured slower than stock's head at every shape (docs/benchmarks.md §4): a
    guarded head there runs the full head, decided before any screen is built; HF_CSV_SPEED_GUARD=0 lifts it. (The
    device is only read off ``weight.device``; tests/test_stack_cuda.py runs the real thing on a GPU.)"""
    from types import SimpleNamespace

    from hf_csv.core.speed import MIN_WEIGHTS, cuda_reason

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
    from hf_csv.core.speed import SpeedGuard

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
    from hf_csv.core.speed import SpeedGuard

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
    import hf_csv.core.speed as speed
    from hf_csv.core.certificate import CertifiedHead as CH

    monkeypatch.setattr(speed, "MIN_WEIGHTS", 0)
    real_topk = CH.topk

    def slow_topk(self, *a, **k):
        _time.sleep(0.01)
        return real_topk(self, *a, **k)

    monkeypatch.setattr(CH, "topk", slow_topk)
    m, ids = _tiny_llama()
    # (32 steps: the guard samples the certified head once it settled, after its first rows: CertifiedHead.settled)
    ref = m.generate(ids, max_new_tokens=32, do_sample=False)
    hf_csv.enable(m)
    try:
        out = m.generate(ids, max_new_tokens=32, do_sample=False, csv_config=hf_csv.CSVConfig())
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
    import hf_csv.transformers.plans as plan
    import hf_csv.core.speed as speed

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


def test_speed_guard_judges_the_certified_head_once_settled(monkeypatch):
    """The first certified calls carry one-off work (the screen's packing, its columns' re-choice from the first
    rows: ``CertifiedHead.settled``). Made slow here, and stock's head made slower than a settled certified call,
    the guard must judge the certified head by its settled calls: timing the first ones too put it on the full head
    and probed the certified side only a few hundred calls later (docs/benchmarks.md §9.5)."""
    import time as _time

    import hf_csv
    import hf_csv.core.speed as speed
    from hf_csv.core.certificate import CertifiedHead

    monkeypatch.setattr(speed, "MIN_WEIGHTS", 0)
    calls = [0]
    real_topk, real_settled = CertifiedHead.topk, CertifiedHead.settled

    def topk(self, *a, **k):
        calls[0] += 1
        if calls[0] <= 6:
            _time.sleep(0.03)  # the unsettled calls' one-off work
        return real_topk(self, *a, **k)

    monkeypatch.setattr(CertifiedHead, "topk", topk)
    monkeypatch.setattr(CertifiedHead, "settled", lambda self: calls[0] >= 6 and real_settled(self))
    m, ids = _tiny_llama()
    real_fwd, head = torch.nn.Linear.forward, m.lm_head

    def slow_head(self, x):
        if self is head:
            _time.sleep(0.006)  # stock's head: slower than a settled certified call, faster than an unsettled one
        return real_fwd(self, x)

    # (on the class: a forward set on the head instance is a wrapper hf_csv declines, hf_csv.transformers.heads.head_decline_reason)
    monkeypatch.setattr(torch.nn.Linear, "forward", slow_head)
    gen = dict(max_new_tokens=24, do_sample=False)
    ref = m.generate(ids, **gen)
    hf_csv.enable(m)
    try:
        out = m.generate(ids, **gen, csv_config=hf_csv.CSVConfig())
        st = m.csv_last_stats
        assert torch.equal(out, ref)
        assert st["speed_guard"]["choice"] == "certified", st
        assert st["speed_guard"]["certified_ms"] < 6, st  # no unsettled call among its samples
    finally:
        hf_csv.disable(m)


@pytest.mark.parametrize("kind", ["guard", "tuner"])
def test_batched_records_make_the_same_choices_at_most_batch_minus_one_calls_later(kind):
    """Controller(batch=B): in the steady state the chosen arm's samples are kept aside and folded B at a time
    (one list append per call instead of a window update and a decision); the choices are those of B = 1, each
    switch at most B − 1 calls later, through phases where each arm in turn is the faster."""
    from hf_csv.core.speed import SpeedGuard, ThreadTuner

    def run(batch):
        ctl = (SpeedGuard(batch=batch) if kind == "guard" else ThreadTuner(batch=batch))._ctl
        a, b, start = ("c", "f", "c") if kind == "guard" else (1, 2, 2)
        choices, probes = [], 0
        for calls, ms in ((300, {a: 1.0, b: 2.0}), (300, {a: 3.0, b: 2.0}), (300, {a: 1.0, b: 2.0}),
                          (300, {a: 1.0, b: 0.5})):
            for _ in range(calls):
                arm = ctl.pick("k", a, b, start=start)
                probes += arm != ctl.best("k")
                ctl.record("k", arm, ms[arm] * 1e-3)
                choices.append(ctl.best("k"))
        switches = [i for i in range(1, len(choices)) if choices[i] != choices[i - 1]]
        return switches, [choices[i] for i in switches], probes

    sw1, to1, probes1 = run(1)
    assert len(sw1) >= 3  # the phases do make it switch
    for batch in (2, 4, 8):
        sw, to, probes = run(batch)
        assert to == to1, (batch, to, to1)
        assert all(0 <= j - i <= batch - 1 for i, j in zip(sw1, sw)), (batch, sw, sw1)
        assert abs(probes - probes1) <= 2 * len(sw1), (batch, probes, probes1)  # the same probing, give or take


def test_batched_records_fold_before_a_probe_and_after_a_switch_count_no_probe():
    """The kept samples are folded before a probe reads the windows; samples of the arm that was chosen, folded
    after a switch among them, are not taken for a probe that confirms the new choice (which would space the
    probes out: a call's one slow sample then kept the tuner on one thread for a long probe interval)."""
    from hf_csv.core.speed import Controller

    ctl = Controller(window=4, probe=8, max_probe=64, margin=0.9, stat="mean", batch=4)
    st = None
    for _ in range(100):  # warm-up, then the steady state on "a", with 5 calls left before the next probe
        arm = ctl.pick("k", "a", "b")
        ctl.record("k", arm, 0.001 if arm == "a" else 0.002)
        st = ctl._state["k"]
        if st.steady and not st.pending and st.n % st.probe < st.probe - 5:
            break
    assert st.best == "a" and st.steady
    probe_before = st.probe
    while st.steady and len(st.pending) < 3:  # fill the pending list up to the fold
        ctl.record("k", ctl.pick("k", "a", "b"), 0.001)
    st.pending[0] = 0.050  # one very slow call among the kept samples: folding it switches to "b"
    ctl.record("k", ctl.pick("k", "a", "b"), 0.001)
    assert st.best == "b" and not st.pending
    assert st.probe == ctl.probe0 <= probe_before  # a switch resets the interval; no "confirmation" doubled it


def test_a_call_that_ran_the_full_head_is_not_a_sample_of_the_thread_choice(monkeypatch):
    """speed.untimed: inside a tuned block, a call that ran stock's full head on some row (the certified head calls
    it from its fallback) is left out of the tuner's record: its time is that head's, not the thread choice's."""
    from hf_csv.core.speed import untimed

    monkeypatch.setenv("HF_CSV_HEAD_THREADS", "auto")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tu = ThreadTuner()
        with tu("k"):
            untimed()
        st = tu._ctl._state[("k", 2)]
        assert not any(st.win.values()) and not st.pending
        with tu("k"):
            pass
        assert sum(len(w) for w in st.win.values()) == 1
        untimed()  # outside a tuned block: nothing to leave out, no error
        # the certified head's fallback marks its call
        torch.manual_seed(0)
        W = torch.randn(64, 16)
        ch = CertifiedHead(W, provider="screen")
        seen = []
        real = ThreadTuner._record
        monkeypatch.setattr(ThreadTuner, "_record", lambda self, *a: (seen.append(a), real(self, *a)))
        with ch._tuner(("x", 1)):
            ch._stock_rows(torch.randn(1, 16), torch.randn(1, 16), torch.float32)
        assert seen == []
    finally:
        torch.set_num_threads(before)


def test_speed_guard_prior_starts_large_calls_on_the_full_head():
    """A shape not measured yet: 32+ rows start on the full head and try the certified one only max_probe calls in
    (a single large call no longer pays the certified head's per-row work); small calls start certified."""
    from hf_csv.core.speed import PRIOR_FULL_ROWS, SpeedGuard

    g = SpeedGuard()
    big, small = ("k", PRIOR_FULL_ROWS), ("k", 1)
    picks = [g.certified(big, rows=PRIOR_FULL_ROWS) for _ in range(g.max_probe - 1)]
    for c in picks:
        g.record(big, c, 0.5 if c else 0.1)
    assert not any(picks)
    assert g.certified(big, rows=PRIOR_FULL_ROWS)  # the first try
    g.record(big, True, 0.55)  # much slower: probed as rarely as the rule allows
    later = [g.certified(big, rows=PRIOR_FULL_ROWS) for _ in range(200)]
    assert sum(later) <= 1
    assert g.certified(small, rows=1)
    # a large shape where the certified head wins switches over after its first try
    g2 = SpeedGuard()
    for _ in range(g2.max_probe):
        c = g2.certified(big, rows=64)
        g2.record(big, c, 0.05 if c else 0.1)
    assert all(g2.certified(big, rows=64) for _ in range(5))


def test_a_waited_try_that_could_not_be_timed_is_tried_again_at_once():
    """A shape that starts on the full head and waits a ``max_probe`` for its first certified try: where that try is
    not timed (``untimed``: the certified head not settled yet, its screen having seen no rows of the shape, which ran
    stock's head so far), the next call tries again, until one is timed; it used to wait another ``max_probe`` per
    try, and a batch-1 screen needs 8 rows to settle: about 1,000 calls before the guard could judge it. A try the
    caller skips without saying so (vLLM's probe that cannot win) still waits a probe."""
    from hf_csv.core.speed import SpeedGuard

    g = SpeedGuard()
    key = ("k", 1)
    for _ in range(g.max_probe - 1):
        assert not g.certified(key, rows=1, start_full=True, wait=True)
        g.record(key, False, 0.1)
    assert g.certified(key, rows=1, start_full=True, wait=True)  # the first try, not timed
    for _ in range(7):
        g.untimed(key)
        assert g.certified(key, rows=1)  # tried again while none is timed
    g.record(key, True, 0.05)  # settled: one certified sample, faster, decides
    assert g.choice(key) == "c" and all(g.certified(key, rows=1) for _ in range(20))
    g2 = SpeedGuard()
    for _ in range(g2.max_probe):
        c = g2.certified(key, rows=1, start_full=True, wait=True)
        if not c:
            g2.record(key, False, 0.1)
    assert c and not g2.certified(key, rows=1)  # skipped, not untimed: the next try a probe later
