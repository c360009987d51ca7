"""The state of one :func:`~headlab.instrument.instrument` context (:class:`Session`): the plan, the
recording, the queries each layer has run, and the plan's edits and probes as tensors for one layer call.

The session turns the plan's batch rows into the rows of a call: under a :func:`~headlab.instrument.shared_trunk`
a layer below the split runs copy 0 of the ``copies * B`` rows the plan is written for.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from .masks import kernel_mask_args
from .plan import (
    AddZ,
    Edit,
    KeyBias,
    LayerCallback,
    OutputScale,
    Plan,
    QueryScale,
    ReplaceKV,
    ReplaceQ,
    ReplaceZ,
    ScoreZero,
)
from .positions import CallPositions
from .probes import offsets_tensor, pairs_tensor, per_row_spans, select_pairs, span_tensor
from .recording import Recording
from .trunk import active_trunk

__all__ = ["Session", "activated", "active_session"]

_ACTIVE: contextvars.ContextVar[Session | None] = contextvars.ContextVar("headlab_instrument", default=None)


def active_session() -> Session | None:
    """The session of the innermost active instrument context, if any."""
    return _ACTIVE.get()


@contextlib.contextmanager
def activated(session: Session) -> Iterator[Session]:
    """Make ``session`` the active one inside the block (per thread / asyncio task; blocks nest)."""
    token = _ACTIVE.set(session)
    try:
        yield session
    finally:
        _ACTIVE.reset(token)


class Session:
    """One instrument context over a model: ``layer_of`` maps ``id(attention module)`` to its layer."""

    def __init__(self, plan: Plan, layer_of: dict[int, int], n_layers: int):
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

    # ---- the queries each layer has run
    def positions(self, layer: int | None, n_queries: int, n_keys: int) -> CallPositions:
        """The positions of ``layer``'s next call (an uninstrumented call starts at 0)."""
        q_start = 0 if layer is None else self.q_count.get(layer, 0)
        return CallPositions.of(q_start, n_queries, n_keys)

    def advance(self, layer: int, n_queries: int) -> None:
        """Count a call of ``layer`` that ran ``n_queries`` queries."""
        self.q_count[layer] = self.q_count.get(layer, 0) + n_queries
        self.calls[layer] = self.calls.get(layer, 0) + 1

    # ---- masks (cached per mask tensor: every layer of a forward shares it)
    def mask_args(self, mask: Tensor | None, Nq: int, Nk: int, causal: bool, window: int | None) -> dict:
        """:func:`~headlab.instrument.masks.kernel_mask_args`, computed once per mask tensor."""
        if mask is None:
            return kernel_mask_args(None, Nq, Nk, causal, window)
        for entry in self._mask_cache:
            if entry[0] is mask and entry[1] == (Nq, Nk, causal, window):
                return entry[2]
        result = kernel_mask_args(mask, Nq, Nk, causal, window)
        self._mask_cache.append((mask, (Nq, Nk, causal, window), result))
        if len(self._mask_cache) > 8:
            self._mask_cache.pop(0)
        return result

    # ---- per-layer edit tensors
    def edits_for(self, layer: int, B: int, H: int, pos: CallPositions, device: Any) -> dict[str, Tensor | None]:
        """The plan's edits on ``layer`` as :class:`headlab.kernels.HeadEdits` fields for a call of ``B`` rows
        and ``H`` heads (key spans as key slots of the call)."""
        trunk = active_trunk()
        if trunk is None or layer >= trunk.layer:
            return self._edits_for(layer, B, H, pos, device)
        if self.plan.probes.covers(layer) or self.plan.callbacks:
            raise ValueError(f"shared_trunk: layer {layer} runs once for {trunk.copies} copies of the batch, "
                             "so it cannot record probes or run on_layer callbacks")
        full = self._edits_for(layer, B * trunk.copies, H, pos, device)
        return {name: None if t is None else _copy0(t, B, trunk.copies, name, layer) for name, t in full.items()}

    def _edits_for(self, layer: int, B: int, H: int, pos: CallPositions, device: Any) -> dict[str, Tensor | None]:
        qs = sz = osc = None
        spans_l: list[Tensor] = []
        bias_l: list[Tensor] = []
        for e in self.plan.edits:
            if isinstance(e, (LayerCallback, ReplaceZ, ReplaceKV, ReplaceQ)) or e.heads is None:  # None: per layer
                continue
            hit = _selection(e, layer, B, H, device)
            if hit is None:
                continue
            rows, sel = hit
            if isinstance(e, ScoreZero):
                sz = sel if sz is None else sz | sel
            elif isinstance(e, QueryScale):
                qs = _scaled(qs, sel, e.factor, B, H, device)
            elif isinstance(e, OutputScale):
                osc = _scaled(osc, sel, e.factor, B, H, device)
            elif isinstance(e, KeyBias):
                biased = _key_bias(e, rows, sel, B, device)
                if biased is not None:
                    spans_l.append(biased[0])
                    bias_l.append(biased[1])
        cb = self.cb_scale.get(layer)
        if cb is not None:
            osc = cb if osc is None else osc * cb
        out: dict[str, Tensor | None] = dict(q_scale=qs, score_zero=sz, out_scale=osc)
        if spans_l:
            out["key_spans"] = pos.key_spans(torch.cat(spans_l, dim=1))
            out["key_bias"] = torch.cat(bias_l, dim=2)
        return out

    def replace_z(self, layer: int, z: Tensor, pos: CallPositions) -> Tensor:
        """``z`` (B, H, Nq, D) of a call of ``layer`` with the plan's :class:`ReplaceZ` / :class:`AddZ` edits applied in order
        (out of place, differentiable in their values); ``z`` itself when none replaces a query of the call."""
        edits = [e for e in self.plan.edits if isinstance(e, ReplaceZ) and any(ly == layer for ly, _ in e.heads)]
        if not edits:
            return z
        trunk = active_trunk()
        B, H, Nq, D = z.shape
        if trunk is not None and layer < trunk.layer:
            k = trunk.copies
            full = z.repeat(k, 1, 1, 1)
            for e in edits:
                full = _replaced(e, layer, full, pos, k * B, H, Nq, D)
            return _copy0(full, B, k, "head output replacements/additions", layer)
        for e in edits:
            z = _replaced(e, layer, z, pos, B, H, Nq, D)
        return z

    def replace_q(self, layer: int, query: Tensor, pos: CallPositions) -> Tensor:
        """``query`` (B, H, Nq, D) of a call of ``layer`` with the plan's :class:`ReplaceQ` edits applied in order
        (out of place); ``query`` itself when none has a head on the layer."""
        edits = [e for e in self.plan.edits if isinstance(e, ReplaceQ) and any(ly == layer for ly, _ in e.heads)]
        if not edits:
            return query
        trunk = active_trunk()
        if trunk is not None and layer < trunk.layer:
            raise ValueError(f"shared_trunk: layer {layer} runs once for {trunk.copies} copies of the batch, "
                             "so its queries cannot be replaced")
        B, H, Nq, D = query.shape
        for e in edits:
            query = _replaced(e, layer, query, pos, B, H, Nq, D)
        return query

    def replace_kv(self, layer: int, key: Tensor, value: Tensor, pos: CallPositions) -> tuple[Tensor, Tensor]:
        """``key`` / ``value`` (B, Hkv, Nk, D) of a call of ``layer`` with the plan's :class:`ReplaceKV` edits
        applied in order (out of place; key slot ``j`` is absolute position ``pos.key_offset + j``, slots past
        ``pos.n_keys`` untouched)."""
        edits = [e for e in self.plan.edits if isinstance(e, ReplaceKV) and any(ly == layer for ly, _ in e.heads)]
        if not edits:
            return key, value
        trunk = active_trunk()
        if trunk is not None and layer < trunk.layer:
            raise ValueError(f"shared_trunk: layer {layer} runs once for {trunk.copies} copies of the batch, "
                             "so its keys and values cannot be replaced")
        for e in edits:
            key = _replaced_kv(e, "keys", layer, key, pos)
            value = _replaced_kv(e, "values", layer, value, pos)
        return key, value

    # ---- per-call probe tensors
    def probe_spans(self, B: int, pos: CallPositions, device: Any) -> Tensor | None:
        """(B, S, 2) ``Probes.spans`` as key slots of the call."""
        spans = self.plan.probes.spans
        if spans is None:
            return None
        return pos.key_spans(span_tensor(spans, B, device))

    def probe_offsets(self, B: int, pos: CallPositions, device: Any) -> Tensor | None:
        """(B, O) ``Probes.offsets`` as the kernel counts them (see :meth:`CallPositions.offsets`)."""
        offsets = self.plan.probes.offsets
        if offsets is None:
            return None
        key = (B, str(device))
        base = self._offsets_cache.get(key)
        if base is None:
            base = offsets_tensor(offsets, B).to(device)
            self._offsets_cache[key] = base
        return pos.offsets(base)

    def probe_pairs(self, B: int, pos: CallPositions, device: Any) -> Tensor | None:
        """The pairs of ``Probes.pairs`` whose query this call runs, as (B, P, 2) absolute positions (-1 =
        unused slot) in the order given; one selection per call, shared by the layers."""
        pairs = self.plan.probes.pairs
        if pairs is None:
            return None
        q_start, Nq = pos.q_start, pos.n_queries
        key = (B, Nq, q_start, str(device))
        hit = self._pairs_cache.get(key)
        if hit is None:
            if callable(pairs):
                base = pairs_tensor(pairs(q_start, q_start + Nq), B)
            else:
                base = self._pairs_cache.get("base")
                if base is None or base.shape[0] != B:
                    base = self._pairs_cache["base"] = pairs_tensor(pairs, B)
            hit = select_pairs(base, q_start, q_start + Nq).to(device)
            self._pairs_cache = {k: v for k, v in self._pairs_cache.items() if k == "base"}
            self._pairs_cache[key] = hit
        return hit


def _selection(e: Edit, layer: int, B: int, H: int, device: Any) -> tuple[Tensor, Tensor] | None:
    """The rows of edit ``e`` (a 1-D index tensor) and its (B, H) bool selection on ``layer``; ``None`` when
    it has no head there."""
    hs = [h for ly, h in e.heads if ly == layer]
    if not hs:
        return None
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
    return rows, sel


def _replaced(e: ReplaceZ | ReplaceQ, layer: int, z: Tensor, pos: CallPositions, B: int, H: int, Nq: int,
              D: int) -> Tensor:
    """``z`` with the values of one :class:`ReplaceZ` (or added, :class:`AddZ`; or the queries of a
    :class:`ReplaceQ`) at its heads of ``layer`` and the call's queries."""
    device = z.device
    rows = list(range(B)) if e.rows is None else e.rows
    if rows and max(rows) >= B:
        raise ValueError(f"ReplaceZ rows {e.rows} out of range for batch size {B}")
    values = e.full_values(len(rows))
    if values.shape[-1] != D:
        raise ValueError(f"ReplaceZ: values have head_dim {values.shape[-1]}, layer {layer} has {D}")
    k_sel = [k for k, (ly, _) in enumerate(e.heads) if ly == layer]
    heads = [e.heads[k][1] for k in k_sel]
    if any(not 0 <= h < H for h in heads):
        raise ValueError(f"ReplaceZ: head out of range in {heads} (layer {layer} has {H} heads)")
    start = getattr(e, "from_position", None)
    if start is not None:
        first = max(int(start) - pos.q_start, 0)
        if first >= Nq:
            return z
        q_rows = torch.arange(first, Nq)
        vals = values[:, k_sel].expand(-1, -1, Nq - first, -1).to(device=device, dtype=z.dtype)
    else:
        positions = torch.arange(e.n_positions()) if e.positions is None else torch.tensor(e.positions)
        q = positions - pos.q_start
        p_sel = ((q >= 0) & (q < Nq)).nonzero().flatten()
        if not p_sel.numel():
            return z
        vals = values[:, k_sel][:, :, p_sel.to(values.device)].to(device=device, dtype=z.dtype)
        q_rows = q[p_sel]
    r_idx = torch.tensor(rows, device=device)[:, None, None]
    h_idx = torch.tensor(heads, device=device)[None, :, None]
    q_idx = q_rows.to(device)[None, None, :]
    r_idx, h_idx, q_idx = torch.broadcast_tensors(r_idx, h_idx, q_idx)
    return z.index_put((r_idx, h_idx, q_idx), vals, accumulate=isinstance(e, AddZ))


def _replaced_kv(e: ReplaceKV, name: str, layer: int, t: Tensor, pos: CallPositions) -> Tensor:
    """``t`` (keys or values, (B, Hkv, Nk, D)) with ``e``'s ``name`` tensor at its heads of ``layer`` and the
    key positions the call holds."""
    B, Hkv, _, D = t.shape
    rows = list(range(B)) if e.rows is None else e.rows
    if rows and max(rows) >= B:
        raise ValueError(f"ReplaceKV rows {e.rows} out of range for batch size {B}")
    full = e.full(name, len(rows))
    if full is None:
        return t
    if full.shape[-1] != D:
        raise ValueError(f"ReplaceKV: {name} have head_dim {full.shape[-1]}, layer {layer} has {D}")
    k_sel = [k for k, (ly, _) in enumerate(e.heads) if ly == layer]
    heads = [e.heads[k][1] for k in k_sel]
    if any(not 0 <= h < Hkv for h in heads):
        raise ValueError(f"ReplaceKV: kv head out of range in {heads} (layer {layer} has {Hkv} key/value heads)")
    positions = torch.arange(e.n_positions()) if e.positions is None else torch.tensor(e.positions)
    slot = positions - pos.key_offset
    p_sel = ((slot >= 0) & (slot < pos.n_keys)).nonzero().flatten()
    if not p_sel.numel():
        return t
    vals = full[:, k_sel][:, :, p_sel.to(full.device)].to(device=t.device, dtype=t.dtype)
    r_idx = torch.tensor(rows, device=t.device)[:, None, None]
    h_idx = torch.tensor(heads, device=t.device)[None, :, None]
    s_idx = slot[p_sel].to(t.device)[None, None, :]
    r_idx, h_idx, s_idx = torch.broadcast_tensors(r_idx, h_idx, s_idx)
    return t.index_put((r_idx, h_idx, s_idx), vals)


def _scaled(cur: Tensor | None, sel: Tensor, factor: float, B: int, H: int, device: Any) -> Tensor:
    """The (B, H) scales ``cur`` (``None``: all 1) multiplied by ``factor`` where ``sel``."""
    cur = torch.ones(B, H, dtype=torch.float32, device=device) if cur is None else cur
    return torch.where(sel, cur * factor, cur)


def _key_bias(e: KeyBias, rows: Tensor, sel: Tensor, B: int, device: Any) -> tuple[Tensor, Tensor] | None:
    """(B, S, 2) absolute spans and (B, H, S) biases of a :class:`KeyBias` (``None`` when it has no span)."""
    f32 = torch.float32
    row_list = rows.tolist()
    per_row = per_row_spans(e.spans, len(row_list))
    S = max((len(s) for s in per_row), default=0)
    if S == 0:
        return None
    sp = torch.zeros(B, S, 2, dtype=torch.long, device=device)
    for i, r in enumerate(row_list):
        for j, (a, b_) in enumerate(per_row[i]):
            sp[r, j, 0], sp[r, j, 1] = int(a), int(b_)
    bvals = torch.as_tensor(e.bias, dtype=f32, device=device)
    bvals = torch.broadcast_to(bvals, (S,)) if bvals.dim() == 0 else bvals
    if bvals.numel() != S:
        raise ValueError(f"bias_keys: {bvals.numel()} biases for {S} spans")
    bias = torch.where(sel[:, :, None], bvals[None, None, :], torch.zeros((), dtype=f32, device=device))
    return sp, bias


def _copy0(t: Tensor, B: int, copies: int, name: str, layer: int) -> Tensor:
    """The rows of copy 0 of a ``copies * B``-row edit tensor, which must be the same for every copy."""
    first = t[:B]
    for c in range(1, copies):
        if not torch.equal(t[c * B:(c + 1) * B], first):
            raise ValueError(f"shared_trunk: the plan's {name} differs between copies of the batch on layer "
                             f"{layer}, below the layer where the copies separate")
    return first
