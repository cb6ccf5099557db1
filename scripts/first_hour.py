#!/usr/bin/env python
"""Replay a newcomer's first hour with hf_csv and print every message a user would see (issue 36).

    python scripts/first_hour.py [--models ~/.cache/hf-csv-models] [--skip-demo]

Runs, each in its own process so that one failure cannot hide the rest:

1. the README's demo (``scripts/demo.py --model MODELS/smollm2-135m``);
2. pipelines: text generation with ``csv_config``, and the ASR pipeline with its default (5 beams) and with
   ``num_beams=1``, on an array;
3. the CLI: ``hf-csv build`` / ``inspect`` on a real model, ``inspect`` on a mistyped path;
4. ``custom_generate``: a repository from ``assemble_model_repo``, per call, per model, and per model without
   ``trust_remote_code``;
5. the usual mistakes: ``csv_config`` without ``hf_csv.enable``, a mistyped artifact path, a missing C compiler,
   an audio file name without ffmpeg.

Each step prints the command or code, its exit status, and the last lines of what it printed. Nothing is asserted:
the output is for people (the behaviours are tested in tests/test_stack_messages.py and tests/test_hub_vendor.py).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEECH = ROOT.parent / "shared" / "models" / "speech" / "en_fox.wav"


def step(title: str, argv: list, env: dict, tail: int = 14) -> None:
    print(f"\n=== {title}\n$ {' '.join(argv) if argv[0] != sys.executable or argv[1] != '-c' else 'python -c <below>'}")
    if argv[:2] == [sys.executable, "-c"]:
        print(textwrap.indent(argv[2].strip(), "    "))
    r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    lines = [l for l in (r.stdout + r.stderr).splitlines()
             if l.strip() and not l.startswith(("Loading weights", "Writing model shards")) and "it/s]" not in l]
    print(f"[exit status {r.returncode}]")
    for l in lines[-tail:]:
        print("    " + l[:220])


def _prelude(smol: Path) -> str:
    """The code that loads SmolLM2's tokenizer and one prompt (the start of steps 4 and 5)."""
    return f"""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained({str(smol)!r})
x = tok("The capital of France is", return_tensors="pt")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=os.environ.get("HF_CSV_MODELS", "~/.cache/hf-csv-models"))
    ap.add_argument("--skip-demo", action="store_true")
    a = ap.parse_args()
    models = Path(a.models).expanduser()
    smol, whisper = models / "smollm2-135m", models / "whisper-tiny.en"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    py = sys.executable
    tmp = Path(tempfile.mkdtemp(prefix="hf-csv-first-hour-"))

    if not a.skip_demo:
        step("1. the README's demo", [py, "scripts/demo.py", "--model", str(smol), "--runs", "2"], env, tail=20)
    _pipelines(py, env, smol, whisper)
    _cli(py, env, smol, tmp)
    _custom_generate(py, env, smol, tmp)
    _mistakes(py, env, smol, whisper, tmp)
    print(f"\n(scratch files in {tmp})")


def _pipelines(py: str, env: dict, smol: Path, whisper: Path) -> None:
    """2. text generation and the ASR pipeline (its default, 5 beams, and num_beams=1)."""
    step("2a. text-generation pipeline with csv_config", [py, "-c", f"""
import hf_csv, torch
from transformers import pipeline
pipe = pipeline("text-generation", model={str(smol)!r}, dtype=torch.float32)
hf_csv.enable(pipe.model)
out = pipe("The capital of France is", max_new_tokens=12, do_sample=False, csv_config=hf_csv.CSVConfig())
print(out[0]["generated_text"]); print(pipe.model.csv_last_stats["summary"])
"""], env)
    asr = f"""
import wave, numpy as np, hf_csv
from transformers import pipeline
asr = pipeline("automatic-speech-recognition", model={str(whisper)!r})
hf_csv.enable(asr.model)
with wave.open({str(SPEECH)!r}) as w:
    audio = np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768
kw = {{"csv_config": hf_csv.CSVConfig()}}
"""
    step("2b. ASR pipeline, its default (5 beams)", [py, "-c", asr + """
print(asr({"raw": audio, "sampling_rate": 16000}, generate_kwargs=kw)["text"])
print(asr.model.csv_last_stats["summary"])
"""], env)
    step("2c. ASR pipeline, num_beams=1 (certified)", [py, "-c", asr + """
print(asr({"raw": audio, "sampling_rate": 16000}, generate_kwargs={**kw, "num_beams": 1})["text"])
print(asr.model.csv_last_stats["summary"])
"""], env)


def _cli(py: str, env: dict, smol: Path, tmp: Path) -> None:
    """3. ``hf-csv build`` and ``inspect``, and ``inspect`` on a mistyped path."""
    cli = [py, "-m", "hf_csv.cli"]
    step("3a. hf-csv build", cli + ["build", str(smol), "--out", str(tmp / "art")], env)
    step("3b. hf-csv inspect", cli + ["inspect", str(tmp / "art")], env)
    step("3c. hf-csv inspect on a mistyped path", cli + ["inspect", str(tmp / "atr")], env)


def _custom_generate(py: str, env: dict, smol: Path, tmp: Path) -> None:
    """4. a ``custom_generate`` repository: per call, per model, per model without ``trust_remote_code``."""
    step("4a. custom_generate repository (hf-csv push-model's layout, written locally)", [py, "-c", f"""
from hf_csv.hub.artifact import CSVArtifact
from hf_csv.cli import assemble_model_repo
assemble_model_repo({str(tmp / 'repo')!r}, CSVArtifact.from_pretrained({str(tmp / 'art')!r}), {str(smol)!r})
import os; print(sorted(os.listdir({str(tmp / 'repo' / 'custom_generate')!r}))[:8], '...')
"""], env)
    gen = _prelude(smol)
    step("4b. per call: generate(custom_generate=REPO, trust_remote_code=True)", [py, "-c", gen + f"""
m = AutoModelForCausalLM.from_pretrained({str(smol)!r}, dtype=torch.float32)
ref = m.generate(**x, max_new_tokens=12, do_sample=False)
out = m.generate(**x, max_new_tokens=12, do_sample=False, custom_generate={str(tmp / 'repo')!r}, trust_remote_code=True)
print("identical:", torch.equal(ref, out)); print(m.csv_last_stats["summary"])
"""], env)
    step("4c. per model: from_pretrained(REPO, trust_remote_code=True).generate()", [py, "-c", gen + f"""
m = AutoModelForCausalLM.from_pretrained({str(tmp / 'repo')!r}, dtype=torch.float32, trust_remote_code=True)
m.generate(**x, max_new_tokens=12, do_sample=False); print(m.csv_last_stats["summary"])
"""], env)
    step("4d. per model without trust_remote_code: stock generate, silently", [py, "-c", gen + f"""
m = AutoModelForCausalLM.from_pretrained({str(tmp / 'repo')!r}, dtype=torch.float32)
m.generate(**x, max_new_tokens=12, do_sample=False); print("csv_last_stats:", getattr(m, "csv_last_stats", None))
"""], env)


def _mistakes(py: str, env: dict, smol: Path, whisper: Path, tmp: Path) -> None:
    """5. the usual mistakes and the messages they print."""
    gen = _prelude(smol)
    step("5a. mistake: csv_config without hf_csv.enable(model)", [py, "-c", gen + f"""
import hf_csv
m = AutoModelForCausalLM.from_pretrained({str(smol)!r}, dtype=torch.float32)
m.generate(**x, max_new_tokens=4, csv_config=hf_csv.CSVConfig())
"""], env, tail=3)
    step("5b. mistake: a mistyped artifact path", [py, "-c", gen + f"""
import hf_csv
m = hf_csv.enable(AutoModelForCausalLM.from_pretrained({str(smol)!r}, dtype=torch.float32))
m.generate(**x, max_new_tokens=4, csv_config=hf_csv.CSVConfig(index="./my-artifcat"))
"""], env, tail=2)
    step("5c. mistake: no C compiler (CC names none; a fresh kernel cache)", [py, "-c", gen + f"""
import hf_csv
m = hf_csv.enable(AutoModelForCausalLM.from_pretrained({str(smol)!r}, dtype=torch.float32))
m.generate(**x, max_new_tokens=4, csv_config=hf_csv.CSVConfig()); print(m.csv_last_stats["summary"])
"""], dict(env, CC="/nonexistent/cc", HF_CSV_KERNEL_CACHE=str(tmp / "kcache")), tail=4)
    step("5d. mistake: an audio file name without ffmpeg", [py, "-c", f"""
from transformers import pipeline
asr = pipeline("automatic-speech-recognition", model={str(whisper)!r})
print(asr({str(SPEECH)!r})["text"])
"""], env, tail=2)


if __name__ == "__main__":
    main()
