"""The test suite's own layout: test modules share helpers through tests/fixtures/ (``from fixtures.<area>
import ...``) and pytest fixtures through tests/conftest.py, never by importing one another or conftest or by
editing ``sys.path`` (pytest puts tests/ on it when it loads tests/conftest.py), and every ``test_*.py`` file
holds tests (a helper module is not named like one).

The scan reads every Python file under tests/ with ``ast`` and fails on ``import test_x`` /
``from test_x import ...``, on any import of conftest, and on code that changes ``sys.path``
(``sys.path.insert``, assignment, ...). Code inside a string (a command line for a subprocess) is not code to
``ast`` and passes, and so does pytest's ``monkeypatch.syspath_prepend``, which is undone after its test; a
script in a string that imports conftest (a line ``from conftest import ...``) is caught by its text.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
MUTATORS = {"insert", "append", "extend", "remove", "pop", "clear", "sort", "reverse", "__setitem__",
            "__delitem__", "__iadd__"}
SCRIPT_IMPORT = re.compile(r"[ \t]*(from[ \t]+conftest[ \t]+import|import[ \t]+conftest\b)")


def _is_test_module(name: str) -> bool:
    return any(part.startswith("test_") for part in name.split("."))


def _is_shared(name: str) -> bool:
    """A module no test file may import: a test module, or conftest (its helpers live in tests/fixtures/)."""
    return _is_test_module(name) or "conftest" in name.split(".")


def _is_sys_path(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def problems(source: str) -> list[str]:
    """Where one file's source imports a test module or conftest, or changes ``sys.path``
    (``line N: ...``)."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [f"line {node.lineno}: import {a.name}" for a in node.names if _is_shared(a.name)]
        elif isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            if _is_shared(node.module or "") or any(_is_shared(n) for n in names):
                out.append(f"line {node.lineno}: from {'.' * node.level}{node.module or ''} import {names}")
            if node.module == "sys" and "path" in names:
                out.append(f"line {node.lineno}: from sys import path")
        elif isinstance(node, ast.Call):
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            arg = node.args[0] if node.args else None
            if (fn in ("import_module", "__import__") and isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str) and _is_shared(arg.value)):
                out.append(f"line {node.lineno}: {fn}({arg.value!r})")
        elif _is_sys_path(node):
            up = parents.get(node)
            changed = (isinstance(node.ctx, (ast.Store, ast.Del))
                       or (isinstance(up, ast.Attribute) and up.attr in MUTATORS)
                       or (isinstance(up, ast.Subscript) and isinstance(up.ctx, (ast.Store, ast.Del))))
            if changed:
                out.append(f"line {node.lineno}: changes sys.path")
    strings = [n for n in ast.walk(tree)
               if isinstance(n, ast.JoinedStr) or (isinstance(n, ast.Constant) and isinstance(n.value, str))]
    in_strings = {i for n in strings for i in range(n.lineno, (n.end_lineno or n.lineno) + 1)}
    out += [f"line {n}: a script in a string imports conftest"
            for n, line in enumerate(source.splitlines(), 1) if n in in_strings and SCRIPT_IMPORT.match(line)]
    return sorted(out)


def test_the_scan_catches_imports_of_test_modules_and_conftest_and_sys_path_changes():
    bad = ["from test_kernels import check", "import test_steering_pasta", "import os, test_x as t",
           "from tests.test_kernels import check", "from . import test_kernels",
           "import importlib\nimportlib.import_module('test_kernels')",
           "import sys\nsys.path.insert(0, '.')", "import sys\nsys.path.append('.')", "import sys\nsys.path = []",
           "import sys\nsys.path[:0] = ['.']", "import sys\nsys.path += ['.']", "import sys\ndel sys.path[0]",
           "from sys import path", "from conftest import x", "from conftest import TINY_LLAMA, spec_text",
           "import conftest", "import conftest as c", "from tests.conftest import x",
           "from . import conftest", "from tests import conftest", "def f():\n    from conftest import x",
           "import importlib\nimportlib.import_module('conftest')", "__import__('conftest')",
           'SCRIPT = """\nimport sys\nfrom conftest import spec_text\n"""',
           "S = f'''\n  import conftest\n{1}'''"]
    for source in bad:
        assert problems(source), source
    good = ["from fixtures.kernels import check", "from fixtures.specs import spec_text",
            "import sys\nn = len(sys.path)",
            "import subprocess, sys\n"
            "subprocess.run([sys.executable, '-c', 'import sys; sys.path.insert(0, \"x\")'])",
            "def test_x(monkeypatch):\n    monkeypatch.syspath_prepend('.')", "from headlab.kernels import attention",
            'SCRIPT = """\nimport sys\nfrom fixtures.specs import spec_text\n"""', "import myconftest",
            "from fixtures.specs import spec_text  # not from conftest import spec_text"]
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
