"""hf_csv.transformers.whisper_beam_checks: the checks of stock's rules that read the values (Whisper's timestamp rule
and avg-logprob record, a beam step's log-prob intervals), on hand-made head stashes (end to end:
tests/test_transformers_whisper.py, tests/test_transformers_beam.py)."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import RepetitionPenaltyLogitsProcessor

from hf_csv.core import checks
from hf_csv.transformers.whisper_beam_checks import beam_logprob_box, record_lp, timestamp_unsure

N, V = 2, 12


def _stash(seed: int = 0):
    """A head call's stash at one position: S = the 6 largest logits of each row, −inf elsewhere, and upper bounds
    a little above the true logits outside S."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(N, 1, V, generator=g, dtype=torch.float64) * 3
    mask = torch.zeros(N, 1, V, dtype=torch.bool).scatter_(2, full.topk(6, dim=2).indices, True)
    logits = full.float().masked_fill(~mask, float("-inf"))
    return SimpleNamespace(logits=logits, mask=mask, upper=(full + 0.01).float(), H=torch.randn(N, 1, 4, generator=g))


def _sess(processors=()):
    return SimpleNamespace(out_dtype=torch.float32, processors=list(processors), reports={},
                           whisper=SimpleNamespace(steps=[]))


def test_beam_box_is_the_core_interval_without_processors_and_brackets_them_with_one():
    last, ids = _stash(), torch.tensor([[1, 2], [3, 4]])
    lo, hi, ob = beam_logprob_box(_sess(), ids, last, 0)
    want = checks.logprob_box(last.logits[:, 0], last.mask[:, 0],
                              checks.raise_by_dtype(last.upper[:, 0].double(), torch.float32))
    assert all(torch.equal(a, b) for a, b in zip((lo, hi, ob), want))
    pen, check = RepetitionPenaltyLogitsProcessor(1.5), SimpleNamespace(csv_check=True)
    after = RepetitionPenaltyLogitsProcessor(3.0)  # after the check: not run
    lo2, hi2, ob2 = beam_logprob_box(_sess([pen, check, after]), ids, last, 0, stop=check)
    assert torch.equal(lo2, pen(ids, lo.clone())) and torch.equal(hi2, pen(ids, hi.clone())) and torch.equal(ob2, ob)
    assert bool((lo2 <= hi2).all())


def test_a_step_the_head_left_to_stock_records_its_rows_as_stocks():
    sess, ids = _sess(), torch.tensor([[1]])
    record_lp(sess, ids, None, None, 0, None)
    assert sess.whisper.steps == [{"exact_all": True, "ids": ids}]


def test_the_avg_logprob_record_bounds_the_mass_outside_s():
    last, ids, sess = _stash(1), torch.tensor([[1], [2]]), _sess()
    out = last.logits[:, 0].clone()
    record_lp(sess, ids, out, last, 0, None)
    (st,) = sess.whisper.steps
    outside = ~last.mask[:, 0]
    mass = torch.logsumexp(last.upper[:, 0].double().masked_fill(~outside, float("-inf")), 1)
    assert not st["exact_all"] and bool((st["logR"] >= mass - 1e-6).all()) and not bool(st["exact"].any())


class _Timestamps:
    """Whisper's timestamp processor as the check reads it: no rule masks, the logsumexp rule on (tb = 8)."""

    timestamp_begin = 8

    def __call__(self, input_ids, scores):
        return scores


def test_the_timestamp_rule_is_decided_where_the_text_clears_the_timestamp_block():
    x = torch.full((N, V), -20.0)
    x[:, 3] = 10.0  # text far above every timestamp: text wins on both rows
    computed = torch.zeros(N, V, dtype=torch.bool)
    computed[:, 3] = computed[:, 8:] = True
    sess = _sess()
    bad, (M, ts_won) = timestamp_unsure(sess, _Timestamps(), torch.tensor([[1], [2]]), x,
                                        torch.tensor([0.0, 11.0]), computed)
    # row 0: the uncomputed tokens lie below 0 < 10; row 1: one might reach 11 > 10, the row is re-run
    assert bad.tolist() == [False, True] and not bool(M.any()) and not bool(ts_won.any())
    assert sess.reports["timestamps"] == {"rows": 2, "equal_after_rules": 0, "timestamp_decided": 0,
                                          "text_decided": 1, "rows_rerun": 1}
