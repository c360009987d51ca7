"""The test suite's own layout: test modules share helpers through tests/fixtures/ and tests/conftest.py,
never by importing one another or by editing ``sys.path`` (pytest puts tests/ on it when it loads
tests/conftest.py), and every ``test_*.py`` file holds tests (a helper module is not named like one).

The scan reads every Python file under tests/ with ``ast`` and fails on ``import test_x`` /
``from test_x import ...`` and on code that changes ``sys.path`` (``sys.path.insert``, assignment, ...).
Code inside a string (a command line for a subprocess) is not code to ``ast`` and passes, and so does
pytest's ``monkeypatch.syspath_prepend``, which is undone after its test.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
MUTATORS = {"insert", "append", "extend", "remove", "pop", "clear", "sort", "reverse", "__setitem__",
            "__delitem__", "__iadd__"}


def _is_test_module(name: str) -> bool:
    return any(part.startswith("test_") for part in name.split("."))


def _is_sys_path(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def problems(source: str) -> list[str]:
    """Where one file's source imports a test module or changes ``sys.path`` (``line N: ...``)."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [f"line {node.lineno}: import {a.name}" for a in node.names if _is_test_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            if _is_test_module(node.module or "") or any(_is_test_module(n) for n in names):
                out.append(f"line {node.lineno}: from {'.' * node.level}{node.module or ''} import {names}")
            if node.module == "sys" and "path" in names:
                out.append(f"line {node.lineno}: from sys import path")
        elif isinstance(node, ast.Call):
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            arg = node.args[0] if node.args else None
            if (fn in ("import_module", "__import__") and isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str) and _is_test_module(arg.value)):
                out.append(f"line {node.lineno}: {fn}({arg.value!r})")
        elif _is_sys_path(node):
            up = parents.get(node)
            changed = (isinstance(node.ctx, (ast.Store, ast.Del))
                       or (isinstance(up, ast.Attribute) and up.attr in MUTATORS)
                       or (isinstance(up, ast.Subscript) and isinstance(up.ctx, (ast.Store, ast.Del))))
            if changed:
                out.append(f"line {node.lineno}: changes sys.path")
    return sorted(out)


def test_the_scan_catches_imports_of_test_modules_and_sys_path_changes():
    bad = ["from test_kernels import check", "import test_steering_pasta", "import os, test_x as t",
           "from tests.test_kernels import check", "from . import test_kernels",
           "import importlib\nimportlib.import_module('test_kernels')",
           "import sys\nsys.path.insert(0, '.')", "import sys\nsys.path.append('.')", "import sys\nsys.path = []",
           "import sys\nsys.path[:0] = ['.']", "import sys\nsys.path += ['.']", "import sys\ndel sys.path[0]",
           "from sys import path"]
    for source in bad:
        assert problems(source), source
    good = ["from fixtures.kernels import check", "from conftest import spec_text", "import sys\nn = len(sys.path)",
            "import subprocess, sys\n"
            "subprocess.run([sys.executable, '-c', 'import sys; sys.path.insert(0, \"x\")'])",
            "def test_x(monkeypatch):\n    monkeypatch.syspath_prepend('.')", "from headlab.kernels import attention"]
    for source in good:
        assert problems(source) == [], source


def test_no_test_module_imports_another_or_changes_sys_path():
    found = {str(p.relative_to(TESTS)): problems(p.read_text()) for p in sorted(TESTS.rglob("*.py"))}
    assert len(found) > 40 and "fixtures/kernels.py" in found
    assert {name: where for name, where in found.items() if where} == {}


def test_every_test_file_holds_tests():
    """A ``test_*.py`` file without a test is a helper module: it belongs in tests/fixtures/."""
    def has_tests(path: Path) -> bool:
        tree = ast.parse(path.read_text())
        return any((isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test"))
                   or (isinstance(n, ast.ClassDef) and n.name.startswith("Test")) for n in tree.body)

    files = sorted(TESTS.glob("test_*.py"))
    assert len(files) > 40
    assert [p.name for p in files if not has_tests(p)] == []
    assert not list((TESTS / "fixtures").glob("test_*.py"))
