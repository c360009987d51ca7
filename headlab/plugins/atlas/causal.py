"""The atlas's causal check: does removing a role's labelled heads hurt the role's own behaviour more than
removing random heads of the same layers?

Definition: docs/methods.md#causal-check-by-ablation, with the output mask of
docs/methods.md#head-masking-and-scaling. For every detector of the cube whose label is set on at least one
head, the top ``k`` labelled heads (by ``rank``; fewer when fewer are labelled) are masked, and as controls
``draws`` sets of as many random heads, drawn per layer like the top heads (the same number in each layer,
never one of the masked top heads; seeded). Where a layer has too few other heads the control is drawn from
the whole model instead, and ``control_matched`` says so. Every condition measures the role's behavioural
metric (:data:`CAUSAL_METRICS`):

- ``repeat_loss`` (previous-token, duplicate-token, induction): mean next-token cross-entropy (nats) on random
  tokens repeated twice, over the second copy's tokens after its first (each of them can be read off the first
  copy by induction); the task is the detector's own ``repeated_tokens`` task from ``detector_steps``;
- ``log_perplexity`` (attention sinks): mean next-token cross-entropy over every token of the same sequences
  (the log of the perplexity);
- ``needle_recall`` (retrieval): greedy answers to the detector's own needle task scored by the
  ``needle_recall`` metric (the retrieval-head paper's check);
- ``successor_accuracy`` (successor heads): on prompts of up to three consecutive items of an ordinal sequence
  (the successor detector's sequences, each item one token), the fraction whose next-token logits, restricted
  to the tokens of that sequence, peak at the next item.

Other roles (copy suppression, composition, importance, ...) have no behavioural metric here: their
``causal_metric`` is ``"none"`` and ``causal_status`` says so.

``effect`` is the metric's change in the direction of harm, so larger means more harm: masked minus unmasked
for the two losses, unmasked minus masked for recall and accuracy; ``control_effect (detector, draw)`` is the
same for each random draw. A label is causally ``supported`` when its effect is positive and exceeds the
controls' mean plus two sample standard deviations (``ddof=1``; at least two draws).
``causal_status (detector)`` is one of ``supported``, ``not supported`` (the heads do no more than random
heads), ``no labelled heads``, ``no causal metric`` or ``no task: <why>``.

Entry point: :func:`causal_check` (``lm``, the cube) returns the cube with ``effect``, ``control_effect``,
``supported``, ``causal_metric``, ``causal_status``, ``causal_base`` (the unmasked metric),
``control_matched``, the masked heads ``causal_heads (detector, slot)`` and ``control_heads (detector, draw,
slot)`` (``"L<layer>H<head>"``, ``""`` pads) added and
attrs ``causal_k``, ``causal_draws``, ``causal_seed``, ``causal_mode``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any, Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field, field_validator

from headlab import component, draw_like
from headlab.masking import ablate, metric_config
from headlab.plugin import (
    Example,
    LoadedModel,
    Plan,
    PositiveInt,
    Seed,
    StrictModel,
    TaskContext,
    forward,
    tokenize,
)
from headlab.text import SEQUENCES, sequence_tokens

__all__ = ["CAUSAL_METRICS", "CausalConfig", "HARM_SIGN", "causal_check", "causal_lines", "draw_controls", "log_perplexity", "repeat_loss",
           "successor_accuracy", "successor_examples", "top_labelled"]

Head = tuple[int, int]
Progress = Callable[[Iterable[Any], str], Iterable[Any]]

#: the behavioural metric of each role (detectors not listed have none)
CAUSAL_METRICS: dict[str, str] = {
    "previous_token": "repeat_loss",
    "duplicate_token": "repeat_loss",
    "induction": "repeat_loss",
    "attention_sink": "log_perplexity",
    "retrieval": "needle_recall",
    "successor": "successor_accuracy",
}
#: +1: a larger metric is worse (losses); -1: a larger metric is better (recall, accuracy)
HARM_SIGN: dict[str, int] = {"repeat_loss": 1, "log_perplexity": 1, "needle_recall": -1, "successor_accuracy": -1}



class CausalConfig(StrictModel):
    """The atlas's causal check: each labelled role's top-k heads masked vs k random heads of the same layers."""

    k: PositiveInt = Field(4, description="labelled heads masked per role (its best-ranked; fewer if fewer are "
                           "labelled)")
    draws: PositiveInt = Field(5, description="random control draws (at least 2: the support test uses their "
                               "spread)")
    mode: Literal["output", "query", "score"] = Field(
        "output", description="the mask: output zeroes the head output (ablation); query zeroes the query "
        "(uniform attention); score zeroes the scores")
    seed: Seed = Field(0, description="offset added to the run seed for the random draws and the tasks")
    batch_size: PositiveInt = Field(16, description="prompts per forward")

    @field_validator("draws")
    @classmethod
    def _draws(cls, value: int) -> int:
        if value < 2:
            raise ValueError("draws: at least 2 random draws (supported means above their mean + 2 std)")
        return value


_DEFAULT_REPEAT = {"kind": "repeated_tokens", "n": 16, "length": 24}


def top_labelled(cube: xr.Dataset, detector: str, k: int) -> list[Head]:
    """The ``k`` best-ranked heads labelled ``detector`` in ``cube`` (fewer when fewer are labelled)."""
    label = cube["label"].sel(detector=detector).values
    rank = cube["rank"].sel(detector=detector).values
    layers, heads = np.nonzero(label)
    order = np.argsort(rank[layers, heads], kind="stable")[:k]
    return [(int(layers[i]), int(heads[i])) for i in order]


def draw_controls(top: list[Head], n_layers: int, n_heads: int, rng: np.random.Generator) -> tuple[list[Head], bool]:
    """``len(top)`` random heads, as many per layer as ``top`` and none of ``top``; drawn from the whole model
    (still none of ``top``) where a layer has too few other heads. Returns the heads and whether they match."""
    every = [(layer, h) for layer in range(n_layers) for h in range(n_heads)]
    try:
        return draw_like(top, every, rng, match_layers=True, exclude=True), True
    except ValueError:
        return draw_like(top, every, rng, match_layers=False, exclude=True), False


def _plan(heads: list[Head], mode: str) -> Plan | None:
    return Plan().mask_heads(heads, mode=mode) if heads else None


def _token_nll(lm: LoadedModel, examples: list[Example], heads: list[Head], mode: str,
               batch_size: int) -> list[np.ndarray]:
    """Per example, the next-token cross-entropy of each of its tokens after the first (unpadded order)."""
    out: list[np.ndarray] = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start: start + batch_size]
        batch = tokenize(lm, chunk)
        res, _ = forward(lm, batch, _plan(heads, mode))
        logp = torch.log_softmax(res.logits.float(), dim=-1)
        ids = batch.input_ids.to(logp.device)
        nll = -logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        lengths = batch.attention_mask.sum(-1).tolist()
        width = ids.shape[1]
        for r, n in enumerate(lengths):
            out.append(nll[r, width - n:].cpu().double().numpy())  # left padding: the row's tokens are last
    return out


def repeat_loss(lm: LoadedModel, examples: list[Example], heads: list[Head], *, mode: str = "output",
                batch_size: int = 16) -> np.ndarray:
    """Per example ``[bos] + s + s`` (``meta.segment_length``), the mean cross-entropy of the second copy's
    tokens after its first, with ``heads`` masked."""
    values = []
    for ex, nll in zip(examples, _token_nll(lm, examples, heads, mode, batch_size), strict=True):
        length = int(ex.meta["segment_length"])
        # nll[i] is the loss of token i + 1; the second copy's tokens after its first are the last length - 1
        values.append(float(nll[len(nll) - (length - 1):].mean()))
    return np.array(values)


def log_perplexity(lm: LoadedModel, examples: list[Example], heads: list[Head], *, mode: str = "output",
                   batch_size: int = 16) -> np.ndarray:
    """Per example, the mean next-token cross-entropy of every token after the first, with ``heads`` masked."""
    return np.array([float(nll.mean()) for nll in _token_nll(lm, examples, heads, mode, batch_size)])


def successor_examples(tokenizer: Any, window: int = 3) -> list[Example]:
    """Prompts of up to ``window`` consecutive items of each ordinal sequence (:data:`SEQUENCES`, one token
    each, with a leading space) ending at item ``i``; ``meta``: ``answer_id`` (item ``i + 1``'s token) and
    ``candidates`` (the sequence's tokens)."""
    tokens, _ = sequence_tokens(tokenizer, SEQUENCES)
    bos = getattr(tokenizer, "bos_token_id", None)
    examples = []
    for name, ids in tokens.items():
        kept = [t for t in ids if t is not None]
        for i in range(len(ids) - 1):
            if ids[i] is None or ids[i + 1] is None:
                continue
            first = i
            while first > 0 and first > i - window + 1 and ids[first - 1] is not None:
                first -= 1
            prompt_ids = ([bos] if bos is not None else []) + [int(t) for t in ids[first: i + 1]]  # type: ignore[arg-type]
            examples.append(Example(prompt=tokenizer.decode(prompt_ids), input_ids=prompt_ids,
                                    meta={"answer_id": int(ids[i + 1]), "candidates": kept, "sequence": name}))
    return examples


def successor_accuracy(lm: LoadedModel, examples: list[Example], heads: list[Head], *, mode: str = "output",
                       batch_size: int = 16) -> np.ndarray:
    """Per example, 1 when the last position's logits restricted to ``meta.candidates`` peak at
    ``meta.answer_id``, with ``heads`` masked."""
    values = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start: start + batch_size]
        res, _ = forward(lm, tokenize(lm, chunk), _plan(heads, mode), logits_to_keep=1)
        last = res.logits[:, -1].float().cpu()
        for r, ex in enumerate(chunk):
            cand = list(ex.meta["candidates"])
            values.append(float(cand[int(last[r, cand].argmax())] == ex.meta["answer_id"]))
    return np.array(values)


def _build_task(lm: LoadedModel, task: dict[str, Any], seed: int) -> list[Example]:
    comp = component("tasks", str(task["kind"]))
    config = comp.config.model_validate(task)
    vocab_size = lm.model.config.get_text_config().vocab_size
    return comp.impl(config, TaskContext(tokenizer=lm.tokenizer, seed=seed, vocab_size=vocab_size))


class _Measure:
    """One role's metric over its examples: ``values(conditions)`` gives the mean metric per condition."""

    def __init__(self, lm: LoadedModel, metric: str, examples: list[Example], mode: str, batch_size: int,
                 step: dict[str, Any]):
        self.lm, self.metric, self.examples, self.mode, self.batch_size = lm, metric, examples, mode, batch_size
        self.step = step

    def values(self, conditions: list[list[Head]]) -> list[float]:
        if self.metric == "needle_recall":
            detect = self.step.get("detect", {})
            outputs = ablate(self.lm, self.examples, conditions, mode=self.mode,
                             max_new_tokens=int(detect.get("max_new_tokens", 16)), batch_size=self.batch_size)
            mcfg = metric_config("needle_recall")
            compute = component("metrics", "needle_recall").impl
            return [float(np.nanmean(compute(mcfg, self.examples, out))) for out in outputs]
        fn = {"repeat_loss": repeat_loss, "log_perplexity": log_perplexity,
              "successor_accuracy": successor_accuracy}[self.metric]
        return [float(fn(self.lm, self.examples, heads, mode=self.mode, batch_size=self.batch_size).mean())
                for heads in conditions]


def _examples_for(lm: LoadedModel, detector: str, metric: str, step: dict[str, Any], seed: int) -> list[Example]:
    """The examples a role's metric runs on (raises ValueError with the reason when there are none)."""
    task = step.get("task") or {}
    if metric in ("repeat_loss", "log_perplexity"):
        spec = task if task.get("kind") == "repeated_tokens" else _DEFAULT_REPEAT
        return _build_task(lm, spec, seed)
    if metric == "needle_recall":
        if task.get("kind") not in ("niah", "kv_retrieval"):
            raise ValueError(f"the {detector} step records no needle task (niah or kv_retrieval)")
        return _build_task(lm, task, seed)
    if lm.tokenizer is None:
        raise ValueError("the model has no tokenizer to spell ordinal sequences")
    examples = successor_examples(lm.tokenizer)
    if not examples:
        raise ValueError("no two consecutive items of any ordinal sequence are single tokens of this tokenizer")
    return examples


def _names(heads: list[Head]) -> list[str]:
    return [f"L{layer}H{h}" for layer, h in heads]


def causal_check(lm: LoadedModel, cube: xr.Dataset, *, k: int = 4, draws: int = 5, seed: int = 0,
                 mode: str = "output", batch_size: int = 16, progress: Progress | None = None) -> xr.Dataset:
    """``cube`` with the causal check of every labelled role added (see the module docstring).

    ``k``: heads masked per role; ``draws``: random control draws; ``seed``: seeds the draws and the tasks;
    ``mode``: the head mask (``output``: zero ``z``; ``query``; ``score``); ``progress``: wraps the roles'
    iteration (as ``StepContext.progress``)."""
    if k < 1 or draws < 2:
        raise ValueError(f"causal check: k >= 1 and draws >= 2 (got k={k}, draws={draws})")
    detectors = [str(d) for d in cube["detector"].values]
    steps = json.loads(cube.attrs.get("detector_steps", "{}") or "{}")
    n_layers, n_heads = cube.sizes["layer"], cube.sizes["head"]
    rng = np.random.default_rng(seed)
    effect = np.full(len(detectors), np.nan)
    control = np.full((len(detectors), draws), np.nan)
    base = np.full(len(detectors), np.nan)
    supported = np.zeros(len(detectors), dtype=bool)
    matched = np.ones(len(detectors), dtype=bool)
    metric_names = ["none"] * len(detectors)
    status = [""] * len(detectors)
    masked = [[""] * k for _ in detectors]
    masked_controls = [[[""] * k for _ in range(draws)] for _ in detectors]
    measures: dict[tuple[str, str], tuple[_Measure, float]] = {}
    items = progress(list(enumerate(detectors)), "causal check") if progress is not None else enumerate(detectors)
    for i, det in items:
        metric = CAUSAL_METRICS.get(det)
        if metric is None:
            status[i] = "no causal metric"
            continue
        metric_names[i] = metric
        top = top_labelled(cube, det, k)
        if not top:
            status[i] = "no labelled heads"
            continue
        step = steps.get(det, {})
        key = (metric, json.dumps(step.get("task"), sort_keys=True) if metric != "successor_accuracy" else "")
        if key not in measures:
            try:
                examples = _examples_for(lm, det, metric, step, seed)
            except ValueError as e:
                status[i] = f"no task: {e}"
                continue
            measure = _Measure(lm, metric, examples, mode, batch_size, step)
            measures[key] = (measure, measure.values([[]])[0])
        measure, unmasked = measures[key]
        controls = []
        for _ in range(draws):
            heads, ok = draw_controls(top, n_layers, n_heads, rng)
            matched[i] &= ok
            controls.append(heads)
        values = measure.values([top, *controls])
        sign = HARM_SIGN[metric]
        base[i] = unmasked
        effect[i] = sign * (values[0] - unmasked)
        control[i] = [sign * (v - unmasked) for v in values[1:]]
        spread = float(np.std(control[i], ddof=1))
        supported[i] = bool(effect[i] > 0 and effect[i] > float(np.mean(control[i])) + 2 * spread)
        status[i] = "supported" if supported[i] else "not supported"
        masked[i][: len(top)] = _names(top)
        for d, heads in enumerate(controls):
            masked_controls[i][d][: len(heads)] = _names(heads)
    out = cube.copy()
    out["effect"] = ("detector", effect)
    out["control_effect"] = (("detector", "draw"), control)
    out["supported"] = ("detector", supported)
    out["causal_base"] = ("detector", base)
    out["causal_metric"] = ("detector", np.array(metric_names, dtype=object).astype(str))
    out["causal_status"] = ("detector", np.array(status, dtype=object).astype(str))
    out["control_matched"] = ("detector", matched)
    out["causal_heads"] = (("detector", "slot"), np.array(masked, dtype=object).astype(str))
    out["control_heads"] = (("detector", "draw", "slot"), np.array(masked_controls, dtype=object).astype(str))
    out = out.assign_coords(draw=np.arange(draws), slot=np.arange(k))
    out.attrs.update(causal_k=k, causal_draws=draws, causal_seed=seed, causal_mode=mode,
                     causal_reference="docs/methods.md#causal-check-by-ablation")
    return out


def causal_lines(cube: xr.Dataset) -> list[str]:
    """One line per detector of a checked cube: its status, effect and the controls' mean and std."""
    lines = []
    for det in cube["detector"].values:
        c = cube.sel(detector=det)
        status = str(c["causal_status"].values)
        if status in ("supported", "not supported"):
            ctrl = c["control_effect"].values
            spread = float(np.std(ctrl, ddof=1)) if ctrl.size > 1 else 0.0
            lines.append(f"{det}: {status} ({c['causal_metric'].values}: effect {float(c['effect']):+.3f}, "
                         f"random heads {float(np.mean(ctrl)):+.3f} +- {spread:.3f})")
        else:
            lines.append(f"{det}: {status}")
    return lines
