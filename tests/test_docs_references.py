"""References in the repository point inside it: no tracked file cites a file a user of headlab cannot read
(the internal method reference and design notes that live outside the repository, absolute paths of a
developer's machine, Markdown links that leave the repository), and every ``docs/methods.md#<anchor>``
cited anywhere is a heading of docs/methods.md."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
DOC = ROOT / "docs" / "methods.md"

# Built from pieces so that this file does not match its own patterns.
OUTSIDE = [
    (re.compile(re.escape("../" + "shared")), "the internal folder next to the repository"),
    (re.compile(r"METHODS" + r"\.md"), "the internal method reference (cite docs/methods.md#<anchor>)"),
    (re.compile(r"DESIGN" + r"\.md"), "the internal design notes"),
    (re.compile(r"(?<![\w.~/:-])/(?:work|home|Users|mnt)/[\w.-]"), "an absolute path of a developer's machine"),
]
CITED = re.compile(r"docs/methods\.md#([\w-]+)")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown text: lower case, every character but letters,
    digits, spaces, hyphens and underscores dropped, spaces to hyphens, "-1", "-2", ... on repeats. Fenced
    code blocks hold no headings."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fence = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        m = None if fence else re.match(r" {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(base, 0)
        seen[base] = n + 1
        anchors.add(base if n == 0 else f"{base}-{n}")
    return anchors


def tracked_texts() -> dict[str, str]:
    """Every tracked text file (``git ls-files``), by path; binary files left out."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    texts = {}
    for name in out.stdout.decode().split("\0"):
        path = ROOT / name
        if not name or name.startswith(".git/") or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue
        try:
            texts[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return texts


def markdown_of(name: str, text: str) -> str | None:
    """The Markdown of a file: a .md file itself, a notebook's markdown cells; None for anything else."""
    if name.endswith(".md"):
        return text
    if name.endswith(".ipynb"):
        cells = json.loads(text).get("cells", [])
        return "\n".join("".join(c["source"]) if isinstance(c["source"], list) else c["source"]
                         for c in cells if c.get("cell_type") == "markdown")
    return None


def problems(name: str, text: str, anchors: set[str], root: Path = ROOT) -> list[str]:
    """What is wrong with the references of one file (``name`` relative to ``root``)."""
    found = []
    for i, line in enumerate(text.splitlines(), 1):
        for pattern, what in OUTSIDE:
            if pattern.search(line):
                found.append(f"{name}:{i}: {what}: {line.strip()[:120]}")
        for anchor in CITED.findall(line):
            if anchor not in anchors:
                found.append(f"{name}:{i}: docs/methods.md has no heading with anchor #{anchor!r}")
    markdown = markdown_of(name, text)
    if markdown is None:
        return found
    here = (root / name).parent
    for target in LINK.findall(markdown):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#") and name != "docs/methods.md":
            continue  # a URL, or an anchor of the file itself (checked for docs/methods.md only)
        path, _, anchor = target.partition("#")
        resolved = Path(os.path.normpath(here / path)) if path else root / name
        if os.path.relpath(resolved, root).startswith(".."):
            found.append(f"{name}: link {target!r} leaves the repository")
        elif resolved == root / "docs" / "methods.md" and anchor and anchor not in anchors:
            found.append(f"{name}: link {target!r}: docs/methods.md has no such heading")
    return found


def test_methods_doc_exists_with_its_sections():
    anchors = github_anchors(DOC.read_text())
    for section in ("retrieval-score", "pattern-detectors", "lookback-ratio", "vhd", "causal-check-by-ablation",
                    "pasta", "pasta-head-selection", "vhr", "head-masking-and-scaling", "dola", "decore",
                    "contrastive-decoding", "context-aware-decoding", "pope", "chair", "benchmarks",
                    "causal-and-weight-level-head-analysis", "head-level-kv-cache-policies"):
        assert section in anchors, section


def test_no_reference_leaves_the_repository_and_every_methods_anchor_exists():
    anchors = github_anchors(DOC.read_text())
    found = [p for name, text in sorted(tracked_texts().items()) for p in problems(name, text, anchors)]
    assert not found, "\n".join(found)


def test_every_built_in_plugin_module_cites_its_definition():
    """Each method plugin's module docstring names its section of docs/methods.md."""
    texts = tracked_texts()
    for module in ("detectors/retrieval.py", "detectors/patterns.py", "detectors/lookback.py",
                   "detectors/segment_divergence.py", "detectors/ablation.py", "steering/pasta.py",
                   "steering/pasta_profile.py", "steering/vhr.py", "steering/heads.py", "decoding/dola.py",
                   "decoding/decore.py", "decoding/contrastive.py", "metrics/hallucination.py"):
        doc = re.match(r'\s*"""(.*?)"""', texts[f"headlab/plugins/{module}"], flags=re.S).group(1)
        assert CITED.search(doc), module


def test_the_checker_catches_what_it_should(tmp_path):
    """The checks flag each kind of bad reference and leave good ones alone."""
    anchors = github_anchors("# Methods\n## Retrieval score\n### PASTA\n## `code` & more!\n## PASTA\n"
                             "```\n## not a heading\n```\n")
    assert anchors == {"methods", "retrieval-score", "pasta", "code--more", "pasta-1"}
    (tmp_path / "docs").mkdir()
    cite = "docs/methods" + ".md#"  # in pieces, so that the test suite's own scan does not read these samples
    bad = {
        "core/a.py": 'see ../' + 'shared/x',
        "core/b.py": "Definition: " + "METHODS" + '.md "PASTA"',
        "docs/c.md": "See " + "DESIGN" + ".md.",
        "core/d.py": 'path = "/' + 'work/main/x"',
        "core/e.py": f"Definition: {cite}no-such-section.",
        "docs/f.md": "[up](../../elsewhere.md)",
        "docs/g.md": "[m](methods.md#nope)",
    }
    for name, text in bad.items():
        assert len(problems(name, text, anchors, tmp_path)) == 1, name
    good = {
        "core/a.py": f"Definition: {cite}retrieval-score. Also {cite}pasta-1, /tmp/x.",
        "docs/b.md": "[docs/methods.md#pasta](methods.md#pasta), [url](https://x.org/a), [here](#anything)",
        "README.md": "[docs/methods.md](docs/methods.md) and [m](docs/methods.md#retrieval-score)",
    }
    for name, text in good.items():
        assert problems(name, text, anchors, tmp_path) == [], name
