"""Export figures of ``headlab report`` for the docs, by the report's own code (:func:`headlab.report.report_figures`).

    python tools/report_figures.py RUN                                  # list the report's figures by name
    python tools/report_figures.py RUN "comparison: context_memory" docs/images/decoding_comparison.svg

``RUN`` is a stored run (``headlab run specs/decoding_counterfact.yaml`` writes one); the figure is written as
SVG or PNG by its file's suffix (:func:`headlab.figures.save`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from headlab.figures import save
from headlab.report import report_figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a stored run")
    parser.add_argument("figure", nargs="?", help="the figure's name, as listed without it")
    parser.add_argument("out", nargs="?", type=Path, help="the file to write (.svg or .png)")
    args = parser.parse_args(argv)
    figures = report_figures(args.run)
    if args.figure is None:
        print("\n".join(f.name for f in figures))
        return 0
    chosen = [f for f in figures if f.name == args.figure]
    if not chosen or args.out is None:
        print(f"report_figures: no figure {args.figure!r} in {args.run} (or no output path); figures: "
              + ", ".join(repr(f.name) for f in figures), file=sys.stderr)
        return 2
    print(save(chosen[0].chart, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
