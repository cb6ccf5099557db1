"""Whisper sequential long-form with temperature fallback: stock against ``csv_config=CSVConfig()``.

The recording is every speech clip joined past 60 s (``_audio.long_clip``, 102.5 s with the shipped clips); the
settings are the usual fallback ones (``temperature=(0.0, 0.2, ..., 1.0)``, ``logprob_threshold=-1.0``,
``no_speech_threshold=0.6``, ``compression_ratio_threshold=1.35``, timestamps, ``condition_on_prev_tokens=False``),
the call of ``tests/test_transformers_whisper.py::test_real_long_form_with_temperature_fallback_identical``. Each call is
reseeded with ``torch.manual_seed(0)``, so sampled fallback rounds draw the same stream on both sides.

It prints, per model: whether the tokens and every (needs fallback, skip) decision are stock's, each side's wall
time per pair (the order alternating), and the csv call's stats (one long-form call: its rounds' counts summed):
``whisper_thresholds`` (avg-logprob decisions of greedy rounds, decided from the bounds alone, steps replayed on the
stock head), the head rows certified and the reasons logged.
A correctness run with times beside it: a few pairs, not a speed benchmark (docs/benchmarks.md §9.7).

    python scripts/whisper_fallback_report.py --model $M/whisper-tiny.en --model $M/whisper-base --json OUT
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

FALLBACK = dict(return_timestamps=True, temperature=(0.0, 0.2, 0.4, 0.6, 0.8, 1.0), logprob_threshold=-1.0,
                no_speech_threshold=0.6, compression_ratio_threshold=1.35, condition_on_prev_tokens=False)


def _report(model_dir: str, pairs: int) -> dict:
    import hf_csv
    from _audio import long_clip
    from transformers import AutoModelForSpeechSeq2Seq, AutoProcessor
    from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

    proc = AutoProcessor.from_pretrained(model_dir)
    model = hf_csv.enable(AutoModelForSpeechSeq2Seq.from_pretrained(model_dir).eval())
    audio, sr = long_clip(60.0)
    f = proc(audio, sampling_rate=sr, return_tensors="pt", truncation=False, padding="longest",
             return_attention_mask=True)
    kw = dict(input_features=f.input_features, attention_mask=f.attention_mask, **FALLBACK)

    decisions: list = []
    need = WhisperGenerationMixin._need_fallback

    def spy_need(self, *a, **k):  # records stock's (needs_fallback, should_skip) for every segment and round
        out = need(self, *a, **k)
        decisions.append(tuple(bool(x) for x in out))
        return out

    def run(csv: bool) -> tuple:
        decisions.clear()
        torch.manual_seed(0)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**kw, csv_config=hf_csv.CSVConfig()) if csv else model.generate(**kw)
        return out, time.perf_counter() - t0, list(decisions)

    WhisperGenerationMixin._need_fallback = spy_need
    try:
        t_stock, t_csv, identical, stats = [], [], True, None
        for i in range(pairs):  # the order alternates: the first call of the process pays the warm-up
            for csv in ((False, True) if i % 2 == 0 else (True, False)):
                out, t, dec = run(csv)
                if csv:
                    t_csv.append(t)
                    y, dy = out, dec
                    stats = dict(model.csv_last_stats)  # the whole call's: every round's counts summed
                else:
                    t_stock.append(t)
                    x, dx = out, dec
            identical &= bool(torch.equal(x, y)) and dx == dy
    finally:
        WhisperGenerationMixin._need_fallback = need
    return {"model": Path(model_dir).name, "audio_s": round(len(audio) / sr, 1), "identical": identical,
            "fallback_decisions": len(dx), "rounds_needing_fallback": sum(d[0] for d in dx),
            "stock_s": [round(t, 2) for t in t_stock], "csv_s": [round(t, 2) for t in t_csv],
            "mode": stats.get("mode"), "whisper_thresholds": stats.get("whisper_thresholds"),
            "rows": stats.get("head_rows"), "certified_rows": stats.get("certified"),
            "speed_guard_rows": stats.get("declined_rows"), "reasons": stats.get("reasons")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", required=True, help="a Whisper checkpoint directory (repeatable)")
    ap.add_argument("--pairs", type=int, default=1, help="stock/csv pairs per model, the order alternating")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from _load import cpu_info, machine_load

    res = {"cpu": cpu_info(), "load_before": machine_load(), "threads": args.threads,
           "models": [_report(m, args.pairs) for m in args.model]}
    print(json.dumps(res, indent=1, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
