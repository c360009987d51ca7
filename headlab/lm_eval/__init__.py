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
  importing this package registers ``headlab`` in lm-eval's model registry, so
  ``simple_evaluate(model="headlab", model_args=...)`` works too.

Needs the ``eval`` extra: ``pip install 'headlab[eval]'``.

The package is ``headlab.lm_eval``, a top-level module of headlab beside ``headlab.task_code`` (the checks
of task files it shares with spec validation), not under an ``integrations`` namespace: it is headlab's
one integration with another tool's command line and registry, and a namespace for one member would be
one more level to find it under. ``headlab.harness``, its name before, stays as an alias, and is the name
the docs import (``from headlab import harness`` does not shadow lm-eval's own ``lm_eval`` in a user's
code, as ``from headlab import lm_eval`` would). The modules, one
concern each, in dependency order: ``adapter`` (:class:`HeadlabLM`), ``results`` (lm-eval's results as a
Dataset), ``tasks`` (task loading and the checks of an ``evaluate`` step's tasks), ``evaluation`` (the
sandbox bridge: :func:`evaluate`), ``cache`` (where datasets are cached during a run) and ``cli``
(``headlab eval`` and the registration in lm-eval's model registry).
"""

from __future__ import annotations

from ..task_code import EXTRA
from .adapter import HAVE_LM_EVAL, HeadlabLM, require_lm_eval
from .cache import CACHE_ENV, cache_directory, datasets_cache
from .cli import main
from .evaluation import evaluate
from .results import results_dataset
from .tasks import (
    MAX_FEWSHOT,
    OUTPUT_TYPES,
    TaskConfigError,
    check_task_configs,
    local_task,
    metric_output_types,
    task_manager,
)

__all__ = ["CACHE_ENV", "EXTRA", "HAVE_LM_EVAL", "MAX_FEWSHOT", "OUTPUT_TYPES", "HeadlabLM", "TaskConfigError",
           "cache_directory", "check_task_configs", "datasets_cache", "evaluate", "local_task", "main",
           "metric_output_types", "require_lm_eval", "results_dataset", "task_manager"]
