"""The layering of docs/design.md: kernels import neither hf_csv nor transformers, the core does not import
transformers, and imports between hf_csv's modules run one way (no cycle); the tests mirror the package layout."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ["hf_csv", "hf_csv.errors", "hf_csv.index", "hf_csv.hub", "hf_csv.artifact", "hf_csv.bounds",
        "hf_csv.certificate", "hf_csv.checks", "hf_csv.static", "hf_csv.posthead", "hf_csv.distributed",
        "hf_csv.config", "hf_csv.plan", "hf_csv.step", "hf_csv.speed"]
KERNELS = sorted(f"hf_csv_kernels.{p.stem}" for p in (ROOT / "hf_csv_kernels").glob("*.py") if p.stem != "__init__")


def _imported_after(modules: list[str]) -> set[str]:
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules) +
            "print(' '.join(sorted(k for k in sys.modules if k.split('.')[0] in ('transformers', 'hf_csv', "
            "'hf_csv_kernels'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_core_does_not_import_transformers():
    got = _imported_after(CORE)
    assert not {m for m in got if m.split(".")[0] == "transformers"}, sorted(got)


def test_kernels_import_neither_hf_csv_nor_transformers():
    got = _imported_after(KERNELS)
    assert not {m for m in got if m.split(".")[0] in ("transformers", "hf_csv")}, sorted(got)


def _graph() -> dict[str, set[str]]:
    """hf_csv module -> the hf_csv modules it imports (at module level or inside functions)."""
    g: dict[str, set[str]] = {}
    for p in (ROOT / "hf_csv").glob("*.py"):
        name = p.stem
        deps = g.setdefault(name, set())
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.ImportFrom) and n.level == 1:
                if n.module:
                    deps.add(n.module.split(".")[0])
                else:
                    deps.update(a.name for a in n.names)
            elif isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").startswith("hf_csv."):
                deps.add(n.module.split(".")[1])
        deps.discard(name)
    g.pop("__init__", None)
    return {k: {d for d in v if d in g} for k, v in g.items()}


def test_no_two_modules_import_each_other():
    g = _graph()
    # Tarjan's strongly connected components: a component of more than one module is a cycle
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_every_check_names_its_section():
    """Every public function of the core's check module names its docs/certificates.md section."""
    tree = ast.parse((ROOT / "hf_csv" / "checks.py").read_text())
    public = [n for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]
    missing = [n.name for n in public if "§" not in (ast.get_docstring(n) or "")]
    assert public and not missing, missing


def test_a_certified_greedy_step_passes_through_five_modules_without_going_back():
    """Issue 38's call tracer (scripts/trace_step.py) on a tiny random Llama: a settled plain greedy step runs in
    hf_csv.step, hf_csv.plan, hf_csv.certificate, hf_csv.speed and the native kernel, and no hop goes back into a
    module the step came from; a step with a lowering processor still certifies (its check runs from the processor
    list, the one hop back)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from trace_step import trace
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    from hf_csv_kernels import native

    r = trace()
    assert "certified 6/6 rows" in r["certified"], r["certified"]
    assert r["call_backs"] == [], r["call_backs"]
    want = {"hf_csv.step", "hf_csv.plan", "hf_csv.certificate", "hf_csv.speed"}
    assert want <= set(r["modules"]), r["modules"]
    if native.available():  # (without it the screen runs fbgemm through bounds and hf_csv_kernels.screen)
        assert set(r["modules"]) == want | {"hf_csv_kernels.native"}, r["modules"]
    rp = trace(repetition_penalty=1.3)
    assert "certified 6/6 rows" in rp["certified"] and len(rp["call_backs"]) <= 1, rp


# the tests span the whole stack (several modules end to end, a script, or an engine); every other test file mirrors one
# module: tests/test_<m>.py for hf_csv/<m>.py (hf_csv/_compat.py: test_compat.py), tests/test_kernels_<m>.py for
# hf_csv_kernels/<m>.py (docs/design.md, "Tests")
WHOLE_STACK = {"test_differential.py", "test_trust.py", "test_trust_round2.py", "test_real_weights.py",
               "test_first_hour.py", "test_layers.py", "test_cuda.py", "test_vllm_engine.py", "test_whisper_draft.py"}


def _mirrors() -> dict[str, str]:
    """test file name -> the module it mirrors."""
    out = {}
    for package, prefix in (("hf_csv", "test_"), ("hf_csv_kernels", "test_kernels_")):
        for p in (ROOT / package).glob("*.py"):
            if p.stem != "__init__":
                out[f"{prefix}{p.stem.lstrip('_')}.py"] = f"{package}/{p.name}"
    return out


def test_tests_mirror_the_package_layout():
    """Every module of hf_csv and hf_csv_kernels has its mirror test file, and every tests/test_*.py is a mirror or one
    of the whole-stack files: a new module without tests, or a test file named after a feature, fails here."""
    tests = ROOT / "tests"
    mirrors = _mirrors()
    have = {p.name for p in tests.glob("test_*.py")}
    missing = sorted(f"{m} (tests/{t})" for t, m in mirrors.items() if t not in have)
    stray = sorted(have - set(mirrors) - WHOLE_STACK)
    assert not missing, f"modules without their test file: {missing}"
    assert not stray, f"test files that mirror no module and are not whole-stack: {stray}"
    assert not WHOLE_STACK & set(mirrors), WHOLE_STACK & set(mirrors)
    # flat: a tests/hf_csv/ folder would shadow the package under pytest's default import mode
    assert not [p for p in tests.glob("*/**/test_*.py") if "__pycache__" not in p.parts]
