#!/usr/bin/env python
"""Train a distil-whisper-shaped draft for whisper-base on this machine's CPU (issue 40; docs/speculative.md, "A trained Whisper draft").

    python scripts/train_whisper_draft.py                      # the default run: 23 min on 2 cores (docs/benchmarks.md §10.1)
    python scripts/train_whisper_draft.py --clips 24 --train-minutes 1 --out /tmp/draft   # a smoke run

What it does, in order (each stage prints its time):

1. **Text**, three sources drawn with equal odds per sentence: a template grammar written here; sentences sampled
   from ``$HF_CSV_MODELS/smollm2-135m`` where it exists (the model zoo's prose prompts, temperature 0.9, for
   ``--lm-seconds``); lists of 4-12 common words from Whisper's vocabulary (text no language model predicts, so the
   draft must read the audio). Sentences of the evaluation clips (``scripts/_speech.py``: the held-out clips and
   ``../shared/models/speech``) are dropped.
2. **Speech.** espeak-ng + sox: each training clip is 1 to 6 sentences read by one of the *training* voices,
   speeds and pitches (``_speech.TRAIN_*``; the held-out voices and speeds are never used), 2 to 28 s.
3. **Encoder outputs** of whisper-base, computed once (fp32, kept in fp16).
4. **Pseudo-labels.** whisper-base's own greedy transcripts (``language="en"``, ``task="transcribe"``, batched
   ``generate``), and its teacher-forced token distributions on them (top-16 log-probabilities per position).
5. **The draft.** A ``WhisperForCausalLM`` with 2 decoder layers, initialised from whisper-base's first and last
   decoder layers, its token and position embeddings, final layer norm and (tied) head. Trained by knowledge
   distillation: cross-entropy on the greedy tokens plus the cross-entropy against the teacher's top-16
   distribution (renormalised), dropout 0.1 in the layers. The embeddings, the head and the cross-attention key/value projections stay frozen
   (they are the target's own, so the encoder's keys and values need no gradient), everything else trains.
6. **Curve.** Every ``--eval-every`` steps: the draft's greedy agreement with whisper-base on the held-out clips
   (teacher-forced on whisper-base's own greedy transcripts: the fraction of positions where the draft's argmax is
   the target's next token, which is the per-token acceptance of assisted greedy decoding) and the training loss;
   written to ``curve.json`` and plotted to ``curve.png``.
7. **Save** to ``--out`` (default ``$HF_CSV_MODELS/whisper-base-draft``): a standard transformers checkpoint
   (``WhisperForCausalLM``, safetensors, the target's generation config and processor) with a model card
   (``README.md``) stating the data and the figures.

Use it as transformers' assistant: ``model.generate(features, assistant_model=WhisperForCausalLM.from_pretrained(out),
language="en")``; hf_csv certifies its head too (``csv_config=CSVConfig()``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]

import _speech  # noqa: E402

MODELS = Path(os.environ.get("HF_CSV_MODELS", Path.home() / ".cache" / "hf-csv-models"))
TOPK = 16

# --- 1. text -------------------------------------------------------------------------------------------------------
_T = {
    "who": ["my sister", "the teacher", "our neighbour", "a young doctor", "the old fisherman", "the children",
            "the new manager", "my grandfather", "a tall stranger", "the pilot", "the baker", "our team",
            "the students", "his cousin", "the mayor", "a famous painter", "the nurse", "my best friend"],
    "verb": ["bought", "found", "painted", "repaired", "forgot", "sold", "carried", "cleaned", "lost", "borrowed",
             "ordered", "delivered", "described", "photographed", "opened", "packed", "returned", "wrapped"],
    "thing": ["a blue umbrella", "the heavy boxes", "an old bicycle", "three wooden chairs", "the kitchen table",
              "a basket of apples", "the broken clock", "a small green boat", "the letters", "a pair of boots",
              "the silver key", "twelve cups of coffee", "a map of the island", "the garden gate",
              "two tickets to the concert", "a loaf of fresh bread", "the red notebook", "a box of candles"],
    "where": ["at the market", "near the station", "in the village", "behind the library", "by the river",
              "at the airport", "in the mountains", "on the north coast", "outside the museum", "in the city centre",
              "at the hospital", "on the farm", "in a quiet street", "at the harbour", "in the school hall"],
    "when": ["yesterday morning", "last Tuesday", "early on Sunday", "after lunch", "before the storm",
             "in the evening", "three weeks ago", "at half past seven", "during the holidays", "on Friday night",
             "in nineteen ninety eight", "at the end of May", "this afternoon", "every winter"],
    "adj": ["cold", "bright", "quiet", "busy", "expensive", "beautiful", "crowded", "strange", "warm", "windy",
            "difficult", "peaceful", "noisy", "dark", "wonderful", "tiny"],
    "place": ["the hotel", "the park", "the office", "the beach", "the kitchen", "the train", "the theatre",
              "the bakery", "the valley", "the classroom", "the bridge", "the forest"],
}
_FORMS = [
    "{who} {verb} {thing} {where} {when}.",
    "{when}, {who} {verb} {thing}.",
    "Did {who} really say that {place} was {adj} {when}?",
    "It was a {adj} day, and {who} {verb} {thing} {where}.",
    "I think {who} {verb} {thing}, but nobody saw it happen.",
    "If the weather stays {adj}, {who} will meet us {where} {when}.",
    "{place} felt {adj} {when}, so we left early.",
    "Please ask {who} whether {thing} is still {where}.",
    "According to {who}, {place} is the most {adj} place in the region.",
    "We waited {where} for almost an hour, and then {who} arrived with {thing}.",
    "Nobody expected {place} to be so {adj} {when}.",
    "The report says that {who} {verb} {thing} {when}.",
]


def template_sentences(n: int, rng: random.Random) -> list:
    out = []
    for _ in range(n):
        s = rng.choice(_FORMS).format(**{k: rng.choice(v) for k, v in _T.items()})
        out.append(s[0].upper() + s[1:])
    return out


def word_sentences(n: int, rng: random.Random, tokenizer) -> list:
    """n lists of 4-12 common words (whole-word lower-case tokens of Whisper's vocabulary among its first 12,000
    ids): text no language model predicts, so the draft must read the audio through its cross-attention."""
    words = sorted(w[1:] for w, i in tokenizer.get_vocab().items()
                   if w.startswith("\u0120") and w[1:].isalpha() and w[1:].islower() and len(w) >= 4 and i < 12000)
    out = []
    for _ in range(n):
        s = " ".join(rng.choice(words) for _ in range(rng.randint(4, 12)))
        out.append(s[0].upper() + s[1:] + ".")
    return out


def lm_sentences(max_seconds: float, rng: random.Random, threads: int) -> list:
    """Sentences sampled from SmolLM2 (the model zoo), continuing its prose prompts, for at most ``max_seconds``."""
    path = MODELS / "smollm2-135m"
    prompts_file = ROOT.parent / "shared" / "models" / "prompts.jsonl"
    if not path.is_dir() or not prompts_file.is_file() or max_seconds <= 0:
        return []
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [json.loads(line)["prompt"] for line in prompts_file.read_text().splitlines()]
    prompts = [p for p in prompts if "def " not in p and "{" not in p and "(" not in p] or prompts
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    out, t0, g = [], time.perf_counter(), torch.Generator().manual_seed(rng.randint(0, 2**31))
    while time.perf_counter() - t0 < max_seconds:
        batch = [rng.choice(prompts) for _ in range(32)]
        enc = tok(batch, return_tensors="pt", padding=True)
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
        with torch.no_grad():
            ids = lm.generate(**enc, do_sample=True, temperature=0.9, top_p=0.95, max_new_tokens=64,
                              pad_token_id=tok.pad_token_id)
        for text in tok.batch_decode(ids[:, enc.input_ids.shape[1]:], skip_special_tokens=True):
            for s in text.replace("\n", " ").split(". "):
                s = s.strip().rstrip(".") + "."
                words = s.split()
                if 5 <= len(words) <= 28 and all(c.isascii() and (c.isalnum() or c in " ,.'?!-") for c in s):
                    out.append(s[0].upper() + s[1:])
    del lm
    return out


# --- 2.-4. speech, encoder outputs, pseudo-labels ------------------------------------------------------------------
def make_clips(sources: list, n: int, rng: random.Random, workers: int = 2) -> list:
    """[(samples, voice, wpm, pitch, text)] for n training clips of 1-6 sentences each (at most 28 s), each sentence
    from one of ``sources`` (lists of sentences; an empty one is skipped) with equal odds, in duration order."""
    sources = [src for src in sources if src]
    specs = []
    for _ in range(n):
        k = rng.randint(1, 6)
        specs.append((" ".join(rng.choice(rng.choice(sources)) for _ in range(k)),) + _speech.train_voice(rng))

    def one(spec):
        text, voice, wpm, pitch = spec
        try:
            a = _speech.synth(text, voice, wpm, pitch)
        except Exception as e:  # a text espeak-ng or sox cannot read: one clip fewer
            print(f"  skipped a clip ({voice}): {e}", flush=True)
            return None
        while len(a) > 28 * 16000:  # Whisper reads 30 s: drop the last sentence until it fits
            text = text.rsplit(". ", 1)[0] + "." if ". " in text else text[: len(text) // 2]
            a = _speech.synth(text, voice, wpm, pitch)
        return a, voice, wpm, pitch, text

    with ThreadPoolExecutor(workers) as ex:
        clips = [c for c in ex.map(one, specs) if c is not None]
    return sorted(clips, key=lambda c: len(c[0]))  # batches of similar length decode with little padding


@torch.no_grad()
def encode(model, proc, audios: list, batch: int = 4) -> torch.Tensor:
    """whisper-base's encoder outputs [n, 1500, d], fp16 (computed in fp32)."""
    outs = []
    for i in range(0, len(audios), batch):
        feats = proc(audios[i:i + batch], sampling_rate=16000, return_tensors="pt").input_features
        outs.append(model.get_encoder()(feats).last_hidden_state.half())
    return torch.cat(outs)


@torch.no_grad()
def pseudo_label(model, enc: torch.Tensor, batch: int = 16) -> list:
    """whisper-base's greedy transcripts (decoder ids: the 4 prompt tokens, the text, eos) of each encoder output."""
    from transformers.modeling_outputs import BaseModelOutput

    gc = model.generation_config
    eos = gc.eos_token_id
    # generate returns the text tokens (the forced prompt left out): rebuild start, <|en|>, <|transcribe|>,
    # <|notimestamps|>, text, eos, the sequence the draft sees in assisted decoding
    prompt = [gc.decoder_start_token_id, gc.lang_to_id["<|en|>"], gc.task_to_id["transcribe"], gc.no_timestamps_token_id]
    seqs = []
    for i in range(0, enc.shape[0], batch):
        e = enc[i:i + batch].float()
        ids = model.generate(encoder_outputs=BaseModelOutput(last_hidden_state=e), language="en", task="transcribe",
                             num_beams=1, do_sample=False, max_new_tokens=200)
        for row in ids.tolist():
            k = 0
            while k < len(row) and row[k] >= eos:  # leading specials, if any
                k += 1
            text = row[k:]
            text = text[:text.index(eos)] if eos in text else text
            seqs.append(torch.tensor(prompt + text + [eos]))
    return seqs


def pad(seqs: list, value: int) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=value)


@torch.no_grad()
def teacher_topk(model, enc: torch.Tensor, seqs: list, batch: int = 16) -> list:
    """Per sequence: (top-16 log-probs [T-1, 16] fp16, their ids [T-1, 16] int32) of whisper-base teacher-forced."""
    out = []
    head = model.get_output_embeddings()
    for i in range(0, len(seqs), batch):
        s = seqs[i:i + batch]
        ids = pad(s, 0)
        h = model.model.decoder(input_ids=ids[:, :-1], encoder_hidden_states=enc[i:i + len(s)].float()).last_hidden_state
        lp = F.log_softmax(head(h), -1)
        v, ix = lp.topk(TOPK, -1)
        for j, row in enumerate(s):
            n = len(row) - 1
            out.append((v[j, :n].half(), ix[j, :n].int()))
    return out


# --- 5. the draft ----------------------------------------------------------------------------------------------------
def init_draft(model, layers=(0, -1), dropout: float = 0.1):
    """A ``WhisperForCausalLM`` with whisper-base's decoder layers ``layers`` (its embeddings, norm and tied head:
    ``hf_csv.transformers.drafts.truncated_assistant`` builds the class, config and weights), dropout ``dropout`` in the decoder
    (active in training only; the config keeps the target's), embeddings, head and cross-attention keys/values frozen."""
    from hf_csv.transformers.drafts import truncated_assistant

    draft = truncated_assistant(model, len(layers))
    src, dst = model.model.decoder, draft.model.decoder
    for k, i in enumerate(layers):
        dst.layers[k].load_state_dict(src.layers[i].state_dict())
    for mod in (dst, *dst.layers):  # (WhisperDecoder and its layers read config.dropout once, at construction)
        mod.dropout = dropout
    for name, p in draft.named_parameters():
        p.requires_grad = not ("embed" in name or "proj_out" in name or "encoder_attn.k_proj" in name
                               or "encoder_attn.v_proj" in name)
    return draft


def draft_logits(draft, ids: torch.Tensor, enc: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The draft's logits at the positions ``mask`` selects ([n, V]): the head runs on those rows only."""
    h = draft.model.decoder(input_ids=ids, encoder_hidden_states=enc).last_hidden_state
    return draft.proj_out(h[mask])


def batch_of(idx: list, enc, seqs, tk, prompt: int = 4):
    s = [seqs[i] for i in idx]
    ids = pad(s, 0)
    T = ids.shape[1] - 1
    lens = torch.tensor([len(x) - 1 for x in s])
    pos = torch.arange(T)[None]
    mask = (pos < lens[:, None]) & (pos >= prompt - 1)  # positions that predict the text and eos
    labels = ids[:, 1:][mask]
    tv = torch.cat([tk[i][0][prompt - 1:] for i in idx]).float()
    ti = torch.cat([tk[i][1][prompt - 1:] for i in idx]).long()
    return ids[:, :-1], enc[idx].float(), mask, labels, tv, ti


@torch.no_grad()
def agreement(draft, enc, seqs, tk) -> float:
    """Fraction of text positions where the draft's argmax is whisper-base's greedy next token (teacher-forced)."""
    hit = tot = 0
    for i in range(len(seqs)):
        ids, e, mask, labels, _, _ = batch_of([i], enc, seqs, tk)
        hit += int((draft_logits(draft, ids, e, mask).argmax(-1) == labels).sum())
        tot += labels.numel()
    return hit / max(1, tot)


def train_loop(draft, enc, seqs, tk, seconds: float, batch: int, lr: float, eval_every: int, rng: random.Random,
               evaluate, max_steps: int = 10**9) -> tuple:
    """Distil for ``seconds`` (or ``max_steps``): AdamW, 50 warm-up steps, cosine (by elapsed time) to a tenth,
    gradient norm clipped at 1. Returns (steps, curve): ``evaluate(draft)`` at step 0, every ``eval_every`` steps
    and at the end, with the mean hard-label cross-entropy since the last point."""
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    curve = [{"step": 0, "seconds": 0.0, "agreement": evaluate(draft.eval())}]
    print(f"  step 0: held-out agreement {curve[0]['agreement']:.3f}", flush=True)
    t0 = time.perf_counter()
    step, order, losses = 0, [], []
    draft.train()

    def point():
        draft.eval()
        recent = losses[-eval_every:] or [float("nan")]
        curve.append({"step": step, "seconds": round(time.perf_counter() - t0, 1),
                      "train_ce": sum(recent) / len(recent), "agreement": evaluate(draft)})
        draft.train()
        print(f"  step {step} ({curve[-1]['seconds']:.0f} s): train CE {curve[-1]['train_ce']:.3f}, "
              f"held-out agreement {curve[-1]['agreement']:.3f}", flush=True)

    while time.perf_counter() - t0 < seconds and step < max_steps:
        if len(order) < batch:
            order += rng.sample(range(len(seqs)), len(seqs))
        idx, order = order[:batch], order[batch:]
        ids, e, mask, labels, tv, ti = batch_of(idx, enc, seqs, tk)
        frac = min(1.0, (time.perf_counter() - t0) / seconds, step / max_steps)
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        lp = F.log_softmax(draft_logits(draft, ids, e, mask), -1)
        ce = F.nll_loss(lp, labels)
        soft = -(F.softmax(tv, -1) * lp.gather(1, ti)).sum(-1).mean()  # cross-entropy against the teacher's top-k
        opt.zero_grad(set_to_none=True)
        (ce + soft).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        losses.append(ce.item())
        if step % eval_every == 0:
            point()
    if curve[-1]["step"] != step:
        point()
    draft.eval()
    return step, curve



def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=MODELS / "whisper-base")
    ap.add_argument("--out", type=Path, default=MODELS / "whisper-base-draft")
    # more clips and fewer steps: the held-out agreement stops rising after ~150 steps, and 720 clips lift that
    # plateau above 360 clips' (docs/benchmarks.md §10.1)
    ap.add_argument("--clips", type=int, default=720, help="training clips to synthesize")
    ap.add_argument("--lm-seconds", type=float, default=150.0, help="time for sampling sentences from SmolLM2")
    ap.add_argument("--train-minutes", type=float, default=8.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--eval-every", type=int, default=150)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def _stage(stages: dict, name: str, t0: float) -> None:
    """Records and prints a stage's wall time since ``t0``."""
    stages[name] = round(time.perf_counter() - t0, 1)
    print(f"[{name}] {stages[name]} s", flush=True)


def _sentences(a: argparse.Namespace, rng: random.Random, stages: dict):
    """Stage "text": the processor and the distinct training sentences (grammar, SmolLM2 samples, word lists), none
    of them an evaluation clip's."""
    from transformers import AutoProcessor

    t0 = time.perf_counter()
    excluded = _speech.excluded_texts()
    proc = AutoProcessor.from_pretrained(a.model)
    keep = lambda xs: [x for x in dict.fromkeys(xs) if _speech.norm(x) not in excluded]  # noqa: E731
    lm = keep(lm_sentences(a.lm_seconds, rng, a.threads))
    grammar = keep(template_sentences(3000, rng))
    words = keep(word_sentences(3000, rng, proc.tokenizer))
    _stage(stages, "text", t0)
    print(f"  {len(grammar) + len(lm) + len(words)} distinct sentences: {len(grammar)} from the grammar, {len(lm)} "
          f"sampled from SmolLM2, {len(words)} word lists")
    return proc, grammar, lm, words


def _teacher(a: argparse.Namespace, proc, train: list, stages: dict) -> dict:
    """Stages "encoder", "pseudo_labels" and "teacher": the target's encoder outputs, greedy transcripts and top-16
    of the training and evaluation clips; the target itself (``model``) for the draft's initialisation."""
    from transformers import WhisperForConditionalGeneration

    t0 = time.perf_counter()
    model = WhisperForConditionalGeneration.from_pretrained(a.model, dtype=torch.float32).eval()
    evals = _speech.zoo_clips() + _speech.heldout_clips()
    enc = encode(model, proc, [c[0] for c in train])
    enc_ev = encode(model, proc, [c[1] for c in evals])
    _stage(stages, "encoder", t0)

    t0 = time.perf_counter()
    seqs = pseudo_label(model, enc)
    seqs_ev = pseudo_label(model, enc_ev)
    _stage(stages, "pseudo_labels", t0)
    t0 = time.perf_counter()
    tk = teacher_topk(model, enc, seqs)
    tk_ev = teacher_topk(model, enc_ev, seqs_ev)
    _stage(stages, "teacher", t0)
    return {"model": model, "evals": evals, "enc": enc, "enc_ev": enc_ev, "seqs": seqs, "seqs_ev": seqs_ev,
            "tk": tk, "tk_ev": tk_ev}


def _save_draft(a: argparse.Namespace, draft, proc) -> None:
    """The draft and its processor under ``--out``."""
    for p in draft.parameters():
        p.requires_grad = True
    a.out.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(a.out)
    proc.save_pretrained(a.out)


def _write_report(a: argparse.Namespace, report: dict) -> None:
    """The training's record beside the draft: the curve (JSON, PNG) and a model card."""
    (a.out / "curve.json").write_text(json.dumps(report, indent=1))
    plot(report["curve"], a.out / "curve.png")
    (a.out / "README.md").write_text(card(report))


def main(argv=None) -> int:
    a = _args(argv)
    if _speech.tools_missing():
        raise SystemExit(f"missing {', '.join(_speech.tools_missing())}: apt-get install -y espeak-ng sox")
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    t_all = time.perf_counter()
    stages = {}
    proc, grammar, lm, words = _sentences(a, rng, stages)

    t0 = time.perf_counter()
    train = make_clips([grammar, lm, words], a.clips, rng)
    _stage(stages, "speech", t0)
    secs = sum(len(c[0]) for c in train) / 16000
    print(f"  {len(train)} clips, {secs / 60:.1f} min of speech")

    d = _teacher(a, proc, train, stages)
    n_tok = sum(len(s) - 4 for s in d["seqs"])
    print(f"  {n_tok} transcript tokens (eos included) in {len(d['seqs'])} clips")
    draft = init_draft(d.pop("model"))
    t0 = time.perf_counter()
    step, curve = train_loop(draft, d["enc"], d["seqs"], d["tk"], a.train_minutes * 60, a.batch, a.lr, a.eval_every,
                             rng, lambda m: agreement(m, d["enc_ev"], d["seqs_ev"], d["tk_ev"]))
    _stage(stages, "train", t0)

    _save_draft(a, draft, proc)
    report = {"command": " ".join(["python", *sys.argv]), "target": str(a.model), "clips": len(train),
              "speech_minutes": round(secs / 60, 2), "sentences": len(grammar) + len(lm) + len(words),
              "lm_sentences": len(lm), "transcript_tokens": n_tok, "steps": step, "batch": a.batch, "lr": a.lr,
              "threads": a.threads, "stages_s": stages, "total_s": round(time.perf_counter() - t_all, 1),
              "eval_clips": [c[0] for c in d["evals"]], "agreement_start": curve[0]["agreement"],
              "agreement_final": curve[-1]["agreement"], "curve": curve}
    _write_report(a, report)
    print(json.dumps({k: v for k, v in report.items() if k != "curve"}, indent=1))
    return 0


def plot(curve: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    s = [c["step"] for c in curve]
    ax.plot(s, [c["agreement"] for c in curve], "o-", color="C0", label="held-out agreement (per-token acceptance)")
    ax.set_xlabel("training step")
    ax.set_ylabel("agreement with whisper-base", color="C0")
    ax.set_ylim(0, 1)
    ax2 = ax.twinx()
    ax2.plot(s[1:], [c["train_ce"] for c in curve[1:]], "s--", color="C1", label="train CE (hard labels)")
    ax2.set_ylabel("train cross-entropy", color="C1")
    ax.set_title("2-layer Whisper draft, distilled from whisper-base")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def card(r: dict) -> str:
    return f"""---
library_name: transformers
base_model: openai/whisper-base
tags: [whisper, speculative-decoding, assistant-model, distillation, hf_csv]
license: mit
---

# whisper-base-draft: a 2-layer assistant for whisper-base

A `WhisperForCausalLM` decoder (2 layers, whisper-base's layers 0 and 5 as initialisation, its embeddings, final norm
and tied head) that reads whisper-base's encoder outputs, distilled from whisper-base on this machine's CPU by
`scripts/train_whisper_draft.py` (hf_csv, issue 40). Use it with transformers' assisted generation:

```python
draft = WhisperForCausalLM.from_pretrained("{r['target'].replace('whisper-base', 'whisper-base-draft')}")
ids = model.generate(input_features, assistant_model=draft, language="en", task="transcribe", num_beams=1)
```

Assisted greedy decoding returns whisper-base's own greedy transcript whatever the draft proposes; the draft only
sets how many tokens each target step accepts.

## Data
* {r['clips']} synthetic English clips ({r['speech_minutes']} min), espeak-ng voices, speeds 120-175 wpm and pitches
  25-75 of `scripts/_speech.py` (`TRAIN_*`); {r['sentences']} distinct sentences ({r['lm_sentences']} sampled from
  SmolLM2-135M, the rest from a template grammar).
* Labels: whisper-base's greedy transcripts (`language="en"`) and its top-{TOPK} teacher-forced distributions.
* Held out (never trained on): the 7 English clips of `../shared/models/speech` and 6 clips with voices
  (`en-gb-scotland`, `en-029`, variants `+f4` / `+m6`) and speeds (110-115, 180-185 wpm) outside the training set.

## Training
{r['steps']} AdamW steps, batch {r['batch']} clips, lr {r['lr']} (warm-up, cosine to a tenth), {r['threads']} CPU
threads; stages (s): {r['stages_s']}; total {r['total_s']} s. Loss: cross-entropy on the greedy tokens plus the
cross-entropy against the teacher's renormalised top-{TOPK}. Frozen: embeddings, head, cross-attention keys and values.

## Figures
Held-out agreement with whisper-base (teacher-forced: the fraction of positions where the draft's argmax is the
target's greedy token, the per-token acceptance of assisted greedy decoding): {r['agreement_start']:.3f} at
initialisation, **{r['agreement_final']:.3f}** after training (`curve.json`, `curve.png`). End-to-end speed:
hf_csv's `docs/benchmarks.md` §10.
"""


if __name__ == "__main__":
    raise SystemExit(main())
