"""The import graph of ``headlab.*`` has no cycles.

The graph is built from the AST of every module under headlab/ (the core, headlab/plugins and
headlab/kernels), not by importing anything. Every import counts: at module
level, inside functions (a lazy import that dodges a cycle is still a cycle of the design) and under
``if TYPE_CHECKING:``. Relative imports are resolved; ``from headlab.x import name`` is an edge to the
submodule ``headlab.x.name`` when there is one, else to ``headlab.x`` (its ``__init__`` for a package).
Only headlab modules are nodes, so imports of third-party packages do not count. A cycle is a strongly
connected component of more than one module (or a module importing itself).
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Cycles tolerated while a change removes them; each entry is the set of modules of one cycle, and a
#: strongly connected component of the graph passes when it lies within one entry. It is empty and stays
#: so: the test also fails on an entry that matches no cycle.
KNOWN_CYCLES: list[frozenset[str]] = []


def package_dirs(root: Path) -> dict[str, Path]:
    """The import packages built from the checkout and their directories: ``headlab/`` holds them all."""
    return {"headlab": root / "headlab"}


def module_files(packages: Mapping[str, Path]) -> dict[str, Path]:
    """Every module under the package directories by its dotted name (``__init__.py`` names its package).

    A file under several directories belongs to the deepest one's package."""
    out: dict[str, Path] = {}
    for package, directory in sorted(packages.items(), key=lambda item: len(item[1].parts)):
        for path in sorted(directory.rglob("*.py")):
            parts = path.relative_to(directory).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    return out


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name that ``from <level dots><target> import ...`` in ``module`` refers to."""
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def import_edges(modules: Mapping[str, Path]) -> dict[str, dict[str, list[int]]]:
    """module -> imported module -> the lines of those imports, for imports between ``modules``."""
    known = set(modules)
    edges: dict[str, dict[str, list[int]]] = {m: {} for m in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node.level, node.module)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                           for alias in node.names]
            for target in targets:
                if target in known:
                    edges[module].setdefault(target, []).append(node.lineno)
    return edges


def strongly_connected(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
                components.append(sorted(component))
    return components


def cycles(edges: Mapping[str, Mapping[str, list[int]]]) -> list[list[str]]:
    """The cycles of the import graph: its strongly connected components of more than one module, and
    modules that import themselves."""
    return sorted(c for c in strongly_connected(edges) if len(c) > 1 or c[0] in edges[c[0]])


def describe(component: list[str], edges: Mapping[str, Mapping[str, list[int]]],
             modules: Mapping[str, Path]) -> str:
    """The imports that close a cycle, one per line: ``a -> b (core/a.py:12)``."""
    members = set(component)
    lines = []
    for module in component:
        for target, at in sorted(edges[module].items()):
            if target in members:
                path = modules[module]
                shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                lines.append(f"  {module} -> {target} ({', '.join(f'{shown}:{n}' for n in sorted(at))})")
    return "\n".join(lines)


def graph_of(packages: Mapping[str, Path]) -> tuple[dict[str, Path], dict[str, dict[str, list[int]]]]:
    modules = module_files(packages)
    return modules, import_edges(modules)


def test_the_import_graph_has_no_new_cycles():
    modules, edges = graph_of(package_dirs(ROOT))
    assert {"headlab", "headlab.spec", "headlab.plugin_manager", "headlab.plugins.models.embedded",
            "headlab.kernels"} <= set(modules)
    found = cycles(edges)
    new = [c for c in found if not any(set(c) <= known for known in KNOWN_CYCLES)]
    assert not new, "import cycles:\n" + "\n".join(describe(c, edges, modules) for c in new)
    stale = [sorted(known) for known in KNOWN_CYCLES if not any(set(c) <= known for c in found)]
    assert not stale, f"no longer cycles: remove them from KNOWN_CYCLES: {stale}"


def test_spec_and_the_plugin_manager_do_not_import_each_other():
    modules, edges = graph_of(package_dirs(ROOT))
    spec = {m for m in modules if m == "headlab.spec" or m.startswith("headlab.spec.")}
    assert "headlab.plugin_manager" in {t for m in spec for t in edges[m]}  # the spec reads the registry
    reachable, todo = set(), ["headlab.plugin_manager"]
    while todo:
        for target in edges[todo.pop()]:
            if target not in reachable:
                reachable.add(target)
                todo.append(target)
    assert not reachable & spec, sorted(reachable & spec)
    assert edges["headlab.config"] == {}  # the base types are a leaf
    assert not any("headlab.plugin_manager" in c or "headlab.spec" in c for c in cycles(edges))


#: leaves that hold what several engine modules share (nothing of headlab imported), and the old modules
#: that re-export their names
LEAVES = {"headlab.example": "headlab.context", "headlab.geometry": "headlab.model", "headlab.svg": "headlab.report"}
#: public names a leaf added that its old module does not re-export
NEW_IN_LEAVES: set[str] = set()


def test_the_shared_leaves_import_nothing_of_headlab():
    modules, edges = graph_of(package_dirs(ROOT))
    for leaf in LEAVES:
        assert edges[leaf] == {}, (leaf, edges[leaf])


def test_names_moved_to_a_leaf_are_the_same_objects_in_their_old_module():
    for leaf, old in LEAVES.items():
        leaf_module, old_module = importlib.import_module(leaf), importlib.import_module(old)
        assert leaf_module.__all__ and set(leaf_module.__all__) - NEW_IN_LEAVES <= set(old_module.__all__)
        for name in set(leaf_module.__all__) - NEW_IN_LEAVES:
            assert getattr(old_module, name) is getattr(leaf_module, name), (old, name)
        assert all(hasattr(old_module, name) for name in old_module.__all__), old


def test_instrument_imports_no_spec_module_even_lazily():
    """Over the import graph (function-level and ``TYPE_CHECKING`` imports included): nothing that
    :mod:`headlab.instrument` reaches is ``headlab.spec`` or the spec-facing half of ``headlab.kv``."""
    modules, edges = graph_of(package_dirs(ROOT))
    start = [m for m in modules if m == "headlab.instrument" or m.startswith("headlab.instrument.")]
    reachable, todo = set(start), list(start)
    while todo:
        for target in edges[todo.pop()]:
            if target not in reachable:
                reachable.add(target)
                todo.append(target)
    assert {"headlab.kv.split", "headlab.kv.layers"} <= reachable
    spec_side = {m for m in reachable if m.startswith("headlab.spec") or m in {
        "headlab.kv", "headlab.kv.maps", "headlab.kv.selection", "headlab.config"}}
    assert not spec_side, sorted(spec_side)


def test_loading_instrument_loads_no_spec():
    """In a fresh interpreter, literally ``import headlab.instrument``: it loads the engine modules of
    ``headlab.kv``, and neither ``headlab.spec`` nor the spec-facing ones (``headlab/__init__`` loads the
    public namespace lazily)."""
    code = ("import json, sys, headlab.instrument\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('headlab'))))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert {"headlab", "headlab.instrument", "headlab.kv.split", "headlab.kv.layers"} <= loaded
    assert "headlab.spec" not in loaded and not {m for m in loaded if m.startswith("headlab.spec.")}, sorted(loaded)
    assert not loaded & {"headlab.kv.maps", "headlab.kv.selection", "headlab.config"}, sorted(loaded)


def _write(root: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_finds_a_planted_cycle_through_a_function_level_import(tmp_path):
    _write(tmp_path / "src", {
        "__init__.py": "from .api import run\n",
        "api.py": "from .util import helper\n\ndef run():\n    return helper()\n",
        "util.py": "def helper():\n    from .api import run  # dodges the cycle at import time only\n    return run\n",
        "sub/__init__.py": "",
        "sub/leaf.py": "import os\nfrom .. import util\n",
    })
    modules, edges = graph_of({"pkg": tmp_path / "src"})
    assert set(modules) == {"pkg", "pkg.api", "pkg.util", "pkg.sub", "pkg.sub.leaf"}
    assert edges["pkg.sub.leaf"] == {"pkg.util": [2]}  # `from .. import util` is the submodule, os is no node
    assert cycles(edges) == [["pkg.api", "pkg.util"]]
    assert "pkg.util -> pkg.api (" in describe(["pkg.api", "pkg.util"], edges, modules)


def test_the_checker_counts_type_checking_imports_and_names_of_a_package_init(tmp_path):
    _write(tmp_path / "src", {
        "__init__.py": "from .a import A\n",
        "a.py": "A = 1\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import A\n",
        "c.py": "import pkg.b\n",
    })
    modules, edges = graph_of({"pkg": tmp_path / "src"})
    assert edges["pkg.b"] == {"pkg": [3]}  # A is no submodule: an edge to the package's __init__
    assert edges["pkg.c"] == {"pkg.b": [1]}
    assert cycles(edges) == []
    (tmp_path / "src" / "a.py").write_text("from .b import TYPE_CHECKING\nA = 1\n")
    modules, edges = graph_of({"pkg": tmp_path / "src"})
    assert cycles(edges) == [["pkg", "pkg.a", "pkg.b"]]


def test_a_module_that_imports_itself_is_a_cycle(tmp_path):
    _write(tmp_path / "src", {"__init__.py": "", "a.py": "def f():\n    from . import a\n    return a\n"})
    assert cycles(graph_of({"pkg": tmp_path / "src"})[1]) == [["pkg.a"]]


def readme_layers(text: str) -> list[tuple[str, list[str]]]:
    """The README's layer table, from the leaves up: (layer, the modules it names). A module is a backticked
    name outside parentheses (``kv.split``, ``instrument/`` for a package); names in parentheses describe it."""
    start = text.index("| layer | modules |")
    layers = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        name, cell = (c.strip() for c in line.strip().strip("|").split("|")[:2])
        depth, names = 0, []
        for token in re.finditer(r"`([^`]*)`|\(|\)", cell):
            if token.group(0) in "()":
                depth += 1 if token.group(0) == "(" else -1
            elif depth == 0:
                names.append(token.group(1).rstrip("/"))
        layers.append((name, names))
    return layers


def test_the_readme_layer_table_names_modules_and_imports_point_down():
    """Every module the README's layer table names exists, and no module imports one of a higher layer (a module
    counts in the layer of the longest name that covers it: ``headlab.kv.split`` in ``kv.split``'s, the rest
    of ``headlab.kv`` in ``kv``'s)."""
    modules, edges = graph_of(package_dirs(ROOT))
    layers = readme_layers((ROOT / "README.md").read_text())
    assert len(layers) >= 5
    named: dict[str, int] = {}
    for i, (_, names) in enumerate(layers):
        for name in names:
            assert f"headlab.{name}" in modules, f"README's layer table names {name!r}, which is no module"
            named[f"headlab.{name}"] = i

    def layer(module: str) -> int | None:
        covering = [m for m in named if module == m or module.startswith(m + ".")]
        return named[max(covering, key=len)] if covering else None

    wrong = []
    for importer, targets in edges.items():
        for target, lines in targets.items():
            low, high = layer(target), layer(importer)
            if low is not None and high is not None and low > high:
                wrong.append(f"{importer} ({layers[high][0]}) imports {target} ({layers[low][0]}) at line {lines[0]}")
    assert not wrong, "the README's layer table: an import points up:\n" + "\n".join(wrong)


def test_the_layer_table_reader(tmp_path):
    text = ("| layer | modules |\n|---|---|\n| leaves | `version`, `config` (`ComponentConfig`) |\n"
            "| engine | `kv/` engine: `kv.split` (the `split_call` contract); `instrument/` (`Plan`, `Probes`) |\n\nafter\n")
    assert readme_layers(text) == [("leaves", ["version", "config"]), ("engine", ["kv", "kv.split", "instrument"])]
