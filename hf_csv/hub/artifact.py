"""The hf_csv artifact: what a head needs so that the first certified call costs a load, not a build.

One directory (or Hub model repository), in the style of ``ModelHubMixin`` / peft — a JSON config plus
safetensors:

* ``csv_artifact.json`` — :class:`ArtifactConfig`: format version, the head's shape, dtype and
  fingerprint, which parts are present, the sha256 of each tensor file, build figures;
* ``csv_screen.safetensors`` — the int8 (or fp8) screen: per-row codes ``q`` [V, d], ``scale`` [V], the
  error terms ``err_l2`` / ``l1`` / ``abs_l1`` [V] and the ``outlier_cols`` of h kept exact;
* ``csv_index.safetensors`` — the paper's FAISS cluster index (:class:`hf_csv.core.index.VocabIndex`),
  optional: sound, but it opens almost all of V on real heads;
* ``README.md`` — a model card (:func:`hf_csv.hub.transport.write_model_card`).

Trust: a loaded screen is never trusted for soundness. Loading checks the sha256 of each file and the
head's fingerprint, then :func:`hf_csv_kernels.quantize.rows_from_codes` recomputes every error term
from the live head's weights and the stored codes. The stored terms only serve to detect a screen
built for another head (any term larger than stored: :class:`~hf_csv.core.errors.FingerprintMismatchError`);
whatever the file holds, the bounds used are those recomputed, so no file can make a certificate wrong.

Format 1 (``csv_index_config.json`` + ``csv_index.safetensors``, index only) still loads.
Imports run one way: ``artifact`` -> ``index`` and ``hub`` (transport); neither imports this module.
This module does not import transformers.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors.torch import load_file, save_file

from hf_csv_kernels.quantize import Int8Rows, gamma, quantize_rows_fp8, quantize_rows_int8, rows_from_codes

from hf_csv.hub import transport as hub
from hf_csv.core.errors import FingerprintMismatchError, IndexFormatError
from hf_csv.core.index import IndexConfig, VocabIndex, check_head_identity, head_fingerprint

logger = logging.getLogger(__name__)

__all__ = ["ArtifactConfig", "CSVArtifact", "ScreenData", "CONFIG_NAME", "SCREEN_NAME", "INDEX_NAME",
           "FORMAT_VERSION", "ARTIFACT_FILES"]

FORMAT_VERSION = 2
CONFIG_NAME = "csv_artifact.json"
SCREEN_NAME = "csv_screen.safetensors"
INDEX_NAME = "csv_index.safetensors"
LEGACY_CONFIG_NAME = "csv_index_config.json"  # format 1: an index only
ARTIFACT_FILES = [CONFIG_NAME, SCREEN_NAME, INDEX_NAME, LEGACY_CONFIG_NAME, "README.md"]
_SCREEN_KEYS = ("q", "scale", "err_l2", "l1", "abs_l1", "outlier_cols")
# stored error terms may exceed the recomputed ones by the recompute's rounding margins only
_TERM_SLACK = 1e-3


# ------------------------------------------------------------- config schema
# Every field the loader reads, with its JSON type (and range): a damaged or hand-edited config raises
# IndexFormatError naming the field, the expected type and what was found, never a raw TypeError.
_JSON_TYPE = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
              float: "a number", type(None): "null"}


def _int_at_least(lo: int) -> tuple:
    return (lambda v: type(v) is int and v >= lo), f"an integer >= {lo}"


def _one_of(*vals: str) -> tuple:
    return (lambda v: isinstance(v, str) and v in vals), "one of " + ", ".join(repr(v) for v in vals)


_INT = ((lambda v: type(v) is int), "an integer")
_STR = ((lambda v: isinstance(v, str)), "a string")
_OPT_STR = ((lambda v: v is None or isinstance(v, str)), "a string or null")
_BOOL = ((lambda v: isinstance(v, bool)), "a boolean")
_OBJ = ((lambda v: isinstance(v, dict)), "an object")
_OPT_OBJ = ((lambda v: v is None or isinstance(v, dict)), "an object or null")
_SHA = ((lambda v: isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)),
        "a sha256 (64 lowercase hex digits)")
_OPT_SHA = ((lambda v: v is None or _SHA[0](v)), "a sha256 (64 lowercase hex digits) or null")

# name -> (check, expected, required); the dataclasses' defaults apply to optional fields left out
_ARTIFACT_SCHEMA = {
    "vocab_size": (*_int_at_least(1), True), "hidden_size": (*_int_at_least(1), True),
    "fingerprint": (*_STR, True), "head_dtype": (*_STR, False), "has_bias": (*_BOOL, False),
    "base_model": (*_OPT_STR, False), "format_version": (*_int_at_least(1), False), "screen": (*_OPT_OBJ, False),
    "index": (*_OPT_OBJ, False), "sha256": (*_OBJ, False), "stats": (*_OBJ, False)}
_SCREEN_SCHEMA = {"quant": (*_one_of("int8", "fp8"), False), "num_outliers": (*_int_at_least(0), False)}
_INDEX_SCHEMA = {
    "vocab_size": (*_int_at_least(1), True), "hidden_size": (*_int_at_least(1), True),
    "num_clusters": (*_int_at_least(1), True), "metric": (*_one_of("euclidean", "spherical"), False),
    "niter": (*_int_at_least(1), False), "seed": (*_INT, False), "top_m_bias": (*_int_at_least(0), False),
    "has_bias": (*_BOOL, False), "fingerprint": (*_STR, False), "head_dtype": (*_STR, False),
    "base_model": (*_OPT_STR, False), "format_version": (*_int_at_least(1), False),
    "tensors_sha256": (*_OPT_SHA, False), "stats": (*_OBJ, False)}


def _found(v: Any) -> str:
    r = repr(v)
    return f"{_JSON_TYPE.get(type(v), type(v).__name__)} {r if len(r) <= 40 else r[:37] + '...'}"


def _check_fields(where: str, raw: Any, schema: dict) -> None:
    """IndexFormatError unless ``raw`` is a JSON object whose fields in ``schema`` have their type; unknown
    fields are left to the caller (logged and ignored)."""
    if not isinstance(raw, dict):
        raise IndexFormatError(f"{where} must be a JSON object, found {_found(raw)}")
    for name, (ok, expected, required) in schema.items():
        if name not in raw:
            if required:
                raise IndexFormatError(f"{where}: field {name!r} is missing (expected {expected})")
        elif not ok(raw[name]):
            raise IndexFormatError(f"{where}: field {name!r} must be {expected}, found {_found(raw[name])}")


def _validate_config(cpath: Path, raw: Any) -> None:
    """Check every field of a ``csv_artifact.json`` (and its nested ``screen``, ``index`` and ``sha256``)."""
    _check_fields(str(cpath), raw, _ARTIFACT_SCHEMA)
    if raw.get("screen") is not None:
        _check_fields(f"{cpath}: field 'screen'", raw["screen"], _SCREEN_SCHEMA)
    if raw.get("index") is not None:
        _check_fields(f"{cpath}: field 'index'", raw["index"], _INDEX_SCHEMA)
        unknown = set(raw["index"]) - set(IndexConfig.__dataclass_fields__)
        if unknown:
            raise IndexFormatError(f"{cpath}: field 'index' has unknown fields {sorted(unknown)}")
    for name, sha in raw.get("sha256", {}).items():
        if not _SHA[0](sha):
            raise IndexFormatError(f"{cpath}: field 'sha256.{name}' must be {_SHA[1]}, found {_found(sha)}")
    for name, part in ((SCREEN_NAME, "screen"), (INDEX_NAME, "index")):
        if name in raw.get("sha256", {}) and raw.get(part) is None:
            raise IndexFormatError(f"{cpath}: a {part} file ({name}) without its {part!r} entry")


def _read_json(cpath: Path, what: str) -> Any:
    try:
        return json.loads(cpath.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise IndexFormatError(f"{cpath} is not a valid {what}: {type(e).__name__}: {e}") from e


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_hashes(jobs: list) -> None:
    """Join the sha256 threads of :meth:`CSVArtifact._read`; IndexFormatError on a mismatch."""
    for th, box, fpath, sha in jobs:
        th.join()
        if box.get("error") is not None:
            raise IndexFormatError(f"cannot hash {fpath}: {box['error']}")
        if box.get("sha") != sha:
            raise IndexFormatError(f"{fpath} is corrupt or truncated: sha256 {box.get('sha')} != recorded {sha}")


@dataclass
class ArtifactConfig:
    """Identity and contents of a :class:`CSVArtifact` (saved as ``csv_artifact.json``)."""

    vocab_size: int
    hidden_size: int
    fingerprint: str
    head_dtype: str = "float32"
    has_bias: bool = False
    base_model: Optional[str] = None
    format_version: int = FORMAT_VERSION
    screen: Optional[dict] = None  # {"quant": "int8"|"fp8", "num_outliers": k}
    index: Optional[dict] = None  # the IndexConfig of the cluster index, when present
    sha256: dict = field(default_factory=dict)  # file name -> sha256
    stats: dict = field(default_factory=dict)


@dataclass
class ScreenData:
    """The stored screen: codes, scales, the stored error terms and the outlier columns."""

    quant: str
    tensors: dict  # _SCREEN_KEYS -> tensor

    def rows_for(self, weight: torch.Tensor) -> Int8Rows:
        """The screen rows for the live head ``weight``, with every error term recomputed from it.

        Raises :class:`FingerprintMismatchError` when a recomputed term exceeds the stored one by more
        than rounding: these codes were not made from this head (or the file was altered)."""
        t = self.tensors
        dev = weight.device
        try:
            rows = rows_from_codes(weight.detach(), t["q"].to(dev), t["scale"].to(dev))
        except ValueError as e:  # codes or scales no head could have produced (altered, or hostile)
            raise IndexFormatError(f"the stored screen is not valid: {e}") from e
        # the stored terms may come from the C quantizer's float64 sums and the recompute from the float32 pass (a
        # host without the C kernel), which is looser by up to its margin γ_{d+3} (hf_csv_kernels.quantize)
        slack = _TERM_SLACK + 2 * gamma(weight.shape[1] + 3)
        for k in ("err_l2", "l1", "abs_l1"):
            stored = t[k].to(dev)
            got = getattr(rows, k)
            bad = got > stored * (1 + slack) + 1e-30
            if k == "err_l2":  # near-exact rows: the recompute's absolute margin 3u·||ŵ||_1 dominates
                bad &= rows.err_l2 > stored + 4 * torch.finfo(torch.float32).eps * rows.l1
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise FingerprintMismatchError(
                    f"the stored screen does not fit this head: row {i} has {k} {float(got[i]):.6g} "
                    f"> stored {float(stored[i]):.6g} ({int(bad.sum())} rows): built for another head, or altered")
        return rows

    @property
    def outlier_cols(self) -> Optional[torch.Tensor]:
        c = self.tensors["outlier_cols"]
        return c.long() if c.numel() else None


def _looks_like_path(name: str) -> bool:
    """A local path rather than a Hub id: Hub ids are ``NAME`` or ``ORG/NAME``, with no leading ``.``/``/``/``~``,
    no backslash and at most one ``/``."""
    return (name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1 or name.endswith("/")
            or (len(name) > 1 and name[1] == ":"))


class CSVArtifact:
    """A head's screen and (optionally) cluster index, with ``save_pretrained`` / ``from_pretrained`` /
    ``push_to_hub``. Use it through ``CSVConfig(index=DIR_OR_REPO)``: the head then skips quantization."""

    def __init__(self, config: ArtifactConfig, screen: Optional[ScreenData] = None,
                 index: Optional[VocabIndex] = None):
        if config.format_version > FORMAT_VERSION:
            raise IndexFormatError(f"artifact format {config.format_version} is newer than this hf_csv ({FORMAT_VERSION})")
        self._pending: list = []  # sha256 checks still running (from_pretrained(defer_verify=True))
        V, d = config.vocab_size, config.hidden_size
        if screen is not None:
            missing = [k for k in _SCREEN_KEYS if k not in screen.tensors]
            if missing:
                raise IndexFormatError(f"screen tensors missing: {missing}")
            t = screen.tensors
            expect = {"q": (V, d), "scale": (V,), "err_l2": (V,), "l1": (V,), "abs_l1": (V,)}
            for k, shape in expect.items():
                if tuple(t[k].shape) != shape:
                    raise IndexFormatError(f"screen tensor {k!r} has shape {tuple(t[k].shape)}, expected {shape}")
            if t["q"].dtype not in (torch.int8, getattr(torch, "float8_e4m3fn", torch.int8)):
                raise IndexFormatError(f"screen codes have dtype {t['q'].dtype}, expected int8 or float8_e4m3fn")
            for k in ("scale", "err_l2", "l1", "abs_l1"):
                v = t[k]
                if v.dtype != torch.float32:
                    raise IndexFormatError(f"screen tensor {k!r} has dtype {v.dtype}, expected float32")
                if not bool((torch.isfinite(v) & (v >= 0)).all()):
                    raise IndexFormatError(f"screen tensor {k!r} holds negative, NaN or infinite values")
            oc = t["outlier_cols"]
            if oc.dtype not in (torch.int64, torch.int32, torch.int16):
                raise IndexFormatError(f"screen outlier columns have dtype {oc.dtype}, expected an integer type")
            if oc.dim() == 1 and oc.numel() != torch.unique(oc).numel():
                raise IndexFormatError("screen outlier columns must be distinct")
            if oc.dim() != 1 or (oc.numel() and (int(oc.min()) < 0 or int(oc.max()) >= d)):
                raise IndexFormatError(f"screen outlier columns must be a 1-d tensor of indices in [0, {d})")
        if index is not None and (index.config.vocab_size, index.config.hidden_size) != (V, d):
            raise IndexFormatError("the cluster index and the artifact disagree on the head's shape")
        self.config, self.screen, self.index = config, screen, index

    def __repr__(self) -> str:
        c = self.config
        parts = [p for p, have in (("screen", self.screen), ("index", self.index)) if have is not None]
        return f"CSVArtifact(V={c.vocab_size}, d={c.hidden_size}, parts={parts}, fingerprint={c.fingerprint!r})"

    # ---------------------------------------------------------------- build
    @classmethod
    @torch.no_grad()
    def build(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *, screen: bool = True,
              quant: str = "int8", outlier_cols: Optional[torch.Tensor] = None, index: bool = False,
              base_model: Optional[str] = None, progress: bool = True, **index_kwargs: Any) -> "CSVArtifact":
        """Quantize the head into a screen (and, with ``index=True``, cluster it with FAISS).

        ``outlier_cols``: the columns of h to keep exact (from calibration hidden states, see
        ``hf-csv build``); ``None`` leaves the choice to the first call, which costs a prepack then."""
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"weight must be a floating [V, d] tensor, got {tuple(weight.shape)} {weight.dtype}")
        V, d = weight.shape
        cfg = ArtifactConfig(vocab_size=V, hidden_size=d, fingerprint=head_fingerprint(weight, bias),
                             head_dtype=str(weight.dtype).replace("torch.", ""), has_bias=bias is not None,
                             base_model=base_model)
        sd = None
        if screen:
            if quant not in ("int8", "fp8"):
                raise ValueError(f"screen quant must be 'int8' or 'fp8', got {quant!r}")
            r = (quantize_rows_int8 if quant == "int8" else quantize_rows_fp8)(weight.detach())  # as ScreenProvider
            oc = (torch.zeros(0, dtype=torch.long) if outlier_cols is None
                  else outlier_cols.detach().to("cpu", torch.long).sort().values)
            sd = ScreenData(quant, {"q": r.q, "scale": r.scale, "err_l2": r.err_l2, "l1": r.l1,
                                    "abs_l1": r.abs_l1, "outlier_cols": oc})
            cfg.screen = {"quant": quant, "num_outliers": int(oc.numel())}
        ix = None
        if index:
            ix = VocabIndex.build(weight, bias, base_model=base_model, progress=progress, **index_kwargs)
            cfg.index = asdict(ix.config)
        return cls(cfg, sd, ix)

    # ------------------------------------------------------------- identity
    def check_head(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        """Raise :class:`FingerprintMismatchError` unless this artifact was built for a head of this
        shape and fingerprint (the screen's rows are checked in full by :meth:`ScreenData.rows_for`)."""
        check_head_identity("artifact", self.config, weight, bias)

    def describe(self) -> dict:
        """What the artifact holds and its sizes (``hf-csv inspect``)."""
        out = {"config": asdict(self.config), "parts": {}}
        if self.screen is not None:
            out["parts"]["screen"] = {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", ""),
                                          "bytes": v.numel() * v.element_size()} for k, v in self.screen.tensors.items()}
        if self.index is not None:
            out["parts"]["index"] = {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", ""),
                                         "bytes": v.numel() * v.element_size()} for k, v in self.index.tensors.items()}
        out["total_bytes"] = sum(t["bytes"] for p in out["parts"].values() for t in p.values())
        return out

    # ---------------------------------------------------------- save / load
    def save_pretrained(self, save_directory: Union[str, os.PathLike], **card_kwargs: Any) -> Path:
        """Write the config, the tensor files (with their sha256) and a model card."""
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"format": "pt", "hf_csv_format": str(FORMAT_VERSION), "fingerprint": self.config.fingerprint}
        self.config.sha256 = {}
        parts = ((SCREEN_NAME, self.screen.tensors if self.screen else None),
                 (INDEX_NAME, self.index.tensors if self.index else None))
        for name, tensors in parts:
            if tensors is None:
                continue
            tmp = out / (name + ".tmp")
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
            os.replace(tmp, out / name)
            self.config.sha256[name] = _sha256(out / name)
        (out / CONFIG_NAME).write_text(json.dumps(asdict(self.config), indent=2, sort_keys=True) + "\n")
        hub.write_model_card(out, self.config, **card_kwargs)
        return out

    @classmethod
    def from_pretrained(cls, pretrained: Union[str, os.PathLike], revision: Optional[str] = None,
                        verify: bool = True, defer_verify: bool = False, **hub_kwargs: Any) -> "CSVArtifact":
        """Load from a local directory, or from the Hub (``revision`` pinned; huggingface_hub's cache).

        ``verify`` checks each file's sha256 against the config (in a thread, while the file is read). With
        ``defer_verify`` the check is still running when this returns: call :meth:`wait_verified` before trusting
        the files (hf_csv's head does, before it hands out a head built from them; the screen's error terms are
        recomputed from the live head anyway, so soundness never rests on the files)."""
        path = Path(pretrained).expanduser()
        if not path.is_dir():
            if _looks_like_path(str(pretrained)) or path.exists():
                # a mistyped local path would otherwise surface as a Hub error naming neither the path nor CSVConfig
                raise IndexFormatError(
                    f"no artifact at {str(pretrained)!r}: " + ("a file, not an artifact directory" if path.exists()
                                                              else "no such directory") +
                    " (CSVConfig(index=...) takes a local artifact directory or a Hub repo id ORG/NAME)")
            path = Path(hub.download(str(pretrained), ARTIFACT_FILES, revision=revision, **hub_kwargs))
        art = cls._load_dir(path, verify=verify)
        if not defer_verify:
            art.wait_verified()
        return art

    def wait_verified(self) -> None:
        """Wait for the sha256 checks started by :meth:`from_pretrained`; raise IndexFormatError on a mismatch."""
        pending, self._pending = self._pending, []
        _check_hashes(pending)

    @classmethod
    def _load_dir(cls, path: Path, verify: bool = True) -> "CSVArtifact":
        cpath = path / CONFIG_NAME
        if not cpath.is_file():
            if (path / LEGACY_CONFIG_NAME).is_file():
                return cls._load_legacy(path, verify)
            raise IndexFormatError(f"not an hf_csv artifact: {CONFIG_NAME} missing in {path}")
        raw = _read_json(cpath, "artifact config")
        _validate_config(cpath, raw)
        known = set(ArtifactConfig.__dataclass_fields__)
        if set(raw) - known:
            logger.warning("ignoring unknown artifact config keys: %s", sorted(set(raw) - known))
        config = ArtifactConfig(**{k: v for k, v in raw.items() if k in known})
        screen = index = None
        pending: list = []
        for name in (SCREEN_NAME, INDEX_NAME):
            if name not in config.sha256:
                continue
            tensors = cls._read(path / name, config.sha256[name], verify, pending)
            if name == SCREEN_NAME:
                screen = ScreenData(config.screen.get("quant", "int8"), tensors)
            else:
                try:
                    index = VocabIndex(IndexConfig(**config.index), tensors)
                except IndexFormatError:
                    raise
                except (TypeError, ValueError) as e:  # e.g. more clusters than rows
                    raise IndexFormatError(f"{cpath}: bad index entry: {e}") from e
        art = cls(config, screen, index)
        art._pending = pending
        return art

    @staticmethod
    def _read(fpath: Path, sha: str, verify: bool, pending: Optional[list] = None) -> dict:
        """The file's tensors; with ``verify`` its sha256 is computed in a thread (hashlib releases the GIL) and
        appended to ``pending`` for :meth:`wait_verified`, or checked here when ``pending`` is None."""
        if not fpath.is_file():
            raise IndexFormatError(f"{fpath.name} missing in {fpath.parent}")
        job = None
        if verify:
            box: dict = {}

            def run() -> None:
                try:
                    box["sha"] = _sha256(fpath)
                except Exception as e:  # noqa: BLE001 - reported by wait_verified
                    box["error"] = e

            th = threading.Thread(target=run, name="hf_csv-artifact-sha256")
            th.start()
            job = (th, box, fpath, sha)
        try:
            tensors = load_file(str(fpath))
        except Exception as e:  # safetensors raises several types for damaged files
            if job is not None:
                job[0].join()
                if job[1].get("sha") not in (None, sha):  # say "corrupt" when the hash says so
                    raise IndexFormatError(f"{fpath} is corrupt or truncated: sha256 {job[1]['sha']} != recorded "
                                           f"{sha}") from e
            raise IndexFormatError(f"cannot read {fpath}: {e}") from e
        if job is not None:
            if pending is None:
                _check_hashes([job])
            else:
                pending.append(job)
        return tensors

    @classmethod
    def _load_legacy(cls, path: Path, verify: bool) -> "CSVArtifact":
        cpath = path / LEGACY_CONFIG_NAME
        raw = _read_json(cpath, "index config")
        _check_fields(str(cpath), raw, _INDEX_SCHEMA)
        known = set(IndexConfig.__dataclass_fields__)
        ic = IndexConfig(**{k: v for k, v in raw.items() if k in known})
        tensors = cls._read(path / INDEX_NAME, ic.tensors_sha256, verify and bool(ic.tensors_sha256))
        try:
            ix = VocabIndex(ic, tensors)
        except IndexFormatError:
            raise
        except (TypeError, ValueError) as e:
            raise IndexFormatError(f"{cpath} is not a valid index config: {e}") from e
        cfg = ArtifactConfig(vocab_size=ic.vocab_size, hidden_size=ic.hidden_size, fingerprint=ic.fingerprint,
                             head_dtype=ic.head_dtype, has_bias=ic.has_bias, base_model=ic.base_model,
                             format_version=1, index=asdict(ic), stats=dict(ic.stats))
        return cls(cfg, None, ix)

    def push_to_hub(self, repo_id: str, revision: Optional[str] = None, commit_message: Optional[str] = None,
                    extra_folders: Optional[dict] = None, **kwargs: Any) -> Any:
        """Save to a temporary directory and upload it as one commit (:func:`hf_csv.hub.transport.upload`).

        ``extra_folders``: {path in the repo: local folder} uploaded in the same commit (e.g. the
        ``custom_generate`` folder, ``hf-csv push-model``). Card kwargs: ``base_model``, ``measured``."""
        card = {k: kwargs.pop(k) for k in ("base_model", "measured") if k in kwargs}
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp, **card)
            for dest, src in (extra_folders or {}).items():
                hub.copy_folder(src, Path(tmp) / dest)
            return hub.upload(tmp, repo_id, revision=revision,
                              commit_message=commit_message or f"Upload hf_csv artifact ({self.config.fingerprint})",
                              **kwargs)
