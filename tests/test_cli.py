"""The command line: every command, and one-line errors with exit code 2 and no traceback."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from fixtures.cli import run
from fixtures.specs import spec_text

ROOT = Path(__file__).parent.parent
STEPS = "  - id: ind\n    detect: {kind: induction}\n"


def headlab(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``headlab ARGS`` as typed in ``cwd`` (default: the repository root), in this process."""
    return run(*args, cwd=cwd or ROOT)


def test_validate_accepts_every_example_spec():
    specs = sorted(str(p) for p in (ROOT / "specs").glob("*.yaml"))
    res = headlab("validate", *specs)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count(": ok") == len(specs)


def test_bad_spec_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(spec_text(STEPS).replace("kind: induction", "kind: inductoin"))
    res = headlab("validate", str(bad))
    assert res.returncode == 2
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert f"{bad}:6:5: steps[0].detect: unknown detector kind 'inductoin'" in lines[0]
    assert "Traceback" not in res.stderr
    res = headlab("run", str(tmp_path / "nope.yaml"))
    assert res.returncode == 2 and "no such spec file" in res.stderr and "Traceback" not in res.stderr


def test_run_show_runs(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text(STEPS))
    res = headlab("run", str(spec), "--out", str(tmp_path / "runs"), "--set", "task.n=2")
    assert res.returncode == 0, res.stderr
    assert "top head" in res.stdout
    (run_dir,) = (tmp_path / "runs").iterdir()
    res = headlab("show", str(run_dir))
    assert res.returncode == 0 and "induction" in res.stdout
    res = headlab("runs", str(tmp_path / "runs"))
    assert res.returncode == 0 and "complete" in res.stdout and "1/1" in res.stdout
    res = headlab("show", str(tmp_path))
    assert res.returncode == 2 and "no headlab run" in res.stderr


def test_bad_override_and_bad_model_path(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text(STEPS))
    res = headlab("run", str(spec), "--set", "tsak.n=2")
    assert res.returncode == 2 and "did you mean 'task'" in res.stderr
    spec.write_text(spec_text(STEPS).replace(spec_text(STEPS).splitlines()[1], "model: {path: /no/such/dir}"))
    res = headlab("run", str(spec), "--out", str(tmp_path / "r"))
    assert res.returncode == 2 and "does not exist" in res.stderr and "Traceback" not in res.stderr


def test_schema_and_plugins(tmp_path):
    res = headlab("schema", "-o", str(tmp_path / "schema.json"))
    assert res.returncode == 0
    schema = json.loads((tmp_path / "schema.json").read_text())
    assert "induction" in json.dumps(schema)
    res = headlab("plugins", "--json")
    rows = json.loads(res.stdout)
    builtin = {r["name"]: r for r in rows if r["source"] == "built-in"}
    kinds = {c["kind"] for r in builtin.values() for c in r["components"]}
    assert {"induction", "repeated_tokens", "greedy", "exact_match"} <= kinds


def test_usage_errors_are_one_line():
    for args in (("validate", "specs/quickstart.yaml", "--bogus"), ("bogus",)):
        res = headlab(*args)
        assert res.returncode == 2 and "Traceback" not in res.stderr
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: No such"), res.stderr


def test_piped_tables_keep_identifiers_whole(tmp_path):
    """`headlab runs | cat` and `headlab plugins | cat` print every run and kind name whole (no '…')."""
    name = "a-rather-long-experiment-name-that-would-not-fit-in-a-narrow-column"
    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text(STEPS, out=str(tmp_path / "runs")).replace("name: test", f"name: {name}"))
    assert headlab("run", str(spec)).returncode == 0
    listing = headlab("runs", str(tmp_path / "runs")).stdout
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name in listing and "…" not in listing
    plugins = headlab("plugins").stdout
    assert "segment_divergence" in plugins and "pasta_profile" in plugins and "…" not in plugins
