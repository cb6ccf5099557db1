"""The Whisper draft recipe (scripts/train_whisper_draft.py, issue 40) on a tiny random Whisper: the draft's
initialisation, distillation that raises its agreement with the target, the checkpoint's round trip as a standard
``WhisperForCausalLM``, and assisted greedy decoding with it (stock and hf_csv) equal to plain greedy decoding."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

import hf_csv
from hf_csv import CSVConfig
from conftest import _tiny_whisper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import _speech  # noqa: E402
import train_whisper_draft as T  # noqa: E402


def test_heldout_clips_use_voices_or_speeds_no_training_clip_uses():
    """Each evaluation clip of scripts/_speech.py has a held-out voice, variant or speed, and the training draw
    (``train_voice``) can produce none of them."""
    lo, hi = _speech.TRAIN_SPEEDS
    assert not set(_speech.HELDOUT_VOICES) & set(_speech.TRAIN_VOICES)
    assert not set(_speech.HELDOUT_VARIANTS) & set(_speech.TRAIN_VARIANTS)
    for name, voice, wpm, _ in _speech.HELDOUT:
        base, _, variant = voice.partition("+")
        assert base in _speech.HELDOUT_VOICES or "+" + variant in _speech.HELDOUT_VARIANTS or not lo <= wpm <= hi, name
    rng = random.Random(0)
    for _ in range(2000):
        voice, wpm, _ = _speech.train_voice(rng)
        base, _, variant = voice.partition("+")
        assert base in _speech.TRAIN_VOICES and (not variant or "+" + variant in _speech.TRAIN_VARIANTS)
        assert lo <= wpm <= hi


@pytest.mark.slow
def test_draft_init_distil_save_and_assist(tmp_path):
    from transformers import WhisperForCausalLM

    m = _tiny_whisper(seed=3)
    m.model.decoder.layers.append(type(m.model.decoder.layers[0])(m.config, layer_idx=2))  # 3 layers: "last" != 1
    m.config.decoder_layers = 3
    draft = T.init_draft(m)
    assert draft.config.decoder_layers == 2 and not draft.config.is_encoder_decoder
    for k, i in ((0, 0), (1, 2)):  # the first and the last layer of the target
        src = m.model.decoder.layers[i].state_dict()
        assert all(torch.equal(v, src[n]) for n, v in draft.model.decoder.layers[k].state_dict().items())
    assert draft.proj_out.weight is draft.model.decoder.embed_tokens.weight  # tied, as in the target
    frozen = {n for n, p in draft.named_parameters() if not p.requires_grad}
    assert any("encoder_attn.k_proj" in n for n in frozen) and "model.decoder.embed_tokens.weight" in frozen
    assert not any("self_attn" in n or "fc1" in n for n in frozen)

    torch.manual_seed(0)  # (dropout)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(6, 80, 3000, generator=g)
    with torch.no_grad():
        enc = m.get_encoder()(feats).last_hidden_state
    # labels that vary from clip to clip (a tiny random target's greedy output repeats one token): a 4-token
    # prompt, then 10 random tokens; the teacher's top-k is the target's, teacher-forced on them
    seqs = [torch.cat([torch.tensor([1, 5, 6, 7]), torch.randint(3, 300, (10,), generator=g)]) for _ in range(6)]
    tk = T.teacher_topk(m, enc, seqs)
    before = T.agreement(draft, enc, seqs, tk)
    steps, curve = T.train_loop(draft, enc, seqs, tk, seconds=120, batch=3, lr=3e-3, eval_every=80,
                                rng=random.Random(0), evaluate=lambda d: T.agreement(d, enc, seqs, tk), max_steps=240)
    assert steps == 240 and curve[0]["agreement"] == before
    assert before < 0.2 and curve[-1]["agreement"] > 0.5, curve
    assert curve[-1]["train_ce"] < curve[1]["train_ce"], curve

    draft.save_pretrained(tmp_path)
    loaded = WhisperForCausalLM.from_pretrained(tmp_path).eval()
    assert T.agreement(loaded, enc, seqs, tk) == curve[-1]["agreement"]

    hf_csv.enable(m)
    for f in feats[:3]:
        f = f[None]
        plain = m.generate(f, max_new_tokens=12, do_sample=False)
        stock = m.generate(f, max_new_tokens=12, do_sample=False, assistant_model=loaded)
        csv = m.generate(f, max_new_tokens=12, do_sample=False, assistant_model=loaded, csv_config=CSVConfig())
        assert torch.equal(stock, plain) and torch.equal(csv, plain)


def test_step_costs_split_each_step_into_body_and_heads():
    """scripts/whisper_assisted_report.py's step split (issue 40): for target and draft, a step with the full head,
    the full head alone and hf_csv's certified top-1 call alone, on the rows the steps fed the head; c with full heads
    and with certified ones."""
    import whisper_assisted_report as R

    m = _tiny_whisper(seed=4)
    draft = T.init_draft(m).eval()
    feat = torch.randn(1, 80, 3000, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        costs = R._step_costs(m, draft, feat, runs=1)
    for side in ("target", "assistant"):
        c = costs[side]
        assert c["step_ms"] > 0 and c["head_full_ms"] > 0 and c["head_certified_ms"] > 0
        assert abs(c["body_ms"] - (c["step_ms"] - c["head_full_ms"])) < 1e-9
    assert costs["c_full"] == costs["assistant"]["step_ms"] / costs["target"]["step_ms"]
    cert = [costs[x]["body_ms"] + costs[x]["head_certified_ms"] for x in ("assistant", "target")]
    assert abs(costs["c_certified"] - cert[0] / cert[1]) < 1e-12
