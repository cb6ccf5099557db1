"""The head's weights: the certified head built from them (:func:`build_head`), when a screen built from them is
stale (:func:`weight_key`, with the count of the served model's ``load_weights`` calls that :func:`loads_wrapper`
keeps), and whether they are finite (:func:`weights_finite`). No vLLM import."""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from hf_csv.core.certificate import CertifiedHead

__all__ = ["build_head", "weight_key", "loads_wrapper", "weights_finite"]

# bumped after every ``load_weights`` call on a served model (loads_wrapper): vLLM writes reloaded weights into the
# same storage, through ``.data`` (no version counter bump), so a load is what tells a screen it may be stale
_LOADS = [0]


def build_head(weight: torch.Tensor, artifact: Optional[str] = None) -> CertifiedHead:
    """The certified head of ``weight`` [V, d] as vLLM's worker needs it: on the caller's thread count (vLLM's CPU
    worker owns it: its ``torch.set_num_threads`` is a no-op that warns), a large head packed in the background
    (vLLM's head meanwhile) unless ``hf_csv.vllm.layer.prebuild`` packed it at model load. ``artifact``: an
    ``hf-csv build`` directory or Hub repo id whose stored screen skips the quantization; it must have been built for
    this head (checked: a mismatch raises, as in ``generate``)."""
    kw: dict = {"background": True}
    if artifact:
        from hf_csv.hub.artifact import CSVArtifact

        art = CSVArtifact.from_pretrained(artifact)
        art.check_head(weight, None)
        if art.screen is not None and art.screen.quant == "int8":
            # the stored codes; error terms recomputed from this head, columns re-chosen from the first real rows
            kw.update(rows=art.screen.rows_for(weight), outlier_cols=art.screen.outlier_cols, recalibrate=True)
        head = CertifiedHead(weight, tune_threads=False, **kw)
        art.wait_verified()  # its sha256 ran beside the load
        return head
    return CertifiedHead(weight, tune_threads=False, **kw)


def weight_key(w: torch.Tensor, rows: int) -> tuple:
    """What must be unchanged for a screen (or a subset-kernel probe) of the head's first ``rows`` rows to stay
    valid: storage, shape, dtype, the version counter (bumped by an in-place write such as a kernel-format reload's
    ``param.copy_``) and the count of ``load_weights`` calls since the model was loaded (vLLM's ``reload_weights``,
    or a weight sync that calls the model's ``load_weights``, copies the new weights into the same storage through
    ``.data``: without it the old head's screen would certify the new head's rows). Writes that take neither path
    (a caller's own ``.data`` edit) are not seen: rebuild the engine then. An inference tensor has no counter."""
    try:
        version = w._version
    except RuntimeError:  # an inference tensor
        version = None
    return (w.data_ptr(), tuple(w.shape), w.dtype, rows, version, _LOADS[0])


def loads_wrapper(load_weights):
    """``load_weights`` (a served model instance's) counting its calls in :func:`weight_key`."""
    @functools.wraps(load_weights)
    def load_weights_with_hf_csv(*args, **kwargs):
        try:
            return load_weights(*args, **kwargs)
        finally:
            _LOADS[0] += 1  # (also after a failed load: it may have written some weights)
    load_weights_with_hf_csv.__hf_csv_wrapped__ = load_weights
    return load_weights_with_hf_csv


def weights_finite(layer: Any, w: torch.Tensor) -> bool:
    """Whether the head's weights are all finite (a NaN or infinite weight leaves no bound: vLLM's head then),
    checked once per :func:`weight_key` of the head."""
    key = weight_key(w, w.shape[0])
    got = getattr(layer, "_hf_csv_finite", None)
    if got is None or got[0] != key:
        # by blocks of rows: no V×d bool tensor (its first touch cost a first step 0.6 s on SmolLM2)
        got = layer._hf_csv_finite = (key, all(bool(torch.isfinite(c).all()) for c in w.detach().split(4096)))
    return got[1]
