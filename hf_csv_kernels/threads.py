"""Intra-op thread count for the certified head on CPU, chosen by measurement.

Why: a certified head call is one int8 GEMV plus a handful of V-wide passes, each a fork/join of
torch's OpenMP pool. When another process holds a core, every join can wait for a scheduler time
slice, and the many short parallel regions cost more than the work (measured: Qwen-0.5B head,
2 threads, one busy process beside it: 28 ms mean against 15 ms on one thread; docs/benchmarks.md).
Stock's single large GEMV barely notices. So the head times itself on the caller's thread count and
on one thread and keeps the faster, re-probing the other now and then, because load comes and goes.

This only changes speed, never results: the bounds are rigorous for any summation order, and the
callers run the exact recompute on the caller's thread count (:func:`caller_threads`).
``torch.set_num_threads`` sets the calling thread's OpenMP count (and MKL's, process-wide) for the
duration of the call; concurrent calls in other threads may run their BLAS on one thread meanwhile.

``HF_CSV_HEAD_THREADS``: ``auto`` (default), or a fixed count (``1``, ``2`` …) to disable tuning.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
from collections import deque
from typing import Iterator, Optional

import torch

__all__ = ["ThreadTuner", "caller_threads", "intra_op_threads", "rows_bucket"]

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


class ThreadTuner:
    """Per key (e.g. method and batch rows): run on ``torch.get_num_threads()`` threads or on one,
    whichever the recent *mean* says is faster (the mean, not the median: under load the many-thread
    runs are fast most of the time and stall now and then, and the stalls are what users wait for).
    The caller's count must beat one thread by ``margin`` to be kept. Probes the other count every
    ``probe`` calls (doubling up to ``max_probe`` while the choice holds), with three fresh calls in a row
    that replace its window, so a choice made under a passing load is undone at the next probe.
    Thread-safe bookkeeping."""

    def __init__(self, window: int = 6, probe: int = 8, max_probe: int = 64, margin: float = 0.9):
        self.window, self.probe0, self.max_probe, self.margin = window, probe, max_probe, margin
        self._lock = threading.Lock()
        self._state: dict = {}

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
        with self._lock:
            st = self._state.get(key)
            if st is None:
                st = self._state[key] = {"t": {T: deque(maxlen=self.window), 1: deque(maxlen=self.window)},
                                         "best": T, "n": 0, "probe": self.probe0}
            st["n"] += 1
            times = st["t"]
            short = [a for a in (T, 1) if len(times[a]) < 3]
            if short:  # warm up both counts, alternating
                return short[0] if len(times[T]) == len(times[1]) else min((T, 1), key=lambda a: len(times[a]))
            if st["n"] % st["probe"] == 0:
                # A probe starts the other count's window afresh: its old samples may date from a load or a
                # background pack long gone, and one fresh sample a probe apart would take several probes (up
                # to max_probe calls each) to outvote them. The warm-up branch above then runs it three
                # times in a row, and the comparison is between recent means on both sides.
                other = 1 if st["best"] == T else T
                times[other].clear()
                return other
            return st["best"]

    def _record(self, key, n: int, T: int, dt: float) -> None:
        with self._lock:
            st = self._state[key]
            st["t"][n].append(dt)
            if all(len(st["t"][a]) >= 3 for a in (T, 1)):
                best = T if statistics.fmean(st["t"][T]) < self.margin * statistics.fmean(st["t"][1]) else 1
                if best == st["best"]:
                    st["probe"] = min(self.max_probe, st["probe"] * 2) if n != best else st["probe"]
                else:
                    st["best"], st["probe"] = best, self.probe0

    def choice(self, key, threads: Optional[int] = None) -> Optional[int]:
        """The current choice for ``key`` at the caller's thread count ``threads`` (None before any call)."""
        st = self._state.get(key if threads is None else (key, threads))
        return None if st is None else st["best"]

    @contextlib.contextmanager
    def __call__(self, key) -> Iterator[int]:
        """Run the block on the chosen thread count; yields it."""
        T = torch.get_num_threads()
        fixed = self._fixed()
        tuned = fixed is None and T > 1
        if tuned:
            key = (key, T)  # the caller's count is part of the key: it may change between calls
            n = self._pick(key, T)
        else:
            n = fixed if fixed is not None else T
        prev = getattr(_CALLER, "n", None)
        _CALLER.n = T
        t0 = time.perf_counter()
        try:
            with intra_op_threads(n):
                yield n
        finally:
            _CALLER.n = prev
        if tuned:
            self._record(key, n, T, time.perf_counter() - t0)
