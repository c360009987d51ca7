"""``headlab new-plugin``: each kind's package installs editable, is listed, and its own test passes.

The packages are installed into a throwaway virtual environment layered on this one (a ``.pth`` file
adds this environment's site-packages, so headlab and its dependencies are shared), never into the
environment the other tests run in. One ``pip install -e`` and one ``pytest`` run cover all five.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import tomllib

from headlab import cli
from headlab.scaffold import KINDS, names_for

NAMES = {"detector": "sink_score", "steering": "head-gain", "decoder": "penalised_greedy",
         "task": "recall_pairs", "metric": "word_f1"}


def new_plugin(*args: str) -> int:
    """Run ``headlab new-plugin ARGS`` in this process (the CLI's own error handling included)."""
    argv = sys.argv
    sys.argv = ["headlab", "new-plugin", *args]
    try:
        cli.main()
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        sys.argv = argv
    return 0


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plugins")
    dirs = {}
    for kind, name in NAMES.items():
        dirs[kind] = root / f"pkg-{kind}"
        assert new_plugin(kind, name, str(dirs[kind])) == 0
    return dirs


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


@pytest.fixture(scope="module")
def installed(generated, tmp_path_factory) -> Path:
    """A throwaway environment over this one, with every generated package installed editable."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--clear", str(venv)], check=True, timeout=120)
    python = venv_python(venv)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    parents = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    Path(site, "_headlab_parent_env.pth").write_text("".join(f"import site; site.addsitedir({p!r})\n"
                                                             for p in parents))
    editable = [arg for d in generated.values() for arg in ("-e", str(d))]
    res = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--disable-pip-version-check", *editable], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    return python


def test_writes_a_package(generated):
    for kind, directory in generated.items():
        names = names_for(NAMES[kind])
        files = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
        assert files == sorted(["README.md", "pyproject.toml", f"{names.package}/__init__.py",
                                f"tests/test_{names.kind}.py"])
        project = tomllib.loads((directory / "pyproject.toml").read_text())
        assert project["project"]["name"] == names.dist
        assert project["project"]["entry-points"]["headlab"] == {names.kind: names.package}
        module = (directory / names.package / "__init__.py").read_text()
        assert f'kind: Literal["{names.kind}"] = "{names.kind}"' in module
        assert f"def headlab_register_{KINDS[kind]}(register):" in module
        assert not re.search(r"\$\w|\$\{", module + (directory / "README.md").read_text())  # all filled in
        # only public names of headlab: no `headlab._x`, `from headlab... import _x`, `._x` on headlab objects
        for path in directory.rglob("*.py"):
            text = path.read_text()
            assert not re.search(r"from headlab[\w.]* import [^\n]*\b_[a-z]|headlab(\.\w+)*\._[a-z]", text), path
            assert "__dict__" not in text, path


@pytest.mark.slow  # a pip install and a pytest run of the generated package
def test_generated_tests_pass_after_editable_install(generated, installed, tmp_path):
    tests = [str(d / "tests") for d in generated.values()]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": ""}
    res = subprocess.run([str(installed), "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), *tests], capture_output=True, text=True, cwd=tmp_path,
                         env=env, timeout=900)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    for kind in generated:
        module = f"test_{names_for(NAMES[kind]).kind}.py"
        assert re.search(rf"PASSED .*{module}::", res.stdout), f"no test of {module} ran\n{res.stdout[-3000:]}"
    assert not re.search(r"\b(failed|error|skipped)\b", res.stdout.splitlines()[-1])
    # the packages are editable: their modules load from the generated directories
    code = "import importlib; print([importlib.import_module(m).__file__ for m in %r])"
    packages = [names_for(n).package for n in NAMES.values()]
    res = subprocess.run([str(installed), "-c", code % packages], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    for directory in generated.values():
        assert str(directory) in res.stdout


def test_headlab_plugins_lists_each_kind(generated, installed):
    res = subprocess.run([str(installed), "-m", "headlab.cli", "plugins", "--json"], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert res.returncode == 0, res.stderr
    rows = {r["name"]: r for r in json.loads(res.stdout)}
    for kind, name in NAMES.items():
        names = names_for(name)
        row = rows[names.kind]
        assert row["error"] is None and row["source"] == f"distribution {names.dist}" and row["version"] == "0.1.0"
        assert [(c["category"], c["kind"]) for c in row["components"]] == [(KINDS[kind], names.kind)]
    # and this environment, where the other tests run, has none of them
    assert not {names_for(n).kind for n in NAMES.values()} & {ep.name for ep in entry_points(group="headlab")}


def test_generated_packages_are_ruff_clean(generated):
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed")
    res = subprocess.run([ruff, "check", "--no-cache", *map(str, generated.values())], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("args, message", [
    (("detectr", "x"), "unknown plugin kind 'detectr'; one of: detector, steering, decoder, task, metric"),
    (("detector", "Bad Name"), "plugin name 'Bad Name' is not valid"),
    (("metric", "9lives"), "plugin name '9lives' is not valid"),
    (("task", "a__b"), "plugin name 'a__b' is not valid"),
    (("detector", "induction"), "detector kind 'induction' already exists"),
    (("decoder", "greedy"), "decoder kind 'greedy' already exists"),
])
def test_bad_kind_or_name_is_one_line_exit_2(args, message, tmp_path, capsys):
    assert new_plugin(*args, str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert not (tmp_path / "out").exists()


def test_existing_directory(tmp_path, capsys, monkeypatch):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert new_plugin("metric", "my_metric", str(tmp_path / "full")) == 2
    err = capsys.readouterr().err
    assert "already exists and is not an empty directory" in err and len(err.strip().splitlines()) == 1
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    (tmp_path / "empty").mkdir()
    assert new_plugin("metric", "my_metric", str(tmp_path / "empty")) == 0
    assert (tmp_path / "empty" / "headlab_my_metric" / "__init__.py").is_file()
    monkeypatch.chdir(tmp_path)  # DIR defaults to ./headlab-NAME
    assert new_plugin("task", "my-task") == 0
    assert (tmp_path / "headlab-my-task" / "headlab_my_task" / "__init__.py").is_file()
    assert "written to" in capsys.readouterr().out


def test_names():
    names = names_for("attention-sink")
    assert (names.kind, names.package, names.dist, names.config_class) == \
        ("attention_sink", "headlab_attention_sink", "headlab-attention-sink", "AttentionSink")
    assert names_for("headlab_extra").package == "headlab_extra"
