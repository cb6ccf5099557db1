"""Shared by tests/test_core_speculative.py and tests/test_transformers_acceptance.py: speculative-sampling cases (target and draft
logits, drafts), the chi-square machinery (bins with an expected count < 5 merged into one) and transformers' stock
``_speculative_sampling`` run on the same inputs."""
from __future__ import annotations

import inspect
from collections import Counter

import pytest
import torch
from scipy import stats
from transformers.generation import utils as gen_utils

STOCK = gen_utils._speculative_sampling
_EXTRA = tuple(inspect.signature(STOCK).parameters)[4]  # 5.x: assistant_ensemble_weight; 4.57: is_done_candidate


_X = (False,) if _EXTRA == "is_done_candidate" else ()  # the fifth argument stock's caller passes


def stock(*args, **kw):
    """Stock ``_speculative_sampling`` (4.57: is_done_candidate=False; its ensemble weight does not exist)."""
    if _EXTRA == "is_done_candidate":
        if kw.pop("assistant_ensemble_weight", None) is not None:
            pytest.skip("transformers 4.57 has no assistant_ensemble_weight")
        kw.setdefault("is_done_candidate", False)
    return STOCK(*args, **kw)


def make_case(V: int, L: int, seed: int, sub: int | None = None, noise: float = 1.0):
    """Target logits [L+1, V], draft logits [L, V] (-inf outside a random sub-vocabulary of size
    ``sub`` if given) and a generator."""
    g = torch.Generator().manual_seed(seed)
    zp = torch.randn(L + 1, V, generator=g) * 1.5
    zq = zp[:L] + noise * torch.randn(L, V, generator=g)
    if sub is not None:
        for j in range(L):
            keep = torch.randperm(V, generator=g)[:sub]
            mask = torch.full((V,), float("-inf"))
            mask[keep] = 0.0
            zq[j] = zq[j] + mask
    return zp, zq, g


def draw_drafts(zq: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
    """n independent draft sequences [n, L], x_j ~ softmax(zq[j])."""
    q = torch.softmax(zq, -1)
    return torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(zq.shape[0])], 1)


def gof_pvalue(counts: Counter, law: dict, n: int) -> float:
    """Chi-square goodness of fit; bins with expected < 5 merged; outcomes outside the law's support
    make the p-value 0 (an impossible outcome is a failure, not noise)."""
    if any(k not in law for k in counts):
        return 0.0
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for k, pr in law.items():
        if pr * n >= 5:
            obs.append(counts.get(k, 0))
            exp.append(pr * n)
        else:
            rest_o += counts.get(k, 0)
            rest_e += pr * n
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    exp = [e * n / sum(exp) for e in exp]  # renormalize float round-off
    return float(stats.chisquare(obs, exp).pvalue)


def two_sample_pvalue(a: Counter, b: Counter) -> float:
    """Chi-square test of homogeneity of two categorical samples (bins with < 10 total merged)."""
    keys = sorted(set(a) | set(b))
    big = [k for k in keys if a.get(k, 0) + b.get(k, 0) >= 10]
    small = [k for k in keys if k not in big]
    rows = [[a.get(k, 0) for k in big], [b.get(k, 0) for k in big]]
    if small:
        rows[0].append(sum(a.get(k, 0) for k in small))
        rows[1].append(sum(b.get(k, 0) for k in small))
    return float(stats.chi2_contingency(rows).pvalue)


def run_stock(zp, zq, drafts, seed, **kw) -> list[tuple[int, ...]]:
    torch.manual_seed(seed)  # stock draws from the global RNG
    L = zq.shape[0]
    prefix = torch.zeros(1, 3, dtype=torch.long)
    out = []
    for d in drafts:
        cand = torch.cat([prefix, d[None]], 1)
        valid, _ = stock(cand, zq[None], L, zp[None], **kw)
        out.append(tuple(valid[0].tolist()))
    return out
