"""Where one attention call sits among the absolute positions of an instrument context.

A plan and its recording speak absolute positions (counted in the left-padded input from the first
forward of the context); a kernel call speaks query rows ``0..Nq-1`` of this call and key slots
``0..Nk-1`` of the cache it sees. :class:`CallPositions` converts between the two, and nothing else does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["CallPositions"]


@dataclass(frozen=True)
class CallPositions:
    """One attention call: query row ``i`` is absolute position ``q_start + i``; key slot ``j`` is absolute
    position ``key_offset + j`` (``key_offset > 0`` once a sliding-window cache has dropped keys)."""

    q_start: int
    n_queries: int
    n_keys: int
    key_offset: int

    @classmethod
    def of(cls, q_start: int, n_queries: int, n_keys: int) -> CallPositions:
        """The call whose ``n_queries`` queries start at ``q_start`` and whose cache holds the last ``n_keys``
        keys up to its last query (or more slots, e.g. a static cache: then no key was dropped)."""
        return cls(q_start, n_queries, n_keys, max(0, q_start + n_queries - n_keys))

    # ---- absolute -> kernel
    def key_spans(self, spans: Tensor) -> Tensor:
        """Absolute ``[start, end)`` key spans (..., 2) as key slots of this call, clamped to ``0..n_keys``."""
        return (spans - self.key_offset).clamp(0, self.n_keys)

    def offsets(self, offsets: Tensor) -> Tensor:
        """(B, O) relative offsets (-1 = unused) as the kernel counts them. The kernel counts ``delta`` back
        from the query's key slot ``n_keys - n_queries + i``, the recording from its absolute position
        ``q_start + i``: they agree whenever the cache holds every key up to the queries (dropped keys of a
        sliding-window cache included); a static cache with empty slots after the queries shifts them."""
        shift = max(0, self.n_keys - self.n_queries - self.q_start)
        return torch.where(offsets >= 0, offsets + shift, offsets) if shift else offsets

    def pairs(self, pairs: Tensor) -> Tensor:
        """(B, P, 2) absolute ``(query, key)`` pairs (-1 = unused) as (query row, key slot); a pair whose key
        the cache no longer holds becomes an unused slot."""
        shift = torch.tensor([self.q_start, self.key_offset], device=pairs.device)
        idx = torch.where(pairs >= 0, pairs - shift, pairs)
        return torch.where((idx < 0).any(-1, keepdim=True), -1, idx)

    # ---- kernel -> absolute
    def absolute_keys(self, slots: Tensor) -> Tensor:
        """Key slots (-1 = none) as absolute key positions."""
        return torch.where(slots >= 0, slots + self.key_offset, slots)

    def absolute_pattern(self, pattern: Tensor) -> Tensor:
        """A (..., n_queries, n_keys) attention pattern over absolute key positions ``0..`` (keys the cache
        dropped read 0)."""
        return torch.nn.functional.pad(pattern, (self.key_offset, 0)) if self.key_offset else pattern

    def query_positions(self, device: torch.device | str) -> Tensor:
        """The absolute positions of the call's queries."""
        return torch.arange(self.q_start, self.q_start + self.n_queries, device=device)
