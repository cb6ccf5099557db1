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

    parts, sr, total = [], None, 0
    names = sorted(p for p in speech_dir.glob("*.wav"))
    if not names:
        raise FileNotFoundError(f"no .wav clips in {speech_dir}")
    while total <= min_seconds * (sr or 16000):
        for p in names:
            rate, a = wavfile.read(p)
            if sr is None:
                sr = rate
            elif rate != sr:
                raise ValueError(f"{p.name}: {rate} Hz, the other clips have {sr} Hz")
            a = a.astype("float32") / (32768.0 if a.dtype.kind == "i" else 1.0)
            parts += [a, np.zeros(sr // 2, dtype="float32")]
            total += len(a) + sr // 2
    return np.concatenate(parts), int(sr)
