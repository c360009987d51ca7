"""The documentation site and the code blocks of the docs.

- The site (mkdocs.yml) builds with ``mkdocs build --strict``: no broken link, anchor, snippet or API reference;
  its generated pages (the API reference and its "Public namespace", the Results section from benchmarks/results/)
  are there, and so are the files and tables of constants its pages include.
- Every ```python and ```bash block of docs/*.md and README.md runs, or says why not on the line before it:
  ``<!-- not run: REASON -->`` (skipped) or ``<!-- slow: REASON -->`` (run by the slow set). A block with neither
  runs in the default set, so it must be cheap. A block runs in a scratch directory that holds links to the
  repository's folders (a block names ``specs/quickstart.yaml`` as a user in the repository root does), offline
  (nothing is downloaded), with the environment's ``bin`` first on ``PATH``: the python blocks of one page in one
  interpreter, in order (a later block may use an earlier one's names), each bash block under ``set -euo pipefail``.
- A benchmark script's ``--write`` keeps what it prints in benchmarks/results/, the files the Results section is
  built from.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
MARK = re.compile(r"^\s*<!--\s*(not run|slow)\s*:\s*(.*?)\s*-->\s*$")
RUN = ("python", "bash")
#: what a block's run may not do: reach a model hub, use more than one thread per library
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
       "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg", "PYTHONDONTWRITEBYTECODE": "1"}
LINKED = ("specs", "examples", "notebooks", "docs", "benchmarks", "tools", "headlab", ".venv")


@dataclass(frozen=True)
class Block:
    page: str       # path relative to the repository
    line: int       # the line of the opening fence
    lang: str
    code: str
    mark: str       # "", "not run" or "slow"
    reason: str

    @property
    def label(self) -> str:
        return f"{self.page}:{self.line}"


def blocks_of(page: str, text: str) -> list[Block]:
    """The fenced ```python and ```bash blocks of a Markdown text, with the marker on the line before each."""
    lines = text.split("\n")
    found = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), len(lines))
        if lang in RUN:
            mark = MARK.match(lines[i - 1]) if i else None
            code = textwrap.dedent("\n".join(line[len(indent):] if line.startswith(indent) else line
                                             for line in lines[i + 1:end]))
            found.append(Block(page, i + 1, lang, code, mark.group(1) if mark else "", mark.group(2) if mark else ""))
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [b for p in PAGES for b in blocks_of(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8"))]


def problems(blocks: list[Block], root: Path = ROOT) -> list[str]:
    """What is wrong with the markers: a marker without a reason, a reason naming a test file that does not exist."""
    found = []
    for b in blocks:
        if b.mark and not b.reason:
            found.append(f"{b.label}: `<!-- {b.mark}: -->` needs a reason")
        for named in re.findall(r"tests/[\w/]+\.py", b.reason):
            if not (root / named).is_file():
                found.append(f"{b.label}: the reason names {named}, which does not exist")
    return found


def scratch(tmp_path: Path) -> Path:
    """A directory that holds links to the repository's folders, where a block's outputs land."""
    work = tmp_path / "work"
    work.mkdir()
    for name in LINKED:
        if (ROOT / name).exists():
            (work / name).symlink_to(ROOT / name)
    return work


def environment() -> dict[str, str]:
    env = {**os.environ, **ENV}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


DRIVER = """
import json, sys, traceback
namespace = {"__name__": "__main__"}
for label, code in json.load(sys.stdin):
    try:
        exec(compile(code, label, "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"the block at {label} failed", file=sys.stderr)
        sys.exit(1)
"""


def run_blocks(blocks: list[Block], tmp_path: Path) -> None:
    """Run the blocks of each page in order: python blocks in one interpreter per page, bash blocks one by one."""
    work = scratch(tmp_path)
    env = environment()
    failures = []
    for page in dict.fromkeys(b.page for b in blocks):
        python = [(b.label, b.code) for b in blocks if b.page == page and b.lang == "python"]
        if python:
            r = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(python), capture_output=True,
                               text=True, cwd=work, env=env, timeout=900)
            if r.returncode:
                failures.append(r.stderr[-3000:])
        for b in (b for b in blocks if b.page == page and b.lang == "bash"):
            r = subprocess.run(["bash", "-c", "set -euo pipefail\n" + b.code], capture_output=True, text=True,
                               cwd=work, env=env, timeout=900)
            if r.returncode:
                failures.append(f"the block at {b.label} failed (exit {r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    assert not failures, "\n\n".join(failures)


def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(site)], capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**environment(), "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    api = (site / "api" / "headlab" / "index.html").read_text(encoding="utf-8")
    import headlab

    for name in ("run", "open_run", "Plan", "ComponentConfig", "register_plugin"):
        assert name in headlab.__all__ and f'id="headlab.{name}"' in api, name
    for hooks in ("headlab.hookspecs", "headlab.plugin_manager"):
        assert (site / "api" / hooks / "index.html").is_file(), hooks
    results = sorted(p.stem for p in (ROOT / "benchmarks" / "results").glob("*.md"))
    assert results, "benchmarks/results/ holds no benchmark output"
    for name in results:
        assert (site / "results" / name / "index.html").is_file(), name
    assert (site / "atlas" / "index.html").is_file() == (ROOT / "docs" / "atlas.md").is_file()
    # the public namespace page: every public module with the names of its __all__
    namespace = (site / "api" / "public-namespace" / "index.html").read_text(encoding="utf-8")
    for module in ("headlab.plugin", "headlab.spec", "headlab.kv"):
        names = importlib.import_module(module).__all__
        assert f"<code>{module}</code>" in namespace and all(f"<code>{n}</code>" in namespace for n in names)
    # the pages' included files and generated tables of constants, with the values the code has
    plugins = (site / "plugins" / "index.html").read_text(encoding="utf-8")
    assert "--8&lt;--" not in plugins and '<span class="nc">CopyFirst</span>' in plugins
    reliability = (site / "reliability" / "index.html").read_text(encoding="utf-8")
    for module, name in (("headlab.spec", "MAX_SPEC_CHARS"), ("headlab.spec", "MAX_CELLS"),
                         ("headlab.sandbox", "MAX_TEMPLATE_STEPS")):
        value = f"{getattr(importlib.import_module(module), name):,}"
        assert f"<td><code>{name}</code></td>\n<td>{value}</td>" in reliability, name
    assert "<!-- generated:" not in reliability
    headkv = importlib.import_module("headlab.plugins.kv.headkv").HeadKV.model_fields  # a generated field table
    kv = (site / "kv" / "index.html").read_text(encoding="utf-8")
    for key in ("observation_window", "beta"):
        assert f"<td><code>{key}</code></td>\n<td><code>{headkv[key].default}</code></td>" in kv, key
    assert "<!-- generated:" not in kv


def test_every_block_runs_or_says_why():
    blocks = all_blocks()
    assert len(blocks) > 40  # the docs' python and bash blocks were found
    assert not problems(blocks), "\n".join(problems(blocks))


def test_the_checker_reads_blocks_and_markers():
    text = ("# t\n\n```python\nx = 1\n```\n\n<!-- not run: downloads a 7B model -->\n```bash\necho hi\n```\n"
            "<!-- slow: a whole spec -->\n```python\ny = 2\n```\n```yaml\nz: 3\n```\n<!-- not run: -->\n"
            "```bash\nls\n```\n- a list item:\n\n  ```python\n  w = 4\n  ```\n"
            "<!-- not run: see tests/no_such_test.py -->\n```python\nv = 5\n```\n")
    blocks = blocks_of("t.md", text)
    assert [(b.line, b.lang, b.mark) for b in blocks] == [
        (3, "python", ""), (8, "bash", "not run"), (12, "python", "slow"), (19, "bash", "not run"),
        (24, "python", ""), (28, "python", "not run")]
    assert blocks[1].reason == "downloads a 7B model" and blocks[4].code == "w = 4"
    assert problems(blocks) == ["t.md:19: `<!-- not run: -->` needs a reason",
                                "t.md:28: the reason names tests/no_such_test.py, which does not exist"]


def test_the_cheap_blocks_run(tmp_path):
    run_blocks([b for b in all_blocks() if not b.mark], tmp_path)


@pytest.mark.slow
def test_the_slow_blocks_run(tmp_path):
    run_blocks([b for b in all_blocks() if b.mark == "slow"], tmp_path)


FAKE_BENCH = '''"""A fake benchmark: its table, and a line from a subprocess. Not a test."""
import subprocess
import sys


def main():
    if "--fail" in sys.argv:
        print("half a table")
        sys.exit(3)
    print("case   seconds")
    print("a      1.00" + (" (reps " + sys.argv[sys.argv.index("--reps") + 1] + ")" if "--reps" in sys.argv else ""))
    sys.stdout.flush()
    subprocess.run([sys.executable, "-c", "print('from a subprocess')"], check=True)


if __name__ == "__main__":
    from _common import main_writing_results

    main_writing_results(main, __file__)
'''


def test_a_benchmark_writes_its_output_for_the_results_section(tmp_path):
    """``--write`` keeps what a benchmark prints (its subprocesses' lines too) under a header naming the command,
    the date, the machine and the commit, in benchmarks/results/<script>.md; a failed run writes nothing."""
    (tmp_path / "_common.py").write_text((ROOT / "benchmarks" / "_common.py").read_text())
    (tmp_path / "bench_fake.py").write_text(FAKE_BENCH)
    env = environment()
    plain = subprocess.run([sys.executable, "bench_fake.py", "--reps", "2"], capture_output=True, text=True,
                           cwd=tmp_path, env=env, timeout=120)
    assert plain.returncode == 0 and not (tmp_path / "results").exists(), plain.stderr
    r = subprocess.run([sys.executable, "bench_fake.py", "--write", "--reps", "2"], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == plain.stdout  # printed as without --write
    text = (tmp_path / "results" / "bench_fake.md").read_text()
    assert text.startswith("# bench_fake: A fake benchmark: its table, and a line from a subprocess\n")
    assert "`python benchmarks/bench_fake.py --reps 2`" in text and "Written by `--write` on " in text
    assert "Machine: " in text and ", commit " in text and "load average" in text
    assert "```text\ncase   seconds\na      1.00 (reps 2)\nfrom a subprocess\n```" in text
    other = tmp_path / "elsewhere.md"
    r = subprocess.run([sys.executable, "bench_fake.py", f"--write={other}"], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0 and "a      1.00\n" in other.read_text(), r.stderr
    r = subprocess.run([sys.executable, "bench_fake.py", "--fail", "--write", str(tmp_path / "failed.md")],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 3 and not (tmp_path / "failed.md").exists()


def test_write_keeps_a_section_per_command(tmp_path):
    """Runs with different commands share one results file, a section each; a rerun of a command replaces its
    own section in place; text outside the sections (an older recorded run) stays; a file written by hand is
    replaced whole."""
    (tmp_path / "_common.py").write_text((ROOT / "benchmarks" / "_common.py").read_text())
    (tmp_path / "bench_fake.py").write_text(FAKE_BENCH)
    out = tmp_path / "results" / "bench_fake.md"
    out.parent.mkdir()
    out.write_text("# copied by hand\n\nan old table\n")

    def write(*args):
        r = subprocess.run([sys.executable, "bench_fake.py", "--write", *args], capture_output=True, text=True,
                           cwd=tmp_path, env=environment(), timeout=120)
        assert r.returncode == 0, r.stderr
        return out.read_text()

    text = write("--reps", "2")
    assert "copied by hand" not in text and "an old table" not in text
    out.write_text(text + "\n## Recorded output of an earlier run\n\nkept\n")
    text = write("--reps", "3")
    two, three = text.index("## `python benchmarks/bench_fake.py --reps 2`"), text.index("(reps 3)")
    assert text.startswith("# bench_fake: ") and text.count("# bench_fake: ") == 1
    assert two < three < text.index("## Recorded output of an earlier run\n\nkept\n")
    first = text[:text.index("Written by")]
    text = write("--reps", "2")
    assert text.count("(reps 2)") == 1 and text.count("(reps 3)") == 1 and "kept\n" in text
    assert text.index("(reps 2)") < text.index("(reps 3)") and text[:text.index("Written by")] == first
    text = write("--peer", "/opt/someone/envs/.venv-x/bin/python", str(tmp_path / "in.json"))
    assert f"## `python benchmarks/bench_fake.py --peer <elsewhere>/.venv-x/bin/python {tmp_path.name}/in.json`" in text
    assert "/opt/" not in text and str(tmp_path) not in text  # no path of the machine that ran it
