"""The BLAS column-subset probes (docs/certificates.md §2.0): whether ``F.linear`` on a subset of the head's rows (the
gathered rows, else the aligned blocks of 8 to 64 rows that hold them) gives the full call's values bit for bit under
the current setting. No proof gives that property; paths that hand the values on S to stock's own code need it, so it
is measured, once per head, setting and row count (:class:`SubsetProbes`, the head's side of it), and
:func:`fp32_matmul_reason` says where stock's fp32 head is not IEEE fp32 at all."""
from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from hf_csv.core.certificate.result import SubsetFn

logger = logging.getLogger(__name__)

__all__ = ["SUBSET_BLOCKS", "SUBSET_BLOCK", "PROBE_SIZES", "PROBE_ROWS", "SUBSET_KERNELS", "SubsetProbes",
           "subset_probe_key", "fp32_matmul_reason", "rows_like", "gathered_kernel", "blocked_kernel",
           "subset_mismatches", "graph_gather_matches_full", "probe_subset_kernel"]

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


def _probe_cases(weight: torch.Tensor, bias: Optional[torch.Tensor], seed: int = 0,
                 rows: tuple = PROBE_ROWS) -> list:
    """The probe's inputs: per row count of ``rows``, (h, the full call on h, the column subsets), drawn in one
    order from ``seed``: :data:`PROBE_SIZES` columns, each random, the tail and a block."""
    V, d = weight.shape
    g = torch.Generator().manual_seed(seed)
    sizes = [s for s in PROBE_SIZES if s <= V]
    cases = []
    for n_rows in rows:
        H = torch.randn(n_rows, d, generator=g).to(weight.device, weight.dtype)
        subsets = [cols.to(weight.device) for n in sizes
                   for cols in (torch.randperm(V, generator=g)[:n].sort().values, torch.arange(V - n, V),
                                torch.arange(n) + int(torch.randint(0, V - n + 1, (1,), generator=g)))]
        with torch.no_grad():
            cases.append((H, F.linear(H, weight, bias), subsets))
    return cases


def _mismatches(kernel: SubsetFn, cases: list, first: bool) -> int:
    """How many of ``cases``' subsets ``kernel`` computes otherwise than the full call (``first``: stop at one)."""
    bad = 0
    with torch.no_grad():
        for H, full, subsets in cases:
            for cols in subsets:  # (small subsets first: a kernel that rounds otherwise shows it there soonest)
                if not torch.equal(kernel(H, cols), full[:, cols]):
                    bad += 1
                    if first:
                        return bad
    return bad


def subset_mismatches(weight: torch.Tensor, bias: Optional[torch.Tensor], kernel: SubsetFn, seed: int = 0,
                      first: bool = True, rows: tuple = PROBE_ROWS) -> int:
    """How many probed column subsets ``kernel`` computes otherwise than the full call ``F.linear(h, W, b)`` (bit for
    bit): subsets of :data:`PROBE_SIZES` columns (random, the tail, a block), for each of ``rows`` rows of h. ``first``:
    stop at the first difference (returns 0 or 1)."""
    return _mismatches(kernel, _probe_cases(weight, bias, seed, rows), first)


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
    did. A kernel that fails stops at its first differing subset; the full calls are made once and shared by the
    kernels (a failing 8-row probe cost five 8-row GEMMs of the head before; docs/benchmarks.md, "Value slack")."""
    cases = _probe_cases(weight, bias, rows=rows)  # (the full calls once, shared by the kernels tried)
    for name, make in SUBSET_KERNELS.items():
        if _mismatches(make(weight, bias), cases, first=True) == 0:
            return name
    return None


class SubsetProbes:
    """The head's probes of its column-subset kernels, kept per setting (a mixin of
    :class:`hf_csv.core.certificate.head.CertifiedHead`, which sets what it reads: ``weight``, ``bias_native``,
    ``vocab_size`` and the empty verdict maps ``_subset_probe`` and ``_gather_probe``)."""

    weight: torch.Tensor
    bias_native: Optional[torch.Tensor]
    vocab_size: int
    _subset_probe: dict  # (setting, extra row count) -> kernel name or None
    _gather_probe: dict  # (capacity, rows, setting) -> bool

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

    def subset_verdict(self) -> Optional[bool]:
        """The probe's verdict on its own row counts under the current setting, without probing: True (a kernel
        matched, :meth:`subset_exact`), False (none did), None (not probed yet). A caller that defers the probe to
        where it is needed reads this first (hf_csv.transformers.decision)."""
        key = subset_probe_key()
        return None if key not in self._subset_probe else self._subset_probe[key] is not None

    def subset_exact_rows(self, rows: int) -> bool:
        """Whether a probed kernel gives the full call's values for ``rows`` rows of h under the current setting: the
        probe's verdict where it ran on its own row counts (1, 3, 16) and they hold ``rows``, else a probe on ``rows``
        rows alone, run now where it has not (once per setting and row count: one full call and the probed subsets,
        about a third of the three row counts' cost)."""
        known = self.subset_rows_verdict(rows)
        if known is not None:
            return known
        return self._probed(subset_probe_key() + (int(rows),), (int(rows),), True) is not None

    def subset_rows_verdict(self, rows: int) -> Optional[bool]:
        """:meth:`subset_exact_rows`'s answer where a probe already gave it, without probing (None: not probed)."""
        key = self._verdict_key(rows)[0]
        return None if key not in self._subset_probe else self._subset_probe[key] is not None

    def subset_kernel(self, probe: bool = False, rows: Optional[int] = None) -> Optional[str]:
        """The probed subset kernel's name for the current setting and ``rows`` rows of h (``"gathered"``,
        ``"blocked8"`` … ``"blocked64"``), ``None`` where none matched or (``probe=False``) where no probe ran yet
        for them. A row count other than the probe's own (1, 3, 16) gets its own probe on that many rows (a GEMM may
        round by its row count), once per setting: a call's first row count of a kind pays one full call and the
        probed subsets. One of the probe's own row counts takes the probe's verdict, or where only that row count was
        probed (:meth:`subset_exact_rows`), its own."""
        return self._probed(*self._verdict_key(rows), probe)

    def _verdict_key(self, rows: Optional[int]) -> tuple:
        """(key, row counts to probe) of the verdict that holds for ``rows`` rows under the current setting: the
        probe's own (1, 3, 16 rows) where ``rows`` is None or one of them and that probe ran or no probe of ``rows``
        alone did; else that of ``rows`` alone."""
        base = subset_probe_key()
        if rows is None:
            return base, PROBE_ROWS
        own = base + (int(rows),)
        if rows in PROBE_ROWS and (base in self._subset_probe or own not in self._subset_probe):
            return base, PROBE_ROWS
        return own, (int(rows),)

    def _probed(self, key: tuple, rows: tuple, probe: bool) -> Optional[str]:
        """The verdict kept under ``key`` (a probe on ``rows`` rows of h, run now with ``probe`` where none is kept)."""
        if key not in self._subset_probe and probe:
            got = self._subset_probe[key] = probe_subset_kernel(self.weight, self.bias_native, rows=rows)
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
