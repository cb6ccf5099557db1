"""User-facing configuration of certified generation (no transformers import).

``CSVConfig`` is what ``model.generate(..., csv_config=CSVConfig(...))`` takes. It only
describes *how* the certified head may be used; which certificate runs at each call is
decided from the generation config and the logits processors in play (docs/processors.md).
Every field is validated on construction; a bad value raises ``ValueError`` naming the field.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

__all__ = ["CSVConfig", "MODES", "PROVIDERS", "DEFAULT_BUDGET", "lowered_k"]

# The fraction of V past which computing a row's candidate set S through a gather of its columns costs more than one
# dense GEMM of the whole head (measured, docs/benchmarks.md §3): the default ``budget`` of every certified head, and
# the cutoff past which a row within the budget is computed densely (hf_csv.core.certificate).
DEFAULT_BUDGET = 0.125
# most exact outlier columns the screen takes (hf_csv_kernels.screen._err_rest)
MAX_OUTLIERS = 1000

MODES = ("auto", "topk", "sample", "epsilon")
PROVIDERS = ("screen", "cluster")
SPECULATIVE = ("exact", "gumbel", "stock", "sigmoid")
DRAFT_HEADS = ("subvocab", "full")
VOCAB_PARALLEL = ("contiguous", "round_robin", "size_balanced")  # = hf_csv.core.distributed.STRATEGIES


# topk certificates before lowering processors (repetition penalty, bad words, ...): the head certifies this many
# times the warper's k (at least LOWER_K_MIN more), so that the k-th processed score rarely falls to the bound on the
# uncomputed tokens (docs/benchmarks.md §3: with K = k, 18 verify positions in 11 of 21 assisted target calls of
# Qwen-1.5B at its defaults re-ran stock's head). The transformers path and the vLLM plugin both use it.
LOWER_K_FACTOR, LOWER_K_MIN = 2, 8


def lowered_k(k: int, vocab_size: int) -> int:
    """The wider certified set for a top-``k`` decision after lowering processors (a speed choice: any k is sound)."""
    return min(vocab_size, max(LOWER_K_FACTOR * k, k + LOWER_K_MIN))


@dataclass
class CSVConfig:
    """How the certified LM head is used inside ``generate``.

    Args:
        mode: ``"auto"`` (default) picks the strongest *exact* certificate the call allows
            (greedy -> certified top-1, sampling with temperature / top-k -> exact draw from stock's
            law) and the full head otherwise. ``"topk"`` / ``"sample"`` request that certificate (still
            falling back to the full head, with a logged reason, when the call makes it unsound).
            ``"epsilon"`` is the only *approximate* mode: it additionally allows the ε-softmax
            certificate (TV <= ``epsilon`` before normalizing warpers) for top-p / min-p / typical
            sampling, and the ``beam_epsilon`` certificate for beam search.
        epsilon: the TV bound of the ε-softmax certificate (``mode="epsilon"`` only), in (0, 1).
        beam_epsilon: TV bound used for beam search under ``mode="epsilon"`` only (other modes run
            beam search on the full head), whose log-softmax needs the normalizer:
            the beam log-probs differ from stock by at most -log(1-beam_epsilon) ≈ beam_epsilon.
        provider: bound provider, ``"screen"`` (certified int8 screen; needs no index) or
            ``"cluster"`` (needs ``index``).
        budget: max sub-vocabulary size before a row falls back to the full head: an int, or a
            fraction of V in (0, 1]. Speed only: a row with a larger S is exact either way. The default, V/8,
            is where one dense GEMM starts to beat gathering S's columns; a lower budget sent flat rows of
            multi-row calls (the target's verify in assisted sampling) to the full head for the whole call
            (docs/benchmarks.md §3).
        index: a :class:`hf_csv.VocabIndex`, a local directory or a Hub repo id; ``None`` is fine
            for the screen provider.
        revision: Hub revision of ``index`` when it is a repo id.
        stats: collect per-call certification statistics (``output.csv_stats`` /
            ``model.csv_last_stats``).
        num_outliers: exact fp32 columns of h in the screen ("massive activations"), at most 1000 (the proof's
            limit; a larger value is refused here, not when a head is built).
        speculative: verify step of assisted sampling (``assistant_model=``): ``"exact"`` (default,
            hf_csv's exact and faster replacement of transformers' ``_speculative_sampling``),
            ``"gumbel"`` (opt-in, exact: Gumbel-coupled verification — the draft and the target draw with the
            same Gumbel noise per token index and a draft is accepted iff the target's draw equals it; the target's
            law, and for a given seed the tokens do not depend on the assistant, but they are not stock's token
            stream; no normalizer is needed, so flat rows at T = 1 stay certified; docs/speculative.md),
            ``"stock"``, or ``"sigmoid"`` — the seed paper's approximation, **lossy** (it accepts
            nearly every draft token; measured quality in docs/speculative.md); it warns.
        draft_head: head of the *assistant* model in assisted generation: ``"subvocab"`` (default;
            greedy drafts use the certified top-1, so the drafted tokens are the stock draft's;
            sampled drafts sample from the exact logits on a certified top-``draft_top_k`` set and
            return exactly those logits, which keeps speculative sampling lossless) or ``"full"``.
        draft_top_k: size of the certified top-k set sampled drafts draw from (``>= 1``).
        vocab_parallel: shard the certified head's vocabulary over the ranks of ``torch.distributed``
            (``"contiguous"``, ``"round_robin"`` or ``"size_balanced"``; cluster-aware with ``index``);
            ranks agree on the certified top-k with O(k) collectives (docs/distributed.md). A head
            that a tensor-parallel plan already sharded by vocabulary is used as sharded, whatever
            this field says. ``None``: every rank runs the whole certified head.
        scores: what ``output_scores=True`` returns: ``"stock"`` (default; the call uses the full head so
            that ``scores`` and ``compute_transition_scores`` are stock's) or ``"subvocab"`` (opt-in: the
            certified processed scores on the sub-vocabulary, ``-inf`` elsewhere — not log-probabilities
            over V; greedy ``argmax`` of each row is still stock's token).
        screen_quant: storage of the screen's rows: ``"int8"`` (default; fbgemm fast path on CPU) or
            ``"fp8"`` (e4m3, per-row scaled; Triton on CUDA, weight-only reference on CPU).
        beam_search: beam search (``num_beams > 1``, no sampling): ``"full"`` (default; the full head, stock's
            arithmetic) or ``"exact"`` (opt-in: the token-identical certificate of docs/certificates.md §3.10; a
            decision the intervals cannot certify re-runs the call on the full head, so tokens are always stock's).
            Not the default because it is measured *slower* than stock on this project's heads: the screen bounds a
            beam row's normalizer too loosely, so most rows go over the budget (docs/benchmarks.md §9.9).
        compile_capacity: inside a compiled forward (``cache_implementation="static"`` with transformers'
            auto-compile), the static candidate capacity C of the certified head: a row whose certified set
            has more than C tokens takes the full head there (decided on the device, no graph break).
            Larger C: more rows certified, more work per certified row (docs/certificates.md §3.9). A sampled
            call with ``top_k=K`` uses at least 40·K (a certified top-K set is about ten times K on real heads).
    """

    mode: str = "auto"
    epsilon: float = 1e-3
    beam_epsilon: float = 1e-6
    provider: str = "screen"
    budget: Union[int, float] = DEFAULT_BUDGET
    index: Any = None
    revision: Optional[str] = None
    stats: bool = True
    num_outliers: int = 16
    speculative: str = "exact"
    draft_head: str = "subvocab"
    draft_top_k: int = 64
    vocab_parallel: Optional[str] = None
    screen_quant: str = "int8"
    scores: str = "stock"
    compile_capacity: int = 64
    beam_search: str = "full"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"CSVConfig.mode must be one of {MODES}, got {self.mode!r}")
        for name in ("epsilon", "beam_epsilon"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < 1) or not math.isfinite(v):
                raise ValueError(f"CSVConfig.{name} must be a number in (0, 1), got {v!r}")
            setattr(self, name, float(v))
        if self.provider not in PROVIDERS:
            raise ValueError(f"CSVConfig.provider must be one of {PROVIDERS}, got {self.provider!r}")
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise ValueError(f"CSVConfig.budget must be an int >= 1 or a fraction in (0, 1], got {b!r}")
        if isinstance(b, float) and not (0 < b <= 1):
            raise ValueError(f"CSVConfig.budget as a fraction must be in (0, 1], got {b!r}")
        if isinstance(b, int) and b < 1:
            raise ValueError(f"CSVConfig.budget as a count must be >= 1, got {b!r}")
        if self.index is not None and not isinstance(self.index, (str, os.PathLike)):
            # duck-typed so that this module stays import-light; VocabIndex has check_head
            if not hasattr(self.index, "check_head"):
                raise ValueError(f"CSVConfig.index must be a directory, a repo id, a VocabIndex or None, "
                                 f"got {type(self.index).__name__}")
        if self.provider == "cluster" and self.index is None:
            raise ValueError("CSVConfig.index is required for provider='cluster'")
        if self.revision is not None and not isinstance(self.revision, str):
            raise ValueError(f"CSVConfig.revision must be a string or None, got {self.revision!r}")
        if not isinstance(self.stats, bool):
            raise ValueError(f"CSVConfig.stats must be a bool, got {self.stats!r}")
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"CSVConfig.speculative must be one of {SPECULATIVE}, got {self.speculative!r}")
        if self.draft_head not in DRAFT_HEADS:
            raise ValueError(f"CSVConfig.draft_head must be one of {DRAFT_HEADS}, got {self.draft_head!r}")
        if isinstance(self.draft_top_k, bool) or not isinstance(self.draft_top_k, int) or self.draft_top_k < 1:
            raise ValueError(f"CSVConfig.draft_top_k must be an int >= 1, got {self.draft_top_k!r}")
        if self.vocab_parallel is not None and self.vocab_parallel not in VOCAB_PARALLEL:
            raise ValueError(f"CSVConfig.vocab_parallel must be one of {VOCAB_PARALLEL} or None, "
                             f"got {self.vocab_parallel!r}")
        if self.screen_quant not in ("int8", "fp8"):
            raise ValueError(f"CSVConfig.screen_quant must be 'int8' or 'fp8', got {self.screen_quant!r}")
        if self.scores not in ("stock", "subvocab"):
            raise ValueError(f"CSVConfig.scores must be 'stock' or 'subvocab', got {self.scores!r}")
        if self.beam_search not in ("full", "exact"):
            raise ValueError(f"CSVConfig.beam_search must be 'full' or 'exact', got {self.beam_search!r}")
        c = self.compile_capacity
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"CSVConfig.compile_capacity must be an int >= 1, got {c!r}")
        if isinstance(self.num_outliers, bool) or not isinstance(self.num_outliers, int) or self.num_outliers < 0:
            raise ValueError(f"CSVConfig.num_outliers must be an int >= 0, got {self.num_outliers!r}")
        if self.num_outliers > MAX_OUTLIERS:
            # the exact-column error term e^R is proven for k <= 1000 columns (docs/certificates.md §1.1, Lemma 1')
            raise ValueError(f"CSVConfig.num_outliers must be at most {MAX_OUTLIERS} (the screen's proof covers up "
                             f"to {MAX_OUTLIERS} exact columns), got {self.num_outliers}")

    def head_key(self) -> tuple:
        """What determines the cached :class:`CertifiedHead` (the int8 screen is built once per key)."""
        idx = self.index if isinstance(self.index, (str, os.PathLike, type(None))) else id(self.index)
        return (self.provider, self.budget, str(idx), self.revision, self.num_outliers, self.vocab_parallel,
                self.screen_quant)

    def to_dict(self) -> dict:
        return {f.name: (getattr(self, f.name) if f.name != "index" or self.index is None
                         or isinstance(self.index, str) else repr(self.index)) for f in fields(self)}
