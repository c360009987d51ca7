"""No folder of the checkout shadows an installed package: headlab's code is reachable only as ``headlab.*``.

Every Python started in the repository root puts the root first on ``sys.path`` (``python -m pytest``,
``python -c``, a REPL or notebook kernel, the CLI's subprocesses, Ray workers). A top-level ``kernels/``
once answered ``import kernels`` there in place of Hugging Face's package, which transformers imports.
These tests start fresh interpreters with the root first on the path, import what transformers imports,
and fail if any module resolves into the repository outside ``headlab/``.
"""

from __future__ import annotations

import json
import keyword
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: What a fresh interpreter imports, then reports: where each module of sys.modules came from, and where
#: the names of the design card's folders resolve (None: not importable at all).
PROBE = """
import importlib.util, json, sys
first = sys.path[0]
import kernels, transformers.modeling_utils, headlab, headlab.cli, headlab.kernels, headlab.plugins
files, paths = {}, {}
for name, m in list(sys.modules.items()):
    file = getattr(m, "__file__", None)
    files[name] = file if isinstance(file, str) else None
    try:
        paths[name] = [p for p in getattr(m, "__path__", None) or [] if isinstance(p, str)]
    except TypeError:  # a module whose __path__ is no list of folders
        paths[name] = []
found = {}
for name in ("core", "plugins", "kernels"):
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    found[name] = None if spec is None else [spec.origin, list(spec.submodule_search_locations or [])]
import site
envs = [sys.prefix, sys.base_prefix, *site.getsitepackages(), site.getusersitepackages()]
print(json.dumps({"first": first, "envs": envs, "files": files, "paths": paths, "found": found,
                  "kernels": kernels.__file__}))
"""


def probe(cwd: Path, *args: str, env: dict | None = None) -> dict:
    res = subprocess.run([sys.executable, *args, "-c", PROBE], cwd=cwd, capture_output=True, text=True,
                         timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def inside(path: str | None, folder: Path) -> bool:
    """Whether a module's file or folder lies in ``folder`` (a relative name, as torch.classes' __path__
    reports, is no place on disk)."""
    return path is not None and Path(path).is_absolute() and Path(path).resolve().is_relative_to(folder)


def in_checkout(place: str | None, report: dict) -> bool:
    """Inside the repository, and not in the interpreter's environment (a ``.venv/`` in the checkout)."""
    return inside(place, ROOT) and not any(inside(env, ROOT) and inside(place, Path(env))
                                           for env in report["envs"])


def strays(report: dict) -> list[str]:
    """The modules of the report that resolve into the checkout but outside headlab/."""
    out = []
    for name, file in report["files"].items():
        places = [file, *report["paths"].get(name, [])]
        for place in filter(None, places):
            if in_checkout(place, report) and not inside(place, ROOT / "headlab"):
                out.append(f"{name} -> {place}")
    return sorted(out)


@pytest.fixture(scope="module")
def from_root() -> dict:
    """``python -c`` in the repository root: the root ('' , the working directory) is first on sys.path."""
    return probe(ROOT)


def test_the_root_is_first_on_the_path_of_the_probe(from_root):
    assert from_root["first"] in ("", str(ROOT))  # so the probe does test the shadowing it is meant to


def test_no_module_resolves_into_the_checkout_outside_headlab(from_root):
    assert strays(from_root) == []
    assert not in_checkout(from_root["kernels"], from_root)  # Hugging Face's kernels, from site-packages
    assert inside(from_root["files"]["headlab"], ROOT / "headlab")


def test_the_design_cards_folder_names_resolve_to_nothing_of_the_checkout(from_root):
    """``import core`` / ``plugins`` / ``kernels`` from the root find nothing of the checkout: not
    importable at all, or an installed package of that name (kernels: Hugging Face's)."""
    for name, spec in from_root["found"].items():
        if spec is None:
            continue
        origin, locations = spec
        assert not in_checkout(origin, from_root), (name, spec)
        assert not any(in_checkout(p, from_root) for p in locations), (name, spec)


@pytest.mark.slow  # a second probe importing every module; the probe from the root runs in the default set
def test_the_root_first_on_pythonpath_from_elsewhere(tmp_path):
    """The root put first on sys.path by PYTHONPATH, from another directory (a notebook kernel or a
    worker configured that way), with Python's safe-path mode off."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTHONSAFEPATH", None)
    report = probe(tmp_path, env=env)
    assert strays(report) == [] and not in_checkout(report["kernels"], report)


def test_no_top_level_name_of_the_checkout_is_importable_but_headlab():
    """The static rule behind the tests above: at the top of the repository, no regular package (a
    folder with ``__init__.py``) and no module (``*.py``) but the ``headlab/`` package."""
    importable = sorted(
        p.name for p in ROOT.iterdir()
        if not p.name.startswith(".") and (
            (p.is_dir() and (p / "__init__.py").is_file() and p.name.isidentifier())
            or (p.suffix == ".py" and p.stem.isidentifier() and not keyword.iskeyword(p.stem))))
    assert importable == ["headlab"]
