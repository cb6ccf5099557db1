"""Gumbel-coupled acceptance: the draft and the target draw the token of each index with the same Gumbel noise, so
a draft is accepted exactly when the target's own draw equals it.

Plain torch, no ``transformers`` import. The noise is :class:`hf_csv.core.speculative.gumbel.KeyedGumbel`'s.
"""
from __future__ import annotations

import torch

from hf_csv.core.speculative.gumbel import gumbel_shift, row_max_finite
from hf_csv.core.speculative.rule import AcceptanceResult

__all__ = ["gumbel_coupled_acceptance"]


def gumbel_coupled_acceptance(draft_ids: torch.Tensor, target_logits: torch.Tensor,
                              noise: torch.Tensor) -> AcceptanceResult:
    """Gumbel-coupled acceptance (docs/speculative.md): the target's token at position j is
    y_j = argmax_i target_logits[j, i] + noise[j, i]; drafts are accepted while x_j == y_j, and the first y_j that
    differs (or y_L after L accepted drafts) is emitted.

    Law: whatever the draft did, the emitted token at each position is the Gumbel-max draw from
    softmax(target_logits[j]) with that position's noise, so the output has the target's law when the noise of a
    token index is independent of everything that decided the tokens before it (:class:`KeyedGumbel`). A row that
    is one-hot (one finite entry, as hf_csv's certified draw returns it) yields its finite entry. Ties in the
    argmax go to the lowest index (measure zero). Shapes: draft_ids [L], target_logits and noise [L + 1, V].
    """
    L = int(draft_ids.shape[0])
    if target_logits.dim() != 2 or target_logits.shape[0] != L + 1 or noise.shape != target_logits.shape:
        raise ValueError(f"target_logits and noise must be [L + 1, V] with L = {L}; got "
                         f"{tuple(target_logits.shape)} and {tuple(noise.shape)}")
    ids = draft_ids.tolist()
    for j in range(L + 1):
        row = target_logits[j].float()
        m = gumbel_shift(row_max_finite(row[None]))[0]
        y = int(((row - m) + noise[j].to(row.device)).argmax())
        if not bool(torch.isfinite(row[y])):
            raise ValueError(f"target row {j} has no finite logit: nothing to sample")
        if j == L or y != ids[j]:
            toks = torch.tensor(ids[:j] + [y], dtype=torch.long, device=draft_ids.device)
            return AcceptanceResult(j, toks)
    raise AssertionError("unreachable")  # pragma: no cover
