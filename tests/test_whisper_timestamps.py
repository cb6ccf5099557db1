"""Whisper with timestamps, greedy (docs/certificates.md §3.4): short-form, sequential long-form and the
chunked pipeline give stock's tokens, with the certified head on (almost) every row."""
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

import hf_csv
from conftest import model_dir
from hf_csv import CSVConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from _audio import long_clip  # noqa: E402

# these paths hand the values on S to stock (docs/certificates.md §2.0): their machinery under that property
pytestmark = pytest.mark.usefixtures("assume_subset_exact")


def tiny_ts_whisper(seed: int = 0, ts_scale: float = 1.0, V: int = 400, n_ts: int = 300, dtype=torch.float32):
    """A tiny random Whisper with Whisper's layout: text tokens, then specials from eos on, then timestamps.
    ``ts_scale`` scales the timestamp rows of the head: small values make text win the timestamp rule,
    large ones make the two sides close (the rule's decision is then often within the bounds' reach)."""
    torch.manual_seed(seed)
    cfg = WhisperConfig(vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=80,
                        max_source_positions=1500, max_target_positions=64, decoder_start_token_id=1,
                        pad_token_id=0, eos_token_id=2, bos_token_id=1, tie_word_embeddings=False)
    m = WhisperForConditionalGeneration(cfg).eval()
    tb = V - n_ts
    with torch.no_grad():
        m.proj_out.weight.mul_(20.0)  # spread the logits so that the screen prunes
        m.proj_out.weight[tb:].mul_(ts_scale)
    gc = m.generation_config
    gc.no_timestamps_token_id = tb - 1  # timestamp_begin = tb
    gc.eos_token_id = tb - 5
    gc.max_initial_timestamp_index = 50
    return hf_csv.enable(m.to(dtype))


def _feats(batch: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(batch, 80, 3000, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tiny_whisper_timestamps_identical_and_every_branch_taken(dtype):
    seen = Counter()
    for ts_scale in (0.3, 0.6, 1.0):
        for seed in range(3):
            m = tiny_ts_whisper(seed, ts_scale, dtype=dtype)
            kw = dict(input_features=_feats(3, seed, dtype), max_new_tokens=40, do_sample=False, return_timestamps=True)
            x = m.generate(**kw)
            y = m.generate(**kw, csv_config=CSVConfig())
            assert torch.equal(x, y), (ts_scale, seed)
            st = m.csv_last_stats
            assert st["mode"] == "topk" and st["certified"] + st["near_ties"] == st["rows"] > 0 and st["certified"] > 0, st
            seen.update(st["timestamps"])
    # each way of certifying a row happened, and the rows that could not be decided were recomputed
    for key in ("equal_after_rules", "timestamp_decided", "text_decided", "rows_rerun"):
        assert seen[key] > 0, (key, seen)
    assert seen["rows"] == seen["equal_after_rules"] + seen["timestamp_decided"] + seen["text_decided"] + seen["rows_rerun"]


def test_timestamp_block_is_always_computed():
    """Every token from eos on is exact on every row; the rest is the certified top-1's sub-vocabulary."""
    m = tiny_ts_whisper(0, 0.6)
    m.generate(input_features=_feats(1, 0), max_new_tokens=8, return_timestamps=True, csv_config=CSVConfig())
    st = m.csv_last_stats
    start = m.generation_config.eos_token_id
    V = m.config.vocab_size
    assert st["mean_subvocab_fraction"] >= (V - start) / V


@pytest.mark.slow
@pytest.mark.parametrize("kw, why", [
    (dict(do_sample=True, temperature=0.7), "sampling"),
    (dict(num_beams=2), "beam search"),
])
def test_timestamps_with_sampling_or_beams_use_the_full_head(kw, why):
    m = tiny_ts_whisper(1, 0.6)
    torch.manual_seed(0)
    x = m.generate(input_features=_feats(2, 1), max_new_tokens=12, return_timestamps=True, **kw)
    torch.manual_seed(0)
    y = m.generate(input_features=_feats(2, 1), max_new_tokens=12, return_timestamps=True, csv_config=CSVConfig(),
                   **kw)
    assert torch.equal(x, y)
    st = m.csv_last_stats
    assert st["mode"] == "full" and any(why in r for r in st["reasons"]), st["reasons"]


# ------------------------------------------------------------------ real whisper-tiny.en, > 60 s of speech
@pytest.fixture(scope="module")
def tiny_en():
    from transformers import AutoModelForSpeechSeq2Seq, AutoProcessor

    d = model_dir("whisper-tiny.en")
    return AutoProcessor.from_pretrained(d), hf_csv.enable(AutoModelForSpeechSeq2Seq.from_pretrained(d).eval())


@pytest.mark.slow
def test_real_sequential_long_form_identical_and_certified(tiny_en, monkeypatch):
    monkeypatch.setenv("HF_CSV_SPEED_GUARD", "0")  # certification, not the speed choice (a loaded CPU may pick full)
    proc, m = tiny_en
    audio, sr = long_clip(60.0)
    assert len(audio) / sr > 60
    f = proc(audio, sampling_rate=sr, return_tensors="pt", truncation=False, padding="longest",
             return_attention_mask=True)
    kw = dict(input_features=f.input_features, attention_mask=f.attention_mask, return_timestamps=True)
    x = m.generate(**kw)
    y = m.generate(**kw, csv_config=CSVConfig())
    assert torch.equal(x, y)
    st = m.csv_last_stats  # the last segment's call
    assert st["mode"] == "topk" and st["certified"] + st["near_ties"] == st["rows"] > 0 and st["certified"] > 0
    assert st["timestamps"]["rows_rerun"] <= 0.05 * st["timestamps"]["rows"]


@pytest.mark.slow
def test_real_chunked_pipeline_with_timestamps_identical_and_certified(tiny_en, monkeypatch):
    monkeypatch.setenv("HF_CSV_SPEED_GUARD", "0")  # certification, not the speed choice (a loaded CPU may pick full)
    from transformers import pipeline

    proc, m = tiny_en
    audio, sr = long_clip(60.0)
    pipe = pipeline("automatic-speech-recognition", model=m, tokenizer=proc.tokenizer,
                    feature_extractor=proc.feature_extractor, chunk_length_s=30, device="cpu")
    sample = {"raw": audio, "sampling_rate": sr}
    a = pipe(dict(sample), return_timestamps=True, generate_kwargs={"num_beams": 1})
    b = pipe(dict(sample), return_timestamps=True, generate_kwargs={"num_beams": 1, "csv_config": CSVConfig()})
    assert a == b and len(a["chunks"]) > 3
    st = m.csv_last_stats
    assert st["mode"] == "topk" and st["certified"] + st["near_ties"] == st["rows"] > 0 and st["certified"] > 0
