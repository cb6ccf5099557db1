"""Hub artifacts for :class:`hf_csv.index.VocabIndex`: pull, push and the model card.

An index repo on the Hub holds exactly what ``VocabIndex.save_pretrained`` writes:
``csv_index_config.json`` (the :class:`IndexConfig`, including the head fingerprint and the
sha256 of the tensors), ``csv_index.safetensors`` and a generated ``README.md`` model card.
Downloads go through huggingface_hub's cache (``snapshot_download``), so ``revision`` pinning,
``HF_HUB_OFFLINE=1`` and ``local_files_only`` behave as for model weights. This module does not
import transformers.
"""
from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from .index import CONFIG_NAME, TENSORS_NAME

if TYPE_CHECKING:
    from .index import VocabIndex

logger = logging.getLogger(__name__)

__all__ = ["download_index", "push_to_hub", "write_model_card", "ALLOW_PATTERNS"]

ALLOW_PATTERNS = [CONFIG_NAME, TENSORS_NAME, "README.md"]


def download_index(repo_id: str, revision: Optional[str] = None, cache_dir: Optional[Union[str, os.PathLike]] = None,
                   token: Optional[Union[str, bool]] = None, local_files_only: Optional[bool] = None,
                   endpoint: Optional[str] = None) -> str:
    """Download (or find in the cache) an index repo; returns the local snapshot directory.

    ``revision`` may be a branch, tag or commit sha. With ``HF_HUB_OFFLINE=1`` (or
    ``local_files_only=True``) only the cache is consulted.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    if local_files_only is None:
        local_files_only = os.environ.get("HF_HUB_OFFLINE", "0").upper() in ("1", "ON", "YES", "TRUE")
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, token=token,
                                 local_files_only=local_files_only, allow_patterns=ALLOW_PATTERNS,
                                 endpoint=endpoint)
    except HFValidationError as e:
        raise ValueError(f"{repo_id!r} is neither a local index directory nor a valid Hub repo id: {e}") from e
    if not (Path(path) / CONFIG_NAME).is_file():
        from .errors import IndexFormatError
        raise IndexFormatError(f"Hub repo {repo_id!r} (revision {revision!r}) has no {CONFIG_NAME}: not an hf_csv index")
    return path


def push_to_hub(index: "VocabIndex", repo_id: str, revision: Optional[str] = None, private: Optional[bool] = None,
                token: Optional[Union[str, bool]] = None, commit_message: Optional[str] = None,
                create_pr: bool = False, base_model: Optional[str] = None, measured: Optional[dict] = None,
                endpoint: Optional[str] = None) -> Any:
    """Save ``index`` to a temporary directory (with its model card) and upload it as one commit.

    Returns huggingface_hub's ``CommitInfo``.
    """
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    if revision is not None:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        index.save_pretrained(tmp, base_model=base_model, measured=measured)
        return api.upload_folder(repo_id=repo_id, folder_path=tmp, revision=revision, create_pr=create_pr,
                                 commit_message=commit_message or f"Upload hf_csv index ({index.config.fingerprint})",
                                 allow_patterns=ALLOW_PATTERNS)


def write_model_card(index: "VocabIndex", directory: Union[str, os.PathLike], base_model: Optional[str] = None,
                     measured: Optional[dict] = None, **_: Any) -> Path:
    """Write README.md with YAML metadata, the build parameters, fingerprint and measured figures."""
    c = index.config
    base = base_model or c.base_model
    meta = ["---", "library_name: hf_csv", "tags:", "- hf_csv", "- csv-decode", "- certified-decoding"]
    if base:
        meta.append(f"base_model: {base}")
    meta.append("---")
    figures = dict(c.stats)
    figures.update(measured or {})
    rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(figures.items())) or "| (none recorded) | |"
    text = "\n".join(meta) + f"""

# hf_csv vocabulary index{f' for {base}' if base else ''}

FAISS k-means clusters of an LM head's rows, for [hf_csv](https://pypi.org/project/hf-csv/) certified
sub-vocabulary decoding. The index stores no weights of the model; it refuses to load against a head whose
fingerprint differs.

| parameter | value |
|---|---|
| vocab_size | {c.vocab_size} |
| hidden_size | {c.hidden_size} |
| num_clusters | {c.num_clusters} |
| metric | {c.metric} |
| niter / seed | {c.niter} / {c.seed} |
| head bias | {c.has_bias} |
| head dtype | {c.head_dtype} |
| head fingerprint | `{c.fingerprint}` |
| tensors sha256 | `{c.tensors_sha256}` |
| format version | {c.format_version} |

## Measured figures

| figure | value |
|---|---|
{rows}

The paper's cluster bound is sound but, measured on real heads, opens almost all of the vocabulary; the
certified int8 screen (`provider="screen"`, no index needed) is what prunes. See hf_csv's docs/benchmarks.md.

## Use

```python
import hf_csv
from hf_csv import CSVConfig
model = hf_csv.enable(model)
out = model.generate(**inputs, csv_config=CSVConfig(provider="cluster", index="<this repo>", revision="<commit>"))
```
"""
    path = Path(directory) / "README.md"
    path.write_text(text)
    return path
