"""transformers version gate for the integration modules (head swap, generate wrapper).

The integration relies on internals read from transformers 5.23 (DESIGN.md §5): where the head
is applied, ``_get_logits_processor``'s contract, the ``_sample``/``_beam_search`` loops. Other
versions fail clearly instead of silently producing uncertified output.
"""
from __future__ import annotations

import os

from .errors import UnsupportedVersionError

TESTED = ((5, 23),)  # (major, minor) series tested


def _parse(v: str) -> tuple[int, int]:
    parts = v.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return (-1, -1)


def check_transformers_version(version: str | None = None) -> str:
    """Return the transformers version, or raise :class:`UnsupportedVersionError`.

    ``HF_CSV_ALLOW_UNTESTED=1`` skips the check (at your own risk: outputs stay certified only
    if the integration points of DESIGN.md §5 are unchanged).
    """
    if version is None:
        import transformers

        version = transformers.__version__
    if os.environ.get("HF_CSV_ALLOW_UNTESTED") == "1":
        return version
    if _parse(version) not in TESTED:
        tested = ", ".join(f"{a}.{b}.x" for a, b in TESTED)
        raise UnsupportedVersionError(
            f"hf_csv's generate integration was tested with transformers {tested}; found {version}. "
            "Install a tested version, or set HF_CSV_ALLOW_UNTESTED=1 to try anyway.")
    return version
