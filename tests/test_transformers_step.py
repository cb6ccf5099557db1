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
