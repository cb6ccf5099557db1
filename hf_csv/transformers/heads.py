"""The output head of a certified call: the head swap, the per-weight cache and the decline rule.

* **The head swap.** While a certified call runs, the model's output head (``lm_head`` / ``proj_out``) is
  :class:`hf_csv.transformers.step.CSVHead` (the step's entry from transformers: :func:`swapped_head`, through
  :func:`hf_csv.transformers.patches.swapped_module`, put back by the last concurrent call's exit, also when
  ``generate`` raises). For the session of the calling context (:func:`hf_csv.transformers.step.active_session`) it
  returns dense logits that are exact (fp32 accumulation of the head's own weights, cast to the model dtype) on a
  certified sub-vocabulary S and ``-inf`` outside it, where S is certified for the decoding method in play
  (docs/processors.md); in every other context (other threads, other calls, no session) it calls the original
  module, so its output is bitwise the stock output.
* **The per-weight cache.** :class:`HeadEntry` objects (the :class:`CertifiedHead`, whose int8 screen is the
  expensive part to build, the speed guard, the static heads) are cached per head module and per config key, so
  quantization happens once per model, and rebuilt when the weights change (:func:`head_entry`, :class:`WeightProbe`).
* **The decline rule.** :func:`head_decline_reason`: the one rule saying which head modules hf_csv certifies (a
  plain float ``nn.Linear``, nothing around its forward); any other head runs stock's head, with the reason.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import nn

from hf_csv.core.certificate import CertifiedHead
from hf_csv.core.config import CSVConfig
from hf_csv.core.errors import CSVError
from hf_csv.transformers.patches import installed, swapped_module
from hf_csv.transformers.session import CSVSession, _tlog
from hf_csv.transformers.step import CSVHead, activated

__all__ = ["swapped_head", "set_static_plan", "find_head", "model_out_dtype", "head_decline_reason",
           "HeadEntry", "WeightProbe", "get_certified_head", "head_entry", "forget_heads", "forget_kept_head"]

_LOCK = threading.RLock()  # the per-weight cache's
_HEADS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()  # head module -> {config key: entry}
# model -> its CSVHead, reused by later calls: a compiled forward guards on the head module's identity, so a fresh
# wrapper per call would recompile every call (kept off the model: its state_dict and __dict__ are unchanged)
_KEPT: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()


# ------------------------------------------------------------------ the head swap
@contextlib.contextmanager
def swapped_head(model: nn.Module, session: CSVSession) -> Iterator[CSVSession]:
    """Activate ``session`` for ``model`` in this context, with :class:`CSVHead` in the output head's place.

    The original head module is put back when the last concurrent session on the model exits, including on
    exceptions (:func:`hf_csv.transformers.patches.swapped_module`); the context variable is reset in every case.
    """
    name, inner = find_head(model)

    def make() -> CSVHead:
        kept = _KEPT.get(model)
        if not (isinstance(kept, CSVHead) and kept.inner is inner and kept._model_id == id(model)):
            kept = _KEPT[model] = CSVHead(inner, model)
        kept.static_plan = None
        return kept

    def restored(head: CSVHead) -> None:
        head.static_plan = None

    with swapped_module(model, "output head", name, inner, make, restored), activated(model, session):
        yield session


def forget_kept_head(model: nn.Module) -> None:
    """Drop the :class:`CSVHead` kept for ``model``'s compiled graphs (``hf_csv.disable``)."""
    _KEPT.pop(model, None)


def set_static_plan(model: nn.Module, plan: Any, own: bool) -> bool:
    """Make ``plan`` (a :class:`hf_csv.core.static.StaticTopK`, or None: stock's head) what a compiled forward of
    ``model`` traces and runs as its head. A graph reads no per-call state, so a plan is installed only while
    the calling session (``own``) is the only generate call active on the model; any other compiled caller
    (a second session, or a stock call while the head is swapped) sets stock's head for every caller until the
    last session exits. Returns whether ``plan`` was installed."""
    with installed(model, "output head") as swap:
        if swap is None:
            return False
        if not own or swap.users > 1:
            swap.state["shared_compile"] = True
        ok = plan is not None and not swap.state.get("shared_compile", False)
        swap.state["module"].static_plan = plan if ok else None
        return ok


def find_head(model: nn.Module) -> tuple[str, nn.Module]:
    """The attribute name and module of the model's output head (``lm_head`` or ``proj_out``), whatever its type:
    :func:`head_decline_reason` says whether hf_csv can certify it (a call on a head it cannot certify runs stock's
    head). Raises :class:`CSVError` only for a model with neither."""
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(out, CSVHead):
        out = out.inner
    for name in ("lm_head", "proj_out"):
        mod = model._modules.get(name)
        if isinstance(mod, CSVHead):
            mod = mod.inner
        if mod is not None and (out is None or mod is out):
            return name, mod
    raise CSVError(f"{type(model).__name__} has no lm_head/proj_out output head that hf_csv supports")


def model_out_dtype(model: nn.Module, head: nn.Module) -> torch.dtype:
    """The dtype the head's logits come in: its weight's float dtype (float32 for a head without a float weight)."""
    w = getattr(head, "weight", None)  # (a quantized Linear's weight is a method)
    return w.dtype if isinstance(w, torch.Tensor) and w.is_floating_point() else torch.float32


# ------------------------------------------------------------------ the decline rule
CERTIFIABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OFFLOADED = ("the output head is offloaded (device_map 'cpu'/'disk' offload): its weights are loaded only inside "
             "accelerate's hook")


def _plain(t: Optional[torch.Tensor]) -> bool:
    """A plain tensor (or a Parameter of one), or a DTensor (tensor parallel) whose local shard is one; None (no
    bias) too. A tensor subclass (torchao's quantized weights, a parametrization's output...) is not: its values
    are not the floats the screen would read."""
    if t is None or type(t) in (torch.Tensor, nn.Parameter):
        return True
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - old torch
        return False
    return isinstance(t, DTensor) and type(t.to_local()) in (torch.Tensor, nn.Parameter)


def _device_hooks_only(mod: nn.Module) -> bool:
    """Whether the module's accelerate hooks only move tensors between devices (``dispatch_model`` across devices:
    an ``AlignDevicesHook`` without offload around ``nn.Linear.forward``), which changes no value."""
    hook = mod.__dict__.get("_hf_hook")
    hooks = list(getattr(hook, "hooks", None) or []) if type(hook).__name__ == "SequentialHook" else [hook]
    if not hooks or any(type(h).__name__ != "AlignDevicesHook" or getattr(h, "offload", True) for h in hooks):
        return False
    old = mod.__dict__.get("_old_forward")
    return getattr(old, "__func__", None) is nn.Linear.forward and getattr(old, "__self__", None) is mod


def _parallel_code(fn: Any) -> bool:
    """Whether ``fn`` (a hook or a forward) is transformers' or torch.distributed's code (tensor parallelism)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    mod = getattr(getattr(fn, "__func__", fn), "__module__", None) or ""
    return mod.startswith(("transformers.", "torch.distributed."))


def _describe(mod: nn.Module) -> str:
    kind = type(mod)
    if kind.__module__.startswith("peft.") and hasattr(mod, "base_layer"):
        what = f"a peft {'LoRA ' if '.lora' in kind.__module__ else ''}{kind.__name__}"
        if getattr(mod, "merged", False):
            return (f"{what} holding a merged adapter (peft's wrapper computes it; merge_and_unload() gives a plain "
                    "nn.Linear, which hf_csv certifies)")
        return f"{what} (an unmerged adapter: W x + b + s B A x)"
    if "quantiz" in kind.__module__:
        return f"a quantized {kind.__module__}.{kind.__name__}"
    return f"a {kind.__module__}.{kind.__name__}, not nn.Linear"


def head_decline_reason(mod: Any, name: str = "lm_head") -> Optional[str]:
    """Why hf_csv cannot certify the output head module ``mod`` (the call then runs stock's head), or None.

    The certificate bounds ``W x + b`` for a plain float ``W`` and ``b`` (docs/certificates.md): a head is certified
    only when it is exactly that, i.e. ``type(mod) is nn.Linear`` (not a subclass, nor a wrapper such as peft's
    LoRA layer or a quantized Linear), its weight and bias plain tensors (or DTensor shards of them; not a tensor
    subclass such as torchao's quantized weights) of a float dtype hf_csv certifies, not on the meta device
    (offloaded), and nothing that could change its output runs around its forward: no forward hook or pre-hook
    (its own or global), no forward set on the instance, no accelerate hook other than a device move."""
    if isinstance(mod, CSVHead):
        mod = mod.inner
    if type(mod) is not nn.Linear:
        return f"{name} is {_describe(mod)}: hf_csv runs the full head (the screen bounds a plain nn.Linear only)"
    w, b = mod.weight, mod.bias
    for what, t in (("weight", w), ("bias", b)):
        if not _plain(t):
            return (f"{name}'s {what} is a {type(t).__module__}.{type(t).__name__} (a tensor subclass, e.g. "
                    "quantized weights), not a plain tensor: hf_csv runs the full head")
    if w.device.type == "meta" or (b is not None and b.device.type == "meta"):
        return OFFLOADED
    if w.dtype not in CERTIFIABLE_DTYPES or (b is not None and b.dtype not in CERTIFIABLE_DTYPES):
        return f"{name}'s weights are {w.dtype}, not float32/bfloat16/float16: hf_csv runs the full head"
    from torch.nn.modules import module as _m

    from hf_csv.core.distributed import local_shard_of

    # a head sharded by vocabulary (transformers' tensor parallelism: a row-sharded DTensor weight) comes with
    # transformers' (or torch.distributed's) forward or hooks gathering its output, which the vocabulary-parallel
    # head computes itself (hf_csv.core.distributed)
    tp = local_shard_of(w) is not None
    hooks = [*mod._forward_hooks.values(), *mod._forward_pre_hooks.values()]
    if _m._global_forward_hooks or _m._global_forward_pre_hooks or \
            (hooks and not (tp and all(map(_parallel_code, hooks)))):
        return f"{name} has forward hooks (they may change its output): hf_csv runs the full head"
    if "_hf_hook" in mod.__dict__ or "forward" in mod.__dict__:
        if not (_device_hooks_only(mod) or (tp and "_hf_hook" not in mod.__dict__
                                            and _parallel_code(mod.__dict__["forward"]))):
            hook = mod.__dict__.get("_hf_hook")
            what = f"an accelerate {type(hook).__name__}" if hook is not None else "a forward set on the instance"
            return f"{name} runs {what} (it may change its output): hf_csv runs the full head"
    return None


# ------------------------------------------------------------------ the per-weight cache
def _weight_key(head: nn.Linear) -> tuple:
    """What must be unchanged for a cached screen to stay valid: storage, shape, dtype and the tensors'
    version counters (bumped by every in-place write: ``optimizer.step()``, ``load_state_dict``,
    ``copy_``). Writes through ``.data`` bypass version counters: call :func:`hf_csv.refresh` then
    (:class:`WeightProbe` samples rows for them, docs/certificates.md §3.8)."""
    key = []
    for w in (head.weight, head.bias):
        if w is None:
            key.append(None)
            continue
        local = w.to_local() if hasattr(w, "to_local") else w  # DTensor (tensor parallel): its local shard
        key.append((local.data_ptr(), tuple(w.shape), w.dtype, local._version))
    return tuple(key)


PROBE_ROWS = 256  # head rows fingerprinted when a screen is built (at most: fewer when ids repeat, or V is small)
PROBE_PER_CALL = 64  # of them re-read by each call, in turn (all of them every PROBE_ROWS / PROBE_PER_CALL calls)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The rows' bytes as signed integers, int64 [rows, chunks]: int16 chunks for 2-byte floats, int32 otherwise."""
    x = x.detach().contiguous()
    size = x.element_size()
    view = torch.int8 if size == 1 else torch.int16 if size == 2 else torch.int32
    return x.view(view).to(torch.int64)


@dataclass
class WeightProbe:
    """A sampled check for head writes that bypass the version counter (through ``.data``: peft's LoRA merge does
    ``weight.data += delta``; ``_weight_key`` cannot see them).

    Each fingerprint is an exact integer, ``sum_j bits[r, j] * mult[j]`` with ``mult`` odd and below 2**12, so that
    it cannot overflow int64 (|bits| < 2**31, at most 2**17 chunks a row): a write that changes one element of a
    fingerprinted row always changes it, and a write to many elements leaves it equal only if the changes cancel.
    Limits: it reads PROBE_PER_CALL of PROBE_ROWS sampled rows per call, so a write to a few rows (or made while a
    call runs) can go unseen. It is a safety net, not part of the certificate: the rule stays, call
    :func:`hf_csv.refresh` after writing through ``.data``.
    """

    rows: torch.Tensor
    mult: torch.Tensor
    sums: torch.Tensor
    bias: Optional[torch.Tensor]
    turn: int = 0

    @staticmethod
    def _sums(rows_bits: torch.Tensor, mult: torch.Tensor) -> torch.Tensor:
        return (rows_bits * mult).sum(-1)

    @classmethod
    @torch.no_grad()
    def of(cls, head: nn.Linear) -> Optional["WeightProbe"]:
        """The probe of ``head``'s current weights; None for a sharded (DTensor) or meta weight. (No autograd, and
        detached weights: a probe built under ``inference_mode`` is read in grad mode by a later call.)"""
        w, b = head.weight.detach(), None if head.bias is None else head.bias.detach()
        if hasattr(w, "to_local") or w.device.type == "meta" or w.dim() != 2 or w.shape[0] == 0:
            return None
        g = torch.Generator().manual_seed(0x5EED)
        V = w.shape[0]
        rows = torch.randint(0, V, (PROBE_ROWS,), generator=g).unique().to(w.device)  # (sorted)
        bits = _bits(w[rows])
        mult = (torch.randint(0, 2 ** 11, (bits.shape[1],), generator=g) * 2 + 1).to(w.device)
        bias = None if b is None or hasattr(b, "to_local") else _bits(b[rows].reshape(-1, 1))[:, 0]
        return cls(rows=rows, mult=mult, sums=cls._sums(bits, mult), bias=bias)

    @torch.no_grad()
    def unchanged(self, head: nn.Linear) -> bool:
        """Whether this call's share of the sampled rows still holds the bytes the screen was built from."""
        n = len(self.rows)
        start = (self.turn % -(-n // PROBE_PER_CALL)) * PROBE_PER_CALL  # (all rows every ceil(n / 64) calls)
        self.turn += 1
        part = slice(start, min(start + PROBE_PER_CALL, n))
        rows = self.rows[part]
        if not torch.equal(self._sums(_bits(head.weight.detach()[rows]), self.mult), self.sums[part]):
            return False
        b = None if head.bias is None else head.bias.detach()
        if (b is None) != (self.bias is None):
            return False
        return b is None or torch.equal(_bits(b[rows].reshape(-1, 1))[:, 0], self.bias[part])


def forget_heads(head: nn.Module) -> None:
    """Drop the cached certified heads (screens) of ``head``: the next call rebuilds them."""
    with _LOCK:
        _HEADS.pop(head, None)


@dataclass
class HeadEntry:
    """What hf_csv keeps per head weight and config, never per call: the certified head, the key of the weights it
    was built from, the speed guard's timings (hf_csv.core.speed) and the compiled static heads (hf_csv.core.static). Calls
    share it (each piece is safe to share: the guard locks, a static head is read-only); nothing is attached to the
    certified head itself."""

    head: Any
    src_key: tuple
    guard: Any = None
    static_plans: dict = field(default_factory=dict)
    probe: Optional[WeightProbe] = None  # writes through .data (read under the cache's lock)


def get_certified_head(head: nn.Linear, config: CSVConfig):
    """The cached certified head for this head module and config (built once): a
    :class:`CertifiedHead`, or a :class:`hf_csv.core.distributed.VocabParallelHead` when the head is
    sharded by vocabulary (tensor parallel) or ``config.vocab_parallel`` is set."""
    return head_entry(head, config).head


def head_entry(head: nn.Linear, config: CSVConfig) -> HeadEntry:
    """The cached :class:`HeadEntry` of this head module and config (built on first use, rebuilt when the weights
    changed)."""
    key = config.head_key()
    with _LOCK:
        per = _HEADS.setdefault(head, {})
        entry = per.get(key)
        # the cache is keyed on the module; a changed or updated weight tensor invalidates it
        changed = entry is None or entry.src_key != _weight_key(head)
        stale = not changed and entry.probe is not None and not entry.probe.unchanged(head)
        if stale:
            _tlog(__name__).warning(
                "hf_csv: the head's weights changed without a version-counter bump (a write through .data, such as "
                "peft's merge_adapter or merge_and_unload): the screen is rebuilt. Call hf_csv.refresh(model) after "
                "such writes: this check reads a sample of rows and cannot see every write.")
        if changed or stale:
            art, index = _artifact_of(config)
            from hf_csv.core.distributed import local_shard_of

            if (art or index) is not None and local_shard_of(head.weight) is None:
                # any artifact given must be the one built for this head, whatever the provider
                (art or index).check_head(head.weight.detach(), None if head.bias is None else head.bias.detach())
            try:
                if config.vocab_parallel is not None or local_shard_of(head.weight) is not None:
                    ch = _vocab_parallel_head(head, config, index)
                else:
                    kw = {}
                    if config.provider == "screen":
                        # a large head is packed in the background; its first steps use the full head meanwhile
                        kw = {"num_outliers": config.num_outliers, "quant": config.screen_quant, "background": True}
                        if art is not None and art.screen is not None and art.screen.quant == config.screen_quant:
                            # skip the quantization: the stored codes, error terms recomputed from this head
                            # (its columns were calibrated on a dummy input: re-chosen from the first 8 real rows)
                            kw.update(rows=art.screen.rows_for(head.weight), outlier_cols=art.screen.outlier_cols,
                                      recalibrate=True)
                    elif index is None:
                        raise CSVError("provider='cluster' needs a cluster index; this artifact has none "
                                       "(hf-csv build --index)")
                    ch = CertifiedHead(head.weight, head.bias, provider=config.provider, index=index,
                                       budget=config.budget, **kw)
            except BaseException:
                if art is not None:  # a damaged file is reported as such, not as what it broke
                    art.wait_verified()
                raise
            if art is not None:
                art.wait_verified()  # its sha256 ran beside the recompute (CSVArtifact.from_pretrained)
            from hf_csv.core.speed import MIN_WEIGHTS, SpeedGuard

            guarded = isinstance(ch, CertifiedHead) and head.weight.numel() >= MIN_WEIGHTS and SpeedGuard.enabled()
            # (the guard: never slower than stock, hf_csv.core.speed)
            entry = per[key] = HeadEntry(head=ch, src_key=_weight_key(head), guard=SpeedGuard() if guarded else None,
                                         probe=WeightProbe.of(head))
    return entry


def _artifact_of(config: CSVConfig) -> tuple:
    """(artifact or None, cluster index or None) from ``config.index``: a directory or Hub repo id, a
    :class:`hf_csv.hub.artifact.CSVArtifact`, or a :class:`hf_csv.core.index.VocabIndex`."""
    index = config.index
    if index is None:
        return None, None
    if not hasattr(index, "check_head"):
        from hf_csv.hub.artifact import CSVArtifact

        index = CSVArtifact.from_pretrained(index, revision=config.revision, defer_verify=True)
    if hasattr(index, "screen"):  # a CSVArtifact
        return index, index.index
    return None, index


def _vocab_parallel_head(head: nn.Linear, config: CSVConfig, index: Any):
    import torch.distributed as dist

    from hf_csv.core.distributed import VocabParallelHead, local_shard_of, shard_tokens

    if not (dist.is_available() and dist.is_initialized()):
        raise CSVError("CSVConfig(vocab_parallel=...) needs an initialized torch.distributed process group "
                       "(torchrun, or torch.distributed.init_process_group)")
    V = head.weight.shape[0]
    sh = local_shard_of(head.weight)
    bias = head.bias
    if sh is not None:  # transformers' tensor-parallel plan sharded lm_head by rows: use it as is
        rows, start = sh
        ids = torch.arange(start, start + rows.shape[0], device=rows.device)
        if bias is not None:
            bias = bias.to_local() if hasattr(bias, "to_local") else bias[ids]
    else:
        ids = shard_tokens(V, dist.get_world_size(), config.vocab_parallel, index)[dist.get_rank()]
        ids = ids.to(head.weight.device)
        contiguous = ids.numel() == 0 or int(ids[-1] - ids[0]) + 1 == ids.numel()
        rows = head.weight.detach()[int(ids[0]):int(ids[-1]) + 1] if contiguous and ids.numel() else \
            head.weight.detach().index_select(0, ids)
        if bias is not None:
            bias = bias.detach()[ids]
    if config.provider != "screen":
        _tlog(__name__).info("hf_csv: the vocabulary-parallel head uses the screen provider on each shard")
    return VocabParallelHead(rows, ids, V, bias_rows=bias, budget=config.budget, num_outliers=config.num_outliers)
