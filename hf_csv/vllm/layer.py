"""vLLM's ``LogitsProcessor`` with hf_csv's certified head (:class:`CsvLogitsProcessor`, installed by
``hf_csv.vllm.register`` through ``LogitsProcessor.register_oot``), and :func:`prebuild`, which builds its screens
when the model runner has loaded the weights. What it certifies and declines: the package docstring and docs/vllm.md.

Imports vLLM: only ``hf_csv.vllm.register`` (and tests run in vLLM's environment) import this module; the pure steps
of a call live in ``hf_csv.vllm.classify``, ``.guard``, ``.certify`` and ``.shards``."""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Optional

import torch
from vllm.distributed import tensor_model_parallel_all_gather
from vllm.model_executor.layers.logits_processor import LogitsProcessor

from hf_csv.core.certificate import H_MAX, H_MIN, CertifiedHead, fp32_matmul_reason
from hf_csv.core.speed import SpeedGuard
from hf_csv.vllm.certify import certify_batch
from hf_csv.vllm.classify import batch_decline_reason, head_decline_reason, lowering_steps, row_plans
from hf_csv.vllm.counts import count, note_prebuilt, track_guard
from hf_csv.vllm.guard import CERTIFIED, FULL, GUARD_MARGIN, guard_key, pick
from hf_csv.vllm.runner import RUNNER
from hf_csv.vllm.shards import combine_shards, shard_summary
from hf_csv.vllm.subset import SubsetKernel
from hf_csv.vllm.weights import build_head, weight_key, weights_finite

logger = logging.getLogger(__name__)

__all__ = ["CsvLogitsProcessor", "prebuild"]

_UNSEEN = object()
# the reason of a batch whose size's subset-kernel probe runs on it (vLLM's head on that batch is the reference)
_PROBE = "subset kernel probe"


def _max_rows() -> int:
    """Rows above which the plugin does not try the certified head (the speed guard decides below)."""
    return int(os.environ.get("HF_CSV_VLLM_MAX_ROWS", "64"))


def _steps(sampler: Any, sm: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """vLLM's own steps between the head and the sampler (its sampler's method), to run on hf_csv's value bounds for
    the check of lowering steps (``certify_batch``'s ``process``)."""
    def process(x: torch.Tensor) -> torch.Tensor:
        return sampler.apply_logits_processors(x, sm, False)
    return process


class CsvLogitsProcessor(LogitsProcessor):
    """vLLM's ``LogitsProcessor`` with the certified head where a batch allows it (the package docstring); every
    other call is vLLM's own forward, the reason counted (``hf_csv.vllm.counts``)."""

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
        self._hf_csv_subset = SubsetKernel()
        track_guard(self._hf_csv_guard)

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
        weights_finite(self, w)
        if getattr(lm_head, "tp_size", 1) == 1 and hasattr(self, "_apply_head"):
            self._subset_kernel(lm_head, None)
        return True

    def _subset_kernel(self, lm_head, rows: Optional[int]) -> tuple[Callable, Optional[bool]]:
        """vLLM's own GEMM dispatch on a subset of this head's rows, and whether values rows in a batch of ``rows``
        rows may use it (``hf_csv.vllm.subset.SubsetKernel.get``; None: that batch size is not probed yet)."""
        n = self._hf_csv_rows(lm_head)

        def full(H: torch.Tensor) -> torch.Tensor:
            return self._apply_head(lm_head, H, None)[:, :n]
        return self._hf_csv_subset.get(lm_head.weight, n, full, rows)

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
            flags = tensor_model_parallel_all_gather(torch.tensor([[0.0 if why else 1.0]], device=H.device), dim=0)
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
                    count(res.stats.certified, True)
                    if res.stats.fallback:
                        count(res.stats.fallback, False, "near tie")
                    return self._finish_tp(local)
                why = why or ("hidden state out of range" if res is None else "near tie across shards")
        out = self._finish_tp(local_stock())
        if guard is not None and why == "speed guard":
            guard.record(key, False, time.perf_counter() - t0)
        count(rows, False, why)
        return out

    def _finish_tp(self, local: torch.Tensor) -> torch.Tensor:
        """vLLM's own gather of the shards and its cut to the model's vocabulary (its ``_get_logits`` after
        the head)."""
        logits = self._gather_logits(local)
        return logits[..., : self.org_vocab_size] if logits is not None else logits

    def forward(self, lm_head, hidden_states, embedding_bias=None, skip_gather=False):
        got = RUNNER.get()
        if not isinstance(self, CsvLogitsProcessor):
            # vLLM's LoRA wrapper (LogitsProcessorWithLoRA) runs its base layer's class's forward on itself, with
            # the LoRA delta inside its own _get_logits: vLLM's forward, as without the plugin
            if got is not None and hidden_states.dim() == 2:
                count(hidden_states.shape[0], False, "LoRA head")
            return LogitsProcessor.forward(self, lm_head, hidden_states, embedding_bias, skip_gather)
        call = (lm_head, hidden_states, embedding_bias, skip_gather)
        rows = hidden_states.shape[0] if hidden_states.dim() == 2 else -1
        reason = self._call_decline_reason(got, rows, *call)
        if reason is not None:
            return self._vllms_head(call, reason, rows if got is not None else 0)
        runner, sched = got
        sm = runner.input_batch.sampling_metadata
        # asked first, so that a batch the guard sends to vLLM's head costs no classification: the steps run on a
        # cold cache, where every line of Python shows (docs/vllm.md)
        key = guard_key(sm, rows, hidden_states.dtype)
        guard = self._hf_csv_guard if self._hf_csv_guarded else None  # HF_CSV_SPEED_GUARD=0: always try
        tp = getattr(lm_head, "tp_size", 1) > 1
        t0 = time.perf_counter()
        if guard is not None and not tp:
            choice = pick(guard, key, rows)
            if choice != CERTIFIED:
                out = self._vllms_head(call, "speed guard", rows)
                if choice == FULL:  # (a skipped probe is not a sample of either side)
                    guard.record(key, False, time.perf_counter() - t0)
                return out
        # (a pick of the certified head that the checks below decline is not recorded: the guard asks again)
        reason, plans, process, subset = self._classify(lm_head, rows, runner, sched, sm, tp)
        if reason is not None:
            out = self._vllms_head(call, reason, rows)
            if reason == _PROBE:
                # this batch size's first values rows: the probe runs on this batch against vLLM's head on it,
                # which is what this batch returns (stock's time, plus the probe's subset calls)
                self._hf_csv_subset.probe_batch(hidden_states, out, self._hf_csv_rows(lm_head))
            return out
        if tp:
            return self._forward_tp(lm_head, hidden_states, embedding_bias, plans, rows, guard, key)
        return self._forward_certified(call, rows, plans, process, subset, guard, key, t0)

    def _vllms_head(self, call: tuple, why: str, rows: int) -> torch.Tensor:
        """vLLM's own forward on the whole batch; ``rows`` rows (0: none, outside a decode step) counted for
        ``why``."""
        out = LogitsProcessor.forward(self, *call)
        if rows > 0:
            count(rows, False, why)
        return out

    def _call_decline_reason(self, got: Any, rows: int, lm_head, hidden_states, embedding_bias,
                             skip_gather) -> Optional[str]:
        """Why this call takes vLLM's head before its batch is read: the switch, not a decode step, the shape, the
        rows, or the head itself (its configuration, kept per layer, and its weights' finiteness)."""
        if os.environ.get("HF_CSV_VLLM", "1") == "0":
            return "HF_CSV_VLLM=0"
        if got is None or skip_gather:
            return "not a decode step"
        if rows < 1:
            return "hidden states shape"
        if rows > self._hf_csv_max_rows:
            return "batch above HF_CSV_VLLM_MAX_ROWS"
        # the head's own configuration first (constant for a layer, its weights and the activations' dtype and
        # device: kept per layer), so that a head declined whatever the batch is counted under its reason; keyed
        # on the head module itself (the memo holds it: no id of a freed module can come back)
        hk = (lm_head, hidden_states.dtype, hidden_states.device.type, embedding_bias is None,
              fp32_matmul_reason(hidden_states.device))  # (a precision set after the first step is seen)
        reason = self._hf_csv_head_why.get(hk, _UNSEEN)
        if reason is _UNSEEN:
            reason = self._hf_csv_head_why[hk] = head_decline_reason(self, lm_head, hidden_states, embedding_bias)
        if reason is None and not weights_finite(self, lm_head.weight):
            reason = "non-finite head weights"
        return reason

    def _classify(self, lm_head, rows: int, runner: Any, sched: Any, sm: Any, tp: bool) -> tuple:
        """(reason, plans, process, subset) of the batch: why it takes vLLM's head (``_PROBE``: its size's subset
        probe runs on it), else each row's plan, vLLM's lowering steps to check (or None) and the subset kernel
        for values rows (or None)."""
        reason = batch_decline_reason(
            sm, rows, runner.input_batch.num_reqs,
            structured=bool(getattr(sched, "has_structured_output_requests", False)),
            speculative=getattr(runner, "speculative_config", None) is not None,
            prompt_logprobs=bool(getattr(runner, "num_prompt_logprobs", None)))
        if reason is not None:
            return reason, None, None, None
        subset = process = None
        lowering = lowering_steps(sm)
        reason, plans = row_plans(sm, rows, self.org_vocab_size, lowering, values_ok=True)
        if reason is None and not tp and any(p.values for p in plans):
            subset, ok = self._subset_kernel(lm_head, rows)
            if ok is None:
                return _PROBE, None, None, None
            if not ok:
                reason, plans = row_plans(sm, rows, self.org_vocab_size, lowering, values_ok=False)
        if lowering and reason is None:
            if tp:
                reason = "penalties or masks under tensor parallelism"
            else:
                process = _steps(runner.sampler, sm)
        return reason, plans, process, subset

    def _forward_certified(self, call: tuple, rows: int, plans, process, subset, guard: Optional[SpeedGuard],
                           key: tuple, t0: float) -> torch.Tensor:
        """The batch through ``certify_batch`` (vLLM's own head where it declines), the guard told the time."""
        lm_head, hidden_states = call[0], call[1]

        def stock() -> torch.Tensor:  # vLLM's own head on the whole batch (its rows where S is not enough)
            return LogitsProcessor.forward(self, *call).detach()

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
            out = self._vllms_head(call, reason, rows)
            if guard is not None and settled:
                guard.record(key, True, time.perf_counter() - t0)  # a declined try cost both heads
            return out
        if guard is not None and settled:
            # rows that needed vLLM's whole-batch head cost the certified side both heads: the guard sees it;
            # calls before the screen settled (its first packing and column re-choice) are not its speed
            guard.record(key, True, time.perf_counter() - t0)
        count(counts["certified"], True, sampled=counts["sampled"])
        for why, n in counts["reasons"].items():
            count(n, False, why)
        return logits


def prebuild(model: Any) -> int:
    """Build the screens of ``model``'s plugin layers now (each module with a plugin ``logits_processor`` and an
    ``lm_head``, as vLLM's causal-LM classes have); returns how many. A failure is logged and leaves the lazy
    build of the first certified step in place."""
    if model is None:
        return 0
    n = 0
    for mod in model.modules():
        lp, head = getattr(mod, "logits_processor", None), getattr(mod, "lm_head", None)
        if isinstance(lp, CsvLogitsProcessor) and head is not None:
            t0 = time.perf_counter()
            try:
                if lp.prebuild(head):
                    n += 1
                    note_prebuilt()
                    logger.info("hf_csv: certified head built at model load in %.1f s", time.perf_counter() - t0)
            except Exception as e:  # the lazy build at the first step stays; the reason is in the log
                logger.warning("hf_csv: building the certified head at model load failed (%s: %s); it is built at "
                               "the first certified step instead", type(e).__name__, e)
    return n
