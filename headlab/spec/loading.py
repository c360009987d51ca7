"""Loading a spec: validate raw data or YAML into a :class:`LoadedSpec`, every error located in the YAML."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..plugin_manager import Registry, get_manager
from .errors import SpecError, first_error
from .heads import _check_references
from .safe_yaml import MAX_SPEC_BYTES, MAX_SPEC_CHARS, parse_yaml
from .spec_model import build_spec_model
from .sweep import Cell, Cells, _check_sweep, set_path

__all__ = ["LoadedSpec", "load_spec", "read_spec_file", "validate_data"]


@dataclass
class LoadedSpec:
    """A validated spec: the pydantic object, the raw data it came from, and its text."""

    spec: Any
    data: dict[str, Any]
    text: str
    source: str
    tree: Any = None
    registry: Any = None

    @property
    def cells(self) -> Cells:
        """The sweep grid in row-major order of the sweep keys (one cell when there is no sweep)."""
        return Cells(self.spec.sweep)

    def for_cell(self, cell: Cell) -> Any:
        """The spec object with the cell's sweep values applied."""
        data = {k: v for k, v in self.data.items() if k != "sweep"}
        for key, value in cell.values:
            data = set_path(data, key, value, registry=self.registry)
        return self.spec.__class__.model_validate(data)

    def with_overrides(self, overrides: Mapping[str, Any]) -> LoadedSpec:
        """A new loaded spec with ``--set path=value`` overrides applied to its data."""
        data = self.data
        for key, value in overrides.items():
            try:
                data = set_path(data, key, value, registry=self.registry)
            except KeyError as e:
                raise SpecError(f"--set {e.args[0]}", source=self.source) from None
        try:
            return validate_data(data, text=self.text, source=self.source, tree=None, registry=self.registry)
        except SpecError as e:
            key = next((k for k in overrides if e.path == k or (e.path or "").startswith(f"{k}.")
                        or (e.path or "").startswith(f"{k}[")), None)
            if key is None:
                raise
            raise SpecError(f"--set {key}={overrides[key]!r}: {e.path}: {e.message}", source="command line") from None

    def with_execution(self, execution: Mapping[str, Any]) -> LoadedSpec:
        """A new loaded spec whose ``execution`` is updated by ``execution`` (the CLI's ``--executor``,
        ``--address``): naming another executor starts from that executor's defaults."""
        data = copy.deepcopy(self.data)
        current = data.get("execution")
        current = {"executor": current} if isinstance(current, str) else dict(current or {})
        now = current.pop("kind", current.pop("executor", getattr(self.spec.execution, "kind", None)))
        kind = execution.get("executor", execution.get("kind", now))
        current = {"executor": kind, **(current if kind == now else {})}
        current.update({k: v for k, v in execution.items() if v is not None and k != "kind"})
        data["execution"] = current
        return validate_data(data, text=self.text, source=self.source, tree=None, registry=self.registry)


def _too_big(path: Path, size: int, at_least: bool = False) -> SpecError:
    return SpecError(f"the spec file is {'over ' if at_least else ''}{size:,} bytes; the limit is {MAX_SPEC_BYTES:,} "
                     f"bytes (MAX_SPEC_BYTES, for at most {MAX_SPEC_CHARS:,} characters of spec); is it the spec you "
                     "meant? (data belongs in a task's data file)", source=str(path))


def read_spec_file(path: Path) -> str:
    """The text of the spec file ``path``: its size checked (``os.stat``) before anything is read, then
    decoded as UTF-8 (newlines as text mode reads them). A file over :data:`MAX_SPEC_BYTES`, or bytes that
    are not UTF-8, is one :class:`SpecError` naming the file (and the line, column and byte offset)."""
    size = path.stat().st_size
    if size > MAX_SPEC_BYTES:
        raise _too_big(path, size)
    with path.open("rb") as fh:  # read at most the limit: a file that grows, or one whose size stat cannot tell
        raw = fh.read(MAX_SPEC_BYTES + 1)
    if len(raw) > MAX_SPEC_BYTES:
        raise _too_big(path, MAX_SPEC_BYTES, at_least=True)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        start = raw.rfind(b"\n", 0, e.start) + 1
        col = len(raw[start:e.start].decode("utf-8", errors="replace")) + 1
        raise SpecError(f"the file is not UTF-8: byte 0x{raw[e.start]:02x} at byte offset {e.start:,} (line {line}, "
                        f"column {col}) is not valid UTF-8 (text saved as Latin-1 or Windows-1252?); save it as "
                        "UTF-8", source=str(path), line=line, col=col) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def validate_data(data: dict[str, Any], *, text: str = "", source: str = "<spec>", tree: Any = None,
                  registry: Registry | None = None) -> LoadedSpec:
    """Validate raw spec data, sweep included; raise SpecError located in the YAML.

    ``registry`` defaults to the plugin manager's registry at the time of each call.
    """
    Spec = build_spec_model(registry or get_manager().registry)
    try:
        spec = Spec.model_validate(data)
    except ValidationError as e:
        raise first_error(e, data, tree, source) from None
    _check_references(spec, tree, source)
    loaded = LoadedSpec(spec=spec, data=data, text=text, source=source, tree=tree, registry=registry)
    _check_sweep(spec, data, tree, source, registry)
    return loaded


def load_spec(source: str | Path | Mapping[str, Any], *, registry: Registry | None = None) -> LoadedSpec:
    """Load and validate a spec from a path, a YAML string, or a mapping.

    Raises :class:`SpecError` with ``file:line:col: key.path: message`` on any problem.
    """
    if isinstance(source, Mapping):
        return validate_data(copy.deepcopy(dict(source)), source="<dict>", registry=registry)
    if isinstance(source, Path) or (isinstance(source, str) and "\n" not in source
                                    and source.endswith((".yaml", ".yml"))):
        path = Path(source)
        if not path.is_file():
            raise SpecError(f"no such spec file; check the path{' (it is a directory)' if path.is_dir() else ''}",
                            source=str(path))
        text, name = read_spec_file(path), str(path)
    else:
        text, name = str(source), "<spec>"
    data, tree = parse_yaml(text, name)
    return validate_data(data, text=text, source=name, tree=tree, registry=registry)

