"""Errors at the boundary: which plugin and step failed, one line for people, an exit code for shells.

Exit codes of the ``headlab`` command (docs/reliability.md):

- ``0``: done;
- ``1``: the run failed: a plugin, the model or headlab itself raised something that is not about the input;
- ``2``: invalid input, refused: a spec, a command line, a file or data file, a model that does not load, a
  head selection, a resource budget, a damaged or missing run store. A plugin says "your input is wrong" by
  raising ``ValueError`` (or a subclass: ``TaskDataError``, ``HeadSelectionError``, ...);
- ``130``: interrupted (Ctrl-C, SIGINT or SIGTERM); finished cells are stored and ``--resume`` completes it.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterable
from typing import Any

from .model import ModelLoadError
from .plugin_manager import CATEGORIES, PluginError, get_manager
from .resources import configs_in
from .results import RunNotFound
from .spec import SpecError

__all__ = ["FAILED", "INTERRUPTED", "INVALID", "OK", "ContractError", "StepError", "describe", "exit_code",
           "one_line"]

OK, FAILED, INVALID, INTERRUPTED = 0, 1, 2, 130
"""The exit codes of the ``headlab`` command."""

MAX_LINE = 600
"""Longest one-line message the command prints (the rest is behind ``--debug``)."""


class StepError(Exception):
    """A step of a run failed: the exception of its plugin, with the step and the component named.

    ``step`` is the step id, ``action`` its action, ``category``/``kind``/``plugin`` the component whose code
    raised (the task when building the examples failed, a decoder, a steering method, ... else the action),
    ``cell`` the sweep cell's name (``c0003``) and ``values`` its sweep values. The original exception is
    ``__cause__`` (and :attr:`cause`). The error raised is also an instance of the cause's class (a
    ``ValueError`` from a plugin stays a ``ValueError`` for ``except`` clauses); :meth:`wrap` builds it.
    """

    def __init__(self, cause: BaseException, *, step: str, action: str, category: str, kind: str, plugin: str,
                 cell: str = "", values: dict[str, Any] | None = None, during: str = "") -> None:
        self.cause, self.step, self.action = cause, step, action
        self.category, self.kind, self.plugin = category, kind, plugin
        self.cell, self.values = cell, dict(values or {})
        self.during = during  # the component's method that raised, when it is not the step's work ("estimate()")
        Exception.__init__(self, str(self))

    def __str__(self) -> str:
        where = f"step '{self.step}'"
        if self.values:
            where += f" of cell {self.cell} (" + ", ".join(f"{k}={v!r}" for k, v in self.values.items()) + ")"
        during = f", in its {self.during}" if getattr(self, "during", "") else ""
        return (f"{where} ({self.category} '{self.kind}', plugin {self.plugin}{during}): "
                f"{describe(self.cause, full=True)}")

    def __reduce__(self) -> Any:
        return (_rebuild, (self.cause, self.step, self.action, self.category, self.kind, self.plugin, self.cell,
                           self.values, self.during))

    @classmethod
    def wrap(cls, cause: BaseException, **fields: Any) -> StepError:
        """A StepError for ``cause`` that is also an instance of ``type(cause)`` when that is possible."""
        return _step_error_class(type(cause))(cause, **fields)


def _rebuild(cause: BaseException, step: str, action: str, category: str, kind: str, plugin: str, cell: str,
             values: dict[str, Any], during: str = "") -> StepError:
    return StepError.wrap(cause, step=step, action=action, category=category, kind=kind, plugin=plugin, cell=cell,
                          values=values, during=during)


@functools.cache
def _step_error_class(cause: type[BaseException]) -> type[StepError]:
    if not issubclass(cause, Exception) or issubclass(cause, StepError) or cause is Exception:
        return StepError
    try:
        return type(f"StepError[{cause.__name__}]", (StepError, cause), {"__module__": __name__})
    except TypeError:  # a base that cannot be combined (layout or metaclass conflict)
        return StepError


class ContractError(TypeError):
    """A component broke its contract (a detector returned None, a decoder something other than ``Decoded``).

    Raised by the code that called it (an action), naming the component by ``category`` and ``kind``, so the
    :class:`StepError` names that component and its plugin rather than the caller."""

    def __init__(self, message: str, *, category: str, kind: str) -> None:
        self.category, self.kind = category, kind
        super().__init__(message)


def describe(exc: BaseException, full: bool = False) -> str:
    """``Type: first line of the message`` (``full``: every line, joined into one); SystemExit says that the
    plugin exited."""
    if isinstance(exc, SystemExit):
        return f"SystemExit: the plugin called sys.exit({exc.code!r})"
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - an exception whose __str__ fails still gets named
        text = ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return f"{type(exc).__name__}: {' '.join(lines) if full else lines[0]}"


def one_line(exc: BaseException) -> str:
    """The message the command prints for ``exc``: one line, at most :data:`MAX_LINE` characters. Errors that
    are already about the input (SpecError, ...) keep their own text; others get their type in front."""
    if isinstance(exc, StepError) or input_error(exc):
        text = " ".join(str(exc).split()) or type(exc).__name__
    else:
        text = " ".join(describe(exc).split())
    return text if len(text) <= MAX_LINE else text[: MAX_LINE - 3] + "..."


def input_error(exc: BaseException) -> bool:
    """Whether ``exc`` says the input was wrong (exit code 2) rather than that the run failed (1)."""

    missing_extra = isinstance(exc, ImportError) and "pip install 'headlab[" in str(exc)
    if getattr(exc, "invalid", None) is True:  # a run store where none can be written (StoreWriteError)
        return True
    return missing_extra or isinstance(exc, (SpecError, ModelLoadError, PluginError, RunNotFound, ValueError,
                                             FileNotFoundError, FileExistsError, IsADirectoryError,
                                             NotADirectoryError, PermissionError))


def exit_code(exc: BaseException) -> int:
    """The exit code of the command for an exception that ended it (see the module docs)."""
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED
    if isinstance(exc, StepError):
        return INVALID if input_error(exc.cause) else FAILED
    return INVALID if input_error(exc) else FAILED


def _modules(tb: types.TracebackType | None) -> list[tuple[str, Any]]:
    """(module name, code object) of each frame of a traceback, innermost first."""
    out = []
    while tb is not None:
        out.append((tb.tb_frame.f_globals.get("__name__", ""), tb.tb_frame.f_code))
        tb = tb.tb_next
    return out[::-1]


def culprit(exc: BaseException, candidates: Iterable[Any]) -> Any:
    """The component among ``candidates`` whose code raised ``exc``: the one whose implementation's module
    is innermost in the traceback (its function itself preferred when two share a module); None if none."""
    comps = list(candidates)
    frames = _modules(exc.__traceback__)
    codes = {code for _, code in frames}
    for module, _ in frames:
        here = [c for c in comps if any(getattr(f, "__module__", None) == module for f in _functions(c))]
        if here:
            return next((c for c in here if any(getattr(f, "__code__", None) in codes for f in _functions(c))),
                        here[0])
    return None


def _functions(comp: Any) -> list[Any]:
    return [f for f in (comp.impl, getattr(comp, "score", None)) if f is not None]


def step_error(exc: BaseException, *, step: Any, config: Any, task: Any = None, cell: Any = None,
               during: str = "") -> StepError:
    """A :class:`StepError` for ``exc`` raised by step ``step`` (``task`` set: while building its examples),
    naming the component whose code raised it (see :func:`culprit`). ``during``: the method of ``config`` (or
    ``task``), the one config whose own code raised outside the step's work (``"estimate()"``), named in the
    message; that component is named even when its code is not among the traceback's modules."""

    registry = get_manager().registry
    action = registry.actions.get(step.action)
    comps = []
    if task is not None:
        comps.append(registry.components["tasks"].get(task.kind))
    else:
        for cfg in configs_in(config):
            kind = getattr(cfg, "kind", None)
            for category, spec in CATEGORIES.items():
                comp = registry.components[category].get(kind) if spec.style == "config" and kind else None
                if comp is not None and isinstance(cfg, comp.config):
                    comps.append(comp)
    comps = [c for c in comps if c is not None]
    found = culprit(exc, comps) or (comps[0] if (task is not None or during) and comps else None)
    if isinstance(exc, ContractError):
        found = registry.components.get(exc.category, {}).get(exc.kind, found)
    if found is None:
        found = action
    label = CATEGORIES[found.category].label if found is not None else "action"
    values = cell.as_dict() if cell is not None else {}
    err = StepError.wrap(exc, step=step.id, action=step.action, category=label,
                    kind=found.kind if found is not None else step.action,
                    plugin=found.plugin if found is not None else "?", cell=getattr(cell, "name", ""), values=values,
                    during=during)
    return err
