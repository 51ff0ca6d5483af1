"""The package's module layout: no import circle inside hf_raincheck, cache state read through public names."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hf_raincheck"


def _modules(package: pathlib.Path) -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted name -> (file, is a package ``__init__``) for every module of `package` (a folder)."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        modules[".".join(parts)] = (path, is_package)
    return modules


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of import nodes under ``if TYPE_CHECKING:`` (never run)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                skipped.update(id(n) for n in ast.walk(inner))
    return skipped


def import_graph(package: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the hf_raincheck modules it imports, at any depth of its code (a function-level import closes a
    circle as surely as a top-level one: it only defers it), except under ``if TYPE_CHECKING:``. ``from pkg import
    name`` imports the submodule ``pkg.name`` when there is one, else the package (its ``__init__`` defines
    `name`)."""
    modules = _modules(package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped = _type_checking_only(tree)
        package = name if is_package else name.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                submodules = [f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in modules]
                # `from . import sub` imports the submodule; any other name comes from the package's __init__
                whole = len(submodules) < len(node.names)
                targets = submodules + ([source] if whole else [])
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_sees_every_kind_of_import(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .a import f\n",
        "a.py": "from . import b\n\ndef f():\n    from .sub.c import g\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\nimport pkg.sub\n",
        "sub/__init__.py": "",
        "sub/c.py": "from .. import b\nfrom ..sub import d\nfrom .. import f\n",
        "sub/d.py": "",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    graph = import_graph(package)
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b", "pkg.sub.c"},  # a function-level import counts
        "pkg.b": {"pkg.sub"},  # not the TYPE_CHECKING one
        "pkg.sub": set(),
        "pkg.sub.c": {"pkg.b", "pkg.sub.d", "pkg"},  # `f` comes from the package's __init__
        "pkg.sub.d": set(),
    }
    assert cycles(graph) == [["pkg", "pkg.a", "pkg.sub.c"]]


def test_no_import_circle_in_the_package():
    """Every module of hf_raincheck, every import (function-level ones too): the modules form layers, none reaches
    back to a module that imports it."""
    assert cycles(import_graph()) == []


_PRIVATE_CACHE_ACCESS = re.compile(r"\b(cache|past|past_key_values|cache_params)\)?\._[a-z]")


@pytest.mark.parametrize("folder", ["hf_raincheck", "benchmarks", "examples", "scripts", "tests"])
def test_cache_internals_stay_inside_the_cache_package(folder):
    """Code outside hf_raincheck/cache reads and writes a cache only through its public names."""
    offenders = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        if path.is_relative_to(PACKAGE / "cache") or path == pathlib.Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _PRIVATE_CACHE_ACCESS.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []


_TIMING = re.compile(r"\d\s?ms\b|\bms/|H[12]00|\bA100\b|\bmeasured\b")


@pytest.mark.parametrize("folder", ["generation", "cache"])
def test_no_timings_or_machine_names_in_the_code(folder):
    """Timings and machine names belong on the benchmarks page; comments and docstrings give reasons in words."""
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in sorted((PACKAGE / folder).rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if _TIMING.search(line)]
    assert found == []
