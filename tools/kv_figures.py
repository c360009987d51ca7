"""Figures and numbers of head-level KV-cache policies on the embedded model (docs/kv.md, "Needle recall vs
kept KV").

    python tools/kv_figures.py [--run RUN] [--lengths 1024 2048 ...] [--depths 5] [--out docs/images]

Runs ``specs/kv_compression.yaml`` (or reads a stored run of it, ``--run``; ``--lengths`` / ``--depths``
replace the spec's needle grid, for a smaller run), writes ``kv_recall_vs_kept.svg`` (needle recall against
the kept fraction of the full KV bytes, one point per step: the report's figure) and
``kv_recall_by_length.svg`` (recall per context length of chosen steps) and ``kv_needle_<step>.svg`` (recall
per context length and needle depth of a few steps) into ``--out``, with the code of
``headlab report`` (:mod:`headlab.kv.view`, :mod:`headlab.figures`), and prints the table docs/kv.md quotes: per step its policy, kept fraction, KV bytes and recall, overall and per length.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

import headlab
from headlab import figures
from headlab.kv.view import kv_points, kv_tradeoff_chart, needle_by_length_chart, needle_heatmap_chart

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "kv_compression.yaml"
#: the steps drawn per context length
BY_LENGTH = ("full", "streaming_top4_w128", "razor_top4_w128", "headkv_f030", "streaming_top2_w128", "random_top4_w128")
#: the steps drawn as needle heatmaps (context length x depth)
HEATMAPS = ("full", "streaming_top4_w128", "random_top4_w128")


def run_spec(lengths: list[int] | None, depths: int | None, out: Path) -> headlab.Run:
    """``specs/kv_compression.yaml``, its needle grid replaced by ``lengths`` / ``depths`` where given."""
    overrides: dict[str, object] = {}
    if lengths:
        overrides["task.context_lengths"] = lengths
    if depths:
        overrides["task.depths"] = depths
    return headlab.run(SPEC, out=out, overrides=overrides)


def recall_by_length(ds, lengths: list[int]) -> list[float]:
    """Mean needle recall per context length."""
    rec, ctx = ds["needle_recall"].values.astype(float), ds["context_length"].values
    return [float(rec[ctx == n].mean()) for n in lengths]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, default=None, help="a stored run of specs/kv_compression.yaml")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="context lengths (default: the spec's)")
    parser.add_argument("--depths", type=int, default=None, help="needle depths (default: the spec's)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    args = parser.parse_args()
    if args.run is not None:
        run = headlab.open_run(args.run)
    else:
        run = run_spec(args.lengths, args.depths, Path(tempfile.mkdtemp(prefix="kv-figures-")))
    points = kv_points(run)
    args.out.mkdir(parents=True, exist_ok=True)
    figures.save(kv_tradeoff_chart(points, "needle_recall", title="needle recall vs kept KV (headlab-tiny)"),
                 args.out / "kv_recall_vs_kept.svg")
    first = run.results[points[0].step]
    lengths = sorted({int(n) for n in first["context_length"].values})
    figures.save(needle_by_length_chart(run, [s for s in BY_LENGTH if s in run.results], "needle_recall"),
                 args.out / "kv_recall_by_length.svg")
    for step in HEATMAPS:
        if step in run.results:
            figures.save(needle_heatmap_chart(run, step, "needle_recall"), args.out / f"kv_needle_{step}.svg")
    n = first.sizes["example"]
    print(f"run {run.path} ({n} prompts per step, lengths {lengths})")
    print("| step | policy | kept fraction | KV bytes | recall | " + " | ".join(str(x) for x in lengths) + " |")
    print("|---|---|---|---|---|" + "---|" * len(lengths))
    for p in points:
        per = recall_by_length(run.results[p.step], lengths)
        print(f"| `{p.step}` | {p.policy} | {p.kept_fraction:.3f} | {p.kv_bytes} | {p.metrics['needle_recall']:.2f} | "
              + " | ".join(f"{v:.2f}" for v in per) + " |")
    full = run.results["retrieval"]["score"]
    heads = np.argwhere(full.values >= 0.1).tolist()
    print(f"retrieval heads (score >= 0.1): {len(heads)} of {full.size}: {heads}")
    for step in ("streaming_top4_w128", "random_top4_w128"):
        if step in run.results:
            print(step, "full KV heads", np.argwhere(run.results[step]["kv_full"].values).tolist())


if __name__ == "__main__":
    main()
