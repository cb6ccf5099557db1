"""The artifact carries the screen: round trip, identical tokens from a loaded screen, and damaged or
foreign files that give a clear error and never a wrong token."""
import copy
import json
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_csv
from hf_csv import CSVConfig
from hf_csv.hub.artifact import CONFIG_NAME, SCREEN_NAME, CSVArtifact
from hf_csv.core.errors import FingerprintMismatchError, IndexFormatError
from hf_csv_kernels import quantize_rows_int8
from hf_csv_kernels.quantize import rows_from_codes


def _model(seed=0, V=600, scale=12.0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, pad_token_id=0, eos_token_id=V - 1, tie_word_embeddings=False)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(scale)
    return m


def _build(m, tmp_path, **kw):
    art = CSVArtifact.build(m.lm_head.weight, outlier_cols=torch.tensor([3, 7, 11]), **kw)
    art.save_pretrained(tmp_path)
    return art


IDS = torch.tensor([[5, 17, 33, 2, 9, 41]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("assume_subset_exact")  # its sampled call hands the values to stock's sampler
def test_loaded_screen_gives_identical_tokens_and_skips_quantization(tmp_path, monkeypatch, dtype):
    ref = _model().to(dtype)
    _build(ref, tmp_path)
    m = hf_csv.enable(copy.deepcopy(ref))
    import hf_csv.core.bounds as hb

    def no_quantize(*a, **k):
        raise AssertionError("the screen was re-quantized although the artifact holds it")

    monkeypatch.setattr(hb, "quantize_rows_int8", no_quantize)
    for sample in (False, True):
        kw = dict(max_new_tokens=16, do_sample=sample, top_k=20, temperature=0.8)
        torch.manual_seed(1)
        a = ref.generate(IDS, **kw)
        torch.manual_seed(1)
        b = m.generate(IDS, **kw, csv_config=CSVConfig(index=str(tmp_path)))
        assert torch.equal(a, b)
        st = m.csv_last_stats
        assert st["mode"] == "topk" and st["certified"] > 0
    head = hf_csv.transformers.heads.get_certified_head(m.lm_head, CSVConfig(index=str(tmp_path)))
    # the stored calibration was the start; 32 real rows later the columns are re-chosen from the first 8 of them
    assert head.provider._seen is None and head.provider._recalibrate
    fresh = hf_csv.core.bounds.ScreenProvider(m.lm_head.weight, outlier_cols=CSVArtifact.from_pretrained(str(tmp_path))
                                         .screen.outlier_cols, rows=head.provider.rows, recalibrate=True)
    assert fresh.state.outlier_cols.tolist() == [3, 7, 11]


def test_round_trip_and_recomputed_terms(tmp_path):
    m = _model()
    art = _build(m, tmp_path)
    back = CSVArtifact.from_pretrained(tmp_path)
    for k, v in art.screen.tensors.items():
        assert torch.equal(v, back.screen.tensors[k]), k
    rows = back.screen.rows_for(m.lm_head.weight)
    ref = quantize_rows_int8(m.lm_head.weight.detach())
    # the recomputed terms are rigorous upper bounds (float64 reference) and within the check's slack of the stored
    W = m.lm_head.weight.detach().double()
    deq = rows.q.double() * rows.scale.double()[:, None]
    true = {"err_l2": (W - deq).norm(dim=1), "l1": deq.abs().sum(1), "abs_l1": W.abs().sum(1)}
    for k in ("err_l2", "l1", "abs_l1"):
        got, stored = getattr(rows, k), getattr(ref, k)
        assert bool((got.double() >= true[k]).all()) and bool((got <= stored * 1.001 + 1e-6).all()), k
    d = back.describe()
    assert d["parts"]["screen"]["q"]["bytes"] == 600 * 48 and d["config"]["screen"]["num_outliers"] == 3


def test_rows_from_codes_bounds_any_codes():
    """Soundness does not depend on the file: for arbitrary codes the recomputed ||W - s q||_2 bound holds."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(200, 64, generator=g) * 3
    q = torch.randint(-127, 128, (200, 64), generator=g, dtype=torch.int8)
    s = torch.rand(200, generator=g) * 0.1
    rows = rows_from_codes(W, q, s)
    true = (W.double() - q.double() * s.double()[:, None]).norm(dim=1)
    assert bool((rows.err_l2.double() >= true).all())
    assert bool((rows.abs_l1.double() >= W.double().abs().sum(1)).all())
    assert bool((rows.l1.double() >= (q.double() * s.double()[:, None]).abs().sum(1)).all())


def test_a_screen_saved_with_the_c_quantizer_loads_on_a_host_without_it(monkeypatch):
    """Stored terms from the C quantizer's float64 sums, recomputed by the float32 pass (a host without the C kernel):
    the check allows the float32 pass's own margin, which grows with the hidden size (here d = 20,000, where it
    exceeds the fixed 1e-3 slack)."""
    from hf_csv.hub.artifact import ScreenData
    import hf_csv_kernels.quantize as qz

    g = torch.Generator().manual_seed(4)
    W = torch.randn(6, 20000, generator=g)
    r = qz.quantize_rows_int8(W, progress=False)
    sd = ScreenData("int8", {"q": r.q, "scale": r.scale, "err_l2": r.err_l2, "l1": r.l1, "abs_l1": r.abs_l1,
                             "outlier_cols": torch.zeros(0, dtype=torch.long)})
    monkeypatch.setattr(qz, "_native_terms_ok", lambda *a: False)
    rows = sd.rows_for(W)
    assert torch.equal(rows.q, r.q)
    sd.tensors["err_l2"] = r.err_l2 * 0.99  # a stored term 1 % below its recompute is still refused
    with pytest.raises(FingerprintMismatchError):
        sd.rows_for(W)


def test_flipped_byte_truncated_wrong_shape_and_foreign_head(tmp_path):
    m = _model()
    _build(m, tmp_path)
    f = tmp_path / SCREEN_NAME
    data = bytearray(f.read_bytes())
    cfg = CSVConfig(index=str(tmp_path))

    data2 = bytearray(data)
    data2[len(data2) // 2] ^= 0x40  # one flipped byte inside the codes
    f.write_bytes(bytes(data2))
    with pytest.raises(IndexFormatError, match="corrupt or truncated"):
        CSVArtifact.from_pretrained(tmp_path)
    # even with the checksum skipped, the flipped code cannot make a wrong certificate: the terms
    # recomputed from the live head exceed the stored ones, and the load says so
    with pytest.raises(FingerprintMismatchError, match="does not fit this head"):
        CSVArtifact.from_pretrained(tmp_path, verify=False).screen.rows_for(m.lm_head.weight)

    f.write_bytes(bytes(data[: len(data) - 1000]))  # truncated
    with pytest.raises(IndexFormatError, match="corrupt or truncated"):
        CSVArtifact.from_pretrained(tmp_path)
    with pytest.raises(IndexFormatError, match="cannot read"):
        CSVArtifact.from_pretrained(tmp_path, verify=False)
    f.write_bytes(bytes(data))

    # a generate call with a damaged artifact raises before any token; the model is left as it was
    f.write_bytes(bytes(data2))
    mm = hf_csv.enable(copy.deepcopy(m))
    with pytest.raises(IndexFormatError):
        mm.generate(IDS, max_new_tokens=3, do_sample=False, csv_config=cfg)
    assert type(mm.lm_head) is torch.nn.Linear
    f.write_bytes(bytes(data))

    # wrong shape: the config says V = 600, the tensors are of another head
    other = _model(seed=1, V=500)
    _build(other, tmp_path / "o")
    (tmp_path / "o" / CONFIG_NAME).write_text((tmp_path / CONFIG_NAME).read_text().replace(
        json.loads((tmp_path / CONFIG_NAME).read_text())["sha256"][SCREEN_NAME],
        json.loads((tmp_path / "o" / CONFIG_NAME).read_text())["sha256"][SCREEN_NAME]))
    with pytest.raises(IndexFormatError, match="shape"):
        CSVArtifact.from_pretrained(tmp_path / "o")

    # a head of the same shape from another model: refused by fingerprint
    foreign = hf_csv.enable(_model(seed=2))
    with pytest.raises(FingerprintMismatchError, match="fingerprint"):
        foreign.generate(IDS, max_new_tokens=3, do_sample=False, csv_config=cfg)
    # the fingerprint samples every (V // 4096)-th row; a change in an unsampled row is caught by the
    # recomputed terms
    W = torch.randn(8200, 16, generator=torch.Generator().manual_seed(3))
    art = CSVArtifact.build(W)
    W[1] += 0.5
    art.check_head(W)  # the sampled rows agree
    with pytest.raises(FingerprintMismatchError, match="row 1 "):
        art.screen.rows_for(W)


def _set(path, value):
    """fn(raw config) -> raw config with ``path`` ("screen.quant") set to ``value`` (deleted when value is _DEL)."""
    def fn(raw):
        *outer, last = path.split("/")
        d = raw
        for k in outer:
            d = d[k]
        if value is _DEL:
            del d[last]
        else:
            d[last] = value
        return raw
    return fn


_DEL = object()
_INDEX_OK = {"vocab_size": 600, "hidden_size": 48, "num_clusters": 16}
# (id, edit of the parsed csv_artifact.json or raw bytes, a word the message must hold)
MALFORMED_CONFIGS = [
    ("format_version_str", _set("format_version", "2"), "'format_version' must be an integer"),
    ("format_version_null", _set("format_version", None), "'format_version' must be an integer"),
    ("format_version_float", _set("format_version", 2.0), "'format_version' must be an integer"),
    ("sha256_null", _set("sha256", None), "'sha256' must be an object, found null"),
    ("sha256_list", _set("sha256", []), "'sha256' must be an object"),
    ("sha256_value_null", _set(f"sha256/{SCREEN_NAME}", None), f"'sha256.{SCREEN_NAME}' must be a sha256"),
    ("sha256_value_int", _set(f"sha256/{SCREEN_NAME}", 123), f"'sha256.{SCREEN_NAME}' must be a sha256"),
    ("screen_str", _set("screen", "int8"), "'screen' must be an object or null, found a string"),
    ("screen_list", _set("screen", ["int8"]), "'screen' must be an object or null"),
    ("screen_null_with_file", _set("screen", None), "without its 'screen' entry"),
    ("screen_quant_int", _set("screen/quant", 8), "'quant' must be one of"),
    ("screen_quant_unknown", _set("screen/quant", "int4"), "'quant' must be one of"),
    ("screen_num_outliers_str", _set("screen/num_outliers", "3"), "'num_outliers' must be an integer"),
    ("screen_num_outliers_negative", _set("screen/num_outliers", -5), "'num_outliers' must be an integer >= 0"),
    ("vocab_size_str", _set("vocab_size", "600"), "'vocab_size' must be an integer"),
    ("vocab_size_bool", _set("vocab_size", True), "'vocab_size' must be an integer"),
    ("vocab_size_missing", _set("vocab_size", _DEL), "'vocab_size' is missing"),
    ("hidden_size_null", _set("hidden_size", None), "'hidden_size' must be an integer"),
    ("hidden_size_float", _set("hidden_size", 48.0), "'hidden_size' must be an integer"),
    ("fingerprint_int", _set("fingerprint", 5), "'fingerprint' must be a string"),
    ("fingerprint_missing", _set("fingerprint", _DEL), "'fingerprint' is missing"),
    ("head_dtype_null", _set("head_dtype", None), "'head_dtype' must be a string"),
    ("has_bias_str", _set("has_bias", "no"), "'has_bias' must be a boolean"),
    ("has_bias_int", _set("has_bias", 0), "'has_bias' must be a boolean"),
    ("base_model_int", _set("base_model", 5), "'base_model' must be a string or null"),
    ("stats_list", _set("stats", []), "'stats' must be an object"),
    ("stats_null", _set("stats", None), "'stats' must be an object"),
    ("index_str", _set("index", "x"), "'index' must be an object or null"),
    ("index_missing_num_clusters", _set("index", {"vocab_size": 600, "hidden_size": 48}), "'num_clusters' is missing"),
    ("index_num_clusters_str", _set("index", {**_INDEX_OK, "num_clusters": "16"}), "'num_clusters' must be an integer"),
    ("index_metric_int", _set("index", {**_INDEX_OK, "metric": 5}), "'metric' must be one of"),
    ("index_seed_float", _set("index", {**_INDEX_OK, "seed": 0.5}), "'seed' must be an integer"),
    ("index_stats_str", _set("index", {**_INDEX_OK, "stats": "x"}), "'stats' must be an object"),
    ("index_tensors_sha256_int", _set("index", {**_INDEX_OK, "tensors_sha256": 1}), "'tensors_sha256' must be"),
    ("index_unknown_field", _set("index", {**_INDEX_OK, "bogus": 1}), "unknown fields ['bogus']"),
    ("top_level_list", lambda raw: [raw], "must be a JSON object, found an array"),
    ("top_level_null", lambda raw: None, "must be a JSON object, found null"),
    ("top_level_str", lambda raw: "csv", "must be a JSON object, found a string"),
    ("top_level_number", lambda raw: 2, "must be a JSON object, found an integer"),
    ("invalid_json", b"{not json", "not a valid artifact config"),
    ("truncated_json", b'{"vocab_size": 600, "hidden', "not a valid artifact config"),
    ("not_utf8", b'{"fingerprint": "\xff\xfe"}', "not a valid artifact config"),
    ("empty_file", b"", "not a valid artifact config"),
]


def write_malformed_config(base, dest, edit):
    """Copy the artifact directory ``base`` to ``dest`` with its csv_artifact.json edited (a function of the
    parsed JSON, or the file's new bytes)."""
    import shutil

    shutil.copytree(base, dest)
    f = dest / CONFIG_NAME
    if isinstance(edit, bytes):
        f.write_bytes(edit)
    else:
        f.write_text(json.dumps(edit(json.loads(f.read_text()))))
    return dest


@pytest.fixture(scope="module")
def artifact_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("art")
    CSVArtifact.build(_model().lm_head.weight, outlier_cols=torch.tensor([3, 7, 11])).save_pretrained(d)
    return d


@pytest.mark.parametrize("name,edit,words", MALFORMED_CONFIGS, ids=[c[0] for c in MALFORMED_CONFIGS])
def test_malformed_config_field_raises_index_format_error(artifact_dir, tmp_path, name, edit, words):
    """Every field the loader reads, of a wrong type, null, missing or nested wrong: IndexFormatError naming the
    field, the expected type and what was found (was a raw TypeError / AttributeError)."""
    d = write_malformed_config(artifact_dir, tmp_path / "a", edit)
    with pytest.raises(IndexFormatError) as e:
        CSVArtifact.from_pretrained(d)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    if "must be" in words:
        assert "found" in str(e.value)


def test_well_formed_config_still_loads(artifact_dir):
    art = CSVArtifact.from_pretrained(artifact_dir)
    assert art.screen is not None and art.config.screen == {"quant": "int8", "num_outliers": 3}
