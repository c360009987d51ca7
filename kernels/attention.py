"""Attention with per-head edits and streaming probes: one signature, three backends.

See ``docs/kernels.md`` for the full contract. The kernels know nothing of plugins or of transformers:
they take q, k, v and plain tensors describing the edits and probes, and return the per-head output
``z = A @ V`` together with the requested statistics of the (edited) attention ``A``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["AttentionStats", "attention", "triton_available", "BACKENDS"]

BACKENDS = ("auto", "sdpa", "torch", "triton")


@dataclass
class AttentionStats:
    """Probes of one attention call, describing the attention *after* edits.

    Shapes (B batch rows, H query heads, Nq queries, Nk keys, P probe spans, O probe offsets); all float
    tensors are float32 whatever the input dtype. A query row with no visible key (a padding query) has
    ``argmax = -1``, ``argmax_prob = 0``, ``entropy = 0``, ``span_mass = 0``, ``offset_mass = 0`` and an
    all-zero pattern row.

    - ``argmax``: (B, H, Nq) int64, index of the top-1 key (first one on ties), in key coordinates
      ``0..Nk-1``.
    - ``argmax_prob``: (B, H, Nq) float32, its attention probability.
    - ``entropy``: (B, H, Nq) float32, ``-sum_j A_ij log A_ij`` in nats.
    - ``span_mass``: (B, H, Nq, P) float32, ``sum_{j in span p} A_ij``.
    - ``offset_mass``: (B, H, Nq, O) float32, ``A[i, pos(i) - delta_o]`` with ``pos(i) = Nk - Nq + i`` the
      query's own key coordinate and ``delta_o = probe_offsets[b, o]``; 0 where that key is outside
      ``0..Nk-1`` or not visible, and for unused offset slots (``delta_o = -1``).
    - ``pattern``: (B, H, Nq, Nk) float32, the full attention, only when ``return_pattern``.
    - ``backend``: the path that ran (``"sdpa"``, ``"torch"`` or ``"triton"``).
    """

    argmax: Tensor | None = None
    argmax_prob: Tensor | None = None
    entropy: Tensor | None = None
    span_mass: Tensor | None = None
    offset_mass: Tensor | None = None
    pattern: Tensor | None = None
    backend: str = field(default="torch")


def triton_available() -> bool:
    """True when triton can be imported (it does not say whether a GPU is present)."""
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the platform
        return False
    return True


def _per_head(x, B: int, H: int, name: str, dtype, device) -> Tensor | None:
    if x is None:
        return None
    x = torch.as_tensor(x, device=device)
    try:
        x = torch.broadcast_to(x, (B, H))
    except RuntimeError as e:
        raise ValueError(f"{name} must broadcast to (B, H) = ({B}, {H}), got {tuple(x.shape)}") from e
    return x.to(dtype)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    key_padding_mask: Tensor | None = None,
    attn_mask: Tensor | None = None,
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
    softcap: float | None = None,
    window: int | None = None,
    backend: str = "auto",
    block_q: int = 128,
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

    Scores and edits, in this order, per (batch row b, head h)::

        s_ij = scale * (q_scale[b,h] * q_i) . k_j        # q_scale 0 = query masking -> uniform attention
        s_ij = softcap * tanh(s_ij / softcap)             # if softcap (Gemma 2)
        s_ij = 0                 if score_zero[b,h]       # score masking
        s_ij += sum_s key_bias[b,h,s] * [key_spans[b,s,0] <= j < key_spans[b,s,1]]   # PASTA log(alpha)
        s_ij = -inf              where masked
        A = softmax_j(s);  z_i = out_scale[b,h] * sum_j A_ij v_j

    ``q_scale``, ``out_scale``: float, broadcastable to (B, H). ``score_zero``: bool, (B, H).
    ``key_spans``: (B, S, 2) int ``[start, end)`` in key coordinates ``0..Nk``; spans may overlap and
    biases add. ``key_bias``: (B, H, S) float. Rows/heads without an edit use 1 / False / 0.

    Probes (see :class:`AttentionStats`) describe ``A`` after the edits: ``probe_argmax`` (index and
    probability of the top-1 key), ``probe_entropy`` (nats), ``probe_spans`` (B, P, 2) int
    ``[start, end)`` -> mass per span, ``probe_offsets`` (B, O) int relative offsets ``delta >= 0``
    (``-1`` = unused slot) -> ``A[i, Nk - Nq + i - delta]`` per query (the attention ``delta`` keys back
    from the query's own position: 1 = previous token), ``return_pattern`` -> full (B, H, Nq, Nk) attention.

    ``backend``: ``"sdpa"`` (``scaled_dot_product_attention``; takes query/output scales and finite key
    biases, which it computes exactly, the bias riding as an extra head-dim coordinate; no probes,
    softcap or score zeroing), ``"torch"`` (query-blocked, exact, memory linear in sequence length:
    ``block_q`` query rows at a time), ``"triton"`` (fused FlashAttention-2-style kernel; CUDA, or CPU
    under ``TRITON_INTERPRET=1``), ``"auto"`` (sdpa whenever it applies, else triton on CUDA, else
    torch). All paths accumulate in float32 and return ``z`` (B, H, Nq, Dv) in ``q.dtype``.
    """
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
    q_scale = _per_head(q_scale, B, H, "q_scale", torch.float32, dev)
    out_scale = _per_head(out_scale, B, H, "out_scale", torch.float32, dev)
    score_zero = _per_head(score_zero, B, H, "score_zero", torch.bool, dev)
    if key_padding_mask is not None:
        if tuple(key_padding_mask.shape) != (B, Nk):
            raise ValueError(f"key_padding_mask must be (B, Nk) = ({B}, {Nk}), got {tuple(key_padding_mask.shape)}")
        key_padding_mask = key_padding_mask.to(device=dev, dtype=torch.bool)
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool or attn_mask.dim() != 4:
            raise ValueError("attn_mask must be a 4-D boolean tensor broadcastable to (B, H, Nq, Nk)")
        attn_mask = attn_mask.to(dev)
        torch.broadcast_shapes(attn_mask.shape, (B, H, Nq, Nk))
    if (key_spans is None) != (key_bias is None):
        raise ValueError("key_spans and key_bias go together")
    if key_spans is not None:
        key_spans = torch.as_tensor(key_spans, device=dev).long()
        if key_spans.dim() != 3 or key_spans.shape[0] != B or key_spans.shape[2] != 2:
            raise ValueError(f"key_spans must be (B, S, 2), got {tuple(key_spans.shape)}")
        S = key_spans.shape[1]
        key_bias = torch.as_tensor(key_bias, device=dev, dtype=torch.float32)
        try:
            key_bias = torch.broadcast_to(key_bias, (B, H, S))
        except RuntimeError as e:
            raise ValueError(f"key_bias must broadcast to (B, H, S) = ({B}, {H}, {S})") from e
        if S == 0:
            key_spans = key_bias = None
    if probe_spans is not None:
        probe_spans = torch.as_tensor(probe_spans, device=dev).long()
        if probe_spans.dim() != 3 or probe_spans.shape[0] != B or probe_spans.shape[2] != 2:
            raise ValueError(f"probe_spans must be (B, P, 2), got {tuple(probe_spans.shape)}")
    if probe_offsets is not None:
        probe_offsets = torch.as_tensor(probe_offsets, device=dev)
        if probe_offsets.dtype.is_floating_point or probe_offsets.dtype == torch.bool:
            raise ValueError("probe_offsets must be integers")
        probe_offsets = probe_offsets.long()
        if probe_offsets.dim() != 2 or probe_offsets.shape[0] != B:
            raise ValueError(f"probe_offsets must be (B, O), got {tuple(probe_offsets.shape)}")
        if bool((probe_offsets < -1).any()):
            raise ValueError("probe_offsets must be >= 0 (or -1 for an unused slot)")
    if softcap is not None and softcap <= 0:
        raise ValueError("softcap must be positive")
    if window is not None and window <= 0:
        raise ValueError("window must be positive")

    has_probes = (probe_argmax or probe_entropy or probe_spans is not None or probe_offsets is not None
                  or return_pattern)
    sdpa_ok = (not has_probes and softcap is None and score_zero is None
               and (key_bias is None or bool(torch.isfinite(key_bias).all())))
    if backend == "auto":
        if sdpa_ok:
            backend = "sdpa"
        elif q.is_cuda and triton_available():
            backend = "triton"
        else:
            backend = "torch"
    if backend == "sdpa":
        if not sdpa_ok:
            raise ValueError("backend='sdpa' takes no probes, softcap, score_zero or infinite key_bias")
        kbias = None if key_spans is None else _span_bias(key_spans, key_bias, Nk)
        out = _sdpa(q, k, v, scale, causal, key_padding_mask, attn_mask, window, q_scale, out_scale, kbias)
        return out, AttentionStats(backend="sdpa")
    kw = dict(
        scale=float(scale), causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
        q_scale=q_scale, score_zero=score_zero, out_scale=out_scale, key_spans=key_spans,
        key_bias=key_bias, probe_argmax=probe_argmax, probe_entropy=probe_entropy,
        probe_spans=probe_spans, probe_offsets=probe_offsets, return_pattern=return_pattern, softcap=softcap,
        window=window,
    )
    if backend == "triton":
        from .triton_attention import triton_attention

        out, stats = triton_attention(q, k, v, **kw)
    else:
        from .torch_attention import torch_attention

        out, stats = torch_attention(q, k, v, block_q=block_q, **kw)
    stats.backend = backend
    return out, stats


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
