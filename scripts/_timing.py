"""The benchmark scripts' one timing helper: the median wall time of repeated calls."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def median_ms(fn: Callable[[], object], reps: int) -> float:
    """Median over ``reps`` calls of ``fn``, in milliseconds (the median: one preempted call must not decide)."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)
