"""``SpecRunner``: edit or load a spec, validate it with inline errors, run it with live progress,
cancel (leaving a resumable run) and see the result tables.

Validation is :func:`headlab.load_spec`; its :class:`headlab.SpecError` carries ``file:line:col``, so
the offending line is shown under the editor with a caret. Runs go through :func:`headlab.run` in a
background thread with a :class:`headlab.context.Reporter` that drives two progress bars (sweep
cells, and the current step's items) and a ``cancel`` callable: cancelling stops at the next item,
the run store is marked ``interrupted``, and :meth:`SpecRunner.resume` finishes it.
"""

from __future__ import annotations

import html
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ipywidgets as w

from .. import runner
from ..context import Reporter
from ..results import Run, list_runs, open_run
from ..spec import LoadedSpec, SpecError, parse_yaml, validate_data
from .browser import Compare
from .views import figure_box, run_views

__all__ = ["SpecRunner", "WidgetReporter", "error_html"]


class WidgetReporter(Reporter):
    """Progress of a run on two ipywidgets progress bars: ``cells`` and the current step; a long forward
    inside a step (``forward:<step>``, layer by layer) is reported on the step's label.

    Every event is also appended to ``history`` as ``(event, key, value, total)``.
    """

    def __init__(self, cells: w.IntProgress, step: w.IntProgress, label: w.HTML) -> None:
        self.cells, self.step, self.label = cells, step, label
        self.history: list[tuple[str, str, int, int | None]] = []
        self._lock = threading.Lock()
        self._forward: list[Any] = ["", 0, None]

    def _bar(self, key: str) -> w.IntProgress:
        return self.cells if key == "cells" else self.step

    def start(self, key: str, total: int | None, description: str) -> None:
        with self._lock:
            if key.startswith("forward:"):  # inside one of the step's items: said on the label, bars untouched
                self._forward = [description, 0, total]
                self.label.value = html.escape(f"{key.removeprefix('forward:')}: {description} 0/{total}")
                self.history.append(("start", key, 0, total))
                return
            bar = self._bar(key)
            bar.max = max(1, total or 1)
            bar.value = 0
            bar.bar_style = "info"
            bar.description = "cells" if key == "cells" else key.removeprefix("step:")[:14]
            if key != "cells":
                self.label.value = html.escape(f"{key.removeprefix('step:')}: {description}")
            self.history.append(("start", key, 0, total))

    def advance(self, key: str, n: int = 1) -> None:
        with self._lock:
            if key.startswith("forward:"):
                self._forward[1] += n
                description, done, total = self._forward
                self.label.value = html.escape(f"{key.removeprefix('forward:')}: {description} {done}/{total}")
                self.history.append(("advance", key, done, total))
                return
            bar = self._bar(key)
            bar.value = min(bar.max, bar.value + n)
            self.history.append(("advance", key, bar.value, bar.max))

    def stop(self, key: str) -> None:
        with self._lock:
            if key.startswith("forward:"):
                self.history.append(("stop", key, self._forward[1], self._forward[2]))
                return
            bar = self._bar(key)
            if key == "cells" and bar.value >= bar.max:
                bar.bar_style = "success"
            self.history.append(("stop", key, bar.value, bar.max))


def error_html(error: SpecError, text: str, context: int = 2) -> str:
    """The error's message and the spec lines around it, the bad line highlighted with a caret."""
    msg = f'<div class="hl-error-msg"><b>error:</b> {html.escape(str(error))}</div>'
    if error.line is None:
        return f'<div class="headlab-spec-error">{msg}</div>'
    lines = text.splitlines()
    lo, hi = max(1, error.line - context), min(len(lines), error.line + context)
    out = []
    for n in range(lo, hi + 1):
        src = html.escape(lines[n - 1]) if n - 1 < len(lines) else ""
        if n == error.line:
            out.append(f'<span class="hl-error-line" data-line="{n}">{n:>4} | {src}</span>')
            caret = " " * (7 + max(0, (error.col or 1) - 1)) + "^"
            out.append(f'<span class="hl-caret">{caret} {html.escape(error.message)}</span>')
        else:
            out.append(f"{n:>4} | {src}")
    style = ("<style>.headlab-spec-error pre{background:#fff5f5;padding:4px;font-size:12px}"
             ".headlab-spec-error .hl-error-line{background:#ffd6d6;display:inline-block;width:100%}"
             ".headlab-spec-error .hl-caret{color:#c00}.headlab-spec-error .hl-error-msg{color:#a00}</style>")
    return f'{style}<div class="headlab-spec-error">{msg}<pre>' + "\n".join(out) + "</pre></div>"


class SpecRunner(w.VBox):
    """Edit, validate, run, cancel and resume a spec from a notebook.

    ``SpecRunner("specs/quickstart.yaml")`` loads a file (errors then name that file),
    ``SpecRunner(text)`` starts from YAML text. ``overrides`` are ``--set``-style ``{dotted.path: value}``
    applied at run time; ``out`` overrides the spec's store directory. Validation runs as you type.

    State for code and tests: ``error`` (the current :class:`SpecError` or None), ``loaded`` (the
    validated spec), ``state`` (idle, running, cancelling, interrupted, complete, failed), ``run_path``
    and ``result`` (the :class:`headlab.Run`), ``reporter.history`` (every progress event).
    """

    def __init__(self, spec: str | Path | None = None, *, out: str | Path | None = None,
                 overrides: Mapping[str, Any] | None = None, live: bool = True) -> None:
        self.out = None if out is None else Path(out)
        self.overrides = dict(overrides or {})
        self.source = "<spec>"
        self.error: SpecError | None = None
        self.loaded: LoadedSpec | None = None
        self.state = "idle"
        self.run_path: Path | None = None
        self.result: Run | None = None
        self.exception: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()

        self.editor = w.Textarea(layout=w.Layout(width="100%", height="260px"), continuous_update=False)
        self.editor.add_class("headlab-spec-editor")
        self.path = w.Text(placeholder="spec file", description="file", layout=w.Layout(width="50%"))
        self.load_button = w.Button(description="load", icon="folder-open")
        self.validate_button = w.Button(description="validate", icon="check")
        self.run_button = w.Button(description="run", icon="play", button_style="primary")
        self.cancel_button = w.Button(description="cancel", icon="stop", button_style="warning", disabled=True)
        self.resume_button = w.Button(description="resume", icon="forward", disabled=True)
        self.errors = w.HTML()
        self.errors.add_class("headlab-spec-errors")
        self.status = w.HTML("idle")
        self.status.add_class("headlab-run-status")
        self.cells_bar = w.IntProgress(value=0, min=0, max=1, description="cells")
        self.step_bar = w.IntProgress(value=0, min=0, max=1, description="step")
        self.step_label = w.HTML()
        self.results = w.VBox()
        self.results.add_class("headlab-run-results")
        self.reporter = WidgetReporter(self.cells_bar, self.step_bar, self.step_label)

        self.load_button.on_click(lambda _: self.load(self.path.value))
        self.validate_button.on_click(lambda _: self.validate())
        self.run_button.on_click(lambda _: self.start())
        self.cancel_button.on_click(lambda _: self.cancel())
        self.resume_button.on_click(lambda _: self.resume())
        self._live = live
        self.editor.observe(self._edited, names="value")

        super().__init__([
            w.HBox([self.path, self.load_button]), self.editor, self.errors,
            w.HBox([self.validate_button, self.run_button, self.cancel_button, self.resume_button]),
            self.status, w.HBox([self.cells_bar, self.step_bar, self.step_label]), self.results,
        ])
        self.add_class("headlab-spec-runner")
        if spec is not None:
            if isinstance(spec, Path) or ("\n" not in str(spec) and str(spec).endswith((".yaml", ".yml"))):
                self.load(spec)
            else:
                self.set_text(str(spec))

    # ---- editing and validation
    @property
    def text(self) -> str:
        return self.editor.value

    def set_text(self, text: str, source: str = "<spec>") -> None:
        """Put ``text`` in the editor (validated at once)."""
        self.source = source
        if self.editor.value == text:
            self.validate()
        else:
            self.editor.value = text

    def load(self, path: str | Path) -> None:
        """Load a spec file into the editor; errors then name the file."""
        p = Path(path)
        self.path.value = str(p)
        if not p.is_file():
            self._show_error(SpecError("no such spec file; check the path", source=str(p)))
            return
        self.set_text(p.read_text(encoding="utf-8"), source=str(p))

    def _edited(self, change: dict[str, Any]) -> None:
        if self._live:
            self.validate()

    def _show_error(self, error: SpecError | None) -> None:
        self.error = error
        self.errors.value = "" if error is None else error_html(error, self.text)

    def validate(self) -> LoadedSpec | None:
        """Validate the editor's text; shows the error inline and returns None when it is invalid."""
        text = self.text
        try:
            if not text.strip():
                raise SpecError("the spec is empty", source=self.source)

            data, tree = parse_yaml(text, self.source)
            loaded = validate_data(data, text=text, source=self.source, tree=tree)
            if self.overrides:
                loaded = loaded.with_overrides(self.overrides)
        except SpecError as e:
            self.loaded = None
            self._show_error(e)
            self.run_button.disabled = True
            return None
        self.loaded = loaded
        self._show_error(None)
        self.run_button.disabled = self.state in ("running", "cancelling")
        cells = len(loaded.cells)
        self.status.value = html.escape(
            f"valid: {len(loaded.spec.steps)} steps, {cells} cell{'s' if cells != 1 else ''}, "
            f"model {loaded.spec.model.name}") if self.state not in ("running", "cancelling") else self.status.value
        return loaded

    # ---- running
    def _set_state(self, state: str, message: str = "") -> None:
        self.state = state
        busy = state in ("running", "cancelling")
        self.run_button.disabled = busy or self.error is not None
        self.cancel_button.disabled = not busy
        self.resume_button.disabled = not (state == "interrupted" and self.run_path is not None)
        self.editor.disabled = busy
        style = {"complete": "#080", "failed": "#a00", "interrupted": "#a60"}.get(state, "#333")
        self.status.value = f'<span style="color:{style}">{html.escape(state)}</span>' + (
            f" {html.escape(message)}" if message else "")

    def start(self, *, wait: bool = False) -> None:
        """Run the validated spec in a background thread (``wait=True`` blocks until it ends)."""
        loaded = self.validate()
        if loaded is None or self.state in ("running", "cancelling"):
            return
        output = Path(self.out or loaded.spec.output)
        self._launch(lambda cancel, on_cell: _runner().run(loaded, out=output, reporter=self.reporter,
                                                           cancel=cancel, on_cell=on_cell), output, wait)

    def resume(self, *, wait: bool = False) -> None:
        """Finish an interrupted run (the one this widget started, or ``run_path``)."""
        if self.run_path is None or self.state in ("running", "cancelling"):
            return
        path = self.run_path
        self._launch(lambda cancel, on_cell: _runner().run(None, resume=path, reporter=self.reporter,
                                                           cancel=cancel, on_cell=on_cell), path.parent, wait)

    def _launch(self, call: Any, output: Path, wait: bool) -> None:
        self._cancel.clear()
        self.exception = None
        self.result = None
        before = {r.path for r in list_runs(output)}
        self._set_state("running", "")
        self.results.children = []
        started = time.time()

        def cancelled() -> bool:
            return self._cancel.is_set()

        def on_cell(_cell: Any) -> None:
            if self._cancel.is_set():
                raise KeyboardInterrupt

        def target() -> None:
            try:
                result = call(cancelled, on_cell)
            except KeyboardInterrupt:
                self._find_run(output, before)
                self._set_state("interrupted", f"after {time.time() - started:.1f}s; "
                                + (f"{self._done_text()} stored in {self.run_path}; resume to finish"
                                   if self.run_path else "nothing was stored"))
                return
            except BaseException as e:  # shown in the widget, kept for code
                self.exception = e
                self._find_run(output, before)
                self._set_state("failed", f"{type(e).__name__}: {e}")
                return
            self.result = result
            self.run_path = result.path
            self._set_state("complete", f"in {time.time() - started:.1f}s: {result.cells_done}/"
                            f"{result.cells_total} cells stored in {result.path}")
            try:
                self._show_results(result)
            except Exception as e:  # the run is stored; only its display failed
                self.exception = e
                self.results.children = [w.HTML(f"<pre>cannot show the results: {html.escape(repr(e))}</pre>")]

        self._thread = threading.Thread(target=target, name="headlab-spec-runner", daemon=True)
        self._thread.start()
        if wait:
            self.wait()

    def _find_run(self, output: Path, before: set[Path]) -> None:
        new = [r for r in list_runs(output) if r.path not in before]
        if new:
            self.run_path = new[-1].path

    def _done_text(self) -> str:

        if self.run_path is None:
            return ""
        r = open_run(self.run_path)
        return f"{r.cells_done}/{r.cells_total} cells"

    def cancel(self) -> None:
        """Stop the running spec at the next item; finished cells stay stored (resumable)."""
        if self.state == "running":
            self._cancel.set()
            self._set_state("cancelling", "stopping at the next item")

    def wait(self, timeout: float | None = None) -> str:
        """Block until the background run ends; returns the final state."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.state

    # ---- results
    def _show_results(self, result: Run) -> None:

        views = run_views(result)
        children: list[w.Widget] = [w.HTML(result._repr_html_())]
        if views:
            children.append(figure_box(views))
        children.append(Compare([result]))
        self.results.children = children


def _runner() -> Any:

    return runner
