"""Hub transport for hf_csv artifacts: download, upload, the model card and the ``custom_generate`` folder.

This module only moves files (through huggingface_hub, so ``revision`` pinning, the cache,
``HF_HUB_OFFLINE=1`` and ``local_files_only`` behave as for model weights). The artifact format lives in
:mod:`hf_csv.hub.artifact`, which uses this module; this module imports neither it nor transformers.

* :func:`download` / :func:`upload` — a snapshot with allow-patterns; one commit per upload.
* :func:`write_model_card` — README.md with YAML metadata and the artifact's identity.
* :func:`custom_generate_folder` — the repository template of ``hub/custom_generate`` (shipped in the
  package as ``hf_csv/hub/template``): ``generate.py`` and ``requirements.txt``, which transformers 5.x
  loads with ``generate(..., custom_generate=REPO, trust_remote_code=True)`` or, in a model repository,
  at ``from_pretrained(..., trust_remote_code=True)``.
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional, Union

from hf_csv.core.errors import IndexFormatError

logger = logging.getLogger(__name__)

__all__ = ["download", "upload", "copy_folder", "write_model_card", "custom_generate_folder"]


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").upper() in ("1", "ON", "YES", "TRUE")


def download(repo_id: str, allow_patterns: list, revision: Optional[str] = None,
             cache_dir: Optional[Union[str, os.PathLike]] = None, token: Optional[Union[str, bool]] = None,
             local_files_only: Optional[bool] = None, endpoint: Optional[str] = None) -> str:
    """Download (or find in the cache) the files of ``repo_id`` matching ``allow_patterns``; returns the
    local snapshot directory. With ``HF_HUB_OFFLINE=1`` (or ``local_files_only=True``) only the cache is used."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    if local_files_only is None:
        local_files_only = _offline()
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, token=token,
                                 local_files_only=local_files_only, allow_patterns=allow_patterns, endpoint=endpoint)
    except HFValidationError as e:
        raise ValueError(f"{repo_id!r} is neither a local artifact directory nor a valid Hub repo id: {e}") from e
    except (LocalEntryNotFoundError, RepositoryNotFoundError) as e:
        # name both readings of the string: a mistyped local path reads as a Hub id here
        where = ("not in the local Hub cache (offline: HF_HUB_OFFLINE=1 or local_files_only)"
                 if isinstance(e, LocalEntryNotFoundError) else "repo not found on the Hub")
        raise IndexFormatError(f"no artifact at {repo_id!r}: no such local directory, and {where}") from e
    if not any((Path(path) / p).is_file() for p in allow_patterns if "*" not in p and p != "README.md"):
        raise IndexFormatError(f"Hub repo {repo_id!r} (revision {revision!r}) holds no hf_csv artifact")
    return path


def upload(folder: Union[str, os.PathLike], repo_id: str, revision: Optional[str] = None,
           private: Optional[bool] = None, token: Optional[Union[str, bool]] = None, commit_message: str = "",
           create_pr: bool = False, endpoint: Optional[str] = None) -> Any:
    """Create the model repo (and branch) if needed and upload ``folder`` as one commit; returns
    huggingface_hub's ``CommitInfo``."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    if revision is not None:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    return api.upload_folder(repo_id=repo_id, folder_path=str(folder), revision=revision, create_pr=create_pr,
                             commit_message=commit_message or "Upload hf_csv artifact")


def copy_folder(src: Union[str, os.PathLike], dest: Union[str, os.PathLike]) -> None:
    """Copy a folder's files (no caches) into ``dest``."""
    shutil.copytree(src, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def custom_generate_folder() -> Path:
    """The ``custom_generate`` repository template shipped with hf_csv."""
    return Path(__file__).resolve().parent / "template" / "custom_generate"


def write_model_card(directory: Union[str, os.PathLike], config: Any, base_model: Optional[str] = None,
                     measured: Optional[dict] = None, custom_generate: bool = False) -> Path:
    """Write README.md: YAML metadata, what the artifact holds, its fingerprint and measured figures.

    ``config`` is an :class:`hf_csv.hub.artifact.ArtifactConfig`. With ``custom_generate=True`` the card is
    tagged ``custom_generate`` and ``library_name: transformers``, as the Hub expects of such repos."""
    base = base_model or config.base_model
    meta = ["---", f"library_name: {'transformers' if custom_generate else 'hf_csv'}", "tags:", "- hf_csv",
            "- certified-decoding"]
    if custom_generate:
        meta.append("- custom_generate")
    if base:
        meta.append(f"base_model: {base}")
    meta.append("---")
    figures = dict(config.stats)
    figures.update(measured or {})
    rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(figures.items())) or "| (none recorded) | |"
    parts = ", ".join(p for p, have in (("int8 screen" if (config.screen or {}).get("quant", "int8") == "int8"
                                         else "fp8 screen", config.screen), ("cluster index", config.index)) if have)
    use = ("""from transformers import AutoModelForCausalLM
# trust_remote_code=True is what loads the certified generate: without it, from_pretrained gives stock generate,
# nothing is certified, and nothing says so
model = AutoModelForCausalLM.from_pretrained("<this repo>", trust_remote_code=True)
out = model.generate(**inputs)                    # model.csv_last_stats says what was certified
# or per call, on any model with the same head:
out = model.generate(**inputs, custom_generate="<this repo>", trust_remote_code=True)"""
           if custom_generate else
           """import hf_csv
from hf_csv import CSVConfig
model = hf_csv.enable(model)
out = model.generate(**inputs, csv_config=CSVConfig(index="<this repo>", revision="<commit>"))""")
    needs = ("The `custom_generate/` folder carries hf_csv's code (flattened, `csv_*.py` / `kern_*.py`): nothing to "
             "install beyond transformers' own dependencies." if custom_generate else
             "hf_csv is installed from its repository (it is not on PyPI: a package of that name there is not this one).")
    text = "\n".join(meta) + f"""

# hf_csv artifact{f' for {base}' if base else ''}

What hf_csv needs to decode {base or 'this model'} with a certified
sub-vocabulary head from the first call: {parts or 'nothing'}. It stores no weights of the model. It is
refused for a head with another fingerprint, and a loaded screen's error terms are recomputed from the
live head, so no file content can make a certificate wrong.

| field | value |
|---|---|
| vocab_size × hidden_size | {config.vocab_size} × {config.hidden_size} |
| head dtype | {config.head_dtype} |
| head bias | {config.has_bias} |
| head fingerprint | `{config.fingerprint}` |
| format version | {config.format_version} |
| files (sha256) | {', '.join(f'`{k}` `{v[:16]}…`' for k, v in sorted(config.sha256.items()))} |

## Measured figures

| figure | value |
|---|---|
{rows}

## Use

{needs}

```python
{use}
```
"""
    path = Path(directory) / "README.md"
    path.write_text(text)
    return path
