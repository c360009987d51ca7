"""Hardened YAML loading: :func:`parse_yaml` and the limits it enforces.

A spec is YAML loaded safely: no tags, no duplicate keys, never any code, and within limits of size,
depth and expanded values, so a hostile file fails fast with one located line.
"""

from __future__ import annotations

import functools
import io
import re
from collections.abc import Mapping
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.constructor import ConstructorError, RoundTripConstructor
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.reader import ReaderError
from ruamel.yaml.scanner import RoundTripScanner, ScannerError

from .errors import SpecError, _position, format_path

__all__ = ["MAX_DEPTH", "MAX_NODES", "MAX_SPEC_BYTES", "MAX_SPEC_CHARS", "MAX_YAML_INT", "SAFE_TAGS", "parse_yaml"]


# Limits on what a spec may be: YAML is parsed within them, so a hostile file fails fast with one line.
MAX_SPEC_CHARS = 65_536
"""Longest spec text (characters); data belongs in a task's data file, not in the spec. (The YAML parser
that locates errors reads about 30 KB a second, so this also bounds the time to load a spec.)"""
MAX_SPEC_BYTES = 4 * MAX_SPEC_CHARS
"""Largest spec file (bytes), checked with ``os.stat`` before the file is read: no text of
:data:`MAX_SPEC_CHARS` characters takes more in UTF-8 (at most 4 bytes a character)."""
MAX_DEPTH = 64
"""Deepest nesting of mappings and lists (aliases included), checked while scanning, so ``[[[[...`` fails at once."""
MAX_NODES = 50_000
"""Most values (mapping/list entries and scalars) a spec may hold once its YAML aliases are expanded (a 1 KB
alias bomb fails in well under a second, also inside ``model.config``)."""
MAX_YAML_INT = 2**63 - 1

_SURROGATE = re.compile("[\ud800-\udfff]")
"""Largest integer (in absolute value) a spec's YAML may hold: past it no tensor or C library can take it."""

SAFE_TAGS = re.compile(r"^tag:yaml\.org,2002:(str|int|float|bool|null|map|seq|timestamp)$")


class _Walk:
    """Plain Python from a ruamel round-trip tree, within :data:`MAX_DEPTH` and :data:`MAX_NODES`.

    Aliases are shared nodes in the tree; copying them is where an alias bomb would expand, so every
    value produced is counted and the first one past the limit is an error located at its key.
    """

    def __init__(self, source: str, tree: Any) -> None:
        self.source, self.tree, self.count, self.path = source, tree, 0, []

    def fail(self, message: str, at: tuple[int, int] | None = None) -> SpecError:
        line, col = at or _position(self.tree, self.path)
        if line is None:
            line, col = 1, 1
        shown = format_path(self.path[:8]) + ("..." if len(self.path) > 8 else "")
        return SpecError(message, source=self.source, line=line, col=col, path=shown)

    def __call__(self, node: Any) -> Any:
        self.count += 1
        if self.count > MAX_NODES:
            raise self.fail(f"the spec expands to more than {MAX_NODES:,} values (YAML aliases repeating "
                            "large anchors?)")
        if len(self.path) > MAX_DEPTH:
            raise self.fail(f"nested deeper than {MAX_DEPTH} levels")
        tag = getattr(getattr(node, "tag", None), "value", None) or getattr(node, "tag", None)
        if isinstance(tag, str) and (tag.startswith("!") or (not SAFE_TAGS.match(tag) and tag.startswith("tag:"))):
            raise self.fail(f"YAML tag {tag} is not allowed: a spec holds data only")
        if isinstance(node, Mapping):
            out = {}
            for k, v in node.items():
                if not isinstance(k, (str, int, float, bool)) and k is not None:
                    try:
                        line, col = node.lc.key(k)
                        at: tuple[int, int] | None = (line + 1, col + 1)
                    except (AttributeError, KeyError, TypeError):
                        at = None
                    raise self.fail("a key must be a plain name or number, not a "
                                    f"{'list' if isinstance(k, (list, tuple)) else 'mapping'}", at)
                key = str(k) if not isinstance(k, (int, float, bool)) else k
                if isinstance(key, str):
                    self._check_text(key)
                self.path.append(key)
                out[key] = self(v)
                self.path.pop()
            return out
        if isinstance(node, list):
            items = []
            for i, v in enumerate(node):
                self.path.append(i)
                items.append(self(v))
                self.path.pop()
            return items
        if hasattr(node, "value") and tag is not None:
            raise self.fail(f"YAML tag {tag} is not allowed: a spec holds data only")
        if isinstance(node, int) and not isinstance(node, bool) and abs(node) > MAX_YAML_INT:
            digits = len(str(abs(int(node))))
            raise self.fail(f"the integer ({digits} digits) is too large; the limit is {MAX_YAML_INT:,} in absolute value")
        if type(node).__name__ in ("ScalarFloat", "ScalarInt", "ScalarBoolean"):
            return {"ScalarFloat": float, "ScalarInt": int, "ScalarBoolean": bool}[type(node).__name__](node)
        if isinstance(node, str):
            self._check_text(node)
            return str(node)
        return node

    def _check_text(self, text: str) -> None:
        """Refuse a string holding a lone UTF-16 surrogate (a ``"\\ud800"`` escape): not Unicode text, it can
        be neither stored nor printed."""
        bad = _SURROGATE.search(text)
        if bad:
            raise self.fail(f"the text holds an unpaired surrogate (\\u{ord(bad.group()):04x}), which is not a "
                            "Unicode character: write the character itself or its \\U00XXXXXX escape")


def _locate_tag(node: Any, path: list[Any] | None = None, seen: set[int] | None = None) -> tuple[Any, list[Any]] | None:
    """The first explicit tag in the tree: (its parent, its path). Shared (aliased) nodes are visited once."""
    path = path or []
    seen = set() if seen is None else seen
    if id(node) in seen or len(path) > MAX_DEPTH:
        return None
    seen.add(id(node))
    if isinstance(node, Mapping):
        for k, v in node.items():
            t = getattr(v, "tag", None)
            tv = getattr(t, "value", t)
            if isinstance(tv, str) and (tv.startswith("!") or (tv.startswith("tag:") and not SAFE_TAGS.match(tv))):
                return node, path + [k]
            found = _locate_tag(v, path + [k], seen)
            if found:
                return found
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found = _locate_tag(v, path + [i], seen)
            if found:
                return found
    return None


def _located(build: Any) -> Any:
    """``build`` (a constructor method) with any failure to build a value turned into a YAML error at the value."""

    @functools.wraps(build)
    def wrapper(self: Any, node: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return build(self, node, *args, **kwargs)
        except (YAMLError, RecursionError):
            raise
        except Exception as e:
            raise ConstructorError(None, None, f"cannot read this value ({type(e).__name__}: {e})",
                                   node.start_mark) from None
    return wrapper


class _LocatedConstructor(RoundTripConstructor):
    """ruamel's round-trip constructor, turning any failure to build a value (``!!int abc``, a ``!!pairs``
    key) into a YAML error at that value's position."""

    construct_object = _located(RoundTripConstructor.construct_object)
    construct_mapping = _located(RoundTripConstructor.construct_mapping)


class _BoundedScanner(RoundTripScanner):
    """ruamel's round-trip scanner, refusing nesting past :data:`MAX_DEPTH` as it reads (its look-ahead for
    simple keys is quadratic in the flow nesting depth, so the limit must hold before the composer's)."""

    def _too_deep(self) -> ScannerError:
        return ScannerError(None, None, f"nested deeper than {MAX_DEPTH} levels", self.reader.get_mark())

    def fetch_flow_collection_start(self, TokenClass: Any, to_push: str) -> None:
        if len(self.flow_context) >= MAX_DEPTH:
            raise self._too_deep()
        super().fetch_flow_collection_start(TokenClass, to_push)

    def add_indent(self, column: int) -> bool:
        if len(self.indents) >= MAX_DEPTH:
            raise self._too_deep()
        return super().add_indent(column)


def parse_yaml(text: str, source: str = "<spec>") -> tuple[dict[str, Any], Any]:
    """Parse spec YAML safely. Returns (plain data, round-trip tree for locating errors).

    Refused with one located :class:`SpecError`: explicit tags, duplicate keys, a text longer than
    :data:`MAX_SPEC_CHARS`, nesting deeper than :data:`MAX_DEPTH`, and more than :data:`MAX_NODES`
    values once aliases are expanded.
    """
    if len(text) > MAX_SPEC_CHARS:
        raise SpecError(f"the spec is {len(text):,} characters long; the limit is {MAX_SPEC_CHARS:,} (data "
                        "belongs in a task's data file)", source=source, line=1, col=1)
    yaml = YAML(typ="rt")
    yaml.allow_duplicate_keys = False
    yaml.max_depth = MAX_DEPTH
    yaml.Scanner = _BoundedScanner
    yaml.Constructor = _LocatedConstructor
    try:
        tree = yaml.load(io.StringIO(text))
    except MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        problem = (e.problem or e.context or "invalid YAML").strip()
        if "duplicate key" in problem:
            problem = problem.split(" with value")[0].replace("found duplicate key", "duplicate key")
        if "maximum depth" in problem:
            problem = f"nested deeper than {MAX_DEPTH} levels"
        raise SpecError(problem, source=source, line=mark.line + 1 if mark else None,
                        col=mark.column + 1 if mark else None) from None
    except ReaderError as e:
        where = text[: e.position] if isinstance(e.position, int) else ""
        raise SpecError(f"invalid YAML: {str(e).splitlines()[0]}", source=source, line=where.count("\n") + 1,
                        col=len(where) - (where.rfind("\n") + 1) + 1) from None
    except YAMLError as e:
        raise SpecError(f"invalid YAML: {str(e).splitlines()[0]}", source=source, line=1, col=1) from None
    except RecursionError:  # a parser path not covered by max_depth
        raise SpecError(f"nested deeper than {MAX_DEPTH} levels", source=source, line=1, col=1) from None
    if tree is None:
        raise SpecError("the spec is empty", source=source, line=1, col=1)
    if not isinstance(tree, Mapping):
        raise SpecError("a spec is a mapping of keys (name, model, task, steps, ...)", source=source, line=1, col=1)
    tagged = _locate_tag(tree)
    if tagged:
        parent, path = tagged
        line, col = _position(tree, path)
        tag = getattr(parent[path[-1]], "tag", None)
        raise SpecError(f"YAML tag {getattr(tag, 'value', tag)} is not allowed: a spec holds data only",
                        source=source, line=line, col=col, path=format_path(path))
    return _Walk(source, tree)(tree), tree

