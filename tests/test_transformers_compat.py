"""hf_csv.transformers.compat: the supported transformers versions and the version gate."""
from __future__ import annotations

import pytest

from hf_csv.transformers.compat import cache_kwarg, caller_passed_cache, check_transformers_version, unsupported_reason
from hf_csv.core.errors import UnsupportedVersionError


def test_version_gate():
    for v in ("4.57.0", "4.57.6", "5.20.0", "5.21.1", "5.22.3", "5.23.1", "5.24.0"):
        assert check_transformers_version(v) == v and unsupported_reason(v) is None
    for v in ("4.56.2", "5.19.0", "5.25.0", "6.0.0"):
        assert "not a tested version" in unsupported_reason(v)
        with pytest.raises(UnsupportedVersionError, match=v.replace(".", r"\.")):
            check_transformers_version(v)


def test_cache_keyword_per_version():
    """5.24 renamed the forward's KV-cache keyword; the pre-hook that counts a call's positions reads the version's."""
    assert cache_kwarg("5.23.0") == cache_kwarg("4.57.6") == "past_key_values"
    assert cache_kwarg("5.24.0") == "cache"
    assert caller_passed_cache({"cache": object()}) and caller_passed_cache({"past_key_values": object()})
    assert not caller_passed_cache({"past_key_values": None, "use_cache": True})
