"""Intra-op thread counts for the certified head on CPU: the mechanics (the choice, by measurement, is
:class:`hf_csv.speed.ThreadTuner`'s, one setting of hf_csv's one speed controller).

Why: a certified head call is one int8 GEMV plus a handful of V-wide passes, each a fork/join of
torch's OpenMP pool. When another process holds a core, every join can wait for a scheduler time
slice, and the many short parallel regions cost more than the work (measured: Qwen-0.5B head,
2 threads, one busy process beside it: 28 ms mean against 15 ms on one thread; docs/benchmarks.md).
Stock's single large GEMV barely notices. So the head times itself on the caller's thread count and
on one thread and keeps the faster, re-probing the other now and then, because load comes and goes
(hf_csv.speed.ThreadTuner).

This only changes speed, never results: the bounds are rigorous for any summation order, and the
callers run the exact recompute on the caller's thread count (:func:`caller_threads`).
``torch.set_num_threads`` sets the calling thread's OpenMP count (and MKL's, process-wide) for the
duration of the call; concurrent calls in other threads may run their BLAS on one thread meanwhile.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

__all__ = ["calls_on", "caller_threads", "intra_op_threads", "rows_bucket"]

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


@contextlib.contextmanager
def calls_on(n: int, caller: int) -> Iterator[None]:
    """Run the block on ``n`` intra-op threads for a caller that runs on ``caller`` (what :func:`caller_threads`
    inside it restores); both restored on exit, also after an exception. The choice of ``n`` is
    :class:`hf_csv.speed.ThreadTuner`'s."""
    prev = getattr(_CALLER, "n", None)
    _CALLER.n = caller
    try:
        with intra_op_threads(n):
            yield
    finally:
        _CALLER.n = prev
