"""Task loading and checking: local copies of lm-eval tasks, the task index, and the checks of an
``evaluate`` step's tasks before a run (:func:`check_task_configs`)."""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import inspect
import json
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .adapter import HAVE_LM_EVAL, require_lm_eval

if HAVE_LM_EVAL:
    import lm_eval
    from lm_eval.api.registry import aggregation_registry
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml

__all__ = ["MAX_FEWSHOT", "OUTPUT_TYPES", "TaskConfigError", "check_task_configs", "local_task", "metric_output_types",
           "task_manager"]


_DATA_FIELDS = ("dataset_path", "dataset_name", "dataset_kwargs")
_SPLITS = ("training_split", "validation_split", "test_split", "fewshot_split")


def _task_yaml(task: str) -> Path:
    root = Path(lm_eval.__file__).parent / "tasks"
    found = sorted(root.rglob(f"{task}.yaml"))
    if not found:
        pattern = f"task: {task}\n"
        found = [p for p in sorted(root.rglob("*.yaml")) if pattern in p.read_text(encoding="utf-8")]
    if not found:
        raise ValueError(f"lm-eval has no task YAML for '{task}'")
    return found[0]


def _local_yaml(text: str, data: Mapping[str, str]) -> str:
    """A task YAML's text with its dataset fields pointing at local JSON files (one per split)."""
    lines, skip = [], False
    for line in text.splitlines():
        key = line.split(":", 1)[0].strip() if ":" in line and not line.startswith((" ", "\t", "-")) else None
        if skip and (line.startswith((" ", "\t")) or not line.strip()):
            continue
        skip = False
        if key in _DATA_FIELDS:
            skip = key == "dataset_kwargs"
            continue
        lines.append(line)
    files = "".join(f"\n    {split}: {json.dumps(str(path))}" for split, path in data.items())
    return "dataset_path: json\ndataset_name: null\ndataset_kwargs:\n  data_files:" + files + "\n" + "\n".join(lines) + "\n"


def local_task(task: str, data: str | Path | Mapping[str, str | Path], directory: str | Path, *,
               name: str | None = None) -> Path:
    """Copy lm-eval's YAML of ``task`` into ``directory`` with its dataset pointing at local JSON files.

    Only the dataset fields change (``dataset_path: json``, ``dataset_name: null``, ``dataset_kwargs:
    {data_files: ...}``), so prompts, choices, filters and metrics are lm-eval's own. ``data``: one JSON /
    JSON-lines file used for every split the task names (``training_split``, ``validation_split``, ...), or
    ``{split: file}``; rows have the fields of the hub dataset (TruthfulQA MC: ``question``,
    ``mc1_targets: {choices, labels}``, ``mc2_targets``; NQ-Open: ``question``, ``answer: [...]``). ``name``
    renames the task (default: lm-eval's name, which a ``TaskManager`` given ``directory`` as
    ``include_path`` then loads instead of the hub version). YAMLs it ``include:``s and the Python helpers
    beside it (``!function utils.x``) are copied too. Returns the path of the task's YAML; pass
    ``directory`` as ``include_path``.
    """
    require_lm_eval()
    source = _task_yaml(task)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    text = source.read_text(encoding="utf-8")
    splits = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in _SPLITS and value.strip() not in ("", "null", "None"):
            splits[value.strip()] = None
    if isinstance(data, Mapping):
        files = {str(k): str(Path(v).resolve()) for k, v in data.items()}
    else:
        files = {split: str(Path(data).resolve()) for split in (splits or {"validation": None})}
    for py in source.parent.glob("*.py"):  # byte for byte: copies of lm-eval's own code are trusted as such
        if not (directory / py.name).exists():
            shutil.copyfile(py, directory / py.name)
    for line in text.splitlines():
        if line.startswith("include:"):
            included = line.split(":", 1)[1].strip().strip("'\"")
            target = directory / included
            if not target.exists():
                target.write_text(_local_yaml((source.parent / included).read_text(encoding="utf-8"), files),
                                  encoding="utf-8")
    out = _local_yaml(text, files)
    if name is not None:
        out = "\n".join(f"task: {name}" if line.startswith("task:") else line for line in out.splitlines()) + "\n"
        if "\ntask:" not in "\n" + out:
            out += f"task: {name}\n"
    path = directory / f"{name or task}.yaml"
    path.write_text(out, encoding="utf-8")
    return path


def task_manager(include_path: str | Path | Sequence[str | Path] | None = None, include_defaults: bool = True) -> Any:
    """lm-eval's ``TaskManager`` over its own tasks (``include_defaults``) and the task YAMLs under
    ``include_path`` (one or several directories)."""
    require_lm_eval()
    paths = None
    if include_path is not None:
        paths = [str(p) for p in include_path] if isinstance(include_path, (list, tuple)) else str(include_path)
    return TaskManager(include_path=paths, include_defaults=include_defaults)


MAX_FEWSHOT = 1024
"""Most few-shot examples an ``evaluate`` step may ask for (``num_fewshot``)."""

OUTPUT_TYPES = ("loglikelihood", "loglikelihood_rolling", "multiple_choice", "generate_until")
_NEEDS = {"generate_until": ("doc_to_text", "doc_to_target"), "loglikelihood": ("doc_to_text", "doc_to_target"),
          "multiple_choice": ("doc_to_text", "doc_to_target", "doc_to_choice"),
          "loglikelihood_rolling": ("doc_to_target",)}


class TaskConfigError(ValueError):
    """An ``evaluate`` step names an lm-eval task that does not exist or cannot run as configured. ``path`` is
    where in the step's config (``("tasks", 1)``, ``("num_fewshot",)``)."""

    def __init__(self, message: str, path: Sequence[Any] = ()) -> None:
        super().__init__(message)
        self.path = tuple(path)


@functools.lru_cache(maxsize=8)
def _task_index(include_path: tuple[str, ...], include_defaults: bool) -> dict[str, Any]:
    return dict(task_manager(list(include_path) or None, include_defaults).task_index)


@functools.lru_cache(maxsize=1)
def metric_output_types() -> dict[str, tuple[str, ...]]:
    """The output types each of lm-eval's own metrics is registered for (read from the ``output_type`` of its
    ``register_metric`` in lm-eval's source, which its registry does not keep), with ``multiple_choice`` added
    for the metrics lm-eval's ``ConfigurableTask.process_results`` computes from the choices itself."""

    spec = importlib.util.find_spec("lm_eval.api.metrics")
    if spec is None or spec.origin is None:
        return {}
    out: dict[str, tuple[str, ...]] = {}
    for node in ast.walk(ast.parse(Path(spec.origin).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "register_metric":
            kw = {k.arg: k.value for k in node.keywords}
            try:
                name = ast.literal_eval(kw["metric"])
                types = ast.literal_eval(kw["output_type"])
            except (KeyError, ValueError):
                continue
            out[str(name)] = (types,) if isinstance(types, str) else tuple(types)
    if not HAVE_LM_EVAL:  # pragma: no cover - exercised without the extra
        return out
    try:  # the metrics a multiple_choice task's own process_results computes from the choices' scores
        for name in re.findall(r"[\"'](\w+)[\"'] in use_metric", inspect.getsource(ConfigurableTask.process_results)):
            if "multiple_choice" not in out.get(name, ("multiple_choice",)):
                out[name] = (*out[name], "multiple_choice")
    except (OSError, TypeError):  # pragma: no cover - no source to read
        pass
    return out


def _own_aggregation(entry: Any) -> bool:
    """Whether a ``metric_list`` entry brings an aggregation that is not one of lm-eval's registered ones."""
    if not isinstance(entry, Mapping) or "aggregation" not in entry:
        return False
    return not (isinstance(entry["aggregation"], str) and entry["aggregation"] in aggregation_registry)


def _count_docs(cfg: Mapping[str, Any], split: str) -> tuple[int, str] | None:
    """Documents of ``split`` of a task whose data are local JSON files (``dataset_path: json``), and the file."""
    if cfg.get("dataset_path") != "json":
        return None
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    names = files.get(split) if isinstance(files, Mapping) else files if split == "train" else None
    names = [names] if isinstance(names, str) else names
    if not isinstance(names, list) or not names:
        return None
    total = 0
    for name in names:
        path = Path(str(name)).expanduser()
        if not path.is_file():
            return None
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.lstrip().startswith("["):
            try:
                total += len(json.loads(text))
            except ValueError:
                return None
        else:
            total += sum(1 for line in text.splitlines() if line.strip())
    return total, str(names[0])


def _check_config(cfg: Mapping[str, Any], label: str, at: tuple[Any, ...], num_fewshot: int | None,
                  from_spec: bool) -> None:
    output_type = cfg.get("output_type", "generate_until")
    if output_type not in OUTPUT_TYPES:
        raise TaskConfigError(f"lm-eval task {label}: output_type {output_type!r} is not one of "
                              f"{', '.join(OUTPUT_TYPES)}", at)
    if from_spec and "class" not in cfg:
        lacking = [f for f in _NEEDS[output_type] if cfg.get(f) is None]
        if lacking:
            raise TaskConfigError(f"lm-eval task {label}: a {output_type} task needs {', '.join(lacking)} "
                                  f"(each document's prompt, answer and choices); add "
                                  f"{'it' if len(lacking) == 1 else 'them'} to the task", at)
    known = metric_output_types() if cfg.get("process_results") is None else {}  # else the task scores itself
    for j, entry in enumerate(cfg.get("metric_list") or []):
        metric = entry.get("metric") if isinstance(entry, Mapping) else None
        if _own_aggregation(entry) or (isinstance(entry, Mapping) and entry.get("hf_evaluate")):
            continue  # the task aggregates this metric its own way, or it is HF evaluate's metric of that name
        if isinstance(metric, str) and metric in known and output_type not in known[metric]:
            raise TaskConfigError(f"lm-eval task {label}: metric_list[{j}]: metric {metric!r} scores "
                                  f"{' or '.join(known[metric])} tasks, and this task's output_type is "
                                  f"{output_type}; use a metric of {output_type} tasks or change output_type", at)
    shots = num_fewshot if num_fewshot is not None else cfg.get("num_fewshot")
    if isinstance(shots, int) and shots > 0:
        fewshot = cfg.get("fewshot_split") or cfg.get("training_split") or cfg.get("validation_split") or \
            cfg.get("test_split")
        evaluated = cfg.get("test_split") or cfg.get("validation_split")
        counted = _count_docs(cfg, str(fewshot)) if fewshot else None
        if counted is not None:
            n, name = counted
            usable = n - 1 if fewshot == evaluated else n  # the evaluated document is never its own shot
            if shots > usable:
                where = ("num_fewshot",) if num_fewshot is not None else at
                raise TaskConfigError(f"lm-eval task {label}: num_fewshot {shots} is more than the {usable} "
                                      f"document(s) its few-shot split '{fewshot}' ({name}) can give"
                                      f"{' (the evaluated one aside)' if fewshot == evaluated else ''}; ask for "
                                      f"at most {usable}", where)


def check_task_configs(tasks: Sequence[str | Mapping[str, Any]], *,
                       include_path: str | Path | Sequence[str | Path] | None = None, include_defaults: bool = True,
                       num_fewshot: int | None = None) -> None:
    """Check what an ``evaluate`` step asks of lm-eval before anything runs: every task name is a task, group or
    tag of lm-eval's registry (``include_defaults``) or of ``include_path``; every task's ``output_type`` is
    lm-eval's, the fields its output type needs (``doc_to_text``, ``doc_to_target``, ``doc_to_choice``) are
    there (tasks from the spec: inline mappings, task files, ``include_path``), its metrics score that output
    type, and ``num_fewshot`` is at most :data:`MAX_FEWSHOT` and, where the data are local JSON files, the
    documents of the few-shot split. Raises :class:`TaskConfigError` naming the task and where. The index of
    tasks is built once per process for each ``(include_path, include_defaults)``."""
    require_lm_eval()
    if num_fewshot is not None and num_fewshot > MAX_FEWSHOT:
        raise TaskConfigError(f"num_fewshot {num_fewshot:,} is more than {MAX_FEWSHOT:,} few-shot examples",
                              ("num_fewshot",))
    paths = () if include_path is None else (str(include_path),) if isinstance(include_path, (str, Path)) \
        else tuple(str(p) for p in include_path)
    index = _task_index(paths, include_defaults)
    own = {str(Path(p).expanduser().resolve()) for p in paths}
    for i, task in enumerate(tasks):
        at: tuple[Any, ...] = ("tasks", i)
        if isinstance(task, Mapping):
            _check_config(task, repr(str(task.get("task", "?"))), at, num_fewshot, True)
            continue
        path = Path(task).expanduser()
        if task.endswith((".yaml", ".yml")) and path.is_file():
            _check_config(load_yaml(path, resolve_func=False), f"{task!r}", at, num_fewshot, True)
            continue
        entry = index.get(task)
        if entry is None:

            close = difflib.get_close_matches(task, list(index), n=3, cutoff=0.75)
            where = " and ".join(filter(None, ["lm-eval's registry" if include_defaults else "",
                                               f"include_path {', '.join(paths)}" if paths else ""])) or "nowhere"
            hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
            raise TaskConfigError(f"unknown lm-eval task {task!r}: not a task, group or tag of {where}{hint}", at)
        if getattr(entry, "yaml_path", None) is not None and getattr(getattr(entry, "kind", None), "name", "") == \
                "TASK":
            yaml_path = Path(entry.yaml_path)
            from_spec = any(yaml_path.resolve().is_relative_to(p) for p in own)
            _check_config(load_yaml(yaml_path, resolve_func=False), repr(task), at, num_fewshot, from_spec)
