"""The speech clips of ``../shared/models/speech`` as one long recording (Whisper long-form tests and
``bench_generate.py --preset whisper-longform``)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

SPEECH = Path(__file__).resolve().parents[2] / "shared" / "models" / "speech"


def long_clip(min_seconds: float = 60.0, speech_dir: Path = SPEECH) -> tuple[np.ndarray, int]:
    """(float32 mono samples, sampling rate): every clip in name order, repeated until longer than
    ``min_seconds``, with half a second of silence between clips."""
    from scipy.io import wavfile

    clips, sr = [], None
    names = sorted(p for p in speech_dir.glob("*.wav"))
    if not names:
        raise FileNotFoundError(f"no .wav clips in {speech_dir}")
    for p in names:
        rate, a = wavfile.read(p)
        if sr is None:
            sr = rate
        elif rate != sr:
            raise ValueError(f"{p.name}: {rate} Hz, the other clips have {sr} Hz")
        clips.append(a.astype("float32") / (32768.0 if a.dtype.kind == "i" else 1.0))
    return repeat_past(clips, int(sr), min_seconds, 0.5), int(sr)


def repeat_past(clips: list, sr: int, min_seconds: float, gap_s: float) -> np.ndarray:
    """``clips`` (float32 sample arrays at ``sr``) one after another, each followed by ``gap_s`` of silence, the whole
    list repeated until the recording is longer than ``min_seconds``."""
    parts, total = [], 0
    gap = np.zeros(int(sr * gap_s), dtype="float32")
    while total <= min_seconds * sr:
        for a in clips:
            parts += [a, gap]
            total += len(a) + len(gap)
    return np.concatenate(parts)
