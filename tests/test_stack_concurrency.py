"""Certified calls on one model from several threads at once: each call checks against its own session (a shared
processor instance included), every thread gets stock's tokens, and the model is left as it was."""
from __future__ import annotations

import threading

import pytest
import torch
from transformers import LogitsProcessorList

import hf_csv
from conftest import _ids, tiny_llama
from hf_csv import CSVConfig


@pytest.mark.slow
def test_concurrent_certified_calls_on_one_model():
    import sys

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show up
    try:
        _concurrent_calls()
    finally:
        sys.setswitchinterval(old)


def _concurrent_calls():
    m = hf_csv.enable(tiny_llama(scale=20.0))
    cases = [(_ids(batch=b, seed=s), kw) for s, b in enumerate([1, 3, 2, 1, 3, 2])
             for kw in ({}, {"repetition_penalty": 1.4})]
    want = [m.generate(**x, max_new_tokens=12, do_sample=False, **kw) for x, kw in cases]
    errors, got = [], {}

    def work(i):
        try:
            for _ in range(6):
                x, kw = cases[i]
                got[i] = m.generate(**x, max_new_tokens=12, do_sample=False, csv_config=CSVConfig(), **kw)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(torch.equal(got[i], want[i]) for i in range(len(cases)))
    assert "_get_logits_processor" not in m.__dict__ and isinstance(m.lm_head, torch.nn.Linear)


def test_shared_csv_processor_instance_binds_per_call():
    """One user CSVLogitsProcessor in two concurrent calls: each call checks against its own session."""
    m = hf_csv.enable(tiny_llama(scale=20.0))
    rec = hf_csv.CSVLogitsProcessor()
    xs = [_ids(batch=1, seed=1), _ids(batch=3, seed=2)]
    want = [m.generate(**x, max_new_tokens=10, do_sample=False, repetition_penalty=2.0) for x in xs]
    got, errors = {}, []

    def work(i):
        try:
            for _ in range(4):
                got[i] = m.generate(**xs[i], max_new_tokens=10, do_sample=False, repetition_penalty=2.0,
                                    logits_processor=LogitsProcessorList([rec]), csv_config=CSVConfig())
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not errors, errors
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
