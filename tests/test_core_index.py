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


def test_cluster_index_refuses_a_head_edited_in_an_unhashed_row():
    """The fingerprint samples every (V // 4096)-th row; a head edited elsewhere passed it and the stale radius
    gave a wrong certified token (5706 against stock's 37). Now the radii are recomputed from the live head."""
    from hf_csv import CertifiedHead, VocabIndex
    from hf_csv.core.errors import FingerprintMismatchError
    from hf_csv.core.index import head_fingerprint

    torch.manual_seed(0)
    centers = torch.randn(64, 32) * 3
    W = centers[torch.arange(8192) % 64] + 0.01 * torch.randn(8192, 32)  # tight clusters: the bound prunes
    ix = VocabIndex.build(W, num_clusters=64, progress=False)
    H = torch.randn(4, 32)
    ok = CertifiedHead(W, provider="cluster", index=ix, budget=1.0).topk(H, k=1)
    assert torch.equal(ok.logits.argmax(1), (H @ W.T).argmax(1))
    # an odd row (not sampled by the fingerprint) of the cluster with the lowest bound for H[0], moved just past
    # the row's maximum along H[0]: stock's argmax, outside the stale bound's candidate set
    Uc = ix.centroids @ H[0] + ix.radius * H[0].norm()
    i = min((int(j) for j in (ix.assignment == int(Uc.argmin())).nonzero()[:, 0] if j % 2), default=None)
    assert i is not None
    best = float((W @ H[0]).max())
    W2 = W.clone()
    W2[i] = ix.centroids[int(Uc.argmin())] + H[0] / H[0].norm() * (best - float(Uc.min()) + 1.0) / H[0].norm() * 2
    assert int((W2 @ H[0]).argmax()) == i
    assert head_fingerprint(W2) == head_fingerprint(W)
    try:
        head = CertifiedHead(W2, provider="cluster", index=ix, budget=1.0)
    except FingerprintMismatchError as e:
        assert "cluster index does not fit" in str(e)
        return
    res = head.topk(H, k=1)  # pragma: no cover - only if the index were accepted
    assert torch.equal(res.logits.argmax(1), (H @ W2.T).argmax(1))


def test_cluster_index_uses_live_terms():
    """A stored radius larger than needed is replaced by the live head's (never trusted from the file)."""
    from hf_csv import VocabIndex
    torch.manual_seed(1)
    W = torch.randn(2048, 16)
    ix = VocabIndex.build(W, num_clusters=16, progress=False)
    loose = VocabIndex(ix.config, dict(ix.tensors, radius=ix.radius * 10, bias_max=ix.bias_max + 5))
    live = loose.for_head(W)
    assert torch.equal(live.radius, ix.radius) and torch.equal(live.bias_max, ix.bias_max)
