"""What a run's cells were computed from, so that resuming cannot mix results of different inputs.

A new run records, beside its spec, the digest of every local file the spec reads (:func:`input_digests`:
task data files, head files, stored scores, haystacks, synonym lists: the string values of keys named
``path``, ``file``, ``load``, ``haystack``, ``synonyms`` or ending in ``_path``/``_file``, outside ``model``,
in the spec and in its sweep values) and the model's weights digest. ``headlab run --resume RUN`` computes
them again and refuses, in one line, a run whose inputs changed since (:func:`check_resume`): the spec as
headlab resolves it now (a changed default of a newer headlab or plugin), a data file, or the weights.
``--recompute`` (``headlab.run(None, resume=RUN, recompute=True)``) is the explicit way on: every cell is
computed again from the current inputs, which are recorded.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["INPUT_KEYS", "InputChanged", "check_resume", "file_digest", "input_digests"]

INPUT_KEYS = frozenset({"path", "file", "load", "haystack", "synonyms"})
"""Spec keys whose string value names a local file a run reads (besides keys ending in ``_path``/``_file``)."""

_NOT_INPUTS = frozenset({"model", "output", "execution", "limits", "sweep"})


class InputChanged(ValueError):
    """A run cannot be resumed: an input it was computed from has changed; the message names it and the way to
    recompute."""


def file_digest(path: Path) -> str:
    """``sha256:<hex>`` of a file's bytes."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _is_input(key: str) -> bool:
    return key in INPUT_KEYS or key.endswith(("_path", "_file"))


def _named_files(node: Any, where: str) -> Iterator[tuple[str, str]]:
    """(spec location, value) of every string that names an input file in a dumped spec."""
    if isinstance(node, Mapping):
        for key, value in node.items():
            if not where and key in _NOT_INPUTS:
                continue
            at = f"{where}.{key}" if where else str(key)
            if isinstance(value, str) and _is_input(str(key)):
                yield at, value
            elif isinstance(value, list) and _is_input(str(key)):
                yield from ((f"{at}[{i}]", v) for i, v in enumerate(value) if isinstance(v, str))
            else:
                yield from _named_files(value, at)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _named_files(value, f"{where}[{i}]")


def input_digests(spec: Any) -> dict[str, dict[str, str]]:
    """The local files a validated spec reads, by spec location (``task.path``, ``steps[1].generate.steer[0]
    .heads.file``, ``sweep.task.path[2]``): ``{"path": as written, "sha256": digest}``. Values that are not an
    existing regular file (a hub dataset name, a directory, a URL) are left out."""
    dumped = spec.model_dump(by_alias=True, exclude_none=True)
    found = list(_named_files(dumped, ""))
    for key, values in (dumped.get("sweep") or {}).items():
        if _is_input(str(key).rsplit(".", 1)[-1]):
            found += [(f"sweep.{key}[{i}]", v) for i, v in enumerate(values) if isinstance(v, str)]
    out: dict[str, dict[str, str]] = {}
    for where, value in found:
        path = Path(value).expanduser()
        if path.is_file():
            out[where] = {"path": value, "sha256": file_digest(path)}
    return out


def _resolved(text: str) -> dict[str, Any]:
    data = json.loads(text)
    for key in ("execution", "limits"):  # how and within what budget cells run never changes their results
        data.pop(key, None)
    return data


def _first_difference(old: Any, new: Any, where: str = "") -> str:
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        for key in sorted(set(old) | set(new), key=str):
            if old.get(key) != new.get(key):
                return _first_difference(old.get(key), new.get(key), f"{where}.{key}" if where else str(key))
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            if a != b:
                return _first_difference(a, b, f"{where}[{i}]")
    return f"{where or 'the spec'} was {json.dumps(old, default=str)[:80]}, is now {json.dumps(new, default=str)[:80]}"


def check_resume(attrs: Mapping[str, Any], spec: Any, run: str, *, model_digest: str | None = None) -> None:
    """Refuse to resume run ``run`` (its attributes ``attrs``) when what its cells were computed from changed:
    the resolved spec, a recorded input file, or (``model_digest`` given, and recorded) the weights. Raises
    :class:`InputChanged` naming the first change and ``--recompute``."""
    fix = (f"the stored cells were computed from the old one; recompute every cell with `headlab run --resume {run} "
           "--recompute`, or restore it")
    stored = attrs.get("resolved")
    if isinstance(stored, str):
        try:
            old = _resolved(stored)
        except ValueError:
            old = None
        new = _resolved(spec.model_dump_json(by_alias=True))
        if old is not None and old != new:
            raise InputChanged(f"cannot resume {run}: the spec resolves differently now (a default of headlab or a "
                               f"plugin changed): {_first_difference(old, new)}; {fix}")
    recorded = attrs.get("input_digests")
    if isinstance(recorded, str):
        try:
            recorded = json.loads(recorded)
        except ValueError:
            recorded = None
    if isinstance(recorded, Mapping):
        for where, entry in recorded.items():
            if not isinstance(entry, Mapping):
                continue
            path = Path(str(entry.get("path", ""))).expanduser()
            if not path.is_file():
                raise InputChanged(f"cannot resume {run}: {where} file {entry.get('path')!r} is gone (looked at "
                                   f"{path.resolve()}); {fix}")
            if file_digest(path) != entry.get("sha256"):
                raise InputChanged(f"cannot resume {run}: {where} file {entry.get('path')!r} changed since the run "
                                   f"started ({entry.get('sha256', '')[:19]}... then, {file_digest(path)[:19]}... "
                                   f"now); {fix}")
    before = attrs.get("model_digest")
    if model_digest and isinstance(before, str) and before and before != model_digest:
        raise InputChanged(f"cannot resume {run}: the weights of model '{attrs.get('model', '?')}' changed since the "
                           f"run started ({before[:19]}... then, {model_digest[:19]}... now); {fix}")
