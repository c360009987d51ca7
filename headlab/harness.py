"""The lm-evaluation-harness bridge under its former name: an alias of :mod:`headlab.lm_eval`, whose public
names it re-exports (the same objects), so that code written against ``headlab.harness`` keeps working."""

from __future__ import annotations

from .lm_eval import (
    CACHE_ENV,
    EXTRA,
    HAVE_LM_EVAL,
    MAX_FEWSHOT,
    OUTPUT_TYPES,
    HeadlabLM,
    TaskConfigError,
    cache_directory,
    check_task_configs,
    datasets_cache,
    evaluate,
    local_task,
    main,
    metric_output_types,
    require_lm_eval,
    results_dataset,
    task_manager,
)

__all__ = ["CACHE_ENV", "EXTRA", "HAVE_LM_EVAL", "MAX_FEWSHOT", "OUTPUT_TYPES", "HeadlabLM", "TaskConfigError",
           "cache_directory", "check_task_configs", "datasets_cache", "evaluate", "local_task", "main",
           "metric_output_types", "require_lm_eval", "results_dataset", "task_manager"]
