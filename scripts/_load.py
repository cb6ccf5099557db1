"""``--load N``: N busy CPU processes for the timed part of a benchmark (stock and csv alike).

Each process spins in pure Python (one core each), the way a data loader or another user's job
takes a core. They are started before timing and killed after it, also on errors.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from typing import Iterator

_SPIN = "import os\nos.nice(0)\nwhile True:\n    pass\n"


@contextlib.contextmanager
def cpu_load(n: int) -> Iterator[None]:
    """Keep ``n`` cores busy inside the block (n = 0: nothing)."""
    procs = [subprocess.Popen([sys.executable, "-c", _SPIN], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for _ in range(max(0, int(n)))]
    try:
        if procs:
            time.sleep(0.5)  # let them reach the scheduler's steady state
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def cpu_info() -> dict:
    """The CPU's model name, core count and the SIMD flags hf_csv's kernels look at, to print beside every figure."""
    import platform

    from hf_csv_kernels import native
    model = platform.processor()
    try:
        model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                     model)
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count(), "flags": native.simd_flags()}


def machine_load() -> dict:
    """The 1-minute load average and core count, to record beside the figures."""
    la = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return {"loadavg_1min": la, "cpus": os.cpu_count()}
