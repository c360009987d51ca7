"""Attention with per-head edits and streaming probes: one signature, three backends.

See ``docs/kernels.md`` for the full contract. The kernels know nothing of plugins or of transformers:
they take q, k, v, a :class:`HeadEdits` and a :class:`ProbeRequest` made of plain tensors, and return the
per-head output ``z = A @ V`` together with the requested statistics of the (edited) attention ``A``.
:func:`choose_backend` is the one place that decides which path computes a call.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

__all__ = [
    "AttentionStats", "BACKENDS", "HeadEdits", "PAIR_PATHS", "ProbeRequest", "attention", "choose_backend",
    "pairs_from_csr", "triton_available",
]

#: what a caller may request; :func:`choose_backend` also returns ``"native"`` (the caller's own SDPA call)
BACKENDS = ("auto", "sdpa", "torch", "triton")


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
    - ``pattern``: (B, H, Nq, Nk) float32, the full attention, only when ``return_pattern``.
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


def triton_available() -> bool:
    """True when triton can be imported (it does not say whether a GPU is present)."""
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the platform
        return False
    return True


def _on_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def _sdpa_blocker(edits: HeadEdits | None, probes: ProbeRequest | None, softcap: float | None) -> str | None:
    """Why SDPA cannot compute this call exactly, or ``None`` when it can."""
    if probes is not None and probes.any():
        return "probes"
    if softcap is not None:
        return "softcap"
    if edits is not None and edits.score_zero is not None:
        return "score zeroing"
    if edits is not None and edits.key_bias is not None:
        if not bool(torch.isfinite(torch.as_tensor(edits.key_bias)).all()):
            return "an infinite key bias"
    return None


def choose_backend(
    requested: str = "auto",
    *,
    edits: HeadEdits | None = None,
    probes: ProbeRequest | None = None,
    softcap: float | None = None,
    device: torch.device | str | None = None,
    native: bool = False,
    reads_outputs: bool = False,
) -> tuple[str, str]:
    """The path that computes one attention call, and why: ``(backend, reason)``. The only place that decides.

    ``requested`` is one of :data:`BACKENDS`. SDPA applies when the call has no probe of any kind, no softcap,
    no score zeroing and only finite key biases (query and output scales ride around it, finite key biases
    ride as one extra head-dim coordinate). Then:

    - ``"native"``: the caller's own plain SDPA call (headlab's instrument: the model's own ``sdpa``
      attention, bit-identical to an uninstrumented model), with query scales applied before it and
      output scales after it. Only when the caller offers one (``native=True``), the edits hold no key
      bias, and the caller does not read the head outputs (``reads_outputs``: they are recorded or handed
      to a callback that may recompute them through :func:`attention`, so they come from the kernels).
    - ``"sdpa"``: ``scaled_dot_product_attention`` through :func:`attention` otherwise.

    Else (``"auto"``) ``"triton"`` on CUDA when triton is installed, ``"torch"`` elsewhere. ``"torch"`` and
    ``"triton"`` are taken as requested; ``"sdpa"`` requested for a call SDPA cannot compute raises
    ``ValueError``. ``edits``/``probes`` may be unchecked (as given to :func:`attention`). When the probes
    ask for pairs, the reason ends with how the chosen path computes them (:data:`PAIR_PATHS`).
    """
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")
    if requested in ("torch", "triton"):
        return requested, "requested" + _pair_path(probes, requested)
    blocker = _sdpa_blocker(edits, probes, softcap)
    if blocker is None:
        if edits is None or edits.is_empty():
            what = "no edits or probes"
        elif edits.key_spans is None:
            what = "query/output scales only"
        else:
            what = "finite key biases"
        if native and (edits is None or edits.key_spans is None):
            if not reads_outputs:
                return "native", what
            what += "; head outputs are read"
        return "sdpa", what
    if requested == "sdpa":
        raise ValueError("backend='sdpa' takes no probes, softcap, score_zero or infinite key_bias "
                         f"(this call has {blocker})")
    if not _on_cuda(device):
        return "torch", f"{blocker}; not on CUDA" + _pair_path(probes, "torch")
    if not triton_available():
        return "torch", f"{blocker}; triton is not installed" + _pair_path(probes, "torch")
    return "triton", f"{blocker}; CUDA" + _pair_path(probes, "triton")


#: how each kernel path computes pair probes (``ProbeRequest.pairs``), as :func:`choose_backend` reports it
PAIR_PATHS = {
    "torch": "pairs read off each query block's normalised attention",
    "triton": "pairs from the rows' log-sum-exp (pair kernel)",
}


def _pair_path(probes: ProbeRequest | None, backend: str) -> str:
    """``"; <how the pairs are computed>"`` when ``probes`` asks for pairs, else ``""``."""
    if probes is None or probes.pairs is None:
        return ""
    return "; " + PAIR_PATHS[backend]


def _per_head(x, B: int, H: int, name: str, dtype, device) -> Tensor | None:
    if x is None:
        return None
    x = torch.as_tensor(x, device=device)
    try:
        x = torch.broadcast_to(x, (B, H))
    except RuntimeError as e:
        raise ValueError(f"{name} must broadcast to (B, H) = ({B}, {H}), got {tuple(x.shape)}") from e
    return x.to(dtype)


def _requests(
    edits: HeadEdits | None = None,
    probes: ProbeRequest | None = None,
    *,
    q_scale=None,
    score_zero=None,
    out_scale=None,
    key_spans=None,
    key_bias=None,
    probe_argmax: bool = False,
    probe_entropy: bool = False,
    probe_spans=None,
    probe_offsets=None,
    return_pattern: bool = False,
    probe_pairs=None,
) -> tuple[HeadEdits, ProbeRequest]:
    """One :class:`HeadEdits` and one :class:`ProbeRequest` from the dataclasses or from the keyword
    convenience of :func:`attention` (not both for the same group)."""
    flat_edits = HeadEdits(q_scale, score_zero, out_scale, key_spans, key_bias)
    flat_probes = ProbeRequest(probe_argmax, probe_entropy, probe_spans, probe_offsets, return_pattern, probe_pairs)
    if edits is not None and not flat_edits.is_empty():
        raise ValueError("give the edits either as HeadEdits or as keyword arguments, not both")
    if probes is not None and flat_probes.any():
        raise ValueError("give the probes either as a ProbeRequest or as keyword arguments, not both")
    return edits or flat_edits, probes or flat_probes


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    edits: HeadEdits | None = None,
    probes: ProbeRequest | None = None,
    scale: float | None = None,
    causal: bool = True,
    key_padding_mask: Tensor | None = None,
    attn_mask: Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
    backend: str = "auto",
    block_q: int = 128,
    q_scale: Tensor | None = None,
    score_zero: Tensor | None = None,
    out_scale: Tensor | None = None,
    key_spans: Tensor | None = None,
    key_bias: Tensor | None = None,
    probe_argmax: bool = False,
    probe_entropy: bool = False,
    probe_spans: Tensor | None = None,
    probe_offsets: Tensor | None = None,
    return_pattern: bool = False,
    probe_pairs: Tensor | None = None,
) -> tuple[Tensor, AttentionStats]:
    """Attention plus per-head edits and streaming probes.

    Shapes: ``q`` (B, H, Nq, D); ``k`` (B, Hkv, Nk, D); ``v`` (B, Hkv, Nk, Dv); ``H % Hkv == 0`` and
    query head ``h`` reads kv head ``h // (H // Hkv)`` (GQA; ``Hkv == 1`` is MQA). The queries are the
    last ``Nq`` positions of the ``Nk`` keys, so query ``i`` has absolute position ``Nk - Nq + i``
    (KV-cache decoding: ``Nk = past + Nq``).

    Masks (a key is visible when every given mask allows it):
      - ``causal``: key ``j`` visible iff ``j <= Nk - Nq + i``.
      - ``window``: sliding window, key ``j`` visible iff ``(Nk - Nq + i) - j < window`` (and, when not
        causal, also ``j - (Nk - Nq + i) < window``).
      - ``key_padding_mask``: (B, Nk) bool, True = real token.
      - ``attn_mask``: optional general boolean mask broadcastable to (B, H, Nq, Nk), True = visible
        (for masks that are not causal/window/padding, e.g. bidirectional image blocks).
    A query row with no visible key outputs zeros (never NaN).

    ``edits`` (:class:`HeadEdits`), in this order, per (batch row b, head h)::

        s_ij = scale * (q_scale[b,h] * q_i) . k_j        # q_scale 0 = query masking -> uniform attention
        s_ij = softcap * tanh(s_ij / softcap)             # if softcap (Gemma 2)
        s_ij = 0                 if score_zero[b,h]       # score masking
        s_ij += sum_s key_bias[b,h,s] * [key_spans[b,s,0] <= j < key_spans[b,s,1]]   # PASTA log(alpha)
        s_ij = -inf              where masked
        A = softmax_j(s);  z_i = out_scale[b,h] * sum_j A_ij v_j

    ``probes`` (:class:`ProbeRequest`; results in :class:`AttentionStats`) describe ``A`` after the edits.
    The keyword arguments ``q_scale, score_zero, out_scale, key_spans, key_bias`` and ``probe_argmax,
    probe_entropy, probe_spans, probe_offsets, return_pattern, probe_pairs`` are a convenience for the same
    fields.

    ``backend``: ``"sdpa"`` (``scaled_dot_product_attention``; takes query/output scales and finite key
    biases, which it computes exactly, the bias riding as an extra head-dim coordinate; no probes,
    softcap or score zeroing), ``"torch"`` (query-blocked, exact, memory linear in sequence length:
    ``block_q`` query rows at a time), ``"triton"`` (fused FlashAttention-2-style kernel; CUDA, or CPU
    under ``TRITON_INTERPRET=1``), ``"auto"``: :func:`choose_backend` decides (sdpa whenever it applies,
    else triton on CUDA, else torch). All paths accumulate in float32 and return ``z`` (B, H, Nq, Dv) in
    ``q.dtype``.
    """
    edits, probes = _requests(
        edits, probes, q_scale=q_scale, score_zero=score_zero, out_scale=out_scale, key_spans=key_spans,
        key_bias=key_bias, probe_argmax=probe_argmax, probe_entropy=probe_entropy, probe_spans=probe_spans,
        probe_offsets=probe_offsets, return_pattern=return_pattern, probe_pairs=probe_pairs,
    )
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-D: (B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, Dv)")
    B, H, Nq, D = q.shape
    Bk, Hkv, Nk, Dk = k.shape
    if Bk != B or v.shape[0] != B or v.shape[1] != Hkv or v.shape[2] != Nk or Dk != D:
        raise ValueError(f"incompatible shapes q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"query heads {H} must be a multiple of kv heads {Hkv}")
    if Nq > Nk:
        raise ValueError(f"more queries ({Nq}) than keys ({Nk}); queries are the last Nq keys")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if scale is None:
        scale = D**-0.5
    dev = q.device
    if key_padding_mask is not None:
        if tuple(key_padding_mask.shape) != (B, Nk):
            raise ValueError(f"key_padding_mask must be (B, Nk) = ({B}, {Nk}), got {tuple(key_padding_mask.shape)}")
        key_padding_mask = key_padding_mask.to(device=dev, dtype=torch.bool)
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool or attn_mask.dim() != 4:
            raise ValueError("attn_mask must be a 4-D boolean tensor broadcastable to (B, H, Nq, Nk)")
        attn_mask = attn_mask.to(dev)
        torch.broadcast_shapes(attn_mask.shape, (B, H, Nq, Nk))
    edits = edits.checked(B, H, dev)
    probes = probes.checked(B, dev)
    if softcap is not None and softcap <= 0:
        raise ValueError("softcap must be positive")
    if window is not None and window <= 0:
        raise ValueError("window must be positive")

    backend, reason = choose_backend(backend, edits=edits, probes=probes, softcap=softcap, device=dev)
    if backend == "sdpa":
        kbias = None if edits.key_spans is None else _span_bias(edits.key_spans, edits.key_bias, Nk)
        out = _sdpa(q, k, v, scale, causal, key_padding_mask, attn_mask, window, edits.q_scale, edits.out_scale,
                    kbias)
        return out, AttentionStats(backend="sdpa", reason=reason)
    masks = dict(scale=float(scale), causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                 softcap=softcap, window=window)
    if backend == "triton":
        from .triton_attention import triton_attention

        out, stats = triton_attention(q, k, v, edits, probes, **masks)
    else:
        from .torch_attention import torch_attention

        out, stats = torch_attention(q, k, v, edits, probes, block_q=block_q, **masks)
    stats.backend, stats.reason = backend, reason
    return out, stats


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


def _span_bias(key_spans: Tensor, key_bias: Tensor, Nk: int) -> Tensor:
    """(B, H, Nk) float32 additive bias per key from (B, S, 2) spans and their (B, H, S) biases."""
    j = torch.arange(Nk, device=key_spans.device)
    inspan = ((j >= key_spans[..., :1]) & (j < key_spans[..., 1:])).float()
    return torch.einsum("bhs,bsn->bhn", key_bias.float(), inspan)


def _with_key_bias(q: Tensor, k: Tensor, v: Tensor, kbias: Tensor, scale: float):
    """q, k, v with the per-key bias folded into extra head-dim coordinates, so that
    ``scale * q' . k' = scale * q . k + kbias`` (q gets a 1, k gets ``kbias / scale``, v a 0; padded to
    a multiple of 8 so fused SDPA kernels still apply). K and V are expanded to the query heads only when
    the bias differs between the query heads that share a kv head."""
    B, H, Nq, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    kb = kbias.view(B, Hkv, G, -1)
    if G > 1 and bool((kb == kb[:, :, :1]).all()):
        kb = kb[:, :, 0]
    else:
        kb = kbias
        if G > 1:
            k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    pad = 8 - D % 8
    qx = torch.zeros(*q.shape[:3], pad, dtype=q.dtype, device=q.device)
    qx[..., 0] = 1
    kx = torch.zeros(*k.shape[:3], pad, dtype=k.dtype, device=k.device)
    kx[..., 0] = (kb / scale).to(k.dtype)
    vx = torch.zeros(*v.shape[:3], pad + D - v.shape[-1], dtype=v.dtype, device=v.device)
    return torch.cat([q, qx], -1), torch.cat([k, kx], -1), torch.cat([v, vx], -1)


def _sdpa(q, k, v, scale, causal, key_padding_mask, attn_mask, window,
          q_scale=None, out_scale=None, kbias=None) -> Tensor:
    """Plain SDPA, plus the edits it computes exactly: query scales, output scales, finite key biases."""
    B, H, Nq, Dq = q.shape
    Nk = k.shape[2]
    Dv = v.shape[-1]
    if q_scale is not None:
        q = q * q_scale[:, :, None, None].to(q.dtype)
    if kbias is not None:
        q, k, v = _with_key_bias(q, k, v, kbias, scale)
    mask = None
    is_causal = False
    needs_vis = (causal and Nq > 1) or window is not None
    if key_padding_mask is None and attn_mask is None and not needs_vis:
        pass
    elif key_padding_mask is None and attn_mask is None and causal and window is None and Nq == Nk:
        is_causal = True
    else:
        mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=q.device)
        vis = visibility(Nq, Nk, 0, Nq, 0, Nk, causal, window, q.device)
        if vis is not None:
            mask = mask & vis[None, None]
        if key_padding_mask is not None:
            mask = mask & key_padding_mask[:, None, None, :]
        if attn_mask is not None:
            mask = mask & attn_mask
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=k.shape[1] != H
    )
    if kbias is not None:
        out = out[..., :Dv]
    if mask is not None:
        # fully masked rows: make sure they are zeros whatever the SDPA backend does
        empty = ~mask.any(-1, keepdim=True)
        if bool(empty.any()):
            out = out.masked_fill(empty, 0.0)
    if out_scale is not None:
        out = out * out_scale[:, :, None, None].to(out.dtype)
    return out
