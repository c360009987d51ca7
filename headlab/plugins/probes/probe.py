"""Per-head probes: how well each head's output ``z`` at one position separates the classes of a label.

Definition: docs/methods.md#per-head-probes (ITI, Li et al. 2023; SAVs, Mitra et al. 2024). The features of
head ``(l, h)`` for an example are ``z[l,h,t]``, the head's slice of the ``o_proj`` input (per query head under
grouped-query attention) at position ``t``: the prompt's last token (``position: last``), the mean over the
prompt's tokens (``mean``), or a token index into the prompt (``0`` = its first token, ``-1`` = its last).
The label is ``meta[label]`` of each example; ``group`` (optional) names a meta field whose examples always
share a fold (ITI: the question of each answer).

The examples are split into ``folds`` stratified folds (scikit-learn ``StratifiedGroupKFold`` with a group,
else ``StratifiedKFold``, both shuffled with ``seed``). For each head and fold a classifier is fitted on the
other folds and scored on the held-out one:

- ``logistic``: ``LogisticRegression(C=C, max_iter=1000, solver=solver)`` (sklearn's multinomial model for more
  than two classes); ``solver: lbfgs`` is sklearn's default (ITI's), ``newton-cholesky`` reaches the same
  L2-regularised optimum in a few Newton steps (equal predictions up to the solvers' tolerances, several times
  faster on many examples of few features);
- ``nearest_mean``: the class means of the training folds; an example goes to the class whose mean has the
  largest cosine similarity with its ``z`` (SAVs), ties to the first class.

A head's ``score`` is its mean held-out accuracy over the folds, so head selections (``heads: {from: pr, top:
48}``) rank heads by it. Directions come from all examples, for the *positive* class against the rest
(``positive``; default the last class in sorted order, ``true`` / ``1`` of a binary label): ``direction`` is
the unit mass-mean direction ``mean(z | positive) - mean(z | rest)``, ``probe_direction`` the unit weight
vector of a logistic regression (same ``C``) of positive against rest refitted on all examples (``logistic``
only), and ``sigma`` the standard deviation (``ddof=0``) of ``z . direction`` over all examples.

One forward per batch (examples of similar length batched together) records ``z`` of every head (``Probes(z_positions=...)``: the last position, the given
position, or all positions for ``mean``); the fits run over heads through joblib (``n_jobs`` worker processes: sklearn's
solvers hold the GIL on features this small, so threads run no faster than one).

Outputs: ``score``, ``accuracy_std`` (layer, head); ``direction``, ``probe_direction`` (layer, head,
head_dim); ``sigma`` (layer, head); ``class_mean`` (class, layer, head, head_dim), the mean ``z`` of each class
over all examples; ``fold`` (example), the fold each example was held out in; ``class_index`` (example), its class
index into the ``class`` coordinate. Attributes: ``forwards`` (batched forward passes), ``fits`` (classifiers
fitted), ``folds``, ``positive_class``, ``chance`` (the accuracy of always answering the most frequent
class).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

import numpy as np
import xarray as xr
from pydantic import Field

from headlab.plugin import (
    Batch,
    ComponentConfig,
    NonEmptyStr,
    Plan,
    PositiveFloat,
    PositiveInt,
    Probes,
    Seed,
    StepContext,
    forward,
    head_array,
    hookimpl,
    tokenize,
)
from headlab.resources import Estimate, EstimateContext
from headlab.spec import MAX_INT

from .fits import fit_logistic

__all__ = ["Probe", "collect_z", "detect", "fit_heads", "folds_of", "labels_of", "length_batches",
           "nearest_mean_predict"]

Label = bool | int | str
Index = Annotated[int, Field(ge=-MAX_INT, le=MAX_INT)]


class Probe(ComponentConfig):
    """Per-head classifiers of a label from each head's output z at one position (ITI, SAVs)."""

    kind: Literal["probe"] = "probe"
    label: NonEmptyStr = Field(description="the meta field holding each example's class (list it in the task's meta:)")
    group: NonEmptyStr | None = Field(
        None, description="a meta field whose examples always share a fold (ITI: the question of each answer)")
    position: Literal["last", "mean"] | Index = Field(
        "last", description="last: the prompt's last token; mean: the mean over the prompt's tokens; an index "
        "into the prompt's tokens (0 its first, -1 its last)")
    folds: int = Field(2, ge=2, le=100, description="stratified folds of the held-out accuracy")
    seed: Seed | None = Field(None, description="the shuffle of the folds (default: the run's seed)")
    classifier: Literal["logistic", "nearest_mean"] = Field(
        "logistic", description="logistic: sklearn LogisticRegression(C, max_iter=1000); nearest_mean: the "
        "class of the training mean nearest in cosine (SAVs)")
    C: PositiveFloat = Field(1.0, description="the logistic regression's inverse regularisation strength")
    solver: Literal["lbfgs", "newton-cholesky"] = Field(
        "lbfgs", description="the logistic regression's sklearn solver: lbfgs (sklearn's default, as ITI) or "
        "newton-cholesky (the same optimum in a few Newton steps; faster for many examples of few features)")
    positive: bool | Index | str | None = Field(
        None, description="the class whose direction against the rest is stored (default: the last class in "
        "sorted order, true / 1 of a binary label)")
    n_jobs: Annotated[int, Field(ge=-1024, le=1024)] | None = Field(
        None, description="joblib worker processes fitting the heads, as sklearn's n_jobs: none = 1 unless "
        "inside joblib.parallel_config, -1 = every core")
    batch_size: PositiveInt = 8

    def requires(self) -> list[str]:
        """The meta fields of the examples the probe reads."""
        return [f"meta.{self.label}"] + ([f"meta.{self.group}"] if self.group else [])

    def estimate(self, ctx: EstimateContext) -> list[Estimate]:
        """Hidden states of a batch's forward over the longest prompt (resource guard)."""
        return [ctx.activations(ctx.task.tokens, ctx.rows(self.batch_size))]


def labels_of(examples: Sequence[Any], field: str, method: str = "probe") -> tuple[list[Label], np.ndarray]:
    """The sorted classes of ``meta[field]`` and each example's class index; an error naming the first example
    without the field and one for fewer than two classes."""
    values = []
    for i, ex in enumerate(examples):
        if field not in ex.meta or ex.meta[field] is None or ex.meta[field] == "":
            raise ValueError(f"{method}: example {i} has no label field '{field}' in its meta (fields: "
                             f"{', '.join(sorted(ex.meta)) or 'none'}); list '{field}' in the task's meta: and give "
                             "it in every record")
        values.append(ex.meta[field])
    try:
        classes = sorted(set(values))
    except TypeError:  # mixed types: compare as text
        values = [str(v) for v in values]
        classes = sorted(set(values))
    if len(classes) < 2:
        raise ValueError(f"{method}: every example has {field} = {classes[0]!r}, a single class; a probe needs "
                         "examples of at least two classes")
    index = {c: k for k, c in enumerate(classes)}
    return classes, np.array([index[v] for v in values], dtype=np.int64)


def folds_of(y: np.ndarray, groups: Sequence[Any] | None, folds: int, seed: int, field: str = "label",
             classes: Sequence[Any] | None = None, method: str = "probe") -> np.ndarray:
    """The fold (0 .. folds-1) each example is held out in: stratified by ``y``, shuffled with ``seed``, and
    with ``groups`` never split (scikit-learn ``StratifiedGroupKFold``, else ``StratifiedKFold``)."""
    from sklearn.model_selection import StratifiedGroupKFold, StratifiedKFold

    counts = np.bincount(y)
    if counts.min() < folds:
        k = int(counts.argmin())
        name = repr(classes[k]) if classes is not None else k
        raise ValueError(f"{method}: class {field} = {name} has {counts.min()} example(s), fewer than folds: "
                         f"{folds}; give every class at least {folds} examples or lower folds")
    fold = np.full(len(y), -1, dtype=np.int64)
    if groups is None:
        splitter = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
        splits = splitter.split(np.zeros(len(y)), y)
    else:
        n_groups = len(set(groups))
        if n_groups < folds:
            raise ValueError(f"{method}: the examples form {n_groups} group(s), fewer than folds: {folds}, so a fold "
                             "would be empty; give more groups or lower folds")
        codes = np.unique(np.asarray([str(g) for g in groups]), return_inverse=True)[1]
        splitter = StratifiedGroupKFold(n_splits=folds, shuffle=True, random_state=seed)
        splits = splitter.split(np.zeros(len(y)), y, codes)
    for k, (_, test) in enumerate(splits):
        fold[test] = k
    for k in range(folds):
        held = fold == k
        if not held.any() or len(np.unique(y[~held])) < 2:
            what = "holds no example" if not held.any() else "leaves a single class to train on"
            raise ValueError(f"{method}: fold {k} {what} (groups too large or too few for {folds} folds); use "
                             "more, smaller groups or lower folds")
    return fold


def _rows_positions(batch: Batch, position: int) -> list[int]:
    """The padded position of each row's probed token (``position`` an index into the prompt); an error naming
    the first row whose prompt is too short."""
    out = []
    for r, pad in enumerate(batch.pad):
        n = batch.length - pad
        j = position if position >= 0 else n + position
        if not 0 <= j < n:
            raise IndexError(r, n)
        out.append(pad + j)
    return out


def collect_z(lm: Any, batch: Batch, position: str | int = "last") -> np.ndarray:
    """``z`` of every head at ``position`` for the rows of a left-padded batch, in one forward: (row, layer, head,
    head_dim), float64. ``last``: each prompt's last token; ``mean``: the mean over each prompt's tokens; an int:
    a token index into each prompt (negative from its end)."""
    if position == "last":
        _, rec = forward(lm, batch, Plan(probes=Probes(z_positions="last")), logits_to_keep=1)
        return rec.z[:, :, :, -1].double().cpu().numpy()
    if position == "mean":
        _, rec = forward(lm, batch, Plan(probes=Probes(z_positions="all")), logits_to_keep=1)
        z = rec.z.double()  # (B, L, H, T, D)
        mask = batch.attention_mask.to(z.device).double()[:, None, None, :, None]
        return ((z * mask).sum(3) / mask.sum(3)).cpu().numpy()
    wanted = _rows_positions(batch, int(position))
    keep = sorted(set(wanted))
    _, rec = forward(lm, batch, Plan(probes=Probes(z_positions=keep)), logits_to_keep=1)
    at = {p: k for k, p in enumerate(rec.z_positions)}
    z = rec.z.double().cpu().numpy()
    return np.stack([z[r, :, :, at[p]] for r, p in enumerate(wanted)])


def length_batches(lm: Any, examples: Sequence[Any], batch_size: int) -> list[list[int]]:
    """Example indices in batches of ``batch_size``, examples of similar token length together (less padding);
    examples with images keep their order."""
    if lm.tokenizer is None or any(ex.images for ex in examples):
        order = list(range(len(examples)))
    else:
        lengths = [len(ex.input_ids) if ex.input_ids is not None else len(lm.tokenizer(ex.prompt).input_ids)
                   for ex in examples]
        order = sorted(range(len(examples)), key=lambda i: (lengths[i], i))
    return [order[j:j + batch_size] for j in range(0, len(order), batch_size)]


def nearest_mean_predict(means: np.ndarray, z: np.ndarray) -> np.ndarray:
    """The class ``argmax_c cos(z, means[c])`` of each row of ``z`` (..., n, D) for class means (..., C, D); ties
    to the first class."""
    norms = np.linalg.norm(means, axis=-1, keepdims=True)
    unit = means / np.where(norms > 0, norms, 1.0)
    return np.argmax(np.einsum("...nd,...cd->...nc", z, unit), axis=-1)


def fit_heads(z: np.ndarray, y: np.ndarray, fold: np.ndarray, n_folds: int, *, classifier: str = "logistic",
              C: float = 1.0, positive: int = 1, n_jobs: int | None = None, progress: Any = None,
              solver: str = "lbfgs") -> tuple[np.ndarray, np.ndarray | None, int]:
    """Held-out accuracies ``(fold, layer, head)``, the probe directions ``(layer, head, D)`` (``logistic``;
    ``None`` for ``nearest_mean``) and the number of classifiers fitted, for ``z`` (example, layer, head, D)."""
    n, L, H, D = z.shape
    n_classes = int(y.max()) + 1
    if classifier == "nearest_mean":
        acc = np.empty((n_folds, L, H))
        for k in range(n_folds):
            train, test = fold != k, fold == k
            means = np.stack([z[train & (y == c)].mean(0) for c in range(n_classes)], axis=2)  # (L, H, C, D)
            pred = nearest_mean_predict(means, z[test].transpose(1, 2, 0, 3))  # (L, H, n_test)
            acc[k] = (pred == y[test]).mean(-1)
        return acc, None, 0
    from joblib import Parallel, delayed

    heads = [(layer, head) for layer in range(L) for head in range(H)]
    jobs = (delayed(fit_logistic)(np.ascontiguousarray(z[:, layer, head]), y, fold, n_folds, C, positive,
                                  solver)
            for layer, head in heads)
    results = Parallel(n_jobs=n_jobs, prefer="processes", return_as="generator")(jobs)
    if progress is not None:
        results = progress(results, "probe fits", total=len(heads))
    acc = np.empty((n_folds, L, H))
    probe_direction = np.empty((L, H, D))
    for (layer, head), (a, w) in zip(heads, results, strict=True):
        acc[:, layer, head] = a
        probe_direction[layer, head] = w
    return acc, probe_direction, len(heads) * (n_folds + 1)


def _positive_index(config: Probe, classes: list[Label]) -> int:
    if config.positive is None:
        return len(classes) - 1
    for k, c in enumerate(classes):
        if c == config.positive or str(c) == str(config.positive):
            return k
    raise ValueError(f"probe: positive {config.positive!r} is not a class of {config.label} (classes: "
                     f"{', '.join(repr(c) for c in classes)})")


def detect(config: Probe, ctx: StepContext) -> xr.Dataset:
    """The ``probe`` detector over the task's labelled examples."""
    examples = ctx.examples
    classes, y = labels_of(examples, config.label)
    positive = _positive_index(config, classes)
    groups = None
    if config.group is not None:
        for i, ex in enumerate(examples):
            if config.group not in ex.meta:
                raise ValueError(f"probe: example {i} has no group field '{config.group}' in its meta; list "
                                 f"'{config.group}' in the task's meta: and give it in every record")
        groups = [ex.meta[config.group] for ex in examples]
    seed = ctx.seed if config.seed is None else config.seed
    fold = folds_of(y, groups, config.folds, seed, config.label, classes)

    chunks = length_batches(ctx.model, examples, config.batch_size)
    z = None
    for idx in ctx.progress(chunks, "probe forwards"):
        batch = tokenize(ctx.model, [examples[i] for i in idx])
        try:
            part = collect_z(ctx.model, batch, config.position)
        except IndexError as e:
            row, length = e.args
            raise ValueError(f"probe: position {config.position} is outside example {idx[row]}'s prompt of {length} "
                             "tokens; choose a position inside every prompt (0 .. its length - 1, or negative from "
                             "its end)") from None
        if z is None:
            z = np.empty((len(examples), *part.shape[1:]))
        z[idx] = part  # (example, layer, head, D)
    n = len(examples)

    acc, probe_direction, fits = fit_heads(z, y, fold, config.folds, classifier=config.classifier, C=config.C,
                                           positive=positive, n_jobs=config.n_jobs, progress=ctx.progress,
                                           solver=config.solver)
    is_pos = y == positive
    mass_mean = z[is_pos].mean(0) - z[~is_pos].mean(0)  # (L, H, D)
    norms = np.linalg.norm(mass_mean, axis=-1, keepdims=True)
    direction = mass_mean / np.where(norms > 0, norms, 1.0)
    sigma = np.einsum("nlhd,lhd->nlh", z, direction).std(0)
    class_mean = np.stack([z[y == c].mean(0) for c in range(len(classes))])

    per_fold = head_array(acc, "fold_index")
    L, H = acc.shape[1:]
    head_coords = {"layer": np.arange(L), "head": np.arange(H)}
    head_vec = lambda a: xr.DataArray(a, dims=("layer", "head", "head_dim"), coords=head_coords)  # noqa: E731
    ds = xr.Dataset({
        "score": per_fold.mean("fold_index"),
        "accuracy_std": per_fold.std("fold_index"),
        "direction": head_vec(direction),
        "sigma": head_array(sigma),
        "class_mean": xr.DataArray(class_mean, dims=("class", "layer", "head", "head_dim"),
                                   coords={"class": np.asarray(classes), **head_coords}),
        "fold": xr.DataArray(fold, dims=("example",)),
        "class_index": xr.DataArray(y, dims=("example",)),
    })
    if probe_direction is not None:
        ds["probe_direction"] = head_vec(probe_direction)
    chance = float(np.bincount(y).max() / n)
    ds.attrs.update(method="probe", model=ctx.model.name, label=config.label, group=config.group or "",
                    position=str(config.position), classifier=config.classifier, C=float(config.C),
                    solver=config.solver,
                    folds=int(config.folds), seed=int(seed), positive_class=str(classes[positive]),
                    forwards=len(chunks), fits=int(fits), chance=chance, reference="docs/methods.md#per-head-probes")
    return ds


@hookimpl
def headlab_register_detectors(register):
    register(Probe, detect)
