"""``pasta_profile``: PASTA's head selection by steering one head at a time (a detector).

Definition: docs/methods.md#pasta-head-selection (described in the paper, absent from the reference code):
for each of m tasks, steer one head at a time with PASTA on a small set of examples, rank the heads by the
task metric, and take the intersection of the top-k heads of every task.

Batched: every forward holds many (head, example) rows, each row steered on its own head only (per-row
edits of one :class:`headlab.instrument.Plan`), so profiling ``L x H`` heads on ``n`` examples costs
``L * H * n / batch_size`` forwards.

Metric per (task, head): the mean over the task's examples of

- ``target_logprob`` (default): ``log p(target | prompt)`` teacher-forced (summed over the target's
  tokens; target keys are generated-token keys and stay unbiased, exactly as in generation), or
- any metric kind (``exact_match``, ``contains``, ...) on greedy generations of ``max_new_tokens``,

minus the same metric without steering (``gain``). Heads are ranked per task by ``gain`` (0 = best; ties
by (layer, head)). The intersection of the top-k of every task is ``{h : max_task rank(h) < k}``, so the
result's ``score`` is ``1 - (max_rank + mean_rank / C) / C`` over ``C`` candidate heads: ranking by
``score`` (``heads: {from: <this step>, top: n}``) walks the intersections for growing k (ties broken by
the mean rank), and ``selected`` marks the intersection of the top ``top_k``. ``write`` saves that
intersection in PASTA's ``{"<layer>": [heads]}`` JSON format, which ``pasta`` reads with
``heads: {file: ...}``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field, field_validator

from headlab import PluginError, component, to_pasta_json
from headlab.plugin import (
    Batch,
    ComponentConfig,
    DecodeRequest,
    Example,
    HeadSelection,
    NonEmptyStr,
    NonNegativeInt,
    Plan,
    PositiveInt,
    Probability,
    StepContext,
    decode_loop,
    forward,
    head_array,
    hookimpl,
    tokenize,
)
from headlab.resources import Estimate, EstimateContext
from headlab.scoring import build_examples

from .common import resolve_heads
from .pasta import ScalePosition, Span, apply_pasta


class PastaProfile(ComponentConfig):
    """PASTA head profiling: steer each head alone on several tasks; rank; intersect the top-k."""

    kind: Literal["pasta_profile"] = "pasta_profile"
    tasks: list[dict[str, Any]] = Field(
        default_factory=list, description="task configs to profile on ({kind: ..., ...}); empty: the step's task")
    n_examples: PositiveInt | None = Field(16, description="examples per task (the first n; None = all)")
    metric: str = Field("target_logprob", description="target_logprob (teacher-forced log p(target)) or a "
                        "metric kind computed on greedy generations")
    max_new_tokens: PositiveInt = Field(4, description="generation length for generation metrics")
    alpha: Probability = Field(0.01, gt=0)
    scale_position: ScalePosition = "exclude"
    span: NonEmptyStr = Field("emphasis", description="name of the examples' emphasised character spans")
    heads: HeadSelection | list[NonNegativeInt] | None = Field(None, description="candidate heads (default: every head)")
    top_k: PositiveInt | None = Field(None, description="mark the intersection of every task's top-k as `selected`")
    write: str | None = Field(None, description="write the `selected` heads to this PASTA-format JSON file")
    batch_size: PositiveInt = Field(64, description="(head, example) rows per forward")

    def estimate(self, ctx: EstimateContext) -> list[Estimate]:
        """The KV cache of a batch of (head, example) rows over the longest prompt (resource guard)."""
        return [ctx.kv_cache(ctx.task.tokens + self.max_new_tokens, self.batch_size)]

    @field_validator("tasks")
    @classmethod
    def _known_tasks(cls, tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, t in enumerate(tasks):
            _task_config(t, i)
        return tasks


def _task_config(task: dict[str, Any], i: int) -> Any:
    kind = task.get("kind") if isinstance(task, dict) else None
    if kind is None:
        raise ValueError(f"tasks[{i}]: missing `kind`")
    try:
        comp = component("tasks", kind)
    except PluginError:
        comp = None
    if comp is None or comp.config is None:
        raise ValueError(f"tasks[{i}]: unknown task kind '{kind}'")
    return comp.config.model_validate(task)


def _task_sets(config: PastaProfile, ctx: StepContext) -> list[tuple[str, list[Example]]]:
    if not config.tasks:
        sets = [("task", list(ctx.examples))]
    else:
        sets = [(f"{i}-{t['kind']}", build_examples(_task_config(t, i), ctx.model, ctx.seed))
                for i, t in enumerate(config.tasks)]
    n = config.n_examples
    return [(name, exs[:n] if n else exs) for name, exs in sets]


# --------------------------------------------------------------------------- teacher-forced target scores
def _scoring_rows(ctx: StepContext, examples: list[Example], span: str) -> list[dict[str, Any]]:
    """Per example: token ids (prompt + target), prompt length, emphasised token spans (unpadded)."""
    tok = ctx.model.tokenizer
    if tok is None:
        raise ValueError("pasta_profile needs a tokenizer")
    prompts = tokenize(ctx.model, examples, device="cpu")
    sections = prompts.spans(span)
    out = []
    for r, ex in enumerate(examples):
        if not ex.target:
            raise ValueError(f"pasta_profile: example {r} has no target (needed by target_logprob)")
        p_ids = prompts.input_ids[r, prompts.pad[r]:].tolist()
        full = tok(ex.prompt + ex.target, add_special_tokens=True)["input_ids"]
        tgt = full[len(p_ids):] if full[: len(p_ids)] == p_ids else tok(ex.target, add_special_tokens=False)["input_ids"]
        if not tgt:
            raise ValueError(f"pasta_profile: the target of example {r} is empty after tokenization")
        secs = [(s - prompts.pad[r], e - prompts.pad[r]) for s, e in sections[r]]
        out.append({"ids": p_ids + list(tgt), "n_prompt": len(p_ids), "sections": secs})
    return out


def _target_logprob(ctx: StepContext, rows: list[dict[str, Any]], heads: list[tuple[int, int] | None],
                    config: PastaProfile) -> np.ndarray:
    """log p(target | prompt) per row; row i steered on ``heads[i]`` (None: unsteered)."""

    lm = ctx.model
    n = max(len(r["ids"]) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    by_head: dict[tuple[int, int], tuple[list[int], list[list[Span]], list[Span]]] = {}
    for i, (r, h) in enumerate(zip(rows, heads, strict=True)):
        pad = n - len(r["ids"])
        ids[i, pad:] = torch.tensor(r["ids"])
        mask[i, pad:] = 1
        if h is not None and r["sections"]:
            rs, secs, regs = by_head.setdefault(h, ([], [], []))
            rs.append(i)
            secs.append([(s + pad, e + pad) for s, e in r["sections"]])
            regs.append((pad, pad + r["n_prompt"]))
    plan = Plan()
    for h, (rs, secs, regs) in by_head.items():
        apply_pasta(plan, [h], secs, regs, config.alpha, config.scale_position, rows=rs)
    ids, mask = ids.to(lm.device), mask.to(lm.device)
    logits = forward(lm, ids, plan, attention_mask=mask)[0].logits
    logp = torch.log_softmax(logits.float(), dim=-1)
    out = np.zeros(len(rows))
    for i, r in enumerate(rows):
        pad = n - len(r["ids"])
        tgt_pos = torch.arange(pad + r["n_prompt"], n, device=logp.device)
        tgt = ids[i, tgt_pos]
        out[i] = float(logp[i, tgt_pos - 1].gather(-1, tgt[:, None]).sum())
    return out


# --------------------------------------------------------------------------- generation metrics
def _generated_metric(ctx: StepContext, examples: list[Example], heads: list[tuple[int, int] | None],
                      config: PastaProfile) -> np.ndarray:
    comp = component("metrics", config.metric)
    batch: Batch = tokenize(ctx.model, examples)
    sections = batch.spans(config.span)
    plan = Plan()
    by_head: dict[tuple[int, int], list[int]] = {}
    for i, h in enumerate(heads):
        if h is not None and sections[i]:
            by_head.setdefault(h, []).append(i)
    for h, rs in by_head.items():
        apply_pasta(plan, [h], [sections[i] for i in rs], [batch.prompt_span(i) for i in rs],
                    config.alpha, config.scale_position, rows=rs)
    request = DecodeRequest(ctx.model, batch, config.max_new_tokens, [], plan, ctx.seed)
    texts = decode_loop(request, lambda out, _: out.logits[:, -1].argmax(-1)).texts
    return np.asarray(comp.impl(comp.config(), examples, texts), dtype=float)


# --------------------------------------------------------------------------- the detector
def profile(config: PastaProfile, ctx: StepContext) -> xr.Dataset:
    """Steer every candidate head alone on every task's examples; rank and intersect (see module docs)."""
    geo = ctx.model.geometry
    L, H = geo.n_layers, geo.n_heads
    cands = [(ly, h) for ly in range(L) for h in range(H)] if config.heads is None else \
        sorted(set(resolve_heads(ctx, config.heads)))
    if not cands:
        raise ValueError("pasta_profile: no candidate heads")
    if config.metric != "target_logprob":
        component("metrics", config.metric)  # a clear error for an unknown metric, before any work
    sets = _task_sets(config, ctx)
    T, C = len(sets), len(cands)
    steered = np.full((T, L, H), np.nan)
    baseline = np.zeros(T)
    work = []
    for t, (_, exs) in enumerate(sets):
        pairs: list[tuple[tuple[int, int] | None, int]] = [(None, e) for e in range(len(exs))]
        pairs += [(h, e) for h in cands for e in range(len(exs))]
        for j in range(0, len(pairs), config.batch_size):
            work.append((t, pairs[j: j + config.batch_size]))
    rows_cache: dict[int, list[dict[str, Any]]] = {}
    sums = np.zeros((T, L, H))
    base_sum = np.zeros(T)
    for t, chunk in ctx.progress(work, "pasta_profile: steering one head at a time"):
        name, exs = sets[t]
        heads = [h for h, _ in chunk]
        if config.metric == "target_logprob":
            if t not in rows_cache:
                rows_cache[t] = _scoring_rows(ctx, exs, config.span)
            values = _target_logprob(ctx, [rows_cache[t][e] for _, e in chunk], heads, config)
        else:
            values = _generated_metric(ctx, [exs[e] for _, e in chunk], heads, config)
        for (h, _), v in zip(chunk, values, strict=True):
            if h is None:
                base_sum[t] += v
            else:
                sums[t, h[0], h[1]] += v
    for t, (_, exs) in enumerate(sets):
        baseline[t] = base_sum[t] / len(exs)
        for ly, h in cands:
            steered[t, ly, h] = sums[t, ly, h] / len(exs)
    gain = steered - baseline[:, None, None]
    rank = np.full((T, L, H), np.nan)
    for t in range(T):
        order = sorted(cands, key=lambda lh, t=t: (-gain[t, lh[0], lh[1]], lh))
        for i, (ly, h) in enumerate(order):
            rank[t, ly, h] = i
    max_rank, mean_rank = rank.max(0), rank.mean(0)
    score = 1.0 - (max_rank + mean_rank / C) / C
    ds = xr.Dataset({
        "score": head_array(score),
        "gain": head_array(gain, "task"),
        "steered": head_array(steered, "task"),
        "rank": head_array(rank, "task"),
        "baseline": ("task", baseline),
    }).assign_coords(task=[name for name, _ in sets])
    attrs: dict[str, Any] = dict(method="pasta_profile", metric=config.metric, alpha=config.alpha,
                                 scale_position=config.scale_position, candidates=C, model=ctx.model.name,
                                 reference="docs/methods.md#pasta")
    if config.top_k is not None:
        selected = max_rank < config.top_k
        ds["selected"] = head_array(selected)
        chosen = [(int(ly), int(h)) for ly, h in zip(*np.nonzero(selected), strict=True)]
        pasta = to_pasta_json(chosen)
        attrs.update(top_k=config.top_k, pasta_heads=json.dumps(pasta))
        if config.write:
            path = Path(config.write)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(pasta, indent=1) + "\n")
    ds.attrs.update(attrs)
    return ds


@hookimpl
def headlab_register_detectors(register):
    register(PastaProfile, profile)
