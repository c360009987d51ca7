"""Results: xarray conventions, the zarr run store, and the run catalog.

A run is one zarr group (a directory, or any fsspec URL zarr accepts) whose attributes hold the spec
text, the resolved config and provenance. A local run is created under a temporary name and renamed into
place, so a run directory is never half-created. Each sweep cell is written as it finishes to
``cells/<cell>/<step id>``; a cell group with ``done: true`` is complete and lists the arrays it wrote
(shape, number and bytes of chunk files), so an interrupted run resumes where it stopped and reading a
local run verifies it: a missing cell of a complete run, or a missing or changed chunk, is a
:class:`RunDamaged` error naming it, never fill values. Cells are disjoint groups, so workers of a
distributed executor write them side by side while the driver alone writes the run's attributes and the
``done`` marks. A cell that a step stopped keeps the steps completed before it, marked ``partial`` (never
``done``), read and verified like a finished cell and computed again as a whole on resume. ``Run.results``
combines the cells of a step into one Dataset with one dimension per sweep key.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit
from urllib.request import url2pathname

import numpy as np
import xarray as xr

from .display import run_html, run_summary
from .spec import Cell
from .version import __version__

if TYPE_CHECKING:
    import zarr

__all__ = ["FORMAT", "Run", "RunDamaged", "RunFormatTooNew", "RunNotFound", "RunWriter", "list_runs", "open_run"]

FORMAT = "headlab-run/1"
CREATING = ".creating"
"""Suffix of the temporary directory a run store is built in before it is renamed into place."""
_MANIFEST_KEYS = 256


class RunNotFound(Exception):
    """No headlab run store at a path."""


class RunDamaged(RunNotFound):
    """A run store exists but is incomplete or corrupt; the message names what is missing or changed."""


class RunFormatTooNew(RunDamaged):
    """A run store written by a newer headlab, in a format this version cannot read."""


def _array_files(array_dir: Path) -> dict[str, int]:
    """Chunk files of one stored array: relative key -> size in bytes."""
    out = {}
    for root, _, files in os.walk(array_dir):
        for f in files:
            full = Path(root) / f
            key = full.relative_to(array_dir).as_posix()
            if key != "zarr.json":
                out[key] = full.stat().st_size
    return out


def _read_meta(path: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def step_manifest(step_dir: Path) -> dict[str, dict[str, Any]]:
    """What a stored step group holds: array name -> shape, number and bytes of chunk files (and their
    keys when there are few)."""
    out: dict[str, dict[str, Any]] = {}
    if not step_dir.is_dir():
        return out
    for child in sorted(step_dir.iterdir()):
        meta = _read_meta(child / "zarr.json") if child.is_dir() else None
        if meta is None or meta.get("node_type") != "array":
            continue
        files = _array_files(child)
        entry: dict[str, Any] = {"shape": list(meta.get("shape", [])), "chunks": len(files),
                                 "bytes": sum(files.values())}
        if len(files) <= _MANIFEST_KEYS:
            entry["keys"] = sorted(files)
        out[child.name] = entry
    return out


def stored_cells(path: Path) -> list[tuple[str, dict[str, Any] | None]]:
    """The cell groups of the run store at ``path``, read from disk: (name, attributes), ``None`` for a
    group whose metadata is unreadable. Sorted by name."""
    cells_dir = path / "cells"
    out: list[tuple[str, dict[str, Any] | None]] = []
    if not cells_dir.is_dir():
        return out
    for child in sorted(cells_dir.iterdir()):
        if not child.is_dir():
            continue
        meta = _read_meta(child / "zarr.json")
        if meta is None and not (child / "zarr.json").exists():
            continue  # not a group (a cell deleted, or not yet created)
        attrs = meta.get("attributes") if meta is not None and meta.get("node_type") == "group" else None
        out.append((child.name, attrs if isinstance(attrs, dict) else None))
    return out


def cell_problems(path: Path, cell: str, attrs: Mapping[str, Any]) -> list[str]:
    """What is missing or changed in a finished (or partial) cell of the run store at ``path``, compared with the list
    of arrays it recorded when it was written (cells written before that list existed are checked for
    their step groups only)."""
    problems = []
    recorded = attrs.get("arrays")
    for step in attrs.get("steps", []):
        where = f"cells/{cell}/{step}"
        step_dir = path / "cells" / cell / step
        if _read_meta(step_dir / "zarr.json") is None:
            problems.append(f"{where} is missing")
            continue
        if not isinstance(recorded, Mapping) or step not in recorded:
            continue
        found = step_manifest(step_dir)
        for name, want in recorded[step].items():
            have = found.get(name)
            if have is None:
                problems.append(f"{where}/{name} is missing or unreadable")
            elif have["shape"] != want["shape"]:
                problems.append(f"{where}/{name} has shape {have['shape']}, written as {want['shape']}")
            elif have["chunks"] != want["chunks"] or have["bytes"] != want["bytes"]:
                gone = sorted(set(want.get("keys", [])) - set(have.get("keys", [])))
                if gone:
                    what = f"chunk {where}/{name}/{gone[0]} is missing" + (
                        f" (and {len(gone) - 1} more)" if len(gone) > 1 else "")
                else:
                    what = (f"{where}/{name} has {have['chunks']} chunk files ({have['bytes']} bytes), written "
                            f"with {want['chunks']} ({want['bytes']} bytes)")
                problems.append(what)
    return problems


def _json_attr(value: Any) -> Any:
    """Attributes must be JSON: convert numpy scalars and tuples."""
    return json.loads(json.dumps(value, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


def _encodable(ds: xr.Dataset) -> xr.Dataset:
    """Strings as variable-length (object) arrays, attrs as JSON, so zarr v3 stores them portably."""
    ds = ds.copy()
    for name, var in {**ds.data_vars, **ds.coords}.items():
        if var.dtype.kind == "U":
            ds[name] = var.astype(object)
    ds.attrs = {k: _json_attr(v) for k, v in ds.attrs.items()}
    for var in ds.variables.values():
        var.attrs = {k: _json_attr(v) for k, v in var.attrs.items()}
        var.encoding = {}
    return ds


def store_location(path: str | Path) -> str:
    """Where zarr opens a run store: a local path (``~`` expanded; a ``file://`` URL becomes its path) or an
    fsspec URL (``s3://bucket/runs/x``, ``gs://...``, ``memory://...``) passed to zarr as is."""
    text = str(path)
    if text.startswith("file://"):
        return url2pathname(urlsplit(text).path)
    if is_url(text):
        return text
    return os.path.expanduser(text)


def is_url(location: str | Path) -> bool:
    """Whether a store location is a URL (not a local path)."""
    return "://" in str(location)


def _padding(dtype: np.dtype) -> Any:
    """What pads a variable of ``dtype`` where cells of a sweep differ in size (None: xarray's NaN)."""
    if np.issubdtype(dtype, np.integer):
        return -1
    if np.issubdtype(dtype, np.bool_):
        return False
    if dtype.kind in "OUT":  # str, bytes, object (strings), numpy's StringDType
        return ""
    return None


def coord_value(value: Any) -> Any:
    """A sweep value as a coordinate label (lists and mappings become their JSON text)."""
    if isinstance(value, (list, dict, tuple)):
        return json.dumps(value, sort_keys=True)
    return value


def _open_group(location: str, mode: str) -> zarr.Group:
    """The root group of the zarr store at ``location`` (a path or an fsspec URL), opened with ``mode``."""
    import zarr  # a large import that `headlab --help`, `headlab plugins` and loading the plugins need none of

    return zarr.open_group(location, mode=mode)


def _clear_cell(store: Path, cell_name: str) -> None:
    """Remove what a local store holds at ``cells/<cell_name>`` before the cell is written again, without
    following a symbolic link: a link there is removed (its target is left alone). (A ``cells`` that is a link
    is refused when the writer is made.)"""
    target = store / "cells" / cell_name
    if target.is_symlink():
        target.unlink()
    else:
        shutil.rmtree(target, ignore_errors=True)


@dataclass
class RunWriter:
    """Writes the cells of one run into its store (a local path, a ``file://`` URL or an fsspec URL)."""

    path: Path | str

    def __post_init__(self) -> None:
        self.location = store_location(self.path)
        if not is_url(self.location):
            self.path = Path(self.location)
            cells = self.path / "cells"
            if cells.is_symlink():
                raise RunDamaged(f"{cells} is a symbolic link (to {os.readlink(cells)}); headlab never writes "
                                 "through a link inside a run store: replace it with the directory it points to, "
                                 "then resume")

    @classmethod
    def create(cls, path: Path | str, attrs: Mapping[str, Any]) -> RunWriter:
        """Create a new run store at ``path`` with run-level attributes. A local store is created
        atomically: built in a temporary directory beside ``path`` (``.<name>.<random>.creating``) and
        renamed into place, so ``path`` either does not exist or holds a complete, empty run. Raises
        FileExistsError when ``path`` exists."""
        location = store_location(path)
        if is_url(location):
            root = _open_group(location, "w-")
            root.attrs.update(_json_attr({"format": FORMAT, **attrs}))
            root.create_group("cells")
            return cls(location)
        path = Path(location)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            raise FileExistsError(f"'{path}' exists; a new run never overwrites one")
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=CREATING, dir=path.parent))
        try:
            root = _open_group(str(tmp), "w")
            root.attrs.update(_json_attr({"format": FORMAT, **attrs}))
            root.create_group("cells")
            os.rename(tmp, path)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError) and e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise FileExistsError(f"'{path}' exists; a new run never overwrites one") from None
            raise
        return cls(path)

    def root(self) -> zarr.Group:
        return _open_group(self.location, "r+")

    def done_cells(self) -> set[str]:
        """Names of cells already complete and intact (a damaged cell is written again on resume; cells of
        a URL store are taken as marked)."""
        if is_url(self.location):
            return {name for name, grp in self.root()["cells"].groups() if grp.attrs.get("done")}
        path = Path(self.location)
        return {name for name, attrs in stored_cells(path)
                if attrs and attrs.get("done") and not cell_problems(path, name, attrs)}

    def write_cell(self, cell_name: str, values: Mapping[str, Any], results: Mapping[str, xr.Dataset],
                   timing: Mapping[str, Any], *, done: bool = True, failed: Mapping[str, Any] | None = None) -> None:
        """Write every step dataset of a finished cell, then mark the cell done with the list of arrays
        it wrote (one atomic update of the cell's attributes).

        ``done=False`` leaves the mark to :meth:`mark_done` (a distributed executor's worker writes the
        cell, its driver records completion); until then the cell is not read as finished.

        ``failed`` (``{"step": id, "error": line}``) writes a cell that a step stopped: ``results`` are the
        steps completed before ``failed["step"]``, and the same atomic update marks the cell ``partial``
        (never done) with ``failed_step`` and ``error``. A partial cell is read (:attr:`Run.results`,
        :attr:`Run.partial_cells`) and verified like a finished one, and computed again as a whole on resume."""
        if failed is not None and done:
            raise ValueError("a partial cell (failed=...) is never done: pass done=False")
        cells = self.root()["cells"]
        if is_url(self.location):
            if cell_name in cells:
                del cells[cell_name]
        else:
            _clear_cell(Path(self.location), cell_name)
        group = cells.create_group(cell_name)
        group.attrs.update(_json_attr({"values": dict(values), "done": False, "steps": list(results)}))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step_id, ds in results.items():
                _encodable(ds).to_zarr(self.location, group=f"cells/{cell_name}/{step_id}", mode="w",
                                       consolidated=False, zarr_format=3)
        arrays = {} if is_url(self.location) else {
            step_id: step_manifest(Path(self.location) / "cells" / cell_name / step_id) for step_id in results}
        mark = {} if failed is None else {"partial": True, "failed_step": failed.get("step"),
                                          "error": failed.get("error", "")}
        group.attrs.update(_json_attr({"done": done, "arrays": arrays, **timing, **mark}))

    def forget_cells(self) -> None:
        """Mark every stored cell neither done nor partial, so each is computed (and written) again and none
        is read until then."""
        for _, group in self.root()["cells"].groups():
            if group.attrs.get("done") or group.attrs.get("partial"):
                group.attrs.update({"done": False, "partial": False})

    def mark_done(self, cell_name: str, **attrs: Any) -> None:
        """Record that a written cell is complete (with attributes such as its timing)."""
        group = self.root()["cells"][cell_name]
        if group.attrs.get("partial"):
            raise ValueError(f"cell {cell_name} holds only the steps completed before step "
                             f"'{group.attrs.get('failed_step')}' failed; it is never marked done")
        missing = set(group.attrs.get("steps", [])) - set(group.group_keys())
        if missing:
            raise ValueError(f"cell {cell_name} is not completely written (no {', '.join(sorted(missing))})")
        group.attrs.update(_json_attr({**attrs, "done": True}))

    def failed_cells(self) -> dict[str, dict[str, Any]]:
        """Cells recorded as failed (by name): their values, step, error line and attempts."""
        return dict(self.root().attrs.get("failed_cells", {}))

    def record_failure(self, cell_name: str, failure: Mapping[str, Any] | None) -> None:
        """Record a cell as failed with ``failure`` (None: clear its record, it has completed)."""
        failed = self.failed_cells()
        if failure is None and cell_name not in failed:
            return
        if failure is None:
            failed.pop(cell_name)
        else:
            failed[cell_name] = dict(failure)
        self.set_attrs(failed_cells=failed)

    def set_attrs(self, **attrs: Any) -> None:
        """Update run-level attributes (status, finish time)."""
        self.root().attrs.update(_json_attr(attrs))


#: the run-level attributes headlab reads, and the JSON type each must have: (check, what it must be)
_ATTR_TYPES: dict[str, tuple[Any, str]] = {
    "name": (lambda v: isinstance(v, str), "a string"),
    "status": (lambda v: isinstance(v, str), "a string"),
    "created": (lambda v: isinstance(v, str), "a string"),
    "finished": (lambda v: isinstance(v, str), "a string"),
    "model": (lambda v: isinstance(v, str), "a string"),
    "executor": (lambda v: isinstance(v, str), "a string"),
    "spec_text": (lambda v: isinstance(v, str), "a string"),
    "spec_data": (lambda v: isinstance(v, str), "a string"),
    "resolved": (lambda v: isinstance(v, str), "a string"),
    "cells_total": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a non-negative integer"),
    "seed": (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)), "an integer"),
    "steps": (lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v), "a list of step ids"),
    "sweep": (lambda v: isinstance(v, Mapping) and all(isinstance(x, list) for x in v.values()),
              "a mapping of sweep keys to lists of values"),
    "failed_cells": (lambda v: isinstance(v, Mapping) and all(isinstance(x, Mapping) for x in v.values()),
                     "a mapping of cells to their failures"),
    "input_digests": (lambda v: isinstance(v, Mapping), "a mapping"),
}


def attr_problems(attrs: Mapping[str, Any]) -> list[str]:
    """What is wrong with the types of a run's attributes (valid JSON of the wrong type, such as
    ``cells_total: "x"``): one line per attribute, empty when they are as headlab writes them."""
    problems = []
    for key, (ok, what) in _ATTR_TYPES.items():
        if key in attrs and not ok(attrs[key]):
            value = repr(attrs[key])
            value = value if len(value) <= 40 else value[:37] + "..."
            problems.append(f"attribute {key} is {value} ({type(attrs[key]).__name__}), not {what}")
    return problems


class Run:
    """A run store opened for reading: attributes, per-cell datasets, combined step results."""

    def __init__(self, path: str | Path) -> None:
        self.location = store_location(path)
        self.path = Path(self.location)
        self._results: dict[str, xr.Dataset] | None = None
        self._problems: list[str] | None = None
        if not is_url(self.location):
            if self.path.name.endswith(CREATING):
                raise RunDamaged(f"'{path}' is a run store that was never finished being created (the "
                                 "process stopped while creating it); delete it and run the spec again")
            if not self.path.is_dir():
                raise RunNotFound(f"no headlab run at '{path}'")
            meta = self.path / "zarr.json"
            if meta.is_file() and _read_meta(meta) is None:
                raise RunDamaged(f"'{path}' is a damaged run store: its zarr.json is unreadable")
        try:
            self._root = _open_group(self.location, "r")
        except (FileNotFoundError, ValueError, KeyError):  # zarr's GroupNotFoundError is both of the first two
            raise RunNotFound(f"no headlab run at '{path}'") from None
        fmt = self._root.attrs.get("format")
        if fmt != FORMAT:
            family, _, number = str(fmt).partition("/")
            if family == FORMAT.split("/")[0] and number.isdigit() and int(number) > int(FORMAT.split("/")[1]):
                raise RunFormatTooNew(f"'{path}' is a headlab run of format {fmt}, newer than this headlab "
                                      f"({__version__}) reads ({FORMAT}): upgrade headlab to read it")
            raise RunNotFound(f"'{path}' is a zarr store but not a headlab run")
        if not is_url(self.location) and _read_meta(self.path / "cells" / "zarr.json") is None:
            raise RunDamaged(f"'{path}' is a damaged run store: its `cells` group is missing")
        bad = attr_problems(self._root.attrs)
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise RunDamaged(f"'{path}' is a damaged run store: {self.path / 'zarr.json'}: {bad[0]}{more}; "
                             "restore that file, or delete the run and run its spec again")

    @classmethod
    def _unreadable(cls, path: Path, reason: str, status: str | None = None) -> Run:
        """A placeholder for a store that cannot be opened, so a listing can show it as damaged (or with
        ``status``: a run of a newer format)."""
        run = cls.__new__(cls)
        run.path, run._root, run._results, run._problems = Path(path), None, None, [reason]
        run._status = status
        return run

    def __repr__(self) -> str:
        return f"<headlab.Run {self.name!r} {self.status} {self.cells_done}/{self.cells_total} cells at {self.path}>"

    @property
    def attrs(self) -> dict[str, Any]:
        """Run-level attributes: spec text, resolved config, provenance, status."""
        return dict(self._root.attrs) if self._root is not None else {}

    @property
    def problems(self) -> list[str]:
        """What is missing or changed in the store (empty when it is intact): a finished or partial cell whose
        recorded arrays or chunks are gone, or a cell missing from a run marked complete. (An intact partial
        cell is no problem: it is listed in :attr:`partial_cells`.)"""
        if self._problems is None:

            problems: list[str] = []
            done = set()
            for name, attrs in self._stored():
                if attrs is None:
                    problems.append(f"cells/{name} is unreadable")
                elif attrs.get("done") or _is_partial(attrs):
                    if attrs.get("done"):
                        done.add(name)
                    problems += [] if is_url(self.location) else cell_problems(self.path, name, attrs)
            if self.attrs.get("status") == "complete":
                missing = [c for c in (Cell(i, ()).name for i in range(self.cells_total)) if c not in done]
                problems += [f"cell {c} is missing although the run is complete" for c in missing]
            self._problems = problems
        return self._problems

    @property
    def damaged(self) -> bool:
        """Whether the store is missing or has changed data (see :attr:`problems`)."""
        return bool(self.problems)

    def check(self) -> Run:
        """Raise :class:`RunDamaged` naming what is missing or changed; return the run when intact."""
        if getattr(self, "_status", None):
            return str(self._status)
        if self.problems:
            more = f" (and {len(self.problems) - 3} more)" if len(self.problems) > 3 else ""
            raise RunDamaged(f"'{self.path}' is damaged: {'; '.join(self.problems[:3])}{more}; run it again, "
                             "or finish it with `headlab run --resume` (damaged cells are recomputed)")
        return self

    @property
    def name(self) -> str:
        return str(self.attrs.get("name", self.path.name))

    @property
    def status(self) -> str:
        """``running``, ``interrupted``, ``failed``, ``complete``, or ``damaged: <what>`` when :attr:`problems`
        finds any (partial cells leave a run ``failed`` or ``interrupted``)."""
        if getattr(self, "_status", None):
            return str(self._status)
        if self.problems:
            more = f" (+{len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
            return f"damaged: {self.problems[0]}{more}"
        return str(self.attrs.get("status", "unknown"))

    @property
    def spec_data(self) -> dict[str, Any]:
        """The spec this run was made from, as data (what ``--resume`` runs again)."""
        try:
            data = json.loads(self.attrs["spec_data"])
        except (KeyError, TypeError, ValueError):
            raise RunDamaged(f"'{self.path}' is a damaged run store: its spec is missing") from None
        if not isinstance(data, dict):
            raise RunDamaged(f"'{self.path}' is a damaged run store: its spec is not a mapping")
        return data

    @property
    def spec_text(self) -> str:
        return str(self.attrs.get("spec_text", ""))

    @property
    def sweep(self) -> dict[str, list[Any]]:
        return dict(self.attrs.get("sweep", {}))

    @property
    def steps(self) -> list[str]:
        return list(self.attrs.get("steps", []))

    @property
    def cells_total(self) -> int:
        return int(self.attrs.get("cells_total", 0))

    def _stored(self) -> list[tuple[str, dict[str, Any] | None]]:
        """(name, attributes) of every cell group (read from disk for a local store, through zarr for a URL)."""
        if self._root is None:
            return []
        if is_url(self.location):
            return sorted((name, dict(grp.attrs)) for name, grp in self._root["cells"].groups())
        return stored_cells(self.path)

    def _cells(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(name, attributes) of the finished cells."""
        for name, attrs in self._stored():
            if attrs and attrs.get("done"):
                yield name, attrs

    def _readable(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(name, attributes) of the cells whose steps are read: the finished cells and the partial ones."""
        for name, attrs in self._stored():
            if attrs and (attrs.get("done") or _is_partial(attrs)):
                yield name, attrs

    @property
    def cells_done(self) -> int:
        return sum(1 for _ in self._cells())

    @property
    def failed_cells(self) -> dict[str, dict[str, Any]]:
        """Cells recorded as failed and not completed since: ``{cell: {values, step, error, attempts}}``."""
        return dict(self.attrs.get("failed_cells", {}))

    @property
    def partial_cells(self) -> dict[str, dict[str, Any]]:
        """Cells that a step stopped (it raised, or the run was interrupted in it) whose earlier steps are
        stored and read with :attr:`results`: ``{cell: {"values": {sweep key: value}, "steps": [the kept step
        ids], "failed_step": id, "error": line}}``. They do not count as done; resume computes each again as a
        whole."""
        return {name: {"values": dict(attrs.get("values", {})), "steps": list(attrs.get("steps", [])),
                       "failed_step": attrs.get("failed_step"), "error": str(attrs.get("error", ""))}
                for name, attrs in self._stored() if attrs and _is_partial(attrs)}

    def cell(self, name: str, step: str) -> xr.Dataset:
        """The dataset one cell produced for one step (verified against what the cell recorded; a partial
        cell's kept steps too)."""
        self.check()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return xr.open_zarr(self.location, group=f"cells/{name}/{step}", consolidated=False).load()

    @property
    def results(self) -> dict[str, xr.Dataset]:
        """Step id -> Dataset over the finished cells, one dimension per sweep key.

        The steps a partial cell kept (:attr:`partial_cells`: a later step of the cell failed) are included; a
        step's Dataset that holds any has the attribute ``partial_cells``, the names of those cells."""
        if self._results is None:
            self.check()
            self._results = {step: self._combine(step) for step in self.steps}
            self._results = {k: v for k, v in self._results.items() if v is not None}
        return self._results

    def _combine(self, step: str) -> xr.Dataset | None:
        keys = list(self.sweep)
        parts, labels, partial = [], [], []
        for name, attrs in self._readable():
            if step in attrs.get("steps", []):
                parts.append(self.cell(name, step))
                labels.append(attrs.get("values", {}))
                if _is_partial(attrs):
                    partial.append(name)
        if not parts:
            return None
        ds = self._concat(parts, labels, keys)
        if partial:
            ds.attrs["partial_cells"] = partial
        return ds

    @staticmethod
    def _concat(parts: list[xr.Dataset], labels: list[dict[str, Any]], keys: list[str]) -> xr.Dataset:
        """One step's datasets of several cells as one, with a dimension per sweep key."""
        if not keys:
            return parts[0]
        # dims without coordinates (`step`: cells swept over max_new_tokens generate different numbers of
        # tokens) are aligned by position; cells of different sizes (a sweep over `task.n`) are padded: integer
        # arrays with -1 (as within a cell), booleans with False, strings with "", others with NaN
        parts = [p.assign_coords({d: np.arange(n) for d, n in p.sizes.items() if d not in p.coords}) for p in parts]
        fill = {name: pad for p in parts for name, v in p.variables.items()
                if name not in p.dims and (pad := _padding(v.dtype)) is not None}
        ds = xr.concat(parts, dim="cell", join="outer", combine_attrs="override", coords="different",
                       compat="equals", data_vars="all", **({"fill_value": fill} if fill else {}))
        ds = ds.assign_coords({k: ("cell", [coord_value(v.get(k)) for v in labels]) for k in keys})
        if len(keys) == 1:
            return ds.swap_dims({"cell": keys[0]})
        return ds.set_index(cell=keys).unstack("cell")

    def summary(self) -> dict[str, Any]:
        """The headline numbers of each step (:func:`headlab.display.run_summary`, which says their layout)."""
        return run_summary(self)

    def _repr_html_(self) -> str:
        return run_html(self)


def _is_partial(attrs: Mapping[str, Any]) -> bool:
    """Whether cell attributes are those of a partial cell (:meth:`RunWriter.write_cell` with ``failed``)."""
    return bool(attrs.get("partial")) and not attrs.get("done")


def open_run(path: str | Path) -> Run:
    """Open a run store written by ``headlab run``."""
    return Run(path)


def list_runs(directory: str | Path) -> list[Run]:
    """Every run store directly under ``directory``, oldest first. A damaged store is listed too (its
    ``status`` says what is wrong); stores still being created (``.*.creating``) and other zarr stores
    are not."""
    d = Path(store_location(directory))
    if not d.is_dir():
        return []
    runs = []
    for sub in sorted(d.iterdir()):
        if sub.name.startswith(".") or not (sub / "zarr.json").is_file():
            continue
        try:
            run = Run(sub)
            run.problems  # noqa: B018 - verify now, so a listing shows damage
        except RunFormatTooNew as e:
            run = Run._unreadable(sub, str(e), status=f"newer format ({str(e).split('format ', 1)[1].split(',')[0]}): "
                                                        "upgrade headlab")
        except RunDamaged as e:
            run = Run._unreadable(sub, str(e).split(": ", 1)[-1].split("; restore that file")[0])
        except RunNotFound:
            continue
        except Exception as e:  # an unreadable store must not hide the runs beside it
            run = Run._unreadable(sub, f"unreadable ({type(e).__name__}: {e})")
        runs.append(run)
    return sorted(runs, key=lambda r: str(r.attrs.get("created", "")))


def now() -> str:
    """The current time as an ISO-8601 string (UTC)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
