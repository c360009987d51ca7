"""The head atlas: every head of a model scored by every detector that applies, on built-in tasks, labelled
against thresholds checked on a null (docs/atlas.md).

As a spec step: ``atlas: {detectors: [...], tokens: 64, n: 8, importance: false, null: reinit}``; from the
command line: ``headlab atlas MODEL --out DIR [--detectors a,b] [--tokens N] [--n N] [--importance]
[--null reinit|none]``, which runs a spec of that one step through the normal runner (so the run is stored,
and resumed, like any other). From Python::

    build_atlas(lm, *, detectors=None, tokens=64, n=8, importance=False, null="reinit", seed=0,
                batch_size=8, ctx=None) -> xarray.Dataset

``lm`` a :class:`headlab.LoadedModel`; ``ctx`` an optional :class:`headlab.StepContext` whose reporter shows
progress per detector. The result, the *cube*, has dims ``detector``, ``layer``, ``head`` and holds:

- ``score (detector, layer, head)``: each detector's score, exactly what the detector gives as its own spec
  step (``attrs["detector_steps"][name]``: ``{"task", "detect", "variable"}``, JSON) with the same seed;
- ``label (detector, layer, head)``: ``score >= threshold``; a head may carry several labels; a detector with no
  published threshold (segment divergence, gradient importance, Ships) labels only against a null;
- ``rank (detector, layer, head)``: 1 for the highest score (ties by layer, then head; a missing score last);
- ``threshold (detector)`` (effective), ``default_threshold (detector)``, ``threshold_source (detector)``,
  ``threshold_raised (detector)`` (the null raised the default);
- ``null_score (detector, layer, head)``, ``null_mean``, ``null_std (detector)``: the same detector on the null
  model (absent with ``null="none"``);
- ``task (detector)`` (the task kind, ``weights`` for weight-level detectors), ``n_examples (detector)``;
- attrs ``model``, ``null`` (how the null was made), ``skipped`` (JSON: detector -> why it did not run),
  ``detector_steps``, ``tokens``, ``n``, ``seed``.

Threshold: ``max(default, null_mean + 3 null_std)`` (the null's alone where no default is published; NaN, no
label, with neither), ``null_mean`` and ``null_std`` over every head of the
null model. The null (``null: reinit``) is the same architecture with re-initialised weights, seeded: every
weight matrix drawn from ``N(0, initializer_range^2)`` (the config's, 0.02 when it has none), norm gains 1,
biases 0; a role learned in training cannot exist there, so what its detector reports on it is chance.

Detectors that read the same forward share it: previous-token, duplicate-token, induction and attention-sink
scores come from one probe forward per batch of the pattern task (the attention at the union of the three
patterns' (query, key) pairs and the mass on each row's first token and on the whole row), computed as the
detectors compute them. Copy suppression and the eigenvalue copying score come from one ``copy_suppression``
step.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import torch
import typer
import xarray as xr
from pydantic import Field, ValidationError, field_validator

from headlab import PluginError, SpecError, component
from headlab.pattern_scores import pair_scores
from headlab.plugin import (
    LoadedModel,
    Plan,
    PositiveInt,
    Probes,
    StepContext,
    StrictModel,
    forward,
    hookimpl,
    tokenize,
)
from headlab.resources import Estimate, EstimateContext
from headlab.scoring import build_examples

from .causal import CausalConfig, causal_check, causal_lines
from .compare import compare_cubes, comparison_lines, load_like, merge_comparison
from .tasks import ATLAS_DETECTORS, SHARED_PATTERN, detector_step, not_applicable

__all__ = ["AtlasConfig", "AtlasSkipped", "atlas", "build_atlas", "cube", "pattern_scores", "reinitialised"]

NULL_SIGMAS = 3.0
"""A threshold below ``null_mean + NULL_SIGMAS * null_std`` is raised to it."""


class AtlasSkipped(UserWarning):
    """A detector of the atlas that could not run on this model (the message says which and why)."""


class AtlasConfig(StrictModel):
    """The head atlas: every detector that applies, on built-in tasks, one labelled (detector, layer, head) cube."""

    detectors: list[str] | None = Field(
        None, description="detectors to run (default: every one that applies; head_importance and ships with "
        f"importance: true); one of {', '.join(ATLAS_DETECTORS)}")
    tokens: PositiveInt = Field(64, ge=4, description="size of the built-in tasks: the repeated-token prompts are "
                                "about this long (a segment of tokens/2, twice) and the needle prompts this long")
    n: PositiveInt = Field(8, description="examples per built-in task")
    importance: bool = Field(False, description="also gradient importance and Ships (a backward and L x H "
                             "ablations per prompt)")
    null: Literal["reinit", "none"] = Field(
        "reinit", description="reinit: check each threshold against the same detectors on the same architecture "
        "with re-initialised weights (seeded); none: the default thresholds alone")
    batch_size: PositiveInt = Field(8, description="prompts per forward of the shared pattern pass")
    causal: CausalConfig | None = Field(
        None, description="the causal check (docs/atlas.md#causal-check): mask each labelled role's top-k heads vs "
        "k random heads of the same layers and measure the role's own metric; {} for the defaults")
    compare: str | None = Field(
        None, min_length=1, description="compare with model B (docs/atlas.md#compare): a registered model's name or "
        "a local checkpoint directory of the same geometry; adds B's atlas and the per-head differences")

    @field_validator("detectors")
    @classmethod
    def _known(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return value
        if not value:
            raise ValueError("detectors: give at least one, or leave it out for every detector that applies")
        for name in value:
            if name not in ATLAS_DETECTORS:
                raise ValueError(f"unknown atlas detector {name!r} (one of {', '.join(ATLAS_DETECTORS)})")
        if len(set(value)) != len(value):
            raise ValueError("detectors: each detector once")
        return value

    def estimate(self, ctx: EstimateContext) -> list[Estimate]:
        """Hidden states of a batch of the shared pattern pass, and a copy of the weights for the null."""
        out = [ctx.activations(self.tokens + 1, ctx.rows(self.batch_size))]
        if self.null == "reinit":
            g, d = ctx.geometry, ctx.hidden_size
            params = 12 * g.n_layers * d * d + 2 * ctx.vocab_size * d
            out.append(Estimate("re-initialised copy of the weights (null)", params * ctx.dtype_bytes,
                                f"about 12 x {g.n_layers} layers x {d}^2 + 2 x {ctx.vocab_size:,} vocabulary x {d} "
                                f"parameters x {ctx.dtype_bytes} bytes; null: none needs no copy"))
        return out


# --------------------------------------------------------------------------- the null model
def reinitialised(lm: LoadedModel, seed: int) -> LoadedModel:
    """A copy of ``lm`` with re-initialised weights: every parameter of two or more dimensions drawn from
    ``N(0, std^2)`` (``std`` the config's ``initializer_range``, 0.02 without one), biases 0 and other vectors
    (norm gains) 1; seeded, drawn on the CPU so every device gives the same model."""
    model = copy.deepcopy(lm.model)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    std = float(getattr(config, "initializer_range", None) or getattr(model.config, "initializer_range", None)
                or 0.02)
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(std).to(p.dtype))
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)
    model.eval()
    return dataclasses.replace(lm, model=model, name=f"{lm.name} (re-initialised, seed {seed})", digest=None)


def null_description(lm: LoadedModel, seed: int) -> str:
    """How the null model of :func:`reinitialised` is made, in one sentence."""
    config = lm.model.config.get_text_config() if hasattr(lm.model.config, "get_text_config") else lm.model.config
    std = float(getattr(config, "initializer_range", None) or 0.02)
    return (f"the same detectors on the same tasks on {lm.name}'s architecture with re-initialised weights "
            f"(seed {seed}): every weight matrix from N(0, {std:g}^2), norm gains 1, biases 0; threshold = max(default, "
            f"null mean + {NULL_SIGMAS:g} null std over the null model's heads)")


# --------------------------------------------------------------------------- the shared pattern pass
def _pairs(ids: np.ndarray) -> dict[str, np.ndarray]:
    """The (query, key) ones of the previous-token, duplicate-token and induction patterns of one sequence,
    sorted by query then key (docs/methods.md#pattern-detectors)."""
    n = len(ids)
    i = np.arange(1, n)
    same = np.tril(ids[:, None] == ids[None, :], -1)
    q, k = np.nonzero(same)
    return {"previous_token": np.stack([i, i - 1], -1), "duplicate_token": np.stack([q, k], -1),
            "induction": np.stack([q, k + 1], -1)}


def pattern_scores(lm: LoadedModel, examples: list[Any], names: Iterable[str], batch_size: int = 8,
                   progress: Callable[[Any, str], Iterator[Any]] | None = None) -> dict[str, np.ndarray]:
    """Per-example scores (example, layer, head) of the pattern detectors ``names`` (of :data:`SHARED_PATTERN`,
    with the options of :data:`ATLAS_DETECTORS`) from one probe forward per batch of ``examples`` (grouped by
    length): previous-token, duplicate-token and induction as ``mul`` scores
    (:func:`headlab.pattern_scores.pair_scores`, as the pattern detectors score them), the attention sink as the
    mean over queries ``i >= 1`` of the attention on the first token."""
    names = [m for m in SHARED_PATTERN if m in set(names)]
    geo = lm.geometry
    out = {m: np.zeros((len(examples), geo.n_layers, geo.n_heads)) for m in names}
    by_len: dict[int, list[int]] = {}
    for i, ex in enumerate(examples):
        n = len(ex.input_ids) if ex.input_ids is not None else len(lm.tokenizer(ex.prompt)["input_ids"])
        by_len.setdefault(n, []).append(i)
    groups = [idx[j: j + batch_size] for idx in by_len.values() for j in range(0, len(idx), batch_size)]
    patterns = [m for m in names if m != "attention_sink"]
    for idx in (progress(groups, ", ".join(names) + " (one shared forward)") if progress else groups):
        batch = tokenize(lm, [examples[i] for i in idx])
        ids = batch.input_ids.cpu().numpy()
        n = ids.shape[1]
        per_row = [_pairs(ids[r]) for r in range(len(idx))]
        probe_pairs = [torch.as_tensor(np.concatenate([p[m] for m in patterns] or [np.zeros((0, 2))]), dtype=torch.long)
                       for p in per_row]
        probes = Probes(pairs=probe_pairs, spans=[(0, 1), (0, n)]) if patterns else Probes(spans=[(0, 1), (0, n)])
        _, rec = forward(lm, batch, Plan(probes=probes), logits_to_keep=1)
        sm = rec.span_mass.cpu()  # (example, layer, head, query, 2)
        pm = rec.pair_mass.cpu() if patterns else None
        for r, i in enumerate(idx):
            start = 0
            for m in patterns:
                p = per_row[r][m]
                options = ATLAS_DETECTORS[m].detect
                out[m][i] = pair_scores(pm[r, ..., start:start + len(p)], p, sm[r, ..., 0], sm[r, ..., 1], "mul",
                                        bool(options.get("exclude_bos", False)), False).numpy()
                start += len(p)
            if "attention_sink" in out:
                out["attention_sink"][i] = sm[r, ..., 1:, 0].double().mean(-1).numpy()
    return out


# --------------------------------------------------------------------------- running the detectors
@dataclasses.dataclass
class _Slice:
    score: np.ndarray  # (layer, head)
    n_examples: int
    task: str
    default: float | None = None  # a default threshold the detector's own result gives (composition)


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % (2**32))


def _run_detectors(lm: LoadedModel, names: list[str], tokens: int, n: int, seed: int, batch_size: int,
                   ctx: StepContext | None, prefix: str, skipped: dict[str, str] | None) -> dict[str, _Slice]:
    """Each detector's slice on ``lm``; a detector whose task cannot be built (or that refuses this model) is
    put in ``skipped`` with why, when ``skipped`` is given (else its error is raised)."""
    base = ctx or StepContext(model=lm, examples=[], results={}, seed=seed)
    examples: dict[str, list[Any]] = {}
    results: dict[str, xr.Dataset] = {}
    out: dict[str, _Slice] = {}

    def task_examples(task: dict[str, Any]) -> list[Any]:
        key = json.dumps(task, sort_keys=True)
        if key not in examples:
            config = component("tasks", task["kind"]).config.model_validate(task)
            examples[key] = build_examples(config, lm, seed)
        return examples[key]

    def sub(name: str, ex: list[Any]) -> StepContext:
        step_id = f"{base.step_id}/{prefix}{name}" if base.step_id else f"{prefix}{name}"
        return dataclasses.replace(base, model=lm, examples=ex, results={}, seed=seed, step_id=step_id)

    shared = [m for m in names if m in SHARED_PATTERN]
    if shared:
        step = detector_step(shared[0], tokens, n)
        ex = task_examples(step["task"])
        scores = pattern_scores(lm, ex, shared, batch_size, sub("patterns", ex).progress)
        for m in shared:
            out[m] = _Slice(scores[m].mean(0), len(ex), step["task"]["kind"])
    for name in names:
        if name in shared:
            continue
        step = detector_step(name, tokens, n)
        weights = ATLAS_DETECTORS[name].task == "weights"
        key = json.dumps([step["task"], step["detect"]], sort_keys=True)
        try:
            ex = task_examples(step["task"])
            if key not in results:
                comp = component("detectors", step["detect"]["kind"])
                context = sub(name, ex)
                unit = f"step:{context.step_id}"  # a line per detector; its own progress, if any, takes it over
                on = "the weights" if weights else f"{len(ex)} {step['task']['kind']} examples"
                base.reporter.start(unit, None, f"step {context.step_id}: {step['detect']['kind']} on {on}")
                try:
                    _seed(seed)
                    results[key] = comp.impl(comp.config.model_validate(step["detect"]), context)
                finally:
                    base.reporter.stop(unit)
        except ValueError as e:
            if skipped is None:
                raise
            skipped[name] = f"{type(e).__name__}: {e}" if not str(e) else str(e)
            warnings.warn(f"atlas: skipped {name}: {skipped[name]}", AtlasSkipped, stacklevel=2)
            continue
        ds = results[key]
        score = ds[step["variable"]].transpose("layer", "head").values.astype(float)
        default = None
        if "baseline_mean" in ds and "baseline_std" in ds:
            default = float(ds["baseline_mean"]) + NULL_SIGMAS * float(ds["baseline_std"])
        out[name] = _Slice(score, 0 if weights else len(ex), "weights" if weights else step["task"]["kind"], default)
    return out


def _selected(lm: LoadedModel, detectors: list[str] | None, importance: bool) -> tuple[list[str], dict[str, str]]:
    names = list(detectors) if detectors is not None else [
        m for m, d in ATLAS_DETECTORS.items() if importance or not d.importance]
    skipped: dict[str, str] = {}
    chosen = []
    for name in names:
        why = not_applicable(name, lm)
        if why is None:
            chosen.append(name)
        else:
            skipped[name] = why
    if chosen:  # else the error names them all
        for name, why in skipped.items():
            warnings.warn(f"atlas: skipped {name}: {why}", AtlasSkipped, stacklevel=3)
    return chosen, skipped


def _no_detector(lm: LoadedModel, skipped: dict[str, str]) -> ValueError:
    reasons = "; ".join(f"{m}: {why}" for m, why in skipped.items())
    return ValueError(f"atlas: no detector applies to {lm.name} ({reasons}); give a model with a tokenizer and "
                      "attention heads, or name other --detectors")


def build_atlas(lm: LoadedModel, *, detectors: list[str] | None = None, tokens: int = 64, n: int = 8,
                importance: bool = False, null: str = "reinit", seed: int = 0, batch_size: int = 8,
                ctx: StepContext | None = None) -> xr.Dataset:
    """The atlas cube of ``lm`` (see the module docstring): the ``detectors`` named (default: every one that
    applies; the importance detectors with ``importance``), on built-in tasks of about ``tokens`` tokens and
    ``n`` examples, thresholds checked against a re-initialised null (``null="reinit"``) or not (``"none"``)."""
    chosen, skipped = _selected(lm, detectors, importance)
    if not chosen:
        raise _no_detector(lm, skipped)
    slices = _run_detectors(lm, chosen, tokens, n, seed, batch_size, ctx, "", skipped)
    chosen = [m for m in chosen if m in slices]
    if not chosen:
        raise _no_detector(lm, skipped)
    nulls: dict[str, _Slice] = {}
    if null == "reinit":
        null_lm = reinitialised(lm, seed)
        try:
            with warnings.catch_warnings():  # a null model fails the tasks by design ("retrieved no needle")
                warnings.simplefilter("ignore", UserWarning)
                nulls = _run_detectors(null_lm, chosen, tokens, n, seed, batch_size, ctx, "null/", None)
        finally:
            del null_lm
    steps = {m: detector_step(m, tokens, n) for m in chosen}
    ds = cube(lm.geometry.n_layers, lm.geometry.n_heads, chosen, slices, nulls, steps)
    ds.attrs.update(model=lm.name, null=null_description(lm, seed) if null == "reinit" else "none",
                    skipped=json.dumps(skipped), tokens=tokens, n=n, seed=seed)
    return ds


# --------------------------------------------------------------------------- the cube
def _ranks(score: np.ndarray) -> np.ndarray:
    """1 for the highest score of a (layer, head) array, ties by layer then head, NaN last."""
    flat = np.where(np.isnan(score), -np.inf, score).ravel()
    order = np.lexsort((np.arange(flat.size), -flat))
    rank = np.empty(flat.size, dtype=np.int64)
    rank[order] = np.arange(1, flat.size + 1)
    return rank.reshape(score.shape)


def cube(n_layers: int, n_heads: int, names: list[str], slices: dict[str, _Slice], nulls: dict[str, _Slice],
         steps: dict[str, dict[str, Any]]) -> xr.Dataset:
    """The labelled (detector, layer, head) dataset of the module docstring from each detector's slice and its
    null slice (absent: no null)."""
    D = len(names)
    score = np.stack([slices[m].score for m in names])
    null_score = np.stack([nulls[m].score if m in nulls else np.full((n_layers, n_heads), np.nan) for m in names])
    null_mean = np.array([np.nanmean(s) if np.isfinite(s).any() else np.nan for s in null_score])
    null_std = np.array([np.nanstd(s, ddof=1) if np.isfinite(s).sum() > 1 else np.nan for s in null_score])
    default = np.array([slices[m].default if slices[m].default is not None else ATLAS_DETECTORS[m].default
                        for m in names], dtype=float)  # None: NaN
    floor = null_mean + NULL_SIGMAS * null_std
    raised = np.isfinite(floor) & (np.isnan(default) | (floor > default))
    threshold = np.where(raised, floor, default)
    source = []
    for i, m in enumerate(names):
        own = ATLAS_DETECTORS[m].source
        if raised[i]:
            above = f"above the default {default[i]:.4g}" if np.isfinite(default[i]) else "no default"
            source.append(f"null mean + {NULL_SIGMAS:g} std ({floor[i]:.4g}), {above} ({own})")
        else:
            source.append(own if np.isfinite(threshold[i]) else f"{own}; no null was run: no head is labelled")
    label = np.isfinite(score) & (score >= threshold[:, None, None])
    rank = np.stack([_ranks(s) for s in score])
    dims3 = ("detector", "layer", "head")
    ds = xr.Dataset(
        {
            "score": (dims3, score),
            "label": (dims3, label),
            "rank": (dims3, rank),
            "null_score": (dims3, null_score),
            "threshold": ("detector", threshold),
            "default_threshold": ("detector", default),
            "threshold_source": ("detector", np.array(source, dtype=object).astype(str)),
            "threshold_raised": ("detector", raised),
            "null_mean": ("detector", null_mean),
            "null_std": ("detector", null_std),
            "task": ("detector", np.array([slices[m].task for m in names]).astype(str)),
            "n_examples": ("detector", np.array([slices[m].n_examples for m in names], dtype=np.int64)),
        },
        coords={"detector": np.array(names).astype(str), "layer": np.arange(n_layers), "head": np.arange(n_heads)},
    )
    assert ds.sizes["detector"] == D
    if not nulls:  # no null was run: nothing to record (a run refuses variables that are NaN everywhere)
        ds = ds.drop_vars(["null_score", "null_mean", "null_std"])
    ds.attrs.update(method="atlas", detector_steps=json.dumps(steps), reference="docs/atlas.md")
    return ds


# --------------------------------------------------------------------------- the action
def atlas(config: AtlasConfig, ctx: StepContext) -> xr.Dataset:
    """The ``atlas`` action: :func:`build_atlas` of the step's model with the run's seed; with ``causal`` the
    causal check added (:func:`headlab.plugins.atlas.causal.causal_check`), with ``compare`` model B's atlas and the
    differences (:mod:`headlab.plugins.atlas.compare`)."""
    other = load_like(config.compare, ctx.model) if config.compare is not None else None
    options = dict(detectors=config.detectors, tokens=config.tokens, n=config.n, importance=config.importance,
                   null=config.null, seed=ctx.seed, batch_size=config.batch_size, ctx=ctx)
    ds = build_atlas(ctx.model, **options)
    if config.causal is not None:
        c = config.causal
        ds = causal_check(ctx.model, ds, k=c.k, draws=c.draws, seed=ctx.seed + c.seed, mode=c.mode,
                          batch_size=c.batch_size, progress=ctx.progress)
    if other is not None:
        try:
            ds_b = build_atlas(other, **options)
        finally:
            del other
        ds = merge_comparison(ds, compare_cubes(ds, ds_b, model_b=str(config.compare)))
    ds.attrs["example_source"] = "atlas: the built-in tasks of detector_steps"
    return ds


def atlas_spec(model: str, *, detectors: list[str] | None = None, tokens: int = 64, n: int = 8,
               importance: bool = False, null: str = "reinit", seed: int = 0, causal: bool = False,
               compare: str | None = None) -> dict[str, Any]:
    """The spec ``headlab atlas MODEL`` runs: ``model`` (a registered model's name or a local checkpoint
    directory, remote code off) and one ``atlas`` step. Bad arguments are a :class:`headlab.SpecError` naming
    the option."""
    try:
        component("models", model)
        model_spec: Any = model
    except PluginError:
        if not Path(model).expanduser().is_dir():
            raise SpecError(f"MODEL {model!r} is neither a registered model (headlab-tiny, headlab-tiny-vlm, or one a "
                            "plugin registers) nor a local checkpoint directory; give one of them",
                            source="command line") from None
        model_spec = {"path": str(Path(model).expanduser())}
    options: dict[str, Any] = {"tokens": tokens, "n": n, "importance": importance, "null": null}
    if detectors is not None:
        options["detectors"] = detectors
    if causal:
        options["causal"] = {}
    if compare is not None:
        options["compare"] = compare
    try:
        config = AtlasConfig.model_validate(options)
    except ValidationError as e:
        first = e.errors()[0]
        where = "--" + str(first["loc"][0]) if first["loc"] else "atlas"
        raise SpecError(f"{where}: {first['msg'].removeprefix('Value error, ')}", source="command line") from None
    step = config.model_dump(exclude_defaults=True)
    return {"name": "atlas", "model": model_spec, "seed": seed,
            "task": detector_step("previous_token", tokens, n)["task"], "steps": [{"id": "atlas", "atlas": step}]}


def atlas_lines(ds: xr.Dataset, top: int = 3) -> list[str]:
    """One line per detector of a cube: its threshold, how many heads it labels and its top heads."""
    lines = []
    for name in ds["detector"].values:
        d = ds.sel(detector=name)
        score, rank = d["score"].values, d["rank"].values
        best = [tuple(int(x) for x in np.argwhere(rank == r)[0]) for r in range(1, min(top, rank.size) + 1)]
        heads = ", ".join(f"L{layer}H{head} {score[layer, head]:.3f}" for layer, head in best)
        threshold = f"{float(d['threshold']):.3g}" + (" (null)" if bool(d["threshold_raised"]) else "")
        lines.append(f"{name:<18} threshold {threshold:<12} labelled "
                     f"{int(d['label'].sum()):>3}/{rank.size}  top: {heads}")
    return lines


@hookimpl
def headlab_register_commands(app: Any, run_spec: Callable[..., Any]) -> None:
    """``headlab atlas MODEL --out DIR [--detectors a,b] [--tokens N] [--n N] [--importance] [--null none]
    [--causal] [--compare B]``."""

    @app.command("atlas")
    def atlas_command(
        model: Annotated[str, typer.Argument(
            metavar="MODEL", help="headlab-tiny, headlab-tiny-vlm or a local checkpoint directory")],
        out: Annotated[str, typer.Option("--out", help="store directory: the run goes to DIR/atlas-<time>")]
        = "headlab-runs",
        detectors: Annotated[str | None, typer.Option(
            "--detectors", help=f"comma-separated subset of: {', '.join(ATLAS_DETECTORS)}")] = None,
        tokens: Annotated[int, typer.Option("--tokens", min=4, help="size of the built-in tasks in tokens")] = 64,
        n: Annotated[int, typer.Option("--n", min=1, help="examples per built-in task")] = 8,
        importance: Annotated[bool, typer.Option("--importance", help="also gradient importance and Ships")]
        = False,
        null: Annotated[str, typer.Option("--null", help="reinit (re-initialised weights, seeded) or none")]
        = "reinit",
        seed: Annotated[int, typer.Option("--seed", min=0, help="seed of the tasks and the null")] = 0,
        causal: Annotated[bool, typer.Option("--causal", help="check each labelled role by masking its top heads "
                                             "against random heads of the same layers")] = False,
        compare: Annotated[str | None, typer.Option(
            "--compare", metavar="B", help="compare with model B (same geometry): per-head score and label "
            "differences, rank correlations")] = None,
    ) -> None:
        """Label every head of MODEL by every detector that applies (docs/atlas.md)."""
        names = [m.strip() for m in detectors.split(",") if m.strip()] if detectors is not None else None
        spec = atlas_spec(model, detectors=names, tokens=tokens, n=n, importance=importance, null=null, seed=seed,
                          causal=causal, compare=compare)
        with warnings.catch_warnings():
            warnings.simplefilter("always", AtlasSkipped)
            shown = warnings.showwarning

            def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
                if issubclass(category, AtlasSkipped):
                    typer.echo(str(message), err=True)
                else:
                    shown(message, category, *args, **kwargs)

            warnings.showwarning = show
            result = run_spec(spec, out=out)
        ds = result.results["atlas"]
        for line in atlas_lines(ds):
            typer.echo(line)
        if "causal_status" in ds:
            typer.echo("causal check (effect: harm when the top heads are masked; random heads: mean +- std):")
            for line in causal_lines(ds):
                typer.echo("  " + line)
        if "score_diff" in ds:
            typer.echo(f"compared with {ds.attrs['compare_model']}:")
            for line in comparison_lines(ds):
                typer.echo("  " + line)


@hookimpl
def headlab_register_actions(register):
    register("atlas", AtlasConfig, atlas,
             description="the head atlas: every detector that applies on built-in tasks, one labelled "
             "(detector, layer, head) cube with thresholds checked against a null (docs/atlas.md)")
