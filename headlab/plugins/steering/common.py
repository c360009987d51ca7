"""What every steering plugin shares: head resolution, and who edits what in a plan.

Several steering methods of one ``generate`` step add edits to the same :class:`headlab.instrument.Plan`
(the runner calls each in turn). They compose when they touch different heads, or the same head in
different ways (a PASTA key bias and a query mask act at different points of the attention). Two methods
editing the same (layer, head) the same way on overlapping batch rows is a conflict: the result would
depend on how the plan happens to combine the two edits (scales multiply, biases add), which is almost
never what was meant. Each method passes ``owner=config`` when it adds an edit, and the plan itself
rejects a conflict with :class:`headlab.instrument.SteeringConflictError` naming both methods, the head
and the kind of edit (``key_bias``: PASTA; ``q_scale``: query masking or scaling; ``score_zero``: score
masking; ``out_scale``: output ablation or scaling, value scaling, VHR's layer callback).
"""

from __future__ import annotations

from typing import Any

from headlab import SteeringConflictError, from_pasta_json
from headlab.plugin import Plan

__all__ = ["SteeringConflictError", "claims", "resolve_heads"]


def claims(plan: Plan) -> dict[tuple[int, int | None, str], list[str]]:
    """Who edits what in ``plan``: ``(layer, head, kind) -> owner names``, over the edits that have an owner
    (``head`` None: every head of the layer; ``kind`` as :attr:`headlab.instrument.Edit.kind`)."""
    out: dict[tuple[int, int | None, str], list[str]] = {}
    for e in plan.edits:
        if e.owner is None or e.heads is None:
            continue
        for layer, head in e.heads:
            names = out.setdefault((layer, head, e.kind), [])
            if e.owner not in names:
                names.append(e.owner)
    return out


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
