"""Symmetric per-row int8 quantization of a head with rigorous per-row error terms.

For every row W_i we store q_i (int8) and s_i with Ŵ_i = s_i q_i, and the exact
(rounded up) quantities

* ``err_l2[i]  >= ||W_i - Ŵ_i||_2``  (weight quantization error)
* ``l1[i]      >= ||Ŵ_i||_1``        (multiplies the per-coordinate activation error)
* ``abs_l1[i]  >= ||W_i||_1``        (floating-point accumulation margins of the recompute)

They are computed in float32 with rigorous rounding margins (proof in :func:`rows_from_codes`), so
every bound built from them is an over-estimate of the real-number quantity.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from hf_csv_kernels.floats import NonFiniteWeightError, gamma, round_up_f32, unit_roundoff

# unit_roundoff, gamma, round_up_f32 and NonFiniteWeightError live in hf_csv_kernels.floats (shared with the C
# quantizer, hf_csv_kernels.native); they stay importable from here, where the quantizer's callers look for them
__all__ = ["Int8Rows", "QuantRows", "quantize_rows_int8", "quantize_rows_fp8", "rows_from_codes", "unit_roundoff",
           "gamma", "round_up_f32", "FP8_E4M3_MAX", "NonFiniteWeightError"]

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass
class Int8Rows:
    """Quantized rows (int8, or fp8 e4m3 from :func:`quantize_rows_fp8`) plus the per-row terms the
    screen's error bound needs. Ŵ_i = scale_i · float(q_i) is exact in fp32 for both formats."""

    q: torch.Tensor  # int8 or float8_e4m3fn [V, d]
    scale: torch.Tensor  # float32 [V]
    err_l2: torch.Tensor  # float32 [V], >= ||W_i - s_i q_i||_2
    l1: torch.Tensor  # float32 [V], >= ||s_i q_i||_1
    abs_l1: torch.Tensor  # float32 [V], >= ||W_i||_1
    # the int8 codes' 4-row interleaved copy (hf_csv_kernels.native's layout) where the quantizer wrote it in its
    # pass (hf_csv's C quantizer), else None (the screen builds it later, hf_csv_kernels.screen.prepare_screen)
    qi: Optional[torch.Tensor] = None

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]


class _Work:
    """Reusable fp32 scratch for one chunk of rows. Each op writes into it (``out=`` / in place):
    a fresh multi-MB tensor per op would be a fresh mmap, and its page faults cost more than the op."""

    def __init__(self, rows: int, d: int, device: torch.device):
        self.a, self.b, self.c = (torch.empty(rows, d, dtype=torch.float32, device=device) for _ in range(3))

    def views(self, n: int):
        return self.a[:n], self.b[:n], self.c[:n]


def _terms_into(out: "Int8Rows", lo: int, w: torch.Tensor, qf: torch.Tensor, s: torch.Tensor,
                buf: torch.Tensor, absw: Optional[torch.Tensor] = None) -> None:
    """Rigorous fp32 error terms of rows ``lo..`` from the weight chunk ``w`` (fp32), the decoded codes
    ``qf`` (fp32, overwritten), scales ``s`` and a scratch ``buf`` of w's shape; written into ``out``.
    ``absw``: ``|w|`` if the caller has it. Proof: :func:`rows_from_codes`."""
    d = w.shape[1]
    u = unit_roundoff()
    g = gamma(d + 3)
    hi = lo + w.shape[0]
    l1_c = torch.abs(qf, out=buf).sum(1).mul_(s).mul_((1 + g) * (1 + 4 * u))  # >= s·Σ|q| = ||ŵ||_1
    diff = torch.sub(w, qf.mul_(s[:, None]), out=buf)
    out.err_l2[lo:hi] = diff.norm(dim=1).mul_(1 + g).add_(l1_c * (3 * u)).mul_(1 + 4 * u)
    out.l1[lo:hi] = l1_c
    out.abs_l1[lo:hi] = (torch.abs(w, out=buf) if absw is None else absw).sum(1).mul_((1 + g) * (1 + 4 * u))


# Rows per chunk: small enough that a chunk's fp32 working copies stay in cache (each op of the
# quantization then runs at cache speed, not memory speed), large enough to amortize the op overhead.
_CHUNK_ELEMS = 1 << 19


def _chunk_rows(d: int, chunk_rows: Optional[int]) -> int:
    return max(1, chunk_rows if chunk_rows else _CHUNK_ELEMS // max(1, d))


def _chunks(V: int, step: int, desc: str, progress: bool):
    """Chunk starts; a tqdm bar appears only if the loop takes longer than a second."""
    starts = range(0, V, step)
    if not progress:
        return starts
    from tqdm.auto import tqdm

    return tqdm(starts, desc=desc, delay=1.0, leave=False, unit="chunk")


def _as_f32(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """``x`` as fp32: itself when it already is (never written), else copied into ``buf``."""
    return x if x.dtype == torch.float32 else buf.copy_(x)


def _quantize_rows(weight: torch.Tensor, chunk_rows: Optional[int], qdtype: torch.dtype, qmax: float,
                   progress: bool = True) -> Int8Rows:
    """Per-row symmetric quantization with scale_i = max|W_i| / qmax: int8 codes round(w/s) clamped to
    ±127, or fp8 e4m3 codes (round to nearest) of w/s clamped to ±448.

    The error terms come from :func:`_terms_into` (fp32 with rigorous margins; the same function that
    :func:`rows_from_codes` uses without the C kernel, so a saved screen and that recompute agree bit for bit), chunked so that
    the working copies stay in cache.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, d], got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise TypeError(f"weight must be floating point, got {weight.dtype}")
    V, d = weight.shape
    q = torch.empty(V, d, dtype=qdtype, device=weight.device)
    scale = torch.empty(V, dtype=torch.float32, device=weight.device)
    out = Int8Rows(q=q, scale=scale, err_l2=torch.empty_like(scale), l1=torch.empty_like(scale),
                   abs_l1=torch.empty_like(scale))
    step = _chunk_rows(d, chunk_rows)
    slots: dict = {}

    def body(lo: int, hi: int, slot: int) -> None:
        if slot not in slots:  # per worker: scratch buffers reused chunk after chunk
            slots[slot] = (_Work(min(step, V), d, weight.device),
                           torch.empty(min(step, V), d, dtype=torch.float32, device=weight.device)
                           if weight.dtype != torch.float32 else None)
        work, wbuf = slots[slot]
        _quantize_chunk(weight, q, scale, out, lo, hi, work, wbuf, qdtype, qmax)

    _run_chunks(V, step, f"hf_csv: quantizing the head ({V} x {d})", progress, body, weight.device)
    return out


def _run_chunks(V: int, step: int, desc: str, progress: bool, body, device: torch.device) -> None:
    """``body(lo, hi, slot)`` over the row chunks, on ``torch.get_num_threads()`` (at most 8) Python workers that
    take chunks from a shared iterator, each with its own scratch ``slot`` and on one intra-op thread. Per-row
    work, so the result does not depend on which worker ran a chunk. Why not torch's own threads: each chunk is
    a dozen small ops, each a fork/join on several intra-op threads, and with another process on a core each
    join can wait a scheduler slice (docs/benchmarks.md §9.1); a worker on a busy core here just takes fewer chunks. The first
    exception stops the others and is raised. The caller's thread count is restored after."""
    cpu = device.type == "cpu"
    prev = torch.get_num_threads()
    workers = max(1, min(8, prev, -(-V // step))) if cpu else 1
    it = iter(_chunks(V, step, desc, progress))
    lock = threading.Lock()
    errors: list = []
    # inference mode is per thread: a worker runs in the caller's, or it could not write the caller's
    # inference-mode buffers in place
    inference = torch.is_inference_mode_enabled()

    def run(slot: int) -> None:
        try:
            if cpu:
                torch.set_num_threads(1)  # this thread's count (the main thread's is restored below)
            with torch.inference_mode(inference):
                while not errors:
                    with lock:
                        lo = next(it, None)
                    if lo is None:
                        return
                    body(lo, min(V, lo + step), slot)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,), name=f"hf_csv-rows-{k}") for k in range(1, workers)]
    try:
        for t in threads:
            t.start()
        run(0)
        for t in threads:
            t.join()
    finally:
        if cpu:
            torch.set_num_threads(prev)
    if errors:
        raise errors[0]


def _quantize_chunk(weight, q, scale, out, lo, hi, work, wbuf, qdtype, qmax) -> None:
    a, b, c = work.views(hi - lo)
    w = _as_f32(weight[lo:hi], wbuf[: hi - lo] if wbuf is not None else None)
    absw = torch.abs(w, out=a)
    amax = absw.amax(1)
    if not bool(torch.isfinite(amax).all()):
        raise NonFiniteWeightError("head weight contains non-finite values")
    sc = amax / qmax
    sc = torch.where(sc > 0, sc, torch.ones_like(sc))  # all-zero row: any scale is exact
    x = torch.div(w, sc[:, None], out=b)
    if qdtype == torch.int8:
        x.round_().clamp_(-127, 127)  # integers: their fp32 values are the codes' exactly
        q[lo:hi].copy_(x)
    else:
        q[lo:hi].copy_(x.clamp_(-qmax, qmax))  # round to nearest e4m3
        x.copy_(q[lo:hi])  # the codes' fp32 values
    scale[lo:hi] = sc
    _terms_into(out, lo, w, x, sc, c, absw)


@torch.no_grad()
def quantize_rows_int8(weight: torch.Tensor, chunk_rows: Optional[int] = None, progress: bool = True) -> Int8Rows:
    """Quantize ``weight`` [V, d] to symmetric per-row int8 (levels −127..127).

    A contiguous float32 CPU head goes through hf_csv's C quantizer where it is available
    (:func:`hf_csv_kernels.native.quantize_i8`: the same codes and scales as the torch path below bit for bit, the
    error terms of :func:`rows_from_codes`' C recompute, and the interleaved copy the screen reads, in one pass over
    the weight; ``chunk_rows`` and ``progress`` do not apply); anything else takes the chunked torch path.
    """
    if weight.dim() == 2 and _native_terms_ok(weight):
        from . import native

        return _check_scale_size(Int8Rows(**native.quantize_i8(weight)))
    return _quantize_rows(weight, chunk_rows, torch.int8, 127.0, progress)


QuantRows = Int8Rows  # the same container serves both formats


@torch.no_grad()
def quantize_rows_fp8(weight: torch.Tensor, chunk_rows: Optional[int] = None, progress: bool = True) -> Int8Rows:
    """Per-row scaled fp8 e4m3 rows (scale_i = max|W_i| / 448), with the same rigorous error terms.

    e4m3 keeps 3 mantissa bits at every magnitude, so small weights keep their relative precision
    (int8 rounds them to a uniform step of max|W_i|/127). Both are one byte per weight: on a GPU
    the screen reads the same bytes; which bound is tighter is an empirical question per head
    (scripts/certify_report.py --quant fp8 measures it).
    """
    if not hasattr(torch, "float8_e4m3fn"):  # pragma: no cover - old torch
        raise RuntimeError("this torch has no float8_e4m3fn dtype")
    return _quantize_rows(weight, chunk_rows, torch.float8_e4m3fn, FP8_E4M3_MAX, progress)


def _native_terms_ok(weight: torch.Tensor, q: Optional[torch.Tensor] = None,
                     scale: Optional[torch.Tensor] = None) -> bool:
    """hf_csv's one-pass C kernel serves this head (a contiguous float32 CPU head, and its contiguous int8 CPU codes
    where ``q`` is given; the kernel available): the quantizer, the terms' recompute and the exact outlier columns."""
    if not (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()):
        return False
    if q is not None and not (q.dtype == torch.int8 and q.device.type == "cpu" and q.is_contiguous()):
        return False
    from . import native

    return weight.shape[1] <= native.MAX_D and native.available()


@torch.no_grad()
def rows_from_codes(weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, chunk_rows: Optional[int] = None,
                    progress: bool = True) -> Int8Rows:
    """Rebuild :class:`Int8Rows` for ``weight`` from stored codes ``q`` and scales, recomputing every
    error term from ``weight`` itself in float32 with rigorous rounding margins.

    The returned terms bound the real quantities for *these* codes whatever they are: codes loaded
    from a file need no trust for soundness (a corrupt or foreign code only loosens the bound; callers
    compare the terms with the stored ones to detect that). One pass over ``weight``: for a float32 CPU head with
    int8 codes in hf_csv's C kernel (:func:`hf_csv_kernels.native.row_terms`, float64 sums: a little tighter than
    the quantizer's stored terms, within the artifact check's slack), else the float32 pass below.

    Margins (u = 2^-24, n = d): a computed difference d_j = fl(w_j − fl(s·q_j)) is within
    u·|ŵ_j|(1+u) + u·|w_j − ŵ_j| + u²|ŵ_j| of the real e_j = w_j − ŵ_j, so
    ||e||_2 <= ||d||_2/(1−u) + 3u·||ŵ||_2, and fl(sqrt(Σ d_j²)) errs by at most γ_{n+2} relatively;
    ||ŵ||_2 <= ||ŵ||_1 = s·Σ|q_j| (an integer sum, exact in float32 below 2^24, or bounded by γ_n).
    """
    if weight.shape != q.shape or scale.shape != (q.shape[0],):
        raise ValueError(f"codes {tuple(q.shape)} / scales {tuple(scale.shape)} do not fit a head of shape "
                         f"{tuple(weight.shape)}")
    V, d = weight.shape
    _check_codes(q, scale)
    s_all = scale.float()
    if _native_terms_ok(weight, q, s_all):
        from . import native

        err_l2, l1, abs_l1 = native.row_terms(weight, q, s_all.contiguous())
        return _check_scale_size(Int8Rows(q=q, scale=s_all, err_l2=err_l2, l1=l1, abs_l1=abs_l1))
    out = Int8Rows(q=q, scale=s_all, err_l2=torch.empty(V, dtype=torch.float32, device=weight.device),
                   l1=torch.empty(V, dtype=torch.float32, device=weight.device),
                   abs_l1=torch.empty(V, dtype=torch.float32, device=weight.device))
    step = _chunk_rows(d, chunk_rows)
    slots: dict = {}

    def body(lo: int, hi: int, slot: int) -> None:
        work = slots.get(slot)
        if work is None:
            work = slots[slot] = _Work(min(step, V), d, weight.device)
        a, b, c = work.views(hi - lo)
        w = _as_f32(weight[lo:hi], a)  # may be the weight itself (float32): _terms_into never writes into w
        _terms_into(out, lo, w, b.copy_(q[lo:hi]), s_all[lo:hi], c)

    _run_chunks(V, step, f"hf_csv: checking the stored screen ({V} x {d})", progress, body, weight.device)
    return _check_scale_size(out)


def _check_codes(q: torch.Tensor, scale: torch.Tensor) -> None:
    """Codes and scales from a file, before any arithmetic: the proofs assume finite, non-negative scales in
    float32 and finite codes (docs/certificates.md §5). A negative scale made the error terms negative, a NaN
    scale NaN bounds that admit no token: both gave wrong "certified" tokens before this check."""
    if not scale.is_floating_point() or scale.dtype not in (torch.float32, torch.float64, torch.float16,
                                                            torch.bfloat16):
        raise ValueError(f"screen scales must be floating point (float32), got {scale.dtype}")
    if q.dtype != torch.int8 and q.dtype != getattr(torch, "float8_e4m3fn", torch.int8):
        raise ValueError(f"screen codes must be int8 or float8_e4m3fn, got {q.dtype}")
    s = scale.float()
    bad = ~torch.isfinite(s) | (s < 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"screen scale of row {i} is {float(scale[i])!r}: every scale must be finite and >= 0 "
                         f"({int(bad.sum())} rows are not)")
    if q.dtype != torch.int8:
        fin = torch.isfinite(q.float()).all(1)
        if not bool(fin.all()):
            raise ValueError(f"screen codes of row {int((~fin).nonzero()[0, 0])} are not finite")


def _check_scale_size(rows: Int8Rows) -> Int8Rows:
    """A scale far above the head's own row keeps the float steps of the estimate and its radius from staying
    finite (an overflowing estimate plus an infinite radius is NaN, and a NaN upper bound admits no token): every
    scale must be at most max(2·||W_i||_1, 1) (the quantizer's is max_j |W_ij| / 127, or 1 for a zero row)."""
    cap = (rows.abs_l1 * 2).clamp(min=1.0)  # (the quantizer gives a zero row scale 1: finite codes, finite terms)
    bad = rows.scale > cap
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"screen scale of row {i} ({float(rows.scale[i]):.6g}) is far above its head row's "
                         f"magnitude (||W_i||_1 <= {float(rows.abs_l1[i]):.6g}): not made from this head")
    return rows
