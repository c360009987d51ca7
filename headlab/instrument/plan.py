"""The edits of one forward or one ``generate``: the typed :class:`Edit` kinds and the :class:`Plan` holding
them with its probes (conflict check between steering methods, copies of a batch with :meth:`Plan.tile`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from .probes import Probes, pairs_tensor, per_row_spans

__all__ = [
    "Edit",
    "Head",
    "HeadSpec",
    "KeyBias",
    "LayerCallback",
    "LayerContext",
    "LayerFunction",
    "OutputScale",
    "Plan",
    "AddZ",
    "DropResidGrad",
    "QueryScale",
    "ReplaceKV",
    "ReplaceQ",
    "ReplaceResid",
    "ReplaceZ",
    "ScoreZero",
    "SteeringConflictError",
]

HeadSpec = Sequence[tuple[int, int | None]]


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
    ``score_zero``, ``out_scale``, ``key_bias``, ``z_replace``, ``z_add`` or ``kv_replace``; ``description`` words it for messages.
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


def _check_head_values(edit: Any, name: str, why: str = "") -> None:
    """Validate a per-head replacement's ``heads``, ``values`` and ``positions`` in place (ValueError)."""
    if any(h is None for _, h in edit.heads):
        raise ValueError(f"{name} needs explicit (layer, head) pairs{why}")
    if not isinstance(edit.values, Tensor):
        edit.values = torch.as_tensor(edit.values)
    if edit.values.dim() == 0:
        raise ValueError(f"{name}: values must have at least a head_dim axis")
    if edit.positions is not None:
        edit.positions = [int(p) for p in edit.positions]
        if any(p < 0 for p in edit.positions):
            raise ValueError(f"{name}: positions must be >= 0, got {edit.positions}")


@dataclass(eq=False)
class ReplaceZ(Edit):
    """Replace the outputs ``z`` (before ``o_proj``) of ``heads`` on ``rows`` at ``positions`` with ``values``
    (activation patching).

    ``heads``: explicit ``(layer, head)`` pairs (no ``(layer, None)``). ``values``: a tensor broadcastable to
    (rows, heads, positions, head_dim), in the order of ``rows`` (every batch row when ``rows`` is None),
    ``heads`` and ``positions``. ``positions``: absolute query positions; ``None`` = ``0..P-1`` with ``P``
    the size of the positions axis of ``values`` (every position of one forward over the prompts). Each
    attention call replaces the positions among its queries, so a ``generate`` replaces the prompt's
    positions in the prefill and a decode step's when listed. ``from_position`` (instead of ``positions``):
    every absolute position ``>= from_position``, in every call of the context (the prompt's positions from
    there in the prefill, then every decode step's query), with the same value at each (``values`` has a
    positions axis of size 1, or none).

    The replacement is the last change to ``z``: ``o_proj`` receives ``values`` exactly, whatever output
    scales or layer callbacks did before (callbacks see ``z`` before it; a recording of ``z`` reads the
    values). It is differentiable in ``values``: a leaf tensor that requires grad gets ``d output / d z``.
    """

    kind: ClassVar[str] = "z_replace"
    description: ClassVar[str] = "head output replacement"
    heads: list[Head]
    values: Tensor
    rows: list[int] | None = None
    positions: list[int] | None = None
    owner: str | None = field(default=None, kw_only=True)
    instance: Any = field(default=None, kw_only=True, repr=False, compare=False)
    from_position: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        _check_head_values(self, name, ": (layer, None) has no place in values")
        if self.from_position is not None:
            if self.positions is not None:
                raise ValueError(f"{name}: give positions or from_position, not both")
            self.from_position = int(self.from_position)
            if self.from_position < 0:
                raise ValueError(f"{name}: from_position must be >= 0, got {self.from_position}")
            if self.values.dim() >= 2 and self.values.shape[-2] != 1:
                raise ValueError(f"{name}: with from_position, values have a positions axis of size 1 (one value "
                                 f"for every position), got shape {tuple(self.values.shape)}")

    def n_positions(self) -> int:
        """The number of replaced positions (``len(positions)``, or the positions axis of ``values``; 1 with
        ``from_position``: one value for every position)."""
        if getattr(self, "from_position", None) is not None:
            return 1
        if self.positions is not None:
            return len(self.positions)
        return int(self.values.shape[-2]) if self.values.dim() >= 2 else 1

    def full_values(self, n_rows: int) -> Tensor:
        """``values`` broadcast to (``n_rows``, heads, positions, head_dim); a ValueError naming the shapes
        when they do not broadcast."""
        shape = (n_rows, len(self.heads), self.n_positions(), int(self.values.shape[-1]))
        try:
            return torch.broadcast_to(self.values, shape)
        except RuntimeError:
            raise ValueError(f"ReplaceZ: values of shape {tuple(self.values.shape)} do not broadcast to (rows, "
                             f"heads, positions, head_dim) = {shape}") from None


@dataclass(eq=False)
class AddZ(ReplaceZ):
    """Add ``values`` to the outputs ``z`` of ``heads`` on ``rows`` at ``positions`` (the fields and the place
    of :class:`ReplaceZ`; replacements and additions apply in the plan's order).

    Unlike a replacement, an addition keeps ``z``'s dependence on the layers below: a leaf of zeros that
    requires grad gets the total derivative ``d output / d z`` of every head at once (attribution patching).
    """

    kind: ClassVar[str] = "z_add"
    description: ClassVar[str] = "head output addition"


@dataclass(eq=False)
class ReplaceKV(Edit):
    """Replace the keys and/or values of key/value heads on ``rows`` at ``positions`` before attention.

    ``heads``: explicit ``(layer, kv_head)`` pairs, key/value heads (under grouped-query attention each serves
    several query heads; :meth:`Plan.edits_on`, which speaks query heads, never lists the edit). ``keys`` /
    ``values``: tensors broadcastable to (rows, heads, positions, head_dim) in the order of ``rows`` (every
    batch row when ``rows`` is None), ``heads`` and ``positions``, or ``None`` to leave that one alone; keys
    are the ones attention reads (after the rotary embedding and any key norm). ``positions``: absolute key
    positions; ``None`` = ``0..P-1``. Every attention call replaces the positions among the keys it reads
    (the cached ones included), on every path. Two replacements are equal only when they are the same object.
    """

    kind: ClassVar[str] = "kv_replace"
    description: ClassVar[str] = "key/value replacement"
    heads: list[Head]
    keys: Tensor | None = None
    values: Tensor | None = None
    rows: list[int] | None = None
    positions: list[int] | None = None
    owner: str | None = field(default=None, kw_only=True)
    instance: Any = field(default=None, kw_only=True, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if any(h is None for _, h in self.heads):
            raise ValueError("ReplaceKV needs explicit (layer, kv_head) pairs")
        if self.keys is None and self.values is None:
            raise ValueError("ReplaceKV: give keys, values or both")
        for name in ("keys", "values"):
            t = getattr(self, name)
            if t is not None and not isinstance(t, Tensor):
                setattr(self, name, torch.as_tensor(t))
            if getattr(self, name) is not None and getattr(self, name).dim() == 0:
                raise ValueError(f"ReplaceKV: {name} must have at least a head_dim axis")
        if self.positions is not None:
            self.positions = [int(p) for p in self.positions]
            if any(p < 0 for p in self.positions):
                raise ValueError(f"ReplaceKV: positions must be >= 0, got {self.positions}")

    def covers(self, layer: int, head: int) -> bool:
        return False

    def n_positions(self) -> int:
        """The number of replaced positions (``len(positions)``, or the positions axis of the tensors)."""
        if self.positions is not None:
            return len(self.positions)
        t = self.keys if self.keys is not None else self.values
        return int(t.shape[-2]) if t.dim() >= 2 else 1

    def full(self, name: str, n_rows: int) -> Tensor | None:
        """``keys`` or ``values`` (``name``) broadcast to (``n_rows``, heads, positions, head_dim), or ``None``."""
        t = getattr(self, name)
        if t is None:
            return None
        shape = (n_rows, len(self.heads), self.n_positions(), int(t.shape[-1]))
        try:
            return torch.broadcast_to(t, shape)
        except RuntimeError:
            raise ValueError(f"ReplaceKV: {name} of shape {tuple(t.shape)} do not broadcast to (rows, heads, "
                             f"positions, head_dim) = {shape}") from None


@dataclass(eq=False)
class ReplaceQ(Edit):
    """Replace the queries of ``heads`` on ``rows`` at ``positions`` with ``values`` before attention (path
    patching into a head's query input).

    The fields of :class:`ReplaceZ`: ``heads`` explicit ``(layer, head)`` query heads; ``values``
    broadcastable to (rows, heads, positions, head_dim); ``positions`` absolute query positions (``None`` =
    ``0..P-1``). The queries are the ones attention reads (after the rotary embedding and any query norm;
    a :class:`QueryScale` still multiplies them). On every path.
    """

    kind: ClassVar[str] = "q_replace"
    description: ClassVar[str] = "query replacement"
    heads: list[Head]
    values: Tensor
    rows: list[int] | None = None
    positions: list[int] | None = None
    owner: str | None = field(default=None, kw_only=True)
    instance: Any = field(default=None, kw_only=True, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_head_values(self, "ReplaceQ")

    n_positions = ReplaceZ.n_positions
    full_values = ReplaceZ.full_values


@dataclass(eq=False)
class ReplaceResid(Edit):
    """Replace the residual stream entering decoder layer ``layer`` (its input hidden states) on ``rows`` at
    ``positions`` with ``values`` (activation patching of the residual stream; layer 0's input is the
    embedding).

    ``values``: a tensor broadcastable to (rows, positions, hidden) in the order of ``rows`` (every batch row
    when ``rows`` is None) and ``positions``. ``positions``: absolute positions; ``None`` = ``0..P-1`` with
    ``P`` the size of the positions axis of ``values``. Each call of the layer replaces the positions among
    its queries. Differentiable in ``values``. Not under a :func:`~headlab.instrument.shared_trunk`.
    """

    kind: ClassVar[str] = "resid_replace"
    description: ClassVar[str] = "residual stream replacement"
    layer: int
    values: Tensor
    rows: list[int] | None = None
    positions: list[int] | None = None
    owner: str | None = field(default=None, kw_only=True)
    instance: Any = field(default=None, kw_only=True, repr=False, compare=False)
    heads: list[Head] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.layer = int(self.layer)
        if self.layer < 0:
            raise ValueError(f"ReplaceResid: layer must be >= 0, got {self.layer}")
        if not isinstance(self.values, Tensor):
            self.values = torch.as_tensor(self.values)
        if self.values.dim() == 0:
            raise ValueError("ReplaceResid: values must have at least a hidden axis")
        if self.positions is not None:
            self.positions = [int(p) for p in self.positions]
            if any(p < 0 for p in self.positions):
                raise ValueError(f"ReplaceResid: positions must be >= 0, got {self.positions}")

    def n_positions(self) -> int:
        """The number of replaced positions (``len(positions)``, or the positions axis of ``values``)."""
        if self.positions is not None:
            return len(self.positions)
        return int(self.values.shape[-2]) if self.values.dim() >= 2 else 1

    def full_values(self, n_rows: int) -> Tensor:
        """``values`` broadcast to (``n_rows``, positions, hidden); a ValueError naming the shapes when they do
        not broadcast."""
        shape = (n_rows, self.n_positions(), int(self.values.shape[-1]))
        try:
            return torch.broadcast_to(self.values, shape)
        except RuntimeError:
            raise ValueError(f"ReplaceResid: values of shape {tuple(self.values.shape)} do not broadcast to "
                             f"(rows, positions, hidden) = {shape}") from None


@dataclass(eq=False)
class DropResidGrad(Edit):
    """Drop the gradient through decoder layer ``layer``'s write to the residual stream on ``rows`` (GradDrop,
    docs/methods.md#atp-the-qk-fix-and-graddrop): the forward is unchanged; in the backward pass the gradient
    reaches the layers below only through the residual skip around ``layer``, and nothing inside ``layer``
    gets a gradient from those rows."""

    kind: ClassVar[str] = "grad_drop"
    description: ClassVar[str] = "residual gradient drop"
    layer: int
    rows: list[int] | None = None
    owner: str | None = field(default=None, kw_only=True)
    instance: Any = field(default=None, kw_only=True, repr=False, compare=False)
    heads: list[Head] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.layer = int(self.layer)
        if self.layer < 0:
            raise ValueError(f"DropResidGrad: layer must be >= 0, got {self.layer}")


_EDIT_TYPES = (QueryScale, ScoreZero, OutputScale, KeyBias, LayerCallback, ReplaceZ, ReplaceKV, ReplaceQ,
               ReplaceResid, DropResidGrad)


@dataclass
class Plan:
    """Edits and probes over (batch row, layer, head) for one forward or one ``generate``.

    **Typed edits** (:attr:`edits`, a public list, applied in order; scales multiply, biases add):

    - :class:`QueryScale` ``(heads, factor, rows)``: multiply the query (0 = query masking, DeCoRe "flash");
    - :class:`ScoreZero` ``(heads, rows)``: zero the pre-softmax scores ("torch" masking mode);
    - :class:`OutputScale` ``(heads, factor, rows)``: multiply the head output ``z`` (0 = ablation);
    - :class:`KeyBias` ``(heads, spans, bias, rows)``: add pre-softmax biases to key spans (PASTA);
    - :class:`LayerCallback` ``(fn, heads, rows)``: a function of each layer's ``z`` that may return an
      output scale (VHR);
    - :class:`ReplaceZ` ``(heads, values, rows, positions)``: replace the head output ``z`` (activation
      patching), after the other edits; :class:`AddZ` (the same fields): add to it (at every position from
      one on with ``from_position``: a steering vector on a head's output);
    - :class:`ReplaceKV` ``(heads, keys, values, rows, positions)``: replace the keys / values of key/value
      heads before attention;
    - :class:`ReplaceQ` ``(heads, values, rows, positions)``: replace the queries of query heads before
      attention;
    - :class:`ReplaceResid` ``(layer, values, rows, positions)``: replace the residual stream entering a
      decoder layer; :class:`DropResidGrad` ``(layer, rows)``: drop the gradient through a layer's residual
      write (both per layer, not per head).

    Heads are ``(layer, head)`` pairs; ``(layer, None)`` means every head of the layer. ``rows`` are the
    batch rows an edit applies to (``None`` = all). Add edits with :meth:`add` or the builders
    (:meth:`mask_heads`, :meth:`scale_heads`, :meth:`scale_queries`, :meth:`bias_keys`, :meth:`on_layer`,
    :meth:`patch_z`, :meth:`add_z`, :meth:`patch_kv`),
    which take ``owner=``: the method adding the edit, as a name or as its config (named by its ``kind``;
    two config objects are two owners). Two edits of the same kind on a shared (layer, head) and
    overlapping rows from different owners raise :class:`SteeringConflictError` (edits without an owner
    are never checked); the same owner may add repeatedly.

    **Copies of a batch**: :meth:`tile` turns a plan for ``rows`` batch rows into one for ``copies * rows``
    rows (row ``r + c * rows`` is row ``r`` of copy ``c``), each copy edited like its source row or only
    copy 0 (contrastive decoding's base and masked copies). :meth:`edits_on` lists the edits of one head;
    :attr:`callbacks` the layer functions.

    ``backend`` is the path requested of :func:`headlab.kernels.choose_backend` (``"auto"``: it decides per layer;
    ``"torch"``, ``"triton"`` or ``"sdpa"`` force one; ``rec.backends`` says what ran).
    """

    probes: Probes = field(default_factory=Probes)
    backend: str = "auto"
    edits: list[Edit] = field(default_factory=list)

    # ---- adding edits
    def add(self, *edits: Edit) -> Plan:
        """Append ``edits`` (all or none: a conflict leaves the plan unchanged).

        Raises :class:`SteeringConflictError` when an edit with an owner shares its kind, a (layer, head) and
        a batch row with an edit of another owner (already in the plan or earlier in ``edits``).
        """
        for e in edits:
            if not isinstance(e, _EDIT_TYPES):
                raise TypeError(f"Plan.add takes typed edits ({', '.join(t.__name__ for t in _EDIT_TYPES)}), "
                                f"got {type(e).__name__}")
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
        the plan's own output scales); ``None`` leaves it unchanged. VHR picks its heads this way.

        ``heads``/``rows`` declare which heads and rows ``fn`` may scale (a :class:`LayerCallback`), for the
        conflict check with other owners' output scales."""
        return self.add(LayerCallback(fn, heads, rows, owner=owner))

    def patch_z(self, heads: HeadSpec, values: Tensor, rows: Sequence[int] | None = None,
                positions: Sequence[int] | None = None, *, owner: Any = None) -> Plan:
        """Replace the outputs ``z`` of these heads on ``rows`` at absolute ``positions`` with ``values``
        (broadcastable to (rows, heads, positions, head_dim); a :class:`ReplaceZ`)."""
        return self.add(ReplaceZ(heads, values, rows, positions, owner=owner))

    def add_z(self, heads: HeadSpec, values: Tensor, rows: Sequence[int] | None = None,
              positions: Sequence[int] | None = None, *, from_position: int | None = None,
              owner: Any = None) -> Plan:
        """Add ``values`` to the outputs ``z`` of these heads on ``rows`` at absolute ``positions``, or at every
        position ``>= from_position`` (prefill and decode steps alike; ``values`` broadcastable to (rows, heads,
        1, head_dim)) (an :class:`AddZ`)."""
        return self.add(AddZ(heads, values, rows, positions, owner=owner, from_position=from_position))

    def patch_kv(self, heads: HeadSpec, keys: Tensor | None = None, values: Tensor | None = None,
                 rows: Sequence[int] | None = None, positions: Sequence[int] | None = None, *,
                 owner: Any = None) -> Plan:
        """Replace the keys and/or values of these ``(layer, kv_head)`` heads on ``rows`` at absolute key
        ``positions`` (a :class:`ReplaceKV`)."""
        return self.add(ReplaceKV(heads, keys, values, rows, positions, owner=owner))

    def patch_q(self, heads: HeadSpec, values: Tensor, rows: Sequence[int] | None = None,
                positions: Sequence[int] | None = None, *, owner: Any = None) -> Plan:
        """Replace the queries of these heads on ``rows`` at absolute ``positions`` with ``values``
        (broadcastable to (rows, heads, positions, head_dim); a :class:`ReplaceQ`)."""
        return self.add(ReplaceQ(heads, values, rows, positions, owner=owner))

    def patch_resid(self, layer: int, values: Tensor, rows: Sequence[int] | None = None,
                    positions: Sequence[int] | None = None, *, owner: Any = None) -> Plan:
        """Replace the residual stream entering decoder layer ``layer`` on ``rows`` at absolute ``positions``
        with ``values`` (broadcastable to (rows, positions, hidden); a :class:`ReplaceResid`)."""
        return self.add(ReplaceResid(layer, values, rows, positions, owner=owner))

    def drop_resid_grad(self, layer: int, rows: Sequence[int] | None = None, *, owner: Any = None) -> Plan:
        """Drop the gradient through decoder layer ``layer``'s residual write on ``rows`` (a
        :class:`DropResidGrad`)."""
        return self.add(DropResidGrad(layer, rows, owner=owner))

    # ---- queries
    @property
    def callbacks(self) -> tuple[LayerFunction, ...]:
        """The functions of the plan's :class:`LayerCallback` edits, in order (read-only)."""
        return tuple(e.fn for e in self.edits if isinstance(e, LayerCallback))

    def edits_on(self, layer: int, head: int) -> list[Edit]:
        """The edits that apply to head ``(layer, head)`` on some row, in order (layer callbacks that declare
        no heads included)."""
        return [e for e in self.edits if e.covers(int(layer), int(head))]

    def is_empty(self) -> bool:
        """Whether the plan neither edits nor records anything."""
        return not (self.probes.any() or self.edits)

    def touches(self, layer: int) -> bool:
        """Whether the plan edits or records something on ``layer`` (layer callbacks touch every layer)."""
        if self.callbacks or self.probes.covers(layer):
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
            elif isinstance(e, ReplaceKV):
                which = torch.tensor([i for i, r in enumerate(src) for _ in rows_for(r)], dtype=torch.long)
                parts = {name: None if (t := e.full(name, len(src))) is None else t[which.to(t.device)]
                         for name in ("keys", "values")}
                out.edits.append(dataclasses.replace(e, **parts, rows=new_rows))
            elif isinstance(e, ReplaceQ):
                which = torch.tensor([i for i, r in enumerate(src) for _ in rows_for(r)], dtype=torch.long)
                values = e.full_values(len(src))
                out.edits.append(dataclasses.replace(e, values=values[which.to(values.device)], rows=new_rows))
            elif isinstance(e, ReplaceResid):
                which = torch.tensor([i for i, r in enumerate(src) for _ in rows_for(r)], dtype=torch.long)
                values = e.full_values(len(src))
                out.edits.append(dataclasses.replace(e, values=values[which.to(values.device)], rows=new_rows))
            elif isinstance(e, ReplaceZ):
                which = torch.tensor([i for i, r in enumerate(src) for _ in rows_for(r)], dtype=torch.long)
                values = e.full_values(len(src))
                out.edits.append(dataclasses.replace(e, values=values[which.to(values.device)], rows=new_rows))
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
        return lambda start, stop: pairs_tensor(pairs(start, stop), B).repeat(k, 1, 1)
    t = pairs_tensor(pairs, B)
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
