"""Packaging: the one top-level folder headlab/ (the core, headlab/plugins, headlab/kernels) -> the import
package headlab, wheel and editable."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

from headlab.scaffold import KINDS

ROOT = Path(__file__).parent.parent
ROOTS = {"headlab": "headlab"}


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def declared_packages() -> list[str]:
    return pyproject()["tool"]["setuptools"]["packages"]


def package_dir(name: str) -> Path:
    """The source directory of an import package (its dotted name as a path under the checkout)."""
    root = max((r for r in ROOTS if name == r or name.startswith(r + ".")), key=len)
    return ROOT / ROOTS[root] / Path(*name[len(root):].split(".")[1:])


def tracked_package_files() -> list[str]:
    """Tracked files under headlab/ (``git ls-files``)."""
    try:
        out = subprocess.run(["git", "ls-files", *ROOTS.values()], cwd=ROOT, capture_output=True, text=True,
                             check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return out.splitlines()


def glob_regex(pattern: str) -> re.Pattern:
    """A package-data glob as setuptools reads it: relative to the package, ``*`` never crosses a ``/``."""
    return re.compile("".join("[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c) for c in pattern))


def shipped(path: str) -> bool:
    """Whether the build configuration of pyproject.toml puts this source file into the wheel: a module of
    a declared package, or a file matched by a package-data glob of its nearest declared package."""
    data = pyproject()["tool"]["setuptools"]["package-data"]
    owners = [p for p in declared_packages() if (ROOT / path).is_relative_to(package_dir(p))]
    if not owners:
        return False
    pkg = max(owners, key=lambda p: len(package_dir(p).parts))
    rel = (ROOT / path).relative_to(package_dir(pkg)).as_posix()
    if "/" not in rel and rel.endswith(".py"):
        return True
    return any(glob_regex(g).fullmatch(rel) for g in [*data.get(pkg, []), *data.get("*", [])])


def test_every_package_directory_is_declared():
    """Every directory under the package roots is a declared package: one with ``__init__.py`` or a
    data-only one (templates, task data). Directories whose names are no Python identifiers (the
    checkpoints, ``headlab-tiny``) are package data of their parent instead."""
    found = set()
    for pkg, directory in ROOTS.items():
        base = ROOT / directory
        for sub in [base, *(p for p in base.rglob("*") if p.is_dir())]:
            rel = sub.relative_to(base)
            if any(p.startswith(".") or p == "__pycache__" or not p.isidentifier() for p in rel.parts):
                continue
            if not any(f.is_file() for f in sub.iterdir()) and not any(
                    q.is_file() and "__pycache__" not in q.parts for q in sub.rglob("*")):
                continue
            found.add(".".join([pkg, *rel.parts]) if rel.parts else pkg)
    assert found == set(declared_packages())


def test_every_tracked_file_of_the_package_directories_ships():
    """No file under headlab/ is left out of the wheel by the build configuration (the
    scripts that should not be installed live in tools/)."""
    files = tracked_package_files()
    assert "headlab/plugins/models/tiny/headlab-tiny/model.safetensors" in files
    assert [f for f in files if not shipped(f)] == []
    assert not shipped("headlab/plugins/models/tiny/headlab-tiny/sub/x.bin") and not shipped("headlab/notes.rst")


def test_license_is_an_spdx_expression():
    """PEP 639: ``project.license`` is an SPDX string (a TOML table is deprecated), which needs setuptools 77
    or later, and no license classifier goes with it."""
    meta = pyproject()
    assert meta["project"]["license"] == "Apache-2.0"
    assert not any(c.startswith("License ::") for c in meta["project"].get("classifiers", []))
    (req,) = [r for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    assert int(re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", req).group(1)) >= 77


def test_editable_install_maps_directories():
    import headlab
    import headlab.kernels
    import headlab.plugins.detectors

    assert Path(headlab.__file__).parent == ROOT / "headlab"
    assert Path(headlab.plugins.detectors.__file__).parent == ROOT / "headlab" / "plugins" / "detectors"
    assert Path(headlab.kernels.__file__).parent == ROOT / "headlab" / "kernels"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from the tracked files (a clean checkout: no stale ``build/`` of the working tree)."""
    out, src = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("checkout")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "-w", str(out), str(src)], capture_output=True, text=True, timeout=600)
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


def test_wheel_holds_exactly_the_predicted_files(wheel):
    """The wheel's files are the tracked files that :func:`shipped` predicts, no more and no fewer (so the
    declaration tests above read pyproject.toml as setuptools does); the tools/ scripts are not in it."""
    names = {n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in n}
    prefix = {directory: pkg.replace(".", "/") for pkg, directory in ROOTS.items()}
    predicted = set()
    for f in tracked_package_files():
        if shipped(f):
            top, rest = f.split("/", 1)
            predicted.add(f"{prefix[top]}/{rest}")
    assert names == predicted
    tiny = sorted(n for n in names if n.startswith("headlab/plugins/models/tiny/") and n.endswith(".py"))
    assert tiny == ["headlab/plugins/models/tiny/__init__.py"]  # the training and evaluation scripts stay out
