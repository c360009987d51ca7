"""``headlab.plugin``, the plugin author's facade: what the templates and the example package import, and
``forward`` with probes alone (the minimal detector's call)."""

from __future__ import annotations

import ast
from pathlib import Path
from string import Template

import pytest
import torch

import headlab
import headlab.plugin as facade
from headlab.generation import tokenize

ROOT = Path(__file__).parent.parent
TEMPLATES = ROOT / "headlab" / "templates" / "new_plugin"
EXAMPLE = ROOT / "examples" / "headlab-plugin-example" / "headlab_plugin_example"
#: what ``headlab new-plugin`` fills into a template
VALUES = {"kind": "sinks", "package": "headlab_sinks", "dist": "headlab-sinks", "config_class": "Sinks"}


def headlab_imports(source: str) -> list[tuple[str, str]]:
    """(module, name) of every headlab name a source imports; ``import headlab.x`` gives (``headlab.x``, "")."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "headlab":
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name.split(".")[0] == "headlab"]
    return found


def rendered(path: Path) -> str:
    return Template(path.read_text()).substitute(VALUES)


def test_the_detector_template_imports_at_most_six_names_all_from_the_facade():
    imports = headlab_imports(rendered(TEMPLATES / "detector" / "plugin.py.tmpl"))
    assert {module for module, _ in imports} == {"headlab.plugin"}
    assert len({name for _, name in imports}) <= 6
    assert {name for _, name in imports} <= set(facade.__all__)


def test_the_scan_counts_every_headlab_import():
    source = "import headlab\nimport numpy\nfrom headlab.spec import PositiveInt\nfrom headlab.plugin import Plan, forward\n"
    assert headlab_imports(source) == [("headlab", ""), ("headlab.spec", "PositiveInt"), ("headlab.plugin", "Plan"),
                                       ("headlab.plugin", "forward")]


PLUGIN_SOURCES = sorted(TEMPLATES.glob("*/plugin.py.tmpl")) + sorted(EXAMPLE.glob("*.py"))


@pytest.mark.parametrize("path", PLUGIN_SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_template_and_example_plugins_import_headlab_only_through_the_facade(path):
    source = rendered(path) if path.suffix == ".tmpl" else path.read_text()
    imports = headlab_imports(source)
    assert imports, "a plugin module imports headlab"
    assert {module for module, _ in imports} == {"headlab.plugin"}, imports


def test_the_facade_re_exports_public_objects_and_its_map_names_each_one():
    homes = [headlab, headlab.spec, headlab.generation, headlab.dims, headlab.anatomy]
    for name in facade.__all__:
        obj = getattr(facade, name)
        assert any(name in getattr(m, "__all__", ()) and getattr(m, name) is obj for m in homes), name
        assert f"``{name}``" in facade.__doc__, f"the module docstring does not say what {name} is for"
    assert len(facade.__all__) == len(set(facade.__all__))


@pytest.fixture(scope="module")
def lm():
    from fixtures.specs import TINY_LLAMA

    return headlab.from_config(headlab.spec.ModelSpec(config=dict(TINY_LLAMA), device="cpu"), seed=0)


def test_forward_with_probes_alone_is_a_plan_of_those_probes(lm):
    batch = tokenize(lm, [headlab.Example(prompt="", input_ids=ids) for ids in ([5, 17, 42, 8, 8], [9, 3, 77])])
    probes = facade.Probes(spans=[[(p, p + 1)] for p in batch.pad], argmax=True)
    out, rec = facade.forward(lm, batch, probes)
    ref_out, ref = facade.forward(lm, batch, facade.Plan(probes=facade.Probes(spans=probes.spans, argmax=True)))
    torch.testing.assert_close(out.logits, ref_out.logits)
    torch.testing.assert_close(rec.span_mass, ref.span_mass)
    torch.testing.assert_close(rec.argmax, ref.argmax)
