"""hf_csv_kernels.screen: fbgemm's chunked packs give the same screen and consolidate to one; a head packed in the
background runs the full head until it is ready."""
import threading

import pytest
import torch

import hf_csv_kernels.screen as scr
from hf_csv_kernels import quantize_rows_int8
from conftest import _certified_greedy, _tiny_llama


@pytest.mark.skipif(not scr.fbgemm_available(), reason="needs fbgemm")
def test_chunked_packs_give_the_same_screen_and_swap_to_one(monkeypatch):
    g = torch.Generator().manual_seed(1)
    W = torch.randn(1000, 48, generator=g)
    H = torch.randn(3, 48, generator=g)
    H[:, 5] *= 200  # a massive activation, kept exact as an outlier column
    rows = quantize_rows_int8(W, progress=False)
    cols = torch.tensor([5])
    whole = scr.prepare_screen(rows, cols, native=False)  # fbgemm's packs (the native kernel needs none)
    assert len(whole.packed) == 1
    monkeypatch.setattr(scr, "_PACK_ROWS", 96)
    started = []
    real_thread = threading.Thread

    def spy(*a, **k):
        t = real_thread(*a, **k)
        started.append(t)
        return t

    monkeypatch.setattr(scr.threading, "Thread", spy)
    chunked = scr.prepare_screen(rows, cols, native=False)
    e1, r1 = scr.screen_int8_cpu(whole, H)
    for t in started:
        t.join()
    assert len(chunked.packed) == 1  # consolidated in the background
    nocons = scr.prepare_screen(rows, cols, consolidate=False, native=False)
    assert len(nocons.packed) == 11
    e2, r2 = scr.screen_int8_cpu(nocons, H)
    assert torch.equal(e1, e2) and torch.equal(r1, r2)
    ex = H.double() @ W.double().T
    assert ((ex - e2.double()).abs() <= r2.double()).all()


@pytest.mark.skipif(not scr.fbgemm_available(), reason="needs fbgemm")
def test_background_packing_uses_the_full_head_until_ready(monkeypatch):
    """A large head is packed in the background; until then the certified head says not ready and
    generate's head wrapper uses the full head (exact); a direct call waits instead."""
    import hf_csv

    monkeypatch.setattr(scr, "_PACK_ROWS", 64)
    gate = threading.Event()
    real_pack = scr._pack

    def slow_pack(q, s):
        gate.wait(30)
        return real_pack(q, s)

    monkeypatch.setattr(scr, "_pack", slow_pack)
    monkeypatch.setattr(scr, "_use_native", lambda rows: False)  # fbgemm's path (the native kernel needs no pack)
    m, ids = _tiny_llama()
    ref = m.generate(ids, max_new_tokens=6, do_sample=False)
    hf_csv.enable(m)
    try:
        st = _certified_greedy(m, ids, ref)
        assert st["full_head_calls"] == st["head_calls"] == 6 and st["rows"] == 0
        assert any("still being packed" in r for r in st["reasons"])
        gate.set()
        from hf_csv.transformers.heads import find_head, get_certified_head

        ch = get_certified_head(find_head(m)[1], hf_csv.CSVConfig())
        ch.provider.state.ready.wait(30)
        st = _certified_greedy(m, ids, ref)
        assert st["full_head_calls"] == 0 and st["certified"] == 6
    finally:
        gate.set()
        hf_csv.disable(m)
