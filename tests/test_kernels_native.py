"""hf_csv_kernels.native: hf_csv's own int8 screen kernel. Each path the host can run (AVX-512 VNNI, AVX-VNNI,
AVX2) gives the same values, bit for bit; the selection falls back past a path that fails and says why; the kernel is
exact, its fused bounds round up, its row terms are rigorous, and a head on it is certified from its first call.
A path this host cannot run is skipped, with the missing CPU flags as the reason (never reported as tested)."""
from __future__ import annotations

import ctypes
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import hf_csv_kernels.screen as scr
from hf_csv_kernels import native, quantize_rows_int8
from hf_csv_kernels.quantize import rows_from_codes

from conftest import _certified_greedy, _tiny_llama


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
    W = torch.randn(V, d, generator=g) * torch.logspace(-4, 1, V)[:, None]
    W[2] = 0
    z = native.quantize_i8(W, threads=3)  # the one-pass quantizer and the outlier columns: the same on every path
    wJ, low = native.outlier_cols(W, z["q"], z["scale"], cols, threads=2)
    res[f"{V}x{d}quant"] = [z[k] for k in ("q", "qi", "scale", "err_l2", "l1", "abs_l1")] + [wJ, low]
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


def test_native_row_terms_are_rigorous_and_within_the_artifact_check():
    """hf_csv's one-pass C recompute (float64 sums): every term bounds its exact quantity (checked in exact
    rational arithmetic on a few rows and in float64 on all), and none exceeds the quantizer's stored float32 term
    beyond the artifact check's slack (so a saved screen still loads)."""
    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.why_unavailable()}")
    from fractions import Fraction

    from hf_csv.hub.artifact import _TERM_SLACK

    g = torch.Generator().manual_seed(5)
    W = torch.randn(1234, 77, generator=g) * torch.logspace(-4, 2, 1234)[:, None]
    W[3] = 0
    W[7, 5] = 1e-30  # a tiny entry beside large ones
    r = quantize_rows_int8(W, progress=False)
    r2 = rows_from_codes(W, r.q, r.scale, progress=False)
    assert r2.err_l2 is not r.err_l2
    deq = r.q.double() * r.scale.double()[:, None]
    assert (r2.err_l2.double() >= (W.double() - deq).norm(dim=1)).all()
    assert (r2.l1.double() >= deq.abs().sum(1)).all()
    assert (r2.abs_l1.double() >= W.double().abs().sum(1)).all()
    for k in ("err_l2", "l1", "abs_l1"):
        got, stored = getattr(r2, k), getattr(r, k)
        assert (got <= stored * (1 + _TERM_SLACK) + 1e-30).all(), k
    for i in (0, 3, 7, 500, 1233):  # exact arithmetic: sum of squares below err_l2², sums below the l1 terms
        w = [Fraction(float(x)) for x in W[i]]
        dq = [Fraction(float(r.scale[i])) * int(c) for c in r.q[i]]
        assert sum((a - b) ** 2 for a, b in zip(w, dq)) <= Fraction(float(r2.err_l2[i])) ** 2
        assert sum(abs(b) for b in dq) <= Fraction(float(r2.l1[i]))
        assert sum(abs(a) for a in w) <= Fraction(float(r2.abs_l1[i]))


@pytest.mark.skipif(not native.available(), reason="needs hf_csv's native kernel (x86-64 AVX2 and a C compiler)")
@pytest.mark.parametrize("V,d", [(1001, 77), (1234, 256), (67, 31), (8, 1000), (5, 384), (4, 8)])
def test_one_pass_quantizer_equals_the_torch_path_and_the_recompute(V, d, monkeypatch):
    """hf_csv's C quantizer (a float32 CPU head's default): codes and scales bit for bit those of the torch path
    (round half to even of W/s, ties included), error terms bit for bit those of the C recompute an artifact load runs,
    and the interleaved copy :func:`native.interleave` makes, whatever the threads; a weight that is not finite is
    refused as before."""
    import hf_csv_kernels.quantize as qz

    g = torch.Generator().manual_seed(V * 31 + d)
    W = torch.randn(V, d, generator=g) * torch.logspace(-6, 2, V)[:, None]
    W[min(3, V - 1)] = 0
    W[0, : min(5, d)] = 1e-42  # subnormals beside normal weights
    W[1] = (torch.arange(d) % 20 - 10) + 0.5  # amax 127 (below): s = 1, so W/s at exact halves: ties to even
    W[1, 0] = 127
    W[2] = torch.arange(d) - d / 2  # integers: exact quotients and clamped extremes
    rows = [quantize_rows_int8(W, progress=False)] + [
        qz.Int8Rows(**native.quantize_i8(W, threads=t)) for t in (1, 3)]
    monkeypatch.setattr(qz, "_native_terms_ok", lambda *a: False)
    ref = quantize_rows_int8(W, progress=False)  # the torch path
    monkeypatch.undo()
    assert ref.qi is None and rows[0].qi is not None
    again = rows_from_codes(W, rows[0].q, rows[0].scale, progress=False)  # the C recompute
    for r in rows:
        assert torch.equal(r.q, ref.q) and torch.equal(r.scale, ref.scale)
        for k in ("err_l2", "l1", "abs_l1"):
            assert torch.equal(getattr(r, k), getattr(again, k)), k
            assert (getattr(r, k) <= getattr(ref, k)).all(), k  # float64 sums: no looser than the float32 pass
        assert torch.equal(r.qi, native.interleave(r.q)[0])
    deq = ref.q.double() * ref.scale.double()[:, None]
    assert (rows[0].err_l2.double() >= (W.double() - deq).norm(dim=1)).all()
    bad = W.clone()
    bad[V // 2, d // 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        quantize_rows_int8(bad, progress=False)
    bad[V // 2, d // 2] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        native.quantize_i8(bad, threads=2)


@pytest.mark.skipif(not native.available(), reason="needs hf_csv's native kernel (x86-64 AVX2 and a C compiler)")
def test_exact_outlier_columns_in_one_pass_are_sound_and_equal_the_torch_path(monkeypatch):
    """make_outliers' C pass (W[:, J] and the rows' squared errors on J) gives W[:, J] exactly and a rest-column
    error term that bounds the real one, equal to the torch path's here; and a screen built from the one-pass
    quantizer's rows serves its interleaved copy at once (no background copy)."""
    g = torch.Generator().manual_seed(11)
    V, d = 3001, 384
    W = torch.randn(V, d, generator=g) * torch.logspace(-5, 1, V)[:, None]
    rows = quantize_rows_int8(W, progress=False)
    cols = torch.tensor([0, 5, 383, 100, 17])
    a = scr.make_outliers(rows, cols, W)
    monkeypatch.setattr(scr._native, "available", lambda: False)
    b = scr.make_outliers(rows, cols, W)
    monkeypatch.undo()
    assert torch.equal(a.w, W[:, cols]) and torch.equal(a.w, b.w)
    rest = torch.ones(d, dtype=torch.bool)
    rest[cols] = False
    real = (W.double() - rows.q.double() * rows.scale.double()[:, None])[:, rest].norm(dim=1)
    assert (a.err_rest.double() >= real).all() and (b.err_rest.double() >= real).all()
    assert torch.allclose(a.err_rest, b.err_rest, rtol=1e-6, atol=0)
    started = []
    monkeypatch.setattr(scr, "_interleave", lambda state: started.append(state))
    state = scr.prepare_screen(rows, cols, weight=W)
    assert state.native[0] is rows.qi and state.native[1] and state.ready.is_set() and not started
    est, up, _ = native.screen_bounds(rows.qi, rows.scale, True, W[:2].clone(), cols, state.outliers.w8, True,
                                      (1.0, 1e-3, 1e-5, 1e-6, 1e-7), [rows.err_l2, rows.l1, rows.abs_l1], None)
    est2, up2, _ = native.screen_bounds(rows.q, rows.scale, False, W[:2].clone(), cols, state.outliers.w8, True,
                                        (1.0, 1e-3, 1e-5, 1e-6, 1e-7), [rows.err_l2, rows.l1, rows.abs_l1], None)
    assert torch.equal(est, est2) and torch.equal(up, up2)


@pytest.mark.skipif(not native.available(), reason="needs hf_csv's native kernel (x86-64 AVX2 and a C compiler)")
def test_native_kernel_certifies_the_first_call_and_serves_calls_of_several_rows(monkeypatch):
    """With the native kernel a head is certified from its first step (no prepack to wait for), and calls of several
    rows stay on it: fbgemm's pack is never built (its per-row activation scales bound rows of different
    magnitudes tighter than fbgemm's one scale per call; docs/benchmarks.md §9.12). fbgemm's path, where the native
    kernel does not serve, is as sound."""
    import hf_csv

    packs = []
    real_pack = scr._pack
    monkeypatch.setattr(scr, "_pack", lambda q, s: packs.append(1) or real_pack(q, s))
    m, ids = _tiny_llama()
    ref = m.generate(ids, max_new_tokens=6, do_sample=False)
    hf_csv.enable(m)
    try:
        st = _certified_greedy(m, ids, ref)
        assert st["full_head_calls"] == 0 and st["certified"] == 6
        assert not any("still being packed" in r for r in st["reasons"])
        from hf_csv.transformers.heads import find_head, get_certified_head

        ch = get_certified_head(find_head(m)[1], hf_csv.CSVConfig())
        state = ch.provider.state
        assert state.native is not None and packs == []
        W = find_head(m)[1].weight
        H = torch.randn(3, W.shape[1]) * 3
        e0, r0 = scr.screen_int8_cpu(state, H)  # native, three rows
        assert scr.screen_bounds_cpu(state, H) is not None  # the fused native pass serves several rows too
        assert packs == [] and state.packed is None
        fb = scr.prepare_screen(state.rows, state.outlier_cols, native=False)  # fbgemm's path
        e1, r1 = scr.screen_int8_cpu(fb, H)
        ex = H.double() @ W.double().T
        for e, r in ((e0, r0), (e1, r1)):
            assert ((ex - e.double()).abs() <= r.double()).all()
        assert not torch.equal(e0, e1)  # two different kernels ran
    finally:
        hf_csv.disable(m)


@pytest.mark.slow
def test_native_kernel_builds_into_an_empty_cache_and_can_be_turned_off(tmp_path):
    """A fresh machine: the library is compiled into $HF_CSV_KERNEL_CACHE on first use and loaded from there;
    HF_CSV_NATIVE=0 turns it off with the reason (the screen then uses fbgemm)."""
    import os
    import shutil
    import subprocess
    import sys

    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.why_unavailable()}")
    code = ("from hf_csv_kernels import native; import json; "
            "print(json.dumps([native.available(), native.why_unavailable()]))")
    env = dict(os.environ, HF_CSV_KERNEL_CACHE=str(tmp_path / "k"))
    env.pop("HF_CSV_NATIVE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("[true, null]"), out.stdout
    assert len(list((tmp_path / "k").glob(f"screen_{native.path()}-*.so"))) == 1
    env["HF_CSV_NATIVE"] = "0"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "HF_CSV_NATIVE=0" in out.stdout and "false" in out.stdout
    shutil.rmtree(tmp_path / "k")


def test_native_kernel_is_exact_and_refuses_code_minus_128():
    """The kernel's integer dot products are exact (bit for bit against int64 arithmetic and the same float
    steps), in both layouts, for any thread count, with tails in V and d; a −128 code keeps fbgemm."""
    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.why_unavailable()}")
    g = torch.Generator().manual_seed(3)
    for V, d in [(103, 70), (64, 32), (1001, 576), (7, 5)]:
        q = torch.randint(-127, 128, (V, d), generator=g, dtype=torch.int8)
        s = torch.rand(V, generator=g)
        qi, mn = native.interleave(q)
        assert mn == int(q.min()) and native.min_code(q) == int(q.min())
        for N in (1, 3):
            A = torch.randint(-127, 128, (N, d), generator=g, dtype=torch.int8)
            cr = torch.rand(N, generator=g)
            ref = ((A.long() @ q.long().T).float() * s) * cr[:, None]
            for il, qq in ((False, q), (True, qi)):
                for th in (1, 3):
                    assert torch.equal(native.screen_i8(qq, s, A, cr, il, threads=th, chunk=8), ref), (V, d, N, il)
    q = torch.randint(-127, 128, (40, 64), generator=g, dtype=torch.int8)
    W = q.float() * 0.01
    rows = quantize_rows_int8(W, progress=False)
    assert scr.prepare_screen(rows).native is not None
    rows.q[3, 7] = -128  # a foreign code (from a file, say): the sign trick would overflow on it
    st_ = scr.prepare_screen(rows)
    assert st_.native is None and st_.packed is not None


def test_native_fused_bounds_round_up_and_match_the_plain_kernel():
    """The fused call from the hidden states: est is the plain kernel's value on the same int8 activations plus
    the outlier dot and the bias (within the float rounding the proof allows), top is the first largest est,
    and upper is never below the real sum est + Σ c_t·terms_t (+ c_3·|b|), checked in rational arithmetic on
    every lane (vector body and scalar tail), with and without outlier columns, bias and a third term, for 1 and 3
    rows and 1 and 3 threads. (Rounded to nearest without the final step up, about half the lanes fall short.)"""
    from fractions import Fraction

    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.why_unavailable()}")
    g = torch.Generator().manual_seed(5)
    F = lambda x: Fraction(float(x))  # noqa: E731
    for V, d, k, with_bias, three in [(103, 70, 4, True, True), (1001, 64, 0, False, False), (29, 33, 9, False, True)]:
        q = torch.randint(-127, 128, (V, d), generator=g, dtype=torch.int8)
        s = torch.rand(V, generator=g) * 1e-2
        cols = torch.randperm(d, generator=g)[:k].sort().values
        wJ = torch.randn(V, k, generator=g)
        bias = torch.randn(V, generator=g) * 10 if with_bias else None
        terms = [torch.rand(V, generator=g) * 3 for _ in range(3 if three else 2)]
        K = (1.0 + 1e-6, 0.004, 1e-5, 1e-6, 1e-7)
        for N in (1, 3):
            H = torch.randn(N, d, generator=g)
            H[:, cols] *= 50  # massive activations on the outlier columns
            rest = H.clone()
            rest[:, cols] = 0
            m = rest.abs().amax(1, keepdim=True)
            A = (rest / m).mul_(127.0).round_().to(torch.int8)
            plain = native.screen_i8(q, s, A, (m / 127.0).view(-1).contiguous(), False, threads=1)
            for th in (1, 3):
                for rest_norm in (True, False):
                    est, up, top = native.screen_bounds(q, s, False, H, cols, native.block8(wJ), rest_norm, K, terms,
                                                        bias, threads=th, chunk=16)
                    ref = plain.double() + H[:, cols].double() @ wJ.double().T + (0 if bias is None else bias.double())
                    tol = 1e-5 * (plain.double().abs() + H[:, cols].double().abs() @ wJ.double().abs().T + 1)
                    assert ((est.double() - ref).abs() <= tol).all()
                    assert torch.equal(top, est.argmax(1))
                    for r in range(N):
                        hinf = F(H[r].abs().max())
                        norm = math.sqrt(sum(F(x) ** 2 for x in (rest[r] if rest_norm else H[r])))
                        c = [F(norm) * F(K[0]), F(m[r, 0]) * F(K[1]) + hinf * F(K[2]), hinf * F(K[3]), F(K[4])]
                        for i in range(V):
                            real = F(est[r, i]) + sum(c[t] * F(terms[t][i]) for t in range(len(terms)))
                            if bias is not None:
                                real += c[3] * abs(F(bias[i]))
                            # the norm: float64 within 1e-12 of the real one, the kernel's own raised by 1e-10
                            assert F(up[r, i]) >= real, (V, r, i)


@pytest.mark.skipif(not native.available(), reason="needs hf_csv's native kernel (x86-64 AVX2 and a C compiler)")
def test_top1_names_its_result():
    """native.top1 returns a Top1Result: the candidates by name (n = the sum of counts, rows/toks/acc/ent of length n,
    S in mask, the values on S in logits, per row (t, bound, slack, radius sum) in out), and on a negative code (a row
    over the limit) the code alone."""
    from hf_csv_kernels import gamma

    g = torch.Generator().manual_seed(3)
    V, d, N = 300, 24, 2
    W = torch.randn(V, d, generator=g)
    H = torch.randn(N, d, generator=g)
    real = H.double() @ W.double().T
    upper = (real + 0.5 + real.abs() * 1e-3).float()  # >= every real logit, with room
    abs_l1 = W.abs().sum(1) * (1 + 1e-6)
    cst = native.top1_constants(gamma(d + 2), (d + 2) * 2.0 ** -149, float(abs_l1.max()) * (1 + 1e-6), 0.0)
    seeds = real.argmax(1)
    got = native.top1(W, H, upper, seeds, abs_l1, cst, V)
    assert isinstance(got, native.Top1Result) and got.n > 0
    assert got.n == int(got.counts.sum()) == got.rows.numel() == got.toks.numel() == got.acc.numel() == got.ent.numel()
    assert torch.equal(got.mask.sum(1), got.counts) and torch.equal(torch.isfinite(got.logits), got.mask)
    assert torch.equal(got.logits.argmax(1), real.argmax(1)) and got.out.shape == (N, 4)
    assert torch.equal(got.logits[got.rows, got.toks], got.acc)  # float32 head: the values are the accumulators
    declined = native.top1(W, H, upper + 1e6, seeds, abs_l1, cst, 2)  # every token a candidate: over the limit
    assert declined.n < 0 and declined.logits is None and declined.counts is None
