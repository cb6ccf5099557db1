"""hf_csv.step: one decode step's head call; a speculative round without drafts takes the full head."""
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
