#!/usr/bin/env python
"""Whisper assisted greedy decoding: plain, stock assisted and hf_csv assisted, interleaved, on English speech.

    python scripts/whisper_assisted_report.py --model $M/whisper-base --assistant $M/whisper-base-draft \
        --runs 5 --draft-lengths 3 5 8 --pipeline --json out/whisper_draft.json

``--assistant``: a checkpoint folder (a ``WhisperForCausalLM`` draft such as ``scripts/train_whisper_draft.py``
writes), ``quantized`` (the int8 self-draft, hf_csv.transformers.drafts.quantized_assistant) or ``truncated`` (the target's
first ``--layers`` decoder layers, untrained: an API check, not a speed claim).

Clips: the English clips of ../shared/models/speech and the held-out clips of ``scripts/_speech.py`` (voices and
speeds no training clip used). Multilingual models decode with ``language="en", task="transcribe"``.

For each clip, each run: plain greedy, stock assisted and hf_csv assisted (``csv_config=CSVConfig()``), in that
order, from the input features (the encoder included). Reports whether all three give the same tokens on every
clip and run (``identical``), the draft's acceptance (accepted drafted tokens / drafted tokens, counted from
stock's own per-iteration report on hf_csv's run), tokens/s medians over runs (tokens / total time of the clips),
``speedup_vs_plain`` and ``speedup_vs_stock_assisted`` (hf_csv assisted), the encoder's share of plain's time
(the encoder runs once per clip in every mode, so it bounds what any decoder speed-up can give) and the decoder-only
ratios with the encoder's median time taken off each mode. ``--draft-lengths``: acceptance and hf_csv's tokens/s
with a constant draft length k (the assistant's ``num_assistant_tokens``, no confidence stop), one pass over the
clips each. ``--pipeline``: ``pipeline("automatic-speech-recognition", chunk_length_s=30)`` on a recording of more
than 60 s (the held-out clips, repeated) with ``num_beams=1`` (the pipeline's default is 5 beams), the three modes
interleaved over ``--runs``, identical texts required. Also: the step cost ratio c of one cached decoder step
(assistant over target, full heads) and the greedy ceiling max_k (1 - a^(k+1)) / ((1 - a) (k c + 1)) (Leviathan et
al. 2023, eq. 1, the verify costed as one target step); ``step_costs`` splits each step into body and head (full and
hf_csv's certified top-1 call), and ``step_cost_ratio_certified`` / ``ceiling_certified_vs_plain_certified`` are c
and the ceiling with both heads certified (against plain decoding with hf_csv's head).
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

import hf_csv  # noqa: E402
from hf_csv import CSVConfig  # noqa: E402
from hf_csv.transformers.drafts import quantized_assistant, truncated_assistant  # noqa: E402

import _speech  # noqa: E402


def _wer(ref: str, hyp: str) -> float:
    r, h = _speech.norm(ref).split(), _speech.norm(hyp).split()
    d = list(range(len(h) + 1))
    for i, rw in enumerate(r, 1):
        prev, d[0] = d[0], i
        for j, hw in enumerate(h, 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (rw != hw))
    return d[len(h)] / max(1, len(r))


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--assistant", default="quantized", help="a checkpoint folder, 'quantized' or 'truncated'")
    ap.add_argument("--layers", type=int, default=2, help="--assistant truncated: decoder layers kept")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clips", default="zoo,heldout", help="comma-separated: zoo, heldout")
    ap.add_argument("--draft-lengths", type=int, nargs="*", default=[])
    ap.add_argument("--pipeline", action="store_true")
    ap.add_argument("--json", type=Path, required=True)
    return ap.parse_args(argv)


def _models(a: argparse.Namespace):
    """(processor, the target with hf_csv enabled, the assistant ``--assistant`` names)."""
    from transformers import AutoModelForSpeechSeq2Seq, AutoProcessor, WhisperForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    proc = AutoProcessor.from_pretrained(a.model)
    m = hf_csv.enable(AutoModelForSpeechSeq2Seq.from_pretrained(a.model, dtype=torch.float32).eval())
    if a.assistant == "quantized":
        draft = quantized_assistant(m)
    elif a.assistant == "truncated":
        draft = truncated_assistant(m, a.layers)
    else:
        draft = WhisperForCausalLM.from_pretrained(a.assistant, dtype=torch.float32).eval()
    return proc, m, draft


def _counting():
    """Installs a counter on stock's own per-iteration report: update_candidate_strategy(input_ids, scores,
    num_matches), where scores has candidate_length + 1 positions (instrumentation of this script only). Returns
    the list of (drafted, accepted) per target call it fills, and a function that removes the counter."""
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    counts: list = []
    orig_update = AssistedCandidateGenerator.update_candidate_strategy

    def update(self, input_ids, scores, num_matches):
        counts.append((scores.shape[1] - 1, int(num_matches)))
        return orig_update(self, input_ids, scores, num_matches)

    AssistedCandidateGenerator.update_candidate_strategy = update

    def restore() -> None:
        AssistedCandidateGenerator.update_candidate_strategy = orig_update
    return counts, restore


def _interleaved(a: argparse.Namespace, clips: list, feats: list, modes: dict, counts: list, proc, m) -> dict:
    """``--runs`` passes over the clips, the three modes in turn on each clip: tokens/s and seconds per pass,
    identical tokens, and (first pass) drafted / accepted tokens, target calls, transcripts and encoder times."""
    r = {"tps": {k: [] for k in modes}, "secs": {k: [] for k in modes}, "identical": True, "drafted": 0,
         "accepted": 0, "target_calls": 0, "texts": [], "enc_t": []}
    for run in range(a.runs):
        tot = {k: [0.0, 0] for k in modes}
        for (name, _, ref), f in zip(clips, feats):
            outs = {}
            for k, fn in modes.items():
                t0 = time.perf_counter()
                outs[k] = fn(f)
                tot[k][0] += time.perf_counter() - t0
                tot[k][1] += outs[k].shape[1]
            r["identical"] &= torch.equal(outs["assisted_csv"], outs["plain"]) and torch.equal(outs["assisted_stock"],
                                                                                            outs["plain"])
            if run == 0:
                counts.clear()
                modes["assisted_csv"](f)  # once more, counting drafted / accepted tokens
                r["drafted"] += sum(c for c, _ in counts)
                r["accepted"] += sum(n for _, n in counts)
                r["target_calls"] += len(counts)
                hyp = proc.batch_decode(outs["plain"], skip_special_tokens=True)[0].strip()
                r["texts"].append({"clip": name, "text": hyp, "wer": round(_wer(ref, hyp), 3)})
                t0 = time.perf_counter()
                m.get_encoder()(f)
                r["enc_t"].append(time.perf_counter() - t0)
        for k in modes:
            r["tps"][k].append(tot[k][1] / tot[k][0])
            r["secs"][k].append(tot[k][0])
    return r


def _by_draft_length(a: argparse.Namespace, draft, feats: list, modes: dict, counts: list, plain_tps: float) -> dict:
    """Per ``--draft-lengths`` k: one pass of hf_csv assisted with a constant draft length and no confidence stop."""
    by_k = {}
    for k_len in a.draft_lengths:
        saved = (draft.generation_config.num_assistant_tokens, draft.generation_config.num_assistant_tokens_schedule,
                 draft.generation_config.assistant_confidence_threshold)
        draft.generation_config.num_assistant_tokens = k_len
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0
        counts.clear()
        t_tot, n_tot = 0.0, 0
        for f in feats:
            t0 = time.perf_counter()
            out = modes["assisted_csv"](f)
            t_tot += time.perf_counter() - t0
            n_tot += out.shape[1]
        d_k, a_k = sum(c for c, _ in counts), sum(n for _, n in counts)
        by_k[k_len] = {"acceptance": a_k / max(1, d_k), "drafted": d_k, "target_calls": len(counts),
                       "tokens_per_target_call": (a_k + len(counts)) / max(1, len(counts)),
                       "tok_s_csv_assisted": n_tot / t_tot, "vs_plain_median": (n_tot / t_tot) / plain_tps}
        (draft.generation_config.num_assistant_tokens, draft.generation_config.num_assistant_tokens_schedule,
         draft.generation_config.assistant_confidence_threshold) = saved
    return by_k


def _ceiling(acc: float, c: float) -> float:
    """The greedy ceiling max_k (1 - a^(k+1)) / ((1 - a) (k c + 1)) over k = 1..32."""
    return max(((1 - acc ** (k + 1)) / ((1 - acc) * (k * c + 1)) if acc < 1 else (k + 1) / (k * c + 1))
               for k in range(1, 33))


def _report(a: argparse.Namespace, draft, kw: dict, clips: list, r: dict, extra: dict) -> dict:
    """The JSON record (the module docstring's fields)."""
    from _load import machine_load

    med = {k: statistics.median(v) for k, v in r["tps"].items()}
    med_s = {k: statistics.median(v) for k, v in r["secs"].items()}
    enc_s = sum(r["enc_t"])  # the encoder's time over all clips (one pass each, run 0)
    acc, costs = r["accepted"] / max(1, r["drafted"]), extra["costs"]
    return {"command": " ".join(["python", *sys.argv]), "model": Path(a.model).name, "assistant": a.assistant,
            "assistant_layers": draft.config.decoder_layers, "threads": a.threads,
            "machine_after": machine_load(), "generate_kwargs": {k: v for k, v in kw.items()},
            "clips": [c[0] for c in clips], "identical_tokens": bool(r["identical"]), "identical": bool(r["identical"]),
            "transcripts": r["texts"], "mean_wer": statistics.mean(t["wer"] for t in r["texts"]),
            "acceptance": acc, "draft_acceptance_rate": acc, "drafted_tokens": r["drafted"],
            "target_calls": r["target_calls"], "tokens_per_s_median": med, "tokens_per_s_runs": r["tps"],
            "tok_s_plain": med["plain"], "tok_s_stock_assisted": med["assisted_stock"],
            "tok_s_csv_assisted": med["assisted_csv"],
            "speedup_vs_plain": med["assisted_csv"] / med["plain"],
            "speedup_vs_stock_assisted": med["assisted_csv"] / med["assisted_stock"],
            "stock_assisted_vs_plain": med["assisted_stock"] / med["plain"],
            "assisted_speedup_csv_vs_stock": med["assisted_csv"] / med["assisted_stock"],
            "assisted_csv_vs_plain": med["assisted_csv"] / med["plain"],
            "seconds_median": med_s, "encoder_seconds": enc_s, "encoder_share_of_plain": enc_s / med_s["plain"],
            "decoder_only_speedup_vs_plain": (med_s["plain"] - enc_s) / (med_s["assisted_csv"] - enc_s),
            "decoder_only_speedup_vs_stock_assisted": (med_s["assisted_stock"] - enc_s) / (med_s["assisted_csv"] - enc_s),
            "by_draft_length": extra["by_k"], "pipeline": extra["pipeline"],
            "step_cost_ratio": costs["c_full"], "ceiling_greedy_assisted_vs_plain": _ceiling(acc, costs["c_full"]),
            "step_costs": costs, "step_cost_ratio_certified": costs["c_certified"],
            "ceiling_certified_vs_plain_certified": _ceiling(acc, costs["c_certified"])}


@torch.no_grad()
def main(argv=None) -> int:
    a = _args(argv)
    torch.set_num_threads(a.threads)
    proc, m, draft = _models(a)
    clips = []
    for part in a.clips.split(","):
        clips += {"zoo": _speech.zoo_clips, "heldout": _speech.heldout_clips}[part.strip()]()
    feats = [proc(x, sampling_rate=16000, return_tensors="pt").input_features for _, x, _ in clips]
    kw = dict(num_beams=1, do_sample=False, max_new_tokens=128)
    if getattr(m.generation_config, "is_multilingual", False):
        kw.update(language="en", task="transcribe")
    modes = {
        "plain": lambda f: m.generate(f, **kw),
        "assisted_stock": lambda f: m.generate(f, assistant_model=draft, **kw),
        "assisted_csv": lambda f: m.generate(f, assistant_model=draft, csv_config=CSVConfig(), **kw),
    }
    for f in feats[:1]:  # warm-up
        for fn in modes.values():
            fn(f)
    counts, restore = _counting()
    r = _interleaved(a, clips, feats, modes, counts, proc, m)
    plain_tps = statistics.median(r["tps"]["plain"])
    extra = {"by_k": _by_draft_length(a, draft, feats, modes, counts, plain_tps)}
    restore()
    extra["costs"] = _step_costs(m, draft, feats[0], a.runs)
    extra["pipeline"] = _pipeline(m, proc, draft, kw, a.runs) if a.pipeline else None
    rep = _report(a, draft, kw, clips, r, extra)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(rep, indent=2))
    print(json.dumps({k: v for k, v in rep.items() if k not in ("tokens_per_s_runs", "transcripts")}, indent=2))
    return 0


@torch.no_grad()
def _pipeline(m, proc, draft, kw, runs: int) -> dict:
    """The ASR pipeline (chunk_length_s=30) on a recording of more than 60 s: the three modes, interleaved."""
    from transformers import pipeline

    from _audio import repeat_past

    audio = repeat_past([a for _, a, _ in _speech.heldout_clips()], 16000, 65.0, 0.6)
    pipe = pipeline("automatic-speech-recognition", model=m, tokenizer=proc.tokenizer,
                    feature_extractor=proc.feature_extractor, chunk_length_s=30, device="cpu")
    gk = {k: v for k, v in kw.items() if k != "max_new_tokens"}
    modes = {"plain": gk, "assisted_stock": dict(gk, assistant_model=draft),
             "assisted_csv": dict(gk, assistant_model=draft, csv_config=CSVConfig())}
    times = {k: [] for k in modes}
    texts = {}
    for run in range(runs + 1):  # the first run warms up
        for k, g in modes.items():
            t0 = time.perf_counter()
            texts[k] = pipe({"raw": audio, "sampling_rate": 16000}, generate_kwargs=dict(g))["text"]
            if run:
                times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"audio_seconds": len(audio) / 16000, "identical": texts["plain"] == texts["assisted_stock"] == texts["assisted_csv"],
            "seconds_median": med, "seconds_runs": times, "words": len(texts["plain"].split()),
            "speedup_vs_plain": med["plain"] / med["assisted_csv"],
            "speedup_vs_stock_assisted": med["assisted_stock"] / med["assisted_csv"],
            "stock_assisted_vs_plain": med["plain"] / med["assisted_stock"], "text_head": texts["plain"][:200]}


@torch.no_grad()
def _step_costs(m, draft, feat, runs: int) -> dict:
    """One cached decoder step of the assistant and of the target, split into body and head (32-token decodes after
    one shared encoder pass, medians over ``max(3, runs)`` decodes): ``step_ms`` with the full head as stock runs it,
    ``head_full_ms`` the full head alone and ``head_certified_ms`` hf_csv's certified top-1 call alone on the rows the
    steps fed the head (the draft's own greedy call; the target's verify calls in generate may take more tokens), so
    ``body_ms = step_ms - head_full_ms``. ``c_full`` is the assistant's step over the target's with full heads (the
    earlier ``step_cost_ratio``); ``c_certified`` with both heads certified (body + certified head)."""
    import hf_csv
    from hf_csv.transformers.heads import find_head, get_certified_head

    enc = m.get_encoder()(feat)
    start = torch.tensor([[m.generation_config.decoder_start_token_id]])
    cfg = hf_csv.CSVConfig()

    def split(model) -> dict:
        from transformers import DynamicCache

        _, head = find_head(model)
        rows: list = []
        hook = head.register_forward_hook(lambda mod, inp, out: rows.append(inp[0].detach().reshape(-1, inp[0].shape[-1])[-1:].clone()))
        steps = []
        try:
            for _ in range(max(3, runs)):
                cache, ids = DynamicCache(), start
                rows.clear()
                t0 = time.perf_counter()
                for _ in range(32):
                    out = model(encoder_outputs=enc, **{("decoder_input_ids" if model is m else "input_ids"): ids},
                                past_key_values=cache, use_cache=True)
                    cache = out.past_key_values
                    ids = out.logits[:, -1:].argmax(-1)
                steps.append((time.perf_counter() - t0) / 32)
        finally:
            hook.remove()
        ch = get_certified_head(head, cfg)
        for H in rows[:4]:  # the build and the column re-choice happen here, untimed
            ch.topk(H, k=1)

        def per_row(fn) -> float:
            ts = []
            for _ in range(max(3, runs)):
                for H in rows:
                    t0 = time.perf_counter()
                    fn(H)
                    ts.append(time.perf_counter() - t0)
            return statistics.median(ts)

        full = per_row(lambda H: head(H))
        cert = per_row(lambda H: ch.topk(H, k=1))
        step = statistics.median(steps)
        return {"step_ms": 1e3 * step, "head_full_ms": 1e3 * full, "head_certified_ms": 1e3 * cert,
                "body_ms": 1e3 * (step - full)}

    t, d = split(m), split(draft)
    cert = lambda x: x["body_ms"] + x["head_certified_ms"]  # noqa: E731
    return {"target": t, "assistant": d, "c_full": d["step_ms"] / t["step_ms"], "c_certified": cert(d) / cert(t)}


if __name__ == "__main__":
    raise SystemExit(main())
