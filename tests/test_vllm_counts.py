"""hf_csv.vllm.counts without vLLM: the process's row counts and the speed guards' summary."""
from __future__ import annotations

import gc

from hf_csv.core.speed import SpeedGuard
from hf_csv.vllm import counts


def test_stats_count_and_reset():
    counts.reset_stats()
    counts.count(3, True)
    counts.count(2, False, "logprobs")
    counts.count(1, True, sampled=1)
    prebuilt = counts.stats()["prebuilt"]
    assert counts.stats() == {"rows": 6, "certified": 4, "sampled": 1, "full": 2, "declined": {"logprobs": 2},
                              "prebuilt": prebuilt}
    assert counts.worker_stats(object()) == counts.stats()  # (collective_rpc passes the worker)
    counts.note_prebuilt()
    counts.worker_reset_stats()
    assert counts.stats()["rows"] == 0 and counts.stats()["prebuilt"] == prebuilt + 1  # (not reset)


def test_the_package_exports_the_counts():
    import hf_csv.vllm

    for name in ("stats", "reset_stats", "worker_stats", "worker_reset_stats", "guard_summary"):
        assert getattr(hf_csv.vllm, name) is getattr(counts, name)


def test_guard_summary_lists_tracked_guards_measured_on_both_sides_while_they_live():
    g = SpeedGuard(margin=1.05)
    counts.track_guard(g)
    key = ("greedy", 3, "float32", 2)
    for _ in range(20):
        c = g.certified(key)
        g.record(key, c, 1e-3 if c else 2e-3)
    g.certified(("greedy", 5, "float32", 2))  # (one side only: not listed)
    got = counts.guard_summary()
    assert got[str(key)] == {"choice": "certified", "certified_ms": 1.0, "full_ms": 2.0}
    assert str(("greedy", 5, "float32", 2)) not in got
    del g
    gc.collect()
    assert str(key) not in counts.guard_summary()
