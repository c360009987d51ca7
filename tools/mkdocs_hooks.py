"""mkdocs hooks of the documentation site (mkdocs.yml): the pages generated at build time.

- The API reference: one page per public module that exists (``headlab``, ``headlab.plugin``, ``headlab.kv``,
  ``headlab.plugin_manager``, ``headlab.hookspecs``), each rendered by mkdocstrings from the module's docstrings
  (``headlab``'s members are its ``__all__``).
- The Results section: one page per file the benchmark scripts write to ``benchmarks/results/`` (``*.md`` as it is,
  ``*.json`` as a table of its rows), so that a figure in the guide is read from a benchmark's own output.
- ``docs/atlas.md`` in the guide where the file exists.

Guide pages link a benchmark output as ``../benchmarks/results/<name>.md`` (a path that reads on GitHub); in the
site that link goes to the generated page.
"""

from __future__ import annotations

import json
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
#: module -> (page title, where its source lives)
API = {
    "headlab": ("headlab", "headlab/__init__.py"),
    "headlab.plugin": ("headlab.plugin", "headlab/plugin"),
    "headlab.kv": ("headlab.kv", "headlab/kv"),
    "headlab.plugin_manager": ("headlab.plugin_manager", "headlab/plugin_manager.py"),
    "headlab.hookspecs": ("headlab.hookspecs", "headlab/hookspecs.py"),
}
API_INTRO = {
    "headlab": "The public namespace: what `import headlab` offers (its `__all__`).",
    "headlab.plugin": "The names a plugin needs, in one place.",
    "headlab.kv": "Head-level KV-cache policies: head maps, budgets, the split cache and the policy driver.",
    "headlab.plugin_manager": "Finding, registering and calling plugins.",
    "headlab.hookspecs": "The hooks a plugin implements (see the guide's Plugins page).",
}
RESULT_LINK = re.compile(r"\]\((?:\.\./)+benchmarks/results/([\w.-]+)\.(?:md|json)(#[\w-]*)?\)")


def api_modules() -> list[str]:
    """The modules of :data:`API` whose source exists (a module or a package)."""
    found = []
    for name, (_, path) in API.items():
        p = ROOT / path
        if p.is_file() or p.with_suffix(".py").is_file() or (p / "__init__.py").is_file():
            found.append(name)
    return found


def result_files() -> list[Path]:
    """The benchmark output files, by name."""
    if not RESULTS.is_dir():
        return []
    return sorted(p for p in RESULTS.iterdir() if p.suffix in (".md", ".json") and p.is_file())


def api_page(name: str) -> str:
    options = ""
    if name == "headlab":
        # the namespace re-exports names from its modules: render the exported ones, documented here
        options = "\n    options:\n      show_submodules: false\n"
    return f"# `{name}`\n\n{API_INTRO[name]}\n\n::: {name}{options}\n"


def json_page(path: Path) -> str:
    """A benchmark's JSON output as Markdown: its ``title`` and ``notes``, then ``rows`` as a table."""
    data = json.loads(path.read_text())
    lines = [f"# {data.get('title', path.stem)}", ""]
    for note in data.get("notes", []):
        lines += [note, ""]
    rows = data.get("rows", [])
    if rows:
        cols = list(dict.fromkeys(k for row in rows for k in row))
        lines.append("| " + " | ".join(cols) + " |")
        lines.append("|" + "---|" * len(cols))
        for row in rows:
            lines.append("| " + " | ".join(str(row.get(c, "")) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def result_page(path: Path) -> str:
    return path.read_text() if path.suffix == ".md" else json_page(path)


def result_title(path: Path) -> str:
    if path.suffix == ".json":
        return json.loads(path.read_text()).get("title", path.stem)
    m = re.search(r"^# (.+)$", path.read_text(), flags=re.M)
    return m.group(1).strip() if m else path.stem


def on_config(config, **kwargs):
    """The generated sections of the navigation, and the atlas where docs/atlas.md exists."""
    nav = config["nav"]
    guide = next(item["Guide"] for item in nav if isinstance(item, dict) and "Guide" in item)
    docs = Path(config["docs_dir"])
    if (docs / "atlas.md").is_file() and not any("atlas.md" in item.values() for item in guide):
        at = next((i for i, item in enumerate(guide) if "importance.md" in item.values()), len(guide) - 1)
        guide.insert(at + 1, {"Atlas": "atlas.md"})
    nav.append({"API reference": [{API[m][0]: f"api/{m}.md"} for m in api_modules()]})
    results = result_files()
    if results:
        nav.append({"Results": ["results/index.md"]
                    + [{result_title(p): f"results/{p.stem}.md"} for p in results]})
    return config


def on_files(files, config, **kwargs):
    """The API reference and Results pages, generated."""
    for m in api_modules():
        files.append(File.generated(config, f"api/{m}.md", content=api_page(m)))
    results = result_files()
    if results:
        index = ["# Results", "",
                 "What the benchmark scripts in `benchmarks/` printed, as they wrote it to `benchmarks/results/`",
                 "(each script's `--write` option). Each page names the command, the machine and the commit.", ""]
        index += [f"- [{result_title(p)}]({p.stem}.md) (`benchmarks/results/{p.name}`)" for p in results]
        files.append(File.generated(config, "results/index.md", content="\n".join(index) + "\n"))
        for p in results:
            files.append(File.generated(config, f"results/{p.stem}.md", content=result_page(p)))
    return files


def on_page_markdown(markdown, page, config, files, **kwargs):
    """Links to ``../benchmarks/results/<name>.md`` go to the generated Results page of that file."""
    here = posixpath.dirname(page.file.src_uri)

    def to_page(m: re.Match) -> str:
        target = posixpath.relpath(f"results/{m.group(1)}.md", here or ".")
        return f"]({target}{m.group(2) or ''})"

    return RESULT_LINK.sub(to_page, markdown)
