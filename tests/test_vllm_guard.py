"""hf_csv.vllm.guard without vLLM: the engine's guard setting (a draw to vLLM's head), its key, and the pick for a
new batch size beside smaller ones (the pick inside vLLM's layer: tests/test_vllm_layer.py)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from hf_csv.core.speed import SpeedGuard
from hf_csv.vllm.guard import CERTIFIED, FULL, GUARD_CANNOT_WIN, GUARD_MARGIN, SKIP, guard_key, pick, smaller_keys


def test_the_plugins_guard_gives_a_draw_to_vllms_head():
    """In the engine the guard keeps vLLM's head unless the certified head is clearly faster (GUARD_MARGIN): where
    the two medians are within a few percent (SmolLM2 bf16 at one row, docs/benchmarks.md §12) vLLM's head runs;
    transformers' guard keeps its draw to the certified head."""
    assert GUARD_MARGIN > 1
    for cert_ms, want in ((1.30, "full"), (1.32 / 1.10, "certified")):
        g = SpeedGuard(margin=GUARD_MARGIN)
        for _ in range(300):
            c = g.certified("k")
            g.record("k", c, (cert_ms if c else 1.32) * 1e-3)
        assert g.summary("k")["choice"] == want, (cert_ms, g.summary("k"))
    g = SpeedGuard()  # transformers' setting: the same 2 % goes to the certified head
    for _ in range(300):
        c = g.certified("k")
        g.record("k", c, (1.30 if c else 1.32) * 1e-3)
    assert g.summary("k")["choice"] == "certified"


def test_the_key_is_read_from_vllms_flags():
    threads = torch.get_num_threads()
    for flags, kind in (((True, False), "greedy"), ((False, True), "sample"), ((False, False), "mixed")):
        sm = SimpleNamespace(all_greedy=flags[0], all_random=flags[1])
        assert guard_key(sm, 4, torch.bfloat16) == (kind, 4, torch.bfloat16, threads)


def test_smaller_keys_share_kind_dtype_and_threads():
    g = SpeedGuard()
    f32, bf16 = torch.float32, torch.bfloat16
    keys = [("greedy", 1, f32, 2), ("greedy", 8, f32, 2), ("greedy", 4, bf16, 2), ("sample", 2, f32, 2),
            ("greedy", 2, f32, 1), ("greedy", 16, f32, 2), ("greedy", 4, f32, 2)]
    for k in keys:
        g.certified(k)
    assert smaller_keys(g, ("greedy", 8, f32, 2)) == [("greedy", 1, f32, 2), ("greedy", 4, f32, 2)]
    assert smaller_keys(g, ("greedy", 1, f32, 2)) == []


def test_a_new_key_starts_on_vllms_head_and_a_probe_that_cannot_win_is_skipped():
    """A new key: two calls on vLLM's head, then one certified try. A larger batch of the same kind, while the smaller
    one keeps vLLM's head by more than GUARD_CANNOT_WIN: vLLM's head on every call, its probes skipped (not recorded)."""
    f32 = torch.float32
    g = SpeedGuard(margin=GUARD_MARGIN)
    k1 = ("greedy", 1, f32, 2)
    seq = []
    for _ in range(8):
        p = pick(g, k1, 1)
        seq.append(p)
        if p != SKIP:
            g.record(k1, p == CERTIFIED, 2e-3 if p == CERTIFIED else 1e-3)  # the certified head 2x slower
    assert seq[:3] == [FULL, FULL, CERTIFIED] and set(seq[3:]) == {FULL}
    assert g.lost([k1], by=GUARD_CANNOT_WIN)
    k16 = ("greedy", 16, f32, 2)
    seq = []
    for _ in range(3 * g.max_probe):
        p = pick(g, k16, 16)
        seq.append(p)
        if p == FULL:
            g.record(k16, False, 1e-3)
    assert CERTIFIED not in seq and seq.count(SKIP) == 3  # (one a max_probe)


def test_a_large_new_batch_waits_a_max_probe_for_its_certified_try():
    g = SpeedGuard(margin=GUARD_MARGIN)
    k32 = ("greedy", 32, torch.float32, 2)  # PRIOR_FULL_ROWS rows
    seq = []
    for _ in range(g.max_probe):
        p = pick(g, k32, 32)
        seq.append(p)
        g.record(k32, p == CERTIFIED, 1e-3)
    assert seq == [FULL] * (g.max_probe - 1) + [CERTIFIED]
