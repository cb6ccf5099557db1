"""The native int8 screen's kernel paths (AVX-512 VNNI, AVX-VNNI, AVX2): each one the host can run gives the same values,
bit for bit — against the int64 reference for the plain GEMV, and against the AVX2 path for the fused screen with its
bounds; the selection falls back past a path that fails and says why. A path this host cannot run is skipped, with
the missing CPU flags as the reason (never reported as tested)."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest
import torch

from hf_csv_kernels import native

RUNNABLE = native.runnable_paths() if native.available() else []

_PROBE = r"""
import json, sys, torch
from hf_csv_kernels import native
path = sys.argv[1]; out = sys.argv[2]
assert native.available(), native.why_unavailable()
assert native.path() == path, (native.path(), path)
g = torch.Generator().manual_seed(3)
res = {}
for V, d in [(103, 70), (64, 32), (1001, 576), (7, 5), (517, 1536)]:
    q = torch.randint(-127, 128, (V, d), generator=g, dtype=torch.int8)
    q[0] = 127; q[1] = -127
    s = torch.rand(V, generator=g)
    qi, mn = native.interleave(q)
    for N in (1, 3):
        A = torch.randint(-127, 128, (N, d), generator=g, dtype=torch.int8)
        A[0, ::2] = -127
        cr = torch.rand(N, generator=g)
        ref = ((A.long() @ q.long().T).float() * s) * cr[:, None]
        for il, qq in ((False, q), (True, qi)):
            for th in (1, 3):
                got = native.screen_i8(qq, s, A, cr, il, threads=th, chunk=8)
                assert torch.equal(got, ref), (V, d, N, il, th, int((got != ref).sum()))
        H = torch.randn(N, d, generator=g)
        cols = torch.randperm(d, generator=g)[: min(4, d)].sort().values
        wJ = native.block8(torch.randn(V, cols.numel(), generator=g))
        terms = [torch.rand(V, generator=g) for _ in range(3)]
        bias = torch.randn(V, generator=g)
        for il, qq in ((False, q), (True, qi)):
            est, up, top = native.screen_bounds(qq, s, il, H, cols, wJ, True, (1.0, 1e-3, 1e-5, 1e-6, 1e-7), terms,
                                                bias, threads=2, chunk=16)
            res[f"{V}x{d}x{N}{'i' if il else 'r'}"] = [est, up, top]
torch.save(res, out)
print(json.dumps({"path": native.path(), "cases": len(res)}))
"""


def _run(path: str, out, **env_extra) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_CSV_SCREEN_PATH=path, **env_extra)
    env.pop("HF_CSV_NATIVE", None)
    return subprocess.run([sys.executable, "-c", _PROBE, path, str(out)], env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("path", native.PATHS)
def test_each_kernel_path_is_exact_and_equals_the_avx2_path(path, tmp_path):
    if path not in RUNNABLE:
        pytest.skip(f"this host cannot run the {path} path (CPU flags: {native._PATH_FLAGS[path][1]}; runnable: "
                    f"{RUNNABLE or native.why_unavailable()})")
    r = _run(path, tmp_path / f"{path}.pt")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["path"] == path
    if path != "avx2":  # the fused screen and its bounds: the same floats on every path
        r2 = _run("avx2", tmp_path / "avx2.pt")
        assert r2.returncode == 0, r2.stderr[-3000:]
        a, b = torch.load(tmp_path / f"{path}.pt"), torch.load(tmp_path / "avx2.pt")
        assert a.keys() == b.keys()
        for k in a:
            for x, y in zip(a[k], b[k]):
                assert torch.equal(x, y), k


@pytest.mark.slow
def test_a_forced_path_the_host_cannot_run_leaves_fbgemm_with_the_reason():
    code = "from hf_csv_kernels import native; import json; print(json.dumps([native.available(), native.why_unavailable()]))"
    for bad, said in (("avx9000", "not one of"),) + tuple((p, "lacks") for p in native.PATHS if p not in RUNNABLE):
        env = dict(os.environ, HF_CSV_SCREEN_PATH=bad)
        env.pop("HF_CSV_NATIVE", None)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        ok, why = json.loads(r.stdout.strip().splitlines()[-1])
        assert ok is False and said in why, (bad, why)


def test_selection_skips_a_path_that_fails_and_logs_why(monkeypatch, caplog):
    """A path whose build or self-test fails is never used: the next one is (here the failure is simulated; the real
    self-test compares every value with an int64 reference at load)."""
    if not RUNNABLE:
        pytest.skip(f"native kernel unavailable: {native.why_unavailable()}")
    real = native.load_path

    def load(name):
        if name == "fake":
            raise RuntimeError("self-test: 3 of 603 screen values differ from the int64 reference")
        return real(name)

    monkeypatch.delenv("HF_CSV_SCREEN_PATH", raising=False)
    monkeypatch.setattr(native, "runnable_paths", lambda: ["fake"] + RUNNABLE)
    monkeypatch.setattr(native, "load_path", load)
    monkeypatch.setattr(native, "_path", None)
    with caplog.at_level("WARNING", logger="hf_csv_kernels.native"):
        lib = native._build()
    assert lib is not None and native._path == RUNNABLE[0]
    assert any("fake path" in r.message and "differ" in r.message for r in caplog.records)


def test_the_self_test_catches_a_wrong_kernel():
    """The load-time self-test fails on a library whose dot products are off by one in one lane."""
    if not RUNNABLE:
        pytest.skip(f"native kernel unavailable: {native.why_unavailable()}")
    lib = native.load_path(RUNNABLE[0])

    class Off:
        def __getattr__(self, k):
            return getattr(lib, k)

        def hf_csv_screen_i8(self, q, s, V, d, A, cr, N, out, *rest):
            lib.hf_csv_screen_i8(q, s, V, d, A, cr, N, out, *rest)
            t = torch.frombuffer((ctypes.c_float * (N * V)).from_address(out), dtype=torch.float32)
            t[V // 2] = torch.nextafter(t[V // 2], torch.tensor(float("inf")))

    with pytest.raises(RuntimeError, match="self-test"):
        native._self_test(Off())
