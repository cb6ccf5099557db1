"""hf_csv.hub.vendor: the self-contained copy of hf_csv in a ``custom_generate`` folder. Certified decoding from the Hub
with no code change: transformers' ``custom_generate``, per call and per model, local directories and the local HTTP
Hub double (tests/hub_double.py), LM and Whisper; the folder works without hf_csv installed."""
import importlib.metadata
import os
import re
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, WhisperForConditionalGeneration

from hf_csv.hub.artifact import CSVArtifact
from hf_csv.cli import assemble_model_repo
from hf_csv.cli import main as cli_main
from hub_double import HubDouble
from conftest import _tiny_whisper



def _vendored(suffix: str) -> list:
    """The modules of the hf_csv copies transformers loaded from custom_generate folders (hf_csv.hub.vendor)."""
    return [m for n, m in list(sys.modules.items()) if n.startswith("transformers_modules.") and n.endswith(suffix)]


@pytest.fixture(autouse=True)
def vendored_subset_exact(monkeypatch):
    """The sampled calls compare stock-stream tokens (docs/certificates.md §2.0): under that property, in the installed
    hf_csv (conftest's assume_subset_exact) and in every vendored copy, patched as transformers loads it."""
    import transformers.generation.utils as gu
    from hf_csv.core.certificate import CertifiedHead

    monkeypatch.setattr(CertifiedHead, "subset_exact", lambda self: True)
    real = gu.get_class_in_module

    def load_and_patch(*a, **k):
        out = real(*a, **k)
        for mod in _vendored(".csv_core_certificate_head"):
            monkeypatch.setattr(mod.CertifiedHead, "subset_exact", lambda self: True)
        return out

    monkeypatch.setattr(gu, "get_class_in_module", load_and_patch)

IDS = torch.tensor([[5, 17, 33, 2, 9, 41]])


def _llama(seed=0, V=600):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, pad_token_id=0, eos_token_id=V - 1, bos_token_id=1,
                      tie_word_embeddings=False)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(12.0)
    return m


@pytest.fixture(scope="module")
def llama_repo(tmp_path_factory):
    """A model repository as ``hf-csv push-model`` assembles it, in a local directory."""
    root = tmp_path_factory.mktemp("cg")
    ref = _llama()
    ref.save_pretrained(root / "model")
    art = CSVArtifact.build(ref.lm_head.weight, outlier_cols=torch.tensor([1, 2]))
    assemble_model_repo(root / "repo", art, root / "model")
    return ref, root / "repo"


def _stock(ref, **kw):
    torch.manual_seed(0)
    return ref.generate(IDS, **kw)


def test_per_call_local_directory(llama_repo):
    ref, repo = llama_repo
    for kw in (dict(do_sample=False), dict(do_sample=True, top_k=20, temperature=0.7)):
        kw.update(max_new_tokens=12)
        want = _stock(ref, **kw)
        torch.manual_seed(0)
        got = ref.generate(IDS, custom_generate=str(repo), trust_remote_code=True, **kw)
        assert torch.equal(got, want)
        st = ref.csv_last_stats
        assert st["mode"] == "topk" and st["certified"] > 0
    assert "generate" not in ref.__dict__  # the per-call form leaves the model as it was


def test_per_model_local_directory_uses_the_stored_screen(llama_repo, monkeypatch):
    ref, repo = llama_repo
    m = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True).eval()
    bounds = _vendored(".csv_core_bounds")  # the copy the repository carries (not the installed hf_csv) runs the call
    assert bounds
    for hb in bounds:
        monkeypatch.setattr(hb, "quantize_rows_int8", lambda *a, **k: pytest.fail("re-quantized: artifact not used"))
    for kw in (dict(do_sample=False), dict(do_sample=True, top_k=20)):
        kw.update(max_new_tokens=12)
        assert torch.equal(m.generate(IDS, **kw) if not kw["do_sample"] else _seeded(m, kw), _stock(ref, **kw))
        assert m.csv_last_stats["certified"] > 0


def _seeded(m, kw):
    torch.manual_seed(0)
    return m.generate(IDS, **kw)


def test_csv_config_from_kwargs_overrides_the_default(llama_repo):
    import hf_csv

    ref, repo = llama_repo
    m = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True).eval()
    kw = dict(max_new_tokens=6, do_sample=True, top_k=20)
    out = _seeded(m, dict(kw, csv_config=hf_csv.CSVConfig(budget=1)))
    assert torch.equal(out, _stock(ref, **kw))
    # budget 1 < the 20 tokens a top-20 certificate holds: every row falls back (the default budget certifies them)
    st = m.csv_last_stats
    assert st["rows"] > 0 and st["certified"] == 0, st
    _seeded(m, kw)
    assert m.csv_last_stats["certified"] > 0


def test_whisper_per_model_and_per_call(tmp_path, caplog):
    ref = _tiny_whisper()
    ref.save_pretrained(tmp_path / "model")
    art = CSVArtifact.build(ref.proj_out.weight)
    assemble_model_repo(tmp_path / "repo", art, tmp_path / "model")
    feats = torch.randn(1, 80, 3000, generator=torch.Generator().manual_seed(0))
    want = ref.generate(feats, max_new_tokens=12, do_sample=False)
    m = WhisperForConditionalGeneration.from_pretrained(tmp_path / "repo", trust_remote_code=True).eval()
    assert torch.equal(m.generate(feats, max_new_tokens=12, do_sample=False), want)
    assert m.csv_last_stats["certified"] > 0
    import logging

    from transformers.utils import logging as tlogging

    tlogging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            got = ref.generate(feats, max_new_tokens=12, do_sample=False, custom_generate=str(tmp_path / "repo"),
                               trust_remote_code=True)
    finally:
        tlogging.disable_propagation()
    assert torch.equal(got, want)
    # Whisper's own None overrides (begin_suppress_tokens, suppress_tokens) reach generate: no duplicate processors
    assert not [r for r in caplog.records if "was also created" in r.getMessage()]


_NO_HF_CSV = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("hf_csv", "hf_csv_kernels"):
            raise ImportError(f"No module named {name!r} (blocked: hf_csv is not installed here)")
sys.meta_path.insert(0, Block())
import torch
from transformers import LlamaForCausalLM
repo, model = sys.argv[1], sys.argv[2]
ref = LlamaForCausalLM.from_pretrained(model).eval()
ids = torch.tensor([[5, 17, 33, 2, 9, 41]])
want = ref.generate(ids, max_new_tokens=12, do_sample=False)
got = ref.generate(ids, max_new_tokens=12, do_sample=False, custom_generate=repo, trust_remote_code=True)
st = ref.csv_last_stats
assert "hf_csv" not in sys.modules and "hf_csv_kernels" not in sys.modules
print("identical", bool(torch.equal(got, want)), "certified", st["certified"], st["summary"])
"""


@pytest.mark.slow
def test_the_repository_works_without_hf_csv_installed(llama_repo, tmp_path):
    """The folder carries hf_csv (hf_csv.hub.vendor): a process where ``import hf_csv`` fails still gets certified,
    stock-identical greedy decoding, from the repository alone."""
    import os
    import subprocess

    ref, repo = llama_repo
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    r = subprocess.run([sys.executable, "-c", _NO_HF_CSV, str(repo), str(repo)], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith("identical True certified ") and int(line.split()[3]) > 0, line


def test_the_vendored_copy_is_complete_and_never_imports_the_installed_package(llama_repo):
    from transformers.dynamic_module_utils import get_relative_import_files

    from hf_csv.hub.vendor import VENDORED_MODULES

    _, repo = llama_repo
    cg = repo / "custom_generate"
    fetched = {os.path.basename(f)[:-3] for f in get_relative_import_files(str(cg / "generate.py"))}
    assert fetched == set(VENDORED_MODULES) | {"csv_core_config", "csv_transformers_enable"}
    for f in cg.glob("*.py"):
        text = f.read_text()
        assert not re.search(r"^\s*(from|import) hf_csv", text, flags=re.M), f.name
    req = [l for l in (cg / "requirements.txt").read_text().splitlines() if l and not l.startswith("#")]
    assert not any(l.replace("-", "_").startswith("hf_csv") for l in req)
    assert "pip install hf_csv" not in (repo / "README.md").read_text()


def test_trust_remote_code_is_required(llama_repo):
    ref, repo = llama_repo
    with pytest.raises(ValueError, match="trust_remote_code"):
        ref.generate(IDS, max_new_tokens=2, custom_generate=str(repo), trust_remote_code=False)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "cache"))
    with HubDouble() as h:
        monkeypatch.setattr(hc, "ENDPOINT", h.endpoint)
        monkeypatch.setattr(hc, "HUGGINGFACE_CO_URL_TEMPLATE", h.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        yield h


@pytest.mark.slow
def test_push_model_then_from_pretrained_through_the_hub(hub, tmp_path, monkeypatch):
    ref = _llama(seed=4)
    ref.save_pretrained(tmp_path / "model")
    monkeypatch.setenv("HF_TOKEN", "t")
    assert cli_main(["push-model", str(tmp_path / "model"), "org/certified", "--endpoint", hub.endpoint]) == 0
    files = hub.state.repos["org/certified"]["commits"][hub.state.repos["org/certified"]["branches"]["main"]]
    for f in ("config.json", "model.safetensors", "csv_artifact.json", "csv_screen.safetensors",
              "custom_generate/generate.py", "custom_generate/requirements.txt", "README.md"):
        assert f in files, f
    assert b"CSV_CONFIG_DEFAULTS: dict = {'index': 'org/certified'}" in files["custom_generate/generate.py"]
    assert b"- custom_generate" in files["README.md"] and b"library_name: transformers" in files["README.md"]
    m = AutoModelForCausalLM.from_pretrained("org/certified", trust_remote_code=True).eval()
    want = ref.generate(IDS, max_new_tokens=12, do_sample=False)
    assert torch.equal(m.generate(IDS, max_new_tokens=12, do_sample=False), want)
    st = m.csv_last_stats
    assert st["mode"] == "topk" and st["certified"] > 0
    # per call, from the Hub repository
    got = ref.generate(IDS, max_new_tokens=12, do_sample=False, custom_generate="org/certified",
                       trust_remote_code=True)
    assert torch.equal(got, want)
