#!/usr/bin/env python
"""Whisper with an assistant built from itself: int8 dynamically quantized (``--assistant quantized``, a real
same-vocabulary pair: hf_csv.candidate.quantized_assistant) or its first decoder layers (``--assistant truncated``,
untrained truncation, acceptance near 0: an API check, not a speed claim).

    python scripts/whisper_assisted_report.py --model ~/.cache/hf-csv-models/whisper-base --assistant quantized \
        --json out/whisper_assisted.json

For each speech clip of ../shared/models/speech (English): plain greedy, stock assisted and hf_csv assisted
(``csv_config=CSVConfig()``), interleaved; reports identical tokens, the draft acceptance rate (accepted
drafted tokens / drafted tokens, counted from stock's per-iteration report) and median tokens/s of each mode.
It also times one decoder step of the assistant and of the target (cost ratio c) and reports the ceiling of
assisted greedy decoding for the measured acceptance a: max over draft lengths k of
(1 - a^(k+1)) / ((1 - a) (k c + 1)) (Leviathan et al. 2023, eq. 1 with the verify costing one target step).
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
sys.path.insert(0, str(ROOT / "scripts"))

import hf_csv  # noqa: E402
from hf_csv import CSVConfig  # noqa: E402
from hf_csv.candidate import quantized_assistant, truncated_assistant  # noqa: E402

SPEECH = ROOT.parent / "shared" / "models" / "speech"


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--assistant", choices=("quantized", "truncated"), default="quantized")
    ap.add_argument("--layers", type=int, default=2, help="--assistant truncated: decoder layers kept")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from scipy.io import wavfile
    from transformers import AutoModelForSpeechSeq2Seq, AutoProcessor

    proc = AutoProcessor.from_pretrained(a.model)
    m = hf_csv.enable(AutoModelForSpeechSeq2Seq.from_pretrained(a.model, dtype=torch.float32).eval())
    draft = quantized_assistant(m) if a.assistant == "quantized" else truncated_assistant(m, a.layers)
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
    c_ratio = _step_cost_ratio(m, draft, feats[0], a.runs)
    acc = accepted / max(1, drafted)
    ceiling = max(((1 - acc ** (k + 1)) / ((1 - acc) * (k * c_ratio + 1)) if acc < 1 else (k + 1) / (k * c_ratio + 1))
                  for k in range(1, 33))
    from _load import machine_load

    rep = {"command": " ".join(["python", *sys.argv]), "model": Path(a.model).name, "assistant": a.assistant,
           "assistant_layers": a.layers if a.assistant == "truncated" else None, "threads": a.threads,
           "machine_after": machine_load(),
           "clips": [p.name for p in clips], "identical_tokens": bool(identical), "identical": bool(identical),
           "acceptance": acc, "draft_acceptance_rate": acc, "drafted_tokens": drafted,
           "target_calls": target_calls, "tokens_per_s_median": med, "tokens_per_s_runs": tps,
           "tok_s_plain": med["plain"], "tok_s_stock_assisted": med["assisted_stock"],
           "tok_s_csv_assisted": med["assisted_csv"],
           "speedup_vs_plain": med["assisted_csv"] / med["plain"],
           "stock_assisted_vs_plain": med["assisted_stock"] / med["plain"],
           "assisted_speedup_csv_vs_stock": med["assisted_csv"] / med["assisted_stock"],
           "assisted_csv_vs_plain": med["assisted_csv"] / med["plain"],
           "step_cost_ratio": c_ratio, "ceiling_greedy_assisted_vs_plain": ceiling}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(rep, indent=2))
    print(json.dumps(rep, indent=2))
    return 0


@torch.no_grad()
def _step_cost_ratio(m, draft, feat, runs: int) -> float:
    """Median time of one cached decoder step of the assistant over the target's (32-token decodes after
    one shared encoder pass; both with the full head, as stock runs them)."""
    enc = m.get_encoder()(feat)
    start = torch.tensor([[m.generation_config.decoder_start_token_id]])

    def steps(model, kw) -> float:
        from transformers import DynamicCache

        cache = DynamicCache()
        ids = start
        t0 = time.perf_counter()
        for _ in range(32):
            out = model(**kw, **{("decoder_input_ids" if model is m else "input_ids"): ids},
                        past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            ids = out.logits[:, -1:].argmax(-1)
        return (time.perf_counter() - t0) / 32

    ts, td = [], []
    for _ in range(max(3, runs)):
        ts.append(steps(m, {"encoder_outputs": enc}))
        td.append(steps(draft, {"encoder_outputs": enc}))
    return statistics.median(td) / statistics.median(ts)


if __name__ == "__main__":
    raise SystemExit(main())
