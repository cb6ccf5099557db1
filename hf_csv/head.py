"""The head swap: a module that stands in for ``lm_head`` / ``proj_out`` during one ``generate`` call.

Guarantee: while a :class:`CSVSession` is active *in the calling context* for a model, the
model's output head returns dense logits that are exact (fp32 accumulation of the head's own
weights, cast to the model dtype) on a certified sub-vocabulary S and ``-inf`` outside it,
where S is certified for the decoding method in play (docs/processors.md). In every other
context — other threads, other calls, no session — the wrapper calls the original module, so
its output is bitwise the stock output.

* The swap is scoped: :func:`swapped_head` installs the wrapper on entry and puts the original
  module back on exit, also when ``generate`` raises. Concurrent calls on one model are
  reference-counted under a lock, and the session lives in a :mod:`contextvars` variable, so a
  stock ``generate`` running in another thread at the same time is not affected.
* :class:`CertifiedHead` objects (whose int8 screen is the expensive part to build) are cached
  per head module and per config key, so quantization happens once per model.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import nn

from .certificate import CertifiedHead, CertStats
from .config import CSVConfig
from .errors import CSVError

logger = logging.getLogger(__name__)

__all__ = ["CSVSession", "CSVHead", "swapped_head", "get_certified_head", "find_head", "active_session"]

# model id -> session, per context (thread / task). A dict so that an assistant model and the
# main model can both be certified inside one call.
_ACTIVE: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("hf_csv_active", default=None)
_LOCK = threading.RLock()
_SWAPS: dict[int, list] = {}  # id(model) -> [attr name, original module, wrapper, refcount]
_HEADS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


@dataclass
class StepStash:
    """What the last head call saw at the positions whose logits generate uses (last position)."""

    H: torch.Tensor  # [B, d] hidden states (a view, not a copy)
    logits: torch.Tensor  # [B, V] the dense certified logits returned (model dtype, before softcap)
    mask: Optional[torch.Tensor]  # [B, V] bool: certified S (all True on fallback rows)


@dataclass
class CSVSession:
    """State of one certified ``generate`` call on one model."""

    model: nn.Module
    config: CSVConfig
    head: CertifiedHead
    out_dtype: torch.dtype
    softcap: Optional[float] = None
    mode: str = "full"  # full | topk | beam | sample | epsilon (set by generation.decide_mode)
    k: int = 1
    temperature: float = 1.0
    top_k: Optional[int] = None
    verify: bool = False  # a CSVLogitsProcessor must check the certificate after other processors
    reasons: list = field(default_factory=list)
    stats: CertStats = field(default_factory=CertStats)
    head_calls: int = 0
    full_calls: int = 0
    verify_reruns: int = 0
    force_full: Optional[str] = None  # a reason decided before generate started
    processors: Any = None  # the LogitsProcessorList generate built (when known)
    last: Optional[StepStash] = None

    def set_full(self, reason: str) -> None:
        """Use the full head for the rest of this decoding call, and say why (transformers logging)."""
        self.mode = "full"
        self.verify = False
        if reason not in self.reasons:
            self.reasons.append(reason)
            _tlog().info("hf_csv: full LM head for this call: %s", reason)

    def summary(self) -> dict:
        d = self.stats.as_dict() if self.stats.rows else {"rows": 0}
        d.update(mode=self.mode, reasons=list(self.reasons), head_calls=self.head_calls,
                 full_head_calls=self.full_calls, verify_reruns=self.verify_reruns)
        return d


def _tlog():
    from transformers.utils import logging as tlogging

    return tlogging.get_logger("hf_csv")


def active_session(model: nn.Module) -> Optional[CSVSession]:
    act = _ACTIVE.get()
    return None if act is None else act.get(id(model))


def find_head(model: nn.Module) -> tuple[str, nn.Linear]:
    """The attribute name and module of the model's output head (``lm_head`` or ``proj_out``)."""
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(out, CSVHead):
        out = out.inner
    for name in ("lm_head", "proj_out"):
        mod = model._modules.get(name)
        if isinstance(mod, CSVHead):
            mod = mod.inner
        if mod is not None and (out is None or mod is out):
            if not isinstance(mod, nn.Linear):
                raise CSVError(f"{type(model).__name__}.{name} is a {type(mod).__name__}, not nn.Linear; "
                               "hf_csv cannot certify it")
            return name, mod
    raise CSVError(f"{type(model).__name__} has no lm_head/proj_out output head that hf_csv supports")


def get_certified_head(head: nn.Linear, config: CSVConfig) -> CertifiedHead:
    """The cached :class:`CertifiedHead` for this head module and config (built once)."""
    key = config.head_key()
    with _LOCK:
        per = _HEADS.setdefault(head, {})
        ch = per.get(key)
        # the cache is keyed on the module; a changed weight tensor (e.g. reloaded) invalidates it
        if ch is None or ch.weight.data_ptr() != head.weight.data_ptr() or ch.weight.shape != head.weight.shape:
            index = config.index
            if isinstance(index, str) and config.revision is not None:
                from .index import VocabIndex

                index = VocabIndex.from_pretrained(index, revision=config.revision)
            ch = CertifiedHead(head.weight, head.bias, provider=config.provider, index=index,
                               budget=config.budget, **({"num_outliers": config.num_outliers}
                                                        if config.provider == "screen" else {}))
            per[key] = ch
    return ch


class CSVHead(nn.Module):
    """Stands in for the output head; certified only for the session of the calling context."""

    def __init__(self, inner: nn.Linear, model: nn.Module):
        super().__init__()
        self.inner = inner
        self._model_id = id(model)

    # keep attribute access that code may do on the head working (weight/bias/in_features...)
    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return self.inner.bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        act = _ACTIVE.get()
        sess = None if act is None else act.get(self._model_id)
        if sess is None:
            return self.inner(hidden)
        sess.head_calls += 1
        if sess.mode == "full" or hidden.numel() == 0:
            sess.full_calls += 1
            return self.inner(hidden)
        lead, d = hidden.shape[:-1], hidden.shape[-1]
        H = hidden.reshape(-1, d)
        ch = sess.head
        mode = sess.mode
        if mode == "topk":
            res = ch.topk(H, sess.k, out_dtype=sess.out_dtype)
            out = res.logits
        elif mode in ("beam", "epsilon"):
            eps = sess.config.beam_epsilon if mode == "beam" else sess.config.epsilon
            res = ch.epsilon(H, eps, temperature=sess.temperature, out_dtype=sess.out_dtype)
            out = res.logits
        elif mode == "sample":
            res = ch.sample(H, temperature=sess.temperature, top_k=sess.top_k)
            out = _one_hot_logits(res.logits, res.tokens, sess.out_dtype)
        else:  # pragma: no cover - decide_mode only sets the modes above
            raise CSVError(f"unknown hf_csv mode {mode!r}")
        if sess.config.stats:
            sess.stats.merge(res.stats)
        out = out.view(*lead, out.shape[-1])
        if sess.verify:
            # the positions generate reads: the last one of each sequence
            if hidden.dim() == 3:
                L = hidden.shape[1]
                last = torch.arange(L - 1, H.shape[0], L, device=H.device)
                sess.last = StepStash(H=H[last], logits=out[:, -1], mask=res.mask[last])
            else:
                sess.last = StepStash(H=H, logits=out.reshape(-1, out.shape[-1]), mask=res.mask)
        return out


def _one_hot_logits(logits: torch.Tensor, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Logits that make the stock multinomial sampler return ``tokens``: the drawn token keeps its
    exact logit, every other token is -inf. Rows without a draw (tokens == -1, non-finite hidden
    states) keep their full-head logits, which the stock sampler then samples from."""
    N, V = logits.shape
    out = torch.full((N, V), float("-inf"), dtype=dtype, device=logits.device)
    ok = tokens >= 0
    if bool(ok.all()):
        r = torch.arange(N, device=logits.device)
        out[r, tokens] = logits[r, tokens].to(dtype)
    else:
        r = ok.nonzero(as_tuple=True)[0]
        out[r, tokens[r]] = logits[r, tokens[r]].to(dtype)
        bad = (~ok).nonzero(as_tuple=True)[0]
        out[bad] = logits[bad].to(dtype)
    return out


@contextlib.contextmanager
def swapped_head(model: nn.Module, session: CSVSession) -> Iterator[CSVSession]:
    """Activate ``session`` for ``model`` in this context, with the head wrapper installed.

    The original head module is put back when the last concurrent session on the model exits,
    including on exceptions; the context variable is reset in every case.
    """
    name, inner = find_head(model)
    key = id(model)
    with _LOCK:
        entry = _SWAPS.get(key)
        if entry is None:
            wrapper = CSVHead(inner, model)
            entry = [name, inner, wrapper, 0]
            _SWAPS[key] = entry
            setattr(model, name, wrapper)
        entry[3] += 1
    act = dict(_ACTIVE.get() or {})
    act[key] = session
    token = _ACTIVE.set(act)
    try:
        yield session
    finally:
        _ACTIVE.reset(token)
        with _LOCK:
            entry[3] -= 1
            if entry[3] == 0:
                setattr(model, entry[0], entry[1])
                del _SWAPS[key]


def model_out_dtype(model: nn.Module, head: nn.Linear) -> torch.dtype:
    return head.weight.dtype if head.weight.is_floating_point() else torch.float32


def model_softcap(model: nn.Module) -> Optional[float]:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return getattr(text, "final_logit_softcapping", None)
