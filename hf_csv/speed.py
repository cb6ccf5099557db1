"""Never slower than stock: use the full head where it is measured faster than the certified one.

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
top-p warper, whose sort over V costs about a third of SmolLM2's head on this project's CPU). Other processors and
the model body cost the same on both sides and are not timed.

A shape seen for the first time has no measurement yet, so it starts from a prior on the shape: calls of at least
``PRIOR_FULL_ROWS`` rows start on the full head (there stock's GEMM is compute-bound and efficient, while the
certified head's per-row work grows with the rows: one sampling call of 100 rows on SmolLM2 spent 0.55 s in the
certified head against about 0.1 s for the full head), and the certified head is tried once a probe apart; one
faster certified sample switches it over (the first try comes ``max_probe`` calls in). Smaller calls start certified.

Probes cost what they measure, so they are capped: once the full head is the choice, a probe of the certified side is
one call (not a warm-up of three), and where the certified head is clearly slower (more than 1.5×) probes come
100·(certified/full − 1) calls apart, between 128 and 512, as for a clearly slower full head: about 2 % of the time
the certified head loses on a loaded machine (issue 36: 27.1 ms certified against 12.1 ms full on whisper-tiny.en).

On CUDA the guard does not measure: the certified head there is launch- and synchronisation-bound (about 200 kernel
launches and 60 host synchronisations per call) and was slower than stock's cuBLAS head at every shape measured
(docs/benchmarks.md §4), so :func:`cuda_reason` declines the call before any screen is built, with that reason in
the call's stats. Timing an asynchronous device with host clocks would also need a synchronisation per step.

Only heads of at least ``MIN_WEIGHTS`` weights are guarded (tiny heads in tests stay certified), and
``HF_CSV_SPEED_GUARD=0`` turns the guard off (on CUDA too: the certified head then runs, exact and slower).
"""
from __future__ import annotations

import os
import statistics
import threading
from collections import deque
from typing import Optional

__all__ = ["SpeedGuard", "MIN_WEIGHTS", "PRIOR_FULL_ROWS", "cuda_reason"]

MIN_WEIGHTS = 1 << 21
PRIOR_FULL_ROWS = 32  # calls of this many rows start on the full head (module docstring)


def cuda_reason(weight) -> Optional[str]:
    """Why a guarded head on a CUDA device runs the full head (None where the guard does not decide so)."""
    if weight.device.type != "cuda" or weight.numel() < MIN_WEIGHTS or not SpeedGuard.enabled():
        return None
    return ("speed guard: on CUDA the certified head is measured slower than stock's head (docs/benchmarks.md §4); "
            "HF_CSV_SPEED_GUARD=0 runs it anyway")


class SpeedGuard:
    def __init__(self, window: int = 6, probe: int = 16, max_probe: int = 128, margin: float = 0.95,
                 max_clear: int = 512):
        self.window, self.probe0, self.max_probe, self.margin = window, probe, max_probe, margin
        self.max_clear = max_clear
        self._lock = threading.Lock()
        self._state: dict = {}

    @staticmethod
    def enabled() -> bool:
        return os.environ.get("HF_CSV_SPEED_GUARD", "1").strip() not in ("0", "false", "no", "off")

    def certified(self, key, rows: int = 1) -> bool:
        """Whether this call should run the certified head (else the full head); ``rows``: the call's head rows
        (the prior of a shape not measured yet)."""
        with self._lock:
            st = self._state.get(key)
            if st is None:
                prior = "f" if rows >= PRIOR_FULL_ROWS else "c"
                # a large call's first certified try waits max_probe calls: a decode of fewer steps never pays it
                st = self._state[key] = {"c": deque(maxlen=self.window), "f": deque(maxlen=self.window),
                                         "best": prior, "prior": prior, "n": 0, "seen": 0,
                                         "probe": self.probe0 if prior == "c" else self.max_probe}
            st["n"] += 1
            if st["prior"] == "f":
                if len(st["f"]) < 2:
                    return False
                if not st["c"] and st["best"] == "f":  # one certified try a probe apart
                    return st["n"] % st["probe"] == 0
            if len(st["c"]) < 3 and st["best"] == "c":  # (warm-up; a probe of a losing certified head is one call)
                return True
            if len(st["f"]) < 2:
                return False
            if st["n"] % st["probe"] == 0:
                # A probe measures the other side afresh: its old samples may date from a passing load, the
                # screen's background pack or a run of flat rows, and one new sample a probe apart would take
                # several probes (up to max_probe calls each) to outvote them. Emptying its window makes the
                # warm-up branches above run it again (3 certified or 2 full calls in a row).
                other = "f" if st["best"] == "c" else "c"
                st[other].clear()
                return other == "c"
            return st["best"] == "c"

    def prefers_full(self, key) -> bool:
        """Read-only: whether the full head is the current choice for ``key``, on samples of both sides (a compiled
        decode, which cannot be timed per step, takes this verdict of the eager steps; hf_csv.policy)."""
        with self._lock:
            st = self._state.get(key)
            return st is not None and st["best"] == "f" and len(st["c"]) >= 3 and len(st["f"]) >= 2

    def record(self, key, certified: bool, seconds: float) -> None:
        with self._lock:
            st = self._state[key]
            if certified and st["seen"] == 0 and st["prior"] == "c":  # the first certified call may include one-off work
                st["seen"] = 1
                return
            st["c" if certified else "f"].append(seconds)
            if len(st["c"]) >= (1 if "f" in (st["prior"], st["best"]) else 3) and len(st["f"]) >= 2:
                # medians: one slow sample (a first call's one-off work, a GC pause) must not decide for 128+ calls
                # (whisper-tiny.en: certified steps of 8-10 ms and one of 54 ms made a mean twice the full head's)
                c, f = statistics.median(st["c"]), statistics.median(st["f"])
                best = "f" if f < self.margin * c else "c"
                if best == st["best"]:
                    if ("c" if certified else "f") != best:  # a probe confirmed the choice
                        st["probe"] = min(self.max_probe, st["probe"] * 2)
                else:
                    st["best"], st["probe"] = best, self.probe0
                if best == "f" and c > 1.5 * f:
                    # a clear loss: a probe (one certified call after the warm-up) costs c − f; the same ~2 % rule
                    st["probe"] = max(self.max_probe, min(self.max_clear, int(100 * (c / f - 1))))
                if best == "c" and f > 1.5 * c:
                    # a clear win: a probe (two full calls) costs 2(f − c); this interval keeps that near 2 % of the
                    # certified time (measured: Gemma-3's probes every 128 calls cost 0.75 ms a call, 6 %). A slower
                    # certified head needs no probe to be seen: its own samples flip the choice at once
                    st["probe"] = max(self.max_probe, min(self.max_clear, int(100 * (f / c - 1))))

    def summary(self, key) -> Optional[dict]:
        st = self._state.get(key)
        if st is None or not st["c"] or not st["f"]:
            return None
        return {"choice": "certified" if st["best"] == "c" else "full", "certified_ms": 1e3 * statistics.median(st["c"]),
                "full_ms": 1e3 * statistics.median(st["f"])}
