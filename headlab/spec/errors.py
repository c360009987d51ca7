"""Located spec errors: :class:`SpecError` (``file:line:col: key.path: message``), and turning pydantic's
validation errors into one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from .fields import ID_PATTERN, NAME_PATTERN

__all__ = ["SpecError", "first_error", "format_path"]


_PATTERN_HELP = {
    NAME_PATTERN: "a name may hold only letters, digits, '.', '_' and '-', starting with a letter or digit "
                  "(it names the run directory)",
    ID_PATTERN: "a step id may hold only letters, digits, '_' and '-', starting with a letter or '_'",
}


class SpecError(Exception):
    """A spec problem, located: ``file:line:col: key.path: message``. One line, no traceback."""

    def __init__(self, message: str, *, source: str = "<spec>", line: int | None = None,
                 col: int | None = None, path: str = "") -> None:
        self.message, self.source, self.line, self.col, self.path = message, source, line, col, path
        super().__init__(str(self))

    def __str__(self) -> str:
        where = self.source
        if self.line is not None:
            where += f":{self.line}:{self.col or 1}"
        return one_line(f"{where}: {self.path + ': ' if self.path else ''}{self.message}")


def one_line(text: str) -> str:
    """``text`` with line breaks and other unprintable characters escaped (``\\n``, ``\\x1b``): a key or value
    quoted from a spec cannot break an error's one line or move the terminal's cursor."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _position(tree: Any, path: list[Any]) -> tuple[int | None, int | None]:
    """1-based (line, col) of the deepest node of ``path`` present in the round-trip tree."""
    node, line, col = tree, None, None
    for part in path:
        try:
            if isinstance(node, Mapping) and part in node:
                line, col = node.lc.key(part)
                node = node[part]
            elif isinstance(node, list) and isinstance(part, int) and part < len(node):
                line, col = node.lc.item(part)
                node = node[part]
            elif isinstance(node, Mapping) and part in (node.get("kind"), node.get("executor")):
                continue  # discriminator tag in pydantic's location
            else:
                break
        except (AttributeError, KeyError, TypeError):
            break
    if line is None:
        return (1, 1) if path else (None, None)
    return line + 1, col + 1


def format_path(path: Iterable[Any]) -> str:
    """``['steps', 0, 'detect', 'kind']`` -> ``steps[0].detect.kind``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _clean_loc(loc: tuple[Any, ...], data: Any) -> list[Any]:
    """Drop pydantic's union-member markers from an error location, keeping real keys."""
    out: list[Any] = []
    node = data
    for part in loc:
        if isinstance(node, Mapping) and part not in node and isinstance(part, str) and (
                part in (node.get("kind"), node.get("executor")) or "[" in part
                or part.startswith(("function-", "constrained-", "lax-"))
                or part in ("list", "dict", "str", "int", "float")):
            continue
        if not isinstance(node, Mapping) and isinstance(part, str) and out:
            continue  # a union member's marker below a list or a scalar (``list[int]``, ``constrained-int``)
        out.append(part)
        if isinstance(node, Mapping):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            node = None
    return out


def first_error(exc: ValidationError, data: Any, tree: Any, source: str) -> SpecError:
    """Turn pydantic's first (most specific) error into a located one-line SpecError."""
    errors = exc.errors(include_url=False)
    rank = {"unknown_key": 0, "unknown_kind": 0, "missing_kind": 0, "step_action": 1}
    # most specific first; among equals, a member of a union that rejects the value beats one of the wrong type
    errors.sort(key=lambda e: (rank.get(e["type"], 2), -len(e["loc"]), e["type"].endswith("_type")))
    err = errors[0]
    path = _clean_loc(err["loc"], data)
    msg = err["msg"]
    if err["type"] == "unknown_key":
        path.append(err["ctx"]["key"])
    elif err["type"] == "missing":
        msg = f"missing required key '{path[-1]}'" if path else msg
    elif err["type"] in ("union_tag_invalid", "literal_error") and path and path[-1] != "kind":
        pass
    elif err["type"] == "string_pattern_mismatch" and err.get("ctx", {}).get("pattern") in _PATTERN_HELP:
        msg = f"{err['input']!r} is not allowed: {_PATTERN_HELP[err['ctx']['pattern']]}"
    msg = msg.replace("Value error, ", "")
    line, col = _position(tree, path) if tree is not None else (None, None)
    return SpecError(msg, source=source, line=line, col=col, path=format_path(path))

