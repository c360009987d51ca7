"""The trust boundary for lm-eval task definitions: what a task that a spec brings may run.

An ``evaluate`` step runs lm-evaluation-harness tasks. Tasks of the *installed* lm-eval registry run as
lm-eval runs them: their templates, ``!function`` helpers and metrics are code that was installed with
lm-eval. Task definitions that come *from a spec* are data, and a spec never runs code:

- inline task mappings in the step's ``tasks`` list,
- task YAMLs under the step's ``include_path`` (every ``*.yaml``/``*.yml`` below it, as lm-eval indexes
  them, and every file they ``include:``),
- a task named by the path of a YAML file.

Unless the step says ``trust_task_code: true``, such definitions may not name Python code: no YAML tag
(``!function mod.fn``; lm-eval would import and run ``mod.py``) unless its module is a copy of a file that
lm-eval itself ships (as :func:`headlab.lm_eval.local_task` writes them), no metric outside lm-eval's metric
registry (lm-eval would hand it to HF ``evaluate.load``, which runs a metric script, local paths
included), no ``hf_evaluate: true``, no ``trust_remote_code`` in ``dataset_kwargs``; and their Jinja2
templates are checked now and rendered at run time in headlab's sandbox (:mod:`headlab.sandbox`), not in
lm-eval's unsandboxed environment (:func:`sandboxed_templates`). Every refusal is one line naming the file
(or the task's place in the spec), the key and the fix.

``trust_task_code: true`` hands those definitions to lm-eval unchanged: their Python helpers run with the
permissions of the process. It is recorded in the step's attributes (``task_code``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from .sandbox import check_template, is_jinja, regex_replace, sandbox

__all__ = ["EXTRA", "MAX_TASK_FILES", "MAX_TASK_FILE_BYTES", "MAX_TASK_NODES", "TaskCodeError", "TaskSources",
           "check_tasks", "sandboxed_templates", "shipped_code_digests"]

#: what to do when lm-eval is missing (the ``eval`` extra): the message of every refusal for want of it
EXTRA = "lm-eval is not installed; install the eval extra: pip install 'headlab[eval]'"

MAX_TASK_FILES = 20_000
"""Most task YAML files one ``include_path`` may hold (lm-eval indexes every one)."""
MAX_TASK_FILE_BYTES = 4_000_000
"""Largest task YAML file read."""
MAX_TASK_NODES = 1_000_000
"""Most values one task YAML may expand to, aliases counted as many times as they are used."""

FIX = "set `trust_task_code: true` on the step to run it (the code then runs with this process's permissions)"


class TaskCodeError(ValueError):
    """A task definition from a spec names code or is not allowed; the message names where and the fix."""


@dataclass
class TaskSources:
    """Where a step's task definitions come from: the files and inline mappings that are not lm-eval's own."""

    files: list[str] = field(default_factory=list)
    inline: int = 0

    @property
    def untrusted(self) -> bool:
        """Whether any definition comes from the spec (inline, a file, an ``include_path``)."""
        return bool(self.files or self.inline)


@dataclass(frozen=True)
class _Function:
    """A ``!function module.name`` tag, as read (never imported)."""

    target: str


@lru_cache(maxsize=1)
def shipped_code_digests() -> frozenset[str]:
    """SHA-256 digests of every Python file lm-eval ships with its tasks (empty without lm-eval)."""

    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    root = Path(next(iter(spec.submodule_search_locations))) / "tasks"
    return frozenset(hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*.py"))


def _loader(path: Path) -> type:

    base = yaml.CSafeLoader if getattr(yaml, "__with_libyaml__", False) else yaml.SafeLoader

    class Loader(base):  # type: ignore[misc,valid-type]
        """Safe YAML that reads ``!function`` as a marker and refuses every other tag."""

    Loader.add_constructor("!function", lambda loader, node: _Function(str(loader.construct_scalar(node))))
    return Loader


def _read_yaml(path: Path) -> Any:

    try:
        size = path.stat().st_size
    except OSError as e:
        raise TaskCodeError(f"{path}: cannot read task file: {e.strerror}") from None
    if size > MAX_TASK_FILE_BYTES:
        raise TaskCodeError(f"{path}: task file of {size:,} bytes is larger than {MAX_TASK_FILE_BYTES:,}")
    try:
        with path.open("rb") as fh:
            return yaml.load(fh, Loader=_loader(path))  # noqa: S506 - a safe loader with one marker tag
    except yaml.constructor.ConstructorError as e:
        mark = f":{e.problem_mark.line + 1}" if e.problem_mark is not None else ""
        raise TaskCodeError(f"{path}{mark}: {e.problem}; task files from a spec may use no YAML tags but "
                            f"lm-eval's !function, and that only with trust_task_code") from None
    except yaml.YAMLError as e:
        raise TaskCodeError(f"{path}: not valid YAML: {e}") from None


def _size(value: Any, memo: dict[int, int]) -> int:
    """How many values ``value`` expands to (shared sub-structures counted each time they occur)."""
    key = id(value)
    if key in memo:
        return memo[key]
    memo[key] = 1  # a cycle counts once
    if isinstance(value, Mapping):
        n = 1 + sum(_size(v, memo) for v in value.values())
    elif isinstance(value, list):
        n = 1 + sum(_size(v, memo) for v in value)
    else:
        n = 1
    memo[key] = min(n, MAX_TASK_NODES + 1)
    return memo[key]


def _shipped(target: str, base: Path) -> bool:
    """Whether ``!function target`` (read beside ``base``) resolves to code lm-eval itself ships."""
    module, _, _ = target.rpartition(".")
    if not module:
        return False
    local = base / f"{module.replace('.', '/')}.py"
    if local.is_file():
        return hashlib.sha256(local.read_bytes()).hexdigest() in shipped_code_digests()
    return module == "lm_eval" or module.startswith("lm_eval.")


def _registered_metrics() -> set[str]:
    try:
        import lm_eval.api.metrics  # noqa: F401  (fills the registry)
        from lm_eval.api.registry import metric_registry
    except ImportError:  # pragma: no cover - without the extra nothing runs
        return set()
    return set(metric_registry)


class _Checker:
    def __init__(self, trust: bool) -> None:
        self.trust = trust
        self.sources = TaskSources()
        self.seen: set[Path] = set()
        self._metrics: set[str] | None = None

    def metrics(self) -> set[str]:
        if self._metrics is None:
            self._metrics = _registered_metrics()
        return self._metrics

    def file(self, path: Path) -> None:
        path = path.expanduser().resolve()
        if path in self.seen:
            return
        if len(self.seen) >= MAX_TASK_FILES:
            raise TaskCodeError(f"{path}: more than {MAX_TASK_FILES:,} task files; point include_path at a "
                                "smaller directory")
        self.seen.add(path)
        self.sources.files.append(str(path))
        data = _read_yaml(path)
        if _size(data, {}) > MAX_TASK_NODES:
            raise TaskCodeError(f"{path}: expands to more than {MAX_TASK_NODES:,} values (YAML aliases)")
        self.config(data, str(path), path.parent)

    def config(self, value: Any, where: str, base: Path, key: str = "") -> None:
        """Check one task/group definition (or any value inside one) read at ``where``."""
        stack: list[tuple[Any, str]] = [(value, key)]
        visited: set[int] = set()
        while stack:
            item, at = stack.pop()
            if id(item) in visited:
                continue
            visited.add(id(item))
            self._value(item, where, base, at)
            if isinstance(item, Mapping):
                stack.extend((v, f"{at}.{k}" if at else str(k)) for k, v in item.items())
            elif isinstance(item, list):
                stack.extend((v, f"{at}[{i}]") for i, v in enumerate(item))

    def _refuse(self, where: str, at: str, what: str) -> None:
        if not self.trust:
            raise TaskCodeError(f"{where}: {at}: {what}; {FIX}")

    def _value(self, item: Any, where: str, base: Path, at: str) -> None:
        leaf = at.rsplit(".", 1)[-1]
        if isinstance(item, _Function):
            if not _shipped(item.target, base):
                self._refuse(where, at, f"!function {item.target} names Python code, which a task from a spec "
                                        "may not run")
        elif isinstance(item, str):
            if is_jinja(item) and not self.trust:
                try:
                    check_template(item, at)
                except ValueError as e:
                    raise TaskCodeError(f"{where}: {e}") from None
        elif isinstance(item, Mapping):
            self._mapping(item, where, base, at)
        if leaf == "include" and isinstance(item, (str, list)):
            for inc in [item] if isinstance(item, str) else item:
                if isinstance(inc, str):
                    target = Path(inc).expanduser()
                    self.file(target if target.is_absolute() else base / target)

    def _mapping(self, item: Mapping, where: str, base: Path, at: str) -> None:
        prefix = f"{at}." if at else ""
        metric = item.get("metric")
        if isinstance(metric, str) and at.split(".")[-1].startswith("metric_list["):
            if metric not in self.metrics():
                self._refuse(where, f"{prefix}metric", f"metric {metric!r} is not in lm-eval's metric registry "
                                                       "(lm-eval would load it with HF evaluate, which runs its "
                                                       "script)")
            if item.get("hf_evaluate"):
                self._refuse(where, f"{prefix}hf_evaluate", "hf_evaluate metrics run the metric's script")
        kwargs = item.get("dataset_kwargs")
        if isinstance(kwargs, Mapping) and kwargs.get("trust_remote_code"):
            self._refuse(where, f"{prefix}dataset_kwargs.trust_remote_code", "a dataset's remote code would run")


def check_tasks(tasks: Sequence[str | Mapping[str, Any]], include_path: str | os.PathLike | Sequence[Any] | None,
                *, trust: bool = False) -> TaskSources:
    """Check the task definitions an ``evaluate`` step brings (see the module's docs).

    ``tasks``: the step's task names and inline mappings (``tasks[i]`` is named in errors); a name that is
    an existing ``.yaml``/``.yml`` file is read as a task file. ``include_path``: directories of task YAMLs
    (relative to the working directory). ``trust``: the step's ``trust_task_code`` (nothing is refused, the
    sources are still returned). Raises :class:`TaskCodeError`; returns where the definitions came from.
    """
    checker = _Checker(trust)
    for i, task in enumerate(tasks):
        if isinstance(task, Mapping):
            checker.sources.inline += 1
            checker.config(task, f"tasks[{i}]", Path.cwd())
        elif isinstance(task, str) and task.endswith((".yaml", ".yml")) and Path(task).expanduser().is_file():
            checker.file(Path(task))
    paths = [] if include_path is None else [include_path] if isinstance(include_path, (str, os.PathLike)) \
        else list(include_path)
    for entry in paths:
        root = Path(entry).expanduser()
        if not root.is_dir():
            raise TaskCodeError(f"include_path: {str(entry)!r} is not a directory (looked at {root.resolve()})")
        for path in sorted(p for p in root.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file()
                           and not {"__pycache__", ".ipynb_checkpoints"} & set(p.parts)):
            checker.file(path)
    return checker.sources


@contextmanager
def sandboxed_templates() -> Iterator[None]:
    """lm-eval renders every task template in headlab's sandbox (with its ``regex_replace`` filter) while
    the block runs, instead of in its own unsandboxed Jinja2 environment."""
    from lm_eval import utils

    saved = utils.env
    utils.env = sandbox({"regex_replace": regex_replace})
    try:
        yield
    finally:
        utils.env = saved
