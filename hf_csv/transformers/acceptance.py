"""transformers integration of the fast verify step: a scoped patch of ``_speculative_sampling``.

``transformers.generation.utils._assisted_decoding`` looks the module global
``_speculative_sampling`` up at call time (every version in :mod:`hf_csv.transformers.compat`), so replacing that global is the one
narrow point we patch. Usage::

    from hf_csv.transformers.acceptance import patch_speculative_sampling

    with patch_speculative_sampling():            # mode="exact": same distribution as stock
        out = model.generate(ids, assistant_model=draft, do_sample=True)

    with patch_speculative_sampling("sigmoid"):   # LOSSY, opt-in, warns
        ...

Guarantees:

* ``mode="exact"``: the emitted tokens have exactly the distribution the stock function produces
  (the target model's), proof in docs/speculative.md; return values have stock's shapes and dtypes.
* Scoped and restoring: the original function is put back when the last active scope exits, also
  when the body raises. Scopes nest. (Installed by :func:`hf_csv.transformers.patches.global_override`.)
* Thread-safe: installation is reference-counted under a lock, and the mode is *thread-local* — a
  thread that has not entered a scope always gets the stock function, even while another thread
  is inside one. (Consequence: enter the scope in the thread that calls ``generate``.)
* Fails clearly (:class:`~hf_csv.core.errors.UnsupportedVersionError`) on a transformers version or a
  stock signature this module was not written against.
"""
from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch

from hf_csv.core.speculative import (AcceptanceResult, LossyVerifyWarning, bounded_acceptance, exact_acceptance,
                                   gumbel_coupled_acceptance, sigmoid_acceptance)

from hf_csv.transformers.compat import speculative_gen_utils
from hf_csv.core.errors import CSVError
from hf_csv.transformers.patches import global_override, installed
from hf_csv.transformers.plans import Bounded, Full, TopK

__all__ = [
    "patch_speculative_sampling",
    "SpeculativePatch",
    "speculative_sampling_exact",
    "speculative_sampling_sigmoid",
    "check_transformers_version",
    "LossyVerifyWarning",
]

Mode = Literal["exact", "gumbel", "sigmoid"]

def check_transformers_version() -> Any:
    """``transformers.generation.utils`` after checking the version and the stock signature
    (:func:`hf_csv.transformers.compat.speculative_gen_utils`, the one place that knows each version).

    Raises:
        UnsupportedVersionError: untested transformers version, or the module global is missing or
            has another signature.
    """
    return speculative_gen_utils()[0]


def _adapt(
    acceptance: Callable[..., AcceptanceResult],
    candidate_input_ids: torch.Tensor,
    candidate_logits: torch.Tensor,
    candidate_length: int,
    new_logits: torch.Tensor,
    assistant_ensemble_weight: float | None,
    **kw: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stock calling convention -> kernel -> stock return values.

    Stock (5.23) shapes: candidate_input_ids [1, cur + L], candidate_logits [1, L, V],
    new_logits [1, L + 1, V]; returns (valid_tokens int64 [1, n + 1], n_matches 0-d int64 tensor).
    """
    if candidate_logits.dim() != 3 or new_logits.dim() != 3:
        raise ValueError("candidate_logits and new_logits must be [batch, length, vocab]")
    if candidate_input_ids.shape[0] != 1 or candidate_logits.shape[0] != 1 or new_logits.shape[0] != 1:
        # stock squeezes the batch dim away: assisted decoding is batch-size-1 only
        raise ValueError("speculative sampling supports batch size 1 only (as transformers' assisted decoding)")
    L = int(candidate_length)
    if candidate_logits.shape[1] != L or new_logits.shape[1] != L + 1:
        raise ValueError(
            f"candidate_length={L} but candidate_logits has {candidate_logits.shape[1]} and new_logits "
            f"{new_logits.shape[1]} positions (expected L and L+1)"
        )
    ids = candidate_input_ids[0, candidate_input_ids.shape[1] - L :]
    res = acceptance(ids, candidate_logits[0], new_logits[0], ensemble_weight=assistant_ensemble_weight, **kw)
    valid = res.tokens.to(candidate_input_ids.dtype)[None, :]
    return valid, torch.tensor(res.n_accepted, dtype=torch.long, device=valid.device)


def speculative_sampling_exact(
    candidate_input_ids: torch.Tensor,
    candidate_logits: torch.Tensor,
    candidate_length: int,
    new_logits: torch.Tensor,
    assistant_ensemble_weight: float | None = None,
    *,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for stock ``_speculative_sampling`` with the same output distribution (see
    :func:`hf_csv.core.speculative.exact_acceptance`), faster. Returns (valid_tokens, n_matches)."""
    return _adapt(exact_acceptance, candidate_input_ids, candidate_logits, candidate_length, new_logits,
                  assistant_ensemble_weight, generator=generator)


def speculative_sampling_sigmoid(
    candidate_input_ids: torch.Tensor,
    candidate_logits: torch.Tensor,
    candidate_length: int,
    new_logits: torch.Tensor,
    assistant_ensemble_weight: float | None = None,
    *,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LOSSY stand-in for ``_speculative_sampling`` (seed paper's sigmoid approximation). Does not
    warn itself; :func:`patch_speculative_sampling` warns once per scope."""
    return _adapt(sigmoid_acceptance, candidate_input_ids, candidate_logits, candidate_length, new_logits,
                  assistant_ensemble_weight, generator=generator, warn=False)


def speculative_sampling_certified(
    session: Any,
    candidate_input_ids: torch.Tensor,
    candidate_logits: torch.Tensor,
    candidate_length: int,
    new_logits: torch.Tensor,
    *,
    generator: torch.Generator | None = None,
    counts: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact verify on a target whose head ran in mode ``"spec"`` (docs/speculative.md, "certified
    target"): ``new_logits`` are exact on the head's set S and ``-inf`` elsewhere; the head's stash gives an
    upper bound on every other token's logit, and rows are completed with the full head where the bounds
    do not decide. The law is that of :func:`speculative_sampling_exact` on the full rows.

    Limits: the processors between head and verify must be temperature warpers only (hf_csv.transformers.method_plans picks the
    Bounded plan only then) and the post-head map the identity; batch size 1.
    """
    st = session.step.last
    session.step.spec_pending = False
    L = int(candidate_length)
    if st is None or st.upper is None or new_logits.shape[0] != 1 or st.logits.shape[0] != 1 \
            or st.logits.shape[1] < L + 1 or new_logits.shape[1] != L + 1:
        # the head call was the full head (or shapes we cannot map): the rows are complete
        return speculative_sampling_exact(candidate_input_ids, candidate_logits, candidate_length, new_logits,
                                          None, generator=generator)
    P = st.logits.shape[1]
    rows = slice(P - (L + 1), P)  # without logits_to_keep the head saw the whole input
    mask = st.mask[0, rows]
    z = new_logits[0]
    head, dtype = session.head, session.out_dtype
    procs = [p for p in (session.processors or ()) if type(p).__name__ == "TemperatureLogitsWarper"]
    ids_stub = candidate_input_ids  # temperature warpers ignore input ids

    def process(raw: torch.Tensor) -> torch.Tensor:
        # stock: the head's values in the model dtype, to fp32, then the warpers (same ops, same order)
        x = raw.to(dtype).float()[None]
        for p in procs:
            x = p(ids_stub, x)
        return x[0]

    first = P - (L + 1)

    def upper(j: int) -> torch.Tensor:
        # row j only when the verify reaches it; rounding and division by T > 0 are monotone: still upper bounds
        if bool((torch.isfinite(z[j]) & ~mask[j]).any()):
            raise CSVError("hf_csv: the target's processed logits are finite off the certified set; a processor "
                           "changed uncomputed scores. Please report this.")
        return process(st.upper[0, first + j])

    H = st.H.reshape(P, -1)
    Hf, Hn = head._check(H)
    def complete(j: int, tokens: torch.Tensor | None) -> torch.Tensor:
        r = P - (L + 1) + j
        if tokens is None:
            # the full head on this one row (a GEMV: a quarter of the GEMM over all rows on a 12-row call); its
            # values may differ from that GEMM's in the last fp32 bits, which is the "up to fp32 rounding" of
            # the guarantee (docs/speculative.md)
            return process(head._stock_rows(Hf[r:r + 1], Hn[r:r + 1], dtype)[0])
        return process(head._values(torch.full_like(tokens, r), tokens, Hf, Hn, dtype))

    ids = candidate_input_ids[0, candidate_input_ids.shape[1] - L:]
    res = bounded_acceptance(ids, candidate_logits[0], z, mask, upper, complete, generator=generator, counts=counts)
    valid = res.tokens.to(candidate_input_ids.dtype)[None, :]
    return valid, torch.tensor(res.n_accepted, dtype=torch.long, device=valid.device)


def speculative_sampling_gumbel(
    noise: Any,
    candidate_input_ids: torch.Tensor,
    candidate_length: int,
    new_logits: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gumbel-coupled verification (docs/speculative.md) in stock's calling convention: the target's token at
    index t is argmax(new_logits row + ``noise`` of index t) (:class:`hf_csv.core.speculative.KeyedGumbel`); drafts
    are accepted while they equal it. Exact for any draft; the draft's logits are not read. Batch size 1."""
    L = int(candidate_length)
    if candidate_input_ids.shape[0] != 1 or new_logits.shape[0] != 1 or new_logits.shape[1] != L + 1:
        raise ValueError("Gumbel-coupled verification: batch size 1 and L + 1 target rows")
    cur = candidate_input_ids.shape[1] - L
    rows = new_logits[0]
    g = noise.rows(range(cur, cur + L + 1), rows.shape[1], rows.device)
    res = gumbel_coupled_acceptance(candidate_input_ids[0, cur:], rows, g)
    valid = res.tokens.to(candidate_input_ids.dtype)[None, :]
    return valid, torch.tensor(res.n_accepted, dtype=torch.long, device=valid.device)


@torch.no_grad()
def gumbel_reference(model: Any, seed: int, **generate_kwargs: Any) -> torch.Tensor:
    """What ``generate(..., assistant_model=A, csv_config=CSVConfig(speculative="gumbel"))`` returns after
    ``torch.manual_seed(seed)``, computed by *stock* transformers alone: plain sampling, no assistant, no hf_csv,
    with a last processor that makes the call's keyed draw argmax(processed row + g_t) on stock's full rows.
    For tests and benchmarks of the Gumbel-coupled path (docs/speculative.md); batch size 1.

    transformers puts custom processors before its own warpers, so the warpers are passed explicitly in
    generate's order (temperature, top-k, top-p, min-p); other warpers raise ``ValueError``.
    """
    from transformers import (LogitsProcessor, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                              TopPLogitsWarper)

    from hf_csv.core.speculative import KeyedGumbel

    from hf_csv.transformers.compat import generation_setting

    kw = dict(generate_kwargs)
    # each warper's setting as the certified call sees it: the keyword, else the generation config passed, else the
    # model's (transformers' default top_k = 50, or a model's generation_config.json)
    gc = kw.get("generation_config") or getattr(model, "generation_config", None)
    warp = {key: kw[key] if key in kw else generation_setting(gc, key)
            for key in ("temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
                        "top_h")}
    for key in ("typical_p", "epsilon_cutoff", "eta_cutoff", "top_h"):
        if warp[key] not in (None, 0, 0.0, 1.0):
            raise ValueError(f"gumbel_reference: {key} is not supported")

    class _KeyedDraw(LogitsProcessor):
        def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            y = int((scores[0].float() + kg.row(ids.shape[1], scores.shape[1], scores.device)).argmax())
            out = torch.full_like(scores, float("-inf"))
            out[0, y] = scores[0, y]
            return out

    torch.manual_seed(seed)
    kg = KeyedGumbel(int(torch.randint(0, 2 ** 62, (1,))))  # the certified call's first draw (hf_csv.transformers.enable)
    warpers: list = []
    if warp["temperature"] not in (None, 1.0):
        warpers.append(TemperatureLogitsWarper(warp["temperature"]))
    if warp["top_k"]:
        warpers.append(TopKLogitsWarper(warp["top_k"]))
    if warp["top_p"] not in (None, 1.0):
        warpers.append(TopPLogitsWarper(warp["top_p"]))
    if warp["min_p"]:
        warpers.append(MinPLogitsWarper(warp["min_p"]))
    kw.update(temperature=1.0, top_k=0, top_p=1.0, min_p=None, do_sample=True)
    kw["logits_processor"] = [*kw.get("logits_processor", []), *warpers, _KeyedDraw()]
    generate = type(model).generate  # the class's: an hf_csv-enabled instance's generate without csv_config is too
    return generate(model, **kw)


_IMPLS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "exact": speculative_sampling_exact,
    "sigmoid": speculative_sampling_sigmoid,
}


@dataclass
class SpeculativePatch:
    """Handle of one active scope: its mode and how often the patched verify ran in it.

    ``session``: the target model's certified session (:class:`hf_csv.transformers.session.CSVSession`) when the scope
    belongs to a certified ``generate`` call; in its mode ``"spec"`` the verify reads the head's bounds
    (:func:`speculative_sampling_certified`). ``rows`` counts the target rows the verify looked at,
    ``by_bounds`` the decisions the bounds settled and ``completed`` the rows completed with the full head.
    """

    mode: Mode
    generator: torch.Generator | None = None
    session: Any = None
    calls: int = 0
    accepted: int = 0
    drafted: int = 0
    certified_calls: int = 0
    counts: dict = field(default_factory=lambda: {"rows": 0, "by_bounds": 0, "completed": 0})

    def summary(self) -> dict:
        """What ``csv_stats["speculative"]`` reports."""
        return {"verify_calls": self.calls, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": self.acceptance_rate, "certified_verify_calls": self.certified_calls,
                "target_rows": self.counts["rows"], "target_rows_by_bounds": self.counts["by_bounds"],
                "target_rows_completed": self.counts["completed"]}

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens over this scope (before stock's eos/max-length crop)."""
        return self.accepted / self.drafted if self.drafted else float("nan")


# the name of ``_speculative_sampling``'s fifth parameter on this version (hf_csv.transformers.compat), read on entry
_extra: str | None = None
_local = threading.local()


def _stack() -> list[SpeculativePatch]:
    st = getattr(_local, "stack", None)
    if st is None:
        st = _local.stack = []
    return st


def _dispatch(
    candidate_input_ids: torch.Tensor,
    candidate_logits: torch.Tensor,
    candidate_length: int,
    new_logits: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Installed in place of the stock global: routes to this thread's innermost scope, or to
    the original function for threads outside any scope.

    The fifth argument is the version's (:mod:`hf_csv.transformers.compat`): 5.x ``assistant_ensemble_weight``;
    4.57 ``is_done_candidate``, where stock keeps the L drafts without a bonus token when all are
    accepted and the last one ends the sequence (the bonus draw is discarded: the law is unchanged).
    """
    st = getattr(_local, "stack", None)
    if not st:
        return _dispatch.__hf_csv_original__(  # type: ignore[attr-defined]
            candidate_input_ids, candidate_logits, candidate_length, new_logits, *args, **kwargs)
    h = st[-1]
    extra_name = _extra
    extra = args[0] if args else kwargs.get(extra_name)
    weight = extra if extra_name == "assistant_ensemble_weight" else None
    sess = h.session
    if h.mode == "gumbel":
        if sess is None or sess.gumbel is None:
            raise CSVError("hf_csv: the Gumbel-coupled verify needs the call's keyed noise (use "
                           "generate(..., csv_config=CSVConfig(speculative='gumbel')))")
        if weight is not None:
            raise CSVError("hf_csv: assistant_ensemble_weight (a mixture of the two models' softmax) cannot be "
                           "combined with CSVConfig(speculative='gumbel')")
        valid, n = speculative_sampling_gumbel(sess.gumbel, candidate_input_ids, candidate_length, new_logits)
        h.certified_calls += 1
    elif h.mode == "exact" and sess is not None and isinstance(sess.plan, Bounded) and weight is None:
        valid, n = speculative_sampling_certified(sess, candidate_input_ids, candidate_logits, candidate_length,
                                                  new_logits, generator=h.generator, counts=h.counts)
        h.certified_calls += 1
    elif h.mode == "exact" and sess is not None and h.generator is None and (
            isinstance(sess.plan, Full) or (isinstance(sess.plan, TopK) and sess.plan.check_after is not None)):
        # stock's rows on both sides, so stock's own verify draws stock's tokens from stock's random stream (hf_csv's
        # exact verify has the same law but other draws): a checked top-K plan's processed rows are stock's, and so
        # are the draft's on the same plan; a declined call's rows are stock's head's and its drafts are stock's
        # (hf_csv.transformers.method_plans._sampled_draft_plan)
        valid, n = _dispatch.__hf_csv_original__(  # type: ignore[attr-defined]
            candidate_input_ids, candidate_logits, candidate_length, new_logits, *args, **kwargs)
    else:
        valid, n = _IMPLS[h.mode](candidate_input_ids, candidate_logits, candidate_length, new_logits,
                                  weight, generator=h.generator)
    L = int(candidate_length)
    accepted = valid.shape[1] - 1
    if extra_name == "is_done_candidate" and extra and valid.shape[1] == L + 1:
        valid, n = valid[:, :L], n - 1
    h.calls += 1
    h.drafted += L
    h.accepted += accepted
    return valid, n


class patch_speculative_sampling:  # noqa: N801 (used like a function)
    """Context manager: replace ``transformers.generation.utils._speculative_sampling`` with the
    fast exact verify (``mode="exact"``) or the lossy sigmoid verify (``mode="sigmoid"``, warns
    with :class:`LossyVerifyWarning` on entry) for the current thread, restoring on exit.

    Args:
        mode: ``"exact"`` or ``"sigmoid"``.
        generator: optional ``torch.Generator`` for the verify's random draws.

    Yields a :class:`SpeculativePatch` with call and acceptance counters.
    """

    def __init__(self, mode: Mode = "exact", *, generator: torch.Generator | None = None,
                 session: Any = None) -> None:
        if mode not in _IMPLS and mode != "gumbel":
            raise ValueError(f"mode must be one of {sorted([*_IMPLS, 'gumbel'])}, got {mode!r}")
        if mode == "gumbel" and getattr(session, "gumbel", None) is None:
            raise ValueError("mode 'gumbel' needs a certified session with keyed noise: use "
                             "generate(..., assistant_model=..., csv_config=CSVConfig(speculative='gumbel'))")
        self.handle = SpeculativePatch(mode=mode, generator=generator, session=session)
        self._scopes: list = []  # the installations this object entered (hf_csv.transformers.patches.global_override)

    def __enter__(self) -> SpeculativePatch:
        global _extra
        gen_utils, sup = speculative_gen_utils()
        if self.handle.mode == "sigmoid":
            warnings.warn(
                "hf_csv sigmoid verify is LOSSY: assisted sampling will not follow the target model's "
                "distribution (nearly every draft token is accepted). See docs/speculative.md.",
                LossyVerifyWarning,
                stacklevel=2,
            )
        _extra = sup.speculative_extra
        # installed once for all scopes, reference-counted, restored by the last exit (hf_csv.transformers.patches)
        scope = global_override(gen_utils, "_speculative_sampling", _dispatch)
        scope.__enter__()
        self._scopes.append(scope)
        _stack().append(self.handle)
        return self.handle

    def __exit__(self, *exc: object) -> None:
        st = _stack()
        # remove this scope even if inner scopes exited out of order
        for i in range(len(st) - 1, -1, -1):
            if st[i] is self.handle:
                del st[i]
                break
        self._scopes.pop().__exit__(*exc)
        return None


def installed_original() -> Callable[..., Any] | None:
    """The stock function while a scope is active (None otherwise); for tests and benchmarks."""
    import sys

    gen_utils = sys.modules.get("transformers.generation.utils")
    with installed(gen_utils, "_speculative_sampling") as inst:
        return None if inst is None else inst.state["original"]
