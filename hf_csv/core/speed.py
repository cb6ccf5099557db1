"""The one speed controller: pick the faster of two ways to run a call, by measurement, per call shape.

:class:`Controller` is the rule (windows of recent times per arm, a margin, probes that re-measure the other arm
and space out while the choice holds); :class:`SpeedGuard` (certified head or full head) and :class:`ThreadTuner`
(the certified head on the caller's thread count or on one thread) are its two settings. Both only pick the faster
of two exact ways: results never depend on the choice. The tuner's choice is made inside the certified call, so
the guard compares the full head with the certified head at its best thread count.

**SpeedGuard — never slower than stock:** use the full head where it is measured faster than the certified one.

The certified head wins by a wide margin at batch 1 in fp32, but not everywhere: a bf16 head is read at
half the bytes by stock's GEMV, a small head is dominated by fixed per-call costs, and a busy CPU changes
both sides. So each certified head keeps, per (mode, batch rows, dtype, threads), the recent median time of
its certified calls and of full-head calls, and runs the full head while that is faster, probing the
other side now and then (every 16 calls, doubling to 128 while the choice holds; when the certified head is
more than 1.5× faster, 100·(full/certified − 1) calls apart, between 128 and 512, so that probing the slow full
head costs about 2 % of the certified time), each probe a few calls in a row that replace that side's samples, so a
choice made under a passing load is undone at the next probe. Both sides are exact;
this only picks the faster. The choice is reported in the call's stats (``speed_guard``).

What is timed is the step's work that differs between the two sides: the head call, plus, when hf_csv's
``CSVLogitsProcessor`` runs after it (decoding with a per-step check), that processor's time in the same step —
the check on a certified row, stock's warper that it stands in for on a full one (nucleus mode replaces stock's
top-p warper, whose sort over V is a V-wide cost of its own; docs/benchmarks.md §9.5). Other processors and
the model body cost the same on both sides and are not timed.

A certified call made before the head settled (``CertifiedHead.settled``: the screen's packing and its columns'
re-choice from the first rows, one-off work that makes such calls slower than later ones: docs/benchmarks.md §9.5) is
not a sample of either controller: judged by them, the guard kept the full head for hundreds of calls
(``tests/test_core_speed.py::test_speed_guard_judges_the_certified_head_once_settled``).

A shape seen for the first time has no measurement yet, so it starts from a prior on the shape: calls of at least
``PRIOR_FULL_ROWS`` rows start on the full head (there stock's GEMM is compute-bound and efficient, while the
certified head's per-row work grows with the rows: docs/benchmarks.md §9.3), and the certified head is tried once a probe apart; one
faster certified sample switches it over (the first try comes ``max_probe`` calls in). Smaller calls start certified,
unless the caller overrides the prior (``start_full`` / ``wait``: ``generate`` does where fewer rows of the same plan
keep the full head by far, or where the certified head's first step would run a probe, hf_csv.transformers.step).

Probes cost what they measure, so they are capped: once the full head is the choice, a probe of the certified side is
one call (not a warm-up of three), and where the certified head is clearly slower (more than 1.5×) probes come
100·(certified/full − 1) calls apart, between 128 and 512, as for a clearly slower full head: about 2 % of the time
the certified head loses on a loaded machine (docs/benchmarks.md §9.5).

On CUDA the guard does not measure: the certified head there is launch- and synchronisation-bound (about 200 kernel
launches and 60 host synchronisations per call) and was slower than stock's cuBLAS head at every shape measured
(docs/benchmarks.md §4), so :func:`cuda_reason` declines the call before any screen is built, with that reason in
the call's stats. Timing an asynchronous device with host clocks would also need a synchronisation per step.

Only heads of at least ``MIN_WEIGHTS`` weights are guarded (tiny heads in tests stay certified), and
``HF_CSV_SPEED_GUARD=0`` turns the guard off (on CUDA too: the certified head then runs, exact and slower).

**ThreadTuner — the certified head's thread count:** the caller's count or one thread, keyed per head method and
rows bucket; ``HF_CSV_HEAD_THREADS`` fixes it. Why: a certified head call is one int8 GEMV plus a handful of
V-wide passes, each a fork/join of torch's OpenMP pool. When another process holds a core, every join can wait for
a scheduler time slice, and the many short parallel regions cost more than the work (docs/benchmarks.md §9.1).
Stock's single large GEMV barely notices. So the head times itself on the caller's thread count and on one thread
and keeps the faster, re-probing the other now and then, because load comes and goes.

This only changes speed, never results: the bounds are rigorous for any summation order, and the
callers run the exact recompute on the caller's thread count (:func:`caller_threads`).
``torch.set_num_threads`` sets the calling thread's OpenMP count (and MKL's, process-wide) for the
duration of the call; concurrent calls in other threads may run their BLAS on one thread meanwhile.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
from collections import deque
from typing import Hashable, Iterator, Optional

import torch

__all__ = ["Controller", "SpeedGuard", "ThreadTuner", "MIN_WEIGHTS", "PRIOR_FULL_ROWS", "CANNOT_WIN", "cuda_reason",
           "caller_threads", "intra_op_threads", "rows_bucket", "untimed"]

MIN_WEIGHTS = 1 << 21
PRIOR_FULL_ROWS = 32  # calls of this many rows start on the full head (module docstring)
# a new shape is not tried certified at first where fewer rows of its kind keep the full head with a certified median
# more than this many times its own (the guard's clear loser; the callers: hf_csv.transformers.step, hf_csv.vllm.guard)
CANNOT_WIN = 1.5


_CALLER = threading.local()  # the thread count the caller had before a tuned block


def rows_bucket(n: int) -> int:
    """Rows of a head call, bucketed for timing keys: 1 (decode), up to 8, up to 64, more."""
    return 1 if n <= 1 else 8 if n <= 8 else 64 if n <= 64 else 65


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """Run the block on ``n`` intra-op threads (the calling thread's count; restored on exit)."""
    prev = torch.get_num_threads()
    if n == prev:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


@contextlib.contextmanager
def caller_threads() -> Iterator[None]:
    """Inside a tuned block: run this part on the caller's own thread count (e.g. the exact recompute,
    whose kernel should match stock's head op)."""
    n = getattr(_CALLER, "n", None)
    if n is None:
        yield
    else:
        with intra_op_threads(n):
            yield


def untimed() -> None:
    """Inside a tuned block: leave this call out of the tuner's record. The certified head calls it where it runs
    stock's full head on some row (a fallback, on the caller's thread count): such a call's time is that head's, not
    the thread choice's, and one of them in a window of six moved the tuner's mean to one thread for a probe
    interval (docs/benchmarks.md §9.1)."""
    if getattr(_CALLER, "n", None) is not None:
        _CALLER.untimed = True


def cuda_reason(weight) -> Optional[str]:
    """Why a guarded head on a CUDA device runs the full head (None where the guard does not decide so)."""
    if weight.device.type != "cuda" or weight.numel() < MIN_WEIGHTS or not SpeedGuard.enabled():
        return None
    return ("speed guard: on CUDA the certified head is measured slower than stock's head (docs/benchmarks.md §4); "
            "HF_CSV_SPEED_GUARD=0 runs it anyway")


class _Key:
    """One key's record: the two arms (``a`` wins a draw, ``b`` must beat it by the margin), their windows."""

    __slots__ = ("a", "b", "win", "best", "start", "n", "probe", "wait", "seen", "steady", "pending")

    def __init__(self, a, b, start, window: int, probe: int, wait: bool):
        self.a, self.b, self.start, self.best = a, b, start, start
        self.win = {a: deque(maxlen=window), b: deque(maxlen=window)}
        self.n, self.probe, self.seen = 0, probe, False
        # the other arm's first try waits for a probe (a large call's first certified try: SpeedGuard)
        self.wait = wait
        # steady: both arms past their warm-up or probe and no switch since, so a pick is the chosen arm or a probe;
        # pending: samples of the chosen arm (``best``) not yet in its window (Controller's ``batch``)
        self.steady, self.pending = False, []

    def other(self, arm):
        return self.b if arm == self.a else self.a


class Controller:
    """Per key, which of two arms runs a call: ``a`` or ``b``, the faster by the recent ``stat`` (median or mean)
    of each arm's last ``window`` times; ``b`` is chosen only where it beats ``margin`` times ``a``'s (a draw goes
    to ``a``). Thread-safe bookkeeping; the caller times the call and reports it to :meth:`record`.

    :meth:`pick`, in order:

    1. a new key starts on ``start`` (the caller's prior), probing every ``probe`` calls, or every ``max_probe`` with
       ``wait`` (then the other arm's first try waits for that probe);
    2. warm-up: the chosen arm runs until it has ``warm[role]`` samples, then the other until it has
       ``probe_calls[role]`` (roles ``"a"``, ``"b"``; ``alternate`` interleaves the two while both are short);
    3. a probe, every ``probe`` calls: the other arm's window is emptied and it runs (step 2 then runs it
       ``probe_calls`` times in a row), so a choice made under a passing load or a one-off cost is undone at the
       next probe instead of after several;
    4. otherwise the chosen arm.

    :meth:`record` appends the time and, once both windows hold enough (``warm`` for the chosen arm where it was
    the start, else ``probe_calls``), re-decides: a probe that confirms the choice doubles the interval up to
    ``max_probe``, a switch resets it to ``probe``; with ``clear``, a loser more than ``clear`` times slower is
    probed 100·(ratio − 1) calls apart (between ``max_probe`` and ``max_clear``), so that probing costs about 2 %
    of the time. ``skip_first``: the first sample of the start arm, where it is that arm, is dropped (a first call
    may include one-off work).

    ``batch``: in the steady state (both arms measured, no warm-up or probe running), the chosen arm's samples are
    kept aside and folded into its window ``batch`` at a time, each in turn as :meth:`record` would, so decisions
    are the same ones, up to ``batch - 1`` calls later; a call then costs a counter and a list append (the steps of
    a decode loop run on a cold cache, where each extra line of bookkeeping shows; docs/benchmarks.md §2).
    """

    def __init__(self, window: int, probe: int, max_probe: int, margin: float, stat: str = "median",
                 warm: Optional[dict] = None, probe_calls: Optional[dict] = None, alternate: bool = False,
                 clear: Optional[float] = None, max_clear: int = 512, skip_first: Optional[str] = None,
                 batch: int = 1):
        if stat not in ("median", "mean"):
            raise ValueError(f"stat must be 'median' or 'mean', got {stat!r}")
        self.window, self.probe0, self.max_probe, self.margin = window, probe, max_probe, margin
        self._stat = statistics.median if stat == "median" else statistics.fmean
        self.warm = dict(warm or {"a": 3, "b": 3})
        self.probe_calls = dict(probe_calls or self.warm)
        if min(*self.warm.values(), *self.probe_calls.values()) < 1:
            raise ValueError("warm-up and probe counts must be at least 1 (a decision needs a sample of each arm)")
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        self.batch = batch
        self.alternate, self.clear, self.max_clear, self.skip_first = alternate, clear, max_clear, skip_first
        self._lock = threading.Lock()
        self._state: dict = {}

    def _role(self, st: _Key, arm) -> str:
        return "a" if arm == st.a else "b"

    def _need(self, st: _Key, arm) -> int:
        """Samples ``arm`` needs for a decision: its warm-up where it is the chosen arm and the start, else its probe."""
        role = self._role(st, arm)
        return self.warm[role] if arm == st.best == st.start else self.probe_calls[role]

    def _ready(self, st: _Key) -> bool:
        """Whether both arms' windows hold enough samples for a decision (:meth:`_need`)."""
        return all(len(st.win[x]) >= self._need(st, x) for x in (st.a, st.b))

    def pick(self, key: Hashable, a, b, start=None, wait: bool = False):
        """The arm for this call (``a`` or ``b``; ``start`` and ``wait`` apply to a new key only)."""
        with self._lock:
            st = self._state.get(key)
            if st is None:
                start = a if start is None else start
                st = self._state[key] = _Key(a, b, start, self.window,
                                             self.max_probe if wait else self.probe0, wait)
            st.n += 1
            if st.steady and st.n % st.probe:  # the steady state's common case: steps 2 and 3 do not apply
                return st.best
            self._fold(st)  # (the kept samples belong to the windows this pick reads)
            best, other = st.best, st.other(st.best)
            short_best = len(st.win[best]) < self.warm[self._role(st, best)]
            short_other = len(st.win[other]) < self.probe_calls[self._role(st, other)] and not st.wait
            if short_best and short_other and self.alternate:
                # interleaved: both arms see the same passing load; the start arm first on a tie
                return best if len(st.win[best]) <= len(st.win[other]) else other
            if short_best:
                return best
            if short_other:
                return other
            if st.n % st.probe == 0:
                st.win[other].clear()
                st.steady = False
                return other
            st.steady = True
            return best

    def record(self, key: Hashable, arm, seconds: float) -> None:
        with self._lock:
            st = self._state[key]
            if st.steady and arm == st.best and len(st.pending) < self.batch - 1:
                st.pending.append(seconds)
                return
            probe = arm != st.best  # (as picked: the fold below may switch)
            self._fold(st)
            self._add(st, arm, seconds, probe=probe)

    def _fold(self, st: _Key) -> None:
        """Fold the chosen arm's kept samples into its window, in order (under the lock)."""
        if st.pending:
            pending, st.pending, arm = st.pending, [], st.best
            for s in pending:  # (the chosen arm's samples, not probes: also after a switch among them)
                self._add(st, arm, s, probe=False)

    def _add(self, st: _Key, arm, seconds: float, probe: bool) -> None:
        """One sample of ``arm``: into its window, then the decision (the class docstring's :meth:`record`);
        ``probe``: whether the sample is a probe's (``arm`` was not the chosen one when it was picked)."""
        if arm == st.start == self.skip_first and not st.seen:
            st.seen = True
            return
        if arm != st.best:
            st.wait = st.steady = False
        st.win[arm].append(seconds)
        if self._ready(st):
            ta, tb = self._stat(st.win[st.a]), self._stat(st.win[st.b])
            best = st.b if tb < self.margin * ta else st.a
            if best == st.best:
                if probe:  # a probe confirmed the choice
                    st.probe = min(self.max_probe, st.probe * 2)
            else:
                st.best, st.probe = best, self.probe0
                st.steady = False  # the new choice may still need its warm-up (pick's step 2)
            if self.clear is not None:
                lose, win = (ta, tb) if best == st.b else (tb, ta)
                if lose > self.clear * win:
                    # a clear loser: a probe costs about its extra time; this interval keeps that near 2 %
                    st.probe = max(self.max_probe, min(self.max_clear, int(100 * (lose / win - 1))))

    def retry(self, key: Hashable) -> None:
        """The caller could not time the call it was just given (one-off work it does not count): a waited first try
        of the other arm (:meth:`pick` with ``wait``) is tried again on the next call, not a probe later."""
        with self._lock:
            st = self._state.get(key)
            if st is not None:
                st.wait = False

    def best(self, key: Hashable):
        """The current choice for ``key`` (None before any call)."""
        st = self._state.get(key)
        return None if st is None else st.best

    def times(self, key: Hashable) -> Optional[dict]:
        """{arm: statistic of its window} where both arms have samples, else None."""
        st = self._state.get(key)
        if st is None or not st.win[st.a] or not st.win[st.b]:
            return None
        return {st.a: self._stat(st.win[st.a]), st.b: self._stat(st.win[st.b]), "best": st.best}


class SpeedGuard:
    """The certified head or the full head (module docstring): :class:`Controller` with arms ``"c"`` (certified,
    wins a draw) and ``"f"`` (full, chosen where its median beats 0.95 of the certified one's)."""

    def __init__(self, window: int = 6, probe: int = 16, max_probe: int = 128, margin: float = 0.95,
                 max_clear: int = 512, batch: int = 4):
        # warm-up: 3 certified calls (the first one's sample dropped) and 2 full ones; a probe of a losing
        # certified head is one call, of the full head two
        self._ctl = Controller(window, probe, max_probe, margin, stat="median", warm={"a": 3, "b": 2},
                               probe_calls={"a": 1, "b": 2}, clear=1.5, max_clear=max_clear, skip_first="c",
                               batch=batch)
        self._state = self._ctl._state

    @property
    def max_probe(self) -> int:
        return self._ctl.max_probe

    @staticmethod
    def enabled() -> bool:
        return os.environ.get("HF_CSV_SPEED_GUARD", "1").strip() not in ("0", "false", "no", "off")

    def certified(self, key, rows: int = 1, start_full: Optional[bool] = None, wait: Optional[bool] = None) -> bool:
        """Whether this call should run the certified head (else the full head); ``rows``: the call's head rows
        (the prior of a shape not measured yet: ``PRIOR_FULL_ROWS`` and more start on the full head and try the
        certified one a ``max_probe`` apart). ``start_full`` / ``wait`` override that prior for a new key: start on
        the full head (its first calls cost stock's time), and with ``wait`` try the certified head only a
        ``max_probe`` in (else after the full head's two warm-up calls, one certified call then decides)."""
        full = rows >= PRIOR_FULL_ROWS
        start = full if start_full is None else start_full
        return self._ctl.pick(key, "c", "f", start="f" if start else "c", wait=full if wait is None else wait) == "c"

    def lost(self, keys, by: float = 0.0) -> bool:
        """Read-only: whether any of ``keys`` keeps the full head, decided on samples of both sides (a probe's
        included: a key that started on the full head decides on one certified call), its certified median more than
        ``by`` times the full head's."""
        ctl = self._ctl
        with ctl._lock:
            for k in keys:
                st = self._state.get(k)
                if st is not None and st.best == "f" and st.win["c"] and st.win["f"] and \
                        ctl._stat(st.win["c"]) > by * ctl._stat(st.win["f"]):
                    return True
        return False

    def choice(self, key) -> Optional[str]:
        """``"c"`` or ``"f"``: the current choice for ``key`` (None before its first call)."""
        return self._ctl.best(key)

    def has(self, key) -> bool:
        """Read-only: whether ``key`` has had a call (:meth:`certified` asked for it), measured or not."""
        return key in self._state

    def keys(self) -> list:
        """Read-only: the keys that have had a call, in the order of their first call (a snapshot: later calls may
        add keys)."""
        with self._ctl._lock:
            return list(self._state)

    def smaller_keys(self, key: tuple, rows_at: int) -> list:
        """Read-only: the keys that have had a call and differ from ``key`` only at position ``rows_at`` (its rows or
        rows bucket), with fewer rows there: the same kind of call on fewer rows."""
        i = rows_at % len(key)
        with self._ctl._lock:
            return [k for k in self._state if len(k) == len(key) and k[i] < key[i]
                    and k[:i] == key[:i] and k[i + 1:] == key[i + 1:]]

    def prefers_full(self, key) -> bool:
        """Read-only: whether the full head is the current choice for ``key``, on samples of both sides (a compiled
        decode, which cannot be timed per step, takes this verdict of the eager steps; hf_csv.transformers.decision)."""
        ctl = self._ctl
        with ctl._lock:
            st = self._state.get(key)
            # both arms past their warm-ups (3 certified, 2 full samples), not only probed
            return (st is not None and st.best == "f" and len(st.win["c"]) >= ctl.warm["a"]
                    and len(st.win["f"]) >= ctl.warm["b"])

    def record(self, key, certified: bool, seconds: float) -> None:
        self._ctl.record(key, "c" if certified else "f", seconds)

    def untimed(self, key) -> None:
        """The certified call just picked for ``key`` was not timed (its head not packed or settled yet, one-off work
        that is no sample of its speed): a waited first try is made again on the next call (:meth:`Controller.retry`;
        before, each such try waited another ``max_probe``, and a batch-1 screen needs 8 rows to settle)."""
        self._ctl.retry(key)

    def summary(self, key) -> Optional[dict]:
        t = self._ctl.times(key)
        if t is None:
            return None
        return {"choice": "certified" if t["best"] == "c" else "full", "certified_ms": 1e3 * t["c"],
                "full_ms": 1e3 * t["f"]}


class ThreadTuner:
    """The certified head's intra-op thread count on CPU (the module docstring says why): per key, the
    caller's count ``T`` or one thread, whichever the recent *mean* says is faster (the mean, not the median:
    under load the many-thread runs are fast most of the time and stall now and then, and the stalls are what
    users wait for). :class:`Controller` with arms 1 (wins a draw) and ``T`` (kept where it beats 0.9 of one
    thread's mean), both warmed up three calls each, interleaved; a probe is three calls in a row.

    This only changes speed, never results: the bounds are rigorous for any summation order, and the callers
    run the exact recompute on the caller's thread count (:func:`caller_threads`). A call that ran stock's full
    head on some row is not recorded (:func:`untimed`).
    ``HF_CSV_HEAD_THREADS``: ``auto`` (default), or a fixed count (``1``, ``2`` …) to disable tuning."""

    def __init__(self, window: int = 6, probe: int = 8, max_probe: int = 64, margin: float = 0.9, batch: int = 4):
        self._ctl = Controller(window, probe, max_probe, margin, stat="mean", warm={"a": 3, "b": 3},
                               alternate=True, batch=batch)

    @staticmethod
    def _fixed() -> Optional[int]:
        v = os.environ.get("HF_CSV_HEAD_THREADS", "auto").strip().lower()
        if v in ("", "auto"):
            return None
        try:
            n = int(v)
        except ValueError:
            raise ValueError(f"HF_CSV_HEAD_THREADS must be 'auto' or a positive integer, got {v!r}") from None
        if n < 1:
            raise ValueError(f"HF_CSV_HEAD_THREADS must be 'auto' or a positive integer, got {v!r}")
        return n

    def _pick(self, key, T: int) -> int:
        return self._ctl.pick(key, 1, T, start=T)

    def _record(self, key, n: int, T: int, dt: float) -> None:
        self._ctl.record(key, n, dt)

    def choice(self, key, threads: Optional[int] = None) -> Optional[int]:
        """The current choice for ``key`` at the caller's thread count ``threads`` (None before any call)."""
        return self._ctl.best(key if threads is None else (key, threads))

    @contextlib.contextmanager
    def __call__(self, key) -> Iterator[int]:
        """Run the block on the chosen thread count ``n`` (yielded), for a caller on ``T`` threads, which
        :func:`caller_threads` inside it restores; both restored on exit, also after an exception."""
        T = torch.get_num_threads()
        fixed = self._fixed()
        tuned = fixed is None and T > 1
        if tuned:
            key = (key, T)  # the caller's count is part of the key: it may change between calls
            n = self._pick(key, T)
        else:
            n = fixed if fixed is not None else T
        prev, prev_untimed = getattr(_CALLER, "n", None), getattr(_CALLER, "untimed", False)
        _CALLER.n, _CALLER.untimed = T, False
        t0 = time.perf_counter()
        try:
            with intra_op_threads(n):
                yield n
            if tuned and not _CALLER.untimed:
                self._record(key, n, T, time.perf_counter() - t0)
        finally:
            _CALLER.n, _CALLER.untimed = prev, prev_untimed
