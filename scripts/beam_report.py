"""Token-identical beam search (``CSVConfig(beam_search="exact")``) against stock beam search, on real models.

Per input: stock and hf_csv beam search interleaved (``--pairs`` times), identical outputs, the call's beam stats
(certified steps, restarts) and head rows (certified vs over the budget), and the median time ratio. Whisper models
run through ``pipeline("automatic-speech-recognition")`` with its default generation (5 beams) on each English clip;
LMs run ``generate(num_beams=B)`` on the first prompts of ``../shared/models/prompts.jsonl``.

    python scripts/beam_report.py --model whisper-base --json out.json
    python scripts/beam_report.py --model smollm2-135m --num-beams 4 --json out.json
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import time
from pathlib import Path

import torch

import hf_csv
from hf_csv import CSVConfig

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[1] / "shared" / "models"


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a directory under $HF_CSV_MODELS, or a path")
    ap.add_argument("--num-beams", type=int, default=5, help="LMs only (the ASR pipeline keeps its default)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="LMs only")
    ap.add_argument("--inputs", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    return ap.parse_args()


def _whisper_workload(args: argparse.Namespace, path: Path, cfg: CSVConfig):
    """The ASR pipeline on the first English clips: (model, inputs, run(input, csv), setting)."""
    import transformers as tf
    from scipy.io import wavfile

    model = hf_csv.enable(tf.WhisperForConditionalGeneration.from_pretrained(path).eval())
    asr = tf.pipeline("automatic-speech-recognition", model=model, tokenizer=tf.AutoTokenizer.from_pretrained(path),
                      feature_extractor=tf.AutoFeatureExtractor.from_pretrained(path), device="cpu")
    items = []
    for p in sorted(glob.glob(str(SHARED / "speech" / "en_*.wav")))[: args.inputs]:
        sr, a = wavfile.read(p)
        items.append({"raw": a.astype("float32") / 32768.0, "sampling_rate": sr})
    gk = {} if path.name.endswith(".en") else {"language": "en", "task": "transcribe"}

    def run(x, csv):
        return asr(dict(x), generate_kwargs={**gk, **({"csv_config": cfg} if csv else {})})["text"]
    return model, items, run, "pipeline('automatic-speech-recognition') defaults (5 beams)"


def _lm_workload(args: argparse.Namespace, path: Path, cfg: CSVConfig):
    """``generate(num_beams=B)`` on the first prompts: (model, inputs, run(input, csv), setting)."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(path)
    model = hf_csv.enable(tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    prompts = [json.loads(line)["prompt"] for line in open(SHARED / "prompts.jsonl")][: args.inputs]
    items = [tok(p, return_tensors="pt") for p in prompts]
    kw = dict(num_beams=args.num_beams, max_new_tokens=args.max_new_tokens, do_sample=False)

    def run(x, csv):
        return model.generate(**x, **kw, **({"csv_config": cfg} if csv else {}))
    return model, items, run, f"generate(num_beams={args.num_beams}, max_new_tokens={args.max_new_tokens})"


def _same(a, b) -> bool:
    return a == b if isinstance(a, str) else torch.equal(a, b)


def _input_row(i: int, model, x, run, pairs: int) -> dict:
    """One input: stock and hf_csv interleaved ``pairs`` times; the medians and the last call's stats."""
    ts, tc, ident, stats = [], [], True, None
    for _ in range(pairs):
        t0 = time.perf_counter()
        a = run(x, False)
        t1 = time.perf_counter()
        b = run(x, True)
        t2 = time.perf_counter()
        ts.append(t1 - t0)
        tc.append(t2 - t1)
        ident &= _same(a, b)
        stats = model.csv_last_stats
    beam = stats.get("beam", {})
    return {"input": i, "identical": ident, "stock_s": statistics.median(ts), "csv_s": statistics.median(tc),
            "ratio": statistics.median(ts) / statistics.median(tc), "mode": stats["mode"], "beam": beam,
            "head_rows": stats.get("head_rows", stats.get("rows", 0)), "head_rows_certified": stats.get("certified", 0),
            "head_rows_speed_guard": stats.get("declined_rows", 0),
            "head_rows_over_budget": stats.get("fallback", 0), "full_head_calls": stats.get("full_head_calls", 0),
            "reasons": stats["reasons"]}


def _summary(path: Path, setting: str, args: argparse.Namespace, rows: list[dict]) -> dict:
    steps = sum(r["beam"].get("certified_steps", 0) + r["beam"].get("full_steps", 0) for r in rows)
    return {"model": path.name, "setting": setting, "threads": args.threads, "pairs": args.pairs,
            "identical": all(r["identical"] for r in rows),
            "speedup_median": statistics.median(r["ratio"] for r in rows),
            "beam_steps": steps, "certified_steps": sum(r["beam"].get("certified_steps", 0) for r in rows),
            "subvocab_steps": sum(r["beam"].get("subvocab_steps", 0) for r in rows),
            "restarts": sum(r["beam"].get("restarts", 0) for r in rows),
            "head_rows": sum(r["head_rows"] for r in rows),
            "head_rows_certified": sum(r["head_rows_certified"] for r in rows),
            "head_rows_over_budget": sum(r["head_rows_over_budget"] for r in rows),
            "head_rows_speed_guard": sum(r["head_rows_speed_guard"] for r in rows),
            "load": os.getloadavg(), "rows": rows}


def main() -> None:
    args = _args()
    torch.set_num_threads(args.threads)
    root = Path(os.environ.get("HF_CSV_MODELS", Path.home() / ".cache" / "hf-csv-models"))
    path = Path(args.model) if Path(args.model).exists() else root / args.model
    cfg = CSVConfig(beam_search="exact")
    workload = _whisper_workload if "whisper" in path.name else _lm_workload
    model, items, run, setting = workload(args, path, cfg)
    run(items[0], True)  # builds the screen (its first calls use the full head while it is packed)
    from hf_csv.core.certificate import CertifiedHead  # noqa: F401 (the screen is packed in the background)

    time.sleep(2.0)
    rows = []
    for i, x in enumerate(items):
        r = _input_row(i, model, x, run, args.pairs)
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "reasons"}), flush=True)
    out = _summary(path, setting, args, rows)
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))

if __name__ == "__main__":
    main()
