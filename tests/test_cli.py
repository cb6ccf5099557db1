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
    from hf_csv.hub.artifact import CSVArtifact

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


@pytest.fixture(scope="module")
def artifact_dir(tmp_path_factory):
    from hf_csv.hub.artifact import CSVArtifact

    from test_hub_artifact import _model
    d = tmp_path_factory.mktemp("art")
    CSVArtifact.build(_model().lm_head.weight, outlier_cols=torch.tensor([3, 7, 11])).save_pretrained(d)
    return d


def _malformed():
    from test_hub_artifact import MALFORMED_CONFIGS
    return MALFORMED_CONFIGS


@pytest.mark.parametrize("name,edit,words", _malformed(), ids=[c[0] for c in _malformed()])
def test_inspect_malformed_config_is_one_line_exit_2(artifact_dir, tmp_path, capsys, name, edit, words):
    """``hf-csv inspect`` on a csv_artifact.json with a field of the wrong type (null, missing, nested, not an
    object, not JSON): one line on stderr naming the field, exit status 2 (was a traceback and status 1)."""
    from hf_csv import cli
    from test_hub_artifact import write_malformed_config
    d = write_malformed_config(artifact_dir, tmp_path / "a", edit)
    assert cli.main(["inspect", str(d)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("hf-csv inspect: error: ") and words in err, err


@pytest.mark.parametrize("sub", ["push", "push-model", "pull"])
def test_every_subcommand_that_reads_an_artifact_refuses_a_malformed_one(artifact_dir, tmp_path, capsys,
                                                                        monkeypatch, sub):
    from hf_csv import cli
    from hf_csv.hub import transport as hub
    from test_hub_artifact import write_malformed_config
    d = write_malformed_config(artifact_dir, tmp_path / "a", lambda raw: {**raw, "format_version": "2"})
    monkeypatch.setattr(hub, "download", lambda *a, **k: str(d))  # pull: the "downloaded" copy is malformed
    monkeypatch.setattr(hub, "upload", lambda *a, **k: pytest.fail("uploaded a malformed artifact"))
    argv = {"push": ["push", str(d), "org/x"], "pull": ["pull", "org/x", "--out", str(tmp_path / "o")],
            "push-model": ["push-model", "unused-model", "org/x", "--artifact", str(d), "--no-weights"]}[sub]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'format_version' must be an integer" in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_inspect_malformed_config_through_the_console_script(artifact_dir, tmp_path):
    from test_hub_artifact import write_malformed_config
    d = write_malformed_config(artifact_dir, tmp_path / "a", lambda raw: {**raw, "sha256": None})
    r = run("inspect", str(d))
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "'sha256' must be an object, found null" in r.stderr
