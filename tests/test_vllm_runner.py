"""hf_csv.vllm.runner without vLLM: the wrappers of the model runner's ``execute_model`` (the step visible to the
head, also after an error) and ``load_model`` (the model's ``load_weights`` counted once, the screens prebuilt)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_csv.vllm.runner import RUNNER, load_wrapper, runner_wrapper
from hf_csv.vllm.weights import weight_key


def test_the_step_is_visible_to_the_head_during_execute_model_only():
    seen = []

    def execute_model(self, scheduler_output, fail=False):
        seen.append(RUNNER.get())
        if fail:
            raise RuntimeError("step failed")
        return "out"

    wrapped = runner_wrapper(execute_model)
    assert wrapped.__hf_csv_wrapped__ is execute_model and wrapped.__name__ == "execute_model"
    runner, sched = object(), object()
    assert RUNNER.get() is None
    assert wrapped(runner, sched) == "out" and seen == [(runner, sched)]
    assert RUNNER.get() is None
    with pytest.raises(RuntimeError):
        wrapped(runner, sched, fail=True)
    assert RUNNER.get() is None


@pytest.mark.parametrize("prebuild_env", ["1", "0"])
def test_load_model_wraps_load_weights_once_and_prebuilds(monkeypatch, prebuild_env):
    monkeypatch.setenv("HF_CSV_VLLM_PREBUILD", prebuild_env)
    model = SimpleNamespace(load_weights=lambda weights: None)
    built = []

    class Runner:
        def load_model(self):
            self.model = model

    load_model = load_wrapper(Runner.load_model, built.append)
    runner = Runner()
    load_model(runner)
    assert built == ([model] if prebuild_env == "1" else [])
    wrapped = model.load_weights
    assert hasattr(wrapped, "__hf_csv_wrapped__")
    load_model(runner)  # (a second load: the model's loader is not wrapped twice)
    assert model.load_weights is wrapped
    w = torch.randn(4, 3)
    key = weight_key(w, 4)
    model.load_weights([])  # a reload writes the weights in place: the key changes
    assert weight_key(w, 4) != key
