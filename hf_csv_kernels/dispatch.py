"""The one place where an op's implementation is chosen by device.

Backends:
* ``triton``    – CUDA tensors with triton importable (``hf_csv_kernels.triton_ops``);
* ``cpu``       – the fast CPU path (fbgemm int8 screen, hf_csv's native kernel's wrappers) where one exists;
* ``native``    – on CPU, hf_csv's own C kernel (:mod:`hf_csv_kernels.native`) called directly, preferred to
  ``cpu`` where it is built (an op only the native kernel has: none where it is not);
* ``reference`` – plain torch, every op, every device.

``HF_CSV_KERNELS=reference`` (or ``cpu`` / ``triton``) forces a backend; an op without
that backend falls back to its reference. Callers resolve an op once (per head) and keep the function: the choice
follows the environment and the kernel's build at that moment.
"""
from __future__ import annotations

import importlib
import logging
import os
from typing import Callable, Optional

import torch

from . import cluster, gather, native, residual, screen

logger = logging.getLogger(__name__)

__all__ = ["backend_for", "get_op", "register", "available_backends"]

_REGISTRY: dict[str, dict[str, Callable]] = {
    "screen_int8": {"reference": screen.screen_int8_reference, "cpu": screen.screen_int8_cpu},
    # optional, no reference: est, upper and each row's top estimate in one pass, or None where it does not serve
    "screen_bounds": {"cpu": screen.screen_bounds_cpu},
    # optional, no reference (hf_csv.core.certificate's torch path is): the top-1 epilogue, or None
    "top1": {"native": native.top1},
    "gather_gemv": {"reference": gather.gather_gemv_reference},
    "cluster_upper": {"reference": cluster.cluster_upper_reference},
    "segmented_gemv": {"reference": cluster.segmented_gemv_reference},
    "row_logsumexp": {"reference": residual.row_logsumexp_reference},
    "residual_race": {"reference": residual.residual_race_reference},
}
_triton_loaded = False


def register(op: str, backend: str, fn: Callable) -> None:
    """Register ``fn`` as the ``backend`` implementation of ``op``."""
    _REGISTRY.setdefault(op, {})[backend] = fn


def _load_triton() -> bool:
    global _triton_loaded
    if not _triton_loaded:
        _triton_loaded = True
        try:
            mod = importlib.import_module(".triton_ops", __package__)
            for op, fn in getattr(mod, "OPS", {}).items():
                register(op, "triton", fn)
        except ImportError as e:  # triton missing: references serve
            logger.debug("triton kernels unavailable: %s", e)
    return any("triton" in v for v in _REGISTRY.values())


def backend_for(device: torch.device | str) -> str:
    """The backend used for tensors on ``device`` (honours ``HF_CSV_KERNELS``)."""
    forced = os.environ.get("HF_CSV_KERNELS", "").strip().lower()
    if forced:
        if forced not in ("reference", "cpu", "triton"):
            raise ValueError(f"HF_CSV_KERNELS must be reference, cpu or triton, got {forced!r}")
        if forced == "triton":
            _load_triton()
        return forced
    dev = torch.device(device)
    if dev.type == "cuda" and _load_triton():
        return "triton"
    if dev.type == "cpu":
        return "cpu"
    return "reference"


def get_op(op: str, device: torch.device | str, optional: bool = False) -> Optional[Callable]:
    """Implementation of ``op`` for ``device``; the reference when the backend lacks it (``optional``: None when
    there is no reference either — an op only some backends have)."""
    impls = _REGISTRY.get(op)
    if impls is None:
        raise KeyError(f"unknown op {op!r}; known: {sorted(_REGISTRY)}")
    backend = backend_for(device)
    impl = impls.get("native") if backend == "cpu" and "native" in impls and native.available() else None
    impl = impl or impls.get(backend, impls.get("reference"))
    if impl is None and not optional:
        raise KeyError(f"op {op!r} has no implementation for {torch.device(device)} and no reference")
    return impl


def available_backends(op: str) -> list[str]:
    _load_triton()
    return sorted(_REGISTRY[op])
