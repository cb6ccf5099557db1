import copy
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
                     help="number of differential fuzzer cases (tests/test_stack_differential.py; default 300, "
                          "or HF_CSV_FUZZ_CASES)")


@pytest.fixture
def assume_subset_exact(monkeypatch):
    """Tests of the paths that hand the values on S to stock's sampler, verify or scores: their machinery under the
    property those paths need (every column subset rounds as the full call), which hf_csv itself only uses where a
    probe finds it (docs/certificates.md §2.0; the gate is tested in tests/test_stack_subset_rounding.py). Their token
    comparisons with stock then still run on this host's real values."""
    from hf_csv.core.certificate import CertifiedHead

    monkeypatch.setattr(CertifiedHead, "subset_exact", lambda self: True)
    # the same verdict where a guarded call leaves the probe to each shape's first certified step
    monkeypatch.setattr(CertifiedHead, "subset_verdict", lambda self: True)
    monkeypatch.setattr(CertifiedHead, "subset_rows_verdict", lambda self, rows: True)
    monkeypatch.setattr(CertifiedHead, "subset_exact_rows", lambda self, rows: True)


# ------------------------------------------------------------------ shared by several test files
ALPHA = 1e-3  # significance level of the chi-square tests (fixed seeds)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add wake-up latency on a loaded 2-core machine (stock's
    softmax took ~0.4 ms per call with 2 threads), so the tests that use it run single-threaded (from their
    first use to the end of their module)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _chi2_p(draws, p) -> float:
    """Chi-square p-value of integer ``draws`` (a numpy array) against the law ``p`` (a numpy array over the tokens):
    categories expected >= 5 times, the rest pooled (the pool dropped where it is expected < 5 times)."""
    import numpy as np
    from scipy import stats as sps

    n = len(draws)
    counts = np.bincount(draws, minlength=len(p))
    keep = p * n >= 5
    obs = np.append(counts[keep], counts[~keep].sum()).astype(float)
    exp = np.append(p[keep] * n, p[~keep].sum() * n)
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    return sps.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def tiny_llama(vocab: int = 256, scale: float = 1.0, seed: int = 0, eos: int = 2):
    """The tests' tiny random Llama (V = 256, 2 layers; ``scale`` spreads the head's logits)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=eos)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(scale)  # spread the logits so certificates prune
    m.generation_config.pad_token_id = 0
    return m


@pytest.fixture(scope="module")
def llama():
    import hf_csv

    return hf_csv.enable(tiny_llama(scale=20.0))


def _ids(batch=2, length=7, seed=1, vocab=256):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:  # left padding on row 0
        ids[0, :3] = 0
        mask[0, :3] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _tiny_llama():
    """A 1-layer Llama with V = 300 and a 4-token prompt (no GPU, no files)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval(), torch.tensor([[1, 5, 9, 2]])


@pytest.fixture(scope="module")
def whisper_tiny_en():
    """(processor, enabled model) of the zoo's whisper-tiny.en, once per test module."""
    import hf_csv
    from transformers import AutoModelForSpeechSeq2Seq, AutoProcessor

    d = model_dir("whisper-tiny.en")
    return AutoProcessor.from_pretrained(d), hf_csv.enable(AutoModelForSpeechSeq2Seq.from_pretrained(d).eval())


def _certified_greedy(m, ids, ref):
    """6 greedy tokens with csv_config on an enabled model: stock's tokens; returns the call's stats."""
    import hf_csv

    out = m.generate(ids, max_new_tokens=6, do_sample=False, csv_config=hf_csv.CSVConfig())
    assert torch.equal(out, ref)
    return m.csv_last_stats


def _tiny_whisper(seed=0):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(seed)
    cfg = WhisperConfig(vocab_size=300, d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=80,
                        max_source_positions=1500, max_target_positions=64, decoder_start_token_id=1,
                        pad_token_id=0, eos_token_id=2, bos_token_id=1)
    m = WhisperForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        m.proj_out.weight.mul_(20.0)  # tied to the embeddings: spread the logits so the screen prunes
    return m


# ------------------------------------------------------------------ assisted generation (target, draft)
def _two_sample_p(a, b) -> float:
    """Chi-square p-value of two samples (Counters) having one law: categories seen >= 10 times in total, the rest
    pooled."""
    from scipy import stats as sps

    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    na, nb = sum(a.values()), sum(b.values())
    cols = [(a[k], b[k]) for k in keys] + [(na - sum(a[k] for k in keys), nb - sum(b[k] for k in keys))]
    cols = [c for c in cols if sum(c) > 0]
    if len(cols) < 2:
        return 1.0  # a single category: nothing can differ
    return float(sps.chi2_contingency([[c[0] for c in cols], [c[1] for c in cols]]).pvalue)


def spec_llama(seed: int, layers: int = 2, V: int = 256, scale: float = 30.0):
    """A target for assisted sampling with a certified head (V = 256 unless told)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=V - 1)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(scale)  # peaked rows, as trained models have: the certificates prune
    return m


@pytest.fixture(scope="module")
def spec_pair():
    """An enabled ``spec_llama`` target and a close draft (its layers perturbed)."""
    import hf_csv

    target = spec_llama(0)
    draft = copy.deepcopy(target)  # a close draft: high acceptance, so the second token is often accepted
    with torch.no_grad():
        for p in draft.model.layers.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return hf_csv.enable(target), draft


@pytest.fixture(scope="module")
def trio():
    """A target, a close draft (its layers perturbed) and an unrelated one (V = 4096)."""
    import hf_csv

    target = hf_csv.enable(spec_llama(0, V=4096))
    close = copy.deepcopy(target)
    with torch.no_grad():
        for p in close.model.layers.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return target, close, spec_llama(5, V=4096)


def assist_llama(layers, seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=95)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def assist_pair():
    """An enabled 2-layer target and an unrelated 1-layer draft (V = 96)."""
    import hf_csv

    return hf_csv.enable(assist_llama(2, 0)), assist_llama(1, 1)


@pytest.fixture
def fixed_threshold(monkeypatch):
    """Stock's candidate generator as without scikit-learn: the assistant's confidence threshold stays what it was set
    to. With scikit-learn importable, stock re-chooses it after every round from the draft's whole rows and a greedy
    draft then takes the full head (hf_csv.transformers.compat.adapts_confidence_threshold); tests of the certified draft head use
    this fixture so that they test it in either environment (the ROC path has tests and fuzzer cases of its own)."""
    from transformers.generation import candidate_generator

    monkeypatch.setattr(candidate_generator, "is_sklearn_available", lambda: False)


def roc_adapts(threshold: float) -> bool:
    """Whether stock assisted generation adapts a non-zero confidence threshold here (scikit-learn importable)."""
    from transformers.generation import candidate_generator

    return bool(threshold) and candidate_generator.is_sklearn_available()
