"""What a plan records (:class:`Probes`) and the conversions of its position arguments to tensors.

Every position here is absolute: counted in the (left-padded) input from the first forward of an
:func:`~headlab.instrument.instrument` context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

__all__ = ["Probes", "offsets_tensor", "pairs_tensor", "per_row_spans", "select_pairs", "span_tensor"]


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
    - ``kv_positions``: the keys and values each call adds (after the rotary embedding and any key norm; the
      call's own query positions) to keep, per key/value head: ``None``, ``"all"`` or a list of absolute
      positions (``Recording.k``, ``.v``).
    - ``q_positions``: the queries each call runs (as attention reads them: after the rotary embedding and any
      query norm) to keep, per query head: ``None``, ``"all"`` or a list of absolute positions
      (``Recording.q``).
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
    kv_positions: Literal["all"] | Sequence[int] | None = None
    q_positions: Literal["all"] | Sequence[int] | None = None

    def any(self) -> bool:
        """Whether anything is recorded."""
        return bool(self.argmax or self.entropy or self.spans is not None or self.z_positions is not None
                    or self.pattern or self.offsets is not None or self.pairs is not None
                    or self.kv_positions is not None or self.q_positions is not None)

    def covers(self, layer: int) -> bool:
        """Whether something is recorded on ``layer``."""
        return self.any() and (self.layers is None or layer in self.layers)


def span_tensor(spans: Any, B: int, device: Any) -> Tensor:
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


def offsets_tensor(offsets: Any, B: int) -> Tensor:
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


def pairs_tensor(pairs: Any, B: int) -> Tensor:
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


def select_pairs(pairs: Tensor, start: int, stop: int) -> Tensor:
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
