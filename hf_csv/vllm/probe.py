"""Whether an engine's GEMM on a subset of the head's rows equals its full call bit for bit: the measurement that
the plugin's values rows rest on (``RowPlan.values``: vLLM's values on a set S handed to its own sampler).

No proof gives that property; a probe is evidence (as ``CertifiedHead.subset_exact`` is for ``F.linear``:
docs/certificates.md §2.0). The engine's kernel is passed in (``hf_csv.vllm.subset.engine_subset_kernel`` in
vLLM): this module imports no vLLM."""
from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["ENGINE_PROBE_ROWS", "engine_subset_matches"]

# the largest batch whose rows engine_subset_matches tries (a full call of this many rows, row slices of 1 to all of
# them): rows that hand values to vLLM's sampler are certified in batches up to it only
ENGINE_PROBE_ROWS = 64


def engine_subset_matches(kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                        full: Callable[[torch.Tensor], torch.Tensor], hidden: int, vocab: int,
                        dtype: torch.dtype, seed: int = 0, rows: Optional[int] = None,
                        H: Optional[torch.Tensor] = None, ref: Optional[torch.Tensor] = None) -> bool:
    """Whether ``kernel(H, cols)`` (the engine's own GEMM on the head's rows ``cols``) equals its full call's
    columns ``cols`` bit for bit, on subsets of 1 to 1,000 rows (random, a block, the tail): for full calls of 8 and
    ``ENGINE_PROBE_ROWS`` rows and row slices of 1 to all of them (``rows`` None), or for a full call of ``rows`` rows and
    slices of 1, about a half, the last two thirds and all of them (a batch of that size, probed when first met).
    Each slice is a fresh contiguous tensor, as ``certify_batch`` passes a plan's rows. Plans that hand hf_csv's
    values to vLLM's sampler (``RowPlan.values``) need that property, which no proof gives (a probe is evidence, as
    ``CertifiedHead.subset_exact`` is for ``F.linear``: docs/certificates.md §2.0); they run in batches of at most
    ``ENGINE_PROBE_ROWS`` rows, each batch size probed.

    ``H`` (with ``rows`` None): the batch size's probe on these hidden states, a batch's own, against ``ref``, the
    full call's output on them where the caller has it (vLLM's head on that batch: the probe then costs no full call
    of its own), else ``full(H)``; the same subsets and row slices as ``rows=H.shape[0]``."""
    g = torch.Generator().manual_seed(seed)
    subsets = [torch.randperm(vocab, generator=g)[:m].sort().values for m in (1, 2, 3, 16, 257, min(1000, vocab))]
    subsets += [torch.arange(min(1000, vocab)), torch.arange(max(0, vocab - 300), vocab)]
    given = H
    if given is not None:
        rows = given.shape[0]
    if rows is None:
        plan = ((8, ((0, 1), (2, 5), (0, 8))), (ENGINE_PROBE_ROWS, ((0, 1), (5, 22), (10, 50), (0, ENGINE_PROBE_ROWS))))
    else:
        n = int(rows)
        plan = ((n, tuple(sorted({(0, 1), (0, max(1, n // 2)), (n // 3, n), (0, n)}))),)
    for n, slices in plan:
        if given is None:
            H = (torch.randn(n, hidden, generator=g) * 3).to(dtype)
            ref = full(H)
        elif ref is None:
            ref = full(H)
        for cols in subsets:
            for a, b in slices:
                part = H if (a, b) == (0, n) else H[a:b].clone()
                if not torch.equal(kernel(part, cols), ref[a:b][:, cols]):
                    return False
    return True
