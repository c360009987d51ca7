"""Exports of a labelled head cube (the atlas's result; docs/atlas.md, "Exports"), for tools outside headlab.

- ``heads-<detector>.json``, one per detector: the retrieval-head paper's published format (the Retrieval_Head
  repository's ``head_score/<model>.json``): one line of JSON, ``{"<layer>-<head>": [score, ...]}`` for every
  head, which its readers load with ``json.loads(file.readline())``, average per head and rank. The atlas keeps
  one score per head (the detector's mean over its task), so each list holds that one score; a head whose score
  is undefined (NaN) is left out. headlab reads these files back as head selections (``{file: heads-x.json,
  top: k}``).
- ``head-cards.json``: a card per head, ``[{"layer", "head", "roles": [...], "detectors": {detector: {"score",
  "label", "rank", "threshold", "margin"}}}, ...]`` (``margin = score - threshold``; null for an undefined score).
- ``head-cards.csv``: the same cards, a row per head: ``layer, head, roles`` (``;``-separated), then per detector
  ``<detector>:score``, ``<detector>:label`` (``true``/``false``), ``<detector>:rank``, ``<detector>:threshold``,
  ``<detector>:margin`` (empty for an undefined value).

:func:`write_exports` writes all of them; ``headlab atlas-export RUN --out DIR`` does it for every cube of a run.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer
import xarray as xr

from headlab import open_run, to_retrieval_json
from headlab.plugin import hookimpl
from headlab.roles import CARD_FIELDS, detectors, head_cards, is_cube

__all__ = ["CSV_NAME", "JSON_NAME", "card_columns", "retrieval_json", "write_cards_csv", "write_cards_json",
           "write_exports", "write_retrieval_json"]

JSON_NAME = "head-cards.json"
CSV_NAME = "head-cards.csv"


def retrieval_json(cube: xr.Dataset, detector: str) -> dict[str, list[float]]:
    """One detector's scores in the retrieval-head format ``{"<layer>-<head>": [score]}``, every head with a
    defined score (see the module docstring)."""
    scores = to_retrieval_json(cube["score"].sel(detector=detector).transpose("layer", "head"))
    return {key: values for key, values in scores.items() if all(math.isfinite(v) for v in values)}


def write_retrieval_json(cube: xr.Dataset, detector: str, path: str | Path) -> Path:
    """Write :func:`retrieval_json` as one line of JSON to ``path``; returns the path."""
    path = Path(path)
    path.write_text(json.dumps(retrieval_json(cube, detector)) + "\n", encoding="utf-8")
    return path


def card_columns(names: list[str]) -> list[str]:
    """The header of ``head-cards.csv`` for detectors ``names``."""
    return ["layer", "head", "roles", *[f"{name}:{f}" for name in names for f in CARD_FIELDS]]


def _csv_value(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    return str(v)


def write_cards_csv(cube: xr.Dataset, path: str | Path) -> Path:
    """Write every head's card as a row of a CSV file (module docstring); returns the path."""
    path = Path(path)
    names = detectors(cube)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(card_columns(names))
        for card in head_cards(cube):
            row = [card["layer"], card["head"], ";".join(card["roles"])]
            row += [_csv_value(card["detectors"][name][field]) for name in names for field in CARD_FIELDS]
            writer.writerow(row)
    return path


def write_cards_json(cube: xr.Dataset, path: str | Path) -> Path:
    """Write every head's card as a JSON list (module docstring); returns the path."""
    path = Path(path)
    path.write_text(json.dumps(head_cards(cube), indent=1) + "\n", encoding="utf-8")
    return path


def write_exports(cube: xr.Dataset, folder: str | Path) -> list[Path]:
    """Write ``heads-<detector>.json`` per detector, ``head-cards.json`` and ``head-cards.csv`` into ``folder``
    (made if missing); returns the paths written."""
    if not is_cube(cube):
        raise ValueError("not a labelled head cube: it needs score and label over (detector, layer, head)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = [write_retrieval_json(cube, name, folder / f"heads-{name}.json") for name in detectors(cube)]
    written.append(write_cards_json(cube, folder / JSON_NAME))
    written.append(write_cards_csv(cube, folder / CSV_NAME))
    return written


@hookimpl
def headlab_register_commands(app: Any, run_spec: Any) -> None:
    """``headlab atlas-export RUN --out DIR [--step ID]``."""

    @app.command("atlas-export")
    def atlas_export(
        run: Annotated[str, typer.Argument(metavar="RUN", help="a run directory holding an atlas step")],
        out: Annotated[str, typer.Option("--out", help="folder to write into (a sub-folder per step when the "
                                                       "run has several cubes)")],
        step: Annotated[str | None, typer.Option("--step", help="the step to export (default: every cube)")]
        = None,
    ) -> None:
        """Write a run's head cube as retrieval-head JSON per detector and head cards (CSV, JSON)."""
        if not Path(run).is_dir():
            raise ValueError(f"RUN: {run!r} is not a run directory; give the folder `headlab atlas` printed")
        results = open_run(run).results
        cubes = [s for s, ds in results.items() if is_cube(ds) and (step is None or s == step)]
        if not cubes:
            what = f"no step {step!r} with" if step is not None else "no step with"
            raise ValueError(f"RUN {run}: {what} a head cube (score and label over detector, layer, head); "
                             f"its steps: {', '.join(results) or 'none'}")
        for s in cubes:
            folder = Path(out) / s if len(cubes) > 1 else Path(out)
            for path in write_exports(results[s], folder):
                typer.echo(str(path))
