"""Artifacts that do not fit the head or were tampered with (every stored tensor and config field mutated, with the
checksum updated as a hostile uploader would; an index built for another head): refused with a clear, typed error,
or stock's tokens, never a wrong certified token."""
from __future__ import annotations

import pytest
import torch

import hf_csv
from conftest import _ids, tiny_llama
from hf_csv import CSVConfig
from hf_csv.core.errors import FingerprintMismatchError


def _tensor_mutations():
    """(tensor, name, fn(t) -> mutated t), every stored tensor mutated field by field."""
    out = []
    for k in ("scale", "err_l2", "l1", "abs_l1"):
        out += [(k, "negative", lambda t: -t), (k, "nan", lambda t: t.masked_fill(torch.arange(len(t)) % 7 == 0, float("nan"))),
                (k, "inf", lambda t: torch.full_like(t, float("inf"))), (k, "zero", torch.zeros_like),
                (k, "huge", lambda t: t * 1e30), (k, "float64", lambda t: t.double()), (k, "int", lambda t: t.long()),
                (k, "short", lambda t: t[:-1]), (k, "tiny", lambda t: t * 1e-30),
                (k, "all nan", lambda t: torch.full_like(t, float("nan")))]
    out += [("q", "negated", lambda t: -t), ("q", "zero", torch.zeros_like), ("q", "minus128", lambda t: torch.full_like(t, -128)),
            ("q", "int16", lambda t: t.short()), ("q", "float", lambda t: t.float()), ("q", "transposed", lambda t: t.T.contiguous()),
            ("q", "shuffled", lambda t: t[torch.randperm(len(t), generator=torch.Generator().manual_seed(0))]),
            ("outlier_cols", "repeated", lambda t: torch.cat([t, t[:1]])), ("outlier_cols", "out_of_range", lambda t: t + 1000),
            ("outlier_cols", "negative", lambda t: -t - 1), ("outlier_cols", "float", lambda t: t.float()),
            ("outlier_cols", "2d", lambda t: t[None]), ("outlier_cols", "empty", lambda t: t[:0])]
    # negated codes and scales together: the same Ŵ, a negative error term before the check
    out += [("q+scale", "negated both", None)]
    return out


def _config_mutations():
    return [("vocab_size", 601), ("vocab_size", -1), ("vocab_size", "600"), ("hidden_size", 47), ("hidden_size", None),
            ("fingerprint", "0" * 32), ("fingerprint", None), ("format_version", 99), ("format_version", "x"),
            ("head_dtype", "bfloat16"), ("head_dtype", "nonsense"), ("has_bias", True), ("screen", None),
            ("screen", {"quant": "int4", "num_outliers": 3}), ("screen", {"quant": "fp8", "num_outliers": 3}),
            ("screen", {"quant": "int8", "num_outliers": -5}), ("sha256", {}), ("sha256", None), ("stats", "x"),
            ("index", {"bogus": 1}), ("base_model", 5)]


def _stock_or_clear_error(ref, art_dir):
    """Greedy and top-k sampling through the artifact: a clear, typed error or stock's tokens."""
    import copy
    from hf_csv.core.errors import CSVError

    from test_hub_artifact import IDS
    m = hf_csv.enable(copy.deepcopy(ref))
    for sample in (False, True):
        kw = dict(max_new_tokens=8, do_sample=sample, top_k=20)
        torch.manual_seed(3)
        want = ref.generate(IDS, **kw)
        torch.manual_seed(3)
        try:
            got = m.generate(IDS, **kw, csv_config=CSVConfig(index=str(art_dir)))
        except (CSVError, ValueError, TypeError) as e:
            assert len(str(e)) > 10
            return "refused"
        assert torch.equal(got, want)
    return "stock"


@pytest.fixture(scope="module")
def art_base(tmp_path_factory):
    from test_hub_artifact import _build, _model
    ref = _model()
    d = tmp_path_factory.mktemp("art")
    _build(ref, d)
    return ref, d


def test_unmutated_artifact_certifies(art_base):
    import copy

    from test_hub_artifact import IDS
    ref, d = art_base
    m = hf_csv.enable(copy.deepcopy(ref))
    m.generate(IDS, max_new_tokens=8, do_sample=False, csv_config=CSVConfig(index=str(d)))
    assert m.csv_last_stats["certified"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("key,name,fn", _tensor_mutations(), ids=lambda v: v if isinstance(v, str) else "")
def test_hostile_screen_tensor_refused_or_stock(art_base, tmp_path, key, name, fn, assume_subset_exact):
    """Every stored tensor mutated (the sha256 in the config updated, as a hostile uploader would): refused with
    a clear error, or stock's tokens. Negated or NaN scales gave 6/6 wrong certified calls before."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from hf_csv.hub.artifact import CONFIG_NAME, SCREEN_NAME, _sha256
    ref, base = art_base
    d = tmp_path / "a"
    shutil.copytree(base, d)
    t = load_file(str(d / SCREEN_NAME))
    if key == "q+scale":
        t["q"], t["scale"] = -t["q"], -t["scale"]
    else:
        t[key] = fn(t[key])
    save_file({k: v.contiguous() for k, v in t.items()}, str(d / SCREEN_NAME),
              metadata={"format": "pt", "hf_csv_format": "2"})
    cfg = json.loads((d / CONFIG_NAME).read_text())
    cfg["sha256"][SCREEN_NAME] = _sha256(d / SCREEN_NAME)
    (d / CONFIG_NAME).write_text(json.dumps(cfg))
    _stock_or_clear_error(ref, d)


@pytest.mark.parametrize("field,value", _config_mutations(), ids=str)
def test_hostile_artifact_config_refused_or_stock(art_base, tmp_path, field, value, assume_subset_exact):
    import json
    import shutil

    from hf_csv.hub.artifact import CONFIG_NAME
    ref, base = art_base
    d = tmp_path / "a"
    shutil.copytree(base, d)
    cfg = json.loads((d / CONFIG_NAME).read_text())
    cfg[field] = value
    (d / CONFIG_NAME).write_text(json.dumps(cfg))
    _stock_or_clear_error(ref, d)


def test_index_for_another_head_is_rejected_with_the_screen_provider(tmp_path):
    from hf_csv import CSVArtifact
    m = hf_csv.enable(tiny_llama(scale=20.0))
    other = tiny_llama(scale=20.0, seed=9)
    CSVArtifact.build(other.lm_head.weight, screen=False, index=True, num_clusters=8,
                      progress=False).save_pretrained(tmp_path / "ix")
    with pytest.raises(FingerprintMismatchError):
        m.generate(**_ids(), max_new_tokens=2, csv_config=CSVConfig(index=str(tmp_path / "ix")))
    CSVArtifact.build(m.lm_head.weight, screen=False, index=True, num_clusters=8,
                      progress=False).save_pretrained(tmp_path / "mine")
    m.generate(**_ids(), max_new_tokens=2, csv_config=CSVConfig(index=str(tmp_path / "mine")))
    assert m.csv_last_stats["certified"] > 0
