"""hf_csv_kernels.dispatch: the one place an op's implementation is chosen by device (``HF_CSV_KERNELS`` forces a
backend; a backend without the op gets the reference)."""
import pytest
import torch

from hf_csv_kernels import dispatch
from hf_csv_kernels.gather import gather_gemv_reference


def test_dispatch_picks_triton_only_on_cuda(monkeypatch):
    T = pytest.importorskip("hf_csv_kernels.triton_ops")
    from hf_csv_kernels import dispatch
    monkeypatch.delenv("HF_CSV_KERNELS", raising=False)
    assert dispatch.backend_for("cpu") == "cpu"
    monkeypatch.setenv("HF_CSV_KERNELS", "triton")
    assert dispatch.get_op("gather_gemv", "cpu") is T.gather_gemv
    monkeypatch.setenv("HF_CSV_KERNELS", "reference")
    assert dispatch.get_op("screen_int8", "cpu").__name__ == "screen_int8_reference"
    monkeypatch.setenv("HF_CSV_KERNELS", "bogus")
    with pytest.raises(ValueError):
        dispatch.backend_for("cpu")


def test_a_backend_without_the_op_gets_the_reference(monkeypatch):
    monkeypatch.delenv("HF_CSV_KERNELS", raising=False)
    assert dispatch.backend_for(torch.device("meta")) == "reference"
    assert dispatch.get_op("gather_gemv", "cpu") is gather_gemv_reference  # no cpu gather: the reference
    monkeypatch.setitem(dispatch._REGISTRY, "toy", {})
    ref, fast = (lambda: "reference"), (lambda: "cpu")
    dispatch.register("toy", "reference", ref)
    assert dispatch.get_op("toy", "cpu") is ref
    dispatch.register("toy", "cpu", fast)
    assert dispatch.get_op("toy", "cpu") is fast and dispatch.get_op("toy", "meta") is ref
    assert {"cpu", "reference"} <= set(dispatch.available_backends("toy"))


def test_unknown_ops_and_ops_without_any_implementation(monkeypatch):
    monkeypatch.setenv("HF_CSV_KERNELS", "reference")
    with pytest.raises(KeyError, match="unknown op"):
        dispatch.get_op("no_such_op", "cpu")
    # top1 has only the native kernel: optional callers get None, the others a clear error
    assert dispatch.get_op("top1", "cpu", optional=True) is None
    with pytest.raises(KeyError, match="no reference"):
        dispatch.get_op("top1", "cpu")
