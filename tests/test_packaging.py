"""Packaging: core/ -> headlab, plugins/ -> headlab.plugins, kernels/ -> headlab.kernels, wheel and editable."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

from headlab.scaffold import KINDS

ROOT = Path(__file__).parent.parent
ROOTS = {"headlab": "core", "headlab.plugins": "plugins", "headlab.kernels": "kernels"}


def declared_packages() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]


def test_every_package_directory_is_declared():
    found = set()
    for pkg, directory in ROOTS.items():
        base = ROOT / directory
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            if "headlab-tiny" in rel.parts or any(p.startswith(".") for p in rel.parts):
                continue
            name = ".".join([pkg, *rel.parts]) if rel.parts else pkg
            if pkg == "headlab" and rel.parts and rel.parts[0] in ("plugins", "kernels"):
                continue
            found.add(name)
    assert found == set(declared_packages())


def test_editable_install_maps_directories():
    import headlab
    import headlab.kernels
    import headlab.plugins.detectors

    assert Path(headlab.__file__).parent == ROOT / "core"
    assert Path(headlab.plugins.detectors.__file__).parent == ROOT / "plugins" / "detectors"
    assert Path(headlab.kernels.__file__).parent == ROOT / "kernels"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "-w", str(out), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    (whl,) = out.glob("headlab-*.whl")
    return whl


def test_wheel_contents_and_import(wheel, tmp_path):
    names = zipfile.ZipFile(wheel).namelist()
    for expected in ("headlab/__init__.py", "headlab/spec/__init__.py", "headlab/plugins/detectors/patterns.py",
                     "headlab/kernels/__init__.py", "headlab/templates/new_plugin/pyproject.toml.tmpl",
                     *(f"headlab/templates/new_plugin/{kind}/{name}.tmpl" for kind in KINDS
                       for name in ("plugin.py", "test_plugin.py", "README.md"))):
        assert expected in names
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    code = ("import headlab, headlab.kernels, headlab.plugins.detectors.patterns as p; "
            "from headlab.plugin_manager import get_manager; "
            "print(headlab.__file__); print(sorted(get_manager().components['detectors'])); "
            "import headlab.scaffold as s; s.new_plugin('metric', 'wheel_metric', 'pkg', check_installed=False)")
    res = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(target)!r}); {code}"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert str(target) in res.stdout and "induction" in res.stdout
    assert (tmp_path / "pkg" / "headlab_wheel_metric" / "__init__.py").is_file()  # templates ship in the wheel
