"""hf_csv.transformers.session: a call's session records each reason once, a call sent to the full head says so, and
its summary counts every head row (no None, no NaN) in one line for people."""
from __future__ import annotations

import math

import torch

from hf_csv import CSVConfig
from hf_csv.core.certificate import CertStats
from hf_csv.transformers.plans import FULL, Epsilon
from hf_csv.transformers.session import CSVSession, row_totals, summary_line

from conftest import tiny_llama


def _session(**kw) -> CSVSession:
    return CSVSession(model=tiny_llama(), config=CSVConfig(), head=None, out_dtype=torch.float32, **kw)


def test_the_summary_line():
    """The line before any row, for a call on the full head, with the rows the speed guard and the certificate sent
    to the full head, and led by what an approximate call opted into."""
    assert summary_line(CertStats(), 0) == "certified 0/0 rows"
    assert summary_line(CertStats(), 0, full_reason="why") == "full head (why)"
    st = CertStats(rows=8, certified=6, fallback=2, subvocab_sum=6 * 4, vocab_size=256)
    line = summary_line(st, 2)
    assert line.startswith("certified 6/10 rows (full head: 4, speed guard 2, certificate 2), mean |S| "), line
    assert summary_line(st, 0, approx=["x"]).startswith("approximate (x): certified 6/8 rows"), summary_line(st, 0)
    assert row_totals(CertStats(), 0) == {"declined_rows": 0, "head_rows": 0, "certified_fraction": 0.0}


def test_reasons_once_and_the_full_head():
    sess = _session()
    sess.note("a reason")
    sess.note("a reason")
    sess.whisper.record = True
    sess.set_full("why")
    assert sess.reasons == ["a reason", "why"] and sess.plan is FULL and not sess.whisper.record
    d = sess.summary()
    assert d["mode"] == "full" and d["summary"] == "full head (a reason)" and d["exact"]
    assert not [k for k, v in d.items() if v is None or (isinstance(v, float) and math.isnan(v))], d


def test_an_approximate_call_says_so():
    sess = _session(plan=Epsilon(eps=1e-3))
    assert sess.approximations() == ["ε-softmax, TV ≤ 0.001 a row"]
    d = sess.summary()
    assert not d["exact"] and d["summary"].startswith("approximate (ε-softmax"), d["summary"]
