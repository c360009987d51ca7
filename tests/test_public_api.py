"""Plugins, the example package and the ``headlab new-plugin`` templates use only headlab's public namespace.

Every Python file under plugins/ and examples/, every template ``*.py.tmpl`` of ``headlab new-plugin`` (with
its ``$placeholders`` filled) and the code cells of the notebooks are read with ``ast``; the scan fails on:

- a headlab module that is not one of :data:`PUBLIC_MODULES` (``from headlab.instrument import Plan``,
  ``import headlab.model``): plugins reach core only through ``headlab`` and the modules of
  :data:`PUBLIC_MODULES`;
- a name that is not in that module's ``__all__`` (``from headlab.decoding import forward``, or
  ``headlab.x`` for an ``x`` outside ``headlab.__all__``); no underscore rule, a module says itself what it
  offers;
- ``headlab.runner`` / ``headlab.plugin_manager`` outside plugins/executors, whose job is to run cells
  (:data:`EXECUTOR_MODULES`; there too, only names in their ``__all__``);
- an import across built-in plugin packages: plugins/detectors importing plugins/metrics, absolutely
  (``from headlab.plugins.metrics.rouge import rouge1``) or relatively (``from ..metrics import rouge``); a
  relative import inside one package (``from .common import x`` within plugins/decoding) is fine, one that
  climbs out of the package (to ``headlab.plugins`` or core) is not, and the example package and the
  templates import no built-in plugin at all;
- a private attribute of another object (``plan._edits``; a file's own private names, ``self._x`` and
  dunder names are allowed, and so are the few private attributes of third-party libraries listed in
  :data:`THIRD_PARTY`), or ``__dict__`` / ``vars()``.

The public modules and what each is for are :data:`PUBLIC_MODULES` of tools/public_namespace.py, whose page of
each module's ``__all__`` the docs site generates (API reference, "Public namespace"); that page is checked here.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
DOC = ROOT / "docs" / "plugins.md"
TEMPLATES = ROOT / "headlab" / "templates" / "new_plugin"
_spec = importlib.util.spec_from_file_location("public_namespace", ROOT / "tools" / "public_namespace.py")
public_namespace = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(public_namespace)
#: the modules plugins import from, with what each is for (tools/public_namespace.py)
PUBLIC_MODULES: dict[str, str] = public_namespace.PUBLIC_MODULES
exported = public_namespace.exported

#: modules only executors (plugins/executors) may import from
EXECUTOR_MODULES = ("headlab.runner", "headlab.plugin_manager")
#: private attributes of other libraries that plugins may read (transformers keeps the attention
#: implementation of a loaded model only there)
THIRD_PARTY = {"_attn_implementation"}


@dataclass(frozen=True)
class Where:
    """What a scanned source is: its plugin package under plugins/ (``detectors``; None outside plugins/),
    whether it is an executor, and its own dotted module name (to resolve relative imports)."""

    package: str | None = None
    module: str = ""
    is_package: bool = False

    @property
    def executor(self) -> bool:
        return self.package == "executors"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _resolve(where: Where, level: int, target: str | None) -> str:
    base = where.module.split(".") if where.is_package else where.module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, target] if target else base)


def _module_problem(module: str, where: Where) -> str | None:
    """Why ``module`` may not be imported from ``where`` (None: it may)."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] == "plugins":
        if where.package is None:
            return f"{module}: a built-in plugin; import headlab's public modules, not a plugin's code"
        other = parts[2] if len(parts) > 2 else None
        if other != where.package:
            return (f"{module}: an import across built-in plugin packages (plugins/{where.package} -> "
                    f"plugins/{other or ''}); move what is shared to a public core module or call "
                    "headlab.component(category, kind)")
        return None
    if module in EXECUTOR_MODULES:
        return None if where.executor else f"{module}: runner and plugin-manager internals are for executors only"
    if module not in PUBLIC_MODULES:
        return f"{module}: not a public module (docs/plugins.md, The public namespace)"
    return None


def _attribute_chain(node: ast.Attribute) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def _relative_problem(module: str, where: Where) -> str | None:
    """Why a relative import that resolves to ``module`` may not be made from ``where`` (None: it may)."""
    if where.package is not None:
        own = f"headlab.plugins.{where.package}"
    elif where.module:  # the example package: anywhere inside its own top-level package
        own = where.module.split(".")[0]
    else:
        return "a relative import outside a package"
    if module == own or module.startswith(own + "."):
        return None
    return f"{module}: a relative import out of its plugin package ({own})"


def _from_problem(module: str, name: str, where: Where) -> str | None:
    """Why ``from module import name`` may not be made from ``where`` (None: it may)."""
    names = exported(module)
    if names is not None and name in names:
        return None
    if isinstance(getattr(importlib.import_module(module), name, None), types.ModuleType):
        return _module_problem(f"{module}.{name}", where)
    return f"{module} has no __all__" if names is None else f"{name} is not in {module}.__all__"


def import_problems(source: str, where: Where = Where()) -> list[tuple[int, str]]:
    """(line, why) for every import of ``source`` that leaves headlab's public namespace (module docs)."""
    found: list[tuple[int, str]] = []
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # local name -> headlab module bound by `import headlab[.x] [as y]`
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            problem = _relative_problem(_resolve(where, node.level, node.module), where)
            if problem:
                found.append((node.lineno, f"from {'.' * node.level}{node.module or ''} import ...: {problem}"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "headlab":
            module = node.module or ""
            problem = _module_problem(module, where)
            if problem:
                found.append((node.lineno, problem))
            elif module.split(".")[1:2] != ["plugins"]:
                found += [(node.lineno, p) for alias in node.names
                          if (p := _from_problem(module, alias.name, where))]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "headlab":
                    continue
                problem = None if alias.name == "headlab" else _module_problem(alias.name, where)
                if problem:
                    found.append((node.lineno, problem))
                aliases[alias.asname or "headlab"] = alias.name if alias.asname else "headlab"
    for node in ast.walk(tree):
        chain = _attribute_chain(node) if isinstance(node, ast.Attribute) else None
        if not chain or chain[0] not in aliases:
            continue
        module, rest = aliases[chain[0]], chain[1:]
        while rest and f"{module}.{rest[0]}" in {*PUBLIC_MODULES, *EXECUTOR_MODULES}:
            module, rest = f"{module}.{rest[0]}", rest[1:]
        if rest and rest[0] != "plugins":
            problem = _module_problem(module, where) or _from_problem(module, rest[0], where)
            if problem:
                found.append((node.lineno, problem))
        elif rest:
            found.append((node.lineno, _module_problem("headlab.plugins", where) or "headlab.plugins"))
    return sorted(set(found))


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for every private attribute of another object, ``__dict__`` or ``vars()`` in ``source``."""
    found: list[tuple[int, str]] = []
    tree = ast.parse(source)
    own = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    own |= {t.attr for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "__dict__":
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


def _where(path: Path) -> Where:
    rel = path.relative_to(ROOT)
    parts = rel.with_suffix("").parts
    is_package = parts[-1] == "__init__"
    if parts[:2] == ("headlab", "plugins"):
        parts = parts[1:]
        dotted = ["headlab", *parts]
        return Where(package=parts[1] if len(parts) > 2 else None,
                     module=".".join(dotted[:-1] if is_package else dotted), is_package=is_package)
    if parts[0] == "examples" and len(parts) > 2:  # examples/<distribution>/<package>/...
        dotted = list(parts[2:])
        return Where(module=".".join(dotted[:-1] if is_package else dotted), is_package=is_package)
    return Where()


def _template_source(path: Path) -> str:
    """A template with its ``$placeholders`` replaced by identifiers (what ``headlab new-plugin`` writes)."""
    return re.sub(r"\$(\w+)", r"\1", path.read_text(encoding="utf-8"))


def _sources() -> list[tuple[str, str, Where | None]]:
    """(name, code, where) of every scanned source; ``where`` None: a notebook, whose imports are free
    (it is not a plugin), only its private uses are checked."""
    out = []
    for top in ("headlab/plugins", "examples"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if "build" in path.parts or ".venv" in path.parts:
                continue
            out.append((str(path.relative_to(ROOT)), path.read_text(encoding="utf-8"), _where(path)))
    for path in sorted(TEMPLATES.rglob("*.py.tmpl")):
        out.append((str(path.relative_to(ROOT)), _template_source(path), Where()))
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        code = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("%", "!")))
        out.append((str(path.relative_to(ROOT)), code, None))
    return out


SOURCES = _sources()
DETECTORS = Where(package="detectors", module="headlab.plugins.detectors.retrieval")
DECODING = Where(package="decoding", module="headlab.plugins.decoding.dola")
EXECUTORS = Where(package="executors", module="headlab.plugins.executors.ray")


def test_the_scan_catches_each_kind_of_violation():
    cases = [
        ("from headlab.instrument import Plan\n", DETECTORS, "not a public module"),
        ("import headlab.model\n", DETECTORS, "not a public module"),
        ("from headlab.decoding import forward\n", DETECTORS, "not in headlab.decoding.__all__"),
        ("from headlab import Manager\n", DETECTORS, "not in headlab.__all__"),
        ("import headlab\nheadlab.get_manager()\n", DETECTORS, "not in headlab.__all__"),
        ("import headlab\nheadlab.generation.continuation(lm, None)\n", DETECTORS, "generation.__all__"),
        ("from headlab.runner import Job\n", DETECTORS, "executors only"),
        ("from headlab.plugin_manager import get_manager\n", DECODING, "executors only"),
        ("from headlab.runner import run_cell\n", EXECUTORS, "not in headlab.runner.__all__"),
        ("from headlab.plugins.metrics.rouge import rouge1\n", DETECTORS, "across built-in plugin packages"),
        ("from headlab.plugins import metrics\n", DETECTORS, "across built-in plugin packages"),
        ("from ..metrics.rouge import rouge1\n", DETECTORS, "out of its plugin package"),
        ("from .. import generation\n", DETECTORS, "out of its plugin package"),
        ("from headlab.plugins.tasks.shapes import SHAPES\n", Where(), "a built-in plugin"),
    ]
    for source, where, why in cases:
        problems = import_problems(source, where)
        assert problems and all(why in p for _, p in problems), (source, problems)
    bad = "plan._edits.append(1)\nplan.__dict__['a'] = 1\nx = getattr(plan, '_callbacks')\nv = vars(plan)\n"
    assert [line for line, _ in private_uses(bad)] == [1, 2, 3, 4]


def test_the_scan_lets_the_public_namespace_through():
    good = ("import headlab\nfrom headlab import Plan, Probes, forward\nfrom headlab.generation import Rows, "
            "decode_loop\nfrom headlab.spec import PositiveInt\nfrom .common import entropy_alpha\n"
            "headlab.forward(lm, batch)\nheadlab.generation.decode_loop(request, choose)\n"
            "from headlab.plugins.decoding.common import final_norm\n")
    assert import_problems(good, DECODING) == []
    executor = "from headlab.runner import CellTask, Job, execute_cell\nfrom headlab.plugin_manager import PluginError\n"
    assert import_problems(executor, EXECUTORS) == []
    example = Where(module="headlab_plugin_example.decoding")
    assert import_problems("from . import steering\nfrom .steering import steer\n", example) == []
    own = ("class A:\n    def __init__(self):\n        self._n = 0\n    def _f(self):\n        return self._n\n"
           "a = A()\na._f()\ncfg._attn_implementation\n")
    assert private_uses(own) == []


def test_every_public_module_declares_what_it_offers():
    for module in [*PUBLIC_MODULES, *EXECUTOR_MODULES]:
        names = exported(module)
        assert names, f"{module} has no __all__"
        mod = importlib.import_module(module)
        missing = sorted(n for n in names if not hasattr(mod, n))
        assert not missing, f"{module}.__all__ names what it does not define: {missing}"


@pytest.mark.parametrize("name,source,where", SOURCES, ids=[name for name, _, _ in SOURCES])
def test_only_the_public_namespace(name, source, where):
    problems = (import_problems(source, where) if where is not None else []) + private_uses(source)
    assert not problems, f"{name} leaves headlab's public namespace: " + "; ".join(
        f"line {ln}: {why}" for ln, why in problems)


def test_the_scan_covers_plugins_examples_and_templates():
    names = {name for name, _, _ in SOURCES}
    assert "headlab/plugins/detectors/retrieval.py" in names and "headlab/plugins/executors/ray.py" in names
    assert any(n.startswith("examples/headlab-plugin-example/headlab_plugin_example/") for n in names)
    kinds = {n.split("/")[3] for n in names if n.startswith("headlab/templates/")}
    assert kinds == {"decoder", "detector", "metric", "steering", "task"}


# --------------------------------------------------------------------------- the site's "Public namespace"
def test_the_generated_page_lists_each_public_module_and_exactly_its_names():
    """The page tools/mkdocs_hooks.py adds to the API reference: one section per public module, in the order of
    PUBLIC_MODULES, with what it is for and the names of its ``__all__``, each once; nothing else."""
    page = public_namespace.namespace_page({"headlab.plugin": "headlab.plugin.md"})
    sections = re.split(r"^## ", page, flags=re.M)[1:]
    assert [re.search(r"`([\w.]+)`", s).group(1) for s in sections] == list(PUBLIC_MODULES)
    assert sections[0].startswith("[`headlab.plugin`](headlab.plugin.md)\n")
    assert sections[1].startswith("`headlab`\n")
    for module, section in zip(PUBLIC_MODULES, sections, strict=True):
        _, about, names = section.strip().split("\n\n")
        assert about.lower() == PUBLIC_MODULES[module].lower() + "."
        listed = re.findall(r"`([^`]+)`", names)
        assert sorted(listed) == sorted(exported(module)), module
        assert listed == sorted(listed, key=lambda n: (n.lower().lstrip("_"), n))


def test_the_guide_points_at_the_generated_page_and_keeps_no_copy():
    text = DOC.read_text(encoding="utf-8")
    assert "public-namespace:begin" not in text
    assert "Public namespace" in text and "tools/public_namespace.py" in text
