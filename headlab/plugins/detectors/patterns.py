"""Pattern detectors: previous-token, duplicate-token and induction heads, and any custom detection pattern.

Definition: docs/methods.md#pattern-detectors. A detection pattern
``D`` (queries x keys, 0/1) is compared with each head's attention ``A``: ``mul`` scores
``sum(A * D) / sum(A)``, ``abs`` scores ``1 - sum|A - D| / n``. ``exclude_bos`` zeroes ``A[:, 0]``,
``exclude_current_token`` zeroes the diagonal. Scores are averaged over the task's sequences.

A detection pattern is handled as the list of its ones, ``(query, key)`` pairs (:func:`detection_pairs`;
previous-token: ``n - 1`` pairs, a random sequence repeated twice: about ``n / 2`` plus the chance
repeats), never as an ``n x n`` matrix. The detectors record, in one instrumented forward, the attention
at those pairs (``Probes(pairs=...)``, the kernels' sparse probe: memory O(n + pairs), any length), plus the
diagonal ``A[i, i]`` when ``exclude_current_token``, and two span masses per query (``A[i, 0]`` and the
row total); :func:`headlab.pattern_scores.pair_scores` computes from them exactly what
:func:`headlab.pattern_scores.similarity` computes on the full pattern (the atlas scores its shared pass with it). ``probe: pattern`` records the full attention instead (memory ``n^2`` per head; for checks on
short inputs). The result's ``attrs["probe"]`` says which ran (``"pairs"`` or ``"pattern"``).

Custom patterns (kind ``pattern``): ``pattern`` names an entry of :data:`PATTERNS` (the three above, or one
a user added), a ``"module:function"`` import path, or (from Python) a function; the function takes one
example's token ids (1-D int64 tensor) and returns the pattern's ones: an integer (P, 2) tensor / array /
list of ``(query, key)`` pairs, a tuple ``(queries, keys)`` of two 1-D arrays, or (TransformerLens style) a
bool or 0/1 float (n, n) matrix.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch
import xarray as xr
from pydantic import Field, field_serializer
from pydantic.json_schema import SkipJsonSchema

from headlab.pattern_scores import pair_scores, similarity
from headlab.plugin import (
    ComponentConfig,
    Plan,
    PositiveInt,
    Probes,
    StepContext,
    forward,
    head_array,
    hookimpl,
    tokenize,
)
from headlab.resources import Estimate, EstimateContext

PatternFunction = Callable[[torch.Tensor], Any]


class _Pattern(ComponentConfig):
    error_measure: Literal["mul", "abs"] = Field("mul", description="mul: sum(A*D)/sum(A); abs: 1 - sum|A-D|/n")
    exclude_bos: bool = Field(False, description="zero attention to the first token")
    exclude_current_token: bool = Field(False, description="zero attention to the query's own token")
    batch_size: PositiveInt = 8
    probe: Literal["pairs", "pattern"] = Field(
        "pairs", description="pairs: the attention at the pattern's (query, key) pairs (memory linear in length); "
        "pattern: the full attention pattern (memory n^2 per head; short inputs only)")

    def estimate(self, ctx: EstimateContext) -> list[Estimate]:
        """The full attention patterns of a batch when ``probe: pattern`` (resource guard); the pair probes
        take memory linear in length."""
        rows, n = ctx.rows(self.batch_size), ctx.task.tokens
        if self.probe != "pattern":
            return [ctx.activations(n, rows, "hidden states of a batch's forward")]
        return [ctx.attention(n, n, rows, "full attention patterns")]


class PreviousToken(_Pattern):
    """Heads that attend to the previous token."""

    kind: Literal["previous_token"] = "previous_token"


class DuplicateToken(_Pattern):
    """Heads that attend to earlier copies of the current token."""

    kind: Literal["duplicate_token"] = "duplicate_token"


class Induction(_Pattern):
    """Heads that attend to the token after an earlier copy of the current token."""

    kind: Literal["induction"] = "induction"


class CustomPattern(_Pattern):
    """Heads whose attention matches a detection pattern given by name, import path or function."""

    kind: Literal["pattern"] = "pattern"
    pattern: str | SkipJsonSchema[PatternFunction] = Field(
        ..., description="a name in PATTERNS (previous_token, duplicate_token, induction, or one you added) or "
        "'module:function'; the function maps one example's token ids to the pattern's (query, key) pairs")

    @field_serializer("pattern")
    def _name_of(self, pattern: Any) -> str:
        return pattern if isinstance(pattern, str) else pattern_name(pattern)


# --------------------------------------------------------------------------- detection patterns as pairs
def _earlier_copies(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every ``(i, j)`` with ``j < i`` and ``tokens[j] == tokens[i]``, in O(n log n + pairs)."""
    t = torch.as_tensor(tokens).long().cpu().reshape(-1)
    n = t.shape[0]
    if n == 0:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty
    order = torch.sort(t, stable=True).indices  # positions grouped by token, increasing within a group
    st = t[order]
    new = torch.ones(n, dtype=torch.bool)
    new[1:] = st[1:] != st[:-1]
    first = torch.where(new, torch.arange(n), torch.zeros(n, dtype=torch.long)).cummax(0).values
    rank = torch.arange(n) - first  # place within its token's group
    qs, ks = [], []
    idx = (rank >= 1).nonzero().squeeze(-1)
    lag = 1
    while idx.numel():  # each round pairs every copy with the copy `lag` places before it
        qs.append(order[idx])
        ks.append(order[idx - lag])
        lag += 1
        idx = idx[rank[idx] >= lag]
    if not qs:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty
    return torch.cat(qs), torch.cat(ks)


def previous_token_pairs(tokens: torch.Tensor) -> torch.Tensor:
    """Previous-token pattern: ``(i, i - 1)`` for ``i >= 1``."""
    i = torch.arange(1, len(tokens))
    return torch.stack([i, i - 1], -1)


def duplicate_token_pairs(tokens: torch.Tensor) -> torch.Tensor:
    """Duplicate-token pattern: ``(i, j)`` for every earlier copy ``j < i`` of token ``i``."""
    q, k = _earlier_copies(tokens)
    return torch.stack([q, k], -1)


def induction_pairs(tokens: torch.Tensor) -> torch.Tensor:
    """Induction pattern: ``(i, j + 1)`` for every earlier copy ``j < i`` of token ``i`` (the token after it)."""
    q, k = _earlier_copies(tokens)
    return torch.stack([q, k + 1], -1)


#: detection patterns by name: a function of one example's token ids returning the pattern's ones (see the
#: module docstring for the forms it may return); add an entry to use a new name in specs
PATTERNS: dict[str, PatternFunction] = {
    "previous_token": previous_token_pairs,
    "duplicate_token": duplicate_token_pairs,
    "induction": induction_pairs,
}


def pattern_name(pattern: str | PatternFunction) -> str:
    """A pattern's name: the name itself, or ``module:qualname`` of a function."""
    if isinstance(pattern, str):
        return pattern
    return f"{getattr(pattern, '__module__', '?')}:{getattr(pattern, '__qualname__', repr(pattern))}"


def resolve_pattern(pattern: str | PatternFunction) -> PatternFunction:
    """The function of a pattern given by name (:data:`PATTERNS`), ``"module:function"`` or as a function."""
    if callable(pattern):
        return pattern
    if pattern in PATTERNS:
        return PATTERNS[pattern]
    if ":" in pattern:
        module, _, attr = pattern.partition(":")
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        if not callable(obj):
            raise ValueError(f"detection pattern {pattern!r} is not a function")
        return obj
    raise ValueError(f"unknown detection pattern {pattern!r}: give one of {sorted(PATTERNS)} or 'module:function'")


def detection_pairs(pattern: str | PatternFunction, tokens: torch.Tensor) -> torch.Tensor:
    """The ones of the detection pattern for one token sequence, as distinct ``(query, key)`` pairs: a (P, 2)
    int64 tensor sorted by query, then key. Raises ``ValueError`` for pairs outside ``0..n-1`` or a matrix
    with values other than 0 and 1."""
    tokens = torch.as_tensor(tokens).long().cpu().reshape(-1)
    n = tokens.shape[0]
    got = resolve_pattern(pattern)(tokens)
    if isinstance(got, tuple) and len(got) == 2:
        pairs = torch.stack([torch.as_tensor(got[0]).long().reshape(-1), torch.as_tensor(got[1]).long().reshape(-1)],
                            -1)
    else:
        t = torch.as_tensor(np.asarray(got) if isinstance(got, list) else got)
        if (t.dtype.is_floating_point or t.dtype == torch.bool) and t.dim() == 2 and t.shape == (n, n):
            if not bool(((t == 0) | (t == 1)).all()):
                raise ValueError("a detection pattern matrix must hold only 0 and 1")
            pairs = t.nonzero()
        else:
            if t.dtype.is_floating_point or t.dtype == torch.bool:
                raise ValueError(f"detection pattern pairs must be integers (or an ({n}, {n}) 0/1 matrix)")
            pairs = t.long().reshape(-1, 2) if t.numel() else torch.zeros(0, 2, dtype=torch.long)
    if pairs.numel() and (int(pairs.min()) < 0 or int(pairs.max()) >= n):
        raise ValueError(f"detection pattern pairs must lie in 0..{n - 1}")
    code = torch.unique(pairs[:, 0] * n + pairs[:, 1], sorted=True)  # distinct, by query then key
    return torch.stack([code // max(n, 1), code % max(n, 1)], -1)


def detection_pattern(pattern: str | PatternFunction, tokens: torch.Tensor) -> torch.Tensor:
    """The dense (n x n) float detection pattern ``D`` for one token sequence (built only for the full-pattern
    path and checks)."""
    n = len(tokens)
    d = torch.zeros(n, n)
    pairs = detection_pairs(pattern, tokens)
    d[pairs[:, 0], pairs[:, 1]] = 1.0
    return d


# --------------------------------------------------------------------------- scores
# --------------------------------------------------------------------------- the detector
def detect(config: _Pattern, ctx: StepContext) -> xr.Dataset:
    """Score every head of the model against the pattern, per example and averaged."""

    pattern = config.pattern if isinstance(config, CustomPattern) else config.kind
    geo = ctx.model.geometry
    scores = np.zeros((len(ctx.examples), geo.n_layers, geo.n_heads))
    by_len: dict[int, list[int]] = {}
    for i, ex in enumerate(ctx.examples):
        n = len(ex.input_ids) if ex.input_ids is not None else len(ctx.model.tokenizer(ex.prompt)["input_ids"])
        by_len.setdefault(n, []).append(i)
    groups = [idx[j: j + config.batch_size] for idx in by_len.values() for j in range(0, len(idx), config.batch_size)]
    use_pairs = config.probe == "pairs"
    ex_cur = config.exclude_current_token
    for idx in ctx.progress(groups, f"{pattern_name(pattern)} heads"):
        batch = tokenize(ctx.model, [ctx.examples[i] for i in idx])
        ids = batch.input_ids.cpu()
        n = ids.shape[1]
        pairs = [detection_pairs(pattern, ids[r]) for r in range(len(idx))]
        if use_pairs:  # A at D's ones (then at the diagonal), A[:, 0] and the row totals
            diag = torch.arange(n)[:, None].expand(n, 2)
            probe_pairs = [torch.cat([p, diag]) if ex_cur else p for p in pairs]
            probes = Probes(pairs=probe_pairs, spans=[(0, 1), (0, n)])
        else:
            probes = Probes(pattern=True)
        _, rec = forward(ctx.model, batch, Plan(probes=probes), logits_to_keep=1)
        if use_pairs:
            pm = rec.pair_mass.cpu()  # (example, layer, head, pair)
            sm = rec.span_mass.cpu()  # (example, layer, head, query, 2)
            for r, i in enumerate(idx):
                n_d = pairs[r].shape[0]
                scores[i] = pair_scores(pm[r, ..., :n_d], pairs[r], sm[r, ..., 0], sm[r, ..., 1],
                                        config.error_measure, config.exclude_bos, ex_cur,
                                        diag_mass=pm[r, ..., n_d:n_d + n] if ex_cur else None).numpy()
            continue
        pat = rec.pattern.float().cpu()  # (example, layer, head, query, key)
        for r, i in enumerate(idx):
            det = torch.zeros(n, n)
            det[pairs[r][:, 0], pairs[r][:, 1]] = 1.0
            scores[i] = similarity(pat[r], det, config.error_measure, config.exclude_bos, ex_cur).numpy()
    per_example = head_array(scores, "example")
    ds = xr.Dataset({"score": per_example.mean("example"), "example_score": per_example})
    ds.attrs.update(method=config.kind, pattern=pattern_name(pattern), error_measure=config.error_measure,
                    model=ctx.model.name, reference="docs/methods.md#pattern-detectors",
                    probe=config.probe if groups else "none")
    return ds


@hookimpl
def headlab_register_detectors(register):
    for config in (PreviousToken, DuplicateToken, Induction, CustomPattern):
        register(config, detect)
