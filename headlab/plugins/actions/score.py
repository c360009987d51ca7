"""The ``score`` action: every (example, choice) row scored under a decoding strategy, then
multiple-choice metrics (``choice_metrics`` kinds; TruthfulQA's MC1, MC2, MC3 and accuracy by default).

A decoder supports scoring when it is registered with a scorer: ``register(Config, decode,
score=score_fn)`` with ``score_fn(config, request: ScoreRequest) -> Scored`` (see docs/plugins.md).
"""

from typing import Annotated, Any

import numpy as np
import xarray as xr
from pydantic import BeforeValidator, Field

from headlab import component
from headlab.generation import continuation_batch
from headlab.plugin import ContractError, Scored, ScoreRequest, StepContext, StrictModel, hookimpl
from headlab.resources import Estimate, EstimateContext
from headlab.spec import SpecTypes

from .common import compile_kv, decoding_config, kind_shorthand, kv_results, kv_running, steering_plan

DEFAULT_METRICS = ("mc1", "mc2", "mc3", "accuracy")


def score_config(types: SpecTypes) -> type[StrictModel]:
    """The config of a score step: decoder, steering, batch size and multiple-choice metrics."""
    ChoiceMetric = Annotated[types.union("choice_metrics"), BeforeValidator(kind_shorthand)]
    defaults = [k for k in DEFAULT_METRICS if k in types.kinds("choice_metrics")]

    class Score(decoding_config(types)):
        """Score every example's choices (``prompt + choice``, summed over the choice's tokens) under a
        decoding strategy (greedy: the model's log-likelihood); metrics MC1, MC2, MC3 and accuracy."""

        metrics: list[ChoiceMetric] = Field(defaults, validate_default=True,
                                            description="multiple-choice metrics of the choices' scores")

        def estimate(self, ctx: EstimateContext) -> list[Estimate]:
            """The KV cache of a batch of prompt + choice rows over the longest prompt (resource guard)."""
            return [ctx.kv_cache(ctx.task.tokens, ctx.rows(self.batch_size))]

    return Score


def score(action: Any, ctx: StepContext) -> xr.Dataset:
    """The ``score`` action: every (example, choice) row scored under the decoder's ``score``."""
    decoder = component("decoders", action.decode.kind)
    scorer = decoder.score
    if scorer is None:
        raise ValueError(f"decoder '{action.decode.kind}' does not support scoring (it was registered without "
                         "`score=`)")
    missing = [i for i, ex in enumerate(ctx.examples) if not ex.choices]
    if missing:
        raise ValueError(f"the score action needs examples with `choices` (example {missing[0]} has none)")
    pairs = [(i, j) for i, ex in enumerate(ctx.examples) for j in range(len(ex.choices or []))]
    width = max(len(ex.choices or []) for ex in ctx.examples)
    logprobs = np.full((len(ctx.examples), width), np.nan)
    n_tok = np.zeros((len(ctx.examples), width), dtype=np.int64)
    chunks = [pairs[i: i + action.batch_size] for i in range(0, len(pairs), action.batch_size)]
    built = [continuation_batch(ctx.model, [(ctx.examples[i], ctx.examples[i].choices[j]) for i, j in chunk])
             for chunk in chunks] if action.kv is not None else None
    kv = compile_kv(action.kv, ctx, max((b.length for b, _ in built), default=0) if built else None)
    with kv_running(kv, ctx):
        for k, chunk in enumerate(ctx.progress(chunks, "scoring", total=len(chunks))):
            sources = [ctx.examples[i] for i, _ in chunk]
            conts = [ctx.examples[i].choices[j] for i, j in chunk]
            batch, n_tokens = built[k] if built else continuation_batch(ctx.model, list(zip(sources, conts,
                                                                                             strict=True)))
            plan, _ = steering_plan(action.steer, ctx, batch)
            request = ScoreRequest(ctx.model, batch, n_tokens, sources, conts, plan, ctx.seed, ctx)
            scored = scorer(action.decode, request)
            if not isinstance(scored, Scored) or len(scored.logprobs) != len(chunk):
                raise ContractError(f"the scorer returned {type(scored).__name__}, not Scored with one value per "
                                    "row", category="decoders", kind=action.decode.kind)
            for (i, j), value, n in zip(chunk, scored.logprobs, n_tokens, strict=True):
                logprobs[i, j], n_tok[i, j] = value, n
    metrics = {cfg.kind: np.asarray(component("choice_metrics", cfg.kind).impl(cfg, ctx.examples, logprobs),
                                    dtype=float) for cfg in action.metrics}
    predicted = np.array([int(np.argmax(logprobs[i, : len(ex.choices or [])])) for i, ex in enumerate(ctx.examples)],
                         dtype=np.int64)
    choices = np.full((len(ctx.examples), width), "", dtype=object)
    for i, ex in enumerate(ctx.examples):
        choices[i, : len(ex.choices or [])] = ex.choices
    ds = xr.Dataset({
        "logprob": (("example", "choice"), logprobs),
        "choice_tokens": (("example", "choice"), n_tok),
        "choice_text": (("example", "choice"), choices),
        "label": ("example", np.array([-1 if ex.label is None else ex.label for ex in ctx.examples])),
        **{k: ("example", v) for k, v in metrics.items()},
        "predicted": ("example", predicted),
    }).assign_coords(choice=np.arange(width))
    ds.attrs.update(decode=action.decode.kind, steer=[c.kind for c in action.steer], metrics=list(metrics))
    return kv_results(ds, kv)


@hookimpl
def headlab_register_actions(register):
    register("score", score_config, score,
             description="score multiple-choice answers under a decoding strategy")
