"""What a step asks of the head, read from vLLM's own metadata: why a head (:func:`head_decline_reason`) or a batch
(:func:`batch_decline_reason`) needs vLLM's full head, whether steps between the head and the sampler lower entries
(:func:`lowering_steps`), and each row's plan (:func:`row_plans`, :class:`RowPlan`). The classification reads only
the step's metadata (no logits), so every tensor-parallel rank reaches the same verdict. No vLLM import: vLLM's
classes are recognised by module and name (docs/vllm.md, "What is exact, what is declined")."""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from hf_csv.core.certificate import fp32_matmul_reason
from hf_csv.vllm.probe import ENGINE_PROBE_ROWS

__all__ = ["batch_decline_reason", "lowering_steps", "head_decline_reason", "RowPlan", "GREEDY", "row_plans"]

_BUILTIN_MODULE = "vllm.v1.sample.logits_processor.builtin"
_BUILTIN_NON_INVARIANT = {"LogitBiasLogitsProcessor": "biases", "MinTokensLogitsProcessor": "min_toks"}
_SAMPLING_EPS = 1e-5  # vLLM's: a row with temperature below it is greedy


def batch_decline_reason(sm: Any, rows: int, num_reqs: int, structured: bool = False,
                         speculative: bool = False, prompt_logprobs: bool = False) -> Optional[str]:
    """Why the batch as a whole needs vLLM's full head (logprobs, or a step between the head and the sampler that
    may raise an entry), or None; steps that only lower entries are :func:`lowering_steps`', the rows' own
    parameters :func:`row_plans`'. ``sm``: vLLM's ``SamplingMetadata`` of the step; ``rows``: the head's rows, which
    must be the batch's requests, one each (prompt-logprob and spec-decode calls are not)."""
    if speculative or any(getattr(sm, "spec_token_ids", None) or ()):
        return "speculative decoding"
    if prompt_logprobs:
        return "prompt logprobs"
    if rows != num_reqs:
        return "rows are not the batch's requests"
    if sm.max_num_logprobs is not None or sm.logprob_token_ids:
        return "logprobs"
    if not sm.no_penalties and (bool((sm.repetition_penalties < 1).any()) or bool((sm.frequency_penalties < 0).any())
                                or bool((sm.presence_penalties < 0).any())):
        return "penalties that raise entries"
    for proc in sm.logitsprocs.non_argmax_invariant:
        # vLLM's own builtins (checked by module too: a user class of the same name is not trusted), idle when empty
        builtin = type(proc).__module__ == _BUILTIN_MODULE
        field = _BUILTIN_NON_INVARIANT.get(type(proc).__name__) if builtin else None
        if field is None:
            return f"logits processor {type(proc).__name__}"
        if field == "biases" and getattr(proc, field, None):
            return "logit bias"
    holder = getattr(sm, "thinking_budget_state_holder", None)
    if holder is not None and holder.has_tracked_requests():
        return "thinking budget"
    if structured:
        return "structured outputs"
    return None


def lowering_steps(sm: Any) -> bool:
    """Whether a step between the head and the sampler changes entries of this batch, every such step only
    lowering them (after :func:`batch_decline_reason` passed): penalties with repetition >= 1, frequency and presence
    >= 0 (fp32 x/p or x·p, then minus non-negative terms: each entry's map is non-decreasing and never above the
    identity), allowed token ids, bad words, and ``min_tokens`` still active (each sets entries to −inf). A greedy
    row then keeps its certificate if its winner, processed at the bottom of its slack, stays above every other
    token's processed top and the bound outside S (docs/certificates.md §3.2, §2.0: ``hf_csv.core.checks``)."""
    if not sm.no_penalties or sm.allowed_token_ids_mask is not None or sm.bad_words_token_ids:
        return True
    for proc in sm.logitsprocs.non_argmax_invariant:
        if type(proc).__name__ == "MinTokensLogitsProcessor" and getattr(proc, "min_toks", None):
            return True
    return False


def head_decline_reason(layer: Any, lm_head: Any, hidden_states: torch.Tensor,
                        embedding_bias: Optional[torch.Tensor]) -> Optional[str]:
    """Why this head cannot be certified at all (its configuration, not the batch), or None."""
    if layer.logits_as_input:
        return "logits as input"
    if getattr(lm_head, "tp_size", 1) != 1:
        idx = getattr(lm_head, "shard_indices", None)
        if idx is None or idx.num_added_elements:
            return "tensor parallel head layout"
    if type(getattr(lm_head, "quant_method", None)).__name__ not in ("UnquantizedEmbeddingMethod",
                                                                    "UnquantizedLinearMethod"):
        return "quantized head"
    if layer.soft_cap is not None or layer.scale != 1.0:
        return "soft cap or logit scale"
    if embedding_bias is not None:
        return "embedding bias"
    if layer.head_dtype is not None and layer.head_dtype != hidden_states.dtype:
        return "head dtype"
    if hidden_states.device.type != "cpu":
        return "not a CPU tensor"
    w = getattr(lm_head, "weight", None)
    if w is None or w.dim() != 2 or w.dtype != hidden_states.dtype:
        return "head weight"
    if w.dtype in (torch.float32, torch.float16) and fp32_matmul_reason(hidden_states.device) is not None:
        # torch's reduced fp32 matmul precision (or oneDNN's bf16 passes) leaves the γ bound (certificates §2.0):
        # vLLM's fp32 head itself, or hf_csv's fp32 GEMMs on fp16 values
        return "reduced fp32 matmul precision"
    return None


class RowPlan(NamedTuple):
    """What one row asks of the head: ``temperature`` 0 is greedy (certified argmax); otherwise one draw from
    softmax(top-k(logits / temperature)) (``top_k`` None: no top-k), drawn by hf_csv, or, with ``values``, by vLLM's
    own sampler from stock's padded row: vLLM's values on a set that holds stock's top-k, −inf elsewhere (a seeded
    row: the same token for the same seed). ``top_p`` < 1 and ``min_p`` > 0 (``values`` rows only) act on that row
    as on stock's where :func:`hf_csv.vllm.sampler.sampler_boundary_unsure` finds no token at their boundaries.
    ``temperature`` is vLLM's fp32 value."""
    temperature: float
    top_k: Optional[int] = None
    values: bool = False
    top_p: float = 1.0
    min_p: float = 0.0


GREEDY = RowPlan(0.0)


def row_plans(sm: Any, rows: int, vocab_size: int, lowering: bool = False, values_ok: bool = False
              ) -> tuple[Optional[str], Optional[list[RowPlan]]]:
    """Each row's plan, or ``(reason, None)`` when a row needs vLLM's whole row (then the whole batch takes its
    head: a GEMM over fewer rows may round differently). An unseeded sampling row without top-p or min-p is drawn
    by hf_csv; a seeded one, or one with top-p or min-p, needs stock's padded row after its top-k, so a top-k
    (below V) and ``values_ok`` (vLLM's kernel computes a subset of the head's rows bit for bit as its full call:
    :func:`hf_csv.vllm.probe.engine_subset_matches`); without them the batch declines. No user logits processor may
    act on sampling rows (vLLM runs argmax-invariant ones on them). ``lowering``: steps of :func:`lowering_steps` act
    on the batch; only greedy rows are certified through them."""
    if sm.all_greedy:
        return None, [GREEDY] * rows
    if lowering:
        return "penalties or masks with sampling rows", None
    temps = sm.temperature.tolist()
    top_k = sm.top_k.tolist() if sm.top_k is not None else None
    top_p = sm.top_p.tolist() if sm.top_p is not None else None
    min_p = None
    for proc in sm.logitsprocs.argmax_invariant:
        if type(proc).__module__ == _BUILTIN_MODULE and type(proc).__name__ == "MinPLogitsProcessor":
            if getattr(proc, "min_p_count", 0):
                min_p = proc.min_p_cpu
        else:
            return f"logits processor {type(proc).__name__}", None
    plans = []
    for i in range(rows):
        t = float(temps[i])
        if t < _SAMPLING_EPS:
            plans.append(GREEDY)
            continue
        k = int(top_k[i]) if top_k is not None else vocab_size
        k = k if 0 < k < vocab_size else None
        why = ("seeded sampling rows" if i in sm.generators else "top-p" if top_p is not None and top_p[i] < 1.0
               else "min-p" if min_p is not None and min_p[i] > 0 else None)
        if why is None:
            plans.append(RowPlan(t, k))
        elif k is None:
            return f"{why} without top-k", None
        elif rows > ENGINE_PROBE_ROWS:  # the subset kernel's probe tries batches up to ENGINE_PROBE_ROWS rows
            return f"{why} in a batch above {ENGINE_PROBE_ROWS} rows", None
        elif not values_ok:
            return f"{why}: vLLM's kernel rounds a subset of the head otherwise", None
        else:
            plans.append(RowPlan(t, k, True, float(top_p[i]) if top_p is not None else 1.0,
                                 float(min_p[i]) if min_p is not None else 0.0))
    return None, plans
