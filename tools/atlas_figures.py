"""The picture of the embedded model's atlas page (docs/atlas.md) and its numbers.

    python tools/atlas_figures.py [--run RUN] [--model headlab-tiny] [--out docs/images]

Runs ``headlab atlas MODEL`` with its defaults (the same spec the command runs; or reads a stored run, ``--run``),
then writes ``atlas_<model>.png``: the report's figures of the cube (:mod:`headlab.role_figures`: the roles of
every head, a stripe per role, above the per-detector score panels, and the causal check when the run has one),
one above the other, with the code of ``headlab report``. Prints each detector's threshold, where it comes from,
how many heads it labels and its top heads (the table docs/atlas.md quotes).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import headlab
from headlab import figures, role_figures
from headlab.plugins.atlas.atlas import atlas_spec
from headlab.roles import causal_rows, is_cube, top_heads

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", help="a stored run of `headlab atlas` (default: run it now)")
    parser.add_argument("--model", default="headlab-tiny")
    parser.add_argument("--out", default=str(ROOT / "docs" / "images"))
    args = parser.parse_args()
    if args.run:
        run = headlab.open_run(args.run)
    else:
        run = headlab.run(atlas_spec(args.model), out=tempfile.mkdtemp(prefix="atlas-"))
    step, cube = next((s, ds) for s, ds in run.results.items() if is_cube(ds))
    charts = [role_figures.role_grid_chart(cube), role_figures.role_panels_chart(cube)]
    if causal_rows(cube):
        charts.append(role_figures.causal_chart(cube))
    name = str(run.attrs.get("model", args.model)).replace("/", "_")
    path = figures.save(figures.combine(charts, direction="vertical"), Path(args.out) / f"atlas_{name}.png",
                        scale=1.5)
    print(f"wrote {path} (run {run.path}, step {step})")
    for r in top_heads(cube, 3):
        if r["rank"] == 1:
            labelled = int(cube["label"].sel(detector=r["detector"]).sum())
            print(f"{r['detector']:<18} threshold {r['threshold']:.3g} ({r['threshold_source']}); "
                  f"labelled {labelled}/{cube.sizes['layer'] * cube.sizes['head']}")
        print(f"    #{r['rank']} L{r['layer']}H{r['head']} score {r['score']:.3f} margin {r['margin']:+.3f}")


if __name__ == "__main__":
    main()
