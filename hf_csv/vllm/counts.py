"""The plugin's row counts and speed-guard choices, per process (docs/vllm.md, "Install").

Every row the plugin's head computes is counted once: ``certified`` (hf_csv's values or draw) or ``full`` (vLLM's own
row, with the reason). The counts live in the process that runs the head: the engine process, or each of vLLM's
worker processes under tensor parallelism (:func:`worker_stats` through ``LLM.collective_rpc``). No vLLM import."""
from __future__ import annotations

import threading
import weakref
from collections import Counter
from typing import Any, Optional

from hf_csv.core.speed import SpeedGuard

__all__ = ["stats", "reset_stats", "worker_stats", "worker_reset_stats", "guard_summary", "count", "track_guard",
           "note_prebuilt"]

_LOCK = threading.Lock()
_STATS: dict[str, Any] = {"rows": 0, "certified": 0, "sampled": 0, "full": 0, "declined": Counter()}
_PREBUILT = [0]  # heads whose screens were built at model load in this process (not reset)
_GUARDS: "weakref.WeakSet[SpeedGuard]" = weakref.WeakSet()  # this process's plugin layers' speed guards


def stats() -> dict:
    """This process's counts: every row the head computed is ``certified`` (``sampled`` of them: sampling rows
    drawn by hf_csv) or ``full`` (vLLM's own row); ``declined`` counts the reasons of the full rows (one per row);
    ``prebuilt``: screens built at model load (``hf_csv.vllm.layer.prebuild``; not reset by :func:`reset_stats`)."""
    with _LOCK:
        return {"rows": _STATS["rows"], "certified": _STATS["certified"], "sampled": _STATS["sampled"],
                "full": _STATS["full"], "declined": dict(_STATS["declined"]), "prebuilt": _PREBUILT[0]}


def reset_stats() -> None:
    """Zero the row counts (the ``prebuilt`` count stays)."""
    with _LOCK:
        _STATS.update(rows=0, certified=0, sampled=0, full=0, declined=Counter())


def worker_stats(_worker: Any = None) -> dict:
    """:func:`stats` of the worker process it runs in: ``LLM.collective_rpc(worker_stats)`` returns one dict per
    rank (with tensor parallelism the head runs in vLLM's worker processes, not in the caller's)."""
    return stats()


def worker_reset_stats(_worker: Any = None) -> None:
    """:func:`reset_stats` in each worker process (``LLM.collective_rpc(worker_reset_stats)``)."""
    reset_stats()


def count(rows: int, certified: bool, reason: Optional[str] = None, sampled: int = 0) -> None:
    """Count ``rows`` rows as certified (``sampled`` of them drawn by hf_csv) or as vLLM's own for ``reason``."""
    with _LOCK:
        _STATS["rows"] += rows
        _STATS["certified" if certified else "full"] += rows
        _STATS["sampled"] += sampled
        if not certified:
            _STATS["declined"][reason or "unknown"] += rows


def note_prebuilt() -> None:
    """One more screen built at model load."""
    with _LOCK:
        _PREBUILT[0] += 1


def track_guard(guard: SpeedGuard) -> None:
    """Report ``guard``'s choices in :func:`guard_summary` while it lives (held weakly)."""
    _GUARDS.add(guard)


def guard_summary() -> dict:
    """This process's speed-guard choices: per (kind, rows, dtype, threads) key the median time of a certified call
    and of vLLM's head (ms) and the current choice (keys measured on both sides only)."""
    out = {}
    for guard in list(_GUARDS):
        for key in guard.keys():
            summ = guard.summary(key)
            if summ is not None:
                out[str(key)] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in summ.items()}
    return out
