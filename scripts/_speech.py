"""Synthetic English speech for the Whisper draft (issue 40): espeak-ng voices, speeds and pitches, and the held-out
evaluation clips that ``train_whisper_draft.py`` never trains on and ``whisper_assisted_report.py`` measures.

Needs espeak-ng and sox (``apt-get install -y espeak-ng sox``). Clips are 16 kHz mono float32 in [-1, 1], normalised to
-1 dBFS with 0.25 s of silence at each end, as ``../shared/models/speech/make_clips.sh`` makes its clips.

Held out from training (so the evaluation measures voices and speeds the draft never heard):
* the voices ``en-gb-scotland`` and ``en-029`` (Caribbean) and the variants ``+f4`` / ``+m6``;
* speeds below 120 and above 175 words per minute;
* every sentence of the evaluation clips and of ``../shared/models/speech`` (the training text filter drops them).
"""
from __future__ import annotations

import random
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from _audio import SPEECH

TRAIN_VOICES = ("en-us", "en-gb", "en-gb-x-rp", "en-gb-x-gbclan", "en-gb-x-gbcwmd", "en-us-nyc")
TRAIN_VARIANTS = ("", "+m1", "+m2", "+m3", "+m4", "+m5", "+m7", "+f1", "+f2", "+f3", "+f5")
TRAIN_SPEEDS = (120, 175)  # inclusive range, words per minute
HELDOUT_VOICES = ("en-gb-scotland", "en-029")
HELDOUT_VARIANTS = ("+f4", "+m6")

# (name, voice, words per minute, text): voices and speeds none of the training clips use
HELDOUT = (
    ("ho_bridge", "en-gb-scotland", 135, "The old bridge across the river was closed for repairs all through the winter."),
    ("ho_kitchen", "en-029+f4", 150, "She put the kettle on, opened the window, and waited for her brother to call."),
    ("ho_meeting", "en-us+m6", 185, "The meeting has been moved to Thursday afternoon because the manager is travelling."),
    ("ho_garden", "en-gb-scotland+f4", 110, "In the spring we planted tomatoes, beans and a row of yellow flowers by the fence."),
    ("ho_train", "en-029", 180, "The last train to the city leaves at ten, so we should finish dinner before nine."),
    ("ho_letters", "en-gb+m6", 115, "Every letter he wrote to his grandmother ended with a short poem about the sea."),
)


def tools_missing() -> list:
    return [t for t in ("espeak-ng", "sox") if shutil.which(t) is None]


def synth(text: str, voice: str, wpm: int, pitch: int = 50) -> np.ndarray:
    """One utterance as 16 kHz mono float32 samples (espeak-ng, then sox: resample, normalise, pad)."""
    with tempfile.TemporaryDirectory() as tmp:
        raw, out = Path(tmp) / "raw.wav", Path(tmp) / "out.wav"
        # the text on stdin: a sentence that starts with "-" would read as an option
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(int(wpm)), "-p", str(int(pitch)), "-w", str(raw), "--stdin"],
                       input=text.encode(), check=True, capture_output=True)
        subprocess.run(["sox", "-D", str(raw), "-r", "16000", "-c", "1", "-b", "16", str(out), "norm", "-1",
                        "pad", "0.25", "0.25"], check=True, capture_output=True)
        from scipy.io import wavfile

        sr, a = wavfile.read(out)
    assert sr == 16000, sr
    return a.astype("float32") / 32768.0


def train_voice(rng: random.Random) -> tuple[str, int, int]:
    """(voice, words per minute, pitch) drawn from the training voices only."""
    return (rng.choice(TRAIN_VOICES) + rng.choice(TRAIN_VARIANTS), rng.randint(*TRAIN_SPEEDS), rng.randint(25, 75))


def heldout_clips() -> list:
    """[(name, samples, text)]: the held-out evaluation clips (made on the fly; espeak-ng is deterministic)."""
    return [(name, synth(text, voice, wpm), text) for name, voice, wpm, text in HELDOUT]


def zoo_clips() -> list:
    """[(name, samples, text)]: the English clips of ../shared/models/speech."""
    from scipy.io import wavfile

    out = []
    for name, _, text in sorted(zoo_texts()):  # (name order)
        sr, a = wavfile.read(SPEECH / name)
        assert sr == 16000, (name, sr)
        out.append((Path(name).stem, a.astype("float32") / 32768.0, text))
    return out


def excluded_texts() -> set:
    """Normalised sentences the training data must not contain (evaluation and zoo clips)."""
    return {norm(t) for _, _, _, t in HELDOUT} | {norm(t) for _, _, t in zoo_texts()}


def zoo_texts() -> list:
    """[(file name, None, text)] of the English clips that ../shared/models/speech/transcripts.tsv lists."""
    tsv = SPEECH / "transcripts.tsv"
    if not tsv.is_file():
        return []
    return [(f[0], None, f[-1]) for f in (line.split("\t") for line in tsv.read_text().splitlines()[1:])
            if f[1] == "en"]


def norm(t: str) -> str:
    return " ".join("".join(c.lower() if c.isalnum() else " " for c in t).split())
