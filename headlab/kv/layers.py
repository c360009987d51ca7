"""Cache layers: one layer's keys and values under a KV policy, a full group and a bounded one.

:class:`HeadwiseLayer` holds the full KV heads' keys at every position and the compressed heads' sinks and
ring window; :class:`HeadBudgetLayer` (HeadKV) holds each compressed head's SnapKV selection in its own
buffers. Their ``update`` leaves a :class:`~headlab.kv.split.SplitCall` for headlab's attention.
:func:`mask_stays_implicit` tells the mask function when a forward's attention mask can stay implicit.
These are the engine half of the package: they import no spec type.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from transformers.cache_utils import CacheLayerMixin

from .errors import KvPolicyError
from .snapkv import snapkv_keep
from .split import SplitCall, leave_split, running_cache

__all__ = ["HeadBudgetLayer", "HeadwiseLayer", "mask_stays_implicit"]


def _grow(buf: torch.Tensor, size: int, dim: int, fill: float | int = 0) -> torch.Tensor:
    """``buf`` extended along ``dim`` to ``size`` entries with ``fill`` (a new tensor; ``buf`` when large enough)."""
    if buf.shape[dim] >= size:
        return buf
    shape = list(buf.shape)
    shape[dim] = size - buf.shape[dim]
    return torch.cat([buf, buf.new_full(shape, fill)], dim=dim)


class HeadwiseLayer(CacheLayerMixin):
    """One layer of a :class:`HeadwiseCache`: the full group (``keys``/``values``, ``[batch, n_full, seq,
    head_dim]``, every position including left padding, as :class:`~transformers.DynamicLayer` holds them)
    and the bounded group of the compressed KV heads: ``slot_keys``/``slot_values`` ``[batch, n_compressed,
    slots, head_dim]``, the first ``min(sink, longest row)`` slots the sinks and the others a ring of at most
    ``window`` slots, with each slot's position in its row's own tokens in ``slot_pos`` (-1 while empty).
    With ``compensate``, ``comp_keys``/``comp_values`` ``[batch, n_compressed, 1, head_dim]`` (float32) are
    the sums of the keys and values the bounded group dropped (own positions ``sink <= p < n - window``).

    With ``full_prefill`` the layer's first update (the row's prefill) returns every KV head's keys of the chunk,
    which the attention reads causally for every head, and stores only what the map keeps (the same groups
    as a bounded prefill); a later update of several tokens is refused (the prompt must be the first forward)."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, full: Sequence[bool], sink: int, window: int | None, pad: torch.Tensor | None = None, *,
                 compensate: bool = False, full_prefill: bool = False) -> None:
        super().__init__()
        self.full_heads = torch.tensor([i for i, f in enumerate(full) if f], dtype=torch.long)
        self.compressed_heads = torch.tensor([i for i, f in enumerate(full) if not f], dtype=torch.long)
        if len(self.compressed_heads) and window is None:
            raise KvPolicyError("compressed KV heads need a window")
        self.n_kv_heads = len(full)
        self.sink, self.window = int(sink), (None if window is None else int(window))
        self.pad = pad
        self.seen = 0
        self.n_sink = 0
        self.min_pad = self.max_pad = 0
        self.slot_keys = self.slot_values = self.slot_pos = None
        self.compensate = bool(compensate) and len(self.compressed_heads) > 0
        if self.compensate and full_prefill:
            raise KvPolicyError("prefill: full is not available with a compensation token (razor)")
        self.full_prefill = bool(full_prefill)
        #: with ``full_prefill``, a later forward of at most this many tokens is the prompt's question (fed after
        #: the prefill's compression, under the bounded mask; :func:`kv_policy`'s ``question_tokens``), not a
        #: refused piece of the prompt
        self.question_tokens = 0
        self.comp_keys = self.comp_values = None
        self.pending: SplitCall | None = None
        #: the running forward's attention mask was left implicit (None): causal over the padded positions,
        #: the row's ``pad`` first positions padding (set per forward under :func:`kv_policy`)
        self.implicit_mask = False
        self.attention_paths: set[str] = set()  # how the attention read this layer (kv_split records it)

    # the two parts of the bounded group, as views of its slots
    @property
    def sink_keys(self) -> torch.Tensor | None:
        """The sink slots' keys (a view)."""
        return None if self.slot_keys is None else self.slot_keys[:, :, :self.n_sink]

    @property
    def sink_values(self) -> torch.Tensor | None:
        """The sink slots' values (a view)."""
        return None if self.slot_values is None else self.slot_values[:, :, :self.n_sink]

    @property
    def sink_pos(self) -> torch.Tensor | None:
        """The sink slots' positions (a view)."""
        return None if self.slot_pos is None else self.slot_pos[:, :self.n_sink]

    @property
    def ring_keys(self) -> torch.Tensor | None:
        """The ring slots' keys (a view; slot ``s`` holds position ``p`` with ``(p - sink) % window == s``)."""
        return None if self.slot_keys is None else self.slot_keys[:, :, self.n_sink:]

    @property
    def ring_values(self) -> torch.Tensor | None:
        """The ring slots' values (a view)."""
        return None if self.slot_values is None else self.slot_values[:, :, self.n_sink:]

    @property
    def ring_pos(self) -> torch.Tensor | None:
        """The ring slots' positions (a view)."""
        return None if self.slot_pos is None else self.slot_pos[:, self.n_sink:]

    @property
    def n_compressed(self) -> int:
        """Number of compressed KV heads."""
        return len(self.compressed_heads)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        if heads != self.n_kv_heads:
            raise KvPolicyError(f"the head map has {self.n_kv_heads} KV heads, this layer's keys have {heads}")
        self.device, self.dtype = key_states.device, key_states.dtype
        pad = torch.zeros(batch, dtype=torch.long) if self.pad is None else torch.as_tensor(self.pad, dtype=torch.long)
        if pad.shape != (batch,):
            raise KvPolicyError(f"{pad.numel()} padding lengths for a batch of {batch} rows")
        self.min_pad, self.max_pad = int(pad.min()), int(pad.max())  # the only host sync of the layer
        self.pad = pad.to(self.device)
        self.full_heads = self.full_heads.to(self.device)
        self.compressed_heads = self.compressed_heads.to(self.device)
        n_comp = len(self.compressed_heads)
        self.keys = key_states.new_zeros((batch, len(self.full_heads), 0, dim))
        self.values = value_states.new_zeros((batch, len(self.full_heads), 0, value_states.shape[-1]))
        self.slot_keys = key_states.new_zeros((batch, n_comp, 0, dim))
        self.slot_values = value_states.new_zeros((batch, n_comp, 0, value_states.shape[-1]))
        self.slot_pos = torch.full((batch, 0), -1, dtype=torch.long, device=self.device)
        if self.compensate:
            self.comp_keys = key_states.new_zeros((batch, n_comp, 1, dim), dtype=torch.float32)
            self.comp_values = value_states.new_zeros((batch, n_comp, 1, value_states.shape[-1]), dtype=torch.float32)
        self.n_sink = 0
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the states of the next ``key_states.shape[-2]`` tokens; returns the full group's keys and
        values (every KV head's when the map is full, exactly what :class:`~transformers.DynamicLayer`
        returns). With compressed heads it leaves a :class:`SplitCall` for the attention (:func:`split_call`;
        ``pending`` until an attention reads it); under ``full_prefill`` the first update returns every KV head's
        keys and values of the chunk (the prefill's attention reads them all causally)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if len(self.full_heads) == self.n_kv_heads:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            self.seen += key_states.shape[-2]
            return self.keys, self.values
        q = key_states.shape[-2]
        if self.full_prefill and self.seen and q > max(1, self.question_tokens):
            raise KvPolicyError(f"prefill: full: a forward of {q} tokens after the row's prefill (a prompt fed in "
                                "several forwards, e.g. by prefill_chunk); the first forward must be the whole prompt")
        if len(self.full_heads):
            self.keys = torch.cat([self.keys, key_states.index_select(1, self.full_heads)], dim=-2)
            self.values = torch.cat([self.values, value_states.index_select(1, self.full_heads)], dim=-2)
        else:  # a new (empty) tensor, so that split_call recognises this call's keys
            self.keys = torch.cat([self.keys, key_states[:, :0]], dim=-2)
            self.values = torch.cat([self.values, value_states[:, :0]], dim=-2)
        if self.full_prefill and self.seen == 0:  # the prefill: every head reads this chunk's keys
            self.pending = SplitCall(self, key_states, value_states, 0, prefill=True)
            leave_split(key_states, self.pending)
            self._store_bounded(key_states.index_select(1, self.compressed_heads),
                                value_states.index_select(1, self.compressed_heads))
            self.seen = q
            return key_states, value_states
        prior = prior_comp = None
        if q > 1 and self.seen and self.slot_pos.shape[1]:
            prior = (self.slot_keys.clone(), self.slot_values.clone(), self.slot_pos.clone())
            if self.compensate:
                prior_comp = (self.comp_keys.clone(), self.comp_values.clone())
        ck = key_states.index_select(1, self.compressed_heads)
        cv = value_states.index_select(1, self.compressed_heads)
        self.pending = SplitCall(self, ck, cv, self.seen, prior, prior_comp=prior_comp)
        leave_split(self.keys, self.pending)
        self._store_bounded(ck, cv)
        self.seen += q
        return self.keys, self.values

    def _store_bounded(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        q = keys.shape[-2]
        own = self.seen + torch.arange(q, device=self.device)[None, :] - self.pad[:, None]  # (batch, q)
        longest = max(0, self.seen + q - self.min_pad)  # real tokens of the longest row after this update
        sink, window = self.sink, self.window
        n_sink, ring = min(sink, longest), min(window, max(0, longest - sink))
        size = n_sink + ring  # the ring only starts once every sink slot exists: growth is at the end
        self.slot_keys = _grow(self.slot_keys, size, 2)
        self.slot_values = _grow(self.slot_values, size, 2)
        self.slot_pos = _grow(self.slot_pos, size, 1, -1)
        self.n_sink = n_sink
        if q == 1 and self.seen >= self.max_pad:  # a decode step: every row's token is real, no host sync
            pos = own[:, 0]
            slot = torch.where(pos < sink, pos, sink + (pos - sink) % window)
            index = slot.view(-1, 1, 1, 1)
            if self.compensate:  # the ring slot's previous token leaves the window: into the sums
                evicted = (self.slot_pos.gather(1, slot[:, None]) >= sink).view(-1, 1, 1, 1)
                for total, buf in ((self.comp_keys, self.slot_keys), (self.comp_values, self.slot_values)):
                    old = buf.gather(2, index.expand(-1, buf.shape[1], 1, buf.shape[3]))
                    total.add_(torch.where(evicted, old.float(), torch.zeros((), device=old.device)))
            self.slot_keys.scatter_(2, index.expand(-1, keys.shape[1], 1, keys.shape[3]), keys)
            self.slot_values.scatter_(2, index.expand(-1, values.shape[1], 1, values.shape[3]), values)
            self.slot_pos.scatter_(1, slot[:, None], pos[:, None])
            return
        count = self.seen + q - self.pad  # each row's real tokens after this update
        if self.compensate:  # the chunk's tokens that are dropped at once
            dropped = ((own >= sink) & (own < (count - window)[:, None]))[:, None, :, None]
            self.comp_keys.add_((keys.float() * dropped).sum(2, keepdim=True))
            self.comp_values.add_((values.float() * dropped).sum(2, keepdim=True))
        rows, cols = torch.nonzero((own >= 0) & (own < sink), as_tuple=True)
        if rows.numel():
            slots = own[rows, cols]
            self.slot_keys[rows, :, slots] = keys[rows, :, cols]
            self.slot_values[rows, :, slots] = values[rows, :, cols]
            self.slot_pos[rows, slots] = slots
        rows, cols = torch.nonzero((own >= sink) & (own >= (count - window)[:, None]), as_tuple=True)
        if rows.numel():
            positions = own[rows, cols]
            slots = sink + (positions - sink) % window
            if self.compensate:  # the tokens these slots held leave the window
                evicted = (self.slot_pos[rows, slots] >= sink)[:, None, None]
                for total, buf in ((self.comp_keys, self.slot_keys), (self.comp_values, self.slot_values)):
                    old = torch.where(evicted, buf[rows, :, slots].float(), torch.zeros((), device=buf.device))
                    total[:, :, 0].index_put_((rows,), old, accumulate=True)
            self.slot_keys[rows, :, slots] = keys[rows, :, cols]
            self.slot_values[rows, :, slots] = values[rows, :, cols]
            self.slot_pos[rows, slots] = positions

    def compressed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The bounded group: keys and values ``[batch, n_compressed, slots, head_dim]`` (sink slots, then the
        ring, not in position order) and each slot's position in its row's own tokens ``[batch, slots]``
        (-1: an empty slot, to be masked). The layer's own buffers, not copies."""
        if not self.is_initialized:
            raise KvPolicyError("the cache holds nothing yet")
        return self.slot_keys, self.slot_values, self.slot_pos

    def compensation(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The compensation token of each row and compressed head: the mean key and value ``[batch,
        n_compressed, 1, head_dim]`` (in the cache's dtype) of the tokens dropped so far, and their number per
        row ``[batch]`` (0: nothing dropped, no token)."""
        if not self.compensate or not self.is_initialized:
            raise KvPolicyError("this layer keeps no compensation token")
        count = (self.seen - self.pad - self.sink - self.window).clamp(min=0)
        scale = 1.0 / count.clamp(min=1).to(torch.float32).view(-1, 1, 1, 1)
        return ((self.comp_keys * scale).to(self.dtype), (self.comp_values * scale).to(self.dtype), count)

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.keys, self.values, self.slot_keys, self.slot_values, self.comp_keys,
                            self.comp_values) if t is not None]

    def nbytes(self) -> int:
        """Bytes of the keys and values this layer holds (both groups and the compensation sums; the int64 slot
        positions excluded)."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def full_nbytes(self) -> int:
        """Bytes a full cache (:class:`~transformers.DynamicLayer`) would hold for the same tokens."""
        if not self.is_initialized:
            return 0
        batch, dim, vdim = self.keys.shape[0], self.keys.shape[-1], self.values.shape[-1]
        return batch * self.n_kv_heads * self.seen * (dim + vdim) * self.keys.element_size()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the full group's layout: every position seen plus the query's."""
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        """Tokens stored so far per row, left padding included (the positions of the full group)."""
        return self.seen

    def get_max_length(self) -> int:
        """-1: the full group grows without bound."""
        return -1

    def reset(self) -> None:
        """Drop every stored token."""
        self.keys = self.values = self.slot_keys = self.slot_values = self.slot_pos = None
        self.comp_keys = self.comp_values = None
        self.seen = self.n_sink = 0
        self.pending = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Refused: the bounded group has already dropped the tokens a crop would need back."""
        raise KvPolicyError("a headwise KV cache cannot be cropped (its compressed heads dropped old tokens)")

    def _select_rows(self, pick: Any) -> None:
        for name in ("keys", "values", "slot_keys", "slot_values", "slot_pos", "comp_keys", "comp_values", "pad"):
            tensor = getattr(self, name)
            if isinstance(tensor, torch.Tensor):
                setattr(self, name, pick(tensor))
        if isinstance(self.pad, torch.Tensor) and self.pad.numel():
            self.min_pad, self.max_pad = int(self.pad.min()), int(self.pad.max())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the rows (beam search)."""
        if self.is_initialized:
            self._select_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times."""
        if self.is_initialized:
            self._select_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices``."""
        if self.is_initialized:
            self._select_rows(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    def offload(self) -> None:
        """Move every stored tensor to the CPU."""
        if self.is_initialized:
            self._select_rows(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        """Move every stored tensor back to the layer's device."""
        if self.is_initialized:
            self._select_rows(lambda t: t.to(self.device, non_blocking=True))


class HeadBudgetLayer(HeadwiseLayer):
    """One layer of a :class:`HeadwiseCache` under a :class:`HeadBudgetMap` (HeadKV): the full group as in
    :class:`HeadwiseLayer`, and for each compressed KV head ``i`` (in ``compressed_heads`` order) its own
    buffers, so that no head holds more than it keeps: ``kept_keys[i]``/``kept_values[i]`` ``[batch, 1, k_i,
    head_dim]``, the prompt keys :func:`snapkv_keep` selected for it (``k_i``: the most any row keeps, at most
    its budget), with their padded indices ``kept_pos[i]`` ``[batch, k_i]`` (ascending; -1 fills the front of a
    row that keeps fewer), and ``new_keys``/``new_values`` ``[batch, n_compressed, n, head_dim]``, the ``n``
    tokens stored after the prefill (every head keeps them all), at padded indices ``prefill_length + t``.

    The prefill (the first update, or with ``prompt_length`` every update until the prompt's ``prompt_length``
    padded positions are stored: a prompt fed in several chunks) stores and returns every KV head's keys of the
    prompt so far; the attention attends them all causally and hands the layer its queries: :meth:`observe`
    after a chunk before the prompt's last, which keeps (only) the last ``observation_window`` of them, and
    :meth:`compress` after the last, which keeps each compressed head's selection and drops the rest."""

    def __init__(self, full: Sequence[bool], budgets: Sequence[int], pad: torch.Tensor | None = None, *,
                 observation_window: int = 8, kernel_size: int = 7, pooling: Literal["max", "avg"] = "max") -> None:
        super().__init__(full, 0, 1, pad)
        if len(budgets) != len(full):
            raise KvPolicyError(f"{len(budgets)} budgets for {len(full)} KV heads")
        self.window = None
        self.budgets = [int(b) for b in budgets]
        self.observation_window, self.kernel_size, self.pooling = int(observation_window), int(kernel_size), pooling
        self.kept_keys: list[torch.Tensor] | None = None
        self.kept_values: list[torch.Tensor] | None = None
        self.kept_pos: list[torch.Tensor] | None = None
        self.new_keys = self.new_values = None
        self.prefill_length = 0
        #: padded positions of the prompt (None: the first update is the whole prompt); every update before
        #: the one that stores the last of them is a chunk of the prefill (:meth:`HeadwiseCache.set_prompt_length`)
        self.prompt_length: int | None = None
        #: the last ``observation_window`` queries of the prefill's chunks so far ``[batch, n_heads, <= W,
        #: head_dim]`` (after the rotary embedding), until :meth:`compress`
        self.window_queries: torch.Tensor | None = None

    @property
    def compressed_budgets(self) -> list[int]:
        """The budgets of the compressed KV heads, in ``compressed_heads`` order."""
        return [self.budgets[int(i)] for i in self.compressed_heads]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the states of the next tokens; returns the keys and values the attention reads causally: in
        the prefill (the first call, or every chunk of a prompt of ``prompt_length`` positions) every KV head's
        keys of the prompt so far, later the full group's. With compressed heads it leaves a :class:`SplitCall`
        (``prefill`` in the prefill) for the attention (:func:`split_call`)."""
        if not len(self.compressed_heads):
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        if self.kept_keys is None:
            if self.seen and (self.prompt_length is None or self.seen >= self.prompt_length):
                raise KvPolicyError("headkv: the prefill's attention did not compress this layer")
            if self.prompt_length is not None and self.seen + q > self.prompt_length:
                raise KvPolicyError(f"headkv: a chunk of {q} tokens after {self.seen} ends past the prompt's "
                                    f"{self.prompt_length} positions")
            if self.seen:
                self.keys = torch.cat([self.keys, key_states], dim=-2)
                self.values = torch.cat([self.values, value_states], dim=-2)
            else:
                self.keys, self.values = key_states, value_states
            self.pending = SplitCall(self, key_states, value_states, self.seen, prefill=True)
            leave_split(self.keys, self.pending)
            self.seen += q
            return self.keys, self.values
        if len(self.full_heads):
            self.keys = torch.cat([self.keys, key_states.index_select(1, self.full_heads)], dim=-2)
            self.values = torch.cat([self.values, value_states.index_select(1, self.full_heads)], dim=-2)
        else:  # a new (empty) tensor, so that split_call recognises this call's keys
            self.keys = torch.cat([self.keys, key_states[:, :0]], dim=-2)
            self.values = torch.cat([self.values, value_states[:, :0]], dim=-2)
        ck = key_states.index_select(1, self.compressed_heads)
        cv = value_states.index_select(1, self.compressed_heads)
        self.new_keys = torch.cat([self.new_keys, ck], dim=-2)
        self.new_values = torch.cat([self.new_values, cv], dim=-2)
        self.pending = SplitCall(self, ck, cv, self.seen)
        leave_split(self.keys, self.pending)
        self.seen += q
        return self.keys, self.values

    @property
    def prompt_complete(self) -> bool:
        """Whether the layer has stored the whole prompt and not yet compressed it: the prefill's attention then
        calls :meth:`compress` (else, after an earlier chunk of the prompt, :meth:`observe`)."""
        return self.kept_keys is None and self.seen > 0 and (self.prompt_length is None
                                                              or self.seen >= self.prompt_length)

    def observe(self, queries: torch.Tensor) -> None:
        """After the attention of a chunk of the prompt before its last: keep the last ``observation_window``
        queries of the prefill so far (``queries`` ``[batch, n_heads, q, head_dim]``, the chunk's, after the
        rotary embedding), for the selection at the prompt's end; a copy, so that the chunk's queries are freed."""
        if self.kept_keys is not None:
            raise KvPolicyError("headkv: the layer's prefill was already compressed")
        recent = queries[:, :, -self.observation_window:]
        if self.window_queries is not None:
            recent = torch.cat([self.window_queries, recent], dim=2)[:, :, -self.observation_window:]
        self.window_queries = recent.clone()

    def compress(self, queries: torch.Tensor, scaling: float | None = None) -> None:
        """After the attention of the prefill's last call: keep, per compressed KV head, the prompt keys
        :func:`snapkv_keep` selects from the prompt's last ``observation_window`` queries (those of ``queries``,
        ``[batch, n_heads, q, head_dim]`` after the rotary embedding, preceded by the ones :meth:`observe` kept
        from earlier chunks when ``q`` is shorter than the window) within its budget, and only the full heads'
        keys in the full group. A compressed head whose budget covers the prompt keeps every token of its rows."""
        if self.kept_keys is not None or self.keys is None:
            raise KvPolicyError("headkv: a layer is compressed once, after its prefill")
        if self.window_queries is not None:
            queries = torch.cat([self.window_queries, queries[:, :, -self.observation_window:]], dim=2)
            self.window_queries = None
        keys, values = self.keys, self.values
        batch, _, seq, dim = keys.shape
        group = queries.shape[1] // self.n_kv_heads
        comp = self.compressed_heads
        budgets = self.compressed_budgets
        real = torch.arange(seq, device=keys.device)[None, :] >= self.pad[:, None]  # (batch, seq)
        every = torch.where(real, torch.arange(seq, device=keys.device)[None, :], -1)[:, self.min_pad:]
        select = [i for i, b in enumerate(budgets) if b < seq]  # (a budget is never below the window)
        chosen: dict[int, torch.Tensor] = {}
        if select:
            heads = comp[select]
            qh = (heads[:, None] * group + torch.arange(group, device=keys.device)[None, :]).reshape(-1)
            window = queries[:, :, -self.observation_window:]
            picked = snapkv_keep(keys.index_select(1, heads), window.index_select(1, qh),
                                 [budgets[i] for i in select], kernel_size=self.kernel_size, pooling=self.pooling,
                                 pad=self.pad, scaling=scaling)
            chosen = dict(zip(select, picked, strict=True))
        self.kept_keys, self.kept_values, self.kept_pos = [], [], []
        for i, head in enumerate(comp.tolist()):
            pos = chosen.get(i, every)
            index = pos.clamp(min=0)[:, None, :, None]
            valid = (pos >= 0)[:, None, :, None]
            for out, src in ((self.kept_keys, keys), (self.kept_values, values)):
                taken = src[:, head:head + 1].gather(2, index.expand(-1, -1, -1, src.shape[-1]))
                out.append(torch.where(valid, taken, torch.zeros((), dtype=src.dtype, device=src.device)))
            self.kept_pos.append(pos)
        self.new_keys = keys.new_zeros((batch, len(comp), 0, dim))
        self.new_values = values.new_zeros((batch, len(comp), 0, values.shape[-1]))
        self.keys = keys.index_select(1, self.full_heads)
        self.values = values.index_select(1, self.full_heads)
        self.prefill_length = seq

    def head_cache(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Compressed head ``i``'s keys and values ``[batch, 1, n, head_dim]`` (its kept prompt keys, then the
        tokens stored since) and their padded indices ``[batch, n]`` (-1: an empty slot, to be masked)."""
        if self.kept_keys is None:
            raise KvPolicyError("headkv: the layer keeps nothing until its prefill was compressed")
        n_new = self.new_keys.shape[2]
        new_pos = (self.prefill_length + torch.arange(n_new, device=self.device))[None, :].expand(
            self.kept_pos[i].shape[0], -1)
        return (torch.cat([self.kept_keys[i], self.new_keys[:, i:i + 1]], dim=2),
                torch.cat([self.kept_values[i], self.new_values[:, i:i + 1]], dim=2),
                torch.cat([self.kept_pos[i], new_pos], dim=1))

    def compressed(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Every compressed head's :meth:`head_cache`, as three lists (keys, values, padded indices)."""
        parts = [self.head_cache(i) for i in range(len(self.compressed_heads))]
        return [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts]

    def kept_keys_per_head(self) -> torch.Tensor:
        """Keys each ``(row, kv_head)`` holds, ``[batch, n_kv_heads]``: every real token of the row for a full
        head, its valid kept slots plus the new tokens for a compressed one."""
        if not self.is_initialized:
            raise KvPolicyError("the cache holds nothing yet")
        out = (self.seen - self.pad)[:, None].repeat(1, self.n_kv_heads)
        if self.kept_pos is not None:
            for i, head in enumerate(self.compressed_heads.tolist()):
                out[:, head] = (self.kept_pos[i] >= 0).sum(1) + self.new_keys.shape[2]
        return out

    def _tensors(self) -> list[torch.Tensor]:
        kept = [*(self.kept_keys or []), *(self.kept_values or [])]
        return [t for t in (self.keys, self.values, self.new_keys, self.new_values, *kept) if t is not None]

    def reset(self) -> None:
        """Drop every stored token."""
        super().reset()
        self.kept_keys = self.kept_values = self.kept_pos = None
        self.new_keys = self.new_values = self.window_queries = None
        self.prefill_length = 0

    def _select_rows(self, pick: Any) -> None:
        super()._select_rows(pick)
        for name in ("new_keys", "new_values", "window_queries"):
            if isinstance(getattr(self, name), torch.Tensor):
                setattr(self, name, pick(getattr(self, name)))
        for name in ("kept_keys", "kept_values", "kept_pos"):
            if getattr(self, name) is not None:
                setattr(self, name, [pick(t) for t in getattr(self, name)])


def mask_stays_implicit(mask_function: Any, attention_mask: torch.Tensor | None, q_length: int, kv_length: int,
                   q_offset: Any, kv_offset: Any) -> bool:
    """Whether the attention mask of the forward running under :func:`kv_policy` can stay implicit (None, marked
    on the cache's layers): its cache has compressed heads in every layer (so every attention call reads it
    through headlab's split attention, which rebuilds causality and left padding from the layer), the mask is
    transformers' plain causal one over the cache's positions, and the 2-D padding mask is exactly the
    cache's left padding. Otherwise (any other mask pattern, padding the cache does not know) False: the
    dense mask is built as before."""
    from transformers.masking_utils import causal_mask_function

    cache = running_cache()
    if cache is None or mask_function is not causal_mask_function or not isinstance(q_offset, int) \
            or kv_offset != 0 or q_offset + q_length != kv_length:
        return False
    layers = cache.layers
    if not layers or not all(isinstance(ly, HeadwiseLayer) and ly.n_compressed for ly in layers):
        return False
    pad = layers[0].pad
    if attention_mask is None:
        if pad is not None and bool((pad > 0).any()):
            return False
    else:
        if attention_mask.dim() != 2 or attention_mask.shape[-1] != kv_length:
            return False
        rows = attention_mask.shape[0]
        pad = torch.zeros(rows, dtype=torch.long) if pad is None else pad
        expect = torch.arange(kv_length, device=attention_mask.device)[None, :] >= pad.to(attention_mask.device)[:, None]
        if expect.shape != attention_mask.shape or not torch.equal(attention_mask.bool(), expect):
            return False
    for layer in layers:
        layer.implicit_mask = True
    return True
