"""``headlab new-plugin``: write a pip-installable plugin package to start a new method from.

    headlab new-plugin {detector|steering|decoder|task|metric} NAME [DIR]

writes into ``DIR`` (default ``./headlab-NAME``)::

    pyproject.toml             the distribution, with NAME in the ``headlab`` entry-point group
    README.md                  what the method does, how to install, test and use it in a spec
    headlab_NAME/__init__.py   the plugin: a config model (kind NAME), the method, the hook
    tests/test_NAME.py         the method checked against an independent computation

Each kind starts from a small, working method written only against public names of ``headlab``:

- ``detector``: attention to the first token of the prompt (attention sinks), checked against the
  attention weights of a plain eager-attention forward of a tiny random model;
- ``steering``: scale the outputs of chosen heads (and, optionally, the other heads of their layers),
  checked against forward hooks on the output projection;
- ``decoder``: greedy decoding with a repetition penalty, checked against a plain loop without a cache;
- ``task``: associative recall over random tokens (key-value pairs, then one key), its examples checked;
- ``metric``: token-level F1 between output and target, checked against values worked out by hand.

The package's own test passes right after ``pip install -e DIR``. Templates are files under
``headlab/templates/new_plugin`` with ``string.Template`` placeholders (``$kind``, ``$package``, ...).
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from string import Template

from . import __version__
from .plugin_manager import get_manager

__all__ = ["KINDS", "ScaffoldError", "Names", "names_for", "new_plugin"]

#: plugin kind -> component category it registers into
KINDS: dict[str, str] = {
    "detector": "detectors",
    "steering": "steering",
    "decoder": "decoders",
    "task": "tasks",
    "metric": "metrics",
}

_HOOKS = {category: f"headlab_register_{category}" for category in KINDS.values()}

_NAME = re.compile(r"^[a-z][a-z0-9]*(?:[_-][a-z0-9]+)*$")


class ScaffoldError(ValueError):
    """The plugin cannot be generated (unknown kind, invalid name, occupied directory); says why."""


@dataclass(frozen=True)
class Names:
    """The names one plugin package uses, derived from NAME.

    ``kind`` is the spec kind and entry-point name (``attention_sink``), ``package`` the import package
    (``headlab_attention_sink``), ``dist`` the distribution (``headlab-attention-sink``), ``config_class``
    the config model (``AttentionSink``).
    """

    kind: str
    package: str
    dist: str
    config_class: str


def names_for(name: str) -> Names:
    """Derive the package's names from NAME; :class:`ScaffoldError` if NAME is not a valid plugin name."""
    if not _NAME.match(name):
        raise ScaffoldError(f"plugin name {name!r} is not valid: use lower-case letters, digits and single "
                            "'_' or '-' between them, starting with a letter (e.g. attention_sink)")
    kind = name.replace("-", "_")
    package = kind if kind.startswith("headlab_") else f"headlab_{kind}"
    config_class = "".join(part.capitalize() for part in kind.split("_"))
    if keyword.iskeyword(package) or not package.isidentifier():  # pragma: no cover - excluded by _NAME
        raise ScaffoldError(f"plugin name {name!r} does not give a Python package name")
    return Names(kind=kind, package=package, dist=package.replace("_", "-"), config_class=config_class)


def _template_root() -> Path:
    return Path(str(resources.files("headlab") / "templates" / "new_plugin"))


def _render(path: Path, values: dict[str, str]) -> str:
    try:
        return Template(path.read_text()).substitute(values)
    except (KeyError, ValueError) as e:  # a broken template is a bug of headlab, not of the user
        raise RuntimeError(f"template {path.name}: {e}") from e


def _existing_kind(category: str, kind: str) -> str | None:
    """The plugin that already registers ``kind`` in ``category``, if any."""

    component = get_manager().components.get(category, {}).get(kind)
    return None if component is None else component.plugin


def new_plugin(kind: str, name: str, directory: str | Path | None = None, *, check_installed: bool = True,
               ) -> list[Path]:
    """Write a plugin package of ``kind`` named ``name`` into ``directory``; return the files written.

    ``directory`` defaults to ``./headlab-<name>``; it may exist only if it is empty. With
    ``check_installed``, a ``name`` that an installed plugin (or headlab itself) already uses as a kind of
    that category is refused, since two components of one kind cannot both be registered.
    """
    if kind not in KINDS:
        raise ScaffoldError(f"unknown plugin kind {kind!r}; one of: {', '.join(KINDS)}")
    names = names_for(name)
    category = KINDS[kind]
    if check_installed and (owner := _existing_kind(category, names.kind)) is not None:
        raise ScaffoldError(f"{kind} kind {names.kind!r} already exists (registered by plugin {owner!r}); "
                            "choose another name")
    target = Path(directory) if directory is not None else Path.cwd() / names.dist
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ScaffoldError(f"{target} already exists and is not an empty directory")

    values = {
        "name": name, "kind": names.kind, "package": names.package, "dist": names.dist,
        "config_class": names.config_class, "category": category, "hook": _HOOKS[category],
        "plugin_kind": kind, "headlab_version": __version__,
    }
    root = _template_root()
    files = {
        "pyproject.toml": root / "pyproject.toml.tmpl",
        "README.md": root / kind / "README.md.tmpl",
        f"{names.package}/__init__.py": root / kind / "plugin.py.tmpl",
        f"tests/test_{names.kind}.py": root / kind / "test_plugin.py.tmpl",
    }
    rendered = {rel: _render(src, values) for rel, src in files.items()}  # render all before writing any
    written = []
    for rel, text in rendered.items():
        out = target / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        written.append(out)
    return written
