"""What every steering plugin shares: head resolution and the composition check.

Several steering methods of one ``generate`` step add edits to the same :class:`headlab.instrument.Plan`
(the runner calls each in turn). They compose when they touch different heads, or the same head in
different ways (a PASTA key bias and a query mask act at different points of the attention). Two methods
editing the same (layer, head) the same way on overlapping batch rows is a conflict: the result would
depend on how the plan happens to combine the two edits (scales multiply, biases add), which is almost
never what was meant, so :func:`claim` rejects it with :class:`SteeringConflictError` naming both methods,
the head and the kind of edit.

Edit kinds (the instrument's edit tensors): ``key_bias`` (pre-softmax key biases: PASTA), ``q_scale``
(query masking or scaling), ``score_zero`` (score masking), ``out_scale`` (output ablation or scaling,
value scaling, VHR).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from headlab.heads import from_pasta_json

EDIT_KINDS = {
    "key_bias": "pre-softmax key bias",
    "q_scale": "query scale/mask",
    "score_zero": "score mask",
    "out_scale": "output scale/mask",
}

_CLAIMS = "_headlab_steering_claims"


class SteeringConflictError(ValueError):
    """Two steering methods of one step edit the same head the same way."""


def _owner_name(config: Any) -> str:
    return str(getattr(config, "kind", type(config).__name__))


def claim(plan: Any, config: Any, kind: str, heads: Iterable[tuple[int, int]],
          rows: Sequence[int] | None = None) -> None:
    """Record that the steering method ``config`` edits ``heads`` with edit ``kind`` on ``rows``.

    ``config`` identifies the method instance (the same config object may claim repeatedly); ``rows=None``
    means every row of the batch. Raises :class:`SteeringConflictError` when another method of the same plan
    already claimed one of these (layer, head) pairs with the same ``kind`` on an overlapping row.
    """
    if kind not in EDIT_KINDS:
        raise ValueError(f"unknown edit kind {kind!r}; one of {sorted(EDIT_KINDS)}")
    claims: dict[tuple[int, int, str], list[tuple[int, str, frozenset[int] | None]]] = \
        plan.__dict__.setdefault(_CLAIMS, {})
    row_set = None if rows is None else frozenset(int(r) for r in rows)
    owner = id(config)
    for layer, head in heads:
        key = (int(layer), int(head), kind)
        for other, other_name, other_rows in claims.get(key, []):
            if other == owner:
                continue
            overlap = row_set is None or other_rows is None or bool(row_set & other_rows)
            if overlap:
                raise SteeringConflictError(
                    f"steering conflict: '{other_name}' and '{_owner_name(config)}' both apply a "
                    f"{EDIT_KINDS[kind]} to head ({layer}, {head}) on the same batch rows; steer each head "
                    "with at most one method of a kind (split the heads between the methods)")
        claims.setdefault(key, []).append((owner, _owner_name(config), row_set))


def claims(plan: Any) -> dict[tuple[int, int, str], list[str]]:
    """The claims recorded on ``plan``: (layer, head, kind) -> names of the methods that claimed it."""
    return {k: [name for _, name, _ in v] for k, v in plan.__dict__.get(_CLAIMS, {}).items()}


def resolve_heads(ctx: Any, selection: Any) -> list[tuple[int, int]]:
    """Heads of a steering config's ``heads``: any spec head selection (``ctx.heads``), or a PASTA list of
    layers (every head of those layers)."""
    if isinstance(selection, list) and selection and all(isinstance(x, int) for x in selection):
        geo = ctx.model.geometry
        heads = from_pasta_json(list(selection), geo)
        bad = [ly for ly in selection if not 0 <= ly < geo.n_layers]
        if bad:
            raise ValueError(f"layers {bad} are outside this model ({geo.n_layers} layers)")
        return heads
    return [(int(a), int(b)) for a, b in ctx.heads(selection)]
