"""Stand-ins of vLLM's pieces for the plugin's tests without vLLM (tests/test_vllm_*.py): its builtin logits
processors (recognised by module and name, as the plugin recognises them), its ``SamplingMetadata`` of a step, and a
stock head that rounds otherwise than ``F.linear`` (another engine's kernel)."""
from __future__ import annotations

from types import SimpleNamespace

import torch


class LogitBiasLogitsProcessor:  # the names vLLM's builtin processors have
    def __init__(self, biases=None):
        self.biases = biases or {}


class MinTokensLogitsProcessor:
    def __init__(self, min_toks=None):
        self.min_toks = min_toks or {}


class MinPLogitsProcessor:
    def __init__(self, mins):
        self.min_p_cpu = mins
        self.min_p_count = sum(1 for m in mins if m)


class UserProcessor:
    pass


BUILTIN = "vllm.v1.sample.logits_processor.builtin"
LogitBiasLogitsProcessor.__module__ = MinTokensLogitsProcessor.__module__ = MinPLogitsProcessor.__module__ = BUILTIN


class ImpostorBias:  # a user processor that borrows a builtin's name is not trusted
    def __init__(self):
        self.biases = {}


ImpostorBias.__name__ = "LogitBiasLogitsProcessor"


def batch_sm(**kw):
    """vLLM's ``SamplingMetadata`` of a greedy batch of two requests with idle builtin processors; ``kw``
    changes fields."""
    base = dict(all_greedy=True, all_random=False, max_num_logprobs=None, logprob_token_ids=None, no_penalties=True,
                allowed_token_ids_mask=None, bad_words_token_ids={}, spec_token_ids=[[], []],
                logitsprocs=SimpleNamespace(non_argmax_invariant=[LogitBiasLogitsProcessor(),
                                                                  MinTokensLogitsProcessor()]),
                thinking_budget_state_holder=None)
    base.update(kw)
    return SimpleNamespace(**base)


def rows_sm(temps, top_k=None, top_p=None, generators=None, argmax_invariant=()):
    """The metadata fields ``row_plans`` reads: per-row temperatures (fp32, as vLLM keeps them), top-k, top-p, seeded
    rows (``generators``) and the argmax-invariant processors."""
    return SimpleNamespace(all_greedy=all(t == 0 for t in temps), all_random=all(t > 0 for t in temps),
                           temperature=torch.tensor(temps, dtype=torch.float32),
                           top_k=None if top_k is None else torch.tensor(top_k),
                           top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
                           generators=generators or {},
                           logitsprocs=SimpleNamespace(argmax_invariant=list(argmax_invariant)))


def step_sm(temps, **kw):
    """A decode step's whole metadata: :func:`batch_sm` with :func:`rows_sm`'s rows."""
    rows = rows_sm(temps, **kw)
    sm = batch_sm(all_greedy=rows.all_greedy, all_random=rows.all_random)
    sm.__dict__.update({k: v for k, v in vars(rows).items() if k != "logitsprocs"})
    sm.logitsprocs.argmax_invariant = rows.logitsprocs.argmax_invariant
    return sm


def other_kernel(W: torch.Tensor):
    """A stock head that rounds otherwise than F.linear (fp64 products and sum, rounded once): another engine's
    kernel, bit for bit different from hf_csv's recompute on some entries. Counts its calls and their rows."""
    calls = []

    def stock(H: torch.Tensor) -> torch.Tensor:
        calls.append(H.shape[0])
        return (H.double() @ W.double().T).to(W.dtype)
    return stock, calls
