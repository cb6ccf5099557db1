"""The plugin's wrappers of vLLM's model runner (installed by ``hf_csv.vllm.register``; docs/vllm.md, "How it is
wired"): ``execute_model`` makes the step's runner and scheduler output visible to the head while the runner computes
that step's logits (:data:`RUNNER`), and ``load_model`` builds the screens after the weights load and makes the model
instance's ``load_weights`` count its calls (``hf_csv.vllm.weights.weight_key``). No vLLM import: the wrapped
methods are passed in."""
from __future__ import annotations

import contextvars
import functools
import os
from typing import Any, Callable

from hf_csv.vllm.weights import loads_wrapper

__all__ = ["RUNNER", "runner_wrapper", "load_wrapper"]

# (runner, scheduler output) of the execute_model on the stack; None outside it (prompt logprobs, the dummy sampler
# run): the head then takes vLLM's own path
RUNNER: contextvars.ContextVar = contextvars.ContextVar("hf_csv_vllm_runner", default=None)


def runner_wrapper(execute_model: Callable) -> Callable:
    """``execute_model`` with :data:`RUNNER` set to (runner, scheduler output) for the call."""
    @functools.wraps(execute_model)
    def execute_model_with_hf_csv(self, scheduler_output, *args, **kwargs):
        token = RUNNER.set((self, scheduler_output))
        try:
            return execute_model(self, scheduler_output, *args, **kwargs)
        finally:
            RUNNER.reset(token)
    execute_model_with_hf_csv.__hf_csv_wrapped__ = execute_model
    return execute_model_with_hf_csv


def load_wrapper(load_model: Callable, prebuild: Callable[[Any], int]) -> Callable:
    """``load_model`` that then wraps the loaded model instance's ``load_weights`` (later loads write the weights in
    place: :func:`hf_csv.vllm.weights.loads_wrapper`) and, unless ``HF_CSV_VLLM_PREBUILD=0``, calls
    ``prebuild(model)`` (``hf_csv.vllm.layer.prebuild``: the screens, before the engine serves)."""
    @functools.wraps(load_model)
    def load_model_with_hf_csv(self, *args, **kwargs):
        out = load_model(self, *args, **kwargs)
        model = self.get_model() if hasattr(self, "get_model") else getattr(self, "model", None)
        loader = getattr(model, "load_weights", None)
        if callable(loader) and not hasattr(loader, "__hf_csv_wrapped__"):
            model.load_weights = loads_wrapper(loader)  # (this instance: later loads write the weights in place)
        if os.environ.get("HF_CSV_VLLM_PREBUILD", "1") != "0":
            prebuild(getattr(self, "model", None))
        return out
    load_model_with_hf_csv.__hf_csv_wrapped__ = load_model
    return load_model_with_hf_csv
