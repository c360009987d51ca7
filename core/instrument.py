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
    rec.argmax       # (batch, layer, head, query) int64, absolute key positions

Positions: every position (queries, probe spans, key spans, argmax) is an absolute position in the
(left-padded) input sequence, counting from 0 at the first token of the first forward inside the context;
in ``generate`` the prompt is positions ``0..N-1`` and the query of decode step ``t`` is ``N - 1 + t``.
Nothing is monkey-patched: the active plan lives in a ``contextvars.ContextVar``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from headlab.kernels import HeadEdits, ProbeRequest, choose_backend
from headlab.kernels import attention as kernel_attention
from headlab.kernels.attention import visibility

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DIMS",
    "LayerContext",
    "Plan",
    "Probes",
    "Recording",
    "UnsupportedModelError",
    "attention_forward",
    "instrument",
    "register",
    "shared_trunk",
    "expand_cache",
    "decoder_layers",
]

ATTN_IMPLEMENTATION = "headlab"

#: dimension names of every array a :class:`Recording` returns (xarray order)
DIMS: dict[str, tuple[str, ...]] = {
    "argmax": ("batch", "layer", "head", "query"),
    "argmax_prob": ("batch", "layer", "head", "query"),
    "entropy": ("batch", "layer", "head", "query"),
    "span_mass": ("batch", "layer", "head", "query", "span"),
    "offset_mass": ("batch", "layer", "head", "query", "offset"),
    "z": ("batch", "layer", "head", "position", "head_dim"),
    "pattern": ("batch", "layer", "head", "query", "key"),
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
    - ``layers``: the layers to probe (``None`` = all).
    """

    argmax: bool = False
    entropy: bool = False
    spans: Any = None
    z_positions: Literal["last", "all"] | Sequence[int] | None = None
    pattern: bool = False
    layers: Sequence[int] | None = None
    offsets: Any = None

    def any(self) -> bool:
        return bool(self.argmax or self.entropy or self.spans is not None or self.z_positions is not None
                    or self.pattern or self.offsets is not None)

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


LayerCallback = Callable[[int, Tensor, LayerContext], "Tensor | None"]


@dataclass
class _HeadEdit:
    kind: str  # "q_scale" | "score_zero" | "out_scale"
    heads: list[tuple[int, int | None]]
    value: float
    rows: list[int] | None


@dataclass
class _BiasEdit:
    heads: list[tuple[int, int | None]]
    spans: Any  # list[(s, e)] for all rows or list[list[(s, e)]] per selected row
    bias: Any  # float or per-span sequence
    rows: list[int] | None


@dataclass
class Plan:
    """Edits and probes over (batch row, layer, head) for one forward or one ``generate``.

    Dense edits (optional; batch dim may be omitted to apply to all rows, layers as in the model):
      - ``q_scale``: (B, L, H) or (L, H) float, multiplies the query (0 = query masking, DeCoRe "flash" mode);
      - ``score_zero``: (B, L, H) or (L, H) bool, zero the pre-softmax scores ("torch" masking mode);
      - ``out_scale``: (B, L, H) or (L, H) float, multiplies the head output ``z`` (0 = ablation, VHR alpha);
      - ``key_spans`` (B, S, 2) int absolute ``[start, end)`` with ``key_bias`` (B, L, H, S) or (L, H, S)
        float added to the pre-softmax scores of the keys in span s (PASTA's log alpha; biases add).
    Builder methods (:meth:`mask_heads`, :meth:`scale_heads`, :meth:`bias_keys`) add sparse edits on top;
    scales multiply, biases add. Heads are ``(layer, head)`` pairs; ``(layer, None)`` means every head of
    the layer. ``rows`` are the batch rows an edit applies to (``None`` = all).

    ``backend`` is passed to the kernel (``"auto"``: Triton on CUDA, torch elsewhere).
    """

    probes: Probes = field(default_factory=Probes)
    q_scale: Tensor | None = None
    score_zero: Tensor | None = None
    out_scale: Tensor | None = None
    key_spans: Tensor | None = None
    key_bias: Tensor | None = None
    backend: str = "auto"
    _edits: list = field(default_factory=list, repr=False)
    _callbacks: list = field(default_factory=list, repr=False)

    # ---- builders
    def mask_heads(self, heads: HeadSpec, rows: Sequence[int] | None = None,
                   mode: Literal["query", "score", "output"] = "query") -> Plan:
        """Mask heads (METHODS.md "Head masking and scaling"): ``query`` zeroes the query (uniform attention
        over the causal prefix, output = mean of V), ``score`` zeroes the pre-softmax scores, ``output``
        zeroes the head output (ablation)."""
        kind = {"query": "q_scale", "score": "score_zero", "output": "out_scale"}.get(mode)
        if kind is None:
            raise ValueError(f"mode must be 'query', 'score' or 'output', got {mode!r}")
        self._edits.append(_HeadEdit(kind, _heads(heads), 0.0 if kind != "score_zero" else 1.0, _rows(rows)))
        return self

    def scale_heads(self, heads: HeadSpec, factor: float, rows: Sequence[int] | None = None) -> Plan:
        """Multiply the outputs ``z`` of these heads by ``factor``."""
        self._edits.append(_HeadEdit("out_scale", _heads(heads), float(factor), _rows(rows)))
        return self

    def scale_queries(self, heads: HeadSpec, factor: float, rows: Sequence[int] | None = None) -> Plan:
        """Multiply the queries of these heads by ``factor`` (0 = query masking)."""
        self._edits.append(_HeadEdit("q_scale", _heads(heads), float(factor), _rows(rows)))
        return self

    def bias_keys(self, heads: HeadSpec, spans, bias: float | Sequence[float],
                  rows: Sequence[int] | None = None) -> Plan:
        """Add ``bias`` to the pre-softmax scores of the keys in ``spans`` on these heads.

        ``spans``: a list of absolute ``(start, end)`` for every selected row, or one such list per selected
        row (``rows`` order; all rows when ``rows`` is None). ``bias``: one float or one per span. PASTA with
        coefficient alpha is ``bias=log(alpha)`` on the non-emphasised spans.
        """
        self._edits.append(_BiasEdit(_heads(heads), spans, bias, _rows(rows)))
        return self

    def on_layer(self, fn: LayerCallback) -> Plan:
        """Call ``fn(layer, z, ctx)`` on every call of every layer, with ``z`` (B, H, Nq, D) the layer's head
        outputs before ``o_proj`` (after the plan's edits). If ``fn`` returns a tensor broadcastable to (B, H),
        it becomes that layer's output scale for this call and every later call in the context (multiplying
        the plan's own ``out_scale``); ``None`` leaves it unchanged. VHR picks its heads this way."""
        self._callbacks.append(fn)
        return self

    # ---- queries
    def is_empty(self) -> bool:
        return not (self.probes.any() or self._edits or self._callbacks or self.q_scale is not None
                    or self.score_zero is not None or self.out_scale is not None or self.key_spans is not None)

    def touches(self, layer: int) -> bool:
        if self._callbacks or self.probes.covers(layer):
            return True
        if self.q_scale is not None or self.score_zero is not None or self.out_scale is not None:
            return True
        if self.key_spans is not None:
            return True
        return any(layer == ly for e in self._edits for ly, _ in e.heads)


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

    Arrays (see :data:`DIMS` / ``rec.dims``), all on the model's device:

    - ``argmax`` (batch, layer, head, query) int64 absolute key position of the top-1 key (-1 for padding
      queries); ``argmax_prob``, ``entropy`` (batch, layer, head, query) float32;
    - ``span_mass`` (batch, layer, head, query, span) float32;
    - ``offset_mass`` (batch, layer, head, query, offset) float32, the attention of query ``t`` to key
      ``t - delta`` for each of ``Probes.offsets``;
    - ``z`` (batch, layer, head, position, head_dim) in the model dtype, at ``z_positions``;
    - ``pattern`` (batch, layer, head, query, key) float32 (keys beyond a call's cache are 0).

    The layer axis lists ``rec.layers``; the query axis is the absolute position (the calls of a
    ``generate`` are concatenated: prefill, then one query per step). ``rec.z_positions`` lists the
    positions of the ``z`` axis. ``rec.calls`` counts forward calls seen by the first probed layer.
    ``rec.backends[layer]``: ``(backend, reason)`` of the layer's last call, as
    :func:`headlab.kernels.choose_backend` decided it (``"native"``: the model's own SDPA call).
    """

    dims = DIMS

    def __init__(self, layers: list[int]):
        self.layers = layers
        self._chunks: dict[str, dict[int, list]] = {k: {ly: [] for ly in layers} for k in DIMS}
        self._zpos: dict[int, list[Tensor]] = {ly: [] for ly in layers}
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
    z = property(lambda self: self._get("z"))
    pattern = property(lambda self: self._get("pattern"))

    @property
    def z_positions(self) -> list[int] | None:
        if not self.layers or not self._zpos[self.layers[0]]:
            return None
        return torch.cat(self._zpos[self.layers[0]]).tolist()

    def as_dict(self) -> dict[str, Tensor]:
        """The recorded arrays by name (only those recorded)."""
        return {k: v for k in DIMS if (v := self._get(k)) is not None}


# --------------------------------------------------------------------------- session
_ACTIVE: contextvars.ContextVar[_Session | None] = contextvars.ContextVar("headlab_instrument", default=None)


class _Session:
    def __init__(self, model, plan: Plan, layer_of: dict[int, int], n_layers: int):
        self.plan = plan
        self.layer_of = layer_of
        self.n_layers = n_layers
        probed = plan.probes.layers if plan.probes.layers is not None else range(n_layers)
        self.probe_layers = sorted(int(ly) for ly in probed) if plan.probes.any() else []
        self.rec = Recording(self.probe_layers)
        self.q_count: dict[int, int] = {}
        self.calls: dict[int, int] = {}
        self.cb_scale: dict[int, Tensor] = {}
        self.store: dict = {}
        self._mask_cache: list = []
        self._offsets_cache: dict = {}

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
        if self.plan.probes.covers(layer) or self.plan._callbacks:
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
        for e in plan._edits:
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
            if isinstance(e, _HeadEdit):
                if e.kind == "score_zero":
                    sz = sel if sz is None else sz | sel
                else:
                    cur = qs if e.kind == "q_scale" else osc
                    cur = torch.ones(B, H, dtype=f32, device=device) if cur is None else cur
                    cur = torch.where(sel, cur * e.value, cur)
                    if e.kind == "q_scale":
                        qs = cur
                    else:
                        osc = cur
            else:
                row_list = rows.tolist()
                per_row = _per_row_spans(e.spans, len(row_list))
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
            vis = visibility(Nq, Nk, 0, Nq, 0, Nk, cand_causal, cand_window, mask.device)
            expect = kpm[:, None, None, :] if vis is None else vis[None, None] & kpm[:, None, None, :]
            if expect.shape == mask.shape and torch.equal(mask, expect):
                return dict(key_padding_mask=None if bool(kpm.all()) else kpm, attn_mask=None,
                            causal=cand_causal, window=cand_window)
    # a general mask (e.g. static-cache slots, bidirectional image blocks)
    return dict(key_padding_mask=None, attn_mask=mask, causal=False, window=None)


def span_tensor(spans, B: int, device) -> Tensor:
    """(B, P, 2) int64 ``[start, end)`` spans from a shared list, per-row lists (shorter rows padded with
    empty spans), a (P, 2) tensor shared by all rows or a (B, P, 2) tensor."""
    if isinstance(spans, Tensor):
        sp = spans.to(device).long()
        return torch.broadcast_to(sp, (B, *sp.shape[-2:])) if sp.dim() == 2 else sp
    per_row = _per_row_spans(spans, B)
    sp = torch.zeros(B, max(len(s) for s in per_row), 2, dtype=torch.long)
    for r, rs in enumerate(per_row):
        for j, (a, b) in enumerate(rs):
            sp[r, j, 0], sp[r, j, 1] = int(a), int(b)
    return sp.to(device)


def _per_row_spans(spans, n_rows: int) -> list[list[tuple[int, int]]]:
    """Normalise ``[(s, e), ...]`` (shared) or ``[[(s, e), ...], ...]`` (per row) to per-row lists."""
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
        reads_z = bool(plan._callbacks)
        if plan.probes.covers(layer):
            p = plan.probes
            probes = ProbeRequest(p.argmax, p.entropy, sess.probe_spans(B, Nk, key_offset, query.device),
                                  sess.probe_offsets(B, Nq, Nk, q_start, query.device), p.pattern)
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
    if plan._callbacks:
        def attend(key_spans: Tensor, key_bias: Tensor) -> Tensor:
            ks = (torch.as_tensor(key_spans, device=query.device).long() - key_offset).clamp(0, Nk)
            kb = torch.broadcast_to(torch.as_tensor(key_bias, device=query.device, dtype=torch.float32),
                                    (B, H, ks.shape[1]))
            return kernel_attention(query, key, value, edits=edits.plus_key_bias(ks, kb), scale=scaling,
                                    softcap=softcap, **margs, backend=plan.backend)[0]

        ctx = LayerContext(layer=layer, call=call, q_start=q_start, n_queries=Nq, store=sess.store,
                           attend=attend)
        for fn in plan._callbacks:
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
    for e in plan._edits:
        bad = [ly for ly, _ in e.heads if not 0 <= ly < n_layers]
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

