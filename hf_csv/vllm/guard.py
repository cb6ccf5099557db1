"""The speed guard in vLLM's engine: per batch shape, vLLM's head or the certified head, whichever is measured faster
(:class:`hf_csv.core.speed.SpeedGuard`), asked before the batch's classification so that a batch it sends to vLLM's
head costs no more than the question (docs/vllm.md). No vLLM import.

A draw goes to vLLM's head: the certified head runs where its median is at most vLLM's / ``GUARD_MARGIN``
(docs/benchmarks.md §12, "Serving"). A shape not measured yet starts on vLLM's head (its first calls cost stock's
time plus this decision), and is not tried certified while fewer rows of the same kind keep vLLM's head by more than
``GUARD_CANNOT_WIN``."""
from __future__ import annotations

from typing import Any

import torch

from hf_csv.core.speed import CANNOT_WIN, PRIOR_FULL_ROWS, SpeedGuard

__all__ = ["GUARD_MARGIN", "GUARD_CANNOT_WIN", "CERTIFIED", "FULL", "SKIP", "guard_key", "smaller_keys", "pick"]

GUARD_MARGIN = 1.05  # vLLM's head is kept unless the certified head's median is below its median / 1.05
# a batch size's certified head is not tried while fewer rows of the same kind keep vLLM's head with a certified
# median more than this many times its own (the guard's clear loser: hf_csv.core.speed.CANNOT_WIN)
GUARD_CANNOT_WIN = CANNOT_WIN

# pick's answers: try the certified head; vLLM's head, timed for the guard; vLLM's head, the guard's probe skipped
CERTIFIED, FULL, SKIP = "certified", "full", "skip"


def guard_key(sm: Any, rows: int, dtype: torch.dtype) -> tuple:
    """The guard's key of a step: (kind, rows, dtype, threads), the kind from vLLM's own flags of its
    ``SamplingMetadata`` ``sm`` (``greedy``, ``sample`` or ``mixed``: ``hf_csv.vllm.classify.row_plans`` agrees, a
    row is greedy iff its temperature is below vLLM's epsilon), read without classifying the rows."""
    kinds = "greedy" if sm.all_greedy else "sample" if sm.all_random else "mixed"
    return (kinds, rows, dtype, torch.get_num_threads())


def smaller_keys(guard: SpeedGuard, key: tuple) -> list:
    """The guard's keys of the same kind, dtype and threads as ``key`` (kind, rows, dtype, threads) with fewer rows."""
    return guard.smaller_keys(key, rows_at=1)


def pick(guard: SpeedGuard, key: tuple, rows: int) -> str:
    """Which head this call of ``rows`` rows runs: ``CERTIFIED`` (try it; the caller records its time once the head
    has settled), ``FULL`` (vLLM's head; the caller records its time) or ``SKIP`` (vLLM's head, not a sample of
    either side: a probe of the certified head that cannot win, skipped).

    A new key starts on vLLM's head and tries the certified head once after two of its calls; where fewer rows of the
    same kind already keep vLLM's head, the certified one (whose per-row work grows faster than vLLM's GEMM) waits a
    ``max_probe``, and is not tried at all while they keep it by more than ``GUARD_CANNOT_WIN``: a probe that cannot
    win (one certified sampling call of 32 rows cost a Gemma-3 pass 0.77x of stock's). The smaller keys are listed
    at most once a call, and only where a new key or a probe of a losing certified head asks."""
    smaller = None
    wait = None
    if not guard.has(key):
        smaller = smaller_keys(guard, key)
        wait = rows >= PRIOR_FULL_ROWS or guard.lost(smaller)
    if not guard.certified(key, rows, start_full=True, wait=wait):
        return FULL
    if guard.choice(key) == "f":
        if smaller is None:
            smaller = smaller_keys(guard, key)
        if guard.lost(smaller, by=GUARD_CANNOT_WIN):
            return SKIP
    return CERTIFIED
