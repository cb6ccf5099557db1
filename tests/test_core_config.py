"""hf_csv.core.config: ``CSVConfig`` validates every field on construction (a bad value names the field)."""
from __future__ import annotations

import pytest

from hf_csv import CSVConfig
@pytest.mark.parametrize("kw,field", [({"mode": "fast"}, "mode"), ({"epsilon": 0.0}, "epsilon"),
                                      ({"epsilon": 1.5}, "epsilon"), ({"provider": "x"}, "provider"),
                                      ({"budget": 0}, "budget"), ({"budget": 1.5}, "budget"),
                                      ({"num_outliers": -1}, "num_outliers"), ({"stats": "yes"}, "stats"),
                                      ({"provider": "cluster"}, "index"), ({"index": 3}, "index")])
def test_config_rejects_bad_values(kw, field):
    with pytest.raises(ValueError, match=field):
        CSVConfig(**kw)


def test_speculative_field_is_validated():
    with pytest.raises(ValueError, match="speculative"):
        CSVConfig(speculative="fast")
