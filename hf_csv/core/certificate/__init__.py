"""Certificates: exact results from bounds plus an exact recompute on a small sub-vocabulary.

Given sound upper bounds U_i >= ℓ_i (from a :mod:`hf_csv.core.bounds` provider), every method
computes ℓ exactly (fp32 accumulation of the head's own weights) only on a candidate set S
and proves that tokens outside S cannot change the result (proofs: docs/certificates.md):

* :meth:`CertifiedHead.topk` – the top-k set and values equal the full head's;
* :meth:`CertifiedHead.epsilon` – the returned distribution is within TV <= ε of softmax(ℓ/T);
* :meth:`CertifiedHead.sample` – an exact draw from softmax(ℓ/T) (lazy Gumbel-max);
* over the budget, or for non-finite hidden states, the row falls back to the full head (counted).

Everything is vectorized over the batch and the vocabulary; there is no Python loop over
tokens or clusters. This package does not import transformers nor the Hub layer.

Its modules, each calling only the ones below it (a certificate's call never returns into a module it came from):

* :mod:`.head` – :class:`CertifiedHead`: construction, the checks of each call's arguments and rows, and the
  dispatch to its certificate;
* :mod:`.sampling`, :mod:`.epsilon`, :mod:`.topk` – the certificate families (exact sampling; ε-softmax and the
  speculative verify's bounds; top-k and threshold, with the native top-1 epilogue);
* :mod:`.values` – the screen, stock's head, the exact recompute and the values on S with their slack;
* :mod:`.probes` – the BLAS column-subset probes (whether a subset's values are stock's bits);
* :mod:`.slack`, :mod:`.rounding` – decisions within the values' slack, and the float32 rounding steps;
* :mod:`.result` – :class:`CertStats`, :class:`CertResult`.
"""
from hf_csv.core.certificate.head import H_MAX, H_MIN, CertifiedHead
from hf_csv.core.certificate.probes import (PROBE_ROWS, PROBE_SIZES, SUBSET_BLOCK, SUBSET_BLOCKS, SUBSET_KERNELS,
                                            blocked_kernel, fp32_matmul_reason, gathered_kernel,
                                            graph_gather_matches_full, probe_subset_kernel, rows_like,
                                            subset_mismatches, subset_probe_key)
from hf_csv.core.certificate.result import CertResult, CertStats, StockFn, SubsetFn
from hf_csv.core.certificate.rounding import value_interval

__all__ = ["CertStats", "CertResult", "CertifiedHead", "H_MIN", "H_MAX", "StockFn", "SubsetFn", "value_interval",
           "fp32_matmul_reason", "probe_subset_kernel", "subset_mismatches", "subset_probe_key",
           "graph_gather_matches_full", "gathered_kernel", "blocked_kernel", "rows_like", "SUBSET_KERNELS",
           "SUBSET_BLOCKS", "SUBSET_BLOCK", "PROBE_SIZES", "PROBE_ROWS"]
