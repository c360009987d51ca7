"""The contract of headlab's attention kernels: what a call asks for and what it gets back.

:class:`HeadEdits` (per-head edits of the attention), :class:`ProbeRequest` (what to measure on it) and
:class:`AttentionStats` (the measurements), plus the helpers every path shares: :func:`requests` (a call's
checked edits and probes), :func:`visibility` (the causal / window mask of a block), :func:`span_indicator`
and :func:`span_bias` (key spans as per-key indicators and biases), :func:`flat_pairs` (pair probes as flat,
query-sorted vectors) and :func:`pairs_from_csr`. A leaf module: it imports neither kernel path.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

__all__ = [
    "AttentionStats", "HeadEdits", "ProbeRequest", "flat_pairs", "pairs_from_csr", "requests", "span_bias",
    "span_indicator", "visibility",
]


@dataclass(frozen=True)
class HeadEdits:
    """The edits of one attention call, per (batch row ``b``, query head ``h``); ``None`` = no such edit.

    - ``q_scale``: (B, H) float, multiplies the query (0 = query masking: uniform attention over the
      visible keys, ``z`` = mean of V).
    - ``score_zero``: (B, H) bool, the pre-softmax scores are set to 0 (score masking).
    - ``out_scale``: (B, H) float, multiplies the head output ``z`` (0 = ablation).
    - ``key_spans`` (B, S, 2) int ``[start, end)`` in key coordinates ``0..Nk`` with ``key_bias``
      (B, H, S) float: ``key_bias[b, h, s]`` is added to the scores of the keys in span ``s`` (spans may
      overlap, biases add; PASTA: ``log alpha``). They go together.

    Anything broadcastable to these shapes is accepted; :meth:`checked` returns the dense, validated form.
    """

    q_scale: Tensor | None = None
    score_zero: Tensor | None = None
    out_scale: Tensor | None = None
    key_spans: Tensor | None = None
    key_bias: Tensor | None = None

    def is_empty(self) -> bool:
        """True when no edit is set."""
        return all(getattr(self, f.name) is None for f in fields(self))

    def plus_key_bias(self, key_spans: Tensor, key_bias: Tensor) -> HeadEdits:
        """These edits with more key-span biases: (B, S', 2) spans and their (B, H, S') biases appended."""
        if self.key_spans is not None:
            key_spans = torch.cat([self.key_spans, key_spans], 1)
            key_bias = torch.cat([self.key_bias, key_bias], 2)
        return HeadEdits(self.q_scale, self.score_zero, self.out_scale, key_spans, key_bias)

    def checked(self, B: int, H: int, device) -> HeadEdits:
        """Validated dense form: scales (B, H) float32, ``score_zero`` (B, H) bool, ``key_spans`` (B, S, 2)
        int64 with ``key_bias`` (B, H, S) float32 (both ``None`` when ``S == 0``). Raises ``ValueError``."""
        q_scale = _per_head(self.q_scale, B, H, "q_scale", torch.float32, device)
        out_scale = _per_head(self.out_scale, B, H, "out_scale", torch.float32, device)
        score_zero = _per_head(self.score_zero, B, H, "score_zero", torch.bool, device)
        key_spans, key_bias = self.key_spans, self.key_bias
        if (key_spans is None) != (key_bias is None):
            raise ValueError("key_spans and key_bias go together")
        if key_spans is not None:
            key_spans = torch.as_tensor(key_spans, device=device).long()
            if key_spans.dim() != 3 or key_spans.shape[0] != B or key_spans.shape[2] != 2:
                raise ValueError(f"key_spans must be (B, S, 2), got {tuple(key_spans.shape)}")
            S = key_spans.shape[1]
            key_bias = torch.as_tensor(key_bias, device=device, dtype=torch.float32)
            try:
                key_bias = torch.broadcast_to(key_bias, (B, H, S))
            except RuntimeError as e:
                raise ValueError(f"key_bias must broadcast to (B, H, S) = ({B}, {H}, {S})") from e
            if S == 0:
                key_spans = key_bias = None
        return HeadEdits(q_scale, score_zero, out_scale, key_spans, key_bias)


@dataclass(frozen=True)
class ProbeRequest:
    """What to measure on the (edited) attention of one call; see :class:`AttentionStats` for the outputs.

    - ``argmax``: index and probability of the top-1 key (the first one on ties).
    - ``entropy``: row entropy in nats.
    - ``spans``: (B, P, 2) int ``[start, end)`` key spans -> attention mass per span.
    - ``offsets``: (B, O) int relative offsets ``delta >= 0`` (``-1`` = unused slot) -> per query ``i`` the
      attention ``A[i, Nk - Nq + i - delta]`` to the key ``delta`` positions back (1 = previous token).
    - ``pattern``: the full (B, H, Nq, Nk) attention (the only quadratic output).
    - ``pairs``: (B, P, 2) int ``(query, key)`` pairs: query index ``i`` in ``0..Nq-1`` and key coordinate ``j``
      in ``0..Nk-1`` -> the attention ``A[i, j]`` at each pair (a sparse probe: any set of cells of the
      pattern, in memory O(P)); a pair with an index outside those ranges (``-1``: an unused slot) reads 0.
      :func:`pairs_from_csr` builds it from per-query key lists.

    ``spans`` / ``offsets`` / ``pairs`` given with zero columns still count as probes (their outputs have 0
    columns).
    """

    argmax: bool = False
    entropy: bool = False
    spans: Tensor | None = None
    offsets: Tensor | None = None
    pattern: bool = False
    pairs: Tensor | None = None

    def any(self) -> bool:
        """True when anything is to be measured."""
        return bool(self.argmax or self.entropy or self.spans is not None or self.offsets is not None
                    or self.pattern or self.pairs is not None)

    def checked(self, B: int, device) -> ProbeRequest:
        """Validated form: ``spans`` (B, P, 2) int64, ``offsets`` (B, O) int64 ``>= -1``, ``pairs`` (B, P, 2)
        int64. Raises ``ValueError``."""
        spans, offsets, pairs = self.spans, self.offsets, self.pairs
        if spans is not None:
            spans = torch.as_tensor(spans, device=device).long()
            if spans.dim() != 3 or spans.shape[0] != B or spans.shape[2] != 2:
                raise ValueError(f"probe_spans must be (B, P, 2), got {tuple(spans.shape)}")
        if offsets is not None:
            offsets = torch.as_tensor(offsets, device=device)
            if offsets.dtype.is_floating_point or offsets.dtype == torch.bool:
                raise ValueError("probe_offsets must be integers")
            offsets = offsets.long()
            if offsets.dim() != 2 or offsets.shape[0] != B:
                raise ValueError(f"probe_offsets must be (B, O), got {tuple(offsets.shape)}")
            if bool((offsets < -1).any()):
                raise ValueError("probe_offsets must be >= 0 (or -1 for an unused slot)")
        if pairs is not None:
            pairs = torch.as_tensor(pairs, device=device)
            if pairs.dtype.is_floating_point or pairs.dtype == torch.bool:
                raise ValueError("probe_pairs must be integers")
            pairs = pairs.long()
            if pairs.dim() != 3 or pairs.shape[0] != B or pairs.shape[2] != 2:
                raise ValueError(f"probe_pairs must be (B, P, 2), got {tuple(pairs.shape)}")
        return ProbeRequest(bool(self.argmax), bool(self.entropy), spans, offsets, bool(self.pattern), pairs)


@dataclass
class AttentionStats:
    """Probes of one attention call, describing the attention *after* edits.

    Shapes (B batch rows, H query heads, Nq queries, Nk keys, P probe spans, O probe offsets); all float
    tensors are float32 whatever the input dtype. A query row with no visible key (a padding query) has
    ``argmax = -1``, ``argmax_prob = 0``, ``entropy = 0``, ``span_mass = 0``, ``offset_mass = 0``,
    ``pair_mass = 0`` and an all-zero pattern row.

    - ``argmax``: (B, H, Nq) int64, index of the top-1 key (first one on ties), in key coordinates
      ``0..Nk-1``.
    - ``argmax_prob``: (B, H, Nq) float32, its attention probability.
    - ``entropy``: (B, H, Nq) float32, ``-sum_j A_ij log A_ij`` in nats.
    - ``span_mass``: (B, H, Nq, P) float32, ``sum_{j in span p} A_ij``.
    - ``offset_mass``: (B, H, Nq, O) float32, ``A[i, pos(i) - delta_o]`` with ``pos(i) = Nk - Nq + i`` the
      query's own key coordinate and ``delta_o = probe_offsets[b, o]``; 0 where that key is outside
      ``0..Nk-1`` or not visible, and for unused offset slots (``delta_o = -1``).
    - ``pattern``: (B, H, Nq, Nk) float32, the full attention, only when :attr:`ProbeRequest.pattern`.
    - ``pair_mass``: (B, H, P) float32, ``A[pairs[b, p, 0], pairs[b, p, 1]]``; 0 for a pair outside
      ``0..Nq-1`` x ``0..Nk-1`` (an unused slot) or whose key is not visible to its query.
    - ``backend``: the path that ran (``"sdpa"``, ``"torch"`` or ``"triton"``) and ``reason``: why
      (:func:`choose_backend`).
    """

    argmax: Tensor | None = None
    argmax_prob: Tensor | None = None
    entropy: Tensor | None = None
    span_mass: Tensor | None = None
    offset_mass: Tensor | None = None
    pattern: Tensor | None = None
    pair_mass: Tensor | None = None
    backend: str = field(default="torch")
    reason: str = ""


def pairs_from_csr(indptr: Tensor, keys: Tensor) -> Tensor:
    """(B, P, 2) ``(query, key)`` pairs for :attr:`ProbeRequest.pairs` from per-query key lists in CSR form.

    ``indptr`` (B, Nq + 1) int, non-decreasing from 0: the keys of query ``i`` of row ``b`` are
    ``keys[b, indptr[b, i]:indptr[b, i + 1]]``; ``keys`` (B, P) int. Slots past ``indptr[b, Nq]`` become
    unused pairs ``(-1, -1)``. A 1-D ``indptr`` / ``keys`` is one row.
    """
    indptr = torch.as_tensor(indptr).long()
    keys = torch.as_tensor(keys, device=indptr.device).long()
    if indptr.dim() == 1:
        indptr, keys = indptr[None], keys[None]
    if indptr.dim() != 2 or keys.dim() != 2 or keys.shape[0] != indptr.shape[0]:
        raise ValueError(f"pairs_from_csr: indptr (B, Nq + 1) and keys (B, P), got {tuple(indptr.shape)}, "
                         f"{tuple(keys.shape)}")
    if bool((indptr[:, 1:] < indptr[:, :-1]).any()) or bool((indptr[:, 0] != 0).any()):
        raise ValueError("pairs_from_csr: indptr must start at 0 and be non-decreasing")
    B, P = keys.shape
    n_q = indptr.shape[1] - 1
    slot = torch.arange(P, device=keys.device).expand(B, P).contiguous()
    query = torch.searchsorted(indptr[:, 1:].contiguous(), slot, right=True)
    used = query < n_q
    query = torch.where(used, query, torch.full_like(query, -1))
    key = torch.where(used, keys, torch.full_like(keys, -1))
    return torch.stack([query, key], -1)


def _per_head(x, B: int, H: int, name: str, dtype, device) -> Tensor | None:
    if x is None:
        return None
    x = torch.as_tensor(x, device=device)
    try:
        x = torch.broadcast_to(x, (B, H))
    except RuntimeError as e:
        raise ValueError(f"{name} must broadcast to (B, H) = ({B}, {H}), got {tuple(x.shape)}") from e
    return x.to(dtype)


def requests(
    edits: HeadEdits | None, probes: ProbeRequest | None, B: int, H: int, device
) -> tuple[HeadEdits, ProbeRequest]:
    """The checked dense forms (:meth:`HeadEdits.checked`, :meth:`ProbeRequest.checked`) of one call's edits
    and probes; ``None`` stands for no edits / no probes. Raises ``ValueError``."""
    return (edits or HeadEdits()).checked(B, H, device), (probes or ProbeRequest()).checked(B, device)


def flat_pairs(pairs: Tensor, Nq: int, Nk: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The in-range pairs of a checked (B, P, 2) ``pairs`` as flat vectors sorted by query (stable):
    ``(row b, slot p, query i, key j)``, each (n,) int64; pairs outside ``0..Nq-1`` x ``0..Nk-1`` are dropped
    (their mass is 0)."""
    pq, pk = pairs[..., 0], pairs[..., 1]
    ok = (pq >= 0) & (pq < Nq) & (pk >= 0) & (pk < Nk)
    fb, fp = ok.nonzero(as_tuple=True)
    fq, fk = pq[fb, fp], pk[fb, fp]
    order = torch.sort(fq, stable=True).indices
    return fb[order], fp[order], fq[order], fk[order]


def visibility(
    Nq: int, Nk: int, q0: int, q1: int, k0: int, k1: int, causal: bool, window: int | None, device
) -> Tensor | None:
    """Boolean (q1-q0, k1-k0) visibility of keys [k0, k1) for queries [q0, q1) from causal/window."""
    if not causal and window is None:
        return None
    qa = torch.arange(q0, q1, device=device)[:, None] + (Nk - Nq)
    kj = torch.arange(k0, k1, device=device)[None, :]
    vis = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=device)
    if causal:
        vis &= kj <= qa
    if window is not None:
        vis &= (qa - kj) < window
        if not causal:
            vis &= (kj - qa) < window
    return vis


def span_indicator(spans: Tensor, k0: int, k1: int) -> Tensor:
    """(B, S, k1-k0) float32: 1 where key ``j`` in ``[k0, k1)`` lies in span ``s`` (``[start, end)`` of the
    (B, S, 2) ``spans``), else 0."""
    j = torch.arange(k0, k1, device=spans.device)
    return ((j >= spans[..., :1]) & (j < spans[..., 1:])).float()


def span_bias(key_spans: Tensor, key_bias: Tensor, Nk: int) -> Tensor:
    """(B, H, Nk) float32 additive bias per key from (B, S, 2) spans and their (B, H, S) biases."""
    return torch.einsum("bhs,bsn->bhn", key_bias.float(), span_indicator(key_spans, 0, Nk))
