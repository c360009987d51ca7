"""The one mechanism that reads and edits attention heads during a forward pass.

headlab registers an attention implementation named ``"headlab"`` with transformers'
``AttentionInterface`` (and a mask function of the same name with ``AttentionMaskInterface``; without it a
newly registered attention function receives ``attention_mask=None`` for left-padded batches). Models are
loaded with ``attn_implementation="headlab"`` after :func:`register`. Outside an :func:`instrument`
context, or for a layer the active :class:`Plan` does not touch, the function calls transformers' SDPA
attention exactly, so logits are identical to ``attn_implementation="sdpa"``. Inside a context,
:func:`headlab.kernels.choose_backend` decides each layer's path: that same SDPA call when the plan's edits
on the layer are only query/output scales (applied around it) and nothing reads the layer's outputs, else
:func:`headlab.kernels.attention` with the plan's edits and probes for that layer.

Example::

    from headlab import instrument as ins
    ins.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=ins.ATTN_IMPLEMENTATION)
    plan = ins.Plan(probes=ins.Probes(argmax=True, spans=[(10, 20)]))
    plan.mask_heads([(3, 1), (5, 0)], rows=[1], mode="query")  # row 1 masked, row 0 base, one forward
    with ins.instrument(model, plan) as rec:
        model(**batch)
    rec.argmax       # (example, layer, head, query) int64 tensor, absolute key positions
    rec.to_xarray("argmax")  # the same as an xarray.DataArray with named dims and coordinates

Positions: every position (queries, probe spans, key spans, argmax) is an absolute position in the
(left-padded) input sequence, counting from 0 at the first token of the first forward inside the context;
in ``generate`` the prompt is positions ``0..N-1`` and the query of decode step ``t`` is ``N - 1 + t``.
Nothing is monkey-patched: the active plan lives in a ``contextvars.ContextVar``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
import torch
import xarray as xr
from torch import Tensor

from headlab.kernels import HeadEdits, ProbeRequest, choose_backend
from headlab.kernels import attention as kernel_attention
from headlab.kernels.attention import visibility

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DIMS",
    "Edit",
    "KeyBias",
    "LayerCallback",
    "LayerContext",
    "OutputScale",
    "Plan",
    "Probes",
    "QueryScale",
    "Recording",
    "ScoreZero",
    "SteeringConflictError",
    "UnsupportedModelError",
    "attention_forward",
    "instrument",
    "register",
    "shared_trunk",
    "expand_cache",
    "decoder_layers",
    "per_row_spans",
    "span_tensor",
]

ATTN_IMPLEMENTATION = "headlab"

#: dimension names of every array a :class:`Recording` returns, in axis order (names from
#: :data:`headlab.DIMENSIONS`; the ``example`` axis is the batch row)
DIMS: dict[str, tuple[str, ...]] = {
    "argmax": ("example", "layer", "head", "query"),
    "argmax_prob": ("example", "layer", "head", "query"),
    "entropy": ("example", "layer", "head", "query"),
    "span_mass": ("example", "layer", "head", "query", "span"),
    "offset_mass": ("example", "layer", "head", "query", "offset"),
    "pair_mass": ("example", "layer", "head", "pair"),
    "z": ("example", "layer", "head", "position", "head_dim"),
    "pattern": ("example", "layer", "head", "query", "key"),
}

# model types whose attention headlab cannot honour (ALiBi, learned position biases, attention sinks,
# cross-attention): refused with one clear error rather than computed silently wrong
_REFUSED_MODEL_TYPES = {
    "bloom": "ALiBi position biases",
    "falcon": "ALiBi / custom attention",
    "mpt": "ALiBi position biases",
    "t5": "relative position biases",
    "mt5": "relative position biases",
    "umt5": "relative position biases",
    "gpt_oss": "attention sinks",
    "longt5": "relative position biases",
}
_REFUSED_KWARGS = ("position_bias", "s_aux", "sinks", "alibi", "alibi_slopes")


class UnsupportedModelError(RuntimeError):
    """The model's attention has a feature headlab's kernels cannot honour."""


# --------------------------------------------------------------------------- plan
HeadSpec = Sequence[tuple[int, int | None]]


@dataclass
class Probes:
    """What to record, per (batch row, layer, head, query).

    - ``argmax``: top-1 key position and its probability (``Recording.argmax``, ``.argmax_prob``).
    - ``entropy``: attention row entropy in nats.
    - ``spans``: key spans ``[start, end)`` in absolute positions whose attention mass is recorded: a list of
      ``(start, end)`` shared by all rows, a per-row list of such lists (rows with fewer spans are padded with
      empty spans), or a (batch, span, 2) tensor.
    - ``offsets``: relative key offsets ``delta >= 0``; for every query at position ``t`` the attention to the
      key at ``t - delta`` is recorded (``Recording.offset_mass``; 0 = the query's own token, 1 = the previous
      token; 0 where ``t - delta < 0``): a list of ints shared by all rows, a per-row list of such lists (rows
      with fewer offsets are padded with unused slots, mass 0), or a (batch, offset) int tensor with ``-1``
      for unused slots (a 1-D tensor is shared by all rows). Relative, so decode steps and the full forward record the same values.
    - ``z_positions``: head outputs ``z`` (before ``o_proj``, after edits) to keep: ``None`` (none),
      ``"last"`` (the last query of every forward call: the prompt's last position, then each generated
      step), ``"all"``, or a list of absolute positions.
    - ``pattern``: the full attention (only for small inputs).
    - ``pairs``: (query, key) absolute position pairs whose attention ``A[query, key]`` is recorded
      (``Recording.pair_mass``; a sparse probe: any set of cells of the pattern, memory O(pairs)): a list of
      ``(query, key)`` shared by all rows, a per-row list of such lists (or of (P, 2) arrays; rows with
      fewer pairs are padded with unused slots, mass 0), a (P, 2) / (batch, P, 2) int tensor with ``-1`` for
      unused slots, or a function ``pairs(start, stop)`` returning one of these for the queries in
      ``[start, stop)`` (called once per forward call: the whole input, then each ``generate`` step). Each
      call records the pairs whose query it runs, in the order given; a key the query cannot see reads 0.
    - ``layers``: the layers to probe (``None`` = all).
    """

    argmax: bool = False
    entropy: bool = False
    spans: Any = None
    z_positions: Literal["last", "all"] | Sequence[int] | None = None
    pattern: bool = False
    layers: Sequence[int] | None = None
    offsets: Any = None
    pairs: Any = None

    def any(self) -> bool:
        return bool(self.argmax or self.entropy or self.spans is not None or self.z_positions is not None
                    or self.pattern or self.offsets is not None or self.pairs is not None)

    def covers(self, layer: int) -> bool:
        return self.any() and (self.layers is None or layer in self.layers)


@dataclass
class LayerContext:
    """What a :meth:`Plan.on_layer` callback receives besides the layer index and ``z``.

    ``call``: how many times this layer ran before in this context (0 = prefill / first forward, then one per
    generation step); ``q_start``: absolute position of the first query; ``n_queries``; ``store``: a dict
    shared by all calls of all layers in this context (for the callback's own state). ``attend(key_spans,
    key_bias)``: recompute this call's head outputs ``z`` (B, H, Nq, D) with the same inputs, masks and plan
    edits plus extra pre-softmax key biases (``key_spans`` (B, S, 2) absolute positions, ``key_bias``
    broadcastable to (B, H, S)); VHR uses it for the head outputs without a segment (a large negative bias).
    """

    layer: int
    call: int
    q_start: int
    n_queries: int
    store: dict
    attend: Callable[..., Tensor] | None = None


LayerFunction = Callable[[int, Tensor, LayerContext], "Tensor | None"]
Head = tuple[int, int | None]


class SteeringConflictError(ValueError):
    """Two owners (steering methods) add the same kind of edit to one head on overlapping batch rows."""


class Edit:
    """Base of the typed edits a :class:`Plan` holds in :attr:`Plan.edits`.

    Every edit has ``heads`` (``(layer, head)`` pairs; ``(layer, None)`` = every head of the layer),
    ``rows`` (the batch rows it applies to; ``None`` = all), ``owner`` (the name of the method that added
    it, or ``None``) and ``instance`` (which use of that method added it: a config object, compared by
    identity; ``None`` when the name alone identifies the owner). Passing a method's config as ``owner``
    sets both: the name from its ``kind``, the instance to the config itself.

    ``kind`` (class attribute) is what the edit changes, for the conflict check: ``q_scale``,
    ``score_zero``, ``out_scale`` or ``key_bias``; ``description`` words it for messages.
    """

    kind: ClassVar[str] = ""
    description: ClassVar[str] = ""
    heads: list[Head] | None
    rows: list[int] | None
    owner: str | None
    instance: Any

    def __post_init__(self) -> None:
        """Normalise ``heads`` and ``rows``; a config as ``owner`` sets ``owner`` and ``instance``."""
        if self.heads is not None:
            self.heads = _heads(self.heads)
        self.rows = _rows(self.rows)
        if self.owner is not None and not isinstance(self.owner, str):
            self.owner, self.instance = _owner_name(self.owner), self.owner

    def covers(self, layer: int, head: int) -> bool:
        """Whether the edit applies to head ``(layer, head)`` (on some row)."""
        return self.heads is not None and ((layer, head) in self.heads or (layer, None) in self.heads)

    def same_owner(self, other: Edit) -> bool:
        """Whether ``other`` was added by the same owner (same name and instance)."""
        return self.owner == other.owner and self.instance is other.instance


@dataclass
class _ScaleEdit(Edit):
    """The fields of :class:`QueryScale` and :class:`OutputScale`: a ``factor`` on ``heads`` and ``rows``."""

    heads: list[Head]
    factor: float
    rows: list[int] | None = None
    owner: str | None = field(default=None, kw_only=True)
    instance: Any = field(default=None, kw_only=True, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.factor = float(self.factor)


@dataclass
class QueryScale(_ScaleEdit):
    """Multiply the queries of ``heads`` by ``factor`` on ``rows`` (0 = query masking: uniform attention
    over the causal prefix, output = mean of V)."""

    kind: ClassVar[str] = "q_scale"
    description: ClassVar[str] = "query scale/mask"


@dataclass
class ScoreZero(Edit):
    """Set the pre-softmax scores of ``heads`` to 0 on ``rows`` (uniform attention over the causal prefix)."""

    kind: ClassVar[str] = "score_zero"
    description: ClassVar[str] = "score mask"
    heads: list[Head]
    rows: list[int] | None = None
    owner: str | None = field(default=None, kw_only=True)
    instance: Any = field(default=None, kw_only=True, repr=False, compare=False)


@dataclass
class OutputScale(_ScaleEdit):
    """Multiply the outputs ``z`` (before ``o_proj``) of ``heads`` by ``factor`` on ``rows`` (0 = ablation)."""

    kind: ClassVar[str] = "out_scale"
    description: ClassVar[str] = "output scale/mask"


@dataclass
class KeyBias(Edit):
    """Add ``bias`` to the pre-softmax scores of the keys in ``spans`` on ``heads`` and ``rows``.

    ``spans``: absolute ``[start, end)`` key positions, one list for every selected row or one list per
    selected row (``rows`` order; every row of the batch when ``rows`` is None; see
    :func:`per_row_spans`). ``bias``: one float or one per span. Biases of several edits add.
    """

    kind: ClassVar[str] = "key_bias"
    description: ClassVar[str] = "pre-softmax key bias"
    heads: list[Head]
    spans: Any
    bias: Any
    rows: list[int] | None = None
    owner: str | None = field(default=None, kw_only=True)
    instance: Any = field(default=None, kw_only=True, repr=False, compare=False)


@dataclass
class LayerCallback(Edit):
    """Call ``fn(layer, z, ctx)`` on every call of every layer (see :meth:`Plan.on_layer`).

    ``fn`` sees every row and head; what it returns is an output scale. ``heads`` and ``rows`` declare the
    heads and rows whose output it may scale, for the conflict check (as an ``out_scale`` edit) and
    :meth:`Plan.edits_on`; ``heads=None`` declares nothing (never a conflict, listed for every head).
    """

    kind: ClassVar[str] = "out_scale"
    description: ClassVar[str] = "output scale/mask"
    fn: LayerFunction
    heads: list[Head] | None = None
    rows: list[int] | None = None
    owner: str | None = field(default=None, kw_only=True)
    instance: Any = field(default=None, kw_only=True, repr=False, compare=False)

    def covers(self, layer: int, head: int) -> bool:
        return self.heads is None or super().covers(layer, head)


@dataclass
class Plan:
    """Edits and probes over (batch row, layer, head) for one forward or one ``generate``.

    **Typed edits** (:attr:`edits`, a public list, applied in order; scales multiply, biases add):

    - :class:`QueryScale` ``(heads, factor, rows)``: multiply the query (0 = query masking, DeCoRe "flash");
    - :class:`ScoreZero` ``(heads, rows)``: zero the pre-softmax scores ("torch" masking mode);
    - :class:`OutputScale` ``(heads, factor, rows)``: multiply the head output ``z`` (0 = ablation);
    - :class:`KeyBias` ``(heads, spans, bias, rows)``: add pre-softmax biases to key spans (PASTA);
    - :class:`LayerCallback` ``(fn, heads, rows)``: a function of each layer's ``z`` that may return an
      output scale (VHR).

    Heads are ``(layer, head)`` pairs; ``(layer, None)`` means every head of the layer. ``rows`` are the
    batch rows an edit applies to (``None`` = all). Add edits with :meth:`add` or the builders
    (:meth:`mask_heads`, :meth:`scale_heads`, :meth:`scale_queries`, :meth:`bias_keys`, :meth:`on_layer`),
    which take ``owner=``: the method adding the edit, as a name or as its config (named by its ``kind``;
    two config objects are two owners). Two edits of the same kind on a shared (layer, head) and
    overlapping rows from different owners raise :class:`SteeringConflictError` (edits without an owner
    are never checked); the same owner may add repeatedly.

    **Dense edits** (optional; batch dim may be omitted to apply to all rows, layers as in the model):
      - ``q_scale``: (B, L, H) or (L, H) float, multiplies the query;
      - ``score_zero``: (B, L, H) or (L, H) bool, zero the pre-softmax scores;
      - ``out_scale``: (B, L, H) or (L, H) float, multiplies the head output ``z``;
      - ``key_spans`` (B, S, 2) int absolute ``[start, end)`` with ``key_bias`` (B, L, H, S) or (L, H, S)
        float added to the pre-softmax scores of the keys in span s (PASTA's log alpha; biases add).

    **Copies of a batch**: :meth:`tile` turns a plan for ``rows`` batch rows into one for ``copies * rows``
    rows (row ``r + c * rows`` is row ``r`` of copy ``c``), each copy edited like its source row or only
    copy 0 (contrastive decoding's base and masked copies). :meth:`edits_on` lists the edits of one head;
    :attr:`callbacks` the layer functions.

    ``backend`` is the path requested of :func:`headlab.kernels.choose_backend` (``"auto"``: it decides per layer;
    ``"torch"``, ``"triton"`` or ``"sdpa"`` force one; ``rec.backends`` says what ran).
    """

    probes: Probes = field(default_factory=Probes)
    q_scale: Tensor | None = None
    score_zero: Tensor | None = None
    out_scale: Tensor | None = None
    key_spans: Tensor | None = None
    key_bias: Tensor | None = None
    backend: str = "auto"
    edits: list[Edit] = field(default_factory=list)

    # ---- adding edits
    def add(self, *edits: Edit) -> Plan:
        """Append ``edits`` (all or none: a conflict leaves the plan unchanged).

        Raises :class:`SteeringConflictError` when an edit with an owner shares its kind, a (layer, head) and
        a batch row with an edit of another owner (already in the plan or earlier in ``edits``).
        """
        for e in edits:
            if not isinstance(e, (QueryScale, ScoreZero, OutputScale, KeyBias, LayerCallback)):
                raise TypeError(f"Plan.add takes typed edits (QueryScale, ScoreZero, OutputScale, KeyBias, "
                                f"LayerCallback), got {type(e).__name__}")
        for i, e in enumerate(edits):
            _check_conflict(e, [*self.edits, *edits[:i]])
        self.edits.extend(edits)
        return self

    def mask_heads(self, heads: HeadSpec, rows: Sequence[int] | None = None,
                   mode: Literal["query", "score", "output"] = "query", *, owner: Any = None) -> Plan:
        """Mask heads (docs/methods.md#head-masking-and-scaling): ``query`` zeroes the query (uniform attention
        over the causal prefix, output = mean of V; a :class:`QueryScale` of 0), ``score`` zeroes the
        pre-softmax scores (:class:`ScoreZero`), ``output`` zeroes the head output (ablation; an
        :class:`OutputScale` of 0)."""
        if mode == "query":
            return self.add(QueryScale(heads, 0.0, rows, owner=owner))
        if mode == "score":
            return self.add(ScoreZero(heads, rows, owner=owner))
        if mode == "output":
            return self.add(OutputScale(heads, 0.0, rows, owner=owner))
        raise ValueError(f"mode must be 'query', 'score' or 'output', got {mode!r}")

    def scale_heads(self, heads: HeadSpec, factor: float, rows: Sequence[int] | None = None, *,
                    owner: Any = None) -> Plan:
        """Multiply the outputs ``z`` of these heads by ``factor`` (an :class:`OutputScale`)."""
        return self.add(OutputScale(heads, factor, rows, owner=owner))

    def scale_queries(self, heads: HeadSpec, factor: float, rows: Sequence[int] | None = None, *,
                      owner: Any = None) -> Plan:
        """Multiply the queries of these heads by ``factor`` (0 = query masking; a :class:`QueryScale`)."""
        return self.add(QueryScale(heads, factor, rows, owner=owner))

    def bias_keys(self, heads: HeadSpec, spans, bias: float | Sequence[float],
                  rows: Sequence[int] | None = None, *, owner: Any = None) -> Plan:
        """Add ``bias`` to the pre-softmax scores of the keys in ``spans`` on these heads (a :class:`KeyBias`).

        ``spans``: a list of absolute ``(start, end)`` for every selected row, or one such list per selected
        row (``rows`` order; all rows when ``rows`` is None). ``bias``: one float or one per span. PASTA with
        coefficient alpha is ``bias=log(alpha)`` on the non-emphasised spans.
        """
        return self.add(KeyBias(heads, spans, bias, rows, owner=owner))

    def on_layer(self, fn: LayerFunction, *, heads: HeadSpec | None = None, rows: Sequence[int] | None = None,
                 owner: Any = None) -> Plan:
        """Call ``fn(layer, z, ctx)`` on every call of every layer, with ``z`` (B, H, Nq, D) the layer's head
        outputs before ``o_proj`` (after the plan's edits). If ``fn`` returns a tensor broadcastable to (B, H),
        it becomes that layer's output scale for this call and every later call in the context (multiplying
        the plan's own ``out_scale``); ``None`` leaves it unchanged. VHR picks its heads this way.

        ``heads``/``rows`` declare which heads and rows ``fn`` may scale (a :class:`LayerCallback`), for the
        conflict check with other owners' output scales."""
        return self.add(LayerCallback(fn, heads, rows, owner=owner))

    # ---- queries
    @property
    def callbacks(self) -> tuple[LayerFunction, ...]:
        """The functions of the plan's :class:`LayerCallback` edits, in order (read-only)."""
        return tuple(e.fn for e in self.edits if isinstance(e, LayerCallback))

    def edits_on(self, layer: int, head: int) -> list[Edit]:
        """The edits that apply to head ``(layer, head)`` on some row, in order (layer callbacks that declare
        no heads included; the dense tensor fields are not edits)."""
        return [e for e in self.edits if e.covers(int(layer), int(head))]

    def is_empty(self) -> bool:
        return not (self.probes.any() or self.edits or self.q_scale is not None
                    or self.score_zero is not None or self.out_scale is not None or self.key_spans is not None)

    def touches(self, layer: int) -> bool:
        if self.callbacks or self.probes.covers(layer):
            return True
        if self.q_scale is not None or self.score_zero is not None or self.out_scale is not None:
            return True
        if self.key_spans is not None:
            return True
        return any(layer == ly for e in self.edits if e.heads is not None for ly, _ in e.heads)

    # ---- copies of a batch
    def tile(self, copies: int, rows: int, mirror: bool = True) -> Plan:
        """A plan for ``copies * rows`` batch rows from this plan for ``rows`` rows (row ``r + c * rows`` is
        row ``r`` of copy ``c``).

        ``mirror=True``: every copy gets the edits of its source row (DeCoRe: the masked copy of a prompt is
        steered like the base row). ``mirror=False``: only copy 0 (rows ``0..rows-1``) is edited; the other
        copies run unedited (CAD: the prompt without the context has other positions, so steering spans
        written for the full prompt do not apply to it). Layer callbacks see the ``z`` of copy 0 only and an
        ``attend`` over copy 0's rows (its extra key biases reach the other copies when mirrored); the scale
        they return is applied to every copy (``mirror``) or to copy 0. Probes record every row: per-row
        probe spans and offsets are repeated for every copy. ``copies=1`` returns a copy of the plan.
        """
        if copies < 1 or rows < 1:
            raise ValueError(f"Plan.tile: copies and rows must be >= 1, got {copies}, {rows}")
        if copies == 1:
            return dataclasses.replace(self, edits=list(self.edits))
        k, B = int(copies), int(rows)
        rows_for = (lambda r: [r + c * B for c in range(k)]) if mirror else (lambda r: [r])
        out = Plan(probes=_tile_probes(self.probes, B, k), backend=self.backend)

        def dense(t: Tensor | None, fill: float | bool) -> Tensor | None:
            if t is None:
                return None
            t = torch.as_tensor(t)
            if t.dim() == 2 and mirror:
                return t
            t = t if t.dim() == 3 else t[None].expand(B, *t.shape)
            rest = t.repeat(k - 1, 1, 1) if mirror else torch.full_like(t, fill).repeat(k - 1, 1, 1)
            return torch.cat([t, rest])

        out.q_scale = dense(self.q_scale, 1.0)
        out.out_scale = dense(self.out_scale, 1.0)
        out.score_zero = dense(self.score_zero, False)
        if self.key_spans is not None:
            ks = torch.as_tensor(self.key_spans)
            ks = ks if ks.dim() == 3 else ks[None]
            ks = ks.expand(B, *ks.shape[1:])
            kb = torch.as_tensor(self.key_bias)
            kb = kb if kb.dim() == 4 else kb[None]
            kb = kb.expand(B, *kb.shape[1:])
            out.key_spans = torch.cat([ks] * k) if mirror else torch.cat([ks, torch.zeros_like(ks).repeat(k - 1, 1, 1)])
            out.key_bias = (torch.cat([kb] * k) if mirror
                            else torch.cat([kb, torch.zeros_like(kb).repeat(k - 1, 1, 1, 1)]))
        for e in self.edits:
            src = list(range(B)) if e.rows is None else list(e.rows)
            new_rows = [r2 for r in src for r2 in rows_for(r)]
            if isinstance(e, KeyBias):
                per_row = per_row_spans(e.spans, len(src))
                spans = [per_row[i] for i, r in enumerate(src) for _ in rows_for(r)]
                out.edits.append(dataclasses.replace(e, spans=spans, rows=new_rows))
            elif isinstance(e, LayerCallback):
                out.edits.append(dataclasses.replace(e, fn=_copy0_callback(e.fn, B, k, mirror),
                                                     rows=None if (e.rows is None and mirror) else new_rows))
            else:
                out.edits.append(dataclasses.replace(e, rows=None if (e.rows is None and mirror) else new_rows))
        return out


def _tile_probes(probes: Probes, B: int, k: int) -> Probes:
    """``probes`` for ``k`` copies of ``B`` rows: per-row spans, offsets and pairs repeated for every copy."""
    changes: dict[str, Any] = {}
    spans = probes.spans
    if spans is not None:
        if not isinstance(spans, Tensor):
            changes["spans"] = per_row_spans(spans, B) * k
        elif spans.dim() == 3:
            changes["spans"] = spans.repeat(k, 1, 1)
    offsets = probes.offsets
    if offsets is not None:
        if isinstance(offsets, Tensor):
            if offsets.dim() == 2:
                changes["offsets"] = offsets.repeat(k, 1)
        elif len(offsets) and isinstance(list(offsets)[0], (list, tuple, Tensor)):
            changes["offsets"] = list(offsets) * k
    if probes.pairs is not None:
        changes["pairs"] = _tile_pairs(probes.pairs, B, k)
    return dataclasses.replace(probes, **changes) if changes else probes


def _tile_pairs(pairs: Any, B: int, k: int) -> Any:
    """``Probes.pairs`` for ``k`` copies of ``B`` rows (a function's per-row answers repeated too)."""
    if callable(pairs):
        return lambda start, stop: _pairs_tensor(pairs(start, stop), B).repeat(k, 1, 1)
    t = _pairs_tensor(pairs, B)
    return t.repeat(k, 1, 1)


def _copy0_callback(fn: LayerFunction, B: int, k: int, mirror: bool) -> LayerFunction:
    """``fn`` written for ``B`` rows, run on copy 0 of ``k * B`` rows: it sees copy 0's ``z`` and an
    ``attend`` taking and returning copy 0's rows (the extra key biases reach the other copies when
    mirrored); the scale it returns goes to every copy (``mirror``) or to copy 0."""

    def wrapped(layer: int, z: Tensor, ctx: LayerContext) -> Tensor | None:
        inner = ctx
        if ctx.attend is not None:
            full_attend = ctx.attend

            def attend(key_spans: Tensor, key_bias: Tensor) -> Tensor:
                ks = torch.as_tensor(key_spans, device=z.device).long()
                ks = torch.broadcast_to(ks, (B, *ks.shape[-2:]))
                kb = torch.broadcast_to(torch.as_tensor(key_bias, device=z.device, dtype=torch.float32),
                                        (B, z.shape[1], ks.shape[1]))
                rest = kb.repeat(k - 1, 1, 1) if mirror else torch.zeros_like(kb).repeat(k - 1, 1, 1)
                return full_attend(ks.repeat(k, 1, 1), torch.cat([kb, rest]))[:B]

            inner = dataclasses.replace(ctx, attend=attend)
        scale = fn(layer, z[:B], inner)
        if scale is None:
            return None
        scale = torch.broadcast_to(torch.as_tensor(scale, device=z.device, dtype=torch.float32), (B, z.shape[1]))
        rest = scale.repeat(k - 1, 1) if mirror else torch.ones_like(scale).repeat(k - 1, 1)
        return torch.cat([scale, rest])

    return wrapped


def _owner_name(owner: Any) -> str:
    return str(getattr(owner, "kind", type(owner).__name__))


def _check_conflict(new: Edit, existing: Sequence[Edit]) -> None:
    """Raise :class:`SteeringConflictError` if ``new`` conflicts with one of ``existing``."""
    if new.owner is None or new.heads is None:
        return
    rivals = []
    for old in existing:
        if old.owner is None or old.heads is None or old.kind != new.kind or old.same_owner(new):
            continue
        if new.rows is not None and old.rows is not None and not set(new.rows) & set(old.rows):
            continue
        rivals.append((old, set(old.heads)))
    if not rivals:
        return
    for layer, head in new.heads:
        for old, old_heads in rivals:
            if head is not None:
                hit = (layer, head) if (layer, head) in old_heads or (layer, None) in old_heads else None
            else:
                hit = next(((ly, h) for ly, h in old.heads if ly == layer), None)
            if hit is not None:
                where = f"head ({hit[0]}, {hit[1]})" if hit[1] is not None else f"every head of layer {hit[0]}"
                raise SteeringConflictError(
                    f"steering conflict: '{old.owner}' and '{new.owner}' both apply a {new.description} to "
                    f"{where} on the same batch rows; steer each head with at most one method of a kind (split "
                    "the heads between the methods)")


def _heads(heads) -> list[tuple[int, int | None]]:
    out = []
    for h in heads:
        if isinstance(h, int):
            out.append((int(h), None))
        else:
            layer, head = h
            out.append((int(layer), None if head is None else int(head)))
    return out


def _rows(rows) -> list[int] | None:
    return None if rows is None else [int(r) for r in rows]


# --------------------------------------------------------------------------- recording
class Recording:
    """Probes recorded during an :func:`instrument` context.

    Tensors (see :data:`DIMS` / ``rec.dims`` for the axis names), all on the model's device:

    - ``argmax`` (example, layer, head, query) int64 absolute key position of the top-1 key (-1 for padding
      queries); ``argmax_prob``, ``entropy`` (example, layer, head, query) float32;
    - ``span_mass`` (example, layer, head, query, span) float32;
    - ``offset_mass`` (example, layer, head, query, offset) float32, the attention of query ``t`` to key
      ``t - delta`` for each of ``Probes.offsets``;
    - ``pair_mass`` (example, layer, head, pair) float32, the attention at each of ``Probes.pairs``, whose
      absolute ``(query, key)`` positions are ``rec.pairs`` (example, pair, 2) (-1: an unused slot);
    - ``z`` (example, layer, head, position, head_dim) in the model dtype, at ``z_positions``;
    - ``pattern`` (example, layer, head, query, key) float32 (keys beyond a call's cache are 0).

    The ``example`` axis is the batch row; the layer axis lists ``rec.layers``; the query axis is the
    absolute position (the calls of a ``generate`` are concatenated: prefill, then one query per step).
    ``rec.z_positions`` lists the positions of the ``z`` axis. ``rec.calls`` counts forward calls seen by
    the first probed layer.

    :meth:`to_xarray` / :meth:`to_dataset` return the same arrays as xarray objects on the CPU, with the
    dimension names of :data:`DIMS` (the vocabulary :data:`headlab.DIMENSIONS`) and coordinates.
    ``rec.backends[layer]``: ``(backend, reason)`` of the layer's last call, as
    :func:`headlab.kernels.choose_backend` decided it (``"native"``: the model's own SDPA call).
    """

    dims = DIMS

    def __init__(self, layers: list[int], probes: Probes | None = None):
        self.layers = layers
        self.probes = probes
        self._chunks: dict[str, dict[int, list]] = {k: {ly: [] for ly in layers} for k in DIMS}
        self._zpos: dict[int, list[Tensor]] = {ly: [] for ly in layers}
        self._pairpos: dict[int, list[Tensor]] = {ly: [] for ly in layers}
        self._cache: dict[str, Tensor | None] = {}
        self.calls = 0
        self.backends: dict[int, tuple[str, str]] = {}

    def _add(self, name: str, layer: int, value):
        self._chunks[name][layer].append(value)
        self._cache.pop(name, None)

    def _get(self, name: str) -> Tensor | None:
        if name in self._cache:
            return self._cache[name]
        per_layer = [self._chunks[name][ly] for ly in self.layers]
        if not per_layer or not per_layer[0]:
            return None
        if name == "pattern":
            nk = max(c.shape[-1] for chunks in per_layer for c in chunks)
            per_layer = [[torch.nn.functional.pad(c, (0, nk - c.shape[-1])) for c in chunks]
                         for chunks in per_layer]
        axis = 2  # (batch, head, query, ...) per layer chunk
        out = torch.stack([torch.cat(chunks, dim=axis) for chunks in per_layer], dim=1)
        self._cache[name] = out
        return out

    argmax = property(lambda self: self._get("argmax"))
    argmax_prob = property(lambda self: self._get("argmax_prob"))
    entropy = property(lambda self: self._get("entropy"))
    span_mass = property(lambda self: self._get("span_mass"))
    offset_mass = property(lambda self: self._get("offset_mass"))
    pair_mass = property(lambda self: self._get("pair_mass"))
    z = property(lambda self: self._get("z"))
    pattern = property(lambda self: self._get("pattern"))

    @property
    def pairs(self) -> Tensor | None:
        """(example, pair, 2) int64 absolute ``(query, key)`` positions of the ``pair`` axis of ``pair_mass``
        (-1 for an unused slot), on the CPU."""
        if not self.layers or not self._pairpos[self.layers[0]]:
            return None
        return torch.cat(self._pairpos[self.layers[0]], dim=1)

    @property
    def z_positions(self) -> list[int] | None:
        if not self.layers or not self._zpos[self.layers[0]]:
            return None
        return torch.cat(self._zpos[self.layers[0]]).tolist()

    def as_dict(self) -> dict[str, Tensor]:
        """The recorded arrays by name (only those recorded)."""
        return {k: v for k in DIMS if (v := self._get(k)) is not None}

    def to_xarray(self, name: str) -> xr.DataArray:
        """The recorded array ``name`` as a DataArray on the CPU, with the dims of ``DIMS[name]``.

        Coordinates: ``example`` the batch rows ``0..B-1``; ``layer`` the recorded layers (``rec.layers``);
        ``head`` ``0..H-1``; ``query`` and ``key`` absolute positions ``0..``; ``position`` the positions of
        ``z`` (``rec.z_positions``); ``span`` ``0..S-1``, with ``span_start`` / ``span_end`` (example, span)
        the probed key spans; ``offset`` the probed offsets ``delta`` when every row shares them, otherwise
        ``0..O-1`` with ``delta`` (example, offset) the offsets of each row (-1: unused slot); ``pair``
        ``0..P-1`` with ``pair_query`` / ``pair_key`` (example, pair) the probed positions (-1: unused slot).
        ``head_dim`` has no coordinate. Values keep their dtype (bfloat16, which numpy lacks, becomes float32).
        Raises KeyError for an unknown name and ValueError for an array that was not recorded.
        """
        if name not in DIMS:
            raise KeyError(f"no recorded array {name!r}; the names are {', '.join(DIMS)}")
        t = self._get(name)
        if t is None:
            raise ValueError(f"{name!r} was not recorded (recorded: {', '.join(self.as_dict()) or 'nothing'})")
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            t = t.float()
        dims = DIMS[name]
        B, _, H = t.shape[:3]
        coords: dict[str, Any] = {"example": np.arange(B), "layer": np.asarray(self.layers, dtype=np.int64),
                                  "head": np.arange(H)}
        if "query" in dims:
            coords["query"] = np.arange(t.shape[3])
        if name == "pattern":
            coords["key"] = np.arange(t.shape[4])
        if name == "z":
            coords["position"] = np.asarray(self.z_positions, dtype=np.int64)
        if name == "span_mass":
            coords["span"] = np.arange(t.shape[4])
            if self.probes is not None and self.probes.spans is not None:
                sp = span_tensor(self.probes.spans, B, "cpu").numpy()
                if sp.shape[1] == t.shape[4]:
                    coords["span_start"] = (("example", "span"), sp[..., 0])
                    coords["span_end"] = (("example", "span"), sp[..., 1])
        if name == "offset_mass":
            offs = None
            if self.probes is not None and self.probes.offsets is not None:
                offs = _offsets_tensor(self.probes.offsets, B).numpy()
            if offs is not None and offs.shape[1] == t.shape[4] and (offs == offs[:1]).all() and (offs >= 0).all():
                coords["offset"] = offs[0]
            else:
                coords["offset"] = np.arange(t.shape[4])
                if offs is not None and offs.shape[1] == t.shape[4]:
                    coords["delta"] = (("example", "offset"), offs)
        if name == "pair_mass":
            coords["pair"] = np.arange(t.shape[3])
            pp = self.pairs
            if pp is not None and pp.shape[1] == t.shape[3]:
                coords["pair_query"] = (("example", "pair"), pp[..., 0].numpy())
                coords["pair_key"] = (("example", "pair"), pp[..., 1].numpy())
        return xr.DataArray(t.numpy(), dims=dims, coords=coords, name=name)

    def to_dataset(self) -> xr.Dataset:
        """Every recorded array as one Dataset (variables named as in :data:`DIMS`, see :meth:`to_xarray`),
        with attributes ``calls`` and ``layers``."""
        ds = xr.Dataset({name: self.to_xarray(name) for name in self.as_dict()})
        ds.attrs.update(calls=self.calls, layers=list(self.layers))
        return ds


# --------------------------------------------------------------------------- session
_ACTIVE: contextvars.ContextVar[_Session | None] = contextvars.ContextVar("headlab_instrument", default=None)


class _Session:
    def __init__(self, model, plan: Plan, layer_of: dict[int, int], n_layers: int):
        self.plan = plan
        self.layer_of = layer_of
        self.n_layers = n_layers
        probed = plan.probes.layers if plan.probes.layers is not None else range(n_layers)
        self.probe_layers = sorted(int(ly) for ly in probed) if plan.probes.any() else []
        self.rec = Recording(self.probe_layers, plan.probes)
        self.q_count: dict[int, int] = {}
        self.calls: dict[int, int] = {}
        self.cb_scale: dict[int, Tensor] = {}
        self.store: dict = {}
        self._mask_cache: list = []
        self._offsets_cache: dict = {}
        self._pairs_cache: dict = {}

    # ---- masks (cached per mask tensor: every layer of a forward shares it)
    def mask_args(self, mask: Tensor | None, Nq: int, Nk: int, causal: bool, window: int | None):
        if mask is None:
            return _mask_args(None, Nq, Nk, causal, window)
        for entry in self._mask_cache:
            if entry[0] is mask and entry[1] == (Nq, Nk, causal, window):
                return entry[2]
        result = _mask_args(mask, Nq, Nk, causal, window)
        self._mask_cache.append((mask, (Nq, Nk, causal, window), result))
        if len(self._mask_cache) > 8:
            self._mask_cache.pop(0)
        return result

    # ---- per-layer edit tensors
    def edits_for(self, layer: int, B: int, H: int, Nk: int, key_offset: int, device) -> dict:
        trunk = _TRUNK.get()
        if trunk is None or layer >= trunk.layer:
            return self._edits_for(layer, B, H, Nk, key_offset, device)
        if self.plan.probes.covers(layer) or self.plan.callbacks:
            raise ValueError(f"shared_trunk: layer {layer} runs once for {trunk.copies} copies of the batch, "
                             "so it cannot record probes or run on_layer callbacks")
        full = self._edits_for(layer, B * trunk.copies, H, Nk, key_offset, device)
        return {name: None if t is None else _copy0(t, B, trunk.copies, name, layer) for name, t in full.items()}

    def _edits_for(self, layer: int, B: int, H: int, Nk: int, key_offset: int, device) -> dict:
        plan = self.plan
        f32 = torch.float32
        out: dict[str, Tensor | None] = {}

        def dense(t, dtype):
            if t is None:
                return None
            t = torch.as_tensor(t, device=device)
            t = t[:, layer] if t.dim() == 3 else t[layer][None]
            return torch.broadcast_to(t, (B, H)).to(dtype).clone()

        qs = dense(plan.q_scale, f32)
        sz = dense(plan.score_zero, torch.bool)
        osc = dense(plan.out_scale, f32)
        spans_l: list[Tensor] = []
        bias_l: list[Tensor] = []
        if plan.key_spans is not None:
            ks = torch.as_tensor(plan.key_spans, device=device).long()
            kb = torch.as_tensor(plan.key_bias, device=device, dtype=f32)
            kb = kb[:, layer] if kb.dim() == 4 else kb[layer][None]
            spans_l.append(torch.broadcast_to(ks, (B, ks.shape[-2], 2)))
            bias_l.append(torch.broadcast_to(kb, (B, H, ks.shape[-2])))
        for e in plan.edits:
            if isinstance(e, LayerCallback):
                continue
            hs = [h for ly, h in e.heads if ly == layer]
            if not hs:
                continue
            rows = torch.arange(B, device=device) if e.rows is None else torch.tensor(e.rows, device=device)
            if rows.numel() and int(rows.max()) >= B:
                raise ValueError(f"edit rows {e.rows} out of range for batch size {B}")
            hmask = torch.zeros(H, dtype=torch.bool, device=device)
            for h in hs:
                if h is None:
                    hmask[:] = True
                elif not 0 <= h < H:
                    raise ValueError(f"head {h} out of range (layer {layer} has {H} heads)")
                else:
                    hmask[h] = True
            sel = torch.zeros(B, H, dtype=torch.bool, device=device)
            sel[rows] = hmask
            if isinstance(e, ScoreZero):
                sz = sel if sz is None else sz | sel
            elif isinstance(e, (QueryScale, OutputScale)):
                cur = qs if isinstance(e, QueryScale) else osc
                cur = torch.ones(B, H, dtype=f32, device=device) if cur is None else cur
                cur = torch.where(sel, cur * e.factor, cur)
                if isinstance(e, QueryScale):
                    qs = cur
                else:
                    osc = cur
            elif isinstance(e, KeyBias):
                row_list = rows.tolist()
                per_row = per_row_spans(e.spans, len(row_list))
                S = max((len(s) for s in per_row), default=0)
                if S == 0:
                    continue
                sp = torch.zeros(B, S, 2, dtype=torch.long, device=device)
                for i, r in enumerate(row_list):
                    for j, (a, b_) in enumerate(per_row[i]):
                        sp[r, j, 0], sp[r, j, 1] = int(a), int(b_)
                bvals = torch.as_tensor(e.bias, dtype=f32, device=device)
                bvals = torch.broadcast_to(bvals, (S,)) if bvals.dim() == 0 else bvals
                if bvals.numel() != S:
                    raise ValueError(f"bias_keys: {bvals.numel()} biases for {S} spans")
                bias = torch.where(sel[:, :, None], bvals[None, None, :], torch.zeros((), dtype=f32, device=device))
                spans_l.append(sp)
                bias_l.append(bias)
        cb = self.cb_scale.get(layer)
        if cb is not None:
            osc = cb if osc is None else osc * cb
        out.update(q_scale=qs, score_zero=sz, out_scale=osc)
        if spans_l:
            sp = torch.cat(spans_l, dim=1) - key_offset
            out["key_spans"] = sp.clamp(0, Nk)
            out["key_bias"] = torch.cat(bias_l, dim=2)
        return out

    def probe_spans(self, B: int, Nk: int, key_offset: int, device) -> Tensor | None:
        spans = self.plan.probes.spans
        if spans is None:
            return None
        return (span_tensor(spans, B, device) - key_offset).clamp(0, Nk)

    def probe_offsets(self, B: int, Nq: int, Nk: int, q_start: int, device) -> Tensor | None:
        """(B, O) kernel offsets from ``Probes.offsets``. The kernel counts ``delta`` back from the query's key
        coordinate ``Nk - Nq + i``; the recording counts it back from the query's absolute position
        ``q_start + i``. They agree whenever the cache holds every key up to the queries (dropped keys of a
        sliding-window cache included); a static cache with empty slots after the queries shifts them."""
        offsets = self.plan.probes.offsets
        if offsets is None:
            return None
        key = (B, str(device))
        base = self._offsets_cache.get(key)
        if base is None:
            base = _offsets_tensor(offsets, B).to(device)
            self._offsets_cache[key] = base
        shift = max(0, Nk - Nq - q_start)
        return torch.where(base >= 0, base + shift, base) if shift else base


    def probe_pairs(self, B: int, Nq: int, Nk: int, q_start: int, key_offset: int, device) -> Tensor | None:
        """The pairs of ``Probes.pairs`` whose query this call runs, as (B, P, 2) absolute positions (-1 =
        unused slot) in the order given; one selection per call, shared by the layers."""
        pairs = self.plan.probes.pairs
        if pairs is None:
            return None
        key = (B, Nq, q_start, str(device))
        hit = self._pairs_cache.get(key)
        if hit is None:
            if callable(pairs):
                base = _pairs_tensor(pairs(q_start, q_start + Nq), B)
            else:
                base = self._pairs_cache.get("base")
                if base is None or base.shape[0] != B:
                    base = self._pairs_cache["base"] = _pairs_tensor(pairs, B)
            hit = _select_pairs(base, q_start, q_start + Nq).to(device)
            self._pairs_cache = {k: v for k, v in self._pairs_cache.items() if k == "base"}
            self._pairs_cache[key] = hit
        return hit


def _select_pairs(pairs: Tensor, start: int, stop: int) -> Tensor:
    """The pairs of (B, P, 2) ``pairs`` whose query lies in ``[start, stop)``, packed to the front of each row
    in their order, as (B, P', 2) with ``-1`` padding."""
    B = pairs.shape[0]
    inq = (pairs[..., 0] >= start) & (pairs[..., 0] < stop) & (pairs[..., 1] >= 0)
    if bool(inq.all()):
        return pairs
    n = int(inq.sum(1).max()) if B else 0
    out = torch.full((B, n, 2), -1, dtype=torch.long)
    b, p = inq.nonzero(as_tuple=True)
    out[b, (inq.cumsum(1) - 1)[b, p]] = pairs[b, p]
    return out


def _pairs_tensor(pairs: Any, B: int) -> Tensor:
    """(B, P, 2) int64 absolute ``(query, key)`` pairs on the CPU from a shared list of pairs, per-row lists
    (or (P, 2) arrays) or a (P, 2) / (B, P, 2) tensor or array; -1 = unused slot (rows padded with it)."""
    if isinstance(pairs, (Tensor, np.ndarray)):
        t = torch.as_tensor(pairs)
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError("Probes.pairs must be integers")
        t = t.long().cpu()
        if t.dim() == 2 and t.shape[-1] == 2:
            t = t[None].expand(B, *t.shape)
        if t.dim() != 3 or t.shape[0] != B or t.shape[2] != 2:
            raise ValueError(f"Probes.pairs tensor must be (pair, 2) or (batch, pair, 2) = ({B}, P, 2), "
                             f"got {tuple(t.shape)}")
        if bool((t < -1).any()):
            raise ValueError("Probes.pairs positions must be >= 0 (-1 marks an unused slot in a tensor)")
        return t.clone()
    pairs = list(pairs)
    if not pairs:
        return torch.zeros(B, 0, 2, dtype=torch.long)
    first = pairs[0]
    shared = not isinstance(first, (Tensor, np.ndarray)) and len(first) == 2 and not hasattr(first[0], "__len__")
    if shared:
        rows = [torch.as_tensor(pairs, dtype=torch.long).reshape(-1, 2)] * B
    else:
        if len(pairs) != B:
            raise ValueError(f"got pairs for {len(pairs)} rows, expected {B}")
        rows = []
        for r in pairs:
            t = torch.as_tensor(r if len(r) else np.zeros((0, 2), dtype=np.int64))
            if t.dtype.is_floating_point or t.dtype == torch.bool:
                raise ValueError("Probes.pairs must be integers")
            rows.append(t.long().cpu().reshape(-1, 2))
    if any(bool((r < 0).any()) for r in rows):
        raise ValueError("Probes.pairs positions must be >= 0")
    n = max(r.shape[0] for r in rows)
    out = torch.full((B, n, 2), -1, dtype=torch.long)
    for b, r in enumerate(rows):
        out[b, :r.shape[0]] = r
    return out


def _copy0(t: Tensor, B: int, copies: int, name: str, layer: int) -> Tensor:
    """The rows of copy 0 of a ``copies * B``-row edit tensor, which must be the same for every copy."""
    first = t[:B]
    for c in range(1, copies):
        if not torch.equal(t[c * B:(c + 1) * B], first):
            raise ValueError(f"shared_trunk: the plan's {name} differs between copies of the batch on layer "
                             f"{layer}, below the layer where the copies separate")
    return first


def _offsets_tensor(offsets, B: int) -> Tensor:
    """(B, O) int64 offsets from a shared list, per-row lists or a (B, O) / (O,) tensor; -1 = unused slot."""
    if isinstance(offsets, Tensor):
        if offsets.dtype.is_floating_point or offsets.dtype == torch.bool:
            raise ValueError("Probes.offsets must be integers")
        t = offsets.long().cpu()
        if t.dim() == 1:
            t = t[None].expand(B, t.shape[0])
        if t.dim() != 2 or t.shape[0] != B:
            raise ValueError(f"Probes.offsets tensor must be (batch, offset) = ({B}, O), got {tuple(t.shape)}")
        if bool((t < -1).any()):
            raise ValueError("Probes.offsets must be >= 0 (-1 marks an unused slot in a tensor)")
        return t.clone()
    offsets = list(offsets)
    if offsets and isinstance(offsets[0], (list, tuple, Tensor)):
        if len(offsets) != B:
            raise ValueError(f"got offsets for {len(offsets)} rows, expected {B}")
        per_row = [[int(d) for d in row] for row in offsets]
    else:
        per_row = [[int(d) for d in offsets]] * B
    if any(d < 0 for row in per_row for d in row):
        raise ValueError("Probes.offsets must be >= 0")
    n_off = max((len(row) for row in per_row), default=0)
    t = torch.full((B, n_off), -1, dtype=torch.long)
    for r, row in enumerate(per_row):
        t[r, :len(row)] = torch.tensor(row, dtype=torch.long)
    return t


def _mask_args(mask: Tensor | None, Nq: int, Nk: int, causal: bool, window: int | None) -> dict:
    """Kernel mask arguments from transformers' mask: the 4-D boolean SDPA mask is compressed to
    (key padding, causal, window) when it is exactly that, else passed on as a general ``attn_mask``."""
    if mask is None:
        return dict(key_padding_mask=None, attn_mask=None, causal=causal, window=window)
    if mask.dtype != torch.bool:
        finfo_min = torch.finfo(mask.dtype).min
        if not bool(((mask == 0) | (mask <= finfo_min / 2)).all()):
            raise UnsupportedModelError("headlab: additive float attention masks with biases are not supported")
        mask = mask == 0
    if mask.dim() != 4:
        raise UnsupportedModelError(f"headlab: unexpected attention mask of shape {tuple(mask.shape)}")
    if mask.shape[-1] != Nk:
        mask = mask[..., :Nk]
    if mask.shape[1] == 1 and mask.shape[2] == Nq:
        kpm = mask.any(dim=2)[:, 0]  # (B, Nk): keys some query sees
        for cand_window, cand_causal in ((window, causal), (None, causal), (window, True), (None, True)):
            if _mask_is(mask, kpm, cand_causal, cand_window):
                return dict(key_padding_mask=None if bool(kpm.all()) else kpm, attn_mask=None,
                            causal=cand_causal, window=cand_window)
    # a general mask (e.g. static-cache slots, bidirectional image blocks)
    return dict(key_padding_mask=None, attn_mask=mask, causal=False, window=None)


def _mask_is(mask: Tensor, kpm: Tensor, causal: bool, window: int | None) -> bool:
    """Whether the (B, 1, Nq, Nk) boolean ``mask`` is exactly key padding ``kpm`` (B, Nk) and the causal /
    window visibility; compared a band of query rows at a time, so the check adds O(rows x Nk) memory to the
    mask's own, never another (Nq, Nk) one."""
    B, _, Nq, Nk = mask.shape
    if not causal and window is None and Nq != 1:
        return False  # such a mask is no visibility pattern (and the check never accepted it)
    rows = max(1, (1 << 22) // max(1, B * Nk))
    for q0 in range(0, Nq, rows):
        q1 = min(Nq, q0 + rows)
        vis = visibility(Nq, Nk, q0, q1, 0, Nk, causal, window, mask.device)
        expect = kpm[:, None, None, :] if vis is None else vis[None, None] & kpm[:, None, None, :]
        if not torch.equal(mask[:, :, q0:q1], expect):
            return False
    return True


def span_tensor(spans, B: int, device) -> Tensor:
    """(B, P, 2) int64 ``[start, end)`` spans from a shared list, per-row lists (shorter rows padded with
    empty spans), a (P, 2) tensor shared by all rows or a (B, P, 2) tensor."""
    if isinstance(spans, Tensor):
        sp = spans.to(device).long()
        return torch.broadcast_to(sp, (B, *sp.shape[-2:])) if sp.dim() == 2 else sp
    per_row = per_row_spans(spans, B)
    sp = torch.zeros(B, max(len(s) for s in per_row), 2, dtype=torch.long)
    for r, rs in enumerate(per_row):
        for j, (a, b) in enumerate(rs):
            sp[r, j, 0], sp[r, j, 1] = int(a), int(b)
    return sp.to(device)


def per_row_spans(spans: Any, n_rows: int) -> list[list[tuple[int, int]]]:
    """``n_rows`` lists of ``(start, end)`` spans from one list shared by every row (``[(s, e), ...]``) or
    one list per row (``[[(s, e), ...], ...]``, exactly ``n_rows`` of them; a tensor is read as a list).
    Raises ``ValueError`` when a per-row list has another number of rows."""
    if isinstance(spans, Tensor):
        spans = spans.tolist()
    spans = list(spans)
    if not spans:
        return [[] for _ in range(n_rows)]
    first = list(spans[0])
    if len(first) == 2 and not isinstance(first[0], (list, tuple)):  # one shared list of (start, end)
        return [[tuple(s) for s in spans] for _ in range(n_rows)]
    if len(spans) != n_rows:
        raise ValueError(f"got spans for {len(spans)} rows, expected {n_rows}")
    return [[tuple(s) for s in rs] for rs in spans]


# --------------------------------------------------------------------------- the attention function
def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """headlab's attention implementation (``AttentionInterface`` signature).

    query (B, H, Nq, D), key/value (B, Hkv, Nk, D) -> (attn_output (B, Nq, H, D), None).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    sess = _ACTIVE.get()
    layer = None if sess is None else sess.layer_of.get(id(module))
    softcap = kwargs.get("softcap")
    if softcap is None and getattr(module, "config", None) is not None and layer is not None:
        softcap = getattr(module.config, "attn_logit_softcapping", None)
    for name in _REFUSED_KWARGS:
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(
                f"headlab: attention with `{name}` ({type(module).__name__}) is not supported; load the model "
                "with another attn_implementation")
    plan = sess.plan if layer is not None and sess.plan.touches(layer) else None
    if dropout and module.training and plan is not None:
        raise UnsupportedModelError("headlab: attention dropout is not supported inside instrument()")

    B, H, Nq, D = query.shape
    Nk = key.shape[2]
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    if window is not None and window <= 0:
        window = None
    k_in, v_in = key, value
    if attention_mask is None and is_causal and 1 < Nq < Nk:
        # empty static-cache slots after a prefill (sdpa crops them the same way)
        k_in, v_in, Nk = key[:, :, :Nq], value[:, :, :Nq], Nq
    q_start = 0 if layer is None else sess.q_count.get(layer, 0)
    key_offset = max(0, q_start + Nq - Nk)
    edits = probes = None
    reads_z = False  # the head outputs are recorded or handed to callbacks
    if plan is not None:
        edits = HeadEdits(**sess.edits_for(layer, B, H, Nk, key_offset, query.device))
        reads_z = bool(plan.callbacks)
        if plan.probes.covers(layer):
            p = plan.probes
            pair_pos = sess.probe_pairs(B, Nq, Nk, q_start, key_offset, query.device)
            pair_idx = None
            if pair_pos is not None:  # kernel coordinates: query row of this call, key slot of the cache
                shift = torch.tensor([q_start, key_offset], device=query.device)
                pair_idx = torch.where(pair_pos >= 0, pair_pos - shift, pair_pos)
                pair_idx = torch.where((pair_idx < 0).any(-1, keepdim=True), -1, pair_idx)
            probes = ProbeRequest(p.argmax, p.entropy, sess.probe_spans(B, Nk, key_offset, query.device),
                                  sess.probe_offsets(B, Nq, Nk, q_start, query.device), p.pattern, pair_idx)
            reads_z = reads_z or p.z_positions is not None
    backend, reason = choose_backend("auto" if plan is None else plan.backend, edits=edits, probes=probes,
                                     softcap=softcap, device=query.device, native=True, reads_outputs=reads_z)
    if layer is not None:
        sess.rec.backends[layer] = (backend, reason)
    if backend == "native":
        # exactly the SDPA call of attn_implementation="sdpa", with query / output scales around it
        if edits is not None and edits.q_scale is not None:
            query = query * edits.q_scale[:, :, None, None].to(query.dtype)
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                        scaling=scaling, **kwargs)
        if edits is not None and edits.out_scale is not None:
            out = out * edits.out_scale[:, None, :, None].to(out.dtype)
        if layer is not None:
            _advance(sess, layer, Nq)
        return out, None

    key, value = k_in, v_in
    if scaling is None:
        scaling = D**-0.5
    margs = _mask_args(attention_mask, Nq, Nk, is_causal, window) if layer is None else \
        sess.mask_args(attention_mask, Nq, Nk, is_causal, window)
    z, st = kernel_attention(query, key, value, edits=edits, probes=probes, scale=scaling, softcap=softcap,
                             **margs, backend=backend)
    if plan is None:
        if layer is not None:
            _advance(sess, layer, Nq)
        return z.transpose(1, 2).contiguous(), None

    call = sess.calls.get(layer, 0)
    callbacks = plan.callbacks
    if callbacks:
        def attend(key_spans: Tensor, key_bias: Tensor) -> Tensor:
            ks = (torch.as_tensor(key_spans, device=query.device).long() - key_offset).clamp(0, Nk)
            kb = torch.broadcast_to(torch.as_tensor(key_bias, device=query.device, dtype=torch.float32),
                                    (B, H, ks.shape[1]))
            return kernel_attention(query, key, value, edits=edits.plus_key_bias(ks, kb), scale=scaling,
                                    softcap=softcap, **margs, backend=plan.backend)[0]

        ctx = LayerContext(layer=layer, call=call, q_start=q_start, n_queries=Nq, store=sess.store,
                           attend=attend)
        for fn in callbacks:
            scale = fn(layer, z, ctx)
            if scale is not None:
                scale = torch.broadcast_to(torch.as_tensor(scale, device=z.device, dtype=torch.float32), (B, H))
                sess.cb_scale[layer] = scale.clone()
                z = (z.float() * scale[:, :, None, None]).to(z.dtype)
    if probes is not None:
        rec = sess.rec
        if probes.argmax:
            am = st.argmax
            rec._add("argmax", layer, torch.where(am >= 0, am + key_offset, am))
            rec._add("argmax_prob", layer, st.argmax_prob)
        if probes.entropy:
            rec._add("entropy", layer, st.entropy)
        if probes.spans is not None:
            rec._add("span_mass", layer, st.span_mass)
        if probes.offsets is not None:
            rec._add("offset_mass", layer, st.offset_mass)
        if probes.pairs is not None:
            rec._add("pair_mass", layer, st.pair_mass)
            rec._pairpos[layer].append(pair_pos.cpu())
        if probes.pattern:
            pat = st.pattern
            if key_offset:
                pat = torch.nn.functional.pad(pat, (key_offset, 0))
            rec._add("pattern", layer, pat)
        if plan.probes.z_positions is not None:
            qpos = torch.arange(q_start, q_start + Nq, device=z.device)
            zp = plan.probes.z_positions
            if zp == "last":
                keep = qpos == q_start + Nq - 1
            elif zp == "all":
                keep = torch.ones_like(qpos, dtype=torch.bool)
            else:
                keep = torch.isin(qpos, torch.as_tensor(list(zp), device=z.device))
            rec._add("z", layer, z[:, :, keep])
            rec._zpos[layer].append(qpos[keep].cpu())
        if layer == sess.probe_layers[0]:
            rec.calls += 1
    _advance(sess, layer, Nq)
    return z.transpose(1, 2).contiguous(), None


def _advance(sess: _Session, layer: int, nq: int) -> None:
    sess.q_count[layer] = sess.q_count.get(layer, 0) + nq
    sess.calls[layer] = sess.calls.get(layer, 0) + 1


# --------------------------------------------------------------------------- shared trunk
@dataclass(frozen=True)
class _Trunk:
    layer: int
    copies: int


_TRUNK: contextvars.ContextVar[_Trunk | None] = contextvars.ContextVar("headlab_trunk", default=None)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layer modules of the language model, in order (the parents of its attention modules)."""
    layer_of = attention_layers(model)
    by_layer: dict[int, torch.nn.Module] = {}
    for name, mod in model.named_modules():
        idx = layer_of.get(id(mod))
        if idx is not None and idx not in by_layer and "." in name:
            by_layer[idx] = model.get_submodule(name.rsplit(".", 1)[0])
    return [by_layer[i] for i in range(len(by_layer))]


def _repeat_rows(value: Any, B: int, copies: int, memo: dict[int, Any]) -> Any:
    """``value`` with every tensor of ``B`` rows (2-D or more) repeated ``copies`` times along the rows;
    ``memo`` keeps the repeats of one forward (the layers share their mask and position embeddings)."""
    if isinstance(value, Tensor):
        if value.dim() < 2 or value.shape[0] != B:
            return value
        hit = memo.get(id(value))
        if hit is None or hit[0] is not value:
            hit = memo[id(value)] = (value, value.repeat(copies, *([1] * (value.dim() - 1))))
        return hit[1]
    if isinstance(value, (tuple, list)):
        return type(value)(_repeat_rows(v, B, copies, memo) for v in value)
    return value


@contextlib.contextmanager
def shared_trunk(model, layer: int, copies: int) -> Iterator[None]:
    """Run ``copies`` identical copies of a batch once below ``layer`` (an exact saving for DeCoRe).

    Inside the block the model is called with the ``B`` rows of copy 0 (input ids, attention mask,
    positions). Layers ``0..layer-1`` run on those rows once; on entering ``layer`` the hidden states and
    every per-row input of the layers (attention mask, position embeddings) are repeated to
    ``copies * B`` rows, ordered as the copies (row ``r + c * B`` is row ``r`` of copy ``c``), so the
    logits have ``copies * B`` rows, as if every copy had been run. A KV cache then holds ``B`` rows for
    the layers below ``layer`` and ``copies * B`` rows for the others (see :func:`expand_cache`).

    The active :class:`Plan` is written for the ``copies * B`` rows; below ``layer`` its edits must be the
    same for every copy (checked on every layer) and it may not probe there or have ``on_layer``
    callbacks. ``layer`` equal to the number of layers runs the whole model once (logits of ``B`` rows).
    """
    layers = decoder_layers(model)
    if not 0 <= layer <= len(layers) or copies < 1:
        raise ValueError(f"shared_trunk: layer must be in 0..{len(layers)} and copies >= 1, got {layer}, {copies}")
    state: dict[str, Any] = {}

    def first(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        state["B"] = B = int(hidden.shape[0])
        state["memo"] = memo = {}
        return (_repeat_rows(args, B, copies, memo),
                {k: _repeat_rows(v, B, copies, memo) for k, v in kwargs.items()})

    def later(module, args, kwargs):
        B, memo = state["B"], state["memo"]
        return args, {k: _repeat_rows(v, B, copies, memo) for k, v in kwargs.items()}

    handles = []
    if copies > 1 and layer < len(layers):
        handles.append(layers[layer].register_forward_pre_hook(first, with_kwargs=True))
        handles += [m.register_forward_pre_hook(later, with_kwargs=True) for m in layers[layer + 1:]]
    token = _TRUNK.set(_Trunk(layer, copies))
    try:
        yield
    finally:
        _TRUNK.reset(token)
        for h in handles:
            h.remove()


def expand_cache(cache, layer: int, copies: int) -> None:
    """Repeat the rows of a KV cache's layers ``layer..`` to ``copies`` copies of the batch (copy-major, as
    :func:`shared_trunk`), in place: a cache prefilled once for ``B`` rows becomes the cache of the
    ``copies * B`` rows that separate at ``layer``."""
    for cl in cache.layers[layer:]:
        if not getattr(cl, "is_initialized", True) or not hasattr(cl, "batch_select_indices"):
            raise ValueError(f"expand_cache: cannot repeat the rows of a {type(cl).__name__}")
        n = int(cl.keys.shape[0])
        cl.batch_select_indices(torch.arange(n, device=cl.keys.device).repeat(copies))


# --------------------------------------------------------------------------- registration
_REGISTERED = False


def _mask_function(*args, **kwargs):
    """The mask handed to headlab attention: exactly what transformers builds for SDPA."""
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def register() -> str:
    """Register the ``"headlab"`` attention and mask functions with transformers (idempotent).

    Returns :data:`ATTN_IMPLEMENTATION`, to pass as ``attn_implementation=`` when loading a model.
    """
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _mask_function)
        _REGISTERED = True
    return ATTN_IMPLEMENTATION


# --------------------------------------------------------------------------- model inspection
def _configs(model) -> list:
    cfg = model.config
    out = [cfg]
    for name in ("text_config", "vision_config", "audio_config"):
        sub = getattr(cfg, name, None)
        if sub is not None:
            out.append(sub)
    return out


def _text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def attention_layers(model) -> dict[int, int]:
    """Map ``id(attention module) -> layer index`` for the decoder (language model) layers.

    Raises :class:`UnsupportedModelError` for models headlab refuses (see ``_REFUSED_MODEL_TYPES``, cross
    attention, models not loaded with ``attn_implementation="headlab"``).
    """
    text_cfg = _text_config(model)
    for cfg in _configs(model):
        mt = getattr(cfg, "model_type", "")
        if mt in _REFUSED_MODEL_TYPES:
            raise UnsupportedModelError(f"headlab does not support model type {mt!r}: {_REFUSED_MODEL_TYPES[mt]}")
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError("headlab supports decoder-only models (and VLMs with a decoder); "
                                    "encoder-decoder cross-attention is not supported")
    impl = getattr(text_cfg, "_attn_implementation", None)
    if impl != ATTN_IMPLEMENTATION:
        raise UnsupportedModelError(
            f"the model's attention implementation is {impl!r}; call headlab.instrument.register() and load it "
            f"with attn_implementation={ATTN_IMPLEMENTATION!r}")
    n_layers = int(text_cfg.num_hidden_layers)
    layer_of: dict[int, int] = {}
    for name, mod in model.named_modules():
        if not type(mod).__name__.endswith("Attention") or not hasattr(mod, "layer_idx"):
            continue
        cfg = getattr(mod, "config", None)
        if cfg is not None and cfg is not text_cfg and getattr(cfg, "model_type", None) != text_cfg.model_type:
            continue
        if getattr(mod, "is_cross_attention", False) or "cross" in name.split(".")[-1]:
            raise UnsupportedModelError(f"headlab: cross-attention module {name} is not supported")
        if mod.layer_idx is None:
            raise UnsupportedModelError(f"headlab: attention module {name} has no layer_idx")
        layer_of[id(mod)] = int(mod.layer_idx)
    found = sorted(set(layer_of.values()))
    if found != list(range(n_layers)):
        raise UnsupportedModelError(
            f"headlab: found attention modules for layers {found}, expected 0..{n_layers - 1} "
            f"({type(model).__name__}); this architecture is not supported")
    return layer_of


@contextlib.contextmanager
def instrument(model, plan: Plan | None = None) -> Iterator[Recording]:
    """Apply ``plan`` to every forward of ``model`` inside the block; yields the :class:`Recording`.

    Use it around one forward or one ``model.generate(...)`` (the whole generation, prefill included: query
    positions are counted from the first call). Contexts nest (the innermost wins) and are per thread /
    per asyncio task.
    """
    plan = plan or Plan()
    layer_of = attention_layers(model)
    n_layers = int(_text_config(model).num_hidden_layers)
    if plan.probes.layers is not None:
        bad = [ly for ly in plan.probes.layers if not 0 <= int(ly) < n_layers]
        if bad:
            raise ValueError(f"probe layers {bad} out of range (model has {n_layers})")
    for e in plan.edits:
        bad = [ly for ly, _ in (e.heads or []) if not 0 <= ly < n_layers]
        if bad:
            raise ValueError(f"edit layers {bad} out of range (model has {n_layers})")
    sess = _Session(model, plan, layer_of, n_layers)
    token = _ACTIVE.set(sess)
    try:
        yield sess.rec
    finally:
        _ACTIVE.reset(token)


def active_plan() -> Plan | None:
    """The plan of the innermost active :func:`instrument` context, if any."""
    sess = _ACTIVE.get()
    return None if sess is None else sess.plan

