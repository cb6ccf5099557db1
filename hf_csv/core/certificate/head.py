"""The certified head: :class:`CertifiedHead` builds a head's screen and error terms and runs each certificate on
the rows it can certify (rows with a non-finite or out-of-range hidden state take stock's full call). The
certificates themselves live in their families' modules (:mod:`.topk`, :mod:`.epsilon`, :mod:`.sampling`), on the
values of :mod:`.values`."""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Union

import torch

from hf_csv_kernels import gamma, get_op
from hf_csv_kernels.native import top1_constants
from hf_csv.core.bounds import BoundProvider, keeps_state, make_provider
from hf_csv.core.certificate.epsilon import EpsilonCertificates
from hf_csv.core.certificate.result import CertResult, CertStats, StockFn, SubsetFn
from hf_csv.core.certificate.sampling import SamplingCertificates, sample_warps
from hf_csv.core.config import DEFAULT_BUDGET
from hf_csv.core.index import VocabIndex
from hf_csv.core.speculative import gumbel_noise
from hf_csv.core.speed import ThreadTuner, rows_bucket, untimed

__all__ = ["CertifiedHead", "H_MIN", "H_MAX"]

# The range of ||h||_∞ a certified row needs (rows outside it, NaN and inf rows too, get the full head): within it
# no step of the screen underflows (its activation step m/127 stays a normal float32) or overflows, and stock's
# products are covered by the absolute underflow term of stock_error. Real hidden states sit near 1-100.
H_MIN = 2.0 ** -64
H_MAX = 2.0 ** 64


class CertifiedHead(SamplingCertificates, EpsilonCertificates):
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

    Built here, checked and dispatched here (the public certificate methods); computed in its bases, each a module
    of this package: :class:`~.sampling.SamplingCertificates` (on :class:`~.topk.TopKCertificates`) and
    :class:`~.epsilon.EpsilonCertificates`, on :class:`~.values.HeadValues` and :class:`~.probes.SubsetProbes`.

    Args:
        weight: head weight [V, d] (any float dtype; never copied).
        bias: optional [V].
        provider: ``"screen"`` (default), ``"cluster"``, or a provider object.
        index: a :class:`VocabIndex` for the cluster provider (an artifact's, from a path:
            ``CSVArtifact.from_pretrained(path).index``; ``TypeError`` for anything else).
        budget: max |S| before falling back to the full head: an int, or a fraction of V.
        tune_threads: on CPU, time each call on the caller's thread count and on one and keep the faster
            (:class:`~hf_csv.core.speed.ThreadTuner`); False runs on the caller's count (an engine that owns
            the thread count, as vLLM's CPU worker does).
    """

    @keeps_state
    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 provider: Union[str, BoundProvider] = "screen", index: Optional[VocabIndex] = None,
                 budget: Union[int, float] = DEFAULT_BUDGET, tune_threads: bool = True, **provider_kwargs):
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"head weight must be a floating [V, d] tensor, got {tuple(weight.shape)} {weight.dtype}")
        self.weight = weight.detach()
        self.bias_native = None if bias is None else bias.detach()  # for the stock op, in its own dtype
        self.bias = None if bias is None else bias.detach().float()
        self.vocab_size, self.hidden_size = weight.shape
        if index is not None and not isinstance(index, VocabIndex):
            # the core never reads the Hub layer: a caller with an artifact's path loads it first
            raise TypeError(f"index must be a VocabIndex or None, got {type(index).__name__} {index!r}: load an "
                            "artifact with hf_csv.hub.artifact.CSVArtifact.from_pretrained(path).index")
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

    # ------------------------------------------------------- the call's rows
    def _check(self, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 copy, hidden states in the weight dtype as the stock head receives them)."""
        if not torch.is_tensor(H) or not H.is_floating_point():
            raise TypeError(f"hidden states must be a floating tensor, got {type(H).__name__} "
                            f"{getattr(H, 'dtype', '')}")
        if H.dim() != 2 or H.shape[1] != self.hidden_size:
            raise ValueError(f"hidden states must be [N, {self.hidden_size}], got {tuple(H.shape)}")
        return H.float(), (H if H.dtype == self.weight.dtype else H.to(self.weight.dtype))

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
        """``fn`` (a certificate on the checked rows) where every row's ||h||_∞ lies in [H_MIN, H_MAX]; else stock's
        full call on every row of the call, counted (a sampled call's rows then carry no draw: tokens -1)."""
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
        warps = sample_warps(temperature, top_k, warps)
        if noise is not None and (noise.dim() != 2 or noise.shape[1] != self.vocab_size):
            raise ValueError(f"noise must be [N, {self.vocab_size}], got {tuple(noise.shape)}")
        return self._run_nonfinite(H, self._sample, warps=warps, generator=generator, out_dtype=out_dtype,
                                   post=post, noise=noise, with_conf=with_conf, stock=stock)

