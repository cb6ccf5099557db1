#!/usr/bin/env python
"""Stock vs certified greedy decoding, interleaved in one process (run under flock).

    flock /tmp/hf_csv_bench.lock python scripts/bench_generate.py \
        --model ~/.cache/hf-csv-models/qwen-coder-0.5b --json out/bench_qwen.json
    flock /tmp/hf_csv_bench.lock python scripts/bench_generate.py \
        --model ~/.cache/hf-csv-models/whisper-base --audio ../shared/models/speech/en_fox.wav --json out/bench_wb.json
    # under load (one busy process per extra core), in bf16, at batch 4:
    python scripts/bench_generate.py --model DIR --load 1 --dtype bfloat16 --batch 4 --json out/b.json

``--preset {greedy,default-sample,qwen-chat,min-p,top-p}`` picks the decoding settings (sampling presets reseed
before every call). ``--preset whisper-longform`` (a Whisper ``--model``) times greedy long-form transcription of
the speech clips joined into one > 60 s recording (``--audio`` to give another), with timestamps, two ways:
sequential long-form ``generate`` and ``pipeline("automatic-speech-recognition", chunk_length_s=30)`` with
``num_beams=1``; end to end (features, encoder and decoder), interleaved. ``--load N`` starts N busy CPU processes for the timed part (stock and csv alike; the first call is
timed before them). ``--batch B`` left-pads B different prompts (Whisper: B copies of the clip).

Writes: model, tokens_per_s_stock, tokens_per_s_csv, speedup (median over --runs interleaved
pairs), head_fraction f (time inside the stock head / whole generate, measured with hooks in a
separate stock run), limit = 1/(1-f), gain_fraction = (speedup-1)/(limit-1), identical_tokens,
certified_fraction, mean_subvocab_fraction, head_ms_stock / head_ms_csv (per head call inside generate, speed-guard
probes included), head_ms_csv_certified (the mean over the calls that ran certified: the speed guard's probes of the
full head, which cost the full head's time, left out) and its median; greedy only, in --runs rounds after the timed
pairs, each round two certified generate calls then the head alone: head_alone_ms_csv (the certified head call the
steps made, ``CertifiedHead.topk`` with the same arguments, on the decode rows that generate fed the head, caches
flushed between calls; median over rows, median over rounds), head_alone_call (those arguments), head_alone_warm_ms_csv (back to back, once),
head_in_generate_over_alone (per round: the median certified call in generate over the median alone; the median
of the rounds; the rounds' ratios in head_in_generate_over_alone_rounds), head_in_generate_over_alone_mean (the same
with each side's mean per call instead of its median: outliers count); and a PNG.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import hf_csv
from hf_csv.transformers.step import CSVHead

from _load import cpu_load, machine_load

HERE = Path(__file__).resolve().parent

# --preset: the decoding settings people run. Sampling presets reseed before every call, so stock and
# csv draw from the same random stream (top-k and min-p certificates give stock's tokens for a seed).
PRESETS = {
    "greedy": dict(do_sample=False, num_beams=1),
    "default-sample": dict(do_sample=True),  # transformers' defaults: top_k=50, T=1
    "qwen-chat": dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05),
    "min-p": dict(do_sample=True, top_k=0, min_p=0.05, temperature=0.7),
    "top-p": dict(do_sample=True, top_k=0, top_p=0.9, temperature=0.7),  # nucleus without a top-k (vLLM-style)
    "whisper-longform": dict(do_sample=False, num_beams=1, return_timestamps=True),
}
PROMPTS = HERE.parents[1] / "shared" / "models" / "prompts.jsonl"


def load(model_dir: str, audio: str | None, dtype: torch.dtype = torch.float32, batch: int = 1):
    if audio:
        from scipy.io import wavfile
        from transformers import AutoModelForSpeechSeq2Seq, AutoProcessor

        proc = AutoProcessor.from_pretrained(model_dir)
        model = AutoModelForSpeechSeq2Seq.from_pretrained(model_dir, dtype=dtype).eval()
        sr, a = wavfile.read(audio)
        a = a.astype("float32") / (32768.0 if a.dtype.kind == "i" else 1.0)
        feats = proc(a, sampling_rate=sr, return_tensors="pt").input_features.to(dtype).repeat(batch, 1, 1)
        # the encoder runs once, outside the timing: tokens/s and f are about the decoder loop
        with torch.no_grad():
            enc = model.get_encoder()(feats)
        extra = {"language": "en", "task": "transcribe"} if getattr(model.generation_config, "is_multilingual", False) else {}
        return model, {"encoder_outputs": enc}, extra
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    lines = [json.loads(x)["prompt"] for x in PROMPTS.read_text().splitlines() if x.strip()] if PROMPTS.exists() else ["Hello"]
    prompts = [lines[i % len(lines)] for i in range(batch)]
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    inputs = dict(tok(prompts, return_tensors="pt", padding=True))
    # a fixed new-token count without an extra processor: no EOS stop
    model.generation_config.eos_token_id = None
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return model, inputs, {"pad_token_id": pad}


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def head_time(module: torch.nn.Module, fn) -> tuple[float, int, float]:
    """(seconds inside ``module``'s forward, calls, total seconds) for one ``fn()``."""
    acc = {"t": 0.0, "n": 0, "t0": 0.0}

    def pre(m, a):
        acc["t0"] = time.perf_counter()

    def post(m, a, o):
        acc["t"] += time.perf_counter() - acc["t0"]
        acc["n"] += 1

    h1, h2 = module.register_forward_pre_hook(pre), module.register_forward_hook(post)
    try:
        _, total = timed(fn)
    finally:
        h1.remove(), h2.remove()
    return acc["t"], acc["n"], total


def head_alone(ch, rows: list, call: dict, flush: torch.Tensor | None) -> list:
    """Seconds of the certified head call that generate's steps made (``CertifiedHead.topk`` with the
    arguments ``call`` it was given there: for plain greedy a top-1 call with hf_csv's own values, for Whisper its
    top-9 call) on each decode row of ``rows`` (rows generate fed the head), one time per row whose call certified
    every row (the rows that fall back to stock's row are left out, as the certified calls in generate are counted),
    outside generate. With ``flush`` (cold) the buffer is written between calls (untimed), so the head's codes come from
    memory as they do inside generate, where the model body runs between two head calls; without it (warm) back to
    back."""
    ts = []
    with torch.no_grad():
        for H in rows:
            if flush is not None:
                flush.fill_(1.0)
            t0 = time.perf_counter()
            res = ch.topk(H, **call)
            dt = time.perf_counter() - t0
            if res.stats.certified == res.stats.rows:  # as in generate: calls a row of which fell back are left out
                ts.append(dt)
    return ts


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--audio")
    ap.add_argument("--json", required=True)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--load", type=int, default=0, help="busy CPU processes during the timed part")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="greedy")
    return ap.parse_args()


def _sides(model, gen: dict, cfg, seeded: bool):
    """The stock and the certified ``generate`` call; a sampling preset reseeds before each."""
    def stock():
        if seeded:
            torch.manual_seed(0)
        with torch.no_grad():
            return model.generate(**gen)

    def csv():
        if seeded:
            torch.manual_seed(0)
        with torch.no_grad():
            return model.generate(**gen, csv_config=cfg)
    return stock, csv


def _pairs(stock, csv, runs: int, ref: torch.Tensor) -> tuple[list, list, bool]:
    """``runs`` interleaved pairs, the order alternating (ABBA): drift and order hit both alike. (stock seconds, csv
    seconds, every output equal to ``ref``)."""
    t_stock, t_csv, identical = [], [], True
    for i in range(runs):
        if i % 2 == 0:
            a, ta = timed(stock)
            b, tb = timed(csv)
        else:
            b, tb = timed(csv)
            a, ta = timed(stock)
        identical &= torch.equal(a, ref) and torch.equal(b, ref)
        t_stock.append(ta), t_csv.append(tb)
    return t_stock, t_csv, identical


def _head_in_generate(head: torch.nn.Module, cfg, csv, greedy: bool, runs: int):
    """The head in generate and alone, interleaved round by round (drift and load hit both alike), each side's calls
    that certified every row: in generate over 2 calls (64 head calls; the speed guard's probes of the full head,
    which cost the full head's time, left out), alone cold on the rows generate fed the head. Returns (acc: seconds
    of every head call in generate and of the certified ones, the decode rows fed to the head, the arguments of the
    certified head's last top-k call, rounds: (seconds in generate, seconds alone) per round, the certified head)."""
    orig_fwd = CSVHead.forward
    acc = {"t": 0.0, "n": 0, "cert": []}  # cert: seconds of each head call that ran certified (not a guard probe)
    rows: list = []  # decode rows the head was fed (for the head-alone timing)

    def timed_fwd(self, h):
        t = time.perf_counter()
        o = orig_fwd(self, h)
        dt = time.perf_counter() - t
        acc["t"] += dt
        acc["n"] += 1
        if bool(torch.isinf(o).any()):  # a certified row holds -inf outside S; the full head's (a probe) does not
            acc["cert"].append(dt)
        if h.dim() == 3 and h.shape[1] == 1 and len(rows) < 64:
            rows.append(h.detach().reshape(-1, h.shape[-1]).clone())
        return o

    ch = hf_csv.transformers.heads.get_certified_head(head, cfg)
    call: dict = {}  # the arguments of the certified head's last topk call in generate (replayed alone)
    orig_topk = type(ch).topk

    def seen_topk(self, H, k=1, **kw):
        if self is ch and H.shape[0] == 1:
            call.clear()
            call.update(kw, k=k)
        return orig_topk(self, H, k, **kw)

    flush = torch.empty(64 << 20, dtype=torch.float32) if greedy else None  # 256 MB, more than any L3 here
    rounds: list = []  # per round: (seconds of each call in generate, of each call alone, cold)
    for r in range(max(1, runs) if greedy else 1):
        n0 = len(acc["cert"])
        CSVHead.forward, type(ch).topk = timed_fwd, seen_topk
        try:
            for _ in range(2):
                timed(csv)
        finally:
            CSVHead.forward, type(ch).topk = orig_fwd, orig_topk
        if greedy and rows and call and len(acc["cert"]) > n0:
            if r == 0:  # (a first alone call: nothing in it is built any more, the cached head is)
                ch.topk(rows[0], **call)
            alone = head_alone(ch, rows, call, flush)
            if alone:
                rounds.append((acc["cert"][n0:], alone))
    return acc, rows, call, rounds, ch


def _result(args: argparse.Namespace, m: dict) -> dict:
    """The JSON record (the module docstring's fields) from the measurements ``m``."""
    acc, rounds, stats, new = m["acc"], m["rounds"], m["stats"], m["new"]
    alone_warm = statistics.median(m["warm"]) if m["warm"] else None
    ratios = [statistics.median(a) / statistics.median(b) for a, b in rounds]
    ratios_mean = [statistics.fmean(a) / statistics.fmean(b) for a, b in rounds]
    f = m["hs"] / m["tot"]
    limit = 1 / (1 - f)
    ms, mc = statistics.median(m["t_stock"]), statistics.median(m["t_csv"])
    speedup = ms / mc
    return {
        "model": os.path.basename(os.path.normpath(args.model)),
        "audio": os.path.basename(args.audio) if args.audio else None,
        "new_tokens": int(new), "runs": args.runs, "threads": args.threads,
        "load": args.load, "dtype": args.dtype, "batch": args.batch, "preset": args.preset,
        "machine_before": m["before"],
        "tokens_per_s_stock": args.batch * new / ms, "tokens_per_s_csv": args.batch * new / mc, "speedup": speedup,
        "head_fraction": f, "limit": limit, "gain_fraction": (speedup - 1) / (limit - 1) if limit > 1 else float("nan"),
        "identical_tokens": bool(m["identical"]),
        "certified_fraction": stats.get("certified_fraction"), "mean_subvocab_fraction": stats.get("mean_subvocab_fraction"),
        "near_ties": stats.get("near_ties"), "mode": stats.get("mode"), "verify_reruns": stats.get("verify_reruns"),
        "head_ms_stock": 1e3 * m["hs"] / max(m["ns"], 1), "head_ms_csv": 1e3 * acc["t"] / max(acc["n"], 1),
        "head_alone_ms_csv": 1e3 * statistics.median(statistics.median(b) for _, b in rounds) if rounds else None,
        "head_alone_warm_ms_csv": None if alone_warm is None else 1e3 * alone_warm,
        "head_ms_csv_certified": 1e3 * statistics.fmean(acc["cert"]) if acc["cert"] else None,
        "head_ms_csv_certified_median": 1e3 * statistics.median(acc["cert"]) if acc["cert"] else None,
        "head_in_generate_over_alone": statistics.median(ratios) if ratios else None,
        "head_in_generate_over_alone_rounds": ratios,
        "head_in_generate_over_alone_mean": statistics.median(ratios_mean) if ratios_mean else None,
        "head_in_generate_over_alone_mean_rounds": ratios_mean,
        "head_alone_call": {k: str(v) for k, v in m["call"].items()},
        "step_ms_stock": 1e3 * ms / max(new, 1), "step_ms_csv": 1e3 * mc / max(new, 1),
        "first_csv_call_s": m["t_build"], "first_stock_call_s": m["t_first_stock"],
        "first_call_ratio": m["t_first_stock"] / m["t_build"], "times_stock_s": m["t_stock"], "times_csv_s": m["t_csv"],
    }


def _plot(res: dict, args: argparse.Namespace) -> None:
    """tokens/s of both sides and the speedup against its limit, beside the JSON (optional: needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(8, 3))
        ax[0].bar(["stock", "csv"], [res["tokens_per_s_stock"], res["tokens_per_s_csv"]], color=["gray", "tab:blue"])
        ax[0].set_ylabel(f"tokens/s ({args.preset}, {args.dtype}, batch {args.batch}, load {args.load})")
        ax[1].bar(["speedup", "limit 1/(1-f)"], [res["speedup"], res["limit"]], color=["tab:blue", "lightgray"])
        ax[1].axhline(1, color="k", lw=0.5)
        fig.suptitle(f"{res['model']}: gain fraction {res['gain_fraction']:.2f}")
        fig.tight_layout()
        fig.savefig(str(Path(args.json).with_suffix(".png")), dpi=100)
    except Exception as e:  # plotting is optional
        print("no plot:", e)


def main() -> None:
    args = _args()
    torch.set_num_threads(args.threads)
    if args.preset == "whisper-longform":
        return longform(args)
    m: dict = {"before": machine_load()}
    model, inputs, extra = load(args.model, args.audio, getattr(torch, args.dtype), args.batch)
    hf_csv.enable(model)
    cfg = hf_csv.CSVConfig()
    gen = dict(inputs, max_new_tokens=args.new_tokens, **PRESETS[args.preset], **extra)
    n_in = inputs["input_ids"].shape[1] if "input_ids" in inputs else 1  # Whisper: count tokens after the start token
    stock, csv = _sides(model, gen, cfg, bool(gen.get("do_sample")))
    ref, m["t_first_stock"] = timed(stock)  # warm-up, and builds nothing
    out, m["t_build"] = timed(csv)  # warm-up: builds the int8 screen once (cached per model); quiet
    m["new"] = ref.shape[1] - n_in
    _, head = hf_csv.transformers.heads.find_head(model)
    with cpu_load(args.load):
        m["t_stock"], m["t_csv"], same = _pairs(stock, csv, args.runs, ref)
        m["identical"] = torch.equal(ref, out) and same
        m["stats"] = model.csv_last_stats
        # head fraction: hooks on the stock head in a separate stock run; csv head time likewise
        m["hs"], m["ns"], m["tot"] = head_time(head, stock)
        m["acc"], rows, m["call"], m["rounds"], ch = _head_in_generate(head, cfg, csv, args.preset == "greedy",
                                                                        args.runs)
    m["warm"] = head_alone(ch, rows, m["call"], None) if m["rounds"] else None
    res = _result(args, m)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    _plot(res, args)


def _longform_audio(args: argparse.Namespace):
    """(samples, rate): ``--audio``, or the speech clips joined past 60 s."""
    from _audio import long_clip

    if args.audio:
        from scipy.io import wavfile

        sr, audio = wavfile.read(args.audio)
        return audio.astype("float32") / (32768.0 if audio.dtype.kind == "i" else 1.0), sr
    return long_clip(60.0)


def _recording(model) -> list:
    """Wraps ``model.generate`` so that every certified call's stats land in the returned list (the pipeline calls
    generate once per chunk)."""
    calls: list = []
    enabled = model.generate

    def recording(*a, **kw):
        out = enabled(*a, **kw)
        if "csv_config" in kw:
            calls.append(model.csv_last_stats)
        return out

    model.generate = recording
    return calls


def _longform_path(stock, csv, calls: list, head: torch.nn.Module, args: argparse.Namespace) -> dict:
    """One long-form path, stock against csv: first calls, ``--runs`` pairs, the head fraction and the rows' counts."""
    with torch.no_grad():
        ref, t_first_stock = timed(stock)
        calls.clear()
        out, t_first = timed(csv)  # builds the screen on the first path
        same = _same(ref, out)
        ts, tc = [], []
        with cpu_load(args.load):
            for _ in range(args.runs):
                a, x = timed(stock)
                calls.clear()
                b, y = timed(csv)
                same &= _same(a, ref) and _same(b, ref)
                ts.append(x), tc.append(y)
            hs, _, tot = head_time(head, stock)
    # every head row: the certified head's and those the speed guard gave the full head (csv_stats "head_rows")
    rows = sum(c.get("head_rows", c.get("rows", 0)) for c in calls)
    cert = sum(c.get("certified", 0) for c in calls)
    tsx = {}
    for c in calls:
        for k, v in (c.get("timestamps") or {}).items():
            tsx[k] = tsx.get(k, 0) + v
    fr = hs / tot
    limit = 1 / (1 - fr)
    sp = statistics.median(ts) / statistics.median(tc)
    return {"identical": bool(same), "speedup": sp, "times_stock_s": ts, "times_csv_s": tc,
            "head_fraction": fr, "limit": limit,
            "gain_fraction": (sp - 1) / (limit - 1) if limit > 1 else float("nan"),
            "generate_calls": len(calls), "rows": rows, "certified_rows": cert,
            "speed_guard_rows": sum(c.get("declined_rows", 0) for c in calls),
            "certified_fraction": cert / rows if rows else float("nan"),
            "full_head_calls": sum(c.get("full_head_calls", 0) for c in calls),
            "verify_reruns": sum(c.get("verify_reruns", 0) for c in calls),
            "reasons": sorted({r for c in calls for r in c.get("reasons", [])}), "timestamps": tsx,
            "first_csv_call_s": t_first, "first_stock_call_s": t_first_stock}


def longform(args) -> None:
    """``--preset whisper-longform``: sequential long-form generate and the chunked pipeline, stock vs csv."""
    from transformers import AutoModelForSpeechSeq2Seq, AutoProcessor, pipeline

    before = machine_load()
    dtype = getattr(torch, args.dtype)
    proc = AutoProcessor.from_pretrained(args.model)
    model = hf_csv.enable(AutoModelForSpeechSeq2Seq.from_pretrained(args.model, dtype=dtype).eval())
    audio, sr = _longform_audio(args)
    seconds = len(audio) / sr
    f = proc(audio, sampling_rate=sr, return_tensors="pt", truncation=False, padding="longest",
             return_attention_mask=True)
    lang = {"language": "en", "task": "transcribe"} if getattr(model.generation_config, "is_multilingual", False) else {}
    gen = dict(input_features=f.input_features.to(dtype), attention_mask=f.attention_mask, **PRESETS[args.preset], **lang)
    pipe = pipeline("automatic-speech-recognition", model=model, tokenizer=proc.tokenizer,
                    feature_extractor=proc.feature_extractor, chunk_length_s=30, device="cpu", dtype=dtype)
    cfg = hf_csv.CSVConfig()
    calls = _recording(model)
    pkw = {"num_beams": 1, **lang}
    paths = {
        "sequential": (lambda: model.generate(**gen), lambda: model.generate(**gen, csv_config=cfg)),
        "pipeline": (lambda: pipe({"raw": audio, "sampling_rate": sr}, return_timestamps=True, generate_kwargs=pkw),
                     lambda: pipe({"raw": audio, "sampling_rate": sr}, return_timestamps=True,
                                  generate_kwargs={**pkw, "csv_config": cfg})),
    }
    res = {"model": os.path.basename(os.path.normpath(args.model)), "preset": args.preset, "audio_s": seconds,
           "runs": args.runs, "threads": args.threads, "load": args.load, "dtype": args.dtype, "batch": 1,
           "machine_before": before}
    _, head = hf_csv.transformers.heads.find_head(model)
    for name, (stock, csv) in paths.items():
        res[name] = _longform_path(stock, csv, calls, head, args)
    # the pipeline's default (5 beams) for reference: declined, and why
    calls.clear()
    pipe({"raw": audio[: sr * 5], "sampling_rate": sr}, generate_kwargs={**lang, "csv_config": cfg})
    res["pipeline_default_beams"] = {"mode": calls[-1]["mode"], "reasons": calls[-1]["reasons"]} if calls else None
    res["speedup"] = res["sequential"]["speedup"]
    res["identical_tokens"] = res["sequential"]["identical"] and res["pipeline"]["identical"]
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2, default=float))
    print(json.dumps(res, indent=2, default=float))


def _same(a, b) -> bool:
    """Equal outputs: tensors bitwise, pipeline dicts (text and timestamped chunks) by value."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and torch.equal(a, b)
    return a == b


if __name__ == "__main__":
    main()
