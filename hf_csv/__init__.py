"""hf_csv: certified sub-vocabulary LM heads and exact fast speculative sampling for transformers.

Core (no transformers import): :class:`VocabIndex`, bound providers, :class:`CertifiedHead`.
Integration (imports transformers, checks its version): ``enable``, ``install``, ``CSVConfig``.
"""
from __future__ import annotations

import importlib
from typing import Any

from hf_csv.core.certificate import CertifiedHead, CertResult, CertStats
from hf_csv.core.errors import CSVError, FingerprintMismatchError, IndexFormatError, UnsupportedVersionError
from hf_csv.core.index import IndexConfig, VocabIndex

__version__ = "0.1.0"

# name -> module, imported on first use so that the core never pulls in transformers
_LAZY = {
    "CSVConfig": ".core.config",
    "enable": ".transformers.enable",
    "disable": ".transformers.enable",
    "install": ".transformers.enable",
    "uninstall": ".transformers.enable",
    "refresh": ".transformers.enable",
    "custom_generate": ".transformers.enable",
    "CSVArtifact": ".hub.artifact",
    "CSVLogitsProcessor": ".transformers.processors",
    "patch_speculative_sampling": ".transformers.acceptance",
}

__all__ = ["CertifiedHead", "CertResult", "CertStats", "VocabIndex", "IndexConfig", "CSVError",
           "FingerprintMismatchError", "IndexFormatError", "UnsupportedVersionError", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __package__), name)
    raise AttributeError(f"module 'hf_csv' has no attribute {name!r}")
