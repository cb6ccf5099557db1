"""hf_csv.transformers.step: one decode step's head call; a speculative round without drafts takes the full head."""
import pytest
import torch

from hf_csv import CSVConfig
@pytest.mark.usefixtures("assume_subset_exact")
def test_spec_round_without_drafts_uses_the_full_head(spec_pair):
    """With one new token left the candidate generator returns no draft logits and stock samples from the
    target's row itself: that row must be complete (full head), not the -inf-padded "spec" row."""
    target, draft = spec_pair
    ids = torch.tensor([[5, 17, 33, 2, 9]])
    out = target.generate(ids, assistant_model=draft, do_sample=True, top_k=0, max_new_tokens=1,
                          csv_config=CSVConfig(budget=0.3), return_dict_in_generate=True)
    st = out.csv_stats
    assert st["mode"] == "spec" and st["head_calls"] == 1 and st["full_head_calls"] == 1
    # and with drafts in between: every round without drafts is complete, the others certified
    out = target.generate(ids, assistant_model=draft, do_sample=True, top_k=0, max_new_tokens=2,
                          num_assistant_tokens=1, num_assistant_tokens_schedule="constant",
                          csv_config=CSVConfig(budget=0.3), return_dict_in_generate=True)
    st = out.csv_stats
    assert st["head_calls"] - st["full_head_calls"] == st["speculative"]["verify_calls"]


def test_a_call_the_guard_keeps_on_the_full_head_builds_no_screen(monkeypatch):
    """The guard is asked before the screen: a first call of 32+ rows (its prior: the full head) leaves the head's
    screen unbuilt (no packing beside stock's head on a shared CPU), with stock's tokens; a one-row call builds it."""
    import hf_csv
    import hf_csv.core.speed as speed
    from hf_csv.transformers.heads import find_head, get_certified_head

    from conftest import _ids, tiny_llama

    monkeypatch.setattr(speed, "MIN_WEIGHTS", 0)  # (a guard for the tiny head)
    m = tiny_llama(scale=20.0)
    x = _ids(batch=speed.PRIOR_FULL_ROWS)
    ref = m.generate(**x, max_new_tokens=4, do_sample=False)
    hf_csv.enable(m)
    try:
        out = m.generate(**x, max_new_tokens=4, do_sample=False, csv_config=CSVConfig())
        st = m.csv_last_stats
        assert torch.equal(out, ref)
        assert st["full_head_calls"] == st["head_calls"] == 4 and any("measured faster" in r for r in st["reasons"])
        ch = get_certified_head(find_head(m)[1], CSVConfig())
        assert ch.provider.state is None  # never calibrated nor packed
        one = {k: v[1:2] for k, v in x.items()}
        out = m.generate(**one, max_new_tokens=4, do_sample=False, csv_config=CSVConfig())
        assert torch.equal(out, m.generate(**one, max_new_tokens=4, do_sample=False))
        assert ch.provider.state is not None and m.csv_last_stats["certified"] > 0
    finally:
        hf_csv.disable(m)


def _probe_spy(monkeypatch, result=None):
    """Record every column-subset probe's row counts (``probe_subset_kernel``); returns the list. ``result``: a fixed
    verdict (``"none"``: no kernel) instead of this host's."""
    import hf_csv.core.certificate.probes as probes

    real, calls = probes.probe_subset_kernel, []

    def spy(weight, bias, rows=probes.PROBE_ROWS):
        calls.append(tuple(rows))
        return None if result == "none" else real(weight, bias, rows=rows)

    monkeypatch.setattr(probes, "probe_subset_kernel", spy)
    return calls


@pytest.mark.parametrize("verdict", ["host", "none"])
def test_a_guarded_sampled_shape_probes_at_its_first_certified_step_not_before(monkeypatch, verdict):
    """Top-k sampling hands the values on S to stock's sampler, so its certified steps need the column-subset probe
    (docs/certificates.md §2.0). In a guarded call the probe is not run where the plan is chosen: a new shape starts on
    stock's head (its first calls cost stock's time), and the probe runs once, on the call's own row count, where the
    guard first tries the certified head (a ``max_probe`` in). Stock's tokens for the seed on both sides of it; where
    the probe finds no kernel, those steps stay on stock's head with the reason."""
    import hf_csv
    import hf_csv.core.speed as speed
    from conftest import _ids, tiny_llama

    monkeypatch.setattr(speed, "MIN_WEIGHTS", 0)  # (a guard for the tiny head)
    calls = _probe_spy(monkeypatch, None if verdict == "host" else "none")
    m = tiny_llama(scale=20.0)
    x = {k: v[1:2] for k, v in _ids().items()}
    gen = dict(do_sample=True, top_k=20, temperature=0.8, pad_token_id=0)
    hf_csv.enable(m)
    try:
        for n in (8, 140):
            torch.manual_seed(5)
            ref = m.generate(**x, max_new_tokens=n, **gen)
            torch.manual_seed(5)
            out = m.generate(**x, max_new_tokens=n, **gen, csv_config=CSVConfig())
            st = m.csv_last_stats
            assert torch.equal(out, ref) and st["mode"] == "topk", st
            if n == 8:  # the shape's first call: stock's head throughout, no probe
                assert calls == [] and st["full_head_calls"] == st["head_calls"] == 8, st
                assert any("shape is new" in r for r in st["reasons"]), st
        assert calls == [(1,)]  # once, on the decode step's one row
        from hf_csv.core.certificate import subset_probe_key
        from hf_csv.transformers.heads import find_head, get_certified_head

        ch = get_certified_head(find_head(m)[1], CSVConfig())
        if ch._subset_probe[subset_probe_key() + (1,)] is None:  # forced, or this host's BLAS (a 4,099 x 64 head)
            assert st["certified"] == 0 and any("rounds a column subset of 1 rows" in r for r in st["reasons"]), st
        else:
            assert st["certified"] > 0, st
    finally:
        hf_csv.disable(m)


def test_a_new_shape_starts_on_the_full_head_where_fewer_rows_cannot_win():
    """A shape the guard has not seen starts on stock's head (trying the certified head a ``max_probe`` in) where
    fewer rows of the same plan keep stock's head by more than ``CANNOT_WIN``, or where its value-reading rows were
    never probed; otherwise on the guard's prior."""
    from types import SimpleNamespace

    from hf_csv.core.speed import CANNOT_WIN, SpeedGuard
    from hf_csv.transformers.step import _starts_full

    def guard_with(ratio):  # batch-1 key of the plan ("topk", 0, 20, True): certified / full = ratio
        g = SpeedGuard()
        k1 = ("topk", 0, 20, True, 1, torch.float32, 2)
        for _ in range(12):
            c = g.certified(k1)
            g.record(k1, c, (ratio if c else 1.0) * 1e-3)
        return g

    probed = SimpleNamespace(subset_rows_verdict=lambda rows: True)
    sess = SimpleNamespace(values_probe=False, head=probed)
    k8 = ("topk", 0, 20, True, 8, torch.float32, 2)
    assert _starts_full(sess, guard_with(2 * CANNOT_WIN), k8, 8)
    assert not _starts_full(sess, guard_with(1.2), k8, 8)  # loses, but not by enough to skip the try
    assert not _starts_full(sess, guard_with(0.5), k8, 8)
    other = ("topk", 0, 1, False, 8, torch.float32, 2)  # greedy: another plan's keys say nothing
    assert not _starts_full(sess, guard_with(2 * CANNOT_WIN), other, 8)
    unprobed = SimpleNamespace(values_probe=True, head=SimpleNamespace(subset_rows_verdict=lambda rows: None))
    assert _starts_full(unprobed, SpeedGuard(), k8, 8)
    assert not _starts_full(SimpleNamespace(values_probe=True, head=probed), SpeedGuard(), k8, 8)
