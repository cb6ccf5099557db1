"""The tree is the architecture (docs/design.md, "Layout"): the kernels import neither hf_csv nor transformers, the
core imports neither transformers nor vLLM nor the layers above it, each engine's integration sits in its own
subpackage, imports run one way between subpackages and between modules (no cycle), no unit grows past what a reader
holds in mind, scripts are tools of an installed package, and the tests mirror the layout."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hf_csv", "hf_csv_kernels")
# subpackage -> the subpackages (and top packages) it may import; hf_csv/__init__.py and hf_csv/__main__ are the
# public faces (the Python API, lazily, and the ``hf-csv`` command line, hf_csv/cli.py) and may import any layer
MAY_IMPORT = {
    "hf_csv_kernels": set(),
    "hf_csv.core": {"hf_csv_kernels"},
    "hf_csv.hub": {"hf_csv_kernels", "hf_csv.core"},
    "hf_csv.transformers": {"hf_csv_kernels", "hf_csv.core", "hf_csv.hub"},
    "hf_csv.vllm": {"hf_csv_kernels", "hf_csv.core", "hf_csv.hub"},
}
# the outside engines: the only subpackage that may import each
ENGINES = {"transformers": "hf_csv.transformers", "vllm": "hf_csv.vllm"}
MAX_MODULE_LINES, MAX_CLASS_LINES, MAX_FUNCTION_LINES = 600, 300, 80


def _modules(package: str) -> list[str]:
    """Every module of a (sub)package, by dotted name, packages by their own name."""
    base = ROOT / package.replace(".", "/")
    out = []
    for p in sorted(base.rglob("*.py")):
        if "template" in p.relative_to(ROOT).parts:  # the custom_generate template is data for the Hub
            continue
        parts = p.relative_to(ROOT).with_suffix("").parts
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def _layer(module: str) -> str:
    for layer in sorted(MAY_IMPORT, key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    return module  # hf_csv itself


def _imports(module: str) -> set[str]:
    """The modules ``module`` names in its imports (module level or inside functions), absolute."""
    path = ROOT / module.replace(".", "/")
    is_pkg = (path / "__init__.py").is_file()
    path = path / "__init__.py" if is_pkg else path.with_suffix(".py")
    here = module.split(".") if is_pkg else module.split(".")[:-1]
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Import):
            out.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                up = here[: len(here) - (n.level - 1)]
                base = ".".join(up + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in n.names)
    return out


def _imported_after(modules: list[str]) -> set[str]:
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules) +
            "print(' '.join(sorted(k for k in sys.modules if k.split('.')[0] in ('transformers', 'vllm', 'hf_csv', "
            "'hf_csv_kernels'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_the_core_loads_without_transformers_vllm_or_the_layers_above():
    got = _imported_after(_modules("hf_csv.core"))
    bad = {m for m in got if m.split(".")[0] in ENGINES or _layer(m) not in ("hf_csv.core", "hf_csv_kernels", "hf_csv")}
    assert not bad, sorted(bad)


def test_kernels_import_neither_hf_csv_nor_transformers():
    got = _imported_after([m for m in _modules("hf_csv_kernels") if not m.endswith("triton_ops")])
    assert not {m for m in got if m.split(".")[0] in ("transformers", "vllm", "hf_csv")}, sorted(got)


def test_imports_run_one_way_between_subpackages():
    """Each subpackage imports only the layers below it, and only its own engine (read from the source, so that a lazy
    import inside a function counts)."""
    bad = []
    for layer, allowed in MAY_IMPORT.items():
        for mod in _modules(layer):
            for imp in _imports(mod):
                top = imp.split(".")[0]
                if top in ENGINES and ENGINES[top] != layer:
                    bad.append(f"{mod} imports {imp}")
                elif top in PACKAGES and _layer(imp) not in allowed | {layer}:
                    bad.append(f"{mod} imports {imp}")
    assert not bad, bad


def _graph() -> dict[str, set[str]]:
    """hf_csv module -> the hf_csv modules it imports (a package counts as its ``__init__``)."""
    mods = [m for p in PACKAGES for m in _modules(p)]
    known = set(mods)
    return {m: {i for i in _imports(m) if i in known and i != m and not m.startswith(i + ".")} for m in mods}


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




def _units(path: Path):
    """(kind, name, lines) of every class and function in a file."""
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            kind = "class" if isinstance(n, ast.ClassDef) else "function"
            yield kind, n.name, n.end_lineno - n.lineno + 1


def _sources() -> list[Path]:
    return sorted([p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")] + list((ROOT / "scripts").rglob("*.py")))


def test_no_unit_is_larger_than_a_reader_holds_in_mind():
    """No module over 600 lines, no class over 300, no function over 80, in the packages and the scripts."""
    limit = {"class": MAX_CLASS_LINES, "function": MAX_FUNCTION_LINES}
    big = []
    for p in _sources():
        rel = p.relative_to(ROOT)
        n = len(p.read_text().splitlines())
        if n > MAX_MODULE_LINES:
            big.append(f"{rel}: {n} lines")
        big += [f"{rel}: {kind} {name} {lines} lines" for kind, name, lines in _units(p) if lines > limit[kind]]
    assert not big, big


def test_scripts_are_tools_of_the_installed_package():
    """Every script imports hf_csv as installed (no ``sys.path`` edit) and answers ``--help``."""
    bad = [p.name for p in (ROOT / "scripts").rglob("*.py") if "sys.path" in p.read_text()]
    assert not bad, bad


def test_every_check_names_its_section():
    """Every public function of the core's check module names its docs/certificates.md section."""
    tree = ast.parse((ROOT / "hf_csv" / "core" / "checks.py").read_text())
    public = [n for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]
    missing = [n.name for n in public if "§" not in (ast.get_docstring(n) or "")]
    assert public and not missing, missing


def test_a_certified_greedy_step_passes_through_five_modules_without_going_back(monkeypatch):
    """Issue 38's call tracer (scripts/trace_step.py) on a tiny random Llama: a settled plain greedy step runs in
    hf_csv.transformers.step, hf_csv.transformers.plans, hf_csv.core.certificate, hf_csv.core.speed and the native kernel, and no hop goes back into a
    module the step came from; a step with a lowering processor still certifies (its check runs from the processor
    list, the one hop back). A sub-subpackage (hf_csv/core/certificate/) is one unit here, as for the mirrored tests."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import trace_step
        from trace_step import trace
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    own = trace_step._module
    monkeypatch.setattr(trace_step, "_module", lambda f: None if (m := own(f)) is None else ".".join(m.split(".")[:3]))
    from hf_csv_kernels import native
    r = trace()
    assert "certified 6/6 rows" in r["certified"], r["certified"]
    assert r["call_backs"] == [], r["call_backs"]
    want = {"hf_csv.transformers.step", "hf_csv.transformers.plans", "hf_csv.core.certificate", "hf_csv.core.speed"}
    assert want <= set(r["modules"]), r["modules"]
    if native.available():  # (without it the screen runs fbgemm through bounds and hf_csv_kernels.screen)
        assert set(r["modules"]) == want | {"hf_csv_kernels.native"}, r["modules"]
    rp = trace(repetition_penalty=1.3)
    assert "certified 6/6 rows" in rp["certified"] and len(rp["call_backs"]) <= 1, rp




# test files that span the whole stack (several layers end to end, a script, or an engine) are test_stack_<subject>.py;
# every other test file mirrors one module or sub-subpackage: tests/test_<subpackage>_<module>.py for
# hf_csv/<subpackage>/<module>(.py|/), tests/test_kernels_<module>.py for hf_csv_kernels/<module>.py,
# tests/test_cli.py for the command line (hf_csv/cli.py)
WHOLE_STACK_PREFIX = "test_stack_"


def _mirrors() -> dict[str, str]:
    """test file name -> the module it mirrors."""
    out = {}
    for sub in ("core", "transformers", "vllm", "hub"):
        for p in (ROOT / "hf_csv" / sub).iterdir():
            if p.name == "template" or p.name.startswith("__"):
                continue
            if p.suffix == ".py" or (p / "__init__.py").is_file():
                out[f"test_{sub}_{p.stem.lstrip('_')}.py"] = str(p.relative_to(ROOT))
    for p in (ROOT / "hf_csv_kernels").glob("*.py"):
        if p.stem != "__init__":
            out[f"test_kernels_{p.stem}.py"] = str(p.relative_to(ROOT))
    return out


def test_tests_mirror_the_package_layout():
    """Every module has its mirror test file, and every tests/test_*.py is a mirror, a whole-stack file or this one: a
    new module without tests, or a test file named after a feature's history, fails here."""
    tests = ROOT / "tests"
    mirrors = _mirrors()
    have = {p.name for p in tests.glob("test_*.py")}
    missing = sorted(f"{m} (tests/{t})" for t, m in mirrors.items() if t not in have)
    stray = sorted(n for n in have - set(mirrors) - {"test_layout.py", "test_cli.py"} if not n.startswith(WHOLE_STACK_PREFIX))
    assert not missing, f"modules without their test file: {missing}"
    assert not stray, f"test files that mirror no module and are not whole-stack: {stray}"
    # flat: a tests/transformers/ folder would shadow the package under pytest's default import mode
    assert not [p for p in tests.glob("*/**/test_*.py") if "__pycache__" not in p.parts]


def test_ci_names_only_tests_that_exist():
    """Every test file and test node the CI scripts name exists (a renamed test file must not drop out of a CI job
    silently, nor stop it with 'file not found')."""
    import re

    missing = []
    for script in sorted((ROOT / ".ci").iterdir()):
        for path, node in re.findall(r"\b(tests/[\w/]+\.py)(?:::(\w+))?", script.read_text()):
            f = ROOT / path
            if not f.is_file():
                missing.append(f"{script.name}: {path}")
            elif node and not re.search(rf"^(async )?def {node}\b", f.read_text(), re.M):
                missing.append(f"{script.name}: {path}::{node}")
    assert not missing, missing
