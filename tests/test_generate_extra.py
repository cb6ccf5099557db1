"""Streamers, a tiny random Whisper, and long-form Whisper under csv_config."""
import numpy as np
import pytest
import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration
from transformers.generation.streamers import BaseStreamer

import hf_csv
from conftest import SHARED, model_dir
from hf_csv import CSVConfig
from test_generate import _ids, tiny_llama


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.detach().clone().reshape(-1))

    def end(self):
        self.chunks.append(None)


def test_streamer_sees_the_same_tokens():
    m = hf_csv.enable(tiny_llama(scale=20.0))
    ids = _ids(batch=1)
    a, b = Collect(), Collect()
    x = m.generate(**ids, max_new_tokens=12, do_sample=False, streamer=a)
    y = m.generate(**ids, max_new_tokens=12, do_sample=False, streamer=b, csv_config=CSVConfig())
    assert torch.equal(x, y)
    assert len(a.chunks) == len(b.chunks) and a.chunks[-1] is None and b.chunks[-1] is None
    assert all(torch.equal(u, v) for u, v in zip(a.chunks[:-1], b.chunks[:-1]))
    assert m.csv_last_stats["certified"] > 0


def _tiny_whisper(seed=0):
    torch.manual_seed(seed)
    cfg = WhisperConfig(vocab_size=300, d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=80,
                        max_source_positions=1500, max_target_positions=64, decoder_start_token_id=1,
                        pad_token_id=0, eos_token_id=2, bos_token_id=1)
    m = WhisperForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        m.proj_out.weight.mul_(20.0)  # tied to the embeddings: spread the logits so the screen prunes
    return m


def test_tiny_random_whisper_greedy_identical():
    m = hf_csv.enable(_tiny_whisper())
    feats = torch.randn(1, 80, 3000, generator=torch.Generator().manual_seed(0))
    x = m.generate(feats, max_new_tokens=16, do_sample=False)
    y = m.generate(feats, max_new_tokens=16, do_sample=False, csv_config=CSVConfig())
    assert torch.equal(x, y)
    assert m.csv_last_stats["certified"] > 0


@pytest.mark.slow
def test_long_form_whisper_identical():
    """> 30 s of audio: Whisper's own long-form loop (timestamps) runs per segment; identical output."""
    from scipy.io import wavfile
    from transformers import AutoModelForSpeechSeq2Seq, AutoProcessor

    d = model_dir("whisper-tiny.en")
    proc = AutoProcessor.from_pretrained(d)
    m = hf_csv.enable(AutoModelForSpeechSeq2Seq.from_pretrained(d).eval())
    clips = []
    for name in ("en_fox.wav", "en_draft.wav", "en_library.wav", "en_rainbow.wav", "en_stella.wav", "en_weather.wav",
                 "en_window.wav"):
        sr, a = wavfile.read(SHARED / "models" / "speech" / name)
        clips.append(a.astype("float32") / 32768.0)
    audio = np.concatenate(clips)
    assert len(audio) / sr > 30
    f = proc(audio, sampling_rate=sr, return_tensors="pt", truncation=False, padding="longest",
             return_attention_mask=True)
    kw = dict(input_features=f.input_features, attention_mask=f.attention_mask, return_timestamps=True)
    x = m.generate(**kw)
    y = m.generate(**kw, csv_config=CSVConfig())
    assert torch.equal(x, y)
