"""Certificates: exact results from bounds plus an exact recompute on a small sub-vocabulary.

Given sound upper bounds U_i >= ℓ_i (from a :mod:`hf_csv.core.bounds` provider), every method
computes ℓ exactly (fp32 accumulation of the head's own weights) only on a candidate set S
and proves that tokens outside S cannot change the result (proofs: docs/certificates.md):

* :meth:`CertifiedHead.topk` – the top-k set and values equal the full head's;
* :meth:`CertifiedHead.epsilon` – the returned distribution is within TV <= ε of softmax(ℓ/T);
* :meth:`CertifiedHead.sample` – an exact draw from softmax(ℓ/T) (lazy Gumbel-max);
* over the budget, or for non-finite hidden states, the row falls back to the full head (counted).

Everything is vectorized over the batch and the vocabulary; there is no Python loop over
tokens or clusters. This module does not import transformers.
"""
from __future__ import annotations

import functools
import math
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from hf_csv_kernels import gamma, get_op
from hf_csv_kernels.native import top1_constants
from hf_csv.core.speculative import GUMBEL_SHIFT_FROM, gumbel_noise, gumbel_shift, row_max_finite

from hf_csv.core.bounds import BoundProvider, keeps_state, make_provider
from hf_csv.core.config import DEFAULT_BUDGET
from hf_csv.core.index import VocabIndex
from hf_csv.core.speed import ThreadTuner, caller_threads, rows_bucket, untimed

logger = logging.getLogger(__name__)

__all__ = ["CertStats", "CertResult", "CertifiedHead", "H_MIN", "H_MAX", "StockFn", "SubsetFn", "value_interval"]

# another engine's own head: hidden states [N, d] in the weight dtype -> its logits [N, V] in that dtype, for every
# row of the call (its GEMM over fewer rows may round differently, so the core never asks for a subset)
StockFn = Callable[[torch.Tensor], torch.Tensor]
# that engine's kernel on a subset of the head's rows: (hidden states [N, d] in the weight dtype, sorted token ids
# [m]) -> [N, m] in the weight dtype
SubsetFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# The range of ||h||_∞ a certified row needs (rows outside it, NaN and inf rows too, get the full head): within it
# no step of the screen underflows (its activation step m/127 stays a normal float32) or overflows, and stock's
# products are covered by the absolute underflow term of stock_error. Real hidden states sit near 1-100.
H_MIN = 2.0 ** -64
H_MAX = 2.0 ** 64


@dataclass
class CertStats:
    """Per-call statistics; ``merge`` accumulates them over a generation."""

    rows: int = 0
    certified: int = 0
    fallback: int = 0
    nonfinite: int = 0
    out_of_range: int = 0  # finite rows with ||h||_∞ = 0 or outside [H_MIN, H_MAX]: the full head (stock's row)
    subvocab_sum: int = 0
    subvocab_sizes: list = field(default_factory=list)
    near_ties: int = 0
    # in-range rows of a call that also held a non-finite or out-of-range row: stock's rows of that call's full head
    beside_bad: int = 0
    native: int = 0  # certified rows whose epilogue ran in the native one-row kernel (own_values; speed only)
    tv_bound_max: float = 0.0
    radius_sum: float = 0.0
    vocab_size: int = 0
    collect_radius: bool = True

    def merge(self, other: "CertStats") -> "CertStats":
        for f in ("rows", "certified", "fallback", "nonfinite", "out_of_range", "subvocab_sum", "near_ties", "beside_bad",
                  "native"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.subvocab_sizes.extend(other.subvocab_sizes)
        self.tv_bound_max = max(self.tv_bound_max, other.tv_bound_max)
        self.radius_sum += other.radius_sum
        self.vocab_size = other.vocab_size or self.vocab_size
        return self

    def uncertify(self, sizes: list) -> int:
        """Rows counted certified, with these set sizes |S|, that end on stock's row: fallbacks now, and their sizes
        leave the certified rows' (``mean_subvocab_fraction`` is over certified rows). Returns how many moved."""
        n = min(len(sizes), self.certified)
        self.certified -= n
        self.fallback += n
        for size in sizes[:n]:
            self.subvocab_sum -= size
            if size in self.subvocab_sizes:  # (equal sizes are interchangeable: the multiset stays exact)
                self.subvocab_sizes.remove(size)
        return n

    @property
    def certified_fraction(self) -> float:
        return self.certified / self.rows if self.rows else 0.0

    @property
    def mean_subvocab_fraction(self) -> float:
        """Mean |S|/V over certified rows (fallback rows read all of V and are counted apart)."""
        return self.subvocab_sum / (self.certified * self.vocab_size) if self.certified and self.vocab_size else 0.0

    def as_dict(self) -> dict:
        return {"rows": self.rows, "certified": self.certified, "fallback": self.fallback,
                "nonfinite": self.nonfinite, "out_of_range": self.out_of_range, "certified_fraction": self.certified_fraction,
                "mean_subvocab_fraction": self.mean_subvocab_fraction, "near_ties": self.near_ties,
                "beside_bad": self.beside_bad,
                "native_rows": self.native,
                "tv_bound_max": self.tv_bound_max,
                "mean_bound_radius": self.radius_sum / self.subvocab_sum if self.subvocab_sum else 0.0}


@dataclass
class CertResult:
    """Dense logits [N, V] (exact on S, −inf outside) or sampled tokens, plus stats."""

    logits: Optional[torch.Tensor]
    stats: CertStats
    tokens: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None  # bool [N, V]: the certified sub-vocabulary (all True on fallback)
    est: Optional[torch.Tensor] = None  # [N, V] the provider's estimate (top-k only; not a bound)
    # [N] fp32: every token outside S has a stock logit (in the value dtype, before any post-head
    # transform) <= bound; -inf where the row holds the full head (top-k only)
    bound: Optional[torch.Tensor] = None
    # sample (lazy Gumbel) only: the Gumbel noise [N, V] and the cut [N]: every i ∉ S has
    # law_i + noise_i < cut (law: stock's final value before any lowering processor); -inf on complete rows
    noise: Optional[torch.Tensor] = None
    cut: Optional[torch.Tensor] = None
    # ... and the shift m [N] the draw subtracts first: the token is argmax fl(fl(law_i - m) + noise_i), and the cut
    # is in those shifted units (hf_csv.core.speculative.gumbel_shift; 0 on rows of ordinary magnitude)
    shift: Optional[torch.Tensor] = None
    # spec only: [N, V] fp32, an upper bound on stock's fp32 logit of every token (used off S)
    upper: Optional[torch.Tensor] = None
    # sample(with_conf=True) only: [N] the drawn token's probability, exact with a top-k warp, else with the
    # normalizer estimated from the provider's estimate off S (a heuristic for an assistant's confidence stop)
    conf: Optional[torch.Tensor] = None
    # [N] fp32: every returned value on S comes from an fp32 accumulator within ``slack`` of stock's (then rounded to
    # the value dtype as stock rounds); 0 on rows that are stock's own (docs/certificates.md §2.0, "Values on S")
    slack: Optional[torch.Tensor] = None
    # (rows, tokens, fp32 accumulators) of the values computed from a column subset (top-k only; rows with slack 0
    # hold stock's own values and have no entry): see :func:`value_interval`
    acc: Optional[tuple] = None

    def acc_dense(self) -> torch.Tensor:
        """[N, V] fp32: our accumulator on gathered entries, the returned value elsewhere (stock's own rows, -inf)."""
        return _acc_dense(self.logits, *(self.acc if self.acc is not None else (None, None, None)))


class CertifiedHead:
    """An LM head ℓ = W h + b computed on a certified sub-vocabulary.

    What "exact" means here (proofs: docs/certificates.md): every certificate is proven against
    the head *as stock computes it*, ``F.linear(h, W, b)`` in the weight dtype, whatever order its
    kernel accumulates in: the bounds carry the worst-case fp32 accumulation error of that GEMM
    (E = γ_{d+2}(max_i ||W_i||_1·||h||_∞ + max|b|)) and, in bf16/fp16, the rounding to that dtype.
    The logits returned on S come from the same op on the union of the candidate columns, which a
    BLAS may round otherwise than its full call (MKL does, per instruction set): they are not assumed
    to be stock's. Each carries a slack bounding its distance from stock's accumulator, every
    decision (an argmax, a draw, a processed top-k) is proven within it, and a row the slack leaves
    open takes stock's whole row (counted in ``near_ties``; docs/certificates.md §2.0). Callers that
    hand the values themselves to stock's code need them bit for bit: :meth:`subset_exact` (a probe,
    not a proof) gates those.

    Args:
        weight: head weight [V, d] (any float dtype; never copied).
        bias: optional [V].
        provider: ``"screen"`` (default), ``"cluster"``, or a provider object.
        index: a :class:`VocabIndex` (or directory) for the cluster provider.
        budget: max |S| before falling back to the full head: an int, or a fraction of V.
        tune_threads: on CPU, time each call on the caller's thread count and on one and keep the faster
            (:class:`~hf_csv.core.speed.ThreadTuner`); False runs on the caller's count (an engine that owns
            the thread count, as vLLM's CPU worker does).
    """

    @keeps_state
    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 provider: Union[str, BoundProvider] = "screen", index: Union[VocabIndex, str, None] = None,
                 budget: Union[int, float] = DEFAULT_BUDGET, tune_threads: bool = True, **provider_kwargs):
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"head weight must be a floating [V, d] tensor, got {tuple(weight.shape)} {weight.dtype}")
        self.weight = weight.detach()
        self.bias_native = None if bias is None else bias.detach()  # for the stock op, in its own dtype
        self.bias = None if bias is None else bias.detach().float()
        self.vocab_size, self.hidden_size = weight.shape
        if isinstance(index, (str, os.PathLike)):
            from hf_csv.hub.artifact import CSVArtifact

            index = CSVArtifact.from_pretrained(index).index
        if isinstance(provider, str):
            provider = make_provider(provider, self.weight, self.bias, index=index, **provider_kwargs)
        self.provider = provider
        if isinstance(budget, float) and not (0 < budget <= 1):
            raise ValueError(f"budget as a fraction must be in (0, 1], got {budget}")
        self.budget = max(1, math.ceil(budget * self.vocab_size)) if isinstance(budget, float) else int(budget)
        if self.budget < 1:
            raise ValueError(f"budget must allow at least one candidate, got {budget}")
        self._gather = get_op("gather_gemv", weight.device)
        self._gam = gamma(self.hidden_size + 2)
        self._underflow = (self.hidden_size + 2) * 2.0 ** -149  # a normal float32 (d < 2**100)
        # ||W_i||_1 (rounded up) for the recompute's accumulation margin: the screen's (>= ||W_i||_1, from this
        # weight), else chunked to avoid an fp32 copy
        rows = getattr(provider, "rows", None)
        self._abs_l1 = (rows.abs_l1 if rows is not None and tuple(rows.q.shape) == tuple(weight.shape) else
                        torch.cat([c.float().abs().sum(1) for c in self.weight.split(16384)])) * (1 + 1e-6)
        # stock's GEMM errs by at most γ·(max ||W_i||_1·||h||_∞ + max |b_i|) on any token (scalar per row)
        self._l1_max = float(self._abs_l1.max()) * (1 + 1e-6)
        self._b_max = float(self.bias.abs().max()) * (1 + 1e-6) if self.bias is not None else 0.0
        # rows with more candidates than this are recomputed with the dense GEMM, then masked
        self._dense_cutoff = max(1, int(self.vocab_size * DEFAULT_BUDGET))
        # CPU: the caller's thread count or one, whichever is faster now (robust under load; speed only)
        self._tuner = ThreadTuner() if weight.device.type == "cpu" and tune_threads else None
        self._subset_probe: dict = {}  # (MKL settings, threads) -> kernel name or None: see subset_kernel
        self._gather_probe: dict = {}  # (capacity, rows, setting) -> bool: see graph_gather_exact
        # the top-1 epilogue (dispatch op "top1", the native kernel) serves float32 and bfloat16 CPU heads without a
        # bias, one row or several
        serves = (weight.dtype in (torch.float32, torch.bfloat16) and weight.device.type == "cpu" and bias is None
                  and self.weight.is_contiguous())
        # resolved once: the kernel's entry (None where it is not built or HF_CSV_KERNELS=reference at build time)
        self._top1 = get_op("top1", weight.device, optional=True) if serves else None
        self._top1_cst = (top1_constants(self._gam, self._underflow, self._l1_max, self._b_max)
                          if self._top1 is not None else None)

    # ------------------------------------------------- the value assumption
    def subset_exact(self) -> bool:
        """Whether a kernel of this process computed every column subset probed bit for bit as the full call does
        (``F.linear`` on gathered rows of W, else on the aligned blocks of 8, 16, 32 or 64 rows that hold them, the
        smallest that matches, against the full
        ``F.linear``). Paths that hand the values on S to stock's own sampler, verify or score outputs need that
        property, which no proof gives (docs/certificates.md §2.0): where no kernel matches, those paths use the
        full head; greedy decisions and hf_csv's own draws never need it (they are decided within the values' slack).
        Probed once per head and per setting (:func:`subset_probe_key`: ``MKL_ENABLE_INSTRUCTIONS`` / ``MKL_CBWR``,
        thread count, fp32 matmul precision) and row count: subsets of 1 to 257 columns (random, the tail, a block),
        1, 3 and 16 rows and the call's own row count, against the full call. The kernel found is the one
        :meth:`_values` then uses (:meth:`subset_kernel`)."""
        return self.subset_kernel(probe=True) is not None

    def subset_kernel(self, probe: bool = False, rows: Optional[int] = None) -> Optional[str]:
        """The probed subset kernel's name for the current setting and ``rows`` rows of h (``"gathered"``,
        ``"blocked8"`` … ``"blocked64"``), ``None`` where none matched or (``probe=False``) where no probe ran yet
        for them. A row count other than the probe's own (1, 3, 16) gets its own probe on that many rows (a GEMM may
        round by its row count), once per setting: a call's first row count of a kind pays one full call and the
        probed subsets."""
        extra = () if rows is None or rows in PROBE_ROWS else (int(rows),)
        key = subset_probe_key() + extra
        if key not in self._subset_probe and probe:
            got = self._subset_probe[key] = probe_subset_kernel(self.weight, self.bias_native, rows=extra or PROBE_ROWS)
            if got is None:
                logger.warning("hf_csv: this CPU's BLAS computes a column subset of the head in another rounding "
                               "than the full call; certified sampling that reads the values (stock's sampler, "
                               "verify, scores) uses the full head here, so top-k, min-p and top-p sampling give "
                               "stock's tokens for the seed (docs/certificates.md §2.0)")
        return self._subset_probe.get(key)

    def graph_gather_exact(self, capacity: int, rows: int = 1) -> bool:
        """Whether the op a sampled compiled head (:class:`hf_csv.core.static.StaticTopK`) reads its values from gives
        stock's bits on this head (:func:`graph_gather_matches_full`), probed once per capacity, row count and
        setting (:func:`subset_probe_key`)."""
        key = (min(int(capacity), self.vocab_size), int(rows)) + subset_probe_key()
        if key not in self._gather_probe:
            self._gather_probe[key] = graph_gather_matches_full(self.weight, *key[:2])
        return self._gather_probe[key]

    # ----------------------------------------------------------- helpers
    def _check(self, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 copy, hidden states in the weight dtype as the stock head receives them)."""
        if not torch.is_tensor(H) or not H.is_floating_point():
            raise TypeError(f"hidden states must be a floating tensor, got {type(H).__name__} "
                            f"{getattr(H, 'dtype', '')}")
        if H.dim() != 2 or H.shape[1] != self.hidden_size:
            raise ValueError(f"hidden states must be [N, {self.hidden_size}], got {tuple(H.shape)}")
        return H.float(), (H if H.dtype == self.weight.dtype else H.to(self.weight.dtype))

    def ready(self, H: torch.Tensor) -> bool:
        """Whether a certified call now would run without waiting for a background part of the build
        (the screen's first packing of a large head). Calibrates on ``H`` if needed. Callers that must
        not wait use the full head meanwhile; calling a method anyway is correct, it just waits."""
        p = self.provider
        if getattr(p, "steady", None) is not None:  # settled: nothing left to build or wait for
            return True
        if hasattr(p, "warm"):
            p.warm(H.reshape(-1, self.hidden_size))
        return bool(p.ready()) if hasattr(p, "ready") else True

    def prepare(self, H: torch.Tensor) -> None:
        """Do the provider's first-call work now, in the calling thread (calibration and packing; an engine's load
        step, so that its first requests do not wait or run the full head meanwhile). ``H``: hidden states of this
        head's width (any values: they only choose the screen's first outlier columns)."""
        p = self.provider
        H = H.reshape(-1, self.hidden_size)
        if hasattr(p, "prepare_now"):
            p.prepare_now(H)
        elif hasattr(p, "warm"):
            p.warm(H)

    def settled(self) -> bool:
        """Whether the provider's one-off work of the first calls (packing, the columns' re-choice) is over: a
        caller timing certified calls against the full head (a speed guard, the thread tuner) ignores calls before
        it."""
        p = self.provider
        if getattr(p, "steady", None) is not None:  # (the steady state's one read)
            return True
        return bool(p.settled()) if hasattr(p, "settled") else True

    def _screen(self, Hf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(est, U, top) of the provider on float32 rows: est and upper bounds [N, V], each row's top estimate where
        the provider finds it in the same pass (else None). A settled screen is one kernel call
        (:attr:`hf_csv.core.bounds.ScreenProvider.steady`)."""
        p = self.provider
        steady = getattr(p, "steady", None)
        call = None if steady is None else steady.call  # (read once: a background swap may replace it)
        if call is not None:
            return call(Hf.contiguous())
        screen = getattr(p, "screen", None)
        return screen(Hf) if screen is not None else (*p(Hf), None)

    def full(self, H: torch.Tensor) -> torch.Tensor:
        """The full head in fp32 arithmetic (the real-valued reference of the bounds' tests)."""
        out = H.float() @ self.weight.float().T if self.weight.dtype != torch.float32 else H.float() @ self.weight.T
        return out + self.bias if self.bias is not None else out

    def stock(self, H: torch.Tensor) -> torch.Tensor:
        """The head exactly as ``nn.Linear`` computes it: the same op, in the weight dtype."""
        return F.linear(H.to(self.weight.dtype), self.weight, self.bias_native)

    def stock_error(self, H: torch.Tensor) -> torch.Tensor:
        """Per row, a bound E on |stock's fp32 accumulator − the real logit| for every token."""
        # + (d+2)·2⁻¹⁴⁹: a product that underflows errs by an absolute 2⁻¹⁵⁰ (Higham's γ covers relative errors only)
        return (self._gam * (self._l1_max * H.float().abs().amax(1) + self._b_max)) * (1 + 1e-6) + self._underflow

    def exact(self, tokens: torch.Tensor, rows: torch.Tensor, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact fp32 logits at (rows, tokens) and a rigorous bound on their rounding error."""
        val = self._gather(self.weight, tokens, rows, H)
        # γ_{d+2}·Σ_j |W_ij h_j| <= γ·||W_i||_1·||h||_∞ bounds the fp32 accumulation error
        err = self._gam * self._abs_l1[tokens] * H[rows].abs().amax(1) + self._underflow
        if self.bias is not None:
            val = val + self.bias[tokens]
            err = err + val.abs() * gamma(1)
        return val, err

    def _stock_lower(self, tokens: torch.Tensor, rows: torch.Tensor, H: torch.Tensor,
                     E: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A lower bound on stock's fp32 accumulator at (rows, tokens), whatever its order (``E``: the rows'
        :meth:`stock_error`, when the caller has it)."""
        val, err = self.exact(tokens, rows, H)
        return _down(_down(val - err, 2) - (self.stock_error(H) if E is None else E)[rows], 2)

    def _values(self, r: torch.Tensor, t: torch.Tensor, Hf: torch.Tensor, Hn: torch.Tensor,
                value_dtype: torch.dtype, sorted_one_row: bool = False,
                with_slack: bool = False, subset: Optional[SubsetFn] = None
                ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Logits at (r, t) as fp32 holding ``value_dtype`` values. In the weight dtype: stock's op on
        all rows and the union of the candidate columns (on the aligned row blocks that hold them where
        :meth:`subset_kernel` picked a ``"blocked…"`` kernel); otherwise the exact fp32 recompute, rounded to
        ``value_dtype``.

        These are *not* assumed to be stock's values (a BLAS may sum a column subset in another order than the full
        call: MKL's AVX-512 path does). With ``with_slack`` returns ``(vals, acc, slack)``: ``acc`` our fp32
        accumulator of each value (``vals`` is it rounded to ``value_dtype``) and ``slack`` s >= |acc − stock's fp32
        accumulator|, docs/certificates.md §2.0: each is within γ_{d+2}(Σ_j |W_ij h_j| + |b_i|) + (d+2)·2⁻¹⁴⁹ of the
        real logit, whatever its summation order. ``subset``: the caller's own kernel on the rows ``cols`` of the
        head (another engine's), used instead of ``F.linear`` (its values carry the same slack)."""
        if t.numel() == 0:
            e = torch.empty(0, dtype=torch.float32, device=Hf.device)
            return (e, e, e) if with_slack else e
        if value_dtype == self.weight.dtype:
            # one row whose candidates (a nonzero()) are distinct and sorted: unique(t) is t itself
            cols, inv = (t, None) if sorted_one_row else torch.unique(t, return_inverse=True)
            b = None if self.bias_native is None else self.bias_native[cols]
            Wc = self.weight[cols]
            if subset is not None:
                if b is not None:
                    raise ValueError("a caller's subset kernel is for heads without a bias")
                out = subset(Hn, cols)
            else:
                with caller_threads():  # stock's op as the caller runs it, by the kernel the probe found (if any)
                    # a plan that hands these values to stock's code was chosen on a probe that matched (the
                    # plan choice probes before it picks one); then this setting and row count are probed too (a setting first
                    # met here, e.g. a thread count changed inside the call, is probed now, not assumed)
                    relied = any(v is not None for v in self._subset_probe.values())
                    # the probes multiply fresh, contiguous h; a strided or offset h (a prefill step's last
                    # positions) may be peeled otherwise by the BLAS: no probed kernel is trusted there
                    probed_layout = Hn.is_contiguous() and Hn.data_ptr() % 64 == 0
                    kind = self.subset_kernel(probe=relied, rows=Hn.shape[0]) if probed_layout or not relied \
                        else None
                    if kind is not None:  # the probed kernel (it matched the full call, alignment included)
                        out = SUBSET_KERNELS[kind](self.weight, self.bias_native)(Hn, cols)
                    elif relied:  # no kernel matches here: stock's own full call on this h, its columns
                        out = F.linear(Hn, self.weight, self.bias_native)[:, cols]
                    else:  # no plan relies on stock's bits on this head: the values serve within their slack
                        out = F.linear(Hn, Wc, b)
            pick = (lambda x: x.view(-1)) if inv is None else (lambda x: x[r, inv])
            vals = pick(out).float()
            if not with_slack:
                return vals
            Hs = Hn.float()  # what stock multiplies (bf16/fp16 products are exact in fp32)
            if self.weight.dtype == torch.float32:
                acc = vals
                Wf = Wc
            else:  # the fp32 accumulator before stock's rounding to the weight dtype
                Wf = Wc.float()
                acc = pick(F.linear(Hs, Wf, None if self.bias is None else self.bias[cols]))
            # Σ_j |W_ij h_j| in fp32 (short of the real sum by at most γ_{d+2} relatively: raised below)
            ad = pick(F.linear(Hs.abs(), Wf.abs()))
            if self.bias is not None:
                ad = ad + self.bias[t].abs()
            return vals, acc, (2 * self._gam * (1 + 2 * self._gam) * (1 + 1e-6)) * ad + 2 * self._underflow
        val, err = self.exact(t, r, Hf)
        vals = val.to(value_dtype).float()
        return (vals, val, err + self.stock_error(Hf)[r]) if with_slack else vals

    def _dense(self, S: torch.Tensor, Hf: torch.Tensor, Hn: torch.Tensor, value_dtype: torch.dtype,
               stats: CertStats, U: torch.Tensor, extra: int = 0,
               stock: Optional[StockFn] = None, subset: Optional[SubsetFn] = None) -> tuple[torch.Tensor, "_Dense"]:
        """Dense [N, V] logits in ``value_dtype``: the stock values on S, -inf outside; rows over the
        budget (plus ``extra`` tokens put in S on every row) get the whole stock row (and S = V). Stats are
        accumulated into ``stats``."""
        N, V = S.shape
        if N <= 8:  # decode: one pass over S; counts from the (small) candidate list
            r, t = S.nonzero(as_tuple=True)
            counts = torch.bincount(r, minlength=N)
        else:
            counts = S.sum(1)
        over = counts > self.budget + extra
        big = (counts > self._dense_cutoff + extra) & ~over
        special = over | big
        if N <= 8:
            if bool(special.any()):
                keep = ~special[r]
                r, t = r[keep], t[keep]
        else:
            r, t = (S & ~special[:, None] if bool(special.any()) else S).nonzero(as_tuple=True)
        vals, acc, ent = self._values(r, t, Hf, Hn, value_dtype, sorted_one_row=N == 1, with_slack=True,
                                      subset=subset)
        # per row, the largest slack of its gathered values (0 where the row holds none, or stock's own row)
        slack = torch.zeros(N, dtype=torch.float32, device=Hf.device)
        if ent.numel():
            slack = slack.scatter_reduce(0, r, ent, "amax", include_self=True)
        logits = torch.full((N, V), float("-inf"), dtype=value_dtype, device=Hf.device)
        logits[r, t] = vals.to(value_dtype)
        if stats.collect_radius:
            stats.radius_sum += float((U[r, t] - vals).sum())
        if bool(special.any()):  # within budget but large (one dense GEMM beats a gather), or over budget
            idx = special.nonzero(as_tuple=True)[0]
            dense = self._stock_rows(Hf, Hn, value_dtype, stock)[idx]
            if stats.collect_radius and bool(big.any()):
                b = big[idx]
                stats.radius_sum += float(((U[idx[b]] - dense[b].float()) * S[idx[b]]).sum())
            logits[idx] = torch.where(over[idx, None] | S[idx], dense, torch.full_like(dense, float("-inf")))
            S[over] = True
        cert = ~over
        stats.rows += N
        stats.certified += int(cert.sum())
        stats.fallback += int(over.sum())
        sizes = counts[cert]
        stats.subvocab_sum += int(sizes.sum())
        stats.subvocab_sizes.extend(sizes.tolist())
        stats.vocab_size = V
        if bool(special.any()):
            slack[idx] = 0.0  # stock's own op on all rows of the call
        return logits, _Dense(rows=r, vals=vals, special=bool(special.any()), over=over, complete=over | (counts == V),
                              slack=slack, toks=t, acc=acc, ent=ent)

    def _stock_rows(self, Hf: torch.Tensor, Hn: torch.Tensor, value_dtype: torch.dtype,
                    stock: Optional[StockFn] = None) -> torch.Tensor:
        """All rows of the full head in ``value_dtype`` (the stock op when that is the weight dtype:
        computed on every row, since a GEMM on fewer rows may round differently). ``stock``: the caller's own
        head (another engine's kernel), called with all rows of the call; it is then what "stock" means."""
        untimed()  # (this call's time is mostly the full head's: not a sample of the tuner's thread choice)
        if stock is not None:
            if value_dtype != self.weight.dtype:
                raise ValueError(f"a caller's stock head returns {self.weight.dtype} values, not {value_dtype}")
            out = stock(Hn)
            if tuple(out.shape) != (Hn.shape[0], self.vocab_size):
                raise ValueError(f"the caller's stock head returned {tuple(out.shape)}, expected "
                                 f"{(Hn.shape[0], self.vocab_size)}")
            return out
        with caller_threads():
            if value_dtype == self.weight.dtype:
                return self.stock(Hn)
            return self.full(Hf).to(value_dtype)

    def _run_nonfinite(self, H: torch.Tensor, fn, *args, **kwargs) -> CertResult:
        """Rows with NaN/inf hidden states go to the full head (as stock would), counted. On CPU the
        call runs on the thread count the tuner finds faster (hf_csv.core.speed.ThreadTuner)."""
        if self._tuner is None:
            return self._run_rows(H, fn, *args, **kwargs)
        with self._tuner((fn.__name__, rows_bucket(H.shape[0] if H.dim() == 2 else 0))):
            if not self.settled():
                untimed()  # (the first calls' one-off work is not the thread choice's time)
            return self._run_rows(H, fn, *args, **kwargs)

    def _run_rows(self, H: torch.Tensor, fn, *args, **kwargs) -> CertResult:
        Hf, Hn = self._check(H)
        if Hf.shape[0] == 1:  # a decode row: one reduction and a host read (NaN fails both comparisons: below)
            a = float(Hf.abs().max())
            if H_MIN <= a <= H_MAX:
                return fn(Hf, Hn, *args, **kwargs)
        amax = Hf.abs().amax(1)
        # the proofs' float steps assume normal numbers: below H_MIN the screen's step m/127 and stock's products
        # underflow, above H_MAX its radius terms overflow (docs/certificates.md §2.4)
        finite = (amax >= H_MIN) & (amax <= H_MAX)
        if bool(finite.all()):
            return fn(Hf, Hn, *args, **kwargs)
        # A call with such a row is stock's full call on every row: the in-range rows too, since a certified
        # call on fewer rows than stock's would compute their values (a fallback's row, the values a plan hands to
        # stock's code) in a GEMM of another row count, which may round otherwise (docs/certificates.md §2.0)
        stats = CertStats(vocab_size=self.vocab_size)
        N = Hf.shape[0]
        out_dtype = kwargs.get("out_dtype") or torch.float32
        logits = self._stock_rows(Hf, Hn, out_dtype, kwargs.get("stock")).clone()
        mask = torch.ones(N, self.vocab_size, dtype=torch.bool, device=Hf.device)
        bound = torch.full((N,), float("-inf"), device=Hf.device)
        nbad = int((~finite).sum())
        nonfin = int((~torch.isfinite(amax)).sum())
        stats.rows += N
        stats.fallback += N
        stats.nonfinite += nonfin
        stats.out_of_range += nbad - nonfin
        stats.beside_bad += N - nbad
        tokens = upper = noise = cut = shift = None
        if kwargs.get("with_upper"):  # full rows hold every token: their upper bounds are never read
            upper = torch.full((N, self.vocab_size), float("inf"), device=Hf.device)
        if getattr(fn, "__name__", "") == "_sample":  # full rows: no draw here (tokens -1), fresh noise, no cut
            tokens = torch.full((N,), -1, dtype=torch.long, device=Hf.device)
            noise = kwargs.get("noise")
            noise = gumbel_noise((N, self.vocab_size), Hf.device, kwargs.get("generator")) if noise is None \
                else noise.clone()
            cut = torch.full((N,), float("-inf"), device=Hf.device)
            shift = torch.zeros(N, device=Hf.device)  # (rows without a cut: a later draw shifts by its own row's max)
        return CertResult(logits=logits, stats=stats, tokens=tokens, mask=mask, bound=bound, noise=noise, cut=cut,
                          upper=upper, shift=shift)

    # ---------------------------------------------------------- top-k
    @torch.no_grad()
    def topk(self, H: torch.Tensor, k: int = 1, out_dtype: Optional[torch.dtype] = None,
             always: int = 0, with_upper: bool = False, k_min: Optional[int] = None,
             stock: Optional[StockFn] = None, subset: Optional[SubsetFn] = None,
             own_values: bool = False) -> CertResult:
        """Dense logits, exact on a set S that provably holds stock's top-k, ties included.

        Proof (docs/certificates.md §2): seeds s_1..s_k (top-k of the estimate) give lo <= stock's
        k-th largest fp32 logit. S = {U_i >= t} with t chosen so that every i ∉ S has stock value
        (rounded to ``out_dtype``) <= ``bound`` < round(lo): strictly below the k-th, so neither a
        top-k filter nor argmax's lowest-index tie-break can pick it. ``out_dtype`` is the dtype
        stock's head returns (bf16 for a bf16 model); ``None`` means fp32.

        ``always``: the last ``always`` tokens are put in S on every row (computed exactly, outside the
        budget): Whisper's timestamp block, whose logsumexp its timestamp processor reads. More tokens in S
        leave the guarantee as it is.

        ``with_upper``: also return ``upper`` [N, V], a bound on stock's fp32 logit of every token (read off S:
        Whisper's avg-logprob interval, docs/certificates.md §3.6).

        ``k_min``: on rows where the set for ``k`` would exceed the budget, S holds stock's top-``k_min`` instead
        (the same proof with the first ``k_min`` seeds), so a wider K never costs a row its certificate. The
        guarantee is then only top-``k_min``; callers that want more must not pass it.

        ``stock``: another engine's own head (``Hn -> [N, V]`` in the weight dtype, called with every row of the
        call): every row handed back as stock's own row (slack 0: over the budget, dense, a near tie, non-finite)
        is then its row, that engine's values bit for bit; the other rows' values stay within ``slack`` of its
        accumulator (its GEMM must accumulate in fp32 and round once, as the bounds assume). Default: ``F.linear``.
        ``subset``: that engine's kernel on a subset of the head's rows, for the values on S (equal to its full call
        bit for bit only where the caller has checked that: no proof gives it, docs/certificates.md §2.0).

        ``own_values``: the caller takes only decisions that it proves within the values' ``slack`` (greedy's argmax,
        a draft's law) and never hands the values on S to stock's code as stock's. A float32 or bfloat16 CPU head
        without a bias, whose values are returned in its own dtype, may then compute a top-1 call in hf_csv's
        native epilogue (:func:`hf_csv_kernels.native.top1`: the
        same cut, its own dot products for the values, the same slack and argmax check) instead of ``F.linear`` on S
        (whose values equal stock's bit for bit where :meth:`subset_exact` says so; the native ones need not).
        """
        if not 1 <= k <= self.vocab_size:
            raise ValueError(f"k must be in [1, {self.vocab_size}], got {k}")
        if k_min is not None and not 1 <= k_min <= k:
            raise ValueError(f"k_min must be in [1, k={k}], got {k_min}")
        if not 0 <= always < self.vocab_size:
            raise ValueError(f"always must be in [0, {self.vocab_size}), got {always}")
        kw = {"with_upper": True} if with_upper else {}
        if k_min is not None and k_min < k:
            kw["k_min"] = int(k_min)
        if subset is not None:
            kw["subset"] = subset
        if own_values:
            kw["own_values"] = True
        return self._run_nonfinite(H, self._topk, k=k, out_dtype=out_dtype, always=int(always), stock=stock, **kw)

    def _topk(self, Hf: torch.Tensor, Hn: torch.Tensor, k: int, out_dtype: Optional[torch.dtype] = None,
              always: int = 0, with_upper: bool = False, k_min: Optional[int] = None,
              stock: Optional[StockFn] = None, subset: Optional[SubsetFn] = None,
              own_values: bool = False) -> CertResult:
        d = out_dtype or torch.float32
        N = Hf.shape[0]
        stats = CertStats(vocab_size=self.vocab_size)
        est, U, top = self._screen(Hf)
        if (own_values and k == 1 and top is not None and self._top1 is not None and not always
                and k_min is None and subset is None and d == self.weight.dtype and Hf.device.type == "cpu"):
            res = self._top1_native(Hf, est, U, top, stats)
            if res is not None:
                if with_upper:  # the same bounds as below: |stock − real| <= E
                    res.upper = U + self.stock_error(Hf)[:, None]
                return res
        if k == 1:  # the seed: est's top (found in the screen's own pass where it can)
            seeds = (top if top is not None else est.argmax(1)).view(N, 1)
        else:
            seeds = est.topk(k, dim=1).indices  # sorted: est's top first
        rows = torch.arange(N, device=Hf.device)
        if seeds.shape[1] > 1:
            rows = rows.repeat_interleave(seeds.shape[1])
        E = self.stock_error(Hf)
        lows = self._stock_lower(seeds.reshape(-1), rows, Hf, E).view(N, -1)
        t, bound = _cut(lows.amin(1), E, d)
        S = U >= t[:, None]
        if k_min is not None:
            # _dense's test: |S ∪ A| > budget + |A| for the always-block A, i.e. |S \ A| > budget
            over = S[:, :self.vocab_size - always].sum(1) > self.budget
            if bool(over.any()):  # those rows: the certificate of the first k_min seeds (a smaller S)
                t_min, bound_min = _cut(lows[:, :k_min].amin(1), E, d)
                t, bound = torch.where(over, t_min, t), torch.where(over, bound_min, bound)
                S = U >= t[:, None]
        if always:
            S[:, self.vocab_size - always:] = True
        logits, info = self._dense(S, Hf, Hn, d, stats, U, extra=always, stock=stock, subset=subset)
        bound = bound.masked_fill(info.complete, float("-inf"))
        slack = info.slack
        if k == 1 and bool((slack > 0).any()):
            # the argmax must not depend on where in its slack stock's value lies (docs/certificates.md §2.0)
            und = _sparse_undecided(info.rows, info.toks, info.vals, info.acc, info.ent, N, d) & (slack > 0)
            if bool(und.any()):
                self._to_stock(und, logits, S, bound, slack, Hf, Hn, d, stats, stock)
                keep = ~und[info.rows]
                info.rows, info.toks, info.vals, info.acc, info.ent = (info.rows[keep], info.toks[keep],
                                                                       info.vals[keep], info.acc[keep], info.ent[keep])
        upper = U + E[:, None] if with_upper else None  # |stock − real| <= E
        return CertResult(logits=logits, stats=stats, mask=S, est=est, bound=bound, upper=upper, slack=slack,
                          acc=(info.rows, info.toks, info.acc))

    def _top1_native(self, Hf: torch.Tensor, est: torch.Tensor, U: torch.Tensor, top: torch.Tensor,
                     stats: CertStats) -> Optional[CertResult]:
        """:meth:`_topk`'s result for k = 1 from the dispatch op ``top1`` (the native kernel's
        :func:`hf_csv_kernels.native.top1`, resolved when the head was built: per row the same seed, lower bound, cut,
        S, slack and argmax check, docs/certificates.md §2.1, §2.0); None where that call leaves the call to the torch
        path (a row with more candidates than the budget or the dense cut-off, an argmax the slack leaves open, a
        value that is not finite)."""
        got = self._top1(self.weight, Hf.contiguous(), U.contiguous(), top.contiguous(), self._abs_l1,
                         self._top1_cst, min(self.budget, self._dense_cutoff))
        if got[0] < 0:
            return None
        n, logits, mask, rows, toks, acc, ent, out, counts = got
        N = Hf.shape[0]
        stats.rows += N
        stats.certified += N
        stats.native += N
        stats.subvocab_sum += n
        stats.subvocab_sizes.extend(counts.tolist())
        if stats.collect_radius:  # (a statistic: one host read of the rows' sums)
            stats.radius_sum += sum(r[3] for r in out.tolist())
        return CertResult(logits=logits, stats=stats, mask=mask, est=est, bound=out[:, 1], slack=out[:, 2],
                          acc=(rows, toks, acc))

    def _to_stock(self, rows: torch.Tensor, logits: torch.Tensor, S: torch.Tensor, bound: Optional[torch.Tensor],
                  slack: torch.Tensor, Hf: torch.Tensor, Hn: torch.Tensor, d: torch.dtype, stats: CertStats,
                  stock: Optional[StockFn] = None) -> None:
        """Rows (bool [N]) whose decision the slack of their values leaves open: stock's whole row (its op on every
        row of the call), counted as fallbacks and in ``near_ties``."""
        idx = rows.nonzero(as_tuple=True)[0]
        logits[idx] = self._stock_rows(Hf, Hn, d, stock)[idx].to(logits.dtype)
        sizes = S[idx].sum(1).tolist()
        S[idx] = True
        if bound is not None:
            bound[idx] = float("-inf")
        slack[idx] = 0.0
        stats.near_ties += stats.uncertify(sizes)

    # ------------------------------------------------------ threshold
    @torch.no_grad()
    def threshold(self, H: torch.Tensor, delta: float, out_dtype: Optional[torch.dtype] = None,
                  rel: float = 0.0) -> CertResult:
        """Dense logits, exact on a set S that holds every token whose stock logit can be within
        ``delta + rel·|max|`` of the row's maximum, -inf outside; ``bound`` bounds every uncomputed token's
        stock logit. (``rel`` widens the band for processors that may lower the top token.)

        Proof as for :meth:`topk` with the seed's lower value lowered by ``delta``: every i ∉ S has stock
        value (rounded to ``out_dtype``) <= ``bound`` < round(lo − delta) <= max − delta. Used for min-p
        sampling (docs/certificates.md §3.3), whose per-row check right before the min-p warper decides the rest.
        """
        if not (delta >= 0 and math.isfinite(delta)):
            raise ValueError(f"delta must be finite and >= 0, got {delta}")
        if not (rel >= 0 and math.isfinite(rel)):
            raise ValueError(f"rel must be finite and >= 0, got {rel}")
        return self._run_nonfinite(H, self._threshold, delta=float(delta), out_dtype=out_dtype, rel=float(rel))

    def _threshold(self, Hf: torch.Tensor, Hn: torch.Tensor, delta: float,
                   out_dtype: Optional[torch.dtype] = None, rel: float = 0.0) -> CertResult:
        d = out_dtype or torch.float32
        N = Hf.shape[0]
        stats = CertStats(vocab_size=self.vocab_size)
        est, U, _ = self._screen(Hf)
        seeds = est.argmax(1)
        lo = self._stock_lower(seeds, torch.arange(N, device=Hf.device), Hf)
        t, bound = _cut(_down(lo - delta - rel * lo.abs(), 3), self.stock_error(Hf), d)
        S = U >= t[:, None]
        logits, info = self._dense(S, Hf, Hn, d, stats, U)
        bound = bound.masked_fill(info.complete, float("-inf"))
        return CertResult(logits=logits, stats=stats, mask=S, est=est, bound=bound)

    # ------------------------------------------------------ ε-softmax
    @torch.no_grad()
    def epsilon(self, H: torch.Tensor, eps: float = 1e-3, temperature: float = 1.0,
                out_dtype: Optional[torch.dtype] = None) -> CertResult:
        """Logits exact on S, −inf outside, with TV(softmax(ℓ/T), softmax over S) <= ε (approximate mode).

        With w_i = exp((U_i − τ)/T) and τ <= max_i ℓ_i, the mass outside S is at most
        R̂/(Z_S + R̂) with R̂ = Σ_{i∉S} exp(U_i/T)·e^{−τ/T} and Z_S the exact in-S sum (scaled alike).
        S is chosen from a 64-bucket histogram of w so that R̂ <= ε, then certified exactly.
        """
        if not (0 < eps < 1):
            raise ValueError(f"epsilon must be in (0, 1), got {eps}")
        if not (temperature > 0 and math.isfinite(temperature)):
            raise ValueError(f"temperature must be positive and finite, got {temperature}")
        return self._run_nonfinite(H, self._epsilon, eps=eps, temperature=temperature, out_dtype=out_dtype)

    @torch.no_grad()
    def spec(self, H: torch.Tensor, eps: float = 1e-2, temperature: float = 1.0,
             out_dtype: Optional[torch.dtype] = None) -> CertResult:
        """For the verify of exact speculative sampling (docs/speculative.md, "certified target"): logits
        exact on S (stock's values), -inf outside, and ``upper`` [N, V] bounding stock's fp32 logit of
        every token. S is chosen as in :meth:`epsilon`, so the mass outside S, bounded from ``upper``, is
        at most about ``eps`` of the row's: the normalizer is then known to a relative width of ~eps.
        Nothing here is approximate: the verify decides from these bounds only where they decide, and
        completes the row with the full head where they do not."""
        if not (0 < eps < 1):
            raise ValueError(f"eps must be in (0, 1), got {eps}")
        if not (temperature > 0 and math.isfinite(temperature)):
            raise ValueError(f"temperature must be positive and finite, got {temperature}")
        return self._run_nonfinite(H, self._epsilon, eps=eps, temperature=temperature, out_dtype=out_dtype,
                                   with_upper=True)

    def _epsilon(self, Hf, Hn, eps, temperature, out_dtype=None, with_upper: bool = False) -> CertResult:
        d = out_dtype or torch.float32
        N, T = Hf.shape[0], float(temperature)
        stats = CertStats(vocab_size=self.vocab_size)
        est, U, _ = self._screen(Hf)
        seeds = est.argmax(1)
        rows = torch.arange(N, device=Hf.device)
        val, err = self.exact(seeds, rows, Hf)
        tau = val - err
        z = (U - tau[:, None]) / T  # log w_i
        nb, width = 64, 0.5
        bucket = ((-z) / width).floor().clamp(0, nb - 1).long()  # bucket j: z in (-(j+1)w, -jw]
        w = torch.exp(z.clamp(max=80.0))
        hist = torch.zeros(N, nb, dtype=torch.float64, device=Hf.device).scatter_add_(1, bucket, w.double())
        tail = hist.flip(1).cumsum(1).flip(1)  # tail[j] = mass of buckets >= j
        ok = tail <= eps / 2
        # smallest j whose tail is within ε/2 (bucket nb-1 always includes everything below)
        j = torch.where(ok.any(1), ok.float().argmax(1), torch.full((N,), nb, device=Hf.device))
        S = bucket < j[:, None]
        logits, info = self._dense(S, Hf, Hn, d, stats, U)
        # certify exactly with the final S
        out_mass = (w * (~S)).double().sum(1)
        lz = ((logits.float() - tau[:, None]) / T)
        z_s = torch.exp(lz.clamp(max=80.0)).double().sum(1)
        tv = out_mass / (z_s + out_mass)
        bad = tv > eps
        if bad.any():  # cannot happen with sound bounds; stay correct anyway
            idx = bad.nonzero(as_tuple=True)[0]
            logits[idx] = self._stock_rows(Hf, Hn, d)[idx]
            stats.uncertify(S[idx].sum(1).tolist())
            S[idx] = True
            tv[idx] = 0
        stats.tv_bound_max = float(tv.max()) if N else 0.0
        upper = U + self.stock_error(Hf)[:, None] if with_upper else None  # |stock − real| <= E
        return CertResult(logits=logits, stats=stats, mask=S, upper=upper)

    # ------------------------------------------------------ exact sampling
    @torch.no_grad()
    def sample(self, H: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
               generator: Optional[torch.Generator] = None, out_dtype: Optional[torch.dtype] = None,
               post: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
               warps: Optional[Sequence[tuple[str, float]]] = None,
               noise: Optional[torch.Tensor] = None, with_conf: bool = False,
               stock: Optional[StockFn] = None) -> CertResult:
        """One exact draw per row from stock's sampling law.

        Stock's law: the head's logits in ``out_dtype`` (bf16 for a bf16 model), then ``post`` (the
        architecture's transform, in that dtype; monotone), then fp32, then ``warps`` in order —
        ``("temperature", T)`` divides, ``("top_k", k)`` keeps the values >= the k-th largest —
        then softmax. ``warps`` defaults to ``[("temperature", temperature), ("top_k", top_k)]``,
        transformers' order.

        With a top-k warp the candidate set is the certified top-k set and the row is checked: every
        uncomputed token's warped value is strictly below the k-th (else the row uses the full head).
        Without one, lazy Gumbel-max: any token whose warped upper bound plus its Gumbel noise is
        below the seed's certified lower value plus noise cannot be the argmax (docs/certificates.md §2.3).
        Rows with tokens == -1 (non-finite hidden states) carry the full stock row instead of a draw.

        ``noise``: the Gumbel noise [N, V] to draw with (default: fresh, from ``generator``). With given noise the
        draw is the deterministic argmax of stock's final values plus that noise (Gumbel-coupled verification,
        docs/speculative.md). ``with_conf``: also the drawn token's (estimated) probability, ``CertResult.conf``.
        ``stock``: another engine's own head, as in :meth:`topk` (its rows are then the law's values wherever the
        draw needs stock's whole row).
        """
        if not (temperature > 0 and math.isfinite(temperature)):
            raise ValueError(f"temperature must be positive and finite, got {temperature}")
        if warps is None:
            warps = [("temperature", float(temperature))] if temperature != 1.0 else []
            if top_k is not None and top_k > 0:
                warps.append(("top_k", int(top_k)))
        warps = list(warps)
        for kind, v in warps:
            if kind == "temperature" and not (v > 0 and math.isfinite(v)):
                raise ValueError(f"temperature must be positive and finite, got {v}")
            if kind not in ("temperature", "top_k"):
                raise ValueError(f"unknown warp {kind!r}; use 'temperature' or 'top_k'")
        if sum(kind == "top_k" for kind, _ in warps) > 1:
            raise ValueError("at most one top_k warp is supported")
        if noise is not None and (noise.dim() != 2 or noise.shape[1] != self.vocab_size):
            raise ValueError(f"noise must be [N, {self.vocab_size}], got {tuple(noise.shape)}")
        return self._run_nonfinite(H, self._sample, warps=warps, generator=generator, out_dtype=out_dtype,
                                   post=post, noise=noise, with_conf=with_conf, stock=stock)

    def _law(self, x: torch.Tensor, d: torch.dtype, post, warps, stop_at_topk: bool = False,
             mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """fp32 values of d-representable logits ``x`` after post (in d) and the warps, as stock computes
        them; entries outside ``mask`` (uncomputed) are -inf from the start."""
        y = x.to(d)
        if post is not None:
            y = post(y)
        y = y.float()
        if mask is not None:
            y = y.masked_fill(~mask, float("-inf"))
        for kind, v in warps:
            if kind == "temperature":
                y = y / v
            elif stop_at_topk:
                break
            else:
                k = min(int(v), y.shape[-1])
                kth = y.topk(k, dim=-1).values[..., -1:]
                y = y.masked_fill(y < kth, float("-inf"))
        return y

    def _sample(self, Hf, Hn, warps, generator=None, out_dtype=None, post=None, noise=None,
                with_conf=False, stock: Optional[StockFn] = None) -> CertResult:
        d = out_dtype or torch.float32
        N, V = Hf.shape[0], self.vocab_size
        ks = [int(v) for kind, v in warps if kind == "top_k" and int(v) < V]
        warps = [(kind, v) for kind, v in warps if kind != "top_k" or int(v) < V]  # top-k >= V keeps all
        if ks:
            k = min(ks[0], V)
            res = self._topk(Hf, Hn, ks[0], d, stock=stock)
            S, bound = res.mask, res.bound
            before = self._law(res.logits, d, post, warps, stop_at_topk=True, mask=S)
            ob = self._law(bound[:, None], d, post, warps, stop_at_topk=True)[:, 0]
            kth = before.topk(k, dim=1).values[:, -1]
            bad = ~(ob < kth) & (bound > float("-inf"))  # an uncomputed token could reach the top-k
            reach = bad.clone()  # (fallbacks, not ties: not counted in near_ties)
            # the values' slack (§2.0): the top-k set T of our values must be stock's (min over T of the lower law
            # above every other token's upper one), and the Gumbel winner must win within the slack too
            lo, hi = value_interval(res.acc_dense(), res.slack, d)
            T = before.topk(k, dim=1).indices
            inside = self._law(lo, d, post, warps, stop_at_topk=True, mask=S).gather(1, T).amin(1)
            others = self._law(hi, d, post, warps, stop_at_topk=True, mask=S).scatter(1, T, float("-inf")).amax(1)
            bad |= ~(inside > others) & (res.slack > 0)
            g = noise if noise is not None else gumbel_noise(before.shape, Hf.device, generator)
            inT = torch.zeros_like(S).scatter_(1, T, True)
            law_lo = self._law(lo, d, post, warps, mask=inT)
            law_hi = self._law(hi, d, post, warps, mask=inT)
            # the draw subtracts m (our row's largest value) before the noise; stock's values must lie close to it
            # for the noise to resolve on the full-head path too, so a row whose slack is that wide takes stock's row
            # now (decided from the values alone, before the noise is read)
            bad |= _slack_too_wide(law_lo, law_hi, inT, res.slack)
            if bool(bad.any()):
                self._to_stock(bad, res.logits, S, res.bound, res.slack, Hf, Hn, d, res.stats, stock)
                res.stats.near_ties -= int(reach.sum())
            law = self._law(res.logits, d, post, warps, mask=S)
            m = gumbel_shift(row_max_finite(law))[:, None]  # fixed before the draw, the same on every path below
            res.tokens = ((law - m) + g).argmax(1)
            und = _draw_undecided(res.tokens, g, law_lo - m, law_hi - m) & (res.slack > 0)
            if bool(und.any()):
                self._to_stock(und, res.logits, S, res.bound, res.slack, Hf, Hn, d, res.stats, stock)
                law = self._law(res.logits, d, post, warps, mask=S)
                res.tokens = ((law - m) + g).argmax(1)
            res.shift = m[:, 0]
            if with_conf:
                r = torch.arange(N, device=Hf.device)
                res.conf = torch.softmax(law, 1)[r, res.tokens]
            return res
        stats = CertStats(vocab_size=V)
        est, U, _ = self._screen(Hf)
        g = noise if noise is not None else gumbel_noise(U.shape, Hf.device, generator)
        heur = est
        for kind, v in warps:
            heur = heur / v
        seeds = (heur + g).argmax(1)
        rows = torch.arange(N, device=Hf.device)
        lo = self._stock_lower(seeds, rows, Hf)
        lo_law = self._law(lo[:, None], d, post, warps)[:, 0]
        # every comparison below is in units shifted by m (fixed here, before S): fl(· - m) is non-decreasing, so
        # Theorem 4's chain holds for argmax fl(fl(y_i - m) + G_i) (docs/certificates.md §2.3)
        m = gumbel_shift(lo_law)
        t = (lo_law - m) + g[rows, seeds]
        upper = self._law(U + self.stock_error(Hf)[:, None], d, post, warps)
        S = ((upper - m[:, None]) + g) >= t[:, None]
        logits, info = self._dense(S, Hf, Hn, d, stats, U, stock=stock)
        law = self._law(logits, d, post, warps, mask=S)
        slack = info.slack
        lo = hi = None
        if bool((slack > 0).any()):
            lo, hi = value_interval(_acc_dense(logits, info.rows, info.toks, info.acc), slack, d)
            lo, hi = self._law(lo, d, post, warps, mask=S), self._law(hi, d, post, warps, mask=S)
        # the noise must resolve at the top of the row, on our values and on stock's: where the seed's lower value
        # (m) lies far below the row's largest value (a wide bound), or the values' slack is that wide, the row takes
        # stock's values and, complete, its own largest value. Decided from the values alone, before the noise is
        # read, so each branch is an exact Gumbel-max draw.
        top = row_max_finite(law)
        far = torch.isfinite(top) & ((top - m).abs() >= _GUMBEL_FAR) & ~info.complete
        if lo is not None:
            far |= _slack_too_wide(lo, hi, S, slack) & ~info.complete
        if bool(far.any()):
            self._to_stock(far, logits, S, None, slack, Hf, Hn, d, stats, stock)
            stats.near_ties -= int(far.sum())  # (a wide bound, not a tie)
            info.complete = info.complete | far
            law = self._law(logits, d, post, warps, mask=S)
        # a complete row (the full head, or S = V) has no cut to stay consistent with: its own largest value
        m = torch.where(info.complete, gumbel_shift(row_max_finite(law)), m)
        t = torch.where(info.complete, torch.full_like(t, float("-inf")), t)
        tokens = ((law - m[:, None]) + g).argmax(1)
        if lo is not None and bool((slack > 0).any()):
            # the winner must win for every value of stock's within the slack (§2.0), and reach the cut; an undecided
            # row draws on stock's row with the same m and the same noise (the same function of the noise)
            law_lo = lo - m[:, None]
            und = _draw_undecided(tokens, g, law_lo, hi - m[:, None])
            und |= ~((law_lo.gather(1, tokens[:, None])[:, 0] + g[rows, tokens]) >= t)
            und &= slack > 0
            if bool(und.any()):
                self._to_stock(und, logits, S, None, slack, Hf, Hn, d, stats, stock)
                info.complete = info.complete | und
                law = self._law(logits, d, post, warps, mask=S)
                tokens = ((law - m[:, None]) + g).argmax(1)
        cut = t.masked_fill(info.complete, float("-inf"))
        conf = None
        if with_conf:
            est_law = torch.where(S, law, heur)
            conf = (law[rows, tokens] - torch.logsumexp(est_law, 1)).exp()
        keep = ~info.complete[info.rows]
        return CertResult(logits=logits, stats=stats, tokens=tokens, mask=S,
                          bound=torch.full((N,), float("-inf"), device=Hf.device), noise=g, cut=cut, conf=conf, shift=m,
                          slack=slack, acc=(info.rows[keep], info.toks[keep], info.acc[keep]))


@dataclass
class _Dense:
    rows: torch.Tensor  # row of each sparse candidate value (special rows excluded)
    vals: torch.Tensor  # their fp32 values
    special: bool  # some row was computed densely (big or over budget)
    over: torch.Tensor  # bool [N]: rows over the budget (full head)
    complete: torch.Tensor  # bool [N]: rows that hold every token (S = V)
    slack: torch.Tensor  # fp32 [N]: |our accumulator − stock's| <= slack on every value of the row (0: stock's row)
    toks: torch.Tensor  # token of each sparse value
    acc: torch.Tensor  # our fp32 accumulator of each sparse value (vals is it rounded to the value dtype)
    ent: torch.Tensor  # each sparse value's own slack (the row's slack is their largest)


def _down(x: torch.Tensor, n: int = 1) -> torch.Tensor:
    """x moved n fp32 ulps toward -inf (covers the rounding of the op that produced x)."""
    for _ in range(n):
        x = torch.nextafter(x, torch.full_like(x, float("-inf")))
    return x


def _cut(lo: torch.Tensor, E: torch.Tensor, d: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Threshold t and bound b per row such that any token with upper bound U_i < t has a stock
    logit (rounded to d) <= b < round_d(lo), where lo <= stock's fp32 accumulator of the seeds: :func:`_cut_at`
    with b the predecessor of round_d(lo) in d."""
    r = lo if d == torch.float32 else lo.to(d)
    return _cut_at(torch.nextafter(r, torch.full_like(r, float("-inf"))).float(), E, d)


def _cut_at(b: torch.Tensor, E: torch.Tensor, d: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Threshold t per row such that any token with upper bound U_i < t has a stock logit (rounded to d) <= b,
    for a cap b that is a value of d (as fp32). Returns (t, b); rows where t, b or the edge is not finite get
    t = -inf, b = inf (nothing certified). An infinite edge is b = d's largest finite value: its successor in d is
    +inf, and a stock logit above d's overflow threshold rounds to +inf > b, so no finite t caps it (a float16 head
    whose seed logit overflows: those rows take the full head; docs/certificates.md §2.1).

    U_i < t <= edge − E gives x_i <= ℓ_i + E <= U_i + E < edge; in fp32, edge = succ(b), so x_i <= b; in d, edge
    is the midpoint between b and its successor in d, so round-to-nearest gives round_d(x_i) <= b (a value
    exactly at the midpoint is excluded by the strict '<').
    """
    if d == torch.float32:
        edge = torch.nextafter(b, torch.full_like(b, float("inf")))
    else:
        bd = b.to(d)
        edge = (b + torch.nextafter(bd, torch.full_like(bd, float("inf"))).float()) / 2  # exact in fp32
    t = _down(edge - E, 2)
    ok = torch.isfinite(t) & torch.isfinite(b) & torch.isfinite(edge)
    return t.masked_fill(~ok, float("-inf")), b.masked_fill(~ok, float("inf"))


def _cut_order(lo: torch.Tensor, E: torch.Tensor, d: torch.dtype, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_cut` that also survives any later float32 map x -> fl(x·c) or fl(x/c) (c > 0; transformers'
    temperature warper, in any of its implementations): every token with U_i < t has a stock logit x_i (in d)
    whose processed value is *strictly* below the processed value of round_d(lo), whatever the kernel that
    processes them (docs/certificates.md §3.9).

    Such a map is monotone with relative error at most 3u (u = 2^-24: one rounding of 1/c, one of the product),
    while the result is a normal number. The cap b <= L − 8u|L|, L = round_d(lo), then gives fl(b·/c) < fl(L·/c):
    for L > 0, (1 − 8u)(1 + 3u) < 1 − 3u, and for L < 0, (1 + 8u)(1 − 3u) > 1 + 3u. Rows where |L|/c is outside
    [2^-100, 2^100] (subnormal or overflowing results, and L = 0) get t = -inf, b = inf (not certified: the caller
    treats them as full rows), as do rows with a non-finite lo. ``temperature`` is c.
    """
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    L = lo if d == torch.float32 else lo.to(d).float()
    cap = L.double() * (1.0 - 8.0 * 2.0 ** -24 * torch.sign(L.double()))  # L − 8u|L|, exact enough in fp64
    b = _f32_down(cap)  # largest fp32 <= cap
    if d != torch.float32:  # largest value of d <= b
        r = b.to(d)
        b = torch.where(r.float() > b, torch.nextafter(r, torch.full_like(r, float("-inf"))), r).float()
    mag = L.double().abs() / temperature
    b = b.masked_fill(~((mag >= 2.0 ** -100) & (mag <= 2.0 ** 100)), float("inf"))  # not certified
    return _cut_at(b, E, d)


def _f32_down(x: torch.Tensor) -> torch.Tensor:
    """The largest float32 <= x (float64 input)."""
    f = x.float()
    return torch.where(f.double() > x, torch.nextafter(f, torch.full_like(f, float("-inf"))), f)


def _f32_up(x: torch.Tensor) -> torch.Tensor:
    """The smallest float32 >= x (float64 input)."""
    f = x.float()
    return torch.where(f.double() < x, torch.nextafter(f, torch.full_like(f, float("inf"))), f)


def _to_dtype(x: torch.Tensor, d: torch.dtype, up: bool) -> torch.Tensor:
    """fp32 ``x`` rounded to ``d`` toward +inf (``up``) or -inf, as fp32 holding a ``d`` value."""
    if d == torch.float32:
        return x
    v = x.to(d)
    step = torch.full_like(v, float("inf") if up else float("-inf"))
    off = v.float() < x if up else v.float() > x
    return torch.where(off, torch.nextafter(v, step), v).float()


def value_interval(acc: torch.Tensor, slack: torch.Tensor, d: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi), fp32 holding ``d`` values, with lo <= stock's value <= hi, for values the head computed from an fp32
    accumulator ``acc`` [N, m] within ``slack`` [N] of stock's accumulator, which stock rounds to ``d`` (round to
    nearest, non-decreasing): lo = ``acc − slack`` rounded down to ``d``, hi = ``acc + slack`` rounded up, each
    non-decreasing in ``acc`` (docs/certificates.md §2.0). Where slack is 0 (stock's own rows, ``acc`` its value)
    lo = hi = acc. -inf stays -inf."""
    y = acc.float()
    s = slack.float()[:, None]
    lo = _to_dtype(_down(y - s, 1), d, up=False)
    hi = _to_dtype(_f32_up_n(y + s, 1), d, up=True)
    exact = (s == 0) | ~torch.isfinite(y)
    return torch.where(exact, y, lo), torch.where(exact, y, hi)


def _sparse_undecided(rows: torch.Tensor, toks: torch.Tensor, vals: torch.Tensor, acc: torch.Tensor,
                      ent: torch.Tensor, N: int, d: torch.dtype) -> torch.Tensor:
    """bool [N]: rows whose argmax over the returned values (the first of equal ones, as ``argmax``) is not proven
    stock's. w is stock's argmax when lo_w > hi_j for every other j with a lower index and lo_w >= hi_j for every j
    with a higher one (a tie at stock's precision goes to the lower index). Tokens outside S are below w by the
    certificate. Entries are the sparse values, each with its own slack ``ent`` (0: stock's own value)."""
    dev = vals.device
    und = torch.zeros(N, dtype=torch.bool, device=dev)
    if vals.numel() == 0:
        return und
    ninf = torch.full((N,), float("-inf"), device=dev)
    top = ninf.scatter_reduce(0, rows, vals, "amax", include_self=True)
    is_top = vals == top[rows]
    big = torch.full((N,), torch.iinfo(torch.int64).max, dtype=torch.long, device=dev)
    w = big.scatter_reduce(0, rows[is_top], toks[is_top], "amin", include_self=True)
    lo, hi = value_interval(acc[:, None], ent, d)
    lo, hi = lo[:, 0], hi[:, 0]
    at_w = toks == w[rows]
    lo_w = ninf.scatter_reduce(0, rows[at_w], lo[at_w], "amax", include_self=True)
    before = toks < w[rows]
    after = toks > w[rows]
    hb = ninf.scatter_reduce(0, rows[before], hi[before], "amax", include_self=True)
    ha = ninf.scatter_reduce(0, rows[after], hi[after], "amax", include_self=True)
    has = torch.zeros(N, dtype=torch.bool, device=dev).index_fill_(0, rows, True)
    return has & ~((lo_w > hb) & (lo_w >= ha))


def _f32_up_n(x: torch.Tensor, n: int = 1) -> torch.Tensor:
    for _ in range(n):
        x = torch.nextafter(x, torch.full_like(x, float("inf")))
    return x


# Rows per block of the blocked subset kernels, smallest first: the probe takes the first that matches the full call,
# since a candidate costs its whole block of rows (docs/certificates.md §2.0; the counts per block: docs/benchmarks.md,
# "Value slack"). 64 is a multiple of every row-block width a GEMV/GEMM kernel of the hosts measured uses.
SUBSET_BLOCKS = (8, 16, 32, 64)
SUBSET_BLOCK = SUBSET_BLOCKS[-1]
PROBE_SIZES = (1, 2, 3, 5, 7, 8, 16, 17, 33, 64, 96, 129, 257)  # column-subset sizes the probe tries
PROBE_ROWS = (1, 3, 16)  # rows of h: a GEMV, a small GEMM, a batched step's GEMM (and the call's own count)


def subset_probe_key() -> tuple:
    """What a subset probe's verdict holds for: MKL's instruction-set and reproducibility settings, the thread count,
    and torch's fp32 matmul precision (a reduced one routes fp32 GEMMs through other kernels)."""
    return (os.environ.get("MKL_ENABLE_INSTRUCTIONS"), os.environ.get("MKL_CBWR"), torch.get_num_threads(),
            torch.get_float32_matmul_precision(), getattr(_mkldnn_matmul(), "fp32_precision", None))


def _mkldnn_matmul() -> Any:
    """``torch.backends.mkldnn.matmul`` where this torch has it (its ``fp32_precision`` setting), else ``None``."""
    return getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)


def fp32_matmul_reason(device: torch.device) -> Optional[str]:
    """Why stock's fp32 head on ``device`` may not compute IEEE fp32 dot products (``None`` where it does): torch's
    reduced fp32 matmul precisions (``torch.set_float32_matmul_precision("high" / "medium")``, TF32 or bf16 passes
    in cuBLAS / oneDNN) change stock's values beyond the γ_{d+2} accumulation bound the certificates prove against
    (docs/certificates.md §2.0), so a certified head declines them."""
    if torch.get_float32_matmul_precision() != "highest":
        return f"torch.get_float32_matmul_precision() is {torch.get_float32_matmul_precision()!r}, not 'highest'"
    mk = _mkldnn_matmul()
    if device.type == "cpu" and getattr(mk, "fp32_precision", "ieee") not in ("ieee", "none"):
        return f"torch.backends.mkldnn.matmul.fp32_precision is {mk.fp32_precision!r}"
    if device.type == "cuda" and (torch.backends.cuda.matmul.allow_tf32
                                  or getattr(torch.backends.cuda.matmul, "fp32_precision", "ieee") not in ("ieee", "none")):
        return "TF32 matmuls are allowed on CUDA (torch.backends.cuda.matmul)"
    return None


def rows_like(weight: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``weight[idx]`` in memory at the same address modulo 64 bytes as ``weight`` itself: a BLAS kernel peels a
    row's first elements up to an aligned address, so a row's rounding follows its alignment (a checkpoint's
    memory-mapped head need not start at an aligned address: whisper-tiny.en's sits at 40 mod 64 here)."""
    shift = weight.data_ptr() % 64
    if shift == 0 or shift % weight.element_size() or not weight.is_contiguous() or weight.device.type != "cpu":
        return weight[idx]
    n, d = idx.numel(), weight.shape[1]
    pad = 64 // weight.element_size()
    buf = torch.empty(n * d + pad, dtype=weight.dtype, device=weight.device)
    off = ((shift - buf.data_ptr() % 64) % 64) // weight.element_size()
    out = buf[off:off + n * d].view(n, d)
    torch.index_select(weight, 0, idx, out=out)
    return out


def gathered_kernel(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> SubsetFn:
    """``F.linear`` on the gathered rows ``cols`` of the head (at the head's own alignment): [N, |cols|] in the weight
    dtype."""
    def kernel(H: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        return F.linear(H, rows_like(weight, cols), None if bias is None else bias[cols])
    return kernel


def blocked_kernel(weight: torch.Tensor, bias: Optional[torch.Tensor], block: int = SUBSET_BLOCK) -> SubsetFn:
    """``F.linear`` on the aligned blocks of ``block`` rows of the head that hold ``cols`` (blocks [a·block,
    (a+1)·block), the last one cut at V), concatenated in ascending order, and the columns ``cols`` picked from it:
    [N, |cols|] in the weight dtype. Each token then sits at the same position modulo ``block`` and among the same
    neighbours as in the full call, which is what a kernel whose rounding depends on a row's place in its row block
    sees. Costs up to ``block``·|cols| rows; whether it equals the full call is measured (:func:`subset_mismatches`)."""
    V = weight.shape[0]

    def kernel(H: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        starts = torch.unique(torch.div(cols, block, rounding_mode="floor")) * block  # sorted
        idx = (starts[:, None] + torch.arange(block, device=cols.device)).reshape(-1)
        idx = idx[idx < V]  # ascending: a cut last block stays last, as in the full call
        out = F.linear(H, rows_like(weight, idx), None if bias is None else bias[idx])
        return out[:, torch.searchsorted(idx, cols)]
    return kernel


# in the probe's order, cheapest first: the gathered rows of S, then aligned blocks of 8, 16, 32 and 64 rows
SUBSET_KERNELS: dict[str, Callable[[torch.Tensor, Optional[torch.Tensor]], SubsetFn]] = {
    "gathered": gathered_kernel, **{f"blocked{b}": functools.partial(blocked_kernel, block=b) for b in SUBSET_BLOCKS}}


def subset_mismatches(weight: torch.Tensor, bias: Optional[torch.Tensor], kernel: SubsetFn, seed: int = 0,
                      first: bool = True, rows: tuple = PROBE_ROWS) -> int:
    """How many probed column subsets ``kernel`` computes otherwise than the full call ``F.linear(h, W, b)`` (bit for
    bit): subsets of :data:`PROBE_SIZES` columns (random, the tail, a block), for each of ``rows`` rows of h. ``first``:
    stop at the first difference (returns 0 or 1)."""
    V, d = weight.shape
    g = torch.Generator().manual_seed(seed)
    sizes = [s for s in PROBE_SIZES if s <= V]
    bad = 0
    for n_rows in rows:
        H = torch.randn(n_rows, d, generator=g).to(weight.device, weight.dtype)
        with torch.no_grad():
            full = F.linear(H, weight, bias)
            for n in sizes:
                for cols in (torch.randperm(V, generator=g)[:n].sort().values, torch.arange(V - n, V),
                             torch.arange(n) + int(torch.randint(0, V - n + 1, (1,), generator=g))):
                    cols = cols.to(weight.device)
                    if not torch.equal(kernel(H, cols), full[:, cols]):
                        bad += 1
                        if first:
                            return bad
    return bad


def graph_gather_matches_full(weight: torch.Tensor, capacity: int, rows: int = 1, draws: int = 3) -> bool:
    """Whether the op a sampled :class:`hf_csv.core.static.StaticTopK` reads its values from, ``F.linear(H,
    W[cand.reshape(-1)])`` with ``cand`` [rows, capacity] unsorted candidate rows (one fresh gather at the allocator's
    alignment), gives every row's own columns bit for bit as the full call ``F.linear(H, W)`` does, on random h and
    random candidate sets (``draws`` of them), measured eagerly under the current setting. A sampled compiled head
    hands these values to stock's sampler, which no proof covers (docs/certificates.md §2.0): where this probe fails,
    the call takes the full head. Limits: eager ops. Inductor's default CPU lowering of this matmul calls the same BLAS
    GEMM (``extern_kernels.mm``); max-autotune and backends other than inductor or eager are declined before this
    probe (``hf_csv.transformers.scope._graph_gemm_reason``)."""
    V, d = weight.shape
    C = min(int(capacity), V)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(draws):
            H = torch.randn(rows, d, generator=g).to(weight.device, weight.dtype)
            cand = torch.stack([torch.randperm(V, generator=g)[:C] for _ in range(rows)]).to(weight.device)
            own = torch.diagonal(F.linear(H, weight[cand.reshape(-1)]).view(rows, rows, C),
                                 dim1=0, dim2=1).transpose(0, 1)
            if not torch.equal(own, F.linear(H, weight).gather(1, cand)):
                return False
    return True


def probe_subset_kernel(weight: torch.Tensor, bias: Optional[torch.Tensor], rows: tuple = PROBE_ROWS) -> Optional[str]:
    """The first of :data:`SUBSET_KERNELS` (gathered, then blocks of 8, 16, 32 and 64 rows: the cheapest first) that
    computed every probed column subset as the full call does, bit for bit, for ``rows`` rows of h; ``None`` where none
    did. A kernel that fails stops at its first differing subset; the failing kernels before the winner still add to
    the probe's cost (docs/benchmarks.md, "Value slack": Gemma-3's first probe 0.62 → 1.21 s on host D)."""
    for name, make in SUBSET_KERNELS.items():
        if subset_mismatches(weight, bias, make(weight, bias), rows=rows) == 0:
            return name
    return None


# a Gumbel draw's values lie within this of its shift at the top of the row (ulp 1.2e-4 there); farther, the noise
# would resolve worse than on rows of ordinary magnitude, so the row takes the full head and its own shift
_GUMBEL_FAR = 16 * GUMBEL_SHIFT_FROM


def _slack_too_wide(lo: torch.Tensor, hi: torch.Tensor, on: torch.Tensor, slack: torch.Tensor) -> torch.Tensor:
    """bool [N]: rows whose law interval [lo, hi] on the tokens ``on`` is at least ``GUMBEL_SHIFT_FROM`` wide where the
    values carry slack: the noise must resolve such a row on the full-head path too, so it takes stock's row
    (docs/certificates.md §2.3), decided from the values alone, before the noise is read."""
    width = (hi - lo).masked_fill(~on, 0.0).nan_to_num(0.0).amax(1)
    return (width >= GUMBEL_SHIFT_FROM) & (slack > 0)


def _draw_undecided(tokens: torch.Tensor, g: torch.Tensor, law_lo: torch.Tensor, law_hi: torch.Tensor) -> torch.Tensor:
    """bool [N]: rows where the Gumbel-max winner ``tokens`` could lose for some law within [law_lo, law_hi]: it wins
    for every such law when fl(law_lo_w + g_w) > fl(law_hi_j + g_j) for every other j (fl(x + g) is non-decreasing in
    x). -inf entries never compete."""
    w = tokens[:, None]
    mine = (law_lo.gather(1, w) + g.gather(1, w))[:, 0]
    rest = (law_hi + g).scatter(1, w, float("-inf")).amax(1)
    return ~(mine > rest)


def _acc_dense(logits: torch.Tensor, rows: Optional[torch.Tensor], toks: Optional[torch.Tensor],
               acc: Optional[torch.Tensor]) -> torch.Tensor:
    """[N, V] fp32: the accumulators ``acc`` at (rows, toks), the returned ``logits`` elsewhere."""
    out = logits.float().clone()
    if rows is not None and rows.numel():
        out[rows, toks] = acc
    return out

