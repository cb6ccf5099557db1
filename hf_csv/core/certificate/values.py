"""The head's values and their bounds: the provider's screen (upper bounds U_i >= ℓ_i), stock's head, the exact fp32
recompute with its rounding bound, and the values on a candidate set S with the slack that bounds their distance from
stock's (docs/certificates.md §2.0). :class:`HeadValues` is what every certificate family builds on."""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

from hf_csv_kernels import gamma
from hf_csv.core.bounds import BoundProvider
from hf_csv.core.certificate.probes import SUBSET_KERNELS, SubsetProbes
from hf_csv.core.certificate.result import CertStats, StockFn, SubsetFn, _Dense
from hf_csv.core.certificate.rounding import _down
from hf_csv.core.speed import caller_threads, untimed

__all__ = ["HeadValues"]


class HeadValues(SubsetProbes):
    """The screen, stock's head, the exact recompute and the values on S of a head (a base of
    :class:`hf_csv.core.certificate.head.CertifiedHead`, whose ``__init__`` sets the attributes read here: the weight
    and bias, the provider, the budget, the gather op and the accumulation-error terms ``_gam``, ``_underflow``,
    ``_abs_l1``, ``_l1_max``, ``_b_max``, ``_dense_cutoff``)."""

    provider: BoundProvider
    hidden_size: int
    bias: Optional[torch.Tensor]
    budget: int
    _gather: Callable
    _gam: float
    _underflow: float
    _abs_l1: torch.Tensor
    _l1_max: float
    _b_max: float
    _dense_cutoff: int

    # ------------------------------------------------------- the provider's screen
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

    # ------------------------------------------ stock's head and the exact recompute
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

    # ------------------------------------------------- the values on S and their slack
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
