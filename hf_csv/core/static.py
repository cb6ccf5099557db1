"""A certified top-k head with static shapes, for ``torch.compile(fullgraph=True)`` and CUDA graphs.

:class:`StaticTopK` is the exact top-k certificate of docs/certificates.md §2.1 written without a
data-dependent shape: a fixed candidate capacity ``C`` instead of ``nonzero``, and the fallback to the
full head decided on the device by ``torch.cond``. Traced into the model's compiled forward it adds no graph
break, and its guards depend only on the plan object (not on the prompt or the cache length), so shorter
generations do not recompile. Proof: docs/certificates.md §3.9.

Guarantee: for every row, the returned logits equal stock's ``F.linear(h, W)`` (in the weight dtype) on a
set S' that holds stock's top-k, ties included, and are -inf elsewhere; or the whole row is stock's (full
head), when S has more than ``C`` tokens or ``h`` is not finite. Limits: no bias (the eager certificate
handles biased heads); the values on S' come from the same GEMM over all rows of the call and the union of
the candidate columns, so they equal stock's where the kernel is invariant to the number of output columns,
as §2.0 states for the eager head. The screen is the head's own screen provider (:mod:`hf_csv.core.bounds`, the
eager certificate's kernels, chosen by device in :mod:`hf_csv_kernels.dispatch`), called through the opaque
custom op ``hf_csv::screen_bounds`` so that the compiled graph runs it as it is: inductor would run the
weight-only ``_weight_int8pack_mm``, slower than stock's fp32 head on this project's CPUs (docs/benchmarks.md
§9.8). Without a provider (unit tests) the weight-only int8 reference of §1.1 serves.

This module does not import transformers (core, below the integration in :mod:`hf_csv.transformers.scope`).
"""
from __future__ import annotations

import math
import weakref
from typing import Any, Optional

import torch
import torch.nn.functional as F

from hf_csv_kernels.quantize import Int8Rows, gamma, unit_roundoff
from hf_csv_kernels.screen import weight_only_radius

from hf_csv.core.certificate import H_MAX, H_MIN
from hf_csv.core.certificate.rounding import _cut, _cut_order, _down, value_interval

__all__ = ["StaticTopK"]


# screen providers by key for the custom op (a compiled graph passes the key, a constant, not the object); the plan
# that uses a provider keeps it alive
_PROVIDERS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


@torch.library.custom_op("hf_csv::screen_bounds", mutates_args=())
def screen_bounds(H: torch.Tensor, key: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(estimate, upper bounds) [N, V] of screen provider ``key`` on fp32 hidden states ``H`` [N, d]: the provider's
    own call, opaque to the compiler (its kernels run as in eager decoding; the bound is §1.1's)."""
    est, upper = _PROVIDERS[key](H)
    return est, upper


@screen_bounds.register_fake
def _screen_bounds_fake(H: torch.Tensor, key: int) -> tuple[torch.Tensor, torch.Tensor]:
    V = _PROVIDERS[key].vocab_size
    return H.new_empty((H.shape[0], V), dtype=torch.float32), H.new_empty((H.shape[0], V), dtype=torch.float32)


def _has_int8pack(device: torch.device) -> bool:
    """Whether ``torch._weight_int8pack_mm`` runs on ``device`` for fp32 activations (CPU in torch >= 2.3)."""
    try:
        x = torch.ones(1, 8, device=device)
        q = torch.ones(2, 8, dtype=torch.int8, device=device)
        s = torch.ones(2, device=device)
        return bool(torch._weight_int8pack_mm(x, q, s).eq(8).all())
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


class StaticTopK:
    """Exact top-``k`` head with candidate capacity ``capacity`` (static shapes; see the module docstring).

    Args:
        weight: the head weight [V, d] (the stock op runs on it; never copied).
        rows: the screen's :class:`Int8Rows` of ``weight`` (int8, per-row scale and error terms).
        k: how many top tokens are certified (1: greedy).
        capacity: C >= k, the most tokens a certified row may hold.
        suppress: token ids that a later processor sets to -inf at every step (Whisper's ``suppress_tokens``):
            the certificate is then about the top-k of the other tokens (docs/certificates.md §3.9).
        temperature: the temperature warper between the head and the top-k warper of a sampled call (None or 1.0:
            none): the cut then keeps every token outside S strictly below the k-th largest *after* the warper's
            division, whatever its rounding (docs/certificates.md §3.9, compiled sampling).
        screen: the head's screen provider (:class:`hf_csv.core.bounds.ScreenProvider` of ``rows``, no bias): its
            bounds, through ``hf_csv::screen_bounds``. ``None``: the weight-only reference on ``rows``.

    Call it on hidden states [..., d] in the weight dtype; it returns [..., V] logits in that dtype. Counters
    (``rows_seen``, ``rows_certified``, ``subvocab_sum``: int64 tensors updated in place, also inside a compiled
    graph) count what it did.
    """

    def __init__(self, weight: torch.Tensor, rows: Int8Rows, k: int = 1, capacity: int = 64,
                 suppress: Optional[torch.Tensor] = None, screen: Any = None, temperature: Optional[float] = None):
        V, d = weight.shape
        if rows.q.dtype != torch.int8 or tuple(rows.q.shape) != (V, d):
            raise ValueError(f"StaticTopK needs int8 screen rows of shape {(V, d)}")
        if not 1 <= k <= capacity < V:
            raise ValueError(f"need 1 <= k <= capacity < V, got k={k}, capacity={capacity}, V={V}")
        self.weight, self.k, self.capacity, self.vocab_size = weight.detach(), int(k), int(capacity), V
        if temperature is not None and not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
        self.temperature = None if temperature in (None, 1.0) else float(temperature)
        self.rows, self.q, self.scale = rows, rows.q, rows.scale
        self.abs_l1 = rows.abs_l1 * (1 + 1e-6)
        self.l1_max = float(self.abs_l1.max()) * (1 + 1e-6)
        self.gam = gamma(d + 2)
        self.screen, self.screen_key = screen, None
        if screen is not None:
            if getattr(screen, "rows", None) is not rows or getattr(screen, "bias", None) is not None:
                raise ValueError("StaticTopK's screen must be the bias-free screen provider of the given rows")
            self.screen_key = id(screen)
            _PROVIDERS[self.screen_key] = screen
        self.int8pack = screen is None and _has_int8pack(weight.device)
        self.deq: Optional[torch.Tensor] = None if self.int8pack or screen is not None else rows.dequantize()
        self.suppress = None
        if suppress is not None and suppress.numel():
            self.suppress = torch.zeros(V, dtype=torch.bool, device=weight.device)
            ids = suppress.to(weight.device).long()
            self.suppress[ids[(ids >= 0) & (ids < V)]] = True  # (stock's isin ignores ids outside the vocabulary)
            if int((~self.suppress).sum()) < k:
                raise ValueError("fewer than k tokens are left outside the suppressed set")
        z = torch.zeros((), dtype=torch.int64, device=weight.device)
        self.rows_seen, self.rows_certified, self.subvocab_sum = z.clone(), z.clone(), z.clone()

    def counters(self) -> tuple[int, int, int]:
        return int(self.rows_seen), int(self.rows_certified), int(self.subvocab_sum)

    def _screen(self, Hf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The estimate and upper bounds U >= the real logit for every token (§1.1)."""
        if self.screen_key is not None:
            return screen_bounds(Hf, self.screen_key)
        if self.int8pack:
            # Σ_j q_ij h_j accumulated in fp32, then one product with s_i: within γ_{d+1}·||Ŵ_i||_1·||h||_∞ of
            # <Ŵ_i, h>, inside the γ_{d+2} term below
            est = torch._weight_int8pack_mm(Hf, self.q, self.scale)
        else:
            est = Hf @ self.deq.T
        # (+4u·||Ŵ_i||_1·||h||_∞: the rounding of est + rad, as the screen provider adds it)
        hinf = Hf.abs().amax(dim=1, keepdim=True)
        upper = torch.add(est, weight_only_radius(self.rows, Hf))
        return est, upper.addcmul_(self.rows.l1, hinf * (4 * unit_roundoff()))

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        lead, d = hidden.shape[:-1], hidden.shape[-1]
        H = hidden.reshape(-1, d)
        if H.dtype != self.weight.dtype:
            H = H.to(self.weight.dtype)
        Hf = H.float()
        N = Hf.shape[0]
        est, U = self._screen(Hf)
        fin = torch.isfinite(Hf).all(1) & torch.isfinite(U).all(1)
        if self.suppress is not None:  # tokens every step sets to -inf: neither seeds nor competitors
            est = est.masked_fill(self.suppress, float("-inf"))
            U = U.masked_fill(self.suppress, float("-inf"))
        hinf = Hf.abs().amax(1)
        fin = fin & (hinf >= H_MIN) & (hinf <= H_MAX)  # the proofs' range of ||h||_∞ (§2.4)
        und = (Hf.shape[1] + 2) * 2.0 ** -149  # an underflowing product's absolute error (§2.4)
        E = (self.gam * self.l1_max * hinf) * (1 + 1e-6) + und  # stock's accumulation error, any order (§2.0)
        seeds = est.topk(self.k, dim=1).indices  # [N, k]
        val = (self.weight[seeds].float() * Hf[:, None, :]).sum(-1)  # fp32 recompute, any order
        err = self.gam * self.abs_l1[seeds] * hinf[:, None] + und
        lo = _down(_down(val - err, 2) - E[:, None], 2).amin(1)  # <= stock's k-th largest accumulator
        if self.temperature is None:
            t, _ = _cut(lo, E, self.weight.dtype)
        else:  # a temperature warper divides before the top-k warper: keep the cut strict after it
            t, _ = _cut_order(lo, E, self.weight.dtype, self.temperature)
        count = (U >= t[:, None]).sum(1)
        ok = (count <= self.capacity) & fin & torch.isfinite(t)
        all_ok = ok.all()
        self.rows_seen.add_(N)
        W, C, V = self.weight, self.capacity, self.vocab_size

        # S = {U >= t} has at most C tokens when ok, so it lies within the C largest U (an upper set); their values
        # come from one op on all rows and the union of the candidate columns: within a slack of stock's, not
        # assumed equal (docs/certificates.md §2.0). Computed on every call (a C-column GEMV); the greedy argmax
        # must be decided within the slack, else the call takes the full head
        cand = U.topk(C, dim=1).indices  # [N, C]
        Wc = W[cand.reshape(-1)]
        own = torch.diagonal(F.linear(H, Wc).view(N, N, C), dim1=0, dim2=1).transpose(0, 1)  # row r's: [N, C]
        if self.k == 1:
            Wf = Wc.float()
            acc = own.float() if W.dtype == torch.float32 else \
                torch.diagonal(F.linear(Hf, Wf).view(N, N, C), dim1=0, dim2=1).transpose(0, 1)
            ad = torch.diagonal(F.linear(Hf.abs(), Wf.abs()).view(N, N, C), dim1=0, dim2=1).transpose(0, 1)
            slack = ((2 * self.gam * (1 + 2 * self.gam) * (1 + 1e-6)) * ad + 2 * und).amax(1)
            top = own.float().amax(1, keepdim=True)
            w = torch.where(own.float() == top, cand, V).amin(1, keepdim=True)  # argmax's token: the first of equal
            lo, hi = value_interval(acc, slack, W.dtype)
            ninf = torch.full_like(lo, float("-inf"))
            lo_w = torch.where(cand == w, lo, ninf).amax(1)
            decided = (lo_w > torch.where(cand < w, hi, ninf).amax(1)) & (lo_w >= torch.where(cand > w, hi, ninf).amax(1))
            all_ok = all_ok & decided.all()
        out_c = torch.full((N, V), float("-inf"), dtype=H.dtype, device=H.device).scatter(1, cand, own)
        self.rows_certified.add_(N * all_ok.long())
        self.subvocab_sum.add_(count.sum() * all_ok.long())

        def certified(H: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
            return o.clone()

        def full(H: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
            return F.linear(H, W)

        if torch.compiler.is_compiling():
            out = torch.cond(all_ok, certified, full, (H, out_c))
        else:
            out = out_c if bool(all_ok) else full(H, out_c)
        return out.view(*lead, V)
