"""The house rules of docs/ARCHITECTURE.md, checked on the source tree (no imports executed).

- The runtime runs programs the transforms produced and calls ops and kernels: nothing in ``kvtransform.runtime``
  imports ``passes``, ``transforms``, ``cli``, ``config`` or ``capture`` (not even lazily inside a function).
- Nothing in ``kvtransform.transforms`` imports ``kvtransform.cli``.
- The modules of ``kvtransform.bench`` import each other without a circle.
- One job per module: no module outside ``kernels/`` over 500 lines, no kernel file over 800.
- The repository carries no lab notebook: no file under ``benchmarks/`` named after a commit or a run number,
  BENCHMARKS.md at most 400 lines, and comments/docstrings cite papers, docs/ or BENCHMARKS.md, never issue numbers.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> installed package name (pyproject.toml's package-dir mapping).
PACKAGES = {"kvtransform": "kvtransform", "passes": "kvtransform.passes", "conf": "kvtransform.conf"}


def _modules() -> dict:
    """Installed module name -> source path, for every ``.py`` file of the package folders."""
    out = {}
    for folder, pkg in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set:
    """Every module ``name`` imports, anywhere in the file (top level or inside functions), resolved to absolute
    dotted names; ``from a import b`` yields both ``a`` and ``a.b`` (b may be a submodule)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - (node.level - 1)]
                mod = ".".join(anchor + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{alias.name}" for alias in node.names)
    return found


def _under(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def _violations(src_pkg: str, forbidden: tuple) -> list:
    bad = []
    for name, path in MODULES.items():
        if not _under(name, src_pkg):
            continue
        for imp in sorted(_imports(name, path)):
            if any(_under(imp, f) for f in forbidden):
                bad.append(f"{path.relative_to(ROOT)} imports {imp}")
    return bad


def test_runtime_imports_no_compiler_layer():
    forbidden = ("kvtransform.passes", "kvtransform.transforms", "kvtransform.cli", "kvtransform.config",
                 "kvtransform.capture")
    assert _violations("kvtransform.runtime", forbidden) == []


def test_transforms_import_no_cli():
    assert _violations("kvtransform.transforms", ("kvtransform.cli",)) == []


def _cycles(pkg: str) -> list:
    names = [n for n in MODULES if _under(n, pkg) and n != pkg]
    graph = {n: sorted(i for i in _imports(n, MODULES[n]) if i in names and i != n) for n in names}
    cycles, state = [], {}

    def visit(n, stack):
        state[n] = "open"
        stack.append(n)
        for m in graph[n]:
            if state.get(m) == "open":
                cycles.append(" -> ".join(stack[stack.index(m):] + [m]))
            elif m not in state:
                visit(m, stack)
        stack.pop()
        state[n] = "done"

    for n in names:
        if n not in state:
            visit(n, [])
    return cycles


def test_bench_has_no_import_cycle():
    assert _cycles("kvtransform.bench") == []


def test_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    # The scan itself must be able to fail: two modules that import each other form a cycle.
    (tmp_path / "a.py").write_text("from kvtransform.bench import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from . import a\n")
    monkeypatch.setitem(MODULES, "kvtransform.bench.a", tmp_path / "a.py")
    monkeypatch.setitem(MODULES, "kvtransform.bench.b", tmp_path / "b.py")
    assert any("kvtransform.bench.a" in c and "kvtransform.bench.b" in c for c in _cycles("kvtransform.bench"))


def _line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_module_sizes():
    too_long = []
    for name, path in MODULES.items():
        limit = 800 if _under(name, "kvtransform.kernels") else 500
        if _line_count(path) > limit:
            too_long.append(f"{path.relative_to(ROOT)}: {_line_count(path)} lines > {limit}")
    assert too_long == []


def test_no_results_named_after_commits():
    named = [str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").rglob("*")
             if re.search(r"(^|[_\-.])[0-9a-f]{7,40}([_\-.]|$)|^run\d+|^issue\d+", p.name)]
    assert named == []


def test_benchmarks_md_is_short():
    assert _line_count(ROOT / "BENCHMARKS.md") <= 400


ISSUE_REF = re.compile(r"\bissues? ?#?\d+", re.IGNORECASE)


def _comment_and_doc_text(path: Path) -> list:
    """(line, text) of every comment and every string literal that stands alone as a statement (docstrings)."""
    src = path.read_text()
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(src).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.append((node.lineno, node.value.value))
    return out


@pytest.mark.parametrize("folder", ["kvtransform", "passes", "conf", "tools", "examples", "tests"])
def test_no_issue_numbers_in_comments(folder):
    hits = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for line, text in _comment_and_doc_text(path):
            # Public trackers of other projects may be cited by URL or project name ("TRL #3549"); ours by number not.
            for m in ISSUE_REF.finditer(text):
                hits.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0)}")
    assert hits == []
