"""``headlab.kv`` is a package of one concern per module: its public names keep working from ``headlab.kv``,
and each module is short and says its concern (tests/test_import_graph.py checks that the engine modules
:mod:`headlab.instrument` imports load without the spec-facing ones)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import headlab.kv

KV = Path(__file__).resolve().parent.parent / "headlab" / "kv"

#: the public names of ``headlab.kv`` when it was one module; they keep working from the package
NAMES = {"DuoHeadsFile", "GqaRule", "HeadBudgetLayer", "HeadMap", "HeadwiseCache", "HeadwiseLayer", "KvHeadSelection",
         "KvPolicyError", "KvUsage", "SplitCall", "kv_heads", "kv_policy", "random_kv_heads", "read_duo_heads",
         "split_call", "HeadBudgetMap", "HeadScoreSource", "KvBudget", "ScoresFile", "ScoresFrom", "head_scores",
         "headkv_allocation", "kv_head_scores", "kv_priority", "read_head_scores", "snapkv_keep", "to_kvpress",
         "token_bytes"}


def _modules() -> list[str]:
    return sorted(f"headlab.kv.{path.stem}" for path in KV.glob("*.py") if path.stem != "__init__")


def test_every_public_name_has_one_home_module_and_the_package_gives_that_object():
    assert len(NAMES) == 28 and set(headlab.kv.__all__) == NAMES
    homes: dict[str, list[str]] = {}
    for name in _modules():
        for exported in getattr(importlib.import_module(name), "__all__", ()):
            homes.setdefault(exported, []).append(name)
    for name in NAMES:
        assert len(homes.get(name, [])) == 1, (name, homes.get(name))
        assert getattr(headlab.kv, name) is getattr(importlib.import_module(homes[name][0]), name), name
    assert NAMES <= set(dir(headlab.kv))
    namespace: dict[str, object] = {}
    exec("from headlab.kv import *", namespace)  # noqa: S102 - the star import a notebook may use
    assert NAMES <= set(namespace)


def test_each_module_of_the_package_is_short_and_names_its_concern():
    for path in sorted(KV.glob("*.py")):
        text = path.read_text(encoding="utf-8")
        assert len(text.splitlines()) <= 800, path.name
        doc = ast.get_docstring(ast.parse(text))
        assert doc and len(doc.splitlines()[0]) > 20, path.name
