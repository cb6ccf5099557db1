"""A self-contained copy of hf_csv for a Hub ``custom_generate`` folder.

transformers loads ``custom_generate/generate.py`` with its dynamic-module loader, which copies (from a local folder)
or downloads (from the Hub) every file that a ``from .NAME import ...`` line names, recursively, from the same folder,
and only those: ``.py`` files, one flat folder, no sub-packages (``transformers.dynamic_module_utils``:
``get_relative_imports``, ``get_cached_module_file``). It also refuses a file whose imports, outside ``try`` blocks,
name a package that is not installed (``check_imports``).

So the folder carries hf_csv itself, flattened: ``hf_csv/X.py`` becomes ``csv_X.py``, ``hf_csv_kernels/X.py``
``kern_X.py`` (the packages' ``__init__`` become ``csv_pkg.py`` / ``kern_pkg.py``), every import of the two packages is
rewritten to a relative import of the flat name, and the AVX2 kernel's C source travels as a module
(``kern_csrc_screen_avx2.py``). ``generate.py`` names every file in a never-executed block, so that the loader fetches
them all. Left out: the CLI (``cli.py``), the vLLM plugin (``vllm_plugin.py``: transformers' loader reads every
``import`` in a carried file, ``vllm`` included, and refuses the folder where one is missing) and the Triton kernels
(``triton_ops.py``: ``import triton`` would make the loader refuse the folder on a machine without it; the torch
references serve on GPU instead).

A repository made this way needs no ``pip install`` of hf_csv (which is not on PyPI), only what hf_csv imports:
torch, safetensors, huggingface_hub, numpy, tqdm — transformers' own dependencies.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Union

__all__ = ["vendor_into", "VENDORED_MODULES"]

_ROOT = Path(__file__).resolve().parent
_PKGS = {"hf_csv": ("csv_", _ROOT), "hf_csv_kernels": ("kern_", _ROOT.parent / "hf_csv_kernels")}
_SKIP = {("hf_csv", "cli.py"), ("hf_csv", "vendor.py"), ("hf_csv", "vllm_plugin.py"),
         ("hf_csv_kernels", "triton_ops.py")}


def _flat(pkg: str, mod: str) -> str:
    prefix = _PKGS[pkg][0]
    return prefix + ("pkg" if mod == "__init__" else mod)


def _rewrite(pkg: str, text: str) -> str:
    """Every import of hf_csv / hf_csv_kernels (absolute, or relative within ``pkg``) as a flat relative import."""
    me = _PKGS[pkg][0]

    def from_dot_import(m: re.Match) -> str:  # from . import a, b as c  ->  from . import csv_a as a, csv_b as c
        names = []
        for part in m.group(2).split(","):
            name, _, alias = part.strip().partition(" as ")
            names.append(f"{me}{name.strip()} as {(alias or name).strip()}")
        return f"{m.group(1)}from . import {', '.join(names)}"

    text = re.sub(r"^(\s*)from \. import ([\w ,]+)$", from_dot_import, text, flags=re.M)
    text = re.sub(r"^(\s*)from \.(\w+) import", lambda m: f"{m.group(1)}from .{me}{m.group(2)} import", text, flags=re.M)
    for other, (prefix, _) in _PKGS.items():
        text = re.sub(rf"^(\s*)from {other}\.(\w+) import", rf"\1from .{prefix}\2 import", text, flags=re.M)
        text = re.sub(rf"^(\s*)from {other} import", rf"\1from .{prefix}pkg import", text, flags=re.M)
        text = re.sub(rf"^(\s*)import {other}$", rf"\1from . import {prefix}pkg as {other}", text, flags=re.M)
    # modules named in strings (importlib.import_module(NAME, __package__))
    text = re.sub(r'(import_module\(|": )"\.(\w+)"', lambda m: f'{m.group(1)}".{me}{m.group(2)}"', text)
    return text


def _modules() -> list[tuple[str, Path]]:
    out = []
    for pkg, (_, folder) in _PKGS.items():
        for f in sorted(folder.glob("*.py")):
            if (pkg, f.name) not in _SKIP:
                out.append((pkg, f))
    return out


VENDORED_MODULES: tuple = tuple(_flat(pkg, f.stem) for pkg, f in _modules()) + ("kern_csrc_screen_avx2",)


def _check(name: str, text: str) -> None:
    """No import of the packages may be left absolute (the copy must never reach an installed hf_csv)."""
    for node in ast.walk(ast.parse(text, name)):
        mods = []
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods = [node.module]
        for mod in mods:
            if mod.split(".")[0] in _PKGS:
                raise RuntimeError(f"vendoring hf_csv: {name} still imports {mod!r}")


def vendor_into(dest: Union[str, Path]) -> list[str]:
    """Write the flat copy of hf_csv into ``dest`` (a ``custom_generate`` folder); returns the file names written."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for pkg, f in _modules():
        name = _flat(pkg, f.stem) + ".py"
        text = _rewrite(pkg, f.read_text())
        _check(name, text)
        (dest / name).write_text(text)
        written.append(name)
    src = (_PKGS["hf_csv_kernels"][1] / "csrc" / "screen_avx2.c").read_text()
    (dest / "kern_csrc_screen_avx2.py").write_text(
        '"""The C source of hf_csv\'s AVX2 int8 screen kernel (hf_csv_kernels/csrc/screen_avx2.c), carried as text: a\n'
        'custom_generate folder holds .py files only (hf_csv.vendor)."""\n\nSOURCE = ' + repr(src) + "\n")
    written.append("kern_csrc_screen_avx2.py")
    return written


def manifest() -> str:
    """The block ``generate.py`` ends with: one ``from .NAME import`` line per vendored file, never executed, which
    is how transformers' loader learns which files to fetch."""
    lines = ["if False:  # never runs: transformers' loader fetches each file a `from .NAME import` line names (hf_csv.vendor)"]
    lines += [f"    from .{m} import __doc__  # noqa: F401" for m in VENDORED_MODULES]
    return "\n".join(lines) + "\n"
