"""lm-evaluation-harness tasks under headlab's steering methods and decoding strategies.

:class:`HeadlabLM` is an lm-eval model (``lm_eval.api.model.LM``) backed by headlab: ``loglikelihood``
and ``loglikelihood_rolling`` run through :func:`headlab.logprobs` (the decoder's scorer: greedy = the
model's log-likelihood, DoLa, DeCoRe, CD, CAD), ``generate_until`` through :func:`headlab.generate`
(headlab's KV-cache loop), with the steering methods' edits applied in the same forwards. ``<em>...</em>``
markers in the context a task produces are removed before tokenisation and become the examples'
``emphasis`` spans, so PASTA steers any task whose template marks the emphasis.

Three ways in (docs/evaluation.md):

- ``headlab eval --tasks truthfulqa_mc2 --model_args spec=steer.yaml`` is lm-eval's own command line with
  this model registered as ``headlab`` (lm-eval 0.4 finds models only in its own table, so the plain
  ``lm_eval`` command cannot reach a model of an installed package);
- an ``evaluate`` step in a spec (``headlab.plugins.actions.evaluate``), results stored in the run;
- Python: :func:`evaluate` (an xarray Dataset), or ``lm_eval.simple_evaluate(model=HeadlabLM(...))``;
  importing this module registers ``headlab`` in lm-eval's model registry, so
  ``simple_evaluate(model="headlab", model_args=...)`` works too.

Needs the ``eval`` extra: ``pip install 'headlab[eval]'``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from .context import Example, StepContext, strip_tags
from .model import LoadedModel
from .scoring import as_model, component, generate, logprobs
from .task_code import check_tasks, sandboxed_templates

EXTRA = "lm-eval is not installed; install the eval extra: pip install 'headlab[eval]'"

try:  # the base class; without lm-eval the module imports, and using it says which extra to install
    from lm_eval.api.model import LM as _Base

    HAVE_LM_EVAL = True
except ImportError:  # pragma: no cover - exercised without the extra
    _Base = object  # type: ignore[assignment,misc]
    HAVE_LM_EVAL = False

__all__ = ["CACHE_ENV", "EXTRA", "HAVE_LM_EVAL", "MAX_FEWSHOT", "OUTPUT_TYPES", "HeadlabLM", "TaskConfigError",
           "cache_directory", "check_task_configs", "datasets_cache", "evaluate", "local_task", "main",
           "metric_output_types", "require_lm_eval", "results_dataset", "task_manager"]

log = logging.getLogger(__name__)
EMPHASIS = {"emphasis": "em"}
DEFAULT_MAX_GEN_TOKS = 256


def require_lm_eval() -> None:
    """Raise ``ImportError`` naming the ``eval`` extra when lm-eval is not installed."""
    if not HAVE_LM_EVAL:
        raise ImportError(EXTRA)


def _config_value(value: Any) -> Any:
    """A decode/steer value given as text (lm-eval's ``key=value`` model args): YAML/JSON, or a kind name."""
    if isinstance(value, str):
        from ruamel.yaml import YAML

        loaded = YAML(typ="safe", pure=True).load(value)
        return loaded if loaded is not None else None
    return value


def _batch_size(value: Any) -> int:
    if value is None or (isinstance(value, str) and value.startswith("auto")):
        return 8
    return max(1, int(value))


class HeadlabLM(_Base):  # type: ignore[misc,valid-type]
    """An lm-evaluation-harness model running headlab: its model loading, steering and decoding strategies.

    Arguments (all optional; lm-eval passes ``--model_args`` as keywords):

    - ``model`` (or ``pretrained``): a :class:`~headlab.model.LoadedModel`, a registered name
      (``headlab-tiny``, the default), a checkpoint directory, a hub id, or a model-spec mapping.
    - ``decode``: a decoder config (``{kind: dola, layers: high}``, or the kind's name); default greedy.
      ``steer``: a list of steering configs (``[{kind: pasta, heads: ..., missing: skip}]``). Text values are
      read as YAML, so ``--model_args decode=dola`` works; pass mappings as a JSON ``--model_args`` object.
    - ``spec``: a headlab spec file: its model, and the ``decode``/``steer`` of its ``evaluate`` step
      (``step`` names one; default the first). The steps before that one (detectors) run first, on the
      first sweep cell, so ``heads: {from: <step>}`` resolves. ``run``: a stored run whose results resolve
      ``heads: {from: ...}`` instead. ``results`` (Python): step id -> dataset, for the same purpose.
    - ``batch_size`` (``auto`` = 8), ``max_gen_toks`` (256), ``max_length`` (the model's context length),
      ``seed``, ``device`` (a CUDA device is ignored where there is none: lm-eval's command line passes
      ``cuda`` by default), ``dtype``; ``emphasis_tag`` (``em``; ``none`` disables marker removal).

    ``loglikelihood`` returns ``(logprob, is_greedy)`` as lm-eval's ``hf`` model does: the continuation's
    tokens are those of ``context + continuation`` after the context's own (a context's trailing spaces move
    to the continuation), an empty context is the BOS (else EOS) token, and ``is_greedy`` says whether every
    continuation token is the top-scoring token of the strategy (the model's argmax under greedy).
    ``generate_until`` decodes with the configured strategy; a task's ``do_sample: true`` switches the
    default (greedy) decoder to ``sample`` with the task's ``temperature``/``top_k``/``top_p``; an explicit
    ``decode`` always wins.
    """

    def __init__(self, model: Any = None, *, pretrained: Any = None, spec: str | None = None, step: str | None = None,
                 run: str | None = None, decode: Any = None, steer: Any = None, batch_size: Any = 8,
                 max_batch_size: Any = None, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, max_length: int | None = None,
                 seed: int = 0, device: str | None = None, dtype: str | None = None,
                 results: Mapping[str, Any] | None = None, ctx: StepContext | None = None,
                 emphasis_tag: str | None = "em", **unused: Any) -> None:
        require_lm_eval()
        super().__init__()
        if unused:
            log.warning("headlab model: ignoring model_args %s", sorted(unused))
        self.results: dict[str, Any] = dict(results or {})
        model = model if model is not None else pretrained
        decode, steer = _config_value(decode), _config_value(steer)
        if spec is not None:
            spec_model, spec_decode, spec_steer, spec_results = _from_spec(spec, step, seed)
            model = model if model is not None else spec_model
            decode = decode if decode is not None else spec_decode
            steer = steer if steer is not None else spec_steer
            self.results = {**spec_results, **self.results}
        if run is not None:
            from .results import open_run

            self.results = {**open_run(run).results, **self.results}
        if ctx is not None and model is None:
            model = ctx.model
        if not isinstance(model, LoadedModel):
            model = _model_spec(model, device, dtype)
        self.lm: LoadedModel = as_model(model, seed)
        self.explicit_decode = decode is not None
        self.decode = component("decoders", decode)
        if isinstance(steer, Mapping):
            steer = [steer]
        self.steer = [component("steering", s) for s in (steer or [])]
        self.batch_size_ = _batch_size(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self.max_length = int(max_length) if max_length else _max_length(self.lm)
        self.seed = int(seed)
        self.ctx = ctx
        self.tags = {} if emphasis_tag in (None, "", "none", False) else {"emphasis": str(emphasis_tag)}
        self._device = self.lm.device

    # ------------------------------------------------------------------ lm-eval's interface
    @property
    def tokenizer_name(self) -> str:
        return self.lm.name.replace("/", "__")

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context is replaced with: BOS, else EOS (as lm-eval's ``hf`` model)."""
        tok = self.lm.tokenizer
        for value in (getattr(tok, "bos_token_id", None), getattr(tok, "eos_token_id", None)):
            if value is not None:
                return int(value)
        return int(self.lm.pad_id)

    def get_model_info(self) -> dict[str, Any]:
        """Recorded in lm-eval's results ``config``."""
        return {"model_name": self.lm.name, "model_digest": self.lm.digest or "",
                "decode": self.decode.model_dump(mode="json"),
                "steer": [s.model_dump(mode="json") for s in self.steer]}

    def example(self, context: str) -> Example:
        """The context as an :class:`~headlab.Example`: emphasis markers removed and recorded as spans."""
        if not self.tags:
            return Example(prompt=context)
        try:
            text, spans = strip_tags(context, self.tags)
        except ValueError as e:
            log.warning("headlab model: unbalanced emphasis markers left as text (%s)", e)
            return Example(prompt=context)
        return Example(prompt=text, spans=spans)

    def _pairs(self, requests: Sequence[tuple[str, str]]) -> tuple[list[Example], list[Any]]:
        tok = self.lm.tokenizer
        prompts: list[Example] = []
        conts: list[Any] = []
        for context, continuation in requests:
            if context == "":
                ids = tok(continuation, add_special_tokens=False)["input_ids"]
                if ids and ids[0] == self.prefix_token_id:
                    prompts.append(Example(prompt="", input_ids=ids[:1]))
                    conts.append(list(ids[1:]))
                else:
                    prompts.append(Example(prompt="", input_ids=[self.prefix_token_id]))
                    conts.append(list(ids))
                continue
            ex = self.example(context)
            text = ex.prompt
            n_spaces = len(text) - len(text.rstrip())
            if n_spaces:
                continuation = text[-n_spaces:] + continuation
                text = text[:-n_spaces]
                spans = {k: [(s, min(e, len(text))) for s, e in v if s < len(text)] for k, v in ex.spans.items()}
                ex = Example(prompt=text, spans={k: v for k, v in spans.items() if v})
            prompts.append(ex)
            conts.append(continuation)
        return prompts, conts

    def _score(self, prompts: list[Example], conts: list[Any]) -> Any:
        return logprobs(self.lm, prompts, conts, steer=self.steer, decode=self.decode,
                        batch_size=self.batch_size_, seed=self.seed, results=self.results, ctx=self._step_ctx())

    def _step_ctx(self) -> StepContext | None:
        if self.ctx is None:
            return None
        return StepContext(model=self.lm, examples=[], results={**self.ctx.results, **self.results},
                           seed=self.ctx.seed, step_id=self.ctx.step_id, reporter=self.ctx.reporter,
                           cancel=self.ctx.cancel, store=self.ctx.store)

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), is_greedy)`` per request, under the decoder's scorer."""
        if not requests:
            return []
        args = [tuple(r.args) for r in requests]
        prompts, conts = self._pairs(args)
        scored = self._score(prompts, conts)
        out = [(float(lp), bool(g)) for lp, g in zip(scored.logprobs, scored.greedy, strict=True)]
        for a, answer in zip(args, out, strict=True):
            self.cache_hook.add_partial("loglikelihood", a, answer)
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text (perplexity tasks), in disjoint windows of ``max_length``
        tokens as lm-eval's ``hf`` model computes it (the first token predicted from the prefix token)."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        tok = self.lm.tokenizer
        prompts: list[Example] = []
        conts: list[list[int]] = []
        owner: list[int] = []
        for i, req in enumerate(requests):
            (text,) = req.args
            ids = tok(text)["input_ids"]
            for context, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=ids, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1)):
                prompts.append(Example(prompt="", input_ids=list(context)))
                conts.append(list(cont))
                owner.append(i)
        totals = [0.0] * len(requests)
        if prompts:
            scored = self._score(prompts, conts)
            for i, lp in zip(owner, scored.logprobs, strict=True):
                totals[i] += float(lp)
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", tuple(req.args), total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Generate for each context until a stop string (the task's ``until`` and EOS) or ``max_gen_toks``."""
        from lm_eval.models.utils import (
            handle_stop_sequences,
            normalize_gen_kwargs,
            postprocess_generated_text,
        )

        if not requests:
            return []
        tok = self.lm.tokenizer
        eos = tok.decode(int(tok.eos_token_id), skip_special_tokens=False) if tok.eos_token_id is not None else None
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        out = [""] * len(requests)
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[indices[0]].args[1]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = int(kwargs.pop("max_gen_toks"))
            decode = self.decode
            if kwargs.get("do_sample") and not self.explicit_decode:
                opts = {k: kwargs[k] for k in ("temperature", "top_k", "top_p") if kwargs.get(k) is not None}
                decode = component("decoders", {"kind": "sample", **opts})
            prompts = [self.example(requests[i].args[0]) for i in indices]
            decoded = generate(self.lm, prompts, steer=self.steer, decode=decode, max_new_tokens=max_new,
                               stop=until, batch_size=self.batch_size_, seed=self.seed, results=self.results,
                               ctx=self._step_ctx())
            for i, text in zip(indices, decoded.texts, strict=True):
                out[i] = postprocess_generated_text(text, until, None)
                self.cache_hook.add_partial("generate_until", tuple(requests[i].args), out[i])
        return out


def _max_length(lm: LoadedModel) -> int:
    cfg = lm.model.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(cfg, attr, None)
        if value:
            return int(value)
    value = getattr(lm.tokenizer, "model_max_length", None)
    return int(value) if value and value < 10**9 else 2048


def _model_spec(model: Any, device: str | None, dtype: str | None) -> Any:
    """A model spec mapping from a name/path/mapping plus lm-eval's ``device``/``dtype`` arguments."""
    if model is None:
        from .spec import ModelSpec

        model = ModelSpec().id
    spec: dict[str, Any] = dict(model) if isinstance(model, Mapping) else {"id": str(model)}
    if hasattr(model, "model_dump"):
        spec = model.model_dump()
    if device and not (device.startswith("cuda") and not _cuda()):  # lm-eval's CLI defaults to cuda
        spec["device"] = device
    if dtype:
        spec["dtype"] = dtype
    return spec


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _from_spec(path: str, step: str | None, seed: int) -> tuple[Any, Any, Any, dict[str, Any]]:
    """(model spec, decode, steer, results of the steps before the evaluate step) of a headlab spec."""
    from .runner import ModelCache, run_cell
    from .spec import load_spec

    loaded = load_spec(path)
    steps = loaded.spec.steps
    names = [s.id for s in steps]
    if step is not None and step not in names:
        raise ValueError(f"spec {path}: no step '{step}' (steps: {', '.join(names)})")
    index = names.index(step) if step is not None else next(
        (i for i, s in enumerate(steps) if s.action == "evaluate"), len(steps))
    decode = steer = None
    if index < len(steps):
        config = getattr(steps[index], steps[index].action)
        decode, steer = getattr(config, "decode", None), getattr(config, "steer", None)
    results: dict[str, Any] = {}
    if index > 0:
        data = dict(loaded.data)
        data["steps"] = list(data["steps"])[:index]
        data.pop("sweep", None)
        before = load_spec(data)
        results = run_cell(before, before.cells[0], ModelCache(before.spec.seed))
    return loaded.spec.model, decode, steer, results


# --------------------------------------------------------------------------- results as a Dataset
def _metric_keys(results: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(metric, filter)`` pairs of lm-eval's per-task results, stderr excluded, in first-seen order."""
    keys: list[tuple[str, str]] = []
    for row in results.values():
        for key in row:
            if "," not in key or "_stderr," in key:
                continue
            metric, filt = key.split(",", 1)
            if (metric, filt) not in keys:
                keys.append((metric, filt))
    return keys


def _names(keys: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """Variable names: the metric's name, or ``metric_filter`` when a metric comes with several filters."""
    count: dict[str, int] = {}
    for metric, _ in keys:
        count[metric] = count.get(metric, 0) + 1
    return {(m, f): (m if count[m] == 1 else f"{m}_{f}") for m, f in keys}


def _float(value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return math.nan
    return out


def results_dataset(results: Mapping[str, Any]) -> xr.Dataset:
    """lm-eval's results (``simple_evaluate(..., log_samples=True)``) as one xarray Dataset.

    - over ``task`` (the tasks and groups lm-eval reports): one variable per metric (``acc``,
      ``exact_match``; ``<metric>_<filter>`` when a metric comes with several filters), its standard error
      ``<name>_stderr``, and ``n_samples``;
    - over ``example`` (one per logged sample and filter; coordinates ``sample_task``, ``doc_id``,
      ``filter``): ``prompt`` (the context the task produced, markers included), ``target``, ``output`` (the
      filtered generation; ``raw_output`` before the filters), ``logprob``, ``is_greedy`` and
      ``choice_text`` over ``(example, choice)`` for log-likelihood requests, and the sample's metric values
      ``sample_<name>`` (NaN where a sample's task has no such metric).

    ``attrs``: ``metrics`` (the per-task metric names), ``filters`` (name -> lm-eval filter), ``higher_is_better``,
    ``lm_eval_version``, ``task_versions``, ``n_shot``.
    """
    per_task = dict(results.get("results", {}))
    tasks = list(per_task)
    keys = _metric_keys(per_task)
    names = _names(keys)
    data: dict[str, Any] = {}
    for key, name in names.items():
        metric, filt = key
        data[name] = ("task", np.array([_float(per_task[t].get(f"{metric},{filt}")) for t in tasks]))
        data[f"{name}_stderr"] = ("task", np.array([_float(per_task[t].get(f"{metric}_stderr,{filt}"))
                                                    for t in tasks]))
    n_samples = results.get("n-samples", {})
    data["n_samples"] = ("task", np.array([int(n_samples.get(t, {}).get("effective", -1)) for t in tasks],
                                          dtype=np.int64))
    samples = [(t, s) for t, rows in results.get("samples", {}).items() for s in rows]
    width = max((len(s.get("arguments", [])) for _, s in samples if _is_loglik(s)), default=0)
    n = len(samples)
    prompt = np.full(n, "", dtype=object)
    target = np.full(n, "", dtype=object)
    output = np.full(n, "", dtype=object)
    raw = np.full(n, "", dtype=object)
    lp = np.full((n, width), np.nan)
    greedy = np.zeros((n, width), dtype=bool)
    choice = np.full((n, width), "", dtype=object)
    values = {name: np.full(n, np.nan) for name in names.values()}
    for i, (_, s) in enumerate(samples):
        args = s.get("arguments", [])
        prompt[i] = str(args[0][0]) if args else ""
        target[i] = s["target"] if isinstance(s.get("target"), str) else json.dumps(s.get("target"), default=str)
        if _is_loglik(s):
            for j, (arg, resp) in enumerate(zip(args, s.get("filtered_resps", []), strict=False)):
                choice[i, j] = str(arg[1])
                lp[i, j] = _float(resp[0])
                greedy[i, j] = bool(resp[1])
        else:
            filtered = s.get("filtered_resps", [])
            output[i] = _text(filtered[0]) if filtered else ""
            resps = s.get("resps", [])
            raw[i] = _text(resps[0][0] if resps and isinstance(resps[0], list) and resps[0] else resps[0]) \
                if resps else ""
        filt = s.get("filter", "none")
        for metric in s.get("metrics", []):
            name = names.get((metric, filt))
            if name is not None and metric in s:
                values[name][i] = _float(s[metric])
    data.update({
        "prompt": ("example", prompt), "target": ("example", target), "output": ("example", output),
        "raw_output": ("example", raw), "logprob": (("example", "choice"), lp),
        "is_greedy": (("example", "choice"), greedy), "choice_text": (("example", "choice"), choice),
        **{f"sample_{name}": ("example", v) for name, v in values.items()},
    })
    ds = xr.Dataset(data, coords={
        "task": np.array(tasks, dtype=object), "example": np.arange(n), "choice": np.arange(width),
        "sample_task": ("example", np.array([t for t, _ in samples], dtype=object)),
        "doc_id": ("example", np.array([int(s.get("doc_id", -1)) for _, s in samples], dtype=np.int64)),
        "filter": ("example", np.array([str(s.get("filter", "none")) for _, s in samples], dtype=object)),
    })
    higher = results.get("higher_is_better", {})
    better = {}
    for (metric, _), name in names.items():
        for t in tasks:
            if metric in higher.get(t, {}):
                better[name] = higher[t][metric]
                break
    try:
        import lm_eval

        version = lm_eval.__version__
    except ImportError:  # pragma: no cover
        version = ""
    ds.attrs.update(metrics=list(names.values()), filters={n: f for (_, f), n in names.items()},
                    higher_is_better=better, lm_eval_version=version,
                    task_versions={t: str(v) for t, v in results.get("versions", {}).items()},
                    n_shot={t: _float(v) for t, v in results.get("n-shot", {}).items()})
    return ds


def _is_loglik(sample: Mapping[str, Any]) -> bool:
    args = sample.get("arguments") or []
    resps = sample.get("filtered_resps") or []
    return bool(args) and len(args[0]) == 2 and isinstance(args[0][1], str) and bool(resps) and \
        isinstance(resps[0], (tuple, list)) and len(resps[0]) == 2 and not isinstance(resps[0][0], str)


def _text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return _text(value[0]) if value else ""
    return str(value)


# --------------------------------------------------------------------------- local copies of lm-eval tasks
_DATA_FIELDS = ("dataset_path", "dataset_name", "dataset_kwargs")
_SPLITS = ("training_split", "validation_split", "test_split", "fewshot_split")


def _task_yaml(task: str) -> Path:
    import lm_eval

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


# --------------------------------------------------------------------------- running lm-eval
def task_manager(include_path: str | Path | Sequence[str | Path] | None = None, include_defaults: bool = True) -> Any:
    """lm-eval's ``TaskManager`` over its own tasks (``include_defaults``) and the task YAMLs under
    ``include_path`` (one or several directories)."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    paths = None
    if include_path is not None:
        paths = [str(p) for p in include_path] if isinstance(include_path, (list, tuple)) else str(include_path)
    return TaskManager(include_path=paths, include_defaults=include_defaults)


def evaluate(model: Any, tasks: Sequence[str | Mapping[str, Any]], *, decode: Any = None, steer: Sequence[Any] = (),
             limit: int | float | None = None, num_fewshot: int | None = None,
             include_path: str | Path | Sequence[str | Path] | None = None, include_defaults: bool = True,
             batch_size: int = 8, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, gen_kwargs: Mapping[str, Any] | None = None,
             seed: int = 0, results: Mapping[str, Any] | None = None, ctx: StepContext | None = None,
             bootstrap_iters: int = 1000, raw: bool = False, trust_task_code: bool = False) -> Any:
    """Run lm-eval ``tasks`` on ``model`` under a decoding strategy and steering methods.

    ``model``, ``decode``, ``steer``, ``results`` and ``seed`` as :func:`headlab.logprobs`; ``tasks`` are lm-eval
    task names (or task config mappings); ``limit``, ``num_fewshot``, ``gen_kwargs`` and ``bootstrap_iters`` as
    lm-eval's ``simple_evaluate``; ``include_path`` adds task YAMLs (``include_defaults: false`` skips indexing
    lm-eval's own ~10k task files, faster when every task is local).

    Task definitions that are not lm-eval's own (inline mappings, ``include_path`` YAMLs, task files) are
    checked by :func:`headlab.task_code.check_tasks` and their templates rendered in headlab's sandbox, unless
    ``trust_task_code`` (docs/evaluation.md, "Task code"); a refused definition raises
    :class:`headlab.task_code.TaskCodeError`.

    Returns :func:`results_dataset` of lm-eval's results (per-task metrics over ``task``, per-sample
    records over ``example``), or lm-eval's own results dict with ``raw=True``.
    """
    require_lm_eval()
    from lm_eval import simple_evaluate

    sources = check_tasks(list(tasks), include_path, trust=trust_task_code)
    lm = HeadlabLM(model if model is not None else (ctx.model if ctx is not None else None), decode=decode,
                   steer=list(steer) or None, batch_size=batch_size, max_gen_toks=max_gen_toks, seed=seed,
                   results=results, ctx=ctx)
    sandboxed = sources.untrusted and not trust_task_code
    with sandboxed_templates() if sandboxed else nullcontext():
        out = simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                              task_manager=task_manager(include_path, include_defaults), log_samples=True,
                              gen_kwargs=dict(gen_kwargs) if gen_kwargs else None, bootstrap_iters=bootstrap_iters,
                              random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                              fewshot_random_seed=seed)
    if out is None:  # pragma: no cover - other ranks of a distributed run
        raise RuntimeError("lm-eval returned no results")
    if raw:
        return out
    ds = results_dataset(out)
    ds.attrs["task_code"] = "trusted" if trust_task_code else "sandboxed" if sandboxed else "lm-eval registry"
    ds.attrs["task_files"] = sources.files
    return ds


# --------------------------------------------------------------------------- checking tasks before a run
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
    import ast
    import importlib.util

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
    try:  # the metrics a multiple_choice task's own process_results computes from the choices' scores
        import inspect
        import re

        from lm_eval.api.task import ConfigurableTask

        for name in re.findall(r"[\"'](\w+)[\"'] in use_metric", inspect.getsource(ConfigurableTask.process_results)):
            if "multiple_choice" not in out.get(name, ("multiple_choice",)):
                out[name] = (*out[name], "multiple_choice")
    except (ImportError, OSError, TypeError):  # pragma: no cover - no source to read
        pass
    return out


def _own_aggregation(entry: Any) -> bool:
    """Whether a ``metric_list`` entry brings an aggregation that is not one of lm-eval's registered ones."""
    if not isinstance(entry, Mapping) or "aggregation" not in entry:
        return False
    from lm_eval.api.registry import aggregation_registry

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
    from lm_eval.tasks._yaml_loader import load_yaml

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
            import difflib

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


CACHE_ENV = ("HF_DATASETS_CACHE", "HF_HOME", "XDG_CACHE_HOME")
"""Environment variables that name the ``datasets`` cache; when one is set, :func:`datasets_cache` leaves it."""


def cache_directory(store: str | Path) -> Path | None:
    """Where the ``evaluate`` steps of a run store cache datasets: ``.cache`` in the directory holding the store
    (the run's ``--out``), shared by its runs; None for a store that is not a local directory (a URL)."""
    from .results import is_url, store_location

    location = store_location(store) if str(store) else ""
    if not location or is_url(location):
        return None
    return Path(location).parent / ".cache"


@contextmanager
def datasets_cache(directory: str | Path | None) -> Iterator[Path | None]:
    """While the block runs, the ``datasets`` library keeps what it prepares, downloads and extracts under
    ``directory/datasets`` (yielded) instead of ``~/.cache/huggingface/datasets``. Nothing changes (None is
    yielded) when ``directory`` is None or the environment names a cache (:data:`CACHE_ENV`)."""
    if directory is None or any(os.environ.get(name) for name in CACHE_ENV):
        yield None
        return
    try:
        import datasets.config as config
    except ImportError:  # pragma: no cover - lm-eval requires datasets
        yield None
        return
    root = Path(directory).expanduser() / "datasets"
    paths = {"HF_DATASETS_CACHE": root, "DOWNLOADED_DATASETS_PATH": root / "downloads",
             "EXTRACTED_DATASETS_PATH": root / "downloads" / "extracted"}
    saved = {name: getattr(config, name) for name in paths}
    for name, path in paths.items():
        setattr(config, name, path)
    os.environ["HF_DATASETS_CACHE"] = str(root)  # for anything that reads the variable itself
    try:
        yield root
    finally:
        for name, value in saved.items():
            setattr(config, name, value)
        os.environ.pop("HF_DATASETS_CACHE", None)


def main(argv: Sequence[str] | None = None) -> None:
    """``headlab eval ARGS``: lm-eval's command line (``lm-eval run``) with ``--model headlab`` by default."""
    require_lm_eval()
    from lm_eval.__main__ import cli_evaluate

    args = list(sys.argv[1:] if argv is None else argv)
    commands = ("run", "ls", "validate")
    if not args or args[0] not in commands:
        args = ["run", *args]
    if args[0] == "run" and not any(a in ("--model", "-M") or a.startswith("--model=") for a in args):
        args[1:1] = ["--model", "headlab"]
    saved = sys.argv
    sys.argv = ["headlab eval", *args]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved


def _register() -> None:
    """Register :class:`HeadlabLM` as ``headlab`` in lm-eval's model registry (after lm-eval's own models)."""
    import lm_eval.models  # noqa: F401  (lm-eval registers its models lazily on first lookup of an empty registry)
    from lm_eval.api.registry import model_registry

    if model_registry.get("headlab", None) is not HeadlabLM:
        try:
            model_registry.register("headlab")(HeadlabLM)
        except ValueError as e:  # another class took the name (a reloaded module)
            log.warning("lm-eval model 'headlab' not registered: %s", e)


if HAVE_LM_EVAL:
    _register()
