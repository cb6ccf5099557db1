#!/usr/bin/env python
"""Whisper + a distil-whisper-style assistant built from its own first decoder layers (untrained truncation).

    python scripts/whisper_assisted_report.py --model ~/.cache/hf-csv-models/whisper-base --layers 2 \
        --json out/final/whisper_assisted.json

For each speech clip of ../shared/models/speech (English): plain greedy, stock assisted and hf_csv assisted
(``csv_config=CSVConfig()``), interleaved; reports identical tokens, the draft acceptance rate (accepted
drafted tokens / drafted tokens, from hf_csv's stats) and median tokens/s of each mode. The truncated
assistant is not distilled, so its acceptance is low: this checks the API and exactness on real weights,
it is not a speed claim.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hf_csv  # noqa: E402
from hf_csv import CSVConfig  # noqa: E402
from hf_csv.candidate import truncated_assistant  # noqa: E402

SPEECH = ROOT.parent / "shared" / "models" / "speech"


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--layers", type=int, default=2, help="decoder layers kept in the assistant")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from scipy.io import wavfile
    from transformers import AutoModelForSpeechSeq2Seq, AutoProcessor

    proc = AutoProcessor.from_pretrained(a.model)
    m = hf_csv.enable(AutoModelForSpeechSeq2Seq.from_pretrained(a.model, dtype=torch.float32).eval())
    draft = truncated_assistant(m, a.layers)
    clips = sorted(p for p in SPEECH.glob("en_*.wav"))
    feats = []
    for p in clips:
        sr, x = wavfile.read(p)
        feats.append(proc(x.astype("float32") / 32768.0, sampling_rate=sr, return_tensors="pt").input_features)
    kw = dict(num_beams=1, do_sample=False, max_new_tokens=96)
    modes = {
        "plain": lambda f: m.generate(f, **kw),
        "assisted_stock": lambda f: m.generate(f, assistant_model=draft, **kw),
        "assisted_csv": lambda f: m.generate(f, assistant_model=draft, csv_config=CSVConfig(), **kw),
    }
    for f in feats[:1]:  # warm-up
        for fn in modes.values():
            fn(f)
    # stock's own per-iteration report: update_candidate_strategy(input_ids, scores, num_matches), where
    # scores has candidate_length + 1 positions (instrumentation of this script only)
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    counts: list = []
    orig_update = AssistedCandidateGenerator.update_candidate_strategy

    def update(self, input_ids, scores, num_matches):
        counts.append((scores.shape[1] - 1, int(num_matches)))
        return orig_update(self, input_ids, scores, num_matches)

    AssistedCandidateGenerator.update_candidate_strategy = update
    tps = {k: [] for k in modes}
    identical, drafted, accepted, target_calls = True, 0, 0, 0
    for run in range(a.runs):
        tot = {k: [0.0, 0] for k in modes}
        for f in feats:
            outs = {}
            for k, fn in modes.items():
                t0 = time.perf_counter()
                outs[k] = fn(f)
                tot[k][0] += time.perf_counter() - t0
                tot[k][1] += outs[k].shape[1]
            identical &= torch.equal(outs["assisted_csv"], outs["plain"]) and torch.equal(outs["assisted_stock"],
                                                                                       outs["plain"])
            if run == 0:
                counts.clear()
                modes["assisted_csv"](f)  # once more, counting drafted / accepted tokens
                drafted += sum(c for c, _ in counts)
                accepted += sum(n for _, n in counts)
                target_calls += len(counts)
        for k in modes:
            tps[k].append(tot[k][1] / tot[k][0])
    AssistedCandidateGenerator.update_candidate_strategy = orig_update
    med = {k: statistics.median(v) for k, v in tps.items()}
    rep = {"command": " ".join(["python", *sys.argv]), "model": Path(a.model).name, "assistant_layers": a.layers,
           "clips": [p.name for p in clips], "identical_tokens": bool(identical),
           "draft_acceptance_rate": accepted / max(1, drafted), "drafted_tokens": drafted,
           "target_calls": target_calls, "tokens_per_s_median": med, "tokens_per_s_runs": tps,
           "assisted_speedup_csv_vs_stock": med["assisted_csv"] / med["assisted_stock"],
           "assisted_csv_vs_plain": med["assisted_csv"] / med["plain"]}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(rep, indent=2))
    print(json.dumps(rep, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
