import json

import pytest
import torch

from hf_csv.core.errors import FingerprintMismatchError, IndexFormatError
from dataclasses import asdict

from hf_csv.hub.artifact import CONFIG_NAME, INDEX_NAME, ArtifactConfig, CSVArtifact
from hf_csv.core.index import VocabIndex, default_num_clusters, head_fingerprint


@pytest.fixture(scope="module")
def head():
    g = torch.Generator().manual_seed(0)
    return torch.randn(3000, 24, generator=g), torch.randn(3000, generator=g)


@pytest.mark.parametrize("metric", ["euclidean", "spherical"])
def test_build_layout_is_consistent(head, metric):
    W, b = head
    ix = VocabIndex.build(W, b, num_clusters=40, metric=metric, progress=False)
    a, perm, off = ix.assignment, ix.perm, ix.offsets
    assert sorted(perm.tolist()) == list(range(3000))
    assert off[0] == 0 and off[-1] == 3000 and (off[1:] >= off[:-1]).all()
    for c in range(40):  # cluster c is contiguous in perm order
        assert (a[perm[off[c]:off[c + 1]]] == c).all()
    assert torch.equal(ix.bias_max, torch.full((40,), float("-inf")).scatter_reduce(0, a, b, "amax"))
    assert (ix.bias_topm[:, 0] == ix.bias_max).all()
    assert (ix.bias_topm[:, :-1] >= ix.bias_topm[:, 1:]).all()
    X = W / W.norm(dim=1, keepdim=True) if metric == "spherical" else W
    assert ((X - ix.centroids[a]).norm(dim=1) <= ix.radius[a]).all()


def test_save_load_roundtrip_and_fingerprint(head, tmp_path):
    W, b = head
    ix = VocabIndex.build(W, b, num_clusters=16, progress=False)
    CSVArtifact(ArtifactConfig(3000, 24, ix.config.fingerprint, has_bias=True, index=asdict(ix.config)),
                index=ix).save_pretrained(tmp_path)
    ix2 = CSVArtifact.from_pretrained(tmp_path).index
    assert ix2.config == ix.config
    for k, v in ix.tensors.items():
        assert torch.equal(v, ix2.tensors[k])
    ix2.check_head(W, b)
    ix2.check_head(W.bfloat16().float() if False else W, b)
    W2 = W.clone()
    W2[0, 0] += 1
    with pytest.raises(FingerprintMismatchError, match=ix.config.fingerprint):
        ix2.check_head(W2, b)
    with pytest.raises(FingerprintMismatchError, match="3000x24"):
        ix2.check_head(W[:10], b[:10])


def test_fingerprint_is_dtype_agnostic_for_representable_values():
    W = torch.randn(100, 8).bfloat16()
    assert head_fingerprint(W) == head_fingerprint(W.float())
    assert head_fingerprint(W) != head_fingerprint(W.float(), torch.zeros(100))


def test_corrupt_truncated_missing(head, tmp_path):
    W, b = head
    CSVArtifact.build(W, b, screen=False, index=True, num_clusters=8, progress=False).save_pretrained(tmp_path)
    t = tmp_path / INDEX_NAME
    data = t.read_bytes()
    t.write_bytes(data[: len(data) // 2])
    with pytest.raises(IndexFormatError, match="corrupt or truncated"):
        CSVArtifact.from_pretrained(tmp_path)
    t.write_bytes(data)
    CSVArtifact.from_pretrained(tmp_path)
    (tmp_path / CONFIG_NAME).write_text("{not json")
    with pytest.raises(IndexFormatError, match="not a valid artifact config"):
        CSVArtifact.from_pretrained(tmp_path)
    (tmp_path / CONFIG_NAME).unlink()
    with pytest.raises(IndexFormatError, match="missing"):
        CSVArtifact.from_pretrained(tmp_path)


def test_bad_build_args(head):
    W, b = head
    with pytest.raises(ValueError, match="metric"):
        VocabIndex.build(W, metric="cosine", progress=False)
    with pytest.raises(ValueError, match="num_clusters"):
        VocabIndex.build(W[:5], num_clusters=10, progress=False)
    with pytest.raises(ValueError, match="bias"):
        VocabIndex.build(W, torch.zeros(3), progress=False)


def test_default_num_clusters():
    assert default_num_clusters(262144) == 1024
    assert 16 <= default_num_clusters(49152) <= 1024
    assert default_num_clusters(10) <= 10
