"""Plugins and examples use only public names of ``headlab``, as a third-party package must.

The scan reads every Python file under plugins/ and examples/ (and the code cells of the notebooks) with
``ast`` and fails on: importing a private name from a headlab module (``from headlab.x import _y``),
importing a private headlab module, reading a private attribute of another object (``plan._edits``; a
file's own private names, ``self._x`` and dunder names are allowed, and so are the few private attributes
of third-party libraries listed in ``THIRD_PARTY``), or touching ``__dict__`` / ``vars()``.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SCANNED = ("plugins", "examples")
#: private attributes of other libraries that plugins may read (transformers keeps the attention
#: implementation of a loaded model only there)
THIRD_PARTY = {"_attn_implementation"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for every use of a private headlab name or of ``__dict__`` in ``source``."""
    found: list[tuple[int, str]] = []
    tree = ast.parse(source)
    own = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    own |= {t.attr for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and (
                node.module == "headlab" or node.module.startswith("headlab.")):
            if any(_private(part) for part in node.module.split(".")):
                found.append((node.lineno, f"from {node.module} import ..."))
            found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names
                      if a.name.startswith("headlab.") and any(_private(p) for p in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and node.attr == "__dict__":
            found.append((node.lineno, ".__dict__"))
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own | THIRD_PARTY \
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("vars", "getattr"):
            args = node.args
            if node.func.id == "vars":
                found.append((node.lineno, "vars(...)"))
            elif len(args) > 1 and isinstance(args[1], ast.Constant) and isinstance(args[1].value, str) \
                    and _private(args[1].value):
                found.append((node.lineno, f"getattr(..., {args[1].value!r})"))
    return sorted(found)


def _sources() -> list[tuple[str, str]]:
    out = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "build" in path.parts or ".venv" in path.parts:
                continue
            out.append((str(path.relative_to(ROOT)), path.read_text(encoding="utf-8")))
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        code = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("%", "!")))
        out.append((str(path.relative_to(ROOT)), code))
    return out


def test_the_scan_catches_private_uses():
    bad = ("from headlab.generation import _pad_id\nimport headlab._x\nplan._edits.append(1)\n"
           "plan.__dict__['a'] = 1\nx = getattr(plan, '_callbacks')\nv = vars(plan)\n")
    assert [line for line, _ in private_uses(bad)] == [1, 2, 3, 4, 5, 6]
    good = ("from headlab.instrument import Plan\nplan.edits.append(1)\nclass A:\n    def __init__(self):\n"
            "        self._n = 0\n    def _f(self):\n        return self._n\na = A()\na._f()\n"
            "cfg._attn_implementation\n")
    assert private_uses(good) == []


SOURCES = _sources()


@pytest.mark.parametrize("name,source", SOURCES, ids=[name for name, _ in SOURCES])
def test_no_private_names(name, source):
    uses = private_uses(source)
    assert not uses, f"{name} uses private names of headlab: " + "; ".join(f"line {ln}: {w}" for ln, w in uses)
