"""Whisper under csv_config: greedy (tiny random and whisper-tiny.en), timestamps (docs/certificates.md §3.4:
short-form, sequential long-form, the chunked pipeline) and hf_csv.transformers.whisper's temperature fallback (§3.6:
``logprob_threshold`` / ``no_speech_threshold`` decisions are stock's); tokens are stock's."""
from __future__ import annotations

import math
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration
from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

import hf_csv
from hf_csv import CSVConfig
from conftest import SHARED, _tiny_whisper, model_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from _audio import long_clip  # noqa: E402


@pytest.mark.slow
def test_whisper_tiny_greedy_identical(whisper_tiny_en, monkeypatch):
    # an exactness test: the speed guard's timing-dependent choice would make the certified-row counts vacuous
    monkeypatch.setenv("HF_CSV_SPEED_GUARD", "0")
    from scipy.io import wavfile

    proc, m = whisper_tiny_en
    for name in ("en_fox.wav", "en_draft.wav"):
        sr, a = wavfile.read(SHARED / "models" / "speech" / name)
        a = a.astype("float32") / (32768.0 if a.dtype.kind == "i" else 1.0)
        f = proc(a, sampling_rate=sr, return_tensors="pt").input_features
        x = m.generate(f, max_new_tokens=32)
        y = m.generate(f, max_new_tokens=32, csv_config=CSVConfig())
        assert torch.equal(x, y)
        st = m.csv_last_stats
        # of the certified head's rows (the speed guard may send others to the full head: declined_rows)
        assert st["mode"] == "topk" and st["certified"] + st["near_ties"] + st["verify_reruns"] > 0.9 * st["rows"]


def test_tiny_random_whisper_greedy_identical():
    m = hf_csv.enable(_tiny_whisper())
    feats = torch.randn(1, 80, 3000, generator=torch.Generator().manual_seed(0))
    x = m.generate(feats, max_new_tokens=16, do_sample=False)
    y = m.generate(feats, max_new_tokens=16, do_sample=False, csv_config=CSVConfig())
    assert torch.equal(x, y)
    assert m.csv_last_stats["certified"] > 0


def _long_form_identical(proc, m, audio, sr) -> None:
    """Whisper's sequential long-form generate with timestamps gives stock's tokens under csv_config."""
    f = proc(audio, sampling_rate=sr, return_tensors="pt", truncation=False, padding="longest",
             return_attention_mask=True)
    kw = dict(input_features=f.input_features, attention_mask=f.attention_mask, return_timestamps=True)
    x = m.generate(**kw)
    y = m.generate(**kw, csv_config=CSVConfig())
    assert torch.equal(x, y)


@pytest.mark.slow
def test_long_form_whisper_identical(whisper_tiny_en):
    """> 30 s of audio: Whisper's own long-form loop (timestamps) runs per segment; identical output."""
    from scipy.io import wavfile

    proc, m = whisper_tiny_en
    clips = []
    for name in ("en_fox.wav", "en_draft.wav", "en_library.wav", "en_rainbow.wav", "en_stella.wav", "en_weather.wav",
                 "en_window.wav"):
        sr, a = wavfile.read(SHARED / "models" / "speech" / name)
        clips.append(a.astype("float32") / 32768.0)
    audio = np.concatenate(clips)
    assert len(audio) / sr > 30
    _long_form_identical(proc, m, audio, sr)


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


@pytest.mark.usefixtures("assume_subset_exact")
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
            assert st["mode"] == "topk" and st["certified"] + st["fallback"] == st["rows"] > 0 and st["certified"] > 0 \
                and st["fallback"] <= st["near_ties"] + st["verify_reruns"], st
            seen.update(st["timestamps"])
    # each way of certifying a row happened, and the rows that could not be decided were recomputed
    for key in ("equal_after_rules", "timestamp_decided", "text_decided", "rows_rerun"):
        assert seen[key] > 0, (key, seen)
    assert seen["rows"] == seen["equal_after_rules"] + seen["timestamp_decided"] + seen["text_decided"] + seen["rows_rerun"]


@pytest.mark.usefixtures("assume_subset_exact")
def test_timestamp_block_is_always_computed():
    """Every token from eos on is exact on every row; the rest is the certified top-1's sub-vocabulary."""
    m = tiny_ts_whisper(0, 0.6)
    m.generate(input_features=_feats(1, 0), max_new_tokens=8, return_timestamps=True, csv_config=CSVConfig())
    st = m.csv_last_stats
    start = m.generation_config.eos_token_id
    V = m.config.vocab_size
    assert st["mean_subvocab_fraction"] >= (V - start) / V


@pytest.mark.usefixtures("assume_subset_exact")
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


@pytest.mark.usefixtures("assume_subset_exact")
@pytest.mark.slow
def test_real_sequential_long_form_identical_and_certified(whisper_tiny_en, monkeypatch):
    monkeypatch.setenv("HF_CSV_SPEED_GUARD", "0")  # certification, not the speed choice (a loaded CPU may pick full)
    proc, m = whisper_tiny_en
    audio, sr = long_clip(60.0)
    assert len(audio) / sr > 60
    _long_form_identical(proc, m, audio, sr)
    st = m.csv_last_stats  # the last segment's call
    assert st["mode"] == "topk" and st["certified"] + st["fallback"] == st["rows"] > 0 and st["certified"] > 0 \
        and st["fallback"] <= st["near_ties"] + st["verify_reruns"]
    assert st["timestamps"]["rows_rerun"] <= 0.05 * st["timestamps"]["rows"]


@pytest.mark.usefixtures("assume_subset_exact")
@pytest.mark.slow
def test_real_chunked_pipeline_with_timestamps_identical_and_certified(whisper_tiny_en, monkeypatch):
    monkeypatch.setenv("HF_CSV_SPEED_GUARD", "0")  # certification, not the speed choice (a loaded CPU may pick full)
    from transformers import pipeline

    proc, m = whisper_tiny_en
    audio, sr = long_clip(60.0)
    pipe = pipeline("automatic-speech-recognition", model=m, tokenizer=proc.tokenizer,
                    feature_extractor=proc.feature_extractor, chunk_length_s=30, device="cpu")
    sample = {"raw": audio, "sampling_rate": sr}
    a = pipe(dict(sample), return_timestamps=True, generate_kwargs={"num_beams": 1})
    b = pipe(dict(sample), return_timestamps=True, generate_kwargs={"num_beams": 1, "csv_config": CSVConfig()})
    assert a == b and len(a["chunks"]) > 3
    st = m.csv_last_stats
    assert st["mode"] == "topk" and st["certified"] + st["fallback"] == st["rows"] > 0 and st["certified"] > 0 \
        and st["fallback"] <= st["near_ties"] + st["verify_reruns"]


FALLBACK = dict(temperature=(0.0, 0.4, 0.8), compression_ratio_threshold=2.4, no_speech_threshold=0.6)


@pytest.fixture
def spy(monkeypatch):
    """Records every stock avg-logprob value and every (needs_fallback, should_skip) decision."""
    rec = {"avg": [], "decisions": []}
    avg, need = WhisperGenerationMixin._retrieve_avg_logprobs, WhisperGenerationMixin._need_fallback

    def _avg(scores, tokens, temperature):
        v = avg(scores, tokens, temperature)
        rec["avg"].append(float(v))
        return v

    def _need(self, *a, **k):
        out = need(self, *a, **k)
        rec["decisions"].append(tuple(bool(x) for x in out))
        return out

    monkeypatch.setattr(WhisperGenerationMixin, "_retrieve_avg_logprobs", staticmethod(_avg))
    monkeypatch.setattr(WhisperGenerationMixin, "_need_fallback", _need)
    return rec


def _run(m, spy, csv, **kw):
    spy["avg"].clear()
    spy["decisions"].clear()
    torch.manual_seed(0)
    out = m.generate(**kw, csv_config=CSVConfig()) if csv else m.generate(**kw)
    return out, list(spy["avg"]), list(spy["decisions"])


@pytest.mark.usefixtures("assume_subset_exact")
@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decisions_at_the_threshold_are_stocks(spy, seed):
    """Thresholds at stock's own avg-logprob and one float above it: every decision is stock's (the bounds cannot
    decide these, so the steps are replayed), and so are the tokens. Dropping the mass outside S from the interval
    (or any replay) would flip the second one."""
    m = tiny_ts_whisper(seed, 0.6)
    kw = dict(input_features=_feats(2, seed), max_new_tokens=24, return_timestamps=True, **FALLBACK)
    _, avgs, _ = _run(m, spy, False, logprob_threshold=-1.0, **kw)
    assert avgs
    v = avgs[0]
    for thr in (v, math.nextafter(v, math.inf)):
        x, _, dx = _run(m, spy, False, logprob_threshold=thr, **kw)
        y, _, dy = _run(m, spy, True, logprob_threshold=thr, **kw)
        assert torch.equal(x, y) and dx == dy, (thr, dx, dy)
        st = m.csv_last_stats["whisper_thresholds"]
        assert st["decisions"] > 0 and st["fully_replayed"] + st["replayed_steps"] > 0, st


@pytest.mark.usefixtures("assume_subset_exact")
@pytest.mark.slow
@pytest.mark.parametrize("thr", [-0.5, -2.0, -4.0])
def test_decisions_and_tokens_identical_across_thresholds(spy, thr):
    seen = 0
    for seed in range(3):
        m = tiny_ts_whisper(seed, 0.6)
        kw = dict(input_features=_feats(3, seed), max_new_tokens=24, return_timestamps=True, logprob_threshold=thr,
                  **FALLBACK)
        x, _, dx = _run(m, spy, False, **kw)
        y, _, dy = _run(m, spy, True, **kw)
        assert torch.equal(x, y) and dx == dy, (seed, dx, dy)
        seen += m.csv_last_stats.get("whisper_thresholds", {}).get("decisions", 0)
    assert seen > 0


@pytest.mark.usefixtures("assume_subset_exact")
@pytest.mark.slow
def test_declined_after_the_list_was_built_uses_stocks_own_decision(spy):
    """A stopping criterion that may read the scores declines the call after the processors were chosen: the kept rows
    are then stock's and so is the avg-logprob (found by the differential fuzzer)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Reader(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    m = tiny_ts_whisper(0, 0.6)
    kw = dict(input_features=_feats(2, 0), max_new_tokens=12, return_timestamps=True, logprob_threshold=-1.0,
              stopping_criteria=StoppingCriteriaList([Reader()]), **FALLBACK)
    x, ax, dx = _run(m, spy, False, **kw)
    y, ay, dy = _run(m, spy, True, **kw)
    assert torch.equal(x, y) and dx == dy and ax == ay and ax
    st = m.csv_last_stats
    assert st["mode"] == "full" and "whisper_thresholds" not in st, st  # no round was certified


@pytest.mark.usefixtures("assume_subset_exact")
def test_returned_scores_keep_the_full_head():
    m = tiny_ts_whisper(0, 0.6)
    kw = dict(input_features=_feats(1, 0), max_new_tokens=8, logprob_threshold=-1.0, return_dict_in_generate=True,
              **FALLBACK)
    torch.manual_seed(0)
    m.generate(**kw, csv_config=CSVConfig())
    st = m.csv_last_stats
    assert st["mode"] == "full" and any("logprob_threshold" in r for r in st["reasons"]), st["reasons"]


def _seeded_stock_and_csv(m, kw: dict) -> tuple:
    """(stock's output, hf_csv's, hf_csv's stats) of one call, each from seed 0 (the fallback rounds sample)."""
    torch.manual_seed(0)
    ref = m.generate(**kw)
    torch.manual_seed(0)
    out = m.generate(**kw, csv_config=CSVConfig())
    return ref, out, m.csv_last_stats


@pytest.mark.usefixtures("assume_subset_exact")
def test_returned_scores_asked_on_the_models_own_config_keep_the_full_head():
    """The same request made on the model's own generation_config (as a saved generation_config.json would): the
    returned scores are stock's full rows (they were the certified sub-vocabulary rows, counted certified)."""
    m = tiny_ts_whisper(0, 0.6)
    kw = dict(input_features=_feats(1, 0), max_new_tokens=8, **FALLBACK)
    gc = m.generation_config
    # (a threshold no greedy round misses: the returned scores are the certified greedy round's)
    gc.logprob_threshold, gc.return_dict_in_generate, gc.output_scores = -50.0, True, True
    ref, out, st = _seeded_stock_and_csv(m, kw)
    assert st["mode"] == "full" and any("logprob_threshold" in r for r in st["reasons"]), st["reasons"]
    assert torch.equal(ref.sequences, out.sequences)
    assert all(torch.equal(a, b) for a, b in zip(ref.scores, out.scores)) and len(ref.scores) == len(out.scores)


@pytest.mark.usefixtures("assume_subset_exact")
def test_assisted_decoding_with_a_logprob_threshold_keeps_the_full_head():
    """Assisted decoding records a head step per candidate position, rejected drafts included, so the records are
    not the kept rows that Whisper's fallback decision reads (they were paired by index: another decision than stock's,
    counted certified). Such a call takes the full head, with the reason, and returns stock's output."""
    from hf_csv.transformers.drafts import truncated_assistant

    m = tiny_ts_whisper(0, 0.6)
    draft = truncated_assistant(m, 1)
    kw = dict(input_features=_feats(1, 0), max_new_tokens=8, logprob_threshold=-50.0, assistant_model=draft,
              **FALLBACK)
    ref, out, st = _seeded_stock_and_csv(m, kw)
    assert st["mode"] == "full" and any("assisted" in r for r in st["reasons"]), st["reasons"]
    assert torch.equal(ref, out)


@pytest.mark.usefixtures("assume_subset_exact")
@pytest.mark.slow
def test_real_long_form_with_temperature_fallback_identical(whisper_tiny_en, spy):
    """whisper-tiny.en, > 60 s, sequential long-form with the usual fallback settings: stock's tokens and decisions;
    greedy rounds certified."""
    proc, m = whisper_tiny_en
    audio, sr = long_clip(60.0)
    f = proc(audio, sampling_rate=sr, return_tensors="pt", truncation=False, padding="longest",
             return_attention_mask=True)
    kw = dict(input_features=f.input_features, attention_mask=f.attention_mask, return_timestamps=True,
              temperature=(0.0, 0.2, 0.4, 0.6, 0.8, 1.0), logprob_threshold=-1.0, no_speech_threshold=0.6,
              compression_ratio_threshold=1.35, condition_on_prev_tokens=False)
    x, _, dx = _run(m, spy, False, **kw)
    y, _, dy = _run(m, spy, True, **kw)
    assert torch.equal(x, y) and dx == dy and len(dx) >= 3
    st = m.csv_last_stats["whisper_thresholds"]
    assert st["decisions"] > 0, st


@pytest.mark.slow
def test_whisper_thresholds_on_generation_config_are_honoured():
    from scipy.io import wavfile
    from transformers import AutoModelForSpeechSeq2Seq, AutoProcessor

    d = model_dir("whisper-tiny.en")
    proc = AutoProcessor.from_pretrained(d)
    m = hf_csv.enable(AutoModelForSpeechSeq2Seq.from_pretrained(d).eval())
    sr, a = wavfile.read(SHARED / "models" / "speech" / "en_fox.wav")
    f = proc(a.astype("float32") / 32768.0, sampling_rate=sr, return_tensors="pt").input_features
    m.generation_config.logprob_threshold = -0.1  # strict: forces the temperature fallback
    m.generation_config.no_speech_threshold = 0.6
    # (transformers 5.23 itself fails in short-form with thresholds set on the config unless scores are returned)
    kw = dict(temperature=(0.0, 0.4, 0.8), return_dict_in_generate=True, output_scores=True)
    torch.manual_seed(0)
    x = m.generate(f, **kw)
    torch.manual_seed(0)
    # scores="subvocab": output_scores alone would not decline, so only the threshold check protects the call
    y = m.generate(f, **kw, csv_config=CSVConfig(scores="subvocab"))
    assert torch.equal(x.sequences, y.sequences)
    st = m.csv_last_stats
    assert st["mode"] == "full" and any("logprob_threshold" in r for r in st["reasons"])
