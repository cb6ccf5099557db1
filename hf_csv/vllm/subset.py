"""vLLM's own GEMM on a subset of the head's rows, for the rows that hand vLLM's values on a set S to its sampler
(``hf_csv.vllm.classify.RowPlan.values``), and whether those rows may use it (:class:`SubsetKernel`: the probes, per
head weights and per batch size). Imports vLLM (only ``hf_csv.vllm.layer`` imports this module)."""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

from hf_csv.vllm.probe import engine_subset_matches
from hf_csv.vllm.weights import weight_key

logger = logging.getLogger(__name__)

__all__ = ["engine_subset_kernel", "sampler_is_pytorch", "SubsetKernel"]

# vLLM's oneDNN GEMM may round a call with one output column otherwise than its full call (docs/vllm.md): subset
# calls are padded to this many rows of the head (engine_subset_matches checks the padded calls)
_MIN_SUBSET = 16


def engine_subset_kernel(W: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """vLLM's own CPU GEMM dispatch (``dispatch_cpu_unquantized_gemm``) on the rows ``cols`` of ``W``: [N, |cols|].
    Fewer than ``_MIN_SUBSET`` rows are padded with other rows of W, since oneDNN takes another path for one output
    column. Whether it equals vLLM's full call bit for bit is measured (``hf_csv.vllm.probe.engine_subset_matches``),
    not assumed."""
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


def sampler_is_pytorch() -> bool:
    """Whether vLLM's ``apply_top_k_top_p`` takes its PyTorch path (``apply_top_k_top_p_pytorch`` /
    ``apply_top_k_only``), the one ``hf_csv.vllm.sampler.sampler_boundary_unsure`` models: not where vLLM found
    Triton."""
    try:
        from vllm.v1.sample.ops import topk_topp_sampler
    except ImportError:
        return False
    return not getattr(topk_topp_sampler, "HAS_TRITON", True) and hasattr(topk_topp_sampler,
                                                                          "apply_top_k_top_p_pytorch")


class SubsetKernel:
    """One head's subset kernel (:func:`engine_subset_kernel`), rebuilt when its weights change
    (``hf_csv.vllm.weights.weight_key``), and whether values rows may use it: it computes a subset bit for bit as
    vLLM's full call (``engine_subset_matches``, once per weights, at model load where ``hf_csv.vllm.layer.prebuild``
    runs, and once per batch size), and vLLM's top-k / top-p is its PyTorch path (the one
    ``hf_csv.vllm.sampler.sampler_boundary_unsure`` models; a Triton build's kernel is not checked: declined)."""

    def __init__(self) -> None:
        # (weight key, kernel, probe passed, full call, {batch rows: that size's probe passed})
        self._state: Optional[tuple] = None

    def get(self, w: torch.Tensor, n: int, full: Callable[[torch.Tensor], torch.Tensor],
            rows: Optional[int]) -> tuple[Callable, Optional[bool]]:
        """The kernel on the first ``n`` rows of the head weight ``w``, and whether values rows in a batch of
        ``rows`` rows may use it; None: that batch size is not probed yet (:meth:`probe_batch` probes it on a batch
        that takes vLLM's head); ``rows`` None: the head's own probe only. ``full``: vLLM's head on hidden states,
        its first ``n`` columns (the probes' reference, kept with the kernel)."""
        key = weight_key(w, n)
        if self._state is None or self._state[0] != key:
            W = w.detach()[:n]
            kernel = engine_subset_kernel(W)
            with torch.inference_mode(False), torch.no_grad():
                ok = sampler_is_pytorch() and engine_subset_matches(kernel, full, W.shape[1], n, W.dtype)
            if not ok:
                logger.warning("hf_csv: vLLM's kernel computes a subset of this head's rows in another rounding "
                               "than its full call, or its sampler's top-k / top-p is not the PyTorch path: "
                               "seeded sampling, top-p and min-p rows take vLLM's head")
            self._state = (key, kernel, ok, full, {})
        _, kernel, ok, _, by_rows = self._state
        if not ok or rows is None:
            return kernel, ok
        return kernel, by_rows.get(rows)

    def probe_batch(self, H: torch.Tensor, ref: torch.Tensor, n: int) -> bool:
        """The probe for a batch of ``H``'s rows (after :meth:`get` answered None for it), on that batch itself
        against ``ref``, vLLM's own head on it (the logits that batch returns): the same subsets and row slices as a
        probe on synthetic rows, without a full call of its own."""
        rows = H.shape[0]
        _, kernel, _, full, by_rows = self._state
        with torch.inference_mode(False), torch.no_grad():
            by_rows[rows] = engine_subset_matches(kernel, full, H.shape[1], n, H.dtype, H=H.detach(),
                                                ref=ref.detach()[:, :n])
        if not by_rows[rows]:
            logger.warning("hf_csv: vLLM's kernel computes a subset of this head's rows in another rounding "
                           "than its full call in batches of %d rows: their seeded sampling, top-p and "
                           "min-p rows take vLLM's head", rows)
        return by_rows[rows]
