"""Attention with per-head edits and streaming probes: one signature, three backends.

See ``docs/kernels.md`` for the full contract. The kernels know nothing of plugins or of transformers:
they take q, k, v, a :class:`HeadEdits` and a :class:`ProbeRequest` made of plain tensors, and return the
per-head output ``z = A @ V`` together with the requested statistics of the (edited) attention ``A``.
:func:`choose_backend` is the one place that decides which path computes a call.

This module is the dispatcher (:func:`attention`, :func:`choose_backend`, the SDPA path); the contract types
and the helpers both paths share live in :mod:`.contract` (re-exported here), the paths in
:mod:`.torch_attention` and :mod:`.triton_attention`, which import only the contract.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .contract import AttentionStats, HeadEdits, ProbeRequest, pairs_from_csr, requests, span_bias, visibility
from .torch_attention import torch_attention

__all__ = [
    "AttentionStats", "BACKENDS", "HeadEdits", "PAIR_PATHS", "ProbeRequest", "attention", "choose_backend",
    "pairs_from_csr", "triton_available", "visibility",
]

#: what a caller may request; :func:`choose_backend` also returns ``"native"`` (the caller's own SDPA call)
BACKENDS = ("auto", "sdpa", "torch", "triton")


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
    grad: bool = False,
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

    Else (``"auto"``) ``"triton"`` on CUDA when triton is installed, ``"torch"`` elsewhere; ``"torch"`` also
    when the call is differentiated (``grad``: autograd records it, :func:`needs_grad`), the Triton path being
    forward-only. ``"torch"`` and ``"triton"`` are taken as requested (``"triton"`` under ``grad`` raises
    ``ValueError``); ``"sdpa"`` requested for a call SDPA cannot compute raises
    ``ValueError``. ``edits``/``probes`` may be unchecked (as given to :func:`attention`). When the probes
    ask for pairs, the reason ends with how the chosen path computes them (:data:`PAIR_PATHS`).
    """
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")
    if requested == "triton" and grad:
        raise ValueError("backend='triton' is forward-only and this call is differentiated (autograd records it): "
                         "request backend 'torch' or 'auto'")
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
    if grad:
        return "torch", f"{blocker}; gradients (the Triton path is forward-only)" + _pair_path(probes, "torch")
    return "triton", f"{blocker}; CUDA" + _pair_path(probes, "triton")


def needs_grad(*tensors: Tensor | None) -> bool:
    """Whether autograd records an operation on ``tensors``: grad mode is on and one of them requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


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
    ``None`` stands for no edits / no probes.

    ``backend``: ``"sdpa"`` (``scaled_dot_product_attention``; takes query/output scales and finite key
    biases, which it computes exactly, the bias riding as an extra head-dim coordinate; no probes,
    softcap or score zeroing), ``"torch"`` (query-blocked, exact, memory linear in sequence length:
    ``block_q`` query rows at a time), ``"triton"`` (fused FlashAttention-2-style kernel; CUDA, or CPU
    under ``TRITON_INTERPRET=1``), ``"auto"``: :func:`choose_backend` decides (sdpa whenever it applies,
    else triton on CUDA, else torch). All paths accumulate in float32 and return ``z`` (B, H, Nq, Dv) in
    ``q.dtype``.
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
    if key_padding_mask is not None:
        if tuple(key_padding_mask.shape) != (B, Nk):
            raise ValueError(f"key_padding_mask must be (B, Nk) = ({B}, {Nk}), got {tuple(key_padding_mask.shape)}")
        key_padding_mask = key_padding_mask.to(device=dev, dtype=torch.bool)
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool or attn_mask.dim() != 4:
            raise ValueError("attn_mask must be a 4-D boolean tensor broadcastable to (B, H, Nq, Nk)")
        attn_mask = attn_mask.to(dev)
        torch.broadcast_shapes(attn_mask.shape, (B, H, Nq, Nk))
    edits, probes = requests(edits, probes, B, H, dev)
    if softcap is not None and softcap <= 0:
        raise ValueError("softcap must be positive")
    if window is not None and window <= 0:
        raise ValueError("window must be positive")

    backend, reason = choose_backend(backend, edits=edits, probes=probes, softcap=softcap, device=dev,
                                     grad=needs_grad(q, k, v, edits.q_scale, edits.out_scale, edits.key_bias))
    if backend == "sdpa":
        kbias = None if edits.key_spans is None else span_bias(edits.key_spans, edits.key_bias, Nk)
        out = _sdpa(q, k, v, scale, causal, key_padding_mask, attn_mask, window, edits.q_scale, edits.out_scale,
                    kbias)
        return out, AttentionStats(backend="sdpa", reason=reason)
    masks = dict(scale=float(scale), causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                 softcap=softcap, window=window)
    if backend == "triton":
        from . import triton_attention as triton_path  # triton is optional, and imported on first use only

        out, stats = triton_path.triton_attention(q, k, v, edits, probes, **masks)
    else:
        out, stats = torch_attention(q, k, v, edits, probes, block_q=block_q, **masks)
    stats.backend, stats.reason = backend, reason
    return out, stats


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
