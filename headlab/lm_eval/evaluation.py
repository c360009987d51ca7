"""The sandbox bridge: :func:`evaluate` runs lm-eval's ``simple_evaluate`` on a :class:`HeadlabLM`, task
definitions from outside lm-eval checked and their templates rendered in headlab's sandbox."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from ..context import StepContext
from ..task_code import check_tasks, sandboxed_templates
from .adapter import DEFAULT_MAX_GEN_TOKS, HAVE_LM_EVAL, HeadlabLM, require_lm_eval
from .results import results_dataset
from .tasks import task_manager

if HAVE_LM_EVAL:
    from lm_eval import simple_evaluate

__all__ = ["evaluate"]


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
