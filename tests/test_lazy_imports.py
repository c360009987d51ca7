"""Imports inside functions under headlab/ are the exception, each with a reason.

An import belongs at the top of its module unless it (1) imports an optional dependency (:data:`OPTIONAL`), (2)
keeps start-up light: the importing module is loaded by ``import headlab.cli`` and the plugins, and what it
imports is not (a module start-up does not load, or a lazy attribute of a package such as transformers); this
is checked in a fresh interpreter, not taken on trust; or (3) is listed in :data:`KEPT` with its reason. The
imports are read with ``ast``: one per imported module (``from .x import a, b`` is one); at most :data:`MOST` remain.
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: top-level packages that headlab's core dependencies do not install -> where they come from
OPTIONAL: dict[str, str] = {
    "lm_eval": "the eval extra", "datasets": "the eval extra (lm-eval installs it)",
    "accelerate": "the eval extra (lm-eval[hf] installs it); model loading with device_map needs it",
    "ray": "the ray extra", "triton": "the triton extra (Linux, CUDA)", "kvpress": "the kvpress extra",
    "psutil": "not a dependency: used when installed (machine memory)", "ipywidgets": "the notebook extra",
    "anywidget": "the notebook extra", "matplotlib": "the notebook extra", "playwright": "the notebook extra",
    "IPython": "the notebook extra",
}
#: most imports inside functions there may be (issue #38: from 183, then 73, to at most 40)
MOST = 40
#: (file, imported module) -> why the import stays inside its function
KEPT: dict[tuple[str, str], str] = {
    ("headlab/circuit_view.py", "transformers"): "AutoTokenizer loads transformers' tokenizer classes; only the "
        "view of a model that no registered loader knows needs it",
    ("headlab/circuit_view.py", "scipy.stats"): "scipy.stats is a large import, and the report imports circuit_view "
        "for every run; only the rank correlation of patching results needs it",
}


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _target(path: Path, node: ast.Import | ast.ImportFrom, root: Path) -> list[tuple[str, tuple[str, ...]]]:
    """(imported module, names taken from it) of one import statement."""
    if isinstance(node, ast.Import):
        return [(alias.name, ()) for alias in node.names]
    if node.level == 0:
        return [(node.module or "", tuple(a.name for a in node.names))]
    base = _module_name(path, root).split(".")
    base = base if path.name == "__init__.py" else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    if node.module:
        return [(".".join([*base, node.module]), tuple(a.name for a in node.names))]
    return [(".".join([*base, a.name]), ()) for a in node.names]


@functools.cache
def function_level_imports(root: Path = ROOT) -> list[tuple[str, int, str, tuple[str, ...]]]:
    """(file relative to the root, line, imported module, names) of every import inside a function."""
    found: list[tuple[str, int, str, tuple[str, ...]]] = []

    def visit(path: Path, node: ast.AST, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if inside and isinstance(child, (ast.Import, ast.ImportFrom)):
                for module, names in _target(path, child, root):
                    found.append((path.relative_to(root).as_posix(), child.lineno, module, names))
            visit(path, child, inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    for path in sorted((root / "headlab").rglob("*.py")):
        visit(path, ast.parse(path.read_text()), False)
    return found


#: run in a fresh interpreter: what ``import headlab.cli`` and loading the plugins leave loaded
PROBE = """
import json, sys
import headlab.cli
from headlab.plugin_manager import get_manager
get_manager()
asked = json.loads(sys.stdin.read())
out = []
for parts in asked:
    live = [sys.modules.get(module) for module, _ in parts]
    out.append(all(m is not None and all(n in vars(m) for n in names) for m, (_, names) in zip(live, parts)))
print(json.dumps({"modules": sorted(sys.modules), "loaded": out}))
"""


def _asked(module: str, names: tuple[str, ...]) -> list[tuple[str, list[str]]]:
    """What must be loaded for ``from module import names`` to cost nothing: the module with the names, and
    for a name that a lazy package (``headlab``) loads on first use, the module that defines it."""
    lazy = _declared_homes(ROOT / "headlab" / "__init__.py") if module == "headlab" else {}
    asked = [(module, [n for n in names if n not in lazy])]
    return asked + [(lazy[n], [n]) for n in names if n in lazy]


def test_every_function_level_import_has_a_reason():
    imports = function_level_imports()
    asked = [_asked(module, names) for _, _, module, names in imports]
    done = subprocess.run([sys.executable, "-c", PROBE], input=json.dumps(asked), capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    at_start = set(probe["modules"])
    unexplained, used = [], set()
    for (file, line, module, _), loaded in zip(imports, probe["loaded"], strict=True):
        importer = _module_name(ROOT / file)
        if module.split(".")[0] in OPTIONAL:
            continue
        if importer in at_start and not loaded:
            continue
        if (file, module) in KEPT:
            used.add((file, module))
            continue
        unexplained.append(f"{file}:{line}: import of {module} inside a function: move it to the top of the "
                           "module, or give the reason it stays in KEPT")
    assert not unexplained, "\n".join(unexplained)
    assert not set(KEPT) - used, f"no longer imported inside a function: remove from KEPT: {sorted(set(KEPT) - used)}"


def test_few_imports_stay_inside_functions():
    imports = function_level_imports()
    assert len(imports) <= MOST, "\n".join(f"{file}:{line}: {module}" for file, line, module, _ in imports)


def test_the_scan_reads_imports_inside_functions_only(tmp_path):
    package = tmp_path / "headlab"
    package.mkdir()
    (package / "__init__.py").write_text("import json\n")
    (package / "a.py").write_text("import os\n\ndef f():\n    import re\n    from . import b\n    from .c import x, y\n\n"
                                  "class K:\n    def m(self):\n        if True:\n            from json import dumps\n")
    assert function_level_imports(tmp_path) == [
        ("headlab/a.py", 4, "re", ()), ("headlab/a.py", 5, "headlab.b", ()), ("headlab/a.py", 6, "headlab.c", ("x", "y")),
        ("headlab/a.py", 11, "json", ("dumps",))]


def _declared_homes(init: Path) -> dict[str, str]:
    """name -> defining module, from the ``if TYPE_CHECKING:`` imports of a lazy package's ``__init__.py`` (what
    type checkers and the API reference read)."""
    tree = ast.parse(init.read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    return {alias.name: f"{_module_name(init)}.{node.module}" for node in block.body
            if isinstance(node, ast.ImportFrom) for alias in node.names}


def test_import_headlab_loads_no_submodule():
    code = "import json, sys, headlab\nprint(json.dumps(sorted(m for m in sys.modules if m.startswith('headlab'))))\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["headlab"]


def test_every_public_name_is_the_object_of_its_declared_module():
    import importlib

    import headlab

    homes = _declared_homes(ROOT / "headlab" / "__init__.py")
    assert set(homes) == set(headlab.__all__)
    for name, home in homes.items():
        assert getattr(headlab, name) is getattr(importlib.import_module(home), name), name
    namespace: dict[str, object] = {}
    exec("from headlab import *", namespace)  # noqa: S102 - the star import a notebook may use
    assert set(namespace) - {"__builtins__"} == set(headlab.__all__)
    assert set(headlab.__all__) <= set(dir(headlab))
    assert headlab.harness is importlib.import_module("headlab.harness")  # a submodule, loaded on first use
    assert not hasattr(headlab, "no_such_name") and not hasattr(headlab, "no.such")
