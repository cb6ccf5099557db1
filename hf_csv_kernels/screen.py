"""The certified int8 screen: screen logits plus a rigorous error radius in one call.

Contract shared by every backend (reference, CPU fbgemm, Triton)::

    est, rad = screen_int8(state, H)      # H: float32 [N, d]
    |<W_i, h_r> - est[r, i]| <= rad[r, i]  for every r, i   (real-number inner product)

``state`` is a :class:`ScreenState` made once per head by :func:`prepare_screen`.
The bias is *not* included; callers add it (and its rounding margin).
"""
from __future__ import annotations

import functools
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from . import native as _native
from .quantize import Int8Rows, _native_terms_ok, gamma, round_up_f32, unit_roundoff

__all__ = ["ScreenState", "Outliers", "make_outliers", "prepare_screen", "screen_int8_reference", "screen_int8_cpu", "fbgemm_available",
           "weight_only_radius", "screen_bounds_cpu"]

# fbgemm's dynamic linear quantizes activations to 7 bits with reduce_range=True; that
# keeps the int16 pair sums of its AVX2 kernel from saturating, which the bound relies on.
_QRANGE = 127
# Slack on the activation step s_X/2 for float rounding in fbgemm's choice of qparams.
_ACT_SLACK = 1e-3


@dataclass(frozen=True)
class Outliers:
    """The columns of h kept in fp32, with what the screen needs for them; swapped as one object (a
    recalibration replaces it while other threads may be reading the old one)."""

    cols: torch.Tensor  # int64 [k]: columns of h kept in fp32 (massive activations)
    # float32 [V, k]: W[:, cols] exactly when prepare_screen had the weight, else Ŵ[:, cols]
    w: torch.Tensor
    # float32 [V], >= ||W_i − Ŵ_i|| over the columns *not* in cols; set only with exact outlier columns
    err_rest: Optional[torch.Tensor] = None
    # ``w`` in 8-row blocks for the native kernel's fused pass (hf_csv_kernels.native.block8), on CPU
    w8: Optional[torch.Tensor] = None


@dataclass
class ScreenState:
    """Everything a screen backend needs for one head (built once, reused every step)."""

    rows: Int8Rows
    outliers: Outliers
    # fbgemm packed weights (CPU fast path): a list of (first row, packed rows); see prepare_screen
    packed: Optional[list] = None
    # hf_csv's own AVX2 kernel (hf_csv_kernels.native): (codes, interleaved?) — rows.q itself until the
    # interleaved copy is built in the background, then that copy; None where the kernel is not used
    native: Optional[tuple] = None
    _swap: threading.Lock = field(default_factory=threading.Lock)
    _cache: dict = field(default_factory=dict)
    # set once ``packed`` is final for the first time (at once, unless packing runs in the background)
    ready: threading.Event = field(default_factory=threading.Event)
    # the native fused pass without a bias, bound to the current codes and outlier set: ``call(H)`` is
    # :func:`screen_bounds_cpu(state, H) <screen_bounds_cpu>` for a contiguous float32 ``H`` (the same kernel call,
    # argument for argument); rebuilt by every assignment of either (:meth:`__setattr__`), None where that pass does
    # not serve
    call: Optional[Callable] = None

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, value)
        if name in ("native", "outliers") and "call" in self.__dict__:  # (after __init__, which sets ``call`` last)
            self._publish()

    def swap_outliers(self, new: "Outliers", expected: Optional["Outliers"] = None) -> bool:
        """Swap in another outlier set as one object (readers take ``outliers`` once per call); with ``expected``,
        only if that is still the current set (a later recalibration wins over an older background build)."""
        with self._swap:
            if expected is not None and self.outliers is not expected:
                return False
            self.outliers = new
            return True

    def set_native(self, lay: Optional[tuple]) -> None:
        """Swap in the native kernel's codes (``(codes, interleaved?)``) as one object."""
        with self._swap:
            self.native = lay

    def _publish(self) -> None:
        """:attr:`call` for the current codes and outlier set (each assignment of either; the background swaps hold
        ``_swap``)."""
        lay = self.native
        args = None if lay is None else _bounds_args(self, lay[0], self.outliers, None)
        self.call = None if args is None else functools.partial(
            _native.screen_bounds, lay[0], self.rows.scale, lay[1], cols=self.outliers.cols, wJ=self.outliers.w8,
            rest_norm=args[0], K=args[1], terms=args[2], bias=None, checked=True)

    @property
    def outlier_cols(self) -> torch.Tensor:
        return self.outliers.cols

    @property
    def w_outlier(self) -> torch.Tensor:
        return self.outliers.w

    @property
    def err_rest(self) -> Optional[torch.Tensor]:
        return self.outliers.err_rest

    @property
    def vocab_size(self) -> int:
        return self.rows.q.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.rows.q.shape[1]


def fbgemm_available() -> bool:
    """True when torch's quantized CPU engine offers the fbgemm dynamic linear."""
    try:
        return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(
            torch.ops.quantized, "linear_dynamic"
        )
    except Exception:  # pragma: no cover - exotic builds
        return False


# Rows per fbgemm pack while the head is being readied. fbgemm's prepack time grows faster than
# linearly with the rows, while a GEMV over several packs costs a little more than over one
# (docs/benchmarks.md §7). So the first calls use chunks, and one whole pack replaces them in the background.
_PACK_ROWS = 65536


def _pack(q: torch.Tensor, scale: torch.Tensor):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates quantized tensor creation
        qw = torch._make_per_channel_quantized_tensor(q, scale.double(), torch.zeros(q.shape[0], dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(qw, None)


def _consolidate(state: "ScreenState") -> None:
    """Background, lowest priority: one pack for all rows, swapped in when done (readers take the
    list once per call, so a call sees either the chunks or the whole pack)."""
    try:
        if hasattr(os, "setpriority"):
            try:  # Linux: a thread's nice value is set through its thread id
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            except OSError:
                pass
        state.packed = [(0, _pack(state.rows.q, state.rows.scale))]
    except Exception:  # keep the chunks; they are correct, only a little slower
        pass


def _pack_chunks(state: "ScreenState", consolidate: bool) -> None:
    """Pack the rows in chunks on ``torch.get_num_threads()`` threads, mark the state ready, then
    (optionally) consolidate in the background."""
    rows = state.rows
    V = rows.q.shape[0]
    starts = list(range(0, V, _PACK_ROWS))
    try:
        if len(starts) == 1:
            state.packed = [(0, _pack(rows.q, rows.scale))]
        else:
            with ThreadPoolExecutor(max(1, min(len(starts), torch.get_num_threads()))) as ex:
                packs = list(ex.map(lambda lo: _pack(rows.q[lo: lo + _PACK_ROWS], rows.scale[lo: lo + _PACK_ROWS]),
                                    starts))
            state.packed = list(zip(starts, packs))
    finally:
        state.ready.set()  # on failure packed stays None: the (slow, correct) reference serves
    if consolidate and state.packed is not None and len(state.packed) > 1:
        # not a daemon: interpreter exit waits for it (a native call cannot be interrupted safely)
        threading.Thread(target=_consolidate, args=(state,), name="hf_csv-screen-pack").start()


def _err_rest(rows: Int8Rows, wJ: torch.Tensor, cols: torch.Tensor,
              low: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A float32 upper bound on ||W_i − Ŵ_i|| over the columns not in ``cols``, per row; ``wJ`` = W[:, cols];
    ``low``: the float64 sums Σ_{j∈cols} (W_ij − Ŵ_ij)² where the caller has them (hf_csv's C pass, the same error
    bound), else computed here.

    ||e_rest||² = ||e||² − ||e_J||² <= err_l2² − (a lower bound on ||e_J||²). In float64: err_l2² is exact
    (a float32 squared), Ŵ_J = s·q exact (24 + 7 bits), and each difference, square and sum of the k terms
    errs by at most (k + 4)·2^-53 relatively, so ``(1 − 1e-12)`` makes the computed ||e_J||² a lower bound for
    any k < 10^3; the square root (relative error 2^-53) is then raised by ``1 + 1e-12`` and rounded up to
    float32. Cost: V·k, not V·d.
    """
    if cols.numel() > 1000:  # the margins above assume it (no head has that many massive activations)
        raise ValueError("at most 1000 exact outlier columns")
    if low is None:
        eJ = wJ.double() - rows.q.index_select(1, cols).double() * rows.scale.double()[:, None]
        low = eJ.square_().sum(1)
    rest = (rows.err_l2.double().square() - low.mul(1 - 1e-12)).clamp_(min=0).sqrt_().mul_(1 + 1e-12)
    return round_up_f32(rest)


def make_outliers(rows: Int8Rows, outlier_cols: Optional[torch.Tensor] = None,
                  weight: Optional[torch.Tensor] = None) -> Outliers:
    """The outlier part of a screen for the columns ``outlier_cols`` (exact W[:, J] when ``weight`` is given,
    see :func:`prepare_screen`). Costs one V×k gather of the weight, not a repack: a screen can swap it in
    (:meth:`ScreenState.swap_outliers`) after a recalibration."""
    V, d = rows.q.shape
    if outlier_cols is None:
        outlier_cols = torch.zeros(0, dtype=torch.long, device=rows.q.device)
    outlier_cols = outlier_cols.to(device=rows.q.device, dtype=torch.long)
    if outlier_cols.numel() and (outlier_cols.min() < 0 or outlier_cols.max() >= d):
        raise ValueError(f"outlier columns must lie in [0, {d})")
    if outlier_cols.unique().numel() != outlier_cols.numel():  # a repeated column would count twice in est
        raise ValueError("outlier columns must be distinct")
    if weight is not None and outlier_cols.numel():
        if tuple(weight.shape) != (V, d):
            raise ValueError(f"weight {tuple(weight.shape)} does not fit the screen rows {(V, d)}")
        if _native_terms_ok(weight, rows.q) and outlier_cols.numel() <= 1000:
            # one pass over the rows in C: the k columns and their squared errors (a strided gather per column is
            # a cache miss per row and column, twice)
            w_out, low = _native.outlier_cols(weight, rows.q, rows.scale.contiguous(), outlier_cols)
            return Outliers(outlier_cols, w_out, _err_rest(rows, w_out, outlier_cols, low), _w8(w_out))
        # one gather of the k columns
        w_out = weight.index_select(1, outlier_cols).to(torch.float32).contiguous()  # fp32/bf16/fp16 -> fp32 is exact
        return Outliers(outlier_cols, w_out, _err_rest(rows, w_out, outlier_cols).to(rows.err_l2.device), _w8(w_out))
    w_out = (rows.q[:, outlier_cols].float() * rows.scale[:, None]).contiguous()
    return Outliers(outlier_cols, w_out, None, _w8(w_out))


def _w8(w: torch.Tensor) -> Optional[torch.Tensor]:
    """The outlier columns in the native kernel's 8-row blocks, where that kernel can read them (else None)."""
    return _native.block8(w) if w.device.type == "cpu" and _native.available() else None


def _use_native(rows: Int8Rows) -> bool:
    """The native kernel serves these rows: int8 codes on a CPU, a hidden size its int32 sums allow, no −128
    code (the kernel's sign trick needs |q| <= 127: hf_csv's quantizer never makes −128, a file might)."""
    q = rows.q
    if q.dtype != torch.int8 or q.device.type != "cpu" or q.dim() != 2 or q.shape[1] > _native.MAX_D:
        return False
    if not _native.available():
        return False
    return q.is_contiguous() and _native.min_code(q) >= -127


def _interleave(state: "ScreenState") -> None:
    """Background: the 4-row interleaved copy of the codes (a little faster to stream), swapped in whole."""
    try:
        qi, mn = _native.interleave(state.rows.q)
        if mn >= -127:
            state.set_native((qi, True))
    except Exception:  # keep the row-major codes: correct, a little slower
        pass


def finish_now(state: "ScreenState") -> None:
    """Build now, in the calling thread, what a native state would otherwise build in the background during its
    first calls (the interleaved codes); a no-op where they exist."""
    if state.native is not None and not state.native[1]:
        _interleave(state)


def prepare_screen(rows: Int8Rows, outlier_cols: Optional[torch.Tensor] = None, pack_cpu: bool = True,
                   consolidate: bool = True, background: bool = False,
                   weight: Optional[torch.Tensor] = None, native: Optional[bool] = None,
                   eager: bool = False) -> ScreenState:
    """Build the per-head screen state; pack the int8 rows for fbgemm when on CPU.

    ``weight``: the head weight the rows quantize. With it, the outlier columns are kept *exactly*
    (W[:, J] in float32, exact for fp32/bf16/fp16 weights) and the screen's weight term shrinks from
    ||W_i − Ŵ_i||·||h|| to ||W_i − Ŵ_i||_rest·||h_rest||: the massive activations, which dominate ||h||,
    no longer multiply a quantization error (docs/certificates.md §1.1, Lemma 1′). Without it, Ŵ[:, J] (as before).

    Packing runs on ``torch.get_num_threads()`` threads in chunks of rows; with ``consolidate`` a
    background thread then builds one pack for all rows (faster per call) and swaps it in. With
    ``background`` and a head of more than one chunk, the chunks are packed in a background thread
    too and ``state.ready`` is set when they are in place; :func:`screen_int8_cpu` waits for it, so
    callers that cannot wait check ``state.ready`` first (hf_csv uses the full head meanwhile).

    ``native`` (default: wherever it is available, :mod:`hf_csv_kernels.native`): hf_csv's own kernel instead,
    for calls of any number of rows, ready at once (no prepack: it reads ``rows.q`` as it is, then a 4-row
    interleaved copy built in the background); fbgemm is not packed then. ``native=False`` keeps fbgemm only.
    ``eager`` (an engine's load step, before it serves): what ``background`` would defer (the exact outlier columns,
    fbgemm's chunks) and, with the native kernel, the interleaved copy are built now, in the calling thread.
    """
    V = rows.q.shape[0]
    background = background and not eager  # an engine's load step builds everything now
    # a large head in the background: the exact outlier columns (a V×k gather of W and float64 terms) follow in a
    # thread; the first calls use Ŵ's columns (Lemma 1: sound, a little looser)
    exact_later = (background and weight is not None and V > _PACK_ROWS and outlier_cols is not None
                   and outlier_cols.numel() > 0)
    state = ScreenState(rows=rows, outliers=make_outliers(rows, outlier_cols, None if exact_later else weight))
    if exact_later:
        def exact(first: Outliers = state.outliers) -> None:
            try:
                state.swap_outliers(make_outliers(rows, first.cols, weight), expected=first)
            except Exception:  # keep Ŵ's columns: sound, a little looser
                pass

        threading.Thread(target=exact, name="hf_csv-screen-outliers").start()
    if pack_cpu and native is not False and _use_native(rows):
        # no prepack: the kernel reads the interleaved copy where the quantizer wrote one in its pass, else the codes
        # as they are at once, the interleaved copy following in the background
        state.set_native((rows.qi, True) if rows.qi is not None else (rows.q, False))
        state.ready.set()
        if eager or rows.qi is not None:
            finish_now(state)  # (a no-op where the interleaved copy is in place)
            return state
        # not daemons (here and below): interpreter exit waits for them (a native call cannot be interrupted safely)
        threading.Thread(target=_interleave, args=(state,), name="hf_csv-screen-interleave").start()
        return state
    if pack_cpu and rows.q.dtype == torch.int8 and rows.q.device.type == "cpu" and fbgemm_available():
        if background and V > _PACK_ROWS:
            threading.Thread(target=_pack_chunks, args=(state, consolidate), name="hf_csv-screen-pack",
                             daemon=False).start()
            return state
        _pack_chunks(state, consolidate)
    state.ready.set()
    return state


def _norm_up(H: torch.Tensor) -> torch.Tensor:
    """||h_r||₂ per row [N, 1], float32, never below the real norm: taken in float64 (a sum of d squares errs by
    at most γ_d in float64, far below 10⁻¹⁰ for any hidden size), raised by 10⁻¹⁰, rounded up. A float32 norm
    could fall short of the real one by up to γ_d relatively, more than the (1 + 4u) the radius allows for the
    float32 products that follow."""
    return round_up_f32(H.double().norm(dim=1, keepdim=True) * (1 + 1e-10))


def weight_only_radius(rows: Int8Rows, H: torch.Tensor) -> torch.Tensor:
    """The error radius of a weight-only int8 screen on fp32 activations ``H`` [N, d] (docs/certificates.md §1.1).

    rad_i = ||W_i − Ŵ_i||_2·||h||_2 (rounded up) + γ_{d+2}·||Ŵ_i||_1·||h||_∞: quantization plus any-order fp32
    accumulation of Ŵ h. The one formula of the screens that run Ŵ h in fp32 (this module's reference,
    :class:`hf_csv.core.static.StaticTopK`).
    """
    d = rows.q.shape[1]
    hn2 = _norm_up(H) * (1 + 4 * unit_roundoff())
    hinf = H.abs().amax(dim=1, keepdim=True)
    return rows.err_l2 * hn2 + rows.l1 * (gamma(d + 2) * hinf)


@torch.no_grad()
def screen_int8_reference(state: ScreenState, H: torch.Tensor, chunk_rows: int = 32768) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch reference: weight-only int8, fp32 activations.

    est = Ŵ h in fp32; rad = ||W_i − Ŵ_i||·||h|| + γ_{d+2}·||Ŵ_i||_1·||h||_∞ (accumulation).
    """
    rows = state.rows
    H = H.float()
    V = rows.q.shape[0]
    est = torch.empty(H.shape[0], V, dtype=torch.float32, device=H.device)
    for lo in range(0, V, chunk_rows):
        w = rows.q[lo : lo + chunk_rows].float() * rows.scale[lo : lo + chunk_rows, None]
        est[:, lo : lo + chunk_rows] = H @ w.T
    return est, weight_only_radius(rows, H)


@torch.no_grad()
def screen_int8_cpu(state: ScreenState, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 GEMV over the rest columns (hf_csv's AVX2 kernel or fbgemm) with the outlier columns of h in fp32.

    Per row r: h = h_J + h_rest. h_rest is scaled by 1/m_r (m_r = ||h_rest||_∞), X = h_rest/m_r, and X is
    quantized with a step s_X, each coordinate within s_X/2 of its level, so |<Ŵ_i, h_rest − ĥ_rest>| <=
    ||Ŵ_i||_1 · m_r · s_X/2:

    * native kernel (:mod:`hf_csv_kernels.native`, wherever it serves): hf_csv rounds
      127·X to the nearest integer itself (signed 8 bits; |X| <= 1), s_X = 1/127, within (0.5 + 2·127u) levels;
    * fbgemm: its per-tensor 7-bit quantization of X over the batch, s_X <= 2/127 (the same relative step for
      every row of the batch).

    The int32 accumulation is exact; the remaining float steps (dequantization, rescale, the fp32 outlier GEMV
    over k columns, one add) are covered by (64u + γ_{k+2})·||Ŵ_i||_1·||h_r||_∞.

    Weight term: ||W_i − Ŵ_i||·||h_r|| with Ŵ's outlier columns; with exact ones (``state.err_rest``, see
    :func:`prepare_screen`) ||W_i − Ŵ_i||_rest·||h_rest|| instead, and the outlier GEMV and the add, now over
    W_J, are covered by an extra (γ_{k+2} + 4u)·||W_i||_1·||h_r||_∞ (docs/certificates.md §1.1, Lemma 1′).
    """
    # the native kernel wherever it serves, any number of rows: it reads the codes once for all of them, and its
    # per-row 8-bit activations bound tighter than fbgemm's 7-bit scale over the call (docs/benchmarks.md §9.12)
    lay = state.native  # read once: the background thread swaps in the interleaved copy
    use_native = lay is not None
    packs = state.packed  # read once: a background thread may swap in one whole pack
    if not use_native:
        if not state.ready.is_set():  # packing in the background: wait (hf_csv's head checks first)
            state.ready.wait()
            packs = state.packed
        if packs is None:  # fp8 rows, or a build without fbgemm: the weight-only reference
            return screen_int8_reference(state, H)
    rows = state.rows
    H = H.float()
    out = state.outliers  # read once: a recalibration may swap in another set meanwhile
    J = out.cols
    h_rest = H.clone()
    if J.numel():
        h_rest[:, J] = 0
    m = h_rest.abs().amax(dim=1, keepdim=True)
    m = torch.where(m > 0, m, torch.ones_like(m))
    X = h_rest / m
    if use_native:
        # |X| <= 1 (a correctly rounded quotient of |h_j| <= m), so |fl(127·X)| <= 127: signed 8 bits
        A = X.mul(_native_levels).round_().to(torch.int8)
        est = _native.screen_i8(lay[0], rows.scale, A, (m / _native_levels).view(-1).contiguous(), lay[1])
        # fl(fl(h_j/m)·127) is within 2·127u of 127·h_j/m, so each level is within 0.5 + 2·127u of it; and
        # est = fl(fl(fl(dot)·s_i)·fl(m/127)) is within 4u of s_i·(m/127)·dot, inside the 64u term below
        s_x = 1.0 / _native_levels
    else:
        if len(packs) == 1:
            est = torch.ops.quantized.linear_dynamic(X, packs[0][1], True)
        else:  # every pack quantizes X alike (its range over the batch), so one step s_x serves all
            est = torch.empty(H.shape[0], rows.q.shape[0], dtype=torch.float32, device=H.device)
            for lo, pk in packs:
                part = torch.ops.quantized.linear_dynamic(X, pk, True)
                est[:, lo: lo + part.shape[1]] = part
        est.mul_(m)
        # the step fbgemm chooses: range of X over the whole batch, including 0, over 127 levels
        s_x = (X.max().clamp(min=0) - X.min().clamp(max=0)) / _QRANGE
    if J.numel():
        est.addmm_(H[:, J], out.w.T)
    act = m * (0.5 * (1 + _ACT_SLACK)) * s_x  # [N, 1]
    u = unit_roundoff()
    hinf = H.abs().amax(dim=1, keepdim=True)
    coef = act + (64 * u + gamma(J.numel() + 2)) * hinf
    if out.err_rest is not None:
        hn2 = _norm_up(h_rest) * (1 + 4 * u)
        rad = torch.mul(out.err_rest, hn2).addcmul_(rows.l1, coef)
        # + 4u·||W_i||_1·||h_r||_∞: the caller's rounding margin for est + rad (hf_csv.core.bounds) assumes
        # |est| <= 2·||Ŵ_i||_1·||h_r||_∞, and the exact outlier part is bounded by ||W_i||_1, not ||Ŵ_i||_1
        return est, rad.addcmul_(rows.abs_l1, (gamma(J.numel() + 2) + 4 * u) * hinf)
    hn2 = _norm_up(H) * (1 + 4 * u)
    rad = torch.mul(rows.err_l2, hn2).addcmul_(rows.l1, coef)
    return est, rad


@torch.no_grad()
def screen_bounds_cpu(state: ScreenState, H: torch.Tensor, bias: Optional[torch.Tensor] = None
                      ) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(est, upper, top) in one pass of hf_csv's native kernel, or None where that kernel does not serve this call
    (not built, or not for these rows): then :func:`screen_int8_cpu` and the caller's margins.

    The bound is :func:`screen_int8_cpu`'s radius plus the caller's rounding margins (docs/certificates.md §1.1,
    Theorem 1 with Lemma 1′ and 2′): upper_i = est_i + e_i^R‖h_R‖₂(1+4u) + l_i(m·s_X/2·(1+10⁻³) + (64u + γ_{k+2} +
    4u)‖h‖_∞) [+ (γ_{k+2} + 4u)·a_i‖h‖_∞ with exact outlier columns] [+ 2u|b_i| with a bias], with the norm taken
    in float64 and raised by 10⁻¹⁰, the sum evaluated in float64 and rounded up to float32 in the kernel. ``est``
    includes the outlier columns and the bias; ``top`` [N] is the first index of each row's largest ``est``.
    Weight-only bounds hold in real arithmetic for float32 ``H`` rows; the caller handles non-finite rows.
    """
    lay = state.native  # read once: the background thread swaps in the interleaved copy
    if lay is None:
        return None
    out = state.outliers  # read once: a recalibration may swap in another set meanwhile
    args = _bounds_args(state, lay[0], out, bias)
    if args is None:
        return None
    exact, K, terms, b = args
    return _native.screen_bounds(lay[0], state.rows.scale, lay[1], H.float().contiguous(), out.cols, out.w8, exact, K,
                                 terms, b, checked=True)


def _bounds_args(state: ScreenState, q: torch.Tensor, out: Outliers, bias: Optional[torch.Tensor]) -> Optional[tuple]:
    """(rest_norm, K, terms, bias as float32) of :func:`screen_bounds_cpu` for the codes ``q`` and the outlier set
    ``out`` the caller read, checked and computed once per set and bias (the state's tensors do not change; every
    layout of the codes has the same shape); None where the native pass cannot read ``out``."""
    if out.w8 is None:
        return None
    # keyed by the caller's bias object, not by b: a bias of another dtype gives a fresh copy every call
    key = ("bounds_checked", id(out), id(bias))
    got = state._cache.get(key)
    if got is None:  # once per outlier set and bias
        rows = state.rows
        exact = out.err_rest is not None
        terms = [out.err_rest, rows.l1, rows.abs_l1] if exact else [rows.err_l2, rows.l1]
        b = None if bias is None else bias.float().contiguous()
        _native.check_bounds_inputs(q, rows.scale, out.cols, out.w8, terms, b)
        u = unit_roundoff()
        g = gamma(out.cols.numel() + 2)
        # K: ‖h_R‖ (‖h‖) times (1+4u) for the weight term; l_i's coefficient m·s_X/2·(1+10⁻³) + (64u + γ_{k+2} +
        # 4u)·‖h‖_∞ (Lemma 2′'s step, Lemma 3's float steps, the provider's 4u for |est|); a_i's (γ_{k+2} + 4u)·‖h‖_∞
        # with exact outlier columns; 2u for |b_i|
        K = (1 + 4 * u, 0.5 * (1 + _ACT_SLACK) / _native_levels, 64 * u + g + 4 * u, (g + 4 * u) if exact else 0.0,
             2 * u)
        # holds out and bias, so their ids are not reused while the entry lives
        got = state._cache[key] = (out, bias, (exact, K, terms, b))
    return got[2]


# the native kernel's activation levels: 127·X rounded, X in [−1, 1]
_native_levels = 127.0
