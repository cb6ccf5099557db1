import os
import pathlib

import pytest
import torch

# Triton kernels run in the interpreter where there is no GPU (set before anything imports triton); natively on CUDA
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))

MODELS = pathlib.Path(os.environ.get("HF_CSV_MODELS", "~/.cache/hf-csv-models")).expanduser()
SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared"


def model_dir(name: str) -> pathlib.Path:
    d = MODELS / name
    if not (d / "PROVENANCE.json").is_file():
        pytest.skip(f"{name} not prepared: python ../shared/models/prepare.py {name}")
    return d


def tokenizer(d, **kwargs):
    """The prepared model's tokenizer. The prepared folders are written by transformers 5.x, whose
    tokenizer_config names ``TokenizersBackend``; transformers 4.57 does not know that class, so the
    smoke job (.ci/run) reads the same tokenizer.json through ``PreTrainedTokenizerFast``."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(d, **kwargs)
    except ValueError:
        kwargs.setdefault("model_input_names", ["input_ids", "attention_mask"])
        return PreTrainedTokenizerFast.from_pretrained(d, **kwargs)


@pytest.fixture(params=["reference", "cpu"])
def kernel_backend(request, monkeypatch):
    """Run a test under each CPU kernel backend (fbgemm fast path and the plain reference)."""
    monkeypatch.setenv("HF_CSV_KERNELS", request.param)
    return request.param


def pytest_addoption(parser):
    parser.addoption("--fuzz-cases", type=int, default=None,
                     help="number of differential fuzzer cases (tests/test_differential.py; default 300, "
                          "or HF_CSV_FUZZ_CASES)")


@pytest.fixture
def assume_subset_exact(monkeypatch):
    """Tests of the paths that hand the values on S to stock's sampler, verify or scores: their machinery under the
    property those paths need (every column subset rounds as the full call), which hf_csv itself only uses where a
    probe finds it (docs/certificates.md §2.0; the gate is tested in tests/test_trust_round2.py). Their token
    comparisons with stock then still run on this host's real values."""
    from hf_csv.certificate import CertifiedHead

    monkeypatch.setattr(CertifiedHead, "subset_exact", lambda self: True)
