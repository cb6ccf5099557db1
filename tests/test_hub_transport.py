"""Hub round trips through huggingface_hub's real code paths, against a local HTTP double
(tests/hub_double.py documents exactly which endpoints it emulates)."""
import os

import pytest
import torch

from hf_csv.core.errors import FingerprintMismatchError, IndexFormatError
from hf_csv.hub import transport as hub_mod
from hf_csv.hub.artifact import ARTIFACT_FILES, CSVArtifact
from hub_double import HubDouble


def _index(seed=0, V=400, d=12):
    """A head and its artifact (screen + cluster index)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(V, d, generator=g)
    return W, CSVArtifact.build(W, index=True, num_clusters=8, niter=2, progress=False, base_model="org/base")


@pytest.fixture
def hub(tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    # CI exports HF_HUB_OFFLINE=1 (nothing may reach the real Hub); huggingface_hub reads it at import,
    # so lift it for the loopback double only
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    with HubDouble() as h:
        yield h


def _load(repo, hub, tmp_path, **kw):
    return CSVArtifact.from_pretrained(repo, endpoint=hub.endpoint, cache_dir=tmp_path / "cache", **kw)


def test_push_pull_roundtrip_with_model_card(hub, tmp_path):
    W, ix = _index()
    info = ix.push_to_hub("org/idx", endpoint=hub.endpoint, token="test")
    assert "commit" in str(info)
    ix2 = _load("org/idx", hub, tmp_path)
    assert ix2.config.fingerprint == ix.config.fingerprint
    for k, v in ix.index.tensors.items():
        assert torch.equal(v, ix2.index.tensors[k])
    for k, v in ix.screen.tensors.items():
        assert torch.equal(v, ix2.screen.tensors[k])
    ix2.check_head(W)
    card = os.path.join(hub_mod.download("org/idx", ARTIFACT_FILES, endpoint=hub.endpoint, cache_dir=tmp_path / "cache"),
                        "README.md")
    text = open(card).read()
    assert text.startswith("---\nlibrary_name: hf_csv") and "base_model: org/base" in text
    assert ix.config.fingerprint in text and "int8 screen" in text and "cluster index" in text
    assert ("POST", "/api/models/org/idx/commit/main") in hub.state.requests


def test_revision_pinning(hub, tmp_path):
    _, a = _index(0)
    _, b = _index(1)
    sha_a = a.push_to_hub("org/idx", endpoint=hub.endpoint, token="t").oid
    b.push_to_hub("org/idx", endpoint=hub.endpoint, token="t")
    assert _load("org/idx", hub, tmp_path).config.fingerprint == b.config.fingerprint  # main = newest
    assert _load("org/idx", hub, tmp_path, revision=sha_a).config.fingerprint == a.config.fingerprint
    b.push_to_hub("org/idx", endpoint=hub.endpoint, token="t", revision="v2")
    assert _load("org/idx", hub, tmp_path, revision="v2").config.fingerprint == b.config.fingerprint


def test_offline_mode_uses_the_cache(hub, tmp_path, monkeypatch):
    _, ix = _index()
    ix.push_to_hub("org/idx", endpoint=hub.endpoint, token="t")
    _load("org/idx", hub, tmp_path)
    hub.__exit__()  # the Hub is gone
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ix2 = CSVArtifact.from_pretrained("org/idx", cache_dir=tmp_path / "cache", endpoint=hub.endpoint)
    assert ix2.config.fingerprint == ix.config.fingerprint
    with pytest.raises(Exception):  # never downloaded: offline must not pretend
        CSVArtifact.from_pretrained("org/other", cache_dir=tmp_path / "cache", endpoint=hub.endpoint)


def test_fingerprint_mismatch_names_both(hub, tmp_path):
    from hf_csv.core.bounds import ClusterProvider

    _, ix = _index()
    ix.push_to_hub("org/idx", endpoint=hub.endpoint, token="t")
    other = torch.randn(400, 12)
    with pytest.raises(FingerprintMismatchError) as e:
        ClusterProvider(_load("org/idx", hub, tmp_path).index, other)
    from hf_csv.core.index import head_fingerprint
    assert ix.config.fingerprint in str(e.value) and head_fingerprint(other) in str(e.value)


def test_corrupt_and_missing_files_on_the_hub(hub, tmp_path):
    _, ix = _index()
    ix.push_to_hub("org/idx", endpoint=hub.endpoint, token="t")
    repo = hub.state.repos["org/idx"]
    files = repo["commits"][repo["branches"]["main"]]
    files["csv_index.safetensors"] = files["csv_index.safetensors"][:-100]  # truncated upload
    with pytest.raises(IndexFormatError, match="corrupt or truncated"):
        _load("org/idx", hub, tmp_path)
    del files["csv_artifact.json"]
    with pytest.raises(IndexFormatError):
        _load("org/idx", hub, tmp_path, revision=repo["branches"]["main"])
    with pytest.raises(Exception, match="not found|Not Found|404"):
        _load("org/does-not-exist", hub, tmp_path)


@pytest.mark.skipif(not os.environ.get("HF_TOKEN") or os.environ.get("HF_HUB_OFFLINE") == "1",
                    reason="live Hub test: needs HF_TOKEN and network (neither is available on this machine)")
def test_live_hub_roundtrip():
    import uuid

    from huggingface_hub import HfApi

    _, ix = _index()
    repo = f"{HfApi().whoami()['name']}/hf-csv-test-{uuid.uuid4().hex[:8]}"
    try:
        ix.push_to_hub(repo, private=True)
        assert CSVArtifact.from_pretrained(repo).config.fingerprint == ix.config.fingerprint
    finally:
        HfApi().delete_repo(repo)
