"""The product's tools in scripts/ and the benchmarks reference that cites them (docs/benchmarks.md).

Every script answers ``--help`` with its argparse usage (so a tool that no longer imports, or imports a removed
helper, fails here before anyone needs it); every script and helper is used by the docs, a test, CI, the CLI or
another script (one-off experiments live in git, not in scripts/); the reference stays a reference (at most 500
lines) and every link or section number that points into it resolves."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
MAX_BENCHMARKS_LINES = 500


def _tools() -> list[Path]:
    """The runnable scripts: scripts/*.py but the shared helpers (``_name.py``, imported by the scripts)."""
    return sorted(p for p in SCRIPTS.glob("*.py") if not p.name.startswith("_"))


def _help(script: Path) -> tuple[str, int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, str(script), "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    return script.name, r.returncode, r.stdout + r.stderr


def test_every_script_answers_help():
    """``python scripts/X.py --help`` exits 0 and prints its usage, for every tool (run side by side: each is a
    Python start and an import of torch)."""
    with ThreadPoolExecutor(max(2, min(4, os.cpu_count() or 2))) as ex:
        results = list(ex.map(_help, _tools()))
    bad = [f"{name}: exit {rc}: {out[-400:]}" for name, rc, out in results if rc != 0 or "usage:" not in out]
    assert results and not bad, bad


def _citing_text() -> str:
    """What may use a script: the docs, the README, the tests, CI, the command line and the scripts themselves."""
    files = [ROOT / "README.md", ROOT / "hf_csv" / "cli.py", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "tests").glob("*.py")), *sorted((ROOT / ".ci").iterdir())]
    return "\n".join(p.read_text() for p in files if p.is_file())


def test_every_script_is_used():
    """A script is named by the docs, a test, CI or the CLI (a one-off experiment is not kept in scripts/); a helper
    (``_name.py``) or a folder is used by another script or a test."""
    cited = _citing_text()
    unused = [p.name for p in _tools() + sorted(SCRIPTS.glob("*.sh")) if p.name not in cited]
    scripts_text = "\n".join(p.read_text() for p in _tools())
    for p in sorted(SCRIPTS.glob("_*.py")):
        if not re.search(rf"\b(import {p.stem}\b|from {p.stem} import)", scripts_text + cited):
            unused.append(p.name)
    for d in sorted(q for q in SCRIPTS.iterdir() if q.is_dir() and q.name != "__pycache__"):
        if d.name not in scripts_text + cited:
            unused.append(d.name + "/")
    assert not unused, unused


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _sections() -> tuple[set[str], set[str]]:
    """(the anchors of docs/benchmarks.md's headings, its section numbers)."""
    heads = [line.lstrip("#").strip() for line in BENCHMARKS.read_text().splitlines() if line.startswith("#")]
    numbers = {m.group(1) for h in heads if (m := re.match(r"(\d+(?:\.\d+)?)\.? ", h))}
    return {_slug(h) for h in heads}, numbers


def test_the_benchmarks_reference_is_short_and_its_links_resolve():
    """docs/benchmarks.md keeps the current figures only (at most 500 lines); every ``benchmarks.md#anchor`` link in
    the README and the docs names one of its headings, and every "benchmarks(.md) §N" in the repository (and every
    bare §N inside the file, but those of the certificates) one of its numbered sections."""
    text = BENCHMARKS.read_text()
    assert len(text.splitlines()) <= MAX_BENCHMARKS_LINES
    anchors, numbers = _sections()
    bad = []
    for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for a in re.findall(r"benchmarks\.md#([\w\-]+)", p.read_text()):
            if a not in anchors:
                bad.append(f"{p.name}: #{a}")
    for a in re.findall(r"\]\(#([\w\-]+)\)", text):
        if a not in anchors:
            bad.append(f"benchmarks.md: #{a}")
    sources = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "hf_csv").rglob("*.py"),
               *(ROOT / "tests").glob("*.py"), *SCRIPTS.rglob("*.py")]
    for p in sources:
        for n in re.findall(r"benchmarks(?:\.md)?,? §(\d+(?:\.\d+)?)", p.read_text()):
            if n not in numbers:
                bad.append(f"{p.relative_to(ROOT)}: §{n}")
    for n in re.findall(r"(?<!certificates )(?<!certificates\.md )§(\d+(?:\.\d+)?)", text):
        if n not in numbers:
            bad.append(f"benchmarks.md: §{n}")
    assert not bad, bad
