"""Triton kernels for the certified head and the verify step, each with the signature of its torch
reference (hf_csv_kernels.{screen,gather,cluster,residual}).

Registered by :mod:`hf_csv_kernels.dispatch` through ``OPS`` for CUDA tensors. Tested against the
references on CPU with ``TRITON_INTERPRET=1`` (tests/test_kernels_triton_ops.py). Importing this module
without triton raises ImportError, which the dispatcher treats as "no Triton backend".
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .quantize import gamma, unit_roundoff
from .screen import ScreenState

__all__ = ["OPS", "screen_int8", "screen_int8_with_block_max", "gather_gemv", "cluster_upper", "segmented_gemv",
           "row_logsumexp", "residual_race"]

SCREEN_BLOCK_V = 128
BLOCK_D = 64


# ----------------------------------------------------------------------------- screen
@triton.jit
def _screen_kernel(Q, S, E2, L1, H, HN, COEF, EST, RAD, BMAX, V, D, stride_q, stride_h, stride_o, nblk,
                   BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr):
    pid_v = tl.program_id(0)
    n = tl.program_id(1)
    rows = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    rmask = rows < V
    acc = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        cmask = cols < D
        raw = tl.load(Q + rows[:, None].to(tl.int64) * stride_q + cols[None, :],
                      mask=rmask[:, None] & cmask[None, :], other=0)
        if FP8:
            # e4m3fn bytes decoded exactly with integer ops (no sm89 fp8 unit needed):
            # normal (1 + m/8)·2^(e-7) -> fp32 bits ((e+120) << 23) | (m << 20); subnormal m·2^-9
            b = raw.to(tl.int32)
            e = (b >> 3) & 15
            m = b & 7
            normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
            mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
            q = tl.where((b & 128) != 0, -mag, mag)
        else:
            q = raw.to(tl.float32)
        h = tl.load(H + n * stride_h + cols, mask=cmask, other=0.0)
        acc += tl.sum(q * h[None, :], axis=1)
    s = tl.load(S + rows, mask=rmask, other=0.0)
    est = acc * s
    hn = tl.load(HN + n)
    coef = tl.load(COEF + n)
    rad = tl.load(E2 + rows, mask=rmask, other=0.0) * hn + tl.load(L1 + rows, mask=rmask, other=0.0) * coef
    tl.store(EST + n * stride_o + rows, est, mask=rmask)
    tl.store(RAD + n * stride_o + rows, rad, mask=rmask)
    low = tl.where(rmask, est - rad, float("-inf"))
    tl.store(BMAX + n * nblk + pid_v, tl.max(low, axis=0))


def screen_int8_with_block_max(state: ScreenState, H: torch.Tensor, block: int = SCREEN_BLOCK_V):
    """Weight-only int8 screen in one pass: (est, rad, block_max of est − rad per ``block`` rows).

    Same contract as ``screen_int8_reference``: |<W_i,h> − est| <= rad with
    rad = ||W_i − Ŵ_i||·||h||(1+4u) + γ_{d+2}·||Ŵ_i||_1·||h||_∞. The kernel's fp32 accumulation of the
    exact int8→fp32 products, in any order, errs by at most γ_d·Σ_j|Ŵ_ij h_j| <= γ_d·||Ŵ_i||_1·||h||_∞,
    and the final scale multiply by u·|est|; γ_{d+2} covers both.

    Compiled without FMA contraction, so the block max is of the stored ``est − rad`` rounded as torch rounds it (a
    contracted ``fma(acc, s, −rad)`` differed in the last bit on an H200: docs/benchmarks.md §4).
    """
    rows = state.rows
    H = H.float().contiguous()
    N, D = H.shape
    V = rows.q.shape[0]
    hn = (H.norm(dim=1) * (1 + 4 * unit_roundoff())).contiguous()
    coef = (gamma(D + 2) * H.abs().amax(dim=1)).contiguous()
    est = torch.empty(N, V, dtype=torch.float32, device=H.device)
    rad = torch.empty_like(est)
    nblk = triton.cdiv(V, block)
    bmax = torch.empty(N, nblk, dtype=torch.float32, device=H.device)
    fp8 = rows.q.dtype != torch.int8
    q = rows.q.contiguous().view(torch.uint8) if fp8 else rows.q.contiguous()
    _screen_kernel[(nblk, N)](q, rows.scale, rows.err_l2, rows.l1, H, hn, coef, est, rad, bmax, V, D,
                              q.stride(0), H.stride(0), est.stride(0), nblk, BLOCK_V=block, BLOCK_D=BLOCK_D,
                              FP8=fp8, enable_fp_fusion=False)
    return est, rad, bmax


def screen_int8(state: ScreenState, H: torch.Tensor):
    """The screen for int8 rows or fp8 e4m3 rows (decoded in-kernel, so any CUDA GPU runs it)."""
    est, rad, _ = screen_int8_with_block_max(state, H)
    return est, rad


# ----------------------------------------------------------------------------- gather-GEMV
@triton.jit
def _gather_kernel(W, T, B, H, OUT, M, D, stride_w, stride_h, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = m < M
    t = tl.load(T + m, mask=mmask, other=0).to(tl.int64)
    b = tl.load(B + m, mask=mmask, other=0).to(tl.int64)
    acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        msk = mmask[:, None] & (cols < D)[None, :]
        w = tl.load(W + t[:, None] * stride_w + cols[None, :], mask=msk, other=0.0).to(tl.float32)
        h = tl.load(H + b[:, None] * stride_h + cols[None, :], mask=msk, other=0.0)
        acc += tl.sum(w * h, axis=1)
    tl.store(OUT + m, acc, mask=mmask)


def gather_gemv(weight: torch.Tensor, tokens: torch.Tensor, batch: torch.Tensor, H: torch.Tensor, chunk: int = 0):
    """out[m] = <weight[tokens[m]], H[batch[m]]> in fp32 (weights upcast exactly); as the reference."""
    W = weight.contiguous()
    Hf = H.float().contiguous()
    M = tokens.numel()
    out = torch.empty(M, dtype=torch.float32, device=H.device)
    if M:
        BLOCK_M = 32
        _gather_kernel[(triton.cdiv(M, BLOCK_M),)](W, tokens.contiguous(), batch.contiguous(), Hf, out, M,
                                                  W.shape[1], W.stride(0), Hf.stride(0),
                                                  BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D)
    return out


def segmented_gemv(weight_perm, offsets, cluster_ids, batch, H):
    """Whole clusters of a cluster-contiguous layout: consecutive rows, so the gather is coalesced."""
    starts = offsets[cluster_ids]
    sizes = offsets[cluster_ids + 1] - starts
    pair = torch.repeat_interleave(torch.arange(cluster_ids.numel(), device=H.device), sizes)
    first = torch.cumsum(sizes, 0) - sizes
    pos = starts[pair] + torch.arange(pair.numel(), device=H.device) - first[pair]
    return gather_gemv(weight_perm, pos, batch[pair], H), pos, pair


# ----------------------------------------------------------------------------- cluster bounds
@triton.jit
def _cluster_kernel(MU, R, BMAXB, NMIN, NMAX, H, HN, HINF, OUT, C, D, stride_mu, stride_h, stride_o, u, dslack,
                    SPHERICAL: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    n = tl.program_id(1)
    c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    dot = tl.zeros((BLOCK_C,), dtype=tl.float32)
    l1 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        msk = cmask[:, None] & (cols < D)[None, :]
        mu = tl.load(MU + c[:, None].to(tl.int64) * stride_mu + cols[None, :], mask=msk, other=0.0).to(tl.float32)
        h = tl.load(H + n * stride_h + cols, mask=cols < D, other=0.0)
        dot += tl.sum(mu * h[None, :], axis=1)
        l1 += tl.sum(tl.abs(mu), axis=1)
    hn = tl.load(HN + n)
    hinf = tl.load(HINF + n)
    r = tl.load(R + c, mask=cmask, other=0.0)
    slack = dslack * (tl.abs(dot) + r * hn + l1 * hinf)
    b = dot + r * hn + slack
    if SPHERICAL:
        nmin = tl.load(NMIN + c, mask=cmask, other=0.0)
        nmax = tl.load(NMAX + c, mask=cmask, other=0.0)
        b = tl.where(b >= 0, b * nmax, b * nmin)
        b = b + tl.abs(b) * (2 * u)
    bias = tl.load(BMAXB + c, mask=cmask, other=0.0)
    tl.store(OUT + n * stride_o + c, b + bias + (tl.abs(b) + tl.abs(bias)) * (2 * u), mask=cmask)


def cluster_upper(centroids, radius, bias_max, H, norm_min=None, norm_max=None):
    """U[r, c] >= max_{i in c} <W_i, h_r> + b_i; the reference's bound and margins, one kernel."""
    Hf = H.float().contiguous()
    mu = centroids.float().contiguous()
    N, D = Hf.shape
    C = mu.shape[0]
    u = torch.finfo(torch.float32).eps / 2
    out = torch.empty(N, C, dtype=torch.float32, device=H.device)
    hn = Hf.norm(dim=1).contiguous()
    hinf = Hf.abs().amax(dim=1).contiguous()
    sph = norm_min is not None
    nmin = norm_min.float().contiguous() if sph else radius
    nmax = norm_max.float().contiguous() if sph else radius
    BLOCK_C = 32
    _cluster_kernel[(triton.cdiv(C, BLOCK_C), N)](mu, radius.float().contiguous(), bias_max.float().contiguous(),
                                                  nmin, nmax, Hf, hn, hinf, out, C, D, mu.stride(0), Hf.stride(0),
                                                  out.stride(0), u, 4 * (D + 2) * u,
                                                  SPHERICAL=sph, BLOCK_C=BLOCK_C, BLOCK_D=BLOCK_D)
    return out


# ----------------------------------------------------------------------------- verify
@triton.jit
def _lse_kernel(X, OUT, V, stride, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    m = float("-inf")
    s = 0.0
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        x = tl.load(X + r * stride + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        # online logsumexp; a block (or row) of -inf contributes 0 instead of exp(-inf - -inf) = NaN
        scale = tl.where(m == float("-inf"), 0.0, tl.exp(m - new_m))
        terms = tl.where(x == float("-inf"), 0.0, tl.exp(x - new_m))
        s = s * scale + tl.sum(terms, axis=0)
        m = new_m
    tl.store(OUT + r, m + tl.log(s))


def row_logsumexp(X: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim of [R, V] in one streaming pass per row (−inf rows give −inf)."""
    X = X.contiguous()
    R, V = X.shape
    out = torch.empty(R, dtype=torch.float32, device=X.device)
    _lse_kernel[(R,)](X, out, V, X.stride(0), BLOCK=1024)
    return out


@triton.jit
def _residual_kernel(P, Q, E, KEY, IDX, V, lse_p, lse_q, alpha, inv_width,
                     SIGMOID: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    zp = tl.load(P + offs, mask=mask, other=float("-inf")).to(tl.float32)
    zq = tl.load(Q + offs, mask=mask, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        p = tl.sigmoid((zp - alpha) * inv_width)
        q = tl.sigmoid((zq - alpha) * inv_width)
    else:
        p = tl.exp(zp - lse_p)
        q = tl.exp(zq - lse_q)
    w = tl.maximum(p - q, 0.0)
    e = tl.load(E + offs, mask=mask, other=1.0)
    key = tl.where(mask, w / e, -1.0)
    best = tl.argmax(key, axis=0)
    tl.store(KEY + pid, tl.max(key, axis=0))
    tl.store(IDX + pid, pid * BLOCK + best)


def residual_race(zp, zq, lse_p, lse_q, E, sigmoid=None):
    """Fused residual + race over one row: returns (index, ok); ok is False when the residual is 0."""
    V = zp.numel()
    BLOCK = 1024
    nb = triton.cdiv(V, BLOCK)
    key = torch.empty(nb, dtype=torch.float32, device=zp.device)
    idx = torch.empty(nb, dtype=torch.int64, device=zp.device)
    a, b = sigmoid if sigmoid is not None else (0.0, 1.0)
    _residual_kernel[(nb,)](zp.contiguous(), zq.contiguous(), E.contiguous(), key, idx, V, float(lse_p),
                            float(lse_q), float(a), 1.0 / float(b - a), SIGMOID=sigmoid is not None, BLOCK=BLOCK)
    j = key.argmax()
    return idx[j], bool(key[j] > 0)


OPS = {"screen_int8": screen_int8, "gather_gemv": gather_gemv, "cluster_upper": cluster_upper,
       "segmented_gemv": segmented_gemv, "row_logsumexp": row_logsumexp, "residual_race": residual_race}
