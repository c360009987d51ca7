"""The ``evaluate`` action: lm-evaluation-harness tasks under the step's decoding strategy and steering.

```yaml
- id: eval
  evaluate:
    tasks: [truthfulqa_mc2, nq_open]
    limit: 100
    num_fewshot: 0
    decode: {kind: decore, heads: {from: retrieval, top: 8}}
    steer: [{kind: pasta, heads: {from: retrieval, top: 4}, missing: skip}]
    include_path: my_tasks/          # task YAMLs beside lm-eval's own
    trust_task_code: false           # the default: task definitions from the spec run no Python code
```

The step runs lm-eval's ``simple_evaluate`` with :class:`headlab.lm_eval.HeadlabLM` over the run's model;
``heads: {from: <step>}`` in ``decode``/``steer`` sees the earlier steps of the cell. Its dataset holds the
per-task metrics over ``task`` and the per-sample records over ``example``
(:func:`headlab.lm_eval.results_dataset`). Needs the ``eval`` extra (``pip install 'headlab[eval]'``);
without it a spec with an ``evaluate`` step fails validation with that one line.

Task definitions the spec brings (inline mappings, ``include_path`` YAMLs, task files) are checked when the
spec is validated and rendered in headlab's sandbox (:mod:`headlab.task_code`): no ``!function`` helper
(except copies of lm-eval's own), no metric outside lm-eval's registry, no unsafe template, unless
``trust_task_code: true``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import xarray as xr
from pydantic import Field, model_validator

from headlab.plugin import FiniteFloat, NonNegativeInt, PositiveInt, StepContext, StrictModel, hookimpl
from headlab.spec import SpecTypes
from headlab.task_code import EXTRA, check_tasks

from .common import compile_kv, decoding_config, kv_results, kv_running


def evaluate_config(types: SpecTypes) -> type[StrictModel]:
    """The config of an evaluate step: lm-eval tasks and options, plus the decoder and steering."""

    class Evaluate(decoding_config(types)):
        """Run lm-evaluation-harness tasks with headlab's model, decoding strategy and steering methods."""

        tasks: list[str | dict[str, Any]] = Field(min_length=1, description="lm-eval task names (or task "
                                                  "config mappings), e.g. [truthfulqa_mc2, nq_open]")
        limit: PositiveInt | FiniteFloat | None = Field(None, gt=0, description="examples per task (a fraction if < 1)")
        num_fewshot: NonNegativeInt | None = Field(None, description="few-shot examples (default: the task's)")
        include_path: str | list[str] | None = Field(
            None, description="directories of extra task YAMLs (relative to the working directory)")
        include_defaults: bool = Field(True, description="index lm-eval's own tasks too (false: only "
                                       "include_path, much faster to start)")
        max_gen_toks: PositiveInt = Field(256, description="generated tokens at most (when the task sets none)")
        gen_kwargs: dict[str, Any] | None = Field(None, description="generation arguments for every task "
                                                  "(lm-eval's --gen_kwargs)")
        bootstrap_iters: NonNegativeInt = Field(1000, description="bootstrap iterations for stderr of non-mean metrics")
        trust_task_code: bool = Field(False, description="let task definitions from this spec (inline mappings, "
                                      "include_path YAMLs, task files) run Python code (!function helpers, "
                                      "HF evaluate metrics) and render their templates outside headlab's sandbox; "
                                      "off: such code is refused when the spec is validated")

        @model_validator(mode="after")
        def _lm_eval_installed(self) -> Any:
            if importlib.util.find_spec("lm_eval") is None:
                raise ValueError(EXTRA)
            return self

        @model_validator(mode="after")
        def _task_code(self) -> Any:
            check_tasks(self.tasks, self.include_path, trust=self.trust_task_code)
            return self

        def preflight(self) -> None:
            """Check the tasks against lm-eval before a run starts and in ``headlab validate``: names, the fields
            and metrics of each task, ``num_fewshot`` (:func:`headlab.lm_eval.check_task_configs`)."""
            from headlab.lm_eval import check_task_configs

            check_task_configs(self.tasks, include_path=self.include_path, include_defaults=self.include_defaults,
                               num_fewshot=self.num_fewshot)

    return Evaluate


def evaluate(config: Any, ctx: StepContext) -> xr.Dataset:
    """Run the tasks; per-task metrics over ``task``, per-sample records over ``example``."""
    from headlab.lm_eval import cache_directory, datasets_cache
    from headlab.lm_eval import evaluate as run_tasks

    kv = compile_kv(config.kv, ctx, None)  # lm-eval's requests are not known in advance: no context length
    with kv_running(kv, ctx), datasets_cache(cache_directory(ctx.store) if ctx.store else None):
        ds = run_tasks(ctx.model, config.tasks, decode=config.decode, steer=config.steer, limit=config.limit,
                       num_fewshot=config.num_fewshot, include_path=config.include_path,
                       include_defaults=config.include_defaults, batch_size=config.batch_size,
                       max_gen_toks=config.max_gen_toks, gen_kwargs=config.gen_kwargs, seed=ctx.seed, ctx=ctx,
                       bootstrap_iters=config.bootstrap_iters, trust_task_code=config.trust_task_code)
    ds.attrs.update(decode=config.decode.kind, steer=[c.kind for c in config.steer],
                    tasks=[t if isinstance(t, str) else str(t.get("task", t)) for t in config.tasks],
                    example_source="lm-eval")
    return kv_results(ds, kv)


@hookimpl
def headlab_register_actions(register):
    register("evaluate", evaluate_config, evaluate,
             description="run lm-evaluation-harness tasks under a decoding strategy and steering")
