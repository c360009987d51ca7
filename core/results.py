"""Results: xarray conventions, the zarr run store, and the run catalog.

A run is one zarr group (a directory, or any fsspec URL zarr accepts) whose attributes hold the spec
text, the resolved config and provenance. Each sweep cell is written as it finishes to
``cells/<cell>/<step id>``; a cell group with ``done: true`` is complete, so an interrupted run resumes
where it stopped. Cells are disjoint groups, so workers of a distributed executor write them side by
side while the driver alone writes the run's attributes and the ``done`` marks. ``Run.results``
combines the cells of a step into one Dataset with one dimension per sweep key.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from urllib.request import url2pathname

import numpy as np
import xarray as xr
import zarr

FORMAT = "headlab-run/1"


class RunNotFound(Exception):
    """No headlab run store at a path."""


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
    """Where zarr opens a run store: a local path (a ``file://`` URL becomes its path) or an fsspec URL
    (``s3://bucket/runs/x``, ``gs://...``, ``memory://...``) passed to zarr as is."""
    text = str(path)
    if text.startswith("file://"):
        return url2pathname(urlsplit(text).path)
    return text


def is_url(location: str | Path) -> bool:
    """Whether a store location is a URL (not a local path)."""
    return "://" in str(location)


def coord_value(value: Any) -> Any:
    """A sweep value as a coordinate label (lists and mappings become their JSON text)."""
    if isinstance(value, (list, dict, tuple)):
        return json.dumps(value, sort_keys=True)
    return value


@dataclass
class RunWriter:
    """Writes the cells of one run into its store (a local path, a ``file://`` URL or an fsspec URL)."""

    path: Path | str

    def __post_init__(self) -> None:
        self.location = store_location(self.path)
        if not is_url(self.location):
            self.path = Path(self.location)

    @classmethod
    def create(cls, path: Path | str, attrs: Mapping[str, Any]) -> RunWriter:
        """Create a new run store at ``path`` with run-level attributes."""
        location = store_location(path)
        if not is_url(location):
            Path(location).mkdir(parents=True, exist_ok=False)
        root = zarr.open_group(location, mode="w" if not is_url(location) else "w-")
        root.attrs.update(_json_attr({"format": FORMAT, **attrs}))
        root.create_group("cells")
        return cls(location)

    def root(self) -> zarr.Group:
        return zarr.open_group(self.location, mode="r+")

    def done_cells(self) -> set[str]:
        """Names of cells already complete."""
        cells = self.root()["cells"]
        return {name for name, grp in cells.groups() if grp.attrs.get("done")}

    def write_cell(self, cell_name: str, values: Mapping[str, Any], results: Mapping[str, xr.Dataset],
                   timing: Mapping[str, Any], *, done: bool = True) -> None:
        """Write every step dataset of a finished cell, then mark the cell done.

        ``done=False`` leaves the mark to :meth:`mark_done` (a distributed executor's worker writes the
        cell, its driver records completion); until then the cell is not read as finished."""
        root = self.root()
        cells = root["cells"]
        if cell_name in cells:
            del cells[cell_name]
        group = cells.create_group(cell_name)
        group.attrs.update(_json_attr({"values": dict(values), "done": False, "steps": list(results)}))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step_id, ds in results.items():
                _encodable(ds).to_zarr(self.location, group=f"cells/{cell_name}/{step_id}", mode="w",
                                       consolidated=False, zarr_format=3)
        group.attrs.update(_json_attr({"done": done, **timing}))

    def mark_done(self, cell_name: str, **attrs: Any) -> None:
        """Record that a written cell is complete (with attributes such as its timing)."""
        group = self.root()["cells"][cell_name]
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


class Run:
    """A run store opened for reading: attributes, per-cell datasets, combined step results."""

    def __init__(self, path: str | Path) -> None:
        self.location = store_location(path)
        self.path = Path(self.location)
        try:
            self._root = zarr.open_group(self.location, mode="r")
        except (FileNotFoundError, zarr.errors.GroupNotFoundError, ValueError):
            raise RunNotFound(f"no headlab run at '{path}'") from None
        if self._root.attrs.get("format") != FORMAT:
            raise RunNotFound(f"'{path}' is a zarr store but not a headlab run")
        self._results: dict[str, xr.Dataset] | None = None

    def __repr__(self) -> str:
        return f"<headlab.Run {self.name!r} {self.status} {self.cells_done}/{self.cells_total} cells at {self.path}>"

    @property
    def attrs(self) -> dict[str, Any]:
        """Run-level attributes: spec text, resolved config, provenance, status."""
        return dict(self._root.attrs)

    @property
    def name(self) -> str:
        return str(self.attrs.get("name", self.path.name))

    @property
    def status(self) -> str:
        return str(self.attrs.get("status", "unknown"))

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

    def _cells(self) -> Iterator[tuple[str, zarr.Group]]:
        for name, grp in sorted(self._root["cells"].groups()):
            if grp.attrs.get("done"):
                yield name, grp

    @property
    def cells_done(self) -> int:
        return sum(1 for _ in self._cells())

    @property
    def failed_cells(self) -> dict[str, dict[str, Any]]:
        """Cells recorded as failed and not completed since: ``{cell: {values, step, error, attempts}}``."""
        return dict(self.attrs.get("failed_cells", {}))

    def cell(self, name: str, step: str) -> xr.Dataset:
        """The dataset one cell produced for one step."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return xr.open_zarr(self.location, group=f"cells/{name}/{step}", consolidated=False).load()

    @property
    def results(self) -> dict[str, xr.Dataset]:
        """Step id -> Dataset over the finished cells, one dimension per sweep key."""
        if self._results is None:
            self._results = {step: self._combine(step) for step in self.steps}
            self._results = {k: v for k, v in self._results.items() if v is not None}
        return self._results

    def _combine(self, step: str) -> xr.Dataset | None:
        keys = list(self.sweep)
        parts, labels = [], []
        for name, grp in self._cells():
            if step in grp.attrs.get("steps", []):
                parts.append(self.cell(name, step))
                labels.append(grp.attrs.get("values", {}))
        if not parts:
            return None
        if not keys:
            return parts[0]
        ds = xr.concat(parts, dim="cell", join="outer", combine_attrs="override", coords="different",
                       compat="equals", data_vars="all")
        ds = ds.assign_coords({k: ("cell", [coord_value(v.get(k)) for v in labels]) for k in keys})
        if len(keys) == 1:
            return ds.swap_dims({"cell": keys[0]})
        return ds.set_index(cell=keys).unstack("cell")

    def summary(self) -> dict[str, Any]:
        """Top heads per detect step and metric means per generate step (over all cells)."""
        from .heads import ranked

        out: dict[str, Any] = {}
        for step, ds in self.results.items():
            if "score" in ds and {"layer", "head"} <= set(ds["score"].dims):
                score = ds["score"]
                extra = [d for d in score.dims if d not in ("layer", "head")]
                score = score.mean(extra) if extra else score
                out[step] = {"kind": "detect", "method": ds.attrs.get("method", ""),
                             "top": [{"layer": h[0], "head": h[1], "score": s} for h, s in ranked(score)[:10]]}
            else:
                metrics = ds.attrs.get("metrics", [])
                out[step] = {"kind": "generate",
                             "metrics": {m: float(np.nanmean(ds[m].values)) for m in metrics if m in ds}}
        return out

    def _repr_html_(self) -> str:
        from html import escape

        rows = []
        for step, info in self.summary().items():
            if info["kind"] == "detect":
                top = ", ".join(f"L{t['layer']}H{t['head']} {t['score']:.3f}" for t in info["top"][:5])
                rows.append(f"<tr><td>{escape(step)}</td><td>detect {escape(info['method'])}</td><td>{top}</td></tr>")
            else:
                ms = ", ".join(f"{k} {v:.3f}" for k, v in info["metrics"].items())
                rows.append(f"<tr><td>{escape(step)}</td><td>generate</td><td>{escape(ms)}</td></tr>")
        return (f"<div><b>headlab run</b> {escape(self.name)} &middot; {escape(self.status)} &middot; "
                f"{self.cells_done}/{self.cells_total} cells &middot; model {escape(str(self.attrs.get('model')))}"
                f"<table><tr><th>step</th><th>action</th><th>summary</th></tr>{''.join(rows)}</table></div>")


def open_run(path: str | Path) -> Run:
    """Open a run store written by ``headlab run``."""
    return Run(path)


def list_runs(directory: str | Path) -> list[Run]:
    """Every run store directly under ``directory``, oldest first."""
    d = Path(store_location(directory))
    if not d.is_dir():
        return []
    runs = []
    for sub in sorted(d.iterdir()):
        if (sub / "zarr.json").is_file():
            try:
                runs.append(Run(sub))
            except RunNotFound:
                continue
    return sorted(runs, key=lambda r: r.attrs.get("created", ""))


def now() -> str:
    """The current time as an ISO-8601 string (UTC)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
