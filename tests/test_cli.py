"""The hf-csv console script, through its entry point."""
import json
import subprocess
import sys

import pytest
import torch

from hub_double import HubDouble


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "hf_csv.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    d = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


@pytest.mark.slow
@pytest.mark.parametrize("sub", [[], ["build"], ["push"], ["pull"], ["inspect"], ["bench"]])
def test_help(sub):
    r = run(*sub, "--help")
    assert r.returncode == 0 and "usage: hf-csv" in r.stdout


@pytest.mark.slow
def test_build_inspect_push_pull(tiny_model, tmp_path):
    import os

    out = tmp_path / "ix"
    r = run("build", str(tiny_model), "--out", str(out), "--index", "--num-clusters", "16")
    assert r.returncode == 0, r.stderr
    for f in ("csv_index.safetensors", "csv_screen.safetensors", "csv_artifact.json", "README.md"):
        assert (out / f).is_file(), f
    r = run("inspect", str(out))
    info = json.loads(r.stdout)
    cfg = info["config"]
    assert cfg["index"]["num_clusters"] == 16 and cfg["vocab_size"] == 300 and len(cfg["fingerprint"]) == 32
    assert cfg["screen"] == {"quant": "int8", "num_outliers": 16}  # calibrated on a dummy forward
    assert info["parts"]["screen"]["q"] == {"shape": [300, 32], "dtype": "int8", "bytes": 9600}
    assert info["total_bytes"] > 9600
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "cache"), HF_TOKEN="t")
    env.pop("HF_HUB_OFFLINE", None)
    with HubDouble() as hub:
        r = run("push", str(out), "org/ix", "--endpoint", hub.endpoint, env=env)
        assert r.returncode == 0, r.stderr
        r = run("pull", "org/ix", "--out", str(tmp_path / "pulled"), "--endpoint", hub.endpoint, env=env)
        assert r.returncode == 0, r.stderr
    from hf_csv.artifact import CSVArtifact

    built, pulled = CSVArtifact.from_pretrained(out), CSVArtifact.from_pretrained(tmp_path / "pulled")
    assert pulled.config.fingerprint == built.config.fingerprint
    diff = [k for k in built.index.tensors if not torch.equal(built.index.tensors[k], pulled.index.tensors[k])]
    diff += [k for k in built.screen.tensors if not torch.equal(built.screen.tensors[k], pulled.screen.tensors[k])]
    assert not diff, diff


@pytest.mark.slow
def test_bad_input_is_one_clear_line(tmp_path):
    r = run("inspect", str(tmp_path))  # an empty directory is not an index
    assert r.returncode == 2 and "missing" in r.stderr and "Traceback" not in r.stderr
    r = run("build", str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    r = run("push", str(tmp_path / "nope"), "org/x")
    assert r.returncode == 2 and "not a directory" in r.stderr
    r = run("bench", "nothing")
    assert r.returncode == 2
