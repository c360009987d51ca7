"""The ``headlab`` command: a thin layer over the Python API.

    headlab run SPEC [--set path=value ...] [--out DIR] [--executor KIND [--address ADDR]]
    headlab run --resume RUN [--recompute] [--executor KIND [--address ADDR]]
    headlab validate SPEC [SPEC ...]
    headlab schema [-o FILE]
    headlab plugins [--json]
    headlab runs [DIR]
    headlab show RUN [STEP ...] [--steps]
    headlab report RUN [-o FILE]
    headlab new-plugin {detector|steering|decoder|task|metric} NAME [DIR]
    headlab eval [lm-eval options]   (the eval extra: lm-evaluation-harness with headlab's model)

Any error prints one line (``error: ...``) naming the spec location, or the step, plugin and file, and the
command exits with 0 (done), 1 (the run failed), 2 (invalid input) or 130 (interrupted; ``--resume``
finishes the run). ``--debug`` (anywhere on the command line, or ``HEADLAB_DEBUG=1``) prints the traceback.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import textwrap
import time
import traceback
import warnings
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from . import runner, scaffold
from .config import suggest
from .context import Reporter
from .errors import INTERRUPTED, INVALID, exit_code, one_line
from .overview import head_label, summary_rows
from .plugin_manager import CATEGORIES, get_manager
from .resources import ENV
from .results import RunNotFound, list_runs, open_run, store_location
from .runner import check_steps
from .spec import SpecError, json_schema, load_spec, parse_size, parse_yaml

__all__ = ["app", "main", "register_plugin_commands", "run_spec"]

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="headlab: find, steer and decode with the attention heads of language models.")
# piped output (`headlab runs | cat`) is not cut to 80 columns: identifiers are printed whole
console = Console(width=None if sys.stdout.isatty() else 240)
err = Console(stderr=True)
_reported: list[str] = []  # "interrupted" once a command has said so itself


@app.callback()
def _options(debug: Annotated[bool, typer.Option(
        "--debug", help="print the traceback of an error (also accepted after the command)")] = False) -> None:
    """headlab: find, steer and decode with the attention heads of language models."""


def _table(*headers: str, title: str | None = None) -> Table:
    """A table whose cells fold instead of being cut with an ellipsis (run names, plugin kinds)."""
    table = Table(title=title)
    for header in headers:
        table.add_column(header, overflow="fold")
    return table


class RichReporter(Reporter):
    """Progress bars for cells and for the steps inside them."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.tasks: dict[str, Any] = {}

    def start(self, key: str, total: int | None, description: str) -> None:
        if key in self.tasks and key != "cells":  # a unit taken over by its step's own progress
            self.progress.remove_task(self.tasks.pop(key))
        self.tasks[key] = self.progress.add_task(description, total=total)

    def advance(self, key: str, n: int = 1) -> None:
        if key in self.tasks:
            self.progress.advance(self.tasks[key], n)

    def stop(self, key: str) -> None:
        task = self.tasks.pop(key, None)
        if task is not None and key != "cells":
            self.progress.remove_task(task)


class LineReporter(Reporter):
    """Progress as plain lines on stderr where it is not a terminal (a log file, a pipe, a batch job): a line
    when a unit starts, then at most one every ``interval`` seconds while it advances (one per cell), and one
    when it ends, ``description: done/total [mm:ss]`` (``description [mm:ss]`` for a unit of no size that has not
    advanced: the step that starts). ``interval`` defaults to ``HEADLAB_PROGRESS_SECONDS`` (5)."""

    def __init__(self, stream: Any = None, interval: float | None = None) -> None:

        self.stream, self.clock = stream, time.monotonic
        if interval is None:
            try:
                interval = float(os.environ.get("HEADLAB_PROGRESS_SECONDS", "5"))
            except ValueError:
                interval = 5.0
        self.interval = interval
        self.units: dict[str, dict[str, Any]] = {}

    def _print(self, unit: dict[str, Any]) -> None:
        seconds = int(self.clock() - unit["started"])
        of = f"/{unit['total']}" if unit["total"] is not None else ""
        count = f": {unit['done']}{of}" if unit["total"] is not None or unit["done"] else ""  # "step x (1/3): ..."
        stream = self.stream or sys.stderr
        stream.write(f"{unit['description']}{count} [{seconds // 60:02d}:{seconds % 60:02d}]\n")
        stream.flush()
        unit["printed"], unit["printed_done"] = self.clock(), unit["done"]

    def start(self, key: str, total: int | None, description: str) -> None:
        self.units[key] = unit = {"description": description, "total": total, "done": 0, "started": self.clock()}
        self._print(unit)

    def advance(self, key: str, n: int = 1) -> None:
        unit = self.units.get(key)
        if unit is not None:
            unit["done"] += n
            if n and (key == "cells" or self.clock() - unit["printed"] >= self.interval):
                self._print(unit)

    def stop(self, key: str) -> None:
        unit = self.units.pop(key, None)
        if unit is not None and unit["done"] != unit["printed_done"]:
            self._print(unit)


def _parse_set(items: list[str]) -> dict[str, Any]:
    """``--set path=value`` overrides; each value is YAML read by the spec loader, with its limits (no tags,
    bounded size, depth and alias expansion)."""


    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise SpecError(f"--set {item!r}: write path=value, e.g. --set task.n=16", source="command line")
        key, raw = item.split("=", 1)
        if not raw.strip():
            out[key.strip()] = ""
            continue
        try:
            data, _ = parse_yaml("value:\n" + textwrap.indent(raw, "  "), source=f"--set {key.strip()}")
        except SpecError as e:
            raise SpecError(f"--set {key.strip()}={raw[:60]!r}{'...' if len(raw) > 60 else ''}: {e.message}",
                            source="command line") from None
        out[key.strip()] = data["value"]
    return out


def _spec_output(spec: Path, overrides: dict[str, Any]) -> str:
    """Where ``spec`` (with ``--set`` overrides) stores its runs."""

    loaded = load_spec(spec)
    return str(overrides.get("output", loaded.spec.output))


@app.command()
def run(
    spec: Annotated[Path | None, typer.Argument(help="spec YAML file")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="override: dotted.path=value")] = None,
    out: Annotated[str | None, typer.Option("--out", help="store directory or fsspec URL (default: the spec's "
                                                           "`output`)")] = None,
    resume: Annotated[str | None, typer.Option("--resume", help="finish an interrupted or failed run (its "
                                                                "missing and failed cells)")] = None,
    executor: Annotated[str | None, typer.Option("--executor", help="run the cells with this executor kind "
                                                                    "(local, ray, ...; default: the spec's `execution`)")] = None,
    address: Annotated[str | None, typer.Option("--address", help="the executor's cluster address (ray: auto, "
                                                                  "ray://host:port)")] = None,
    recompute: Annotated[bool, typer.Option("--recompute", help="with --resume: compute every cell again from "
                                                              "the current inputs (the spec as resolved now, data "
                                                              "files, weights) when they changed")] = False,
    memory_limit: Annotated[str | None, typer.Option(
        "--memory-limit", help="resource budget of a cell, e.g. 8GiB (none: no check); overrides "
        "HEADLAB_MEMORY_LIMIT and the spec's limits.memory; default: 80% of this machine's memory")] = None,
) -> None:
    """Run a spec: every step of every sweep cell, writing results to a zarr store."""

    if spec is None and resume is None:
        raise SpecError("give a spec file, or --resume RUN", source="command line")
    if recompute and resume is None:
        raise SpecError("--recompute recomputes a stored run: use it with --resume RUN", source="command line")
    if resume is not None:
        ignored = [name for name, given in (("SPEC", spec is not None), ("--set", bool(set_)), ("--out", out is not None))
                   if given]
        if ignored:
            raise SpecError(f"--resume finishes RUN with the spec and store it was started with, so it cannot honour "
                            f"{', '.join(ignored)}: drop {'it' if len(ignored) == 1 else 'them'} (or run the spec "
                            "without --resume for a new run)", source="command line")
    if resume is None:
        target = out if out is not None else _spec_output(spec, _parse_set(set_ or []))
        if str(target).startswith("memory://"):
            raise SpecError(f"{'--out' if out is not None else 'output'} {target!r}: an in-memory store ends with this "
                            "process, so the run would be lost when the command returns; give a directory or a "
                            "persistent URL (s3://..., gs://...)", source="command line")
    if memory_limit is not None:
        if memory_limit.strip().lower() not in ("none", "off"):
            try:
                parse_size(memory_limit)
            except ValueError as e:
                raise SpecError(f"--memory-limit: {e}", source="command line") from None
    previous = os.environ.get(ENV)
    if memory_limit is not None:
        os.environ[ENV] = memory_limit
    execution = {k: v for k, v in (("executor", executor), ("address", address)) if v is not None}
    try:
        run_spec(spec, out=out, overrides=_parse_set(set_ or []), resume=resume, execution=execution,
                 recompute=recompute)
    finally:
        if memory_limit is not None:  # the option holds for this command only (main() may run again in process)
            if previous is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = previous


def run_spec(spec: Any, *, out: str | None = None, overrides: dict[str, Any] | None = None, resume: str | None = None,
             execution: dict[str, Any] | None = None, recompute: bool = False) -> Any:
    """Run a spec (path, YAML text or mapping; or ``resume`` a stored run) as ``headlab run`` does: progress on
    stderr, Ctrl-C keeps the finished cells (exit 130), then the summary and the run's location; exit 1 when a
    cell failed. Returns the :class:`headlab.Run`. Plugin commands receive it (``headlab_register_commands``)."""


    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns, console=err, transient=False, disable=not err.is_terminal) as progress, \
                warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".* cells of run .* failed")
            reporter = RichReporter(progress) if err.is_terminal else LineReporter()
            result = runner.run(spec, out=out, overrides=overrides or {}, reporter=reporter,
                                execution=execution or {}, cancel=_signalled.__len__) if resume is None else \
                runner.run(None, resume=resume, reporter=reporter, execution=execution or {}, recompute=recompute,
                           cancel=_signalled.__len__)
    except KeyboardInterrupt as e:
        store = next((n.removeprefix("run store: ") for n in getattr(e, "__notes__", [])
                      if n.startswith("run store: ")), None)
        if store is None:
            err.print("interrupted before the run store was created: nothing was written")
        else:
            err.print(Text(f"interrupted: finished cells are stored in {store}; finish with "
                           f"`headlab run --resume {store}`"), soft_wrap=True)
        _reported.append("interrupted")
        raise typer.Exit(INTERRUPTED) from None
    _print_summary(result)
    console.print(f"[bold]run stored at[/bold] {result.location}")
    if result.failed_cells or result.cells_done < result.cells_total:
        _print_failures(result)
        err.print(f"[red]{result.cells_total - result.cells_done} of {result.cells_total} cells failed[/red]; "
                  f"finish them with `headlab run --resume {result.location}`", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    return result


def _print_failures(result: Any) -> None:
    table = Table("cell", "values", "step", "error", "attempts", title="failed cells")
    for name, info in sorted(result.failed_cells.items()):
        table.add_row(name, json.dumps(info.get("values", {}), default=str), str(info.get("step") or "-"),
                      str(info.get("error", "")), str(info.get("attempts", "")))
    err.print(table)


@app.command()
def validate(specs: Annotated[list[Path], typer.Argument(help="spec files")]) -> None:
    """Check specs without running them."""

    for path in specs:
        loaded = load_spec(path)
        check_steps(loaded)
        console.print(f"{path}: ok ({len(loaded.spec.steps)} steps, {len(loaded.cells)} cells)")


@app.command()
def schema(output: Annotated[Path | None, typer.Option("-o", "--output", help="write to a file")] = None) -> None:
    """Print the JSON Schema of specs (every installed plugin kind included)."""

    text = json.dumps(json_schema(), indent=2)
    if output is None:
        sys.stdout.write(text + "\n")
    else:
        output.write_text(text + "\n")
        console.print(f"schema written to {output}; add `# yaml-language-server: $schema={output}` to a spec")


@app.command()
def plugins(as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False) -> None:
    """List plugins, where they come from, and the components they register (by category)."""

    mgr = get_manager()
    rows = [{"name": info.name, "source": info.source, "version": info.version, "error": info.error,
             "components": [{"category": c.category, "kind": c.kind, "description": c.description}
                            for c in info.components]} for info in mgr.infos.values()]
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    table = _table("plugin", "source", "version", "components")
    for r in rows:
        comps = "; ".join(f"{CATEGORIES[cat].label}: " + ", ".join(c["kind"] for c in r["components"]
                                                                  if c["category"] == cat)
                          for cat in CATEGORIES if any(c["category"] == cat for c in r["components"]))
        table.add_row(r["name"], r["source"], r["version"], f"[red]failed: {r['error']}[/red]" if r["error"] else comps)
    console.print(table)
    kinds = _table("category", "hook", "kinds", title="components by category")
    for cat in CATEGORIES.values():
        registered = mgr.components[cat.name]
        kinds.add_row(f"{cat.name}\n[dim]{cat.description}[/dim]", cat.hook,
                      ", ".join(k + (" (default)" if c.default else "") for k, c in registered.items()) or "-")
    console.print(kinds)


@app.command()
def runs(directory: Annotated[Path, typer.Argument(help="store directory")] = Path("./headlab-runs")) -> None:
    """List the runs in a store directory."""

    directory = Path(store_location(directory))  # ~ expanded, a file:// URL as its path, as --out takes them
    if not directory.exists():
        raise RunNotFound(f"runs: no directory '{directory}'; name the directory a run's --out (or the spec's "
                          "output:) wrote to, default ./headlab-runs")
    if not directory.is_dir():
        raise RunNotFound(f"runs: '{directory}' is a file, not a directory of runs; name the directory a run's "
                          "--out (or the spec's output:) wrote to (`headlab show RUN` reads one run)")
    table = _table("run", "name", "status", "cells", "created", "model")
    for r in list_runs(directory):
        a = r.attrs
        table.add_row(str(r.path) if r.status.startswith("damaged") else r.path.name, r.name, r.status,
                      f"{r.cells_done}/{r.cells_total}", str(a.get("created", "")), str(a.get("model", "")))
    console.print(table)


def _width() -> int:
    """The width of ``headlab show``'s table: ``COLUMNS`` where it is set, else the terminal's, else 240 (piped
    output keeps whole lines)."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    return console.width if sys.stdout.isatty() else 240


def _fit(text: str, width: int, right: bool = False) -> str:
    """``text`` in ``width`` columns, cut with an ellipsis where it is longer."""
    if len(text) > width:
        text = text[:max(width - 1, 0)] + "…"
    return text.rjust(width) if right else text.ljust(width)


def _summary_table(result: Any, out: Console) -> None:
    """One table for the run: step | what it did | metric | value | n | 95% interval, in ``out``'s width. Step
    ids are printed whole: one longer than a quarter of the width gets a line of its own above its row. "What
    it did" (and, past that, the metric's label) is cut with an ellipsis to fit."""

    rows = summary_rows(result)
    cells = [(r.step, r.what, ("no summary figure" if r.step in result.results else "no result") if r.note
              else r.metric, r.value, "" if r.note else r.n, "" if r.note else r.interval()) for r in rows]
    headers = ("step", "what it did", "metric", "value", "n", "95% interval")
    if all(c[4] in ("-", "") and c[5] in ("-", "") for c in cells):  # no mean over examples: no n, no interval
        headers, cells = headers[:4], [c[:4] for c in cells]
    natural = [max([len(headers[i])] + [len(c[i]) for c in cells]) for i in range(len(headers))]
    cap = max(out.width // 4, len(headers[0]))
    natural[0] = max([len(headers[0])] + [len(c[0]) for c in cells if len(c[0]) <= cap])
    left = max(out.width - 2 * (len(headers) - 1) - natural[0] - sum(natural[3:]), 2)  # gaps of 2 columns
    metric = min(natural[2], max(left - natural[1], left - 12, left // 2))  # "what it did" keeps 12 if it can
    widths = [natural[0], max(min(left - metric, natural[1]), 1), metric, *natural[3:]]

    def line(values: tuple[str, ...]) -> str:
        return "  ".join(_fit(v, w, right=i >= 3) for i, (v, w) in enumerate(zip(values, widths, strict=True)))

    lines = [line(headers), "─" * len(line(headers))]
    previous = None
    for r, c in zip(rows, cells, strict=True):
        first, previous = r.step != previous, r.step
        if first and len(r.step) > widths[0]:
            lines.append(r.step)
        step = r.step if first and len(r.step) <= widths[0] else ""
        lines.append(line((step, c[1] if first else "", *c[2:])).rstrip())
    lines += [f"{r.step}: {r.note}" for r in rows if r.note]
    out.print(Text("\n".join(lines)))


def _print_detail(result: Any, steps: list[str], out: Console) -> None:
    """Each of ``steps`` in full: what it did, then its top heads or its metrics per sweep cell (mean, 95%
    interval, n, dropped and why), per-task values and the KV policy's kept fraction."""

    summary = result.summary()
    rows = summary_rows(result)
    for step in steps:
        mine = [r for r in rows if r.step == step]
        out.print(Text(f"\n{step}: {mine[0].what}", style="bold"))
        info = summary.get(step, {})
        if mine[0].note:
            out.print(Text(mine[0].note))
            continue
        if "detectors" in info:  # a labelled cube: a row per detector
            table = _table("detector", "top heads", "threshold", "labelled", "causal", title="per detector")
            for r in info["detectors"]:
                tops = ", ".join(f"{head_label(t['layer'], t['head'])} {t['score']:.4f}" for t in r["top"][:3])
                labelled = "-" if r["labelled"] is None else f"{r['labelled']:g}/{r['heads']}"
                table.add_row(r["detector"], tops, "-" if r["threshold"] is None else f"{r['threshold']:.4g}",
                              labelled, r["causal"] or "-")
            out.print(table)
        if "top" in info:  # a (layer, head) score; a detect step without one (ablation) shows its metrics
            what = ", the per-token peak" if info.get("token_peak") else ""
            table = _table("rank", "head", "score", title=f"top heads ({info['method']}{what})")
            for i, t in enumerate(info["top"], 1):
                table.add_row(str(i), head_label(t["layer"], t["head"], info.get("unit", "head")), f"{t['score']:.4f}")
            out.print(table)
        if info.get("tasks"):
            keys = list(dict.fromkeys(k for r in info["tasks"] for k in r["cell"]))
            names = list(dict.fromkeys(m for r in info["tasks"] for m in r["metrics"]))
            table = _table(*keys, "task", *names, title="per task")
            for r in info["tasks"]:
                table.add_row(*(str(r["cell"].get(k, "")) for k in keys), r["task"],
                              *(f"{r['metrics'][m]:.4f}" if m in r["metrics"] else "" for m in names))
            out.print(table)
        if any(r["metrics"] for r in info.get("cells", [])):  # one row per sweep cell and metric, never a mean across sweep values
            keys = list(dict.fromkeys(k for r in info["cells"] for k in r["cell"]))
            table = _table(*keys, "metric", "mean", "95% interval", "n", "dropped",
                           title="metrics (mean over the examples where defined)")
            for r in info["cells"]:
                for m, value in r["metrics"].items():
                    e = r["estimates"].get(m)  # None: a step-level value, not a mean over examples
                    mean = f"{value:.4f}" if math.isfinite(value) else "undefined"
                    table.add_row(*(str(r["cell"][k]) for k in keys), m, mean, e.interval_text(4) if e else "-",
                                  str(e.n) if e else "-", e.dropped_text() if e else "-")
            out.print(table)
        for row in info.get("kv", []):
            where = ", ".join(f"{k}={v}" for k, v in row["cell"].items())
            out.print(f"{step}: kv {row['policy']} kept fraction {row['kept_fraction']:.4f}"
                      + (f" ({where})" if where else ""))


def _print_summary(result: Any, detail: list[str] | None = None) -> None:
    out = Console(width=_width(), highlight=False)
    _summary_table(result, out)
    if detail:
        _print_detail(result, detail, out)


@app.command()
def show(run_path: Annotated[Path, typer.Argument(metavar="RUN", help="a run store directory")],
         names: Annotated[list[str] | None, typer.Argument(metavar="[STEP]...", help="steps to show in detail "
                                                           "(implies --steps)", show_default=False)] = None,
         steps: Annotated[bool, typer.Option("--steps", help="after the summary, every step in detail (or the "
                                             "STEPs named)")] = False) -> None:
    """Print a run's summary, one row per step and number (top heads of detect steps, metric means with their n
    and 95% interval, KV kept fractions; the kept steps of partial cells included), then with --steps each step in
    detail."""

    result = open_run(run_path)
    known = list(dict.fromkeys([*result.steps, *result.results]))
    for name in names or []:
        if name not in known:
            raise SpecError(f"show: the run has no step '{name}'{suggest(name, known)}; its steps: "
                            f"{', '.join(known)}", source="command line")
    Console(width=_width(), highlight=False).print(  # the table's width: a long model path folds, as the table does
        f"[bold]{result.name}[/bold] {result.status}, {result.cells_done}/{result.cells_total} cells, "
        f"model {result.attrs.get('model')}")
    for name, info in sorted(result.partial_cells.items()):
        values = ", ".join(f"{k}={v!r}" for k, v in info["values"].items())
        stop = f"interrupted in step '{info['failed_step']}'" if info["error"] == "interrupted" else \
            f"step '{info['failed_step']}' failed: {info['error']}"
        console.print(Text(f"partial cell {name}{f' ({values})' if values else ''}: kept steps "
                           f"{', '.join(info['steps'])} (shown below); {stop}; `headlab run --resume "
                           f"{result.location}` computes the cell again"), soft_wrap=True)
    _print_summary(result, list(names) if names else known if steps else None)


class ReportFormat(str, Enum):
    """What ``headlab report`` writes: one HTML page, or one SVG or PNG file per figure."""

    html = "html"
    svg = "svg"
    png = "png"


@app.command()
def report(
    run_path: Annotated[Path, typer.Argument(metavar="RUN", help="a run store directory")],
    output: Annotated[Path | None, typer.Option(
        "-o", "--output", help="HTML file (default: RUN.html); with --format svg|png a folder (default: RUN.figures)")]
    = None,
    examples: Annotated[int, typer.Option("--examples", help="generations shown per step")] = 8,
    format: Annotated[ReportFormat, typer.Option(
        "--format", help="html: one offline page; svg or png: one file per figure, for papers")] = ReportFormat.html,
) -> None:
    """Write a static HTML report of a run (head heatmaps, metric tables, comparison and sweep charts), or its
    figures as SVG or PNG files."""
    from .report import write_report

    path = write_report(run_path, output, n_examples=examples, format=format.value)
    console.print(f"report written to {path}")


@app.command("eval", context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                       "help_option_names": []})
def eval_(ctx: typer.Context) -> None:
    """lm-evaluation-harness with headlab's model: lm-eval's own options (`--tasks`, `--include_path`, `--limit`,
    ...), `--model headlab` by default, e.g. `--model_args spec=steer.yaml` (`headlab eval --help`)."""
    from .lm_eval import main as harness_main

    harness_main(ctx.args)


@app.command("new-plugin")
def new_plugin(
    kind: Annotated[str, typer.Argument(metavar="KIND", help="detector, steering, decoder, task or metric")],
    name: Annotated[str, typer.Argument(help="the plugin's kind in specs, e.g. attention_sink")],
    directory: Annotated[Path | None, typer.Argument(metavar="DIR", help="where to write (default: ./headlab-NAME)")]
    = None,
) -> None:
    """Write a pip-installable plugin package: pyproject, a working method, its test, a README."""
    files = scaffold.new_plugin(kind, name, directory)
    root = files[0].parent
    console.print(f"[bold]{kind} plugin {name!r}[/bold] written to {root}:", soft_wrap=True)
    for path in files:
        console.print(f"  {path.relative_to(root)}")
    console.print(f"next: pip install -e {root} && pytest {root}", soft_wrap=True)


def _error(e: BaseException, debug: bool) -> None:
    """Print ``e`` as one line (the traceback first with ``debug``) and exit with its code."""
    code = exit_code(e)
    if debug:

        traceback.print_exception(e, file=sys.stderr)
    hint = "" if debug or code == INVALID else " (--debug shows the traceback)"
    err.print(Text.assemble(("error:", "red"), f" {one_line(e)}{hint}"), highlight=False, soft_wrap=True)
    sys.exit(code)


#: the signals received during this command: the executor stops at the next cell even where the
#: KeyboardInterrupt raised in the handler was swallowed (Python ignores exceptions in GC callbacks)
_signalled: list[int] = []


def _terminate(signum: int, frame: Any) -> None:
    _signalled.append(signum)
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app; any error prints one line and exits 1 (run failed) or 2 (invalid input);
    Ctrl-C, SIGINT, SIGTERM or SIGHUP exit 130 with finished cells stored."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("HEADLAB_DEBUG", "") not in ("", "0")
    args = [a for a in args if a != "--debug"]
    previous: dict[int, Any] = {}
    _signalled.clear()
    # a polite kill, or the terminal going away (SIGHUP), ends a run like Ctrl-C: resumable, never "running";
    # a hangup the parent chose to ignore (`nohup headlab run ...`) stays ignored
    for signum in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if signum is None or (signum != signal.SIGTERM and signal.getsignal(signum) is signal.SIG_IGN):
            continue
        try:
            previous[signum] = signal.signal(signum, _terminate)
        except ValueError:  # not the main thread (an embedding application): leave its handlers alone
            break
    if previous and hasattr(signal, "pthread_sigmask"):  # a parent that blocked them would hold them back
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, *previous})
    try:
        _main(args, debug)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


_plugin_commands: list[bool] = []  # [True] once the plugins' commands are on `app`


def _builtin_commands() -> set[str]:
    return {c.name or (c.callback.__name__.replace("_", "-") if c.callback else "") for c in app.registered_commands}


def register_plugin_commands() -> None:
    """Add the commands of every plugin's ``headlab_register_commands`` to ``app`` (once per process)."""
    if _plugin_commands:
        return
    _plugin_commands.append(True)

    get_manager().pm.hook.headlab_register_commands(app=app, run_spec=run_spec)


def _main(args: list[str], debug: bool) -> None:
    _reported.clear()
    try:
        first = next((a for a in args if not a.startswith("-")), None)
        if first is None or first not in _builtin_commands():  # a plugin's command, or the list of commands
            register_plugin_commands()
        code = app(args, standalone_mode=False)
    except (typer.Abort, KeyboardInterrupt):
        code = INTERRUPTED
    except Exception as e:  # usage errors of typer's bundled click, then everything else
        if callable(getattr(e, "format_message", None)) and getattr(e, "exit_code", None) is not None \
                and "click" in type(e).__module__:  # typer's bundled click (typer._click) or click
            command = getattr(getattr(e, "ctx", None), "command_path", "headlab")
            err.print(Text.assemble(("error:", "red"), f" {e.format_message()} (see `{command} --help`)"),
                      highlight=False, soft_wrap=True)
            sys.exit(INVALID)
        if type(e).__name__ == "Exit":
            code = getattr(e, "exit_code", 0)
        else:
            _error(e, debug)
    except SystemExit as e:  # a plugin calling sys.exit outside a step (a step's is a StepError)
        if isinstance(e.code, int) or e.code is None:
            raise
        _error(RuntimeError(f"sys.exit({e.code!r})"), debug)
    if isinstance(code, int) and code:
        if code == INTERRUPTED and not _reported:
            err.print("interrupted")
        sys.exit(code)


if __name__ == "__main__":
    main()
