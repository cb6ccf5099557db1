"""hf_csv.vllm.weights without vLLM: the certified head from an artifact, the weights' finiteness checked once per
weights, and the weight key that a reload through ``load_weights`` changes."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hf_csv.vllm.certify import certify_batch
from hf_csv.vllm.classify import GREEDY
from hf_csv.vllm.weights import build_head, loads_wrapper, weight_key, weights_finite


def test_head_from_an_artifact_skips_quantization_and_refuses_another_head(tmp_path, monkeypatch):
    from hf_csv.core.errors import CSVError
    from hf_csv.hub.artifact import CSVArtifact

    g = torch.Generator().manual_seed(5)
    W = torch.randn(2000, 32, generator=g) * 0.1
    CSVArtifact.build(W).save_pretrained(tmp_path / "art")
    import hf_csv.core.bounds as bounds

    called = []
    real = bounds.quantize_rows_int8
    monkeypatch.setattr(bounds, "quantize_rows_int8", lambda *a, **k: called.append(1) or real(*a, **k))
    build_head(W)  # (the probe sees a quantization)
    assert called
    called.clear()
    head = build_head(W, str(tmp_path / "art"))
    H = torch.randn(4, 32, generator=g) * 3
    head.ready(H)
    logits, counts, reason = certify_batch(head, H, [GREEDY] * 4, lambda: F.linear(H, W))
    assert not called and logits is not None
    assert torch.equal(logits.argmax(1), F.linear(H, W).argmax(1))
    with pytest.raises(CSVError):
        build_head(W * 1.5, str(tmp_path / "art"))


def test_the_heads_weights_are_checked_once_per_weights():
    """The plugin's finiteness check: vLLM's head for a head with a NaN weight; rechecked after an in-place
    write (the weight key), not on every step."""
    layer = SimpleNamespace()
    w = torch.randn(50, 8)
    assert weights_finite(layer, w)
    first = layer._hf_csv_finite
    assert weights_finite(layer, w) and layer._hf_csv_finite is first  # (cached)
    w[3, 3] = float("nan")  # an in-place write: a new version
    assert not weights_finite(layer, w)


def test_the_weight_key_changes_with_an_in_place_write_and_a_counted_load():
    """vLLM's ``reload_weights`` writes the same storage through ``.data`` (no version bump): a call of the model's
    wrapped ``load_weights`` is what changes the key, also after a failed load."""
    w = torch.randn(10, 4)
    key = weight_key(w, 10)
    assert weight_key(w, 10) == key and weight_key(w, 8) != key
    w.data[0, 0] = 1.0  # through .data: not seen
    assert weight_key(w, 10) == key
    w[0, 0] = 2.0  # an in-place write: a new version
    key = weight_key(w, 10)

    def failing(*a):
        raise ValueError("bad checkpoint")
    load = loads_wrapper(failing)
    with pytest.raises(ValueError):
        load()
    assert weight_key(w, 10) != key
    with torch.inference_mode():
        inf = torch.randn(3, 2)
    assert weight_key(inf, 3)[4] is None  # an inference tensor has no version counter
