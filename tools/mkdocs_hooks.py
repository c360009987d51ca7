"""mkdocs hooks of the documentation site (mkdocs.yml): the pages generated at build time.

- The API reference: the public namespace (each public module with the names of its ``__all__``, from
  tools/public_namespace.py), then one page per public module that exists (``headlab``, ``headlab.plugin``, ``headlab.kv``,
  ``headlab.plugin_manager``, ``headlab.hookspecs``), each rendered by mkdocstrings from the module's docstrings
  (``headlab``'s members are its ``__all__``).
- The Results section: one page per file the benchmark scripts write to ``benchmarks/results/`` (``*.md`` as it is,
  ``*.json`` as a table of its rows), so that a figure in the guide is read from a benchmark's own output.
- ``docs/atlas.md`` in the guide where the file exists.
- Tables of constants: a line ``<!-- generated: constants of headlab.spec: MAX_DEPTH MAX_NODES -->`` of a page
  becomes a table of those constants, their values and their docstrings, so that a page never restates a limit
  by hand; ``<!-- generated: fields of headlab.plugins.kv.headkv:HeadKV -->`` a table of a config model's fields,
  their defaults and their descriptions (what the spec's JSON schema says of them).

Guide pages link a benchmark output as ``../benchmarks/results/<name>.md`` (a path that reads on GitHub); in the
site that link goes to the generated page. A link to a file of ``examples/`` (a page includes the file with
pymdownx.snippets; the link is for GitHub) is its label in the site, which has no page for it.
"""

from __future__ import annotations

import ast
import importlib
import json
import logging
import posixpath
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

sys.path.insert(0, str(Path(__file__).resolve().parent))
from public_namespace import namespace_page  # noqa: E402  (tools/ is not a package)

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
LOG = logging.getLogger("mkdocs.hooks.headlab")
EXAMPLE_LINK = re.compile(r"\[([^\]\n]+)\]\(\.\./(examples/[^)\s#]+)\)")
CONSTANTS = re.compile(r"^<!-- generated: constants of ([\w.]+): ([\w ]+?) -->$", flags=re.M)
FIELDS = re.compile(r"^<!-- generated: fields of ([\w.]+):(\w+) -->$", flags=re.M)
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


def constant_docs(module: str) -> dict[str, str]:
    """The docstrings of the module-level constants of ``module`` (a package: of all its modules), by name."""
    path = Path(importlib.import_module(module).__file__)
    docs: dict[str, str] = {}
    for source in sorted(path.parent.glob("*.py")) if path.name == "__init__.py" else [path]:
        body = ast.parse(source.read_text(encoding="utf-8")).body
        for node, after in zip(body, body[1:], strict=False):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                    and isinstance(after.value.value, str):
                docs[node.targets[0].id] = after.value.value
    return docs


def _markdown(docstring: str) -> str:
    text = " ".join(docstring.split())
    return re.sub(r"``([^`]+)``", r"`\1`", re.sub(r":\w+:`([^`]+)`", r"`\1`", text))


def _value(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"{value:,}" if isinstance(value, int) else str(value)


def constants_table(module: str, names: list[str], where: str = "") -> str:
    """A Markdown table of the constants ``names`` of ``module``: name, value, docstring (a warning, which fails a
    strict build, for a name the module lacks or a constant without a docstring)."""
    mod = importlib.import_module(module)
    docs = constant_docs(module)
    lines = ["| constant | value | what it bounds |", "| --- | --- | --- |"]
    for name in names:
        if not hasattr(mod, name) or name not in docs:
            LOG.warning("%s: %s.%s is not a documented constant", where, module, name)
            continue
        lines.append(f"| `{name}` | {_value(getattr(mod, name))} | {_markdown(docs[name])} |")
    return "\n".join(lines)


def _default(field) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "none"
    return f"`{str(value).lower() if isinstance(value, bool) else value}`"


def fields_table(module: str, name: str, where: str = "") -> str:
    """A Markdown table of the fields of the pydantic model ``module.name`` (but ``kind``): the key a spec writes,
    the default and the description (a warning, which fails a strict build, for a missing model or a field
    without a description)."""
    model = getattr(importlib.import_module(module), name, None)
    if not hasattr(model, "model_fields"):
        LOG.warning("%s: %s.%s is not a config model", where, module, name)
        return ""
    lines = ["| field | default | meaning |", "| --- | --- | --- |"]
    for key, field in model.model_fields.items():
        if key == "kind":
            continue
        if not field.description:
            LOG.warning("%s: %s.%s.%s has no description", where, module, name, key)
        text = _markdown(field.description or "").replace("|", "\\|")
        lines.append(f"| `{field.alias or key}` | {_default(field)} | {text} |")
    return "\n".join(lines)


def on_config(config, **kwargs):
    """The generated sections of the navigation, and the atlas where docs/atlas.md exists."""
    nav = config["nav"]
    guide = next(item["Guide"] for item in nav if isinstance(item, dict) and "Guide" in item)
    docs = Path(config["docs_dir"])
    if (docs / "atlas.md").is_file() and not any("atlas.md" in item.values() for item in guide):
        at = next((i for i, item in enumerate(guide) if "importance.md" in item.values()), len(guide) - 1)
        guide.insert(at + 1, {"Atlas": "atlas.md"})
    nav.append({"API reference": [{"Public namespace": "api/public-namespace.md"}]
                + [{API[m][0]: f"api/{m}.md"} for m in api_modules()]})
    results = result_files()
    if results:
        nav.append({"Results": ["results/index.md"]
                    + [{result_title(p): f"results/{p.stem}.md"} for p in results]})
    return config


def on_files(files, config, **kwargs):
    """The API reference and Results pages, generated."""
    modules = api_modules()
    for m in modules:
        files.append(File.generated(config, f"api/{m}.md", content=api_page(m)))
    page = namespace_page({m: f"{m}.md" for m in modules})
    files.append(File.generated(config, "api/public-namespace.md", content=page))
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
    """Tables of constants and of config fields filled in; links to ``../benchmarks/results/<name>.md`` go to the generated Results page
    of that file; links to a file
    of ``examples/`` become their label (a warning, which fails a strict build, if the file does not exist)."""
    here = posixpath.dirname(page.file.src_uri)

    def to_page(m: re.Match) -> str:
        target = posixpath.relpath(f"results/{m.group(1)}.md", here or ".")
        return f"]({target}{m.group(2) or ''})"

    def to_label(m: re.Match) -> str:
        if not (ROOT / m.group(2)).is_file():
            LOG.warning("%s links to %s, which does not exist", page.file.src_uri, m.group(2))
        return m.group(1)

    def to_table(m: re.Match) -> str:
        return constants_table(m.group(1), m.group(2).split(), page.file.src_uri)

    markdown = CONSTANTS.sub(to_table, markdown)
    markdown = FIELDS.sub(lambda m: fields_table(m.group(1), m.group(2), page.file.src_uri), markdown)
    return EXAMPLE_LINK.sub(to_label, RESULT_LINK.sub(to_page, markdown))
