"""The README as a product page: CI runs its test command, its links resolve, the essentials come first.

`.ci/run` says it runs "the README's test command, exactly"; these checks keep the two lines the same, keep every
relative link in README.md pointing at a file (and heading) that exists, and keep the page short with what a new
user needs (the one call, install, the demo, where to read on) in its first 60 lines. Text only: nothing is run.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# the command's opening, as CI's line and the README's Tests block both start it
TEST_COMMAND_START = 'python -m pip install torch==2.13.0 && python -m pip install -e ".[test]"'


def _lines() -> list[str]:
    return README.read_text(encoding="utf-8").splitlines()


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_readme_test_command_is_the_one_ci_runs() -> None:
    ci = [l for l in (ROOT / ".ci" / "run").read_text().splitlines() if l.startswith(TEST_COMMAND_START)]
    readme = [l for l in _lines() if l.startswith(TEST_COMMAND_START)]
    assert len(ci) == 1 and len(readme) == 1, (ci, readme)
    assert readme[0] == ci[0]


def test_readme_is_short_and_leads_with_the_essentials() -> None:
    lines = _lines()
    assert len(lines) <= 150, len(lines)
    head = "\n".join(lines[:60])
    for needed in ("hf_csv.enable(model)", "## Install", "scripts/demo.py", "## Where to read on"):
        assert needed in head, needed
    # the "Where to read on" list ends within the first 60 lines too
    start = next(i for i, l in enumerate(lines) if l == "## Where to read on")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    assert end <= 61, end


def test_readme_offline_demo_line_installs_what_prepare_needs() -> None:
    demo = [l for l in _lines() if "prepare.py ci && python scripts/demo.py" in l]
    assert len(demo) == 1, demo
    assert re.search(r"pip install [^&]*\bgguf\b", demo[0]), demo[0]


def test_readme_links_resolve() -> None:
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), link
        if anchor:
            headings = [m.group(1) for m in re.finditer(r"^#+ (.+)$", target.read_text(encoding="utf-8"), re.M)]
            assert anchor in {_slug(h) for h in headings}, link
