"""hf_csv._compat: the supported transformers versions and the version gate."""
from __future__ import annotations

import pytest

from hf_csv._compat import check_transformers_version, unsupported_reason
from hf_csv.errors import UnsupportedVersionError


def test_version_gate():
    for v in ("4.57.0", "4.57.6", "5.20.0", "5.21.1", "5.22.3", "5.23.1"):
        assert check_transformers_version(v) == v and unsupported_reason(v) is None
    for v in ("4.56.2", "5.19.0", "5.24.0", "6.0.0"):
        assert "not a tested version" in unsupported_reason(v)
        with pytest.raises(UnsupportedVersionError, match=v.replace(".", r"\.")):
            check_transformers_version(v)
