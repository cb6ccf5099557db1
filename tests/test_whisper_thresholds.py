"""Whisper's temperature fallback (docs/certificates.md §3.6): with ``logprob_threshold`` / ``no_speech_threshold``
the certified call takes stock's fallback and skip decisions, from certified avg-logprob intervals or by replaying
steps on the stock head; tokens are stock's."""
import math
import sys
from pathlib import Path

import pytest
import torch
from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

import hf_csv
from hf_csv import CSVConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_whisper_timestamps import _feats, long_clip, tiny_en, tiny_ts_whisper  # noqa: E402,F401

# these paths hand the values on S to stock (docs/certificates.md §2.0): their machinery under that property
pytestmark = pytest.mark.usefixtures("assume_subset_exact")

FALLBACK = dict(temperature=(0.0, 0.4, 0.8), compression_ratio_threshold=2.4, no_speech_threshold=0.6)


@pytest.fixture
def spy(monkeypatch):
    """Records every stock avg-logprob value and every (needs_fallback, should_skip) decision."""
    rec = {"avg": [], "decisions": []}
    avg, need = WhisperGenerationMixin._retrieve_avg_logprobs, WhisperGenerationMixin._need_fallback

    def _avg(scores, tokens, temperature):
        v = avg(scores, tokens, temperature)
        rec["avg"].append(float(v))
        return v

    def _need(self, *a, **k):
        out = need(self, *a, **k)
        rec["decisions"].append(tuple(bool(x) for x in out))
        return out

    monkeypatch.setattr(WhisperGenerationMixin, "_retrieve_avg_logprobs", staticmethod(_avg))
    monkeypatch.setattr(WhisperGenerationMixin, "_need_fallback", _need)
    return rec


def _run(m, spy, csv, **kw):
    spy["avg"].clear()
    spy["decisions"].clear()
    torch.manual_seed(0)
    out = m.generate(**kw, csv_config=CSVConfig()) if csv else m.generate(**kw)
    return out, list(spy["avg"]), list(spy["decisions"])


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decisions_at_the_threshold_are_stocks(spy, seed):
    """Thresholds at stock's own avg-logprob and one float above it: every decision is stock's (the bounds cannot
    decide these, so the steps are replayed), and so are the tokens. Dropping the mass outside S from the interval
    (or any replay) would flip the second one."""
    m = tiny_ts_whisper(seed, 0.6)
    kw = dict(input_features=_feats(2, seed), max_new_tokens=24, return_timestamps=True, **FALLBACK)
    _, avgs, _ = _run(m, spy, False, logprob_threshold=-1.0, **kw)
    assert avgs
    v = avgs[0]
    for thr in (v, math.nextafter(v, math.inf)):
        x, _, dx = _run(m, spy, False, logprob_threshold=thr, **kw)
        y, _, dy = _run(m, spy, True, logprob_threshold=thr, **kw)
        assert torch.equal(x, y) and dx == dy, (thr, dx, dy)
        st = m.csv_last_stats["whisper_thresholds"]
        assert st["decisions"] > 0 and st["fully_replayed"] + st["replayed_steps"] > 0, st


@pytest.mark.slow
@pytest.mark.parametrize("thr", [-0.5, -2.0, -4.0])
def test_decisions_and_tokens_identical_across_thresholds(spy, thr):
    seen = 0
    for seed in range(3):
        m = tiny_ts_whisper(seed, 0.6)
        kw = dict(input_features=_feats(3, seed), max_new_tokens=24, return_timestamps=True, logprob_threshold=thr,
                  **FALLBACK)
        x, _, dx = _run(m, spy, False, **kw)
        y, _, dy = _run(m, spy, True, **kw)
        assert torch.equal(x, y) and dx == dy, (seed, dx, dy)
        seen += m.csv_last_stats.get("whisper_thresholds", {}).get("decisions", 0)
    assert seen > 0


@pytest.mark.slow
def test_declined_after_the_list_was_built_uses_stocks_own_decision(spy):
    """A stopping criterion that may read the scores declines the call after the processors were chosen: the kept rows
    are then stock's and so is the avg-logprob (found by the differential fuzzer)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Reader(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    m = tiny_ts_whisper(0, 0.6)
    kw = dict(input_features=_feats(2, 0), max_new_tokens=12, return_timestamps=True, logprob_threshold=-1.0,
              stopping_criteria=StoppingCriteriaList([Reader()]), **FALLBACK)
    x, ax, dx = _run(m, spy, False, **kw)
    y, ay, dy = _run(m, spy, True, **kw)
    assert torch.equal(x, y) and dx == dy and ax == ay and ax
    st = m.csv_last_stats
    assert st["mode"] == "full" and "whisper_thresholds" not in st, st  # no round was certified


def test_returned_scores_keep_the_full_head():
    m = tiny_ts_whisper(0, 0.6)
    kw = dict(input_features=_feats(1, 0), max_new_tokens=8, logprob_threshold=-1.0, return_dict_in_generate=True,
              **FALLBACK)
    torch.manual_seed(0)
    m.generate(**kw, csv_config=CSVConfig())
    st = m.csv_last_stats
    assert st["mode"] == "full" and any("logprob_threshold" in r for r in st["reasons"]), st["reasons"]


@pytest.mark.slow
def test_real_long_form_with_temperature_fallback_identical(tiny_en, spy):
    """whisper-tiny.en, > 60 s, sequential long-form with the usual fallback settings: stock's tokens and decisions;
    greedy rounds certified."""
    proc, m = tiny_en
    audio, sr = long_clip(60.0)
    f = proc(audio, sampling_rate=sr, return_tensors="pt", truncation=False, padding="longest",
             return_attention_mask=True)
    kw = dict(input_features=f.input_features, attention_mask=f.attention_mask, return_timestamps=True,
              temperature=(0.0, 0.2, 0.4, 0.6, 0.8, 1.0), logprob_threshold=-1.0, no_speech_threshold=0.6,
              compression_ratio_threshold=1.35, condition_on_prev_tokens=False)
    x, _, dx = _run(m, spy, False, **kw)
    y, _, dy = _run(m, spy, True, **kw)
    assert torch.equal(x, y) and dx == dy and len(dx) >= 3
    st = m.csv_last_stats["whisper_thresholds"]
    assert st["decisions"] > 0, st
