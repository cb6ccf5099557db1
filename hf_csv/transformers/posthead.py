"""What an architecture does to the head's output before ``generate`` sees it (no transformers import).

Some architectures transform the logits after the head, in the model dtype:

* Cohere / Cohere2: ``logits * config.logit_scale``;
* Granite (and GraniteMoe): ``logits / config.logits_scaling``;
* Gemma-2 / Gemma-3 (``final_logit_softcapping``): ``tanh(logits / cap) * cap``.

A certificate proves facts about the head's logits; stock ``generate`` compares the *transformed*
values, rounded in the model dtype, where rounding can merge distinct logits into ties (and ties
go to the lowest index). So every certificate is checked on ``post(x)``: :class:`PostHead.apply`
performs the architecture's own operations, in the same order and dtype, on a tensor of bounds.
Each transform is monotone non-decreasing, which is all the proofs need (docs/certificates.md §3.1).

The registry is an allow-list read from transformers 5.23's modeling code (the listed models' logits code is
unchanged in 5.24). An architecture that is
not listed, or a listed one with a configuration this module does not understand (a non-positive
scale, say), gets ``None``: the caller uses the full head and logs why. :func:`check_output`
is a run-time guard that the model really returned ``post(head output)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["PostHead", "post_head_of", "IDENTITY_TYPES", "check_output"]

# model_type values whose forward returns the head's output unchanged (read from the modeling code;
# each is exercised by tests/test_stack_differential.py, the run-time guard backs the list up)
IDENTITY_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi", "phi3", "gemma", "whisper",
                            "starcoder2", "olmo2", "smollm3"})
_SOFTCAP_TYPES = frozenset({"gemma2", "gemma3_text"})
_SCALE_TYPES = {"cohere": "logit_scale", "cohere2": "logit_scale"}  # logits * value
_DIVIDE_TYPES = {"granite": "logits_scaling", "granitemoe": "logits_scaling"}  # logits / value


@dataclass(frozen=True)
class PostHead:
    """The model's post-head map: ``kind`` is ``identity``, ``scale`` (x * value), ``divide``
    (x / value) or ``softcap`` (tanh(x / value) * value). All are monotone non-decreasing."""

    kind: str = "identity"
    value: float = 1.0

    @property
    def identity(self) -> bool:
        return self.kind == "identity"

    @property
    def keeps_neg_inf(self) -> bool:
        """Whether ``-inf`` stays ``-inf`` (false for softcap, which maps it to ``-cap``)."""
        return self.kind != "softcap"

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The model's own operations, in order, in ``x``'s dtype (bitwise what the model does)."""
        if self.kind == "identity":
            return x
        if self.kind == "scale":
            return x * self.value
        if self.kind == "divide":
            return x / self.value
        x = x / self.value  # softcap: the three ops of the modeling code, each rounded
        x = torch.tanh(x)
        return x * self.value

    def describe(self) -> str:
        return {"identity": "none", "scale": f"logits * {self.value}", "divide": f"logits / {self.value}",
                "softcap": f"tanh(logits / {self.value}) * {self.value}"}[self.kind]


def post_head_of(model: Any) -> tuple[Optional[PostHead], str]:
    """``(PostHead, "")`` for a supported architecture, else ``(None, reason)``."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None, f"{type(model).__name__} has no config: its post-head transform is unknown"
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    mt = getattr(cfg, "model_type", None)
    if mt in IDENTITY_TYPES:
        return PostHead(), ""
    if mt in _SOFTCAP_TYPES:
        cap = getattr(text, "final_logit_softcapping", None)
        if cap is None:
            return PostHead(), ""
        return _positive(mt, "final_logit_softcapping", cap, "softcap")
    if mt in _SCALE_TYPES:
        return _positive(mt, _SCALE_TYPES[mt], getattr(text, _SCALE_TYPES[mt], None), "scale")
    if mt in _DIVIDE_TYPES:
        return _positive(mt, _DIVIDE_TYPES[mt], getattr(text, _DIVIDE_TYPES[mt], None), "divide")
    return None, (f"model_type {mt!r}: hf_csv does not know what this architecture does to the logits after "
                  f"the head (supported: {sorted(IDENTITY_TYPES | _SOFTCAP_TYPES | set(_SCALE_TYPES) | set(_DIVIDE_TYPES))})")


def _positive(mt: str, field: str, v: Any, kind: str) -> tuple[Optional[PostHead], str]:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        return None, f"{mt}: config.{field} = {v!r} is not a positive finite number; only such transforms are proven"
    return PostHead(kind, float(v)), ""


def check_output(post: PostHead, head_out: torch.Tensor, model_logits: torch.Tensor) -> bool:
    """Whether ``model_logits`` is exactly ``post.apply(head_out)`` (identity: the very same storage)."""
    if post.identity:
        return model_logits.untyped_storage().data_ptr() == head_out.untyped_storage().data_ptr()
    if model_logits.shape != head_out.shape:
        return False
    mine = post.apply(head_out)
    if torch.equal(mine, model_logits):
        return True
    # a NaN where the model has one is the same value (a float16 head output that overflowed): stock then decodes
    # (or raises) on those NaNs, and hf_csv must do what stock does rather than blame the model's code
    return bool(((mine == model_logits) | (mine.isnan() & model_logits.isnan())).all())
