"""hf_csv: certified sub-vocabulary LM heads and exact fast speculative sampling for transformers.

Core (no transformers import): :class:`VocabIndex`, bound providers, :class:`CertifiedHead`.
Integration (imports transformers, checks its version): ``enable``, ``install``, ``CSVConfig``.
"""
from __future__ import annotations

import importlib
from typing import Any

from .certificate import CertifiedHead, CertResult, CertStats
from .errors import CSVError, FingerprintMismatchError, IndexFormatError, UnsupportedVersionError
from .index import IndexConfig, VocabIndex

__version__ = "0.1.0"

# name -> module, imported on first use so that the core never pulls in transformers
_LAZY = {
    "CSVConfig": "hf_csv.config",
    "enable": "hf_csv.generation",
    "disable": "hf_csv.generation",
    "install": "hf_csv.generation",
    "uninstall": "hf_csv.generation",
    "refresh": "hf_csv.generation",
    "custom_generate": "hf_csv.generation",
    "CSVArtifact": "hf_csv.artifact",
    "CSVLogitsProcessor": "hf_csv.processors",
    "patch_speculative_sampling": "hf_csv.verify",
}

__all__ = ["CertifiedHead", "CertResult", "CertStats", "VocabIndex", "IndexConfig", "CSVError",
           "FingerprintMismatchError", "IndexFormatError", "UnsupportedVersionError", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_csv' has no attribute {name!r}")
