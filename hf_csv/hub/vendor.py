"""A self-contained copy of hf_csv for a Hub ``custom_generate`` folder.

transformers loads ``custom_generate/generate.py`` with its dynamic-module loader, which copies (from a local folder)
or downloads (from the Hub) every file that a ``from .NAME import ...`` line names, recursively, from the same folder,
and only those: ``.py`` files, one flat folder, no sub-packages (``transformers.dynamic_module_utils``:
``get_relative_imports``, ``get_cached_module_file``). It also refuses a file whose imports, outside ``try`` blocks,
name a package that is not installed (``check_imports``).

So the folder carries hf_csv itself, flattened: ``hf_csv/core/X.py`` becomes ``csv_core_X.py``, ``hf_csv_kernels/X.py``
``kern_X.py`` (a package's ``__init__`` becomes ``..._pkg.py``: ``csv_pkg.py``, ``csv_core_pkg.py``, ``kern_pkg.py``), every import of the two packages is
rewritten to a relative import of the flat name, and the AVX2 kernel's C source travels as a module
(``kern_csrc_screen_avx2.py``). ``generate.py`` names every file in a never-executed block, so that the loader fetches
them all. Left out: the CLI (``hub/cli.py``), the vLLM plugin (``vllm/``: transformers' loader reads every
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

_PKG_ROOT = Path(__file__).resolve().parents[1]  # hf_csv/
_SRC = _PKG_ROOT.parent  # the folder that holds hf_csv/ and hf_csv_kernels/
_PREFIX = {"hf_csv": "csv", "hf_csv_kernels": "kern"}
_PKGS = tuple(_PREFIX)
# what the copy leaves out (the module docstring says why)
_SKIP = ("hf_csv/cli.py", "hf_csv/hub/vendor.py", "hf_csv/hub/template/", "hf_csv/vllm/", "hf_csv_kernels/triton_ops.py")


def _dotted(f: Path) -> str:
    """hf_csv/core/index.py -> hf_csv.core.index; hf_csv/core/__init__.py -> hf_csv.core"""
    parts = f.relative_to(_SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _flat(dotted: str) -> str:
    """hf_csv.core.index -> csv_core_index; a package (its ``__init__``) gets ``_pkg``: hf_csv -> csv_pkg."""
    top, *rest = dotted.split(".")
    name = "_".join([_PREFIX[top], *rest])
    return name + "_pkg" if _is_package(dotted) else name


def _is_package(dotted: str) -> bool:
    return (_SRC / dotted.replace(".", "/") / "__init__.py").is_file()


def _is_module(dotted: str) -> bool:
    return _is_package(dotted) or (_SRC / (dotted.replace(".", "/") + ".py")).is_file()


def _resolve(module: str, level: int, here: str) -> str:
    """The absolute name of ``from <level dots><module> import`` written in module ``here``."""
    if level == 0:
        return module
    base = here.split(".") if _is_package(here) else here.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _rewrite(here: str, text: str) -> str:
    """Every import of hf_csv / hf_csv_kernels (absolute or relative) as a relative import of the flat name."""

    def from_import(m: re.Match) -> str:
        indent, dots, module, names = m.group(1), m.group(2), m.group(3) or "", m.group(4).strip("()")
        target = _resolve(module, len(dots), here)
        if target.split(".")[0] not in _PKGS:
            return m.group(0)
        lines, plain = [], []
        for part in filter(str.strip, names.split(",")):
            name, _, alias = part.strip().partition(" as ")
            name, alias = name.strip(), (alias or name).strip()
            if _is_module(f"{target}.{name}"):
                lines.append(f"{indent}from . import {_flat(f'{target}.{name}')} as {alias}")
            else:
                plain.append(name if name == alias else f"{name} as {alias}")
        if plain:
            lines.insert(0, f"{indent}from .{_flat(target)} import {', '.join(plain)}")
        return "\n".join(lines)

    text = re.sub(r"^(\s*)from (\.*)([\w.]*) import (\([\w\s,]*\)|[\w ,]+?)[ \t]*$", from_import, text, flags=re.M)
    for top in _PKGS:
        text = re.sub(rf"^(\s*)import {top}$", rf"\1from . import {_flat(top)} as {top}", text, flags=re.M)
    # modules named in strings (importlib.import_module(NAME, __package__), relative to hf_csv)
    text = re.sub(r'(import_module\(|": )"\.([\w.]+)"', lambda m: f'{m.group(1)}".{_flat("hf_csv." + m.group(2))}"', text)
    return text


def _modules() -> list[Path]:
    out = []
    for top in _PKGS:
        for f in sorted((_SRC / top).rglob("*.py")):
            rel = f.relative_to(_SRC).as_posix()
            if not any(rel == s or (s.endswith("/") and rel.startswith(s)) for s in _SKIP):
                out.append(f)
    return out


VENDORED_MODULES: tuple = tuple(_flat(_dotted(f)) for f in _modules()) + ("kern_csrc_screen_avx2",)


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
    for f in _modules():
        name = _flat(_dotted(f)) + ".py"
        text = _rewrite(_dotted(f), f.read_text())
        _check(name, text)
        (dest / name).write_text(text)
        written.append(name)
    src = (_SRC / "hf_csv_kernels" / "csrc" / "screen_avx2.c").read_text()
    (dest / "kern_csrc_screen_avx2.py").write_text(
        '"""The C source of hf_csv\'s AVX2 int8 screen kernel (hf_csv_kernels/csrc/screen_avx2.c), carried as text: a\n'
        'custom_generate folder holds .py files only (hf_csv.hub.vendor)."""\n\nSOURCE = ' + repr(src) + "\n")
    written.append("kern_csrc_screen_avx2.py")
    return written


def manifest() -> str:
    """The block ``generate.py`` ends with: one ``from .NAME import`` line per vendored file, never executed, which
    is how transformers' loader learns which files to fetch."""
    lines = ["if False:  # never runs: transformers' loader fetches each file a `from .NAME import` line names (hf_csv.hub.vendor)"]
    lines += [f"    from .{m} import __doc__  # noqa: F401" for m in VENDORED_MODULES]
    return "\n".join(lines) + "\n"
