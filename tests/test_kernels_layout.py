"""headlab.kernels' own layout, read from the source with ``ast``: no Triton function takes more than 30
parameters (they take bundled tuples), the modules of kernels/ form no import cycle (the contract is a leaf,
each path imports only the contract, the dispatcher imports the paths), none imports another's private
names, and every module declares ``__all__``."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import headlab.kernels

KERNELS = Path(headlab.kernels.__file__).resolve().parent
MODULES = sorted(p.stem for p in KERNELS.glob("*.py"))
MAX_PARAMS = 30


def _is_triton_jit(decorator: ast.expr) -> bool:
    node = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(node, ast.Attribute) and node.attr == "jit" and getattr(node.value, "id", "") == "triton"


def jit_param_counts(source: str) -> dict[str, int]:
    """Parameters of each ``@triton.jit`` function defined in ``source``."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and any(_is_triton_jit(d) for d in node.decorator_list):
            a = node.args
            out[node.name] = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
    return out


def kernel_imports(source: str) -> dict[str, set[str]]:
    """The modules of kernels/ that ``source`` (a module of kernels/) imports, anywhere in it (functions too),
    each with the names it takes from them."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            if node.level == 1 and node.module is None:  # from . import module
                for n in names:
                    if n in MODULES:
                        out.setdefault(n, set())
            elif node.level == 1 or (node.module or "").startswith("headlab.kernels."):
                out.setdefault(node.module.rsplit(".", 1)[-1], set()).update(names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("headlab.kernels."):
                    out.setdefault(a.name.rsplit(".", 1)[-1], set())
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> imported modules) as a path ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def _graph() -> dict[str, dict[str, set[str]]]:
    return {m: kernel_imports((KERNELS / f"{m}.py").read_text()) for m in MODULES}


def test_no_triton_function_takes_more_than_30_parameters():
    counts = jit_param_counts((KERNELS / "triton_attention.py").read_text())
    assert {"_attn_fwd", "_attn_fwd_inner", "_pair_fwd", "_scores", "_softcap", "_visible"} <= set(counts)
    assert {name: n for name, n in counts.items() if n > MAX_PARAMS} == {}


def test_the_parameter_count_reads_jit_functions_only():
    src = ("import triton\n@triton.jit\ndef f(a, b, C: tl.constexpr):\n    pass\n\n"
           "@triton.jit(debug=True)\ndef g(x, *, y):\n    pass\n\ndef host(a, b, c, d):\n    pass\n")
    assert jit_param_counts(src) == {"f": 3, "g": 2}


def test_kernels_modules_form_no_import_cycle():
    graph = {m: set(imports) for m, imports in _graph().items()}
    assert graph["contract"] == set() and graph["triton_args"] == set()
    assert graph["torch_attention"] == {"contract"} and graph["triton_attention"] == {"contract", "triton_args"}
    assert graph["attention"] == {"contract", "torch_attention", "triton_attention"}
    assert find_cycle(graph) is None


def test_the_cycle_check_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    src = "from . import torch_attention\nfrom .contract import _x\ndef f():\n    from headlab.kernels.attention import y\n"
    assert kernel_imports(src) == {"torch_attention": set(), "contract": {"_x"}, "attention": {"y"}}


def test_no_private_names_cross_modules():
    private = {(m, dep, n) for m, imports in _graph().items() for dep, names in imports.items() for n in names
               if n.startswith("_")}
    assert private == set()


def test_every_kernels_module_declares_all():
    for m in MODULES:
        if m == "triton_attention":
            pytest.importorskip("triton")
        mod = importlib.import_module(f"headlab.kernels.{m}" if m != "__init__" else "headlab.kernels")
        assert isinstance(getattr(mod, "__all__", None), list) and mod.__all__, m
        assert [n for n in mod.__all__ if not hasattr(mod, n)] == [], m
