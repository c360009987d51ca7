"""The probes recorded during an :func:`~headlab.instrument.instrument` context (:class:`Recording`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import xarray as xr
from torch import Tensor

from .probes import Probes, offsets_tensor, span_tensor

__all__ = ["DIMS", "Recording"]

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
    "k": ("example", "layer", "kv_head", "position", "head_dim"),
    "v": ("example", "layer", "kv_head", "position", "head_dim"),
    "q": ("example", "layer", "head", "position", "head_dim"),
}


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
    - ``pattern`` (example, layer, head, query, key) float32 (keys beyond a call's cache are 0);
    - ``k``, ``v`` (example, layer, kv_head, position, head_dim) in the model dtype, the keys (as attention
      reads them) and values at ``kv_positions``; ``rec.kv_positions`` lists the positions of their axis;
    - ``q`` (example, layer, head, position, head_dim) in the model dtype, the queries at ``q_positions``
      (``rec.q_positions``).

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
        self._kvpos: dict[int, list[Tensor]] = {ly: [] for ly in layers}
        self._qpos: dict[int, list[Tensor]] = {ly: [] for ly in layers}
        self._cache: dict[str, Tensor | None] = {}
        self.calls = 0
        self.backends: dict[int, tuple[str, str]] = {}

    # ---- written by the attention function, one chunk per layer call
    def _add(self, name: str, layer: int, value: Tensor) -> None:
        self._chunks[name][layer].append(value)
        self._cache.pop(name, None)

    def _add_z_positions(self, layer: int, positions: Tensor) -> None:
        self._zpos[layer].append(positions)

    def _add_kv_positions(self, layer: int, positions: Tensor) -> None:
        self._kvpos[layer].append(positions)

    def _add_q_positions(self, layer: int, positions: Tensor) -> None:
        self._qpos[layer].append(positions)

    def _add_pair_positions(self, layer: int, positions: Tensor) -> None:
        self._pairpos[layer].append(positions)

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
        first = per_layer[0][0].device  # layers split across devices (device_map) meet on the first layer's
        out = torch.stack([torch.cat(chunks, dim=axis).to(first) for chunks in per_layer], dim=1)
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
    k = property(lambda self: self._get("k"))
    v = property(lambda self: self._get("v"))
    q = property(lambda self: self._get("q"))

    @property
    def pairs(self) -> Tensor | None:
        """(example, pair, 2) int64 absolute ``(query, key)`` positions of the ``pair`` axis of ``pair_mass``
        (-1 for an unused slot), on the CPU."""
        if not self.layers or not self._pairpos[self.layers[0]]:
            return None
        return torch.cat(self._pairpos[self.layers[0]], dim=1)

    @property
    def z_positions(self) -> list[int] | None:
        """The absolute positions of the ``position`` axis of ``z``."""
        if not self.layers or not self._zpos[self.layers[0]]:
            return None
        return torch.cat(self._zpos[self.layers[0]]).tolist()

    @property
    def kv_positions(self) -> list[int] | None:
        """The absolute positions of the ``position`` axis of ``k`` and ``v``."""
        if not self.layers or not self._kvpos[self.layers[0]]:
            return None
        return torch.cat(self._kvpos[self.layers[0]]).tolist()

    @property
    def q_positions(self) -> list[int] | None:
        """The absolute positions of the ``position`` axis of ``q``."""
        if not self.layers or not self._qpos[self.layers[0]]:
            return None
        return torch.cat(self._qpos[self.layers[0]]).tolist()

    def as_dict(self) -> dict[str, Tensor]:
        """The recorded arrays by name (only those recorded)."""
        return {k: v for k in DIMS if (v := self._get(k)) is not None}

    def to_xarray(self, name: str) -> xr.DataArray:
        """The recorded array ``name`` as a DataArray on the CPU, with the dims of ``DIMS[name]``.

        Coordinates: ``example`` the batch rows ``0..B-1``; ``layer`` the recorded layers (``rec.layers``);
        ``head`` (``kv_head`` for ``k``, ``v``) ``0..H-1``; ``query`` and ``key`` absolute positions ``0..``;
        ``position`` the positions of ``z`` (``rec.z_positions``; of ``k``, ``v``: ``rec.kv_positions``); ``span`` ``0..S-1``, with ``span_start`` / ``span_end`` (example, span)
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
                                  dims[2]: np.arange(H)}
        if "query" in dims:
            coords["query"] = np.arange(t.shape[3])
        if name == "pattern":
            coords["key"] = np.arange(t.shape[4])
        if name == "z":
            coords["position"] = np.asarray(self.z_positions, dtype=np.int64)
        if name in ("k", "v"):
            coords["position"] = np.asarray(self.kv_positions, dtype=np.int64)
        if name == "q":
            coords["position"] = np.asarray(self.q_positions, dtype=np.int64)
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
                offs = offsets_tensor(self.probes.offsets, B).numpy()
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
