"""Bound providers: for hidden states H [N, d], per-token bounds on the logits ℓ = W h + b.

Every provider returns ``(est, upper)`` with ``upper[r, i] >= ℓ_i(h_r)`` for the real-number
logit (soundness, property-tested in tests/test_core_bounds.py) and ``est`` a cheap estimate used
only to pick seed tokens (correctness never depends on it).

* :class:`ScreenProvider` – the certified int8 screen (docs/certificates.md §1.1). This is the one that prunes.
* :class:`ClusterProvider` – the paper's centroid + radius + bias bound from a :class:`VocabIndex`
  (Euclidean, or the sound spherical variant). Sound, but on real heads it opens almost all of V.

This module does not import transformers.
"""
from __future__ import annotations

import logging
import threading
from typing import Optional, Protocol

import torch

from hf_csv_kernels import Int8Rows, get_op, quantize_rows_fp8, quantize_rows_int8, unit_roundoff
from hf_csv_kernels.screen import ScreenState, finish_now, make_outliers, prepare_screen

from hf_csv.core.index import VocabIndex

logger = logging.getLogger(__name__)

__all__ = ["BoundProvider", "ScreenProvider", "ClusterProvider", "make_provider"]


class BoundProvider(Protocol):
    name: str
    vocab_size: int

    def __call__(self, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(est, upper), both float32 [N, V], bias included; upper >= true logits."""


def keeps_state(fn):
    """Decorator for a method that may create or update tensors its object keeps across calls: it runs with
    inference mode off and without autograd. Kept tensors made under a caller's ``torch.inference_mode()`` would be
    inference tensors, which no later call outside it may update in place (a call under ``no_grad`` after one under
    ``inference_mode`` raised); normal tensors can be updated in either mode."""
    return torch.inference_mode(False)(torch.no_grad()(fn))


class ScreenProvider:
    """Certified int8 screen over every token.

    ``num_outliers`` columns of h with the largest magnitude (the "massive activations")
    are kept exact in fp32 (W[:, J] itself) on the CPU fbgemm path. The first call chooses them (or
    ``outlier_cols`` gives them) and they are chosen once more from the largest |h_j| of the first
    ``recalibrate_rows`` rows (a decode step is one row, and one row is a poor sample); given columns are
    re-chosen only with ``recalibrate=True`` (an artifact's, calibrated on a dummy input), and
    :meth:`calibrate` fixes them for good. The bound is sound for *any* choice: a poor choice only makes
    it looser.
    """

    name = "screen"

    @keeps_state
    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, num_outliers: int = 16,
                 outlier_cols: Optional[torch.Tensor] = None, quant: str = "int8", rows: Optional[Int8Rows] = None,
                 background: bool = False, recalibrate: Optional[bool] = None):
        if weight.dim() != 2:
            raise ValueError(f"head weight must be [V, d], got {tuple(weight.shape)}")
        self.vocab_size, self.hidden_size = weight.shape
        self.device = weight.device
        self.bias = None if bias is None else bias.detach().float()
        self._bias_margin = None if bias is None else self.bias.abs() * (2 * unit_roundoff())
        if quant not in ("int8", "fp8"):
            raise ValueError(f"screen quant must be 'int8' or 'fp8' (e4m3), got {quant!r}")
        self.quant = quant
        # fp8 e4m3: decoded exactly inside the Triton screen (any CUDA GPU); weight-only reference on CPU
        # rows: from a saved artifact, error terms already recomputed from this weight (hf_csv.hub.artifact)
        self.rows = rows if rows is not None else (quantize_rows_int8 if quant == "int8" else quantize_rows_fp8)(
            weight.detach())
        if tuple(self.rows.q.shape) != tuple(weight.shape):
            raise ValueError(f"screen rows {tuple(self.rows.q.shape)} do not fit the head {tuple(weight.shape)}")
        self.num_outliers = min(int(num_outliers if outlier_cols is None else outlier_cols.numel()), self.hidden_size)
        self.state = None
        # the state once the first calls' work is over and the native pass served it without a bias: its ``call``
        # is then the whole screen of a call (hf_csv.core.certificate reads it; None: call :meth:`screen`)
        self.steady: Optional[ScreenState] = None
        # the outlier columns are kept exact (W[:, J]; hf_csv_kernels.screen.prepare_screen): a reference, not a copy
        self._weight = weight.detach()
        self.background = background  # pack a large head in a background thread (see ready())
        self._calibrating = threading.Lock()  # concurrent first calls calibrate once
        # columns chosen from the first call are re-chosen once from the first ``recalibrate_rows`` rows
        self.recalibrate_rows = 8
        self.recalibrated = False
        self._recal: Optional[threading.Thread] = None  # the background re-choice (``background`` only)
        self._seen: Optional[torch.Tensor] = None
        self._seen_rows = 0
        # re-choose the columns from the first rows: by default only when none were given; an artifact's columns
        # (calibrated on a dummy input) are a start, re-chosen too (hf_csv.transformers.session passes recalibrate=True)
        self._recalibrate = (outlier_cols is None if recalibrate is None else bool(recalibrate)) and self.num_outliers > 0
        if outlier_cols is not None or self.num_outliers == 0:
            self._prepare(outlier_cols)
            if self._recalibrate:
                self._seen = torch.zeros(self.hidden_size, dtype=torch.float32, device=weight.device)

    def _prepare(self, cols: Optional[torch.Tensor], eager: bool = False) -> None:
        self.state = prepare_screen(self.rows, cols, background=self.background, weight=self._weight, eager=eager)

    def _choose(self, amax: torch.Tensor) -> torch.Tensor:
        return amax.topk(self.num_outliers).indices.sort().values

    @keeps_state
    def warm(self, H: torch.Tensor, eager: bool = False) -> None:
        """Calibrate on ``H`` if this is the first call (starts the packing). Rows are counted towards the
        re-choice of the columns by :meth:`__call__` only (a caller may warm and then call on the same rows).
        ``eager``: :meth:`prepare_now`."""
        if self.state is None:
            with self._calibrating:
                if self.state is None:
                    Hr = H.reshape(-1, self.hidden_size).float()
                    if self._recalibrate:
                        self._seen = torch.zeros(self.hidden_size, dtype=torch.float32, device=Hr.device)
                        self._seen_rows = 0
                    self._prepare(self._choose(Hr.abs().amax(0)) if self.num_outliers else None, eager=eager)
        elif eager:
            finish_now(self.state)

    def _observe(self, H: torch.Tensor) -> None:
        """Until ``recalibrate_rows`` rows have been seen, keep the largest |h_j| per column; then choose the
        columns once more from them."""
        with self._calibrating:
            if self._seen is not None:
                Hr = H.reshape(-1, self.hidden_size)
                torch.maximum(self._seen, Hr.float().abs().amax(0), out=self._seen)
                self._seen_rows += Hr.shape[0]
                self._maybe_recalibrate()

    def _maybe_recalibrate(self) -> None:
        """(Under the lock.) Once enough rows are seen: the columns from all of them, swapped in as one object
        (W[:, J] and the rest-column error terms; no repack). Any choice is sound; one row is often a poor
        sample of where the massive activations are (docs/certificates.md §1.1)."""
        if self._seen_rows < self.recalibrate_rows:
            return
        cols = self._choose(self._seen)
        self._seen = None
        if not torch.equal(cols.to(self.state.outlier_cols.device), self.state.outlier_cols):
            state = self.state

            def build() -> None:
                state.swap_outliers(make_outliers(self.rows, cols, self._weight))
                self.recalibrated = True

            if self.background:
                # off the decode path (a V×k gather of W and float64 terms per row, docs/benchmarks.md §9.10): the
                # calls meanwhile use the columns they have, which are as sound (any choice is); not a daemon, like
                # the packing
                self._recal = threading.Thread(target=build, name="hf_csv-recalibrate")
                self._recal.start()
            else:
                build()

    def prepare_now(self, H: torch.Tensor) -> None:
        """Calibrate on ``H`` and build everything the first calls would build in the background (the exact outlier
        columns, the interleaved codes), now, in the calling thread: an
        engine's load step, before it serves. The later re-choice of the columns from the first real rows still
        follows ``background``. Sound for any ``H``: the columns only make the bound tighter or looser."""
        self.warm(H, eager=True)

    def ready(self) -> bool:
        """False while the int8 rows are still being packed in the background (the screen would wait)."""
        return self.state is not None and self.state.ready.is_set()

    def settled(self) -> bool:
        """Whether the one-off work of the first calls is over: packed, and the columns' re-choice from the first
        ``recalibrate_rows`` rows done (calls before it are slower than the screen's steady state: a speed guard
        must not judge the screen by them)."""
        return self.ready() and self._seen is None and (self._recal is None or not self._recal.is_alive())

    @keeps_state
    def calibrate(self, H: torch.Tensor) -> torch.Tensor:
        """Fix the outlier columns from calibration hidden states (no later recalibration); returns them."""
        H = H.reshape(-1, self.hidden_size).float()
        with self._calibrating:
            self._seen = None
            self.steady = None
            self._prepare(self._choose(H.abs().amax(0)) if self.num_outliers else None)
        return self.state.outlier_cols

    @keeps_state
    def __call__(self, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        est, upper, _ = self.screen(H)
        return est, upper

    @keeps_state
    def screen(self, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(est, upper, top): :meth:`__call__`'s pair and, where the backend finds it in the same pass, each row's
        first largest estimate (int64 [N]; else None). One fused pass on the CPU where hf_csv's kernel serves."""
        self.warm(H)
        if self._seen is not None:
            self._observe(H)
        fused = get_op("screen_bounds", H.device, optional=True)
        res = None if fused is None else fused(self.state, H, self.bias)
        if res is not None:
            if self.bias is None and self.steady is None and self.settled():
                self.steady = self.state  # from now on no warm-up, no re-choice, the same kernel: its call serves
            return res
        est, rad = get_op("screen_int8", H.device)(self.state, H)
        if self.bias is not None:
            est = est.add_(self.bias)
        # rounding of the bias add and of est + rad: 2u(|est| + |b|), with |est - b| <= 2·||Ŵ_i||_1·||h||_∞
        # (|ĥ_j| <= |h_j| + one quantization step), folded into one fused op per term
        upper = torch.add(est, rad).addcmul_(self.rows.l1, H.float().abs().amax(1, keepdim=True) * (4 * unit_roundoff()))
        if self.bias is not None:
            upper.add_(self._bias_margin)
        return est, upper, None


class ClusterProvider:
    """The paper's cluster bound, U_c = <μ_c, h> + R_c ||h|| + max_{i∈c} b_i, expanded per token."""

    name = "cluster"

    def __init__(self, index: VocabIndex, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 check: bool = True):
        if check:
            index.check_head(weight, bias)
        # soundness rests on the live head only: radii, norms and bias maxima recomputed from it (§1.2)
        self.index = index.for_head(weight, bias).to(weight.device)
        self.vocab_size = index.config.vocab_size
        self.spherical = index.config.metric == "spherical"

    @torch.no_grad()
    def cluster_upper(self, H: torch.Tensor) -> torch.Tensor:
        ix = self.index
        nmin, nmax = (ix.norm_min, ix.norm_max) if self.spherical else (None, None)
        bias_max = torch.where(torch.isfinite(ix.bias_max), ix.bias_max, torch.zeros_like(ix.bias_max))
        return get_op("cluster_upper", H.device)(ix.centroids, ix.radius, bias_max, H, nmin, nmax)

    @torch.no_grad()
    def __call__(self, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        Uc = self.cluster_upper(H)
        upper = Uc[:, self.index.assignment]
        return upper, upper


def make_provider(name: str, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  index: Optional[VocabIndex] = None, **kwargs) -> BoundProvider:
    """Provider by name: ``"screen"`` (default, prunes) or ``"cluster"`` (needs ``index``)."""
    if name == "screen":
        return ScreenProvider(weight, bias, **kwargs)
    if name == "cluster":
        if index is None:
            raise ValueError("provider 'cluster' needs an index (a VocabIndex)")
        return ClusterProvider(index, weight, bias)
    raise ValueError(f"unknown bound provider {name!r}; choose 'screen' or 'cluster'")
