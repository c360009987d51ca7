"""Query-blocked exact attention with edits and probes in plain torch (the CPU path).

Memory: one block of ``block_q`` query rows against the visible keys at a time, i.e. O(B * H * block_q * Nk)
float32 scratch, never (B, H, Nq, Nk) unless the full pattern is requested. GQA is computed by viewing the
query heads as (Hkv, G) groups against the shared kv head (no repeat of K/V).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .attention import AttentionStats, HeadEdits, ProbeRequest, visibility

# float32 elements of one (B, H, block, keys) score block; the block shrinks to stay under this
_MAX_BLOCK_ELEMS = 1 << 25


def _inspan(spans: Tensor, k0: int, k1: int) -> Tensor:
    """(B, S, k1-k0) float: 1 where key j in [k0, k1) lies in span [start, end)."""
    j = torch.arange(k0, k1, device=spans.device)
    return ((j >= spans[..., :1]) & (j < spans[..., 1:])).float()


def torch_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    edits: HeadEdits,
    probes: ProbeRequest,
    *,
    scale: float,
    causal: bool,
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    softcap: float | None,
    window: int | None,
    block_q: int = 128,
) -> tuple[Tensor, AttentionStats]:
    """The torch path of :func:`~headlab.kernels.attention` (checked ``edits`` and ``probes``)."""
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = H // Hkv
    off = Nk - Nq
    dev = q.device
    f32 = torch.float32
    kf = k.to(f32)
    vf = v.to(f32)
    bq = max(1, min(block_q, _MAX_BLOCK_ELEMS // max(1, B * H * Nk)))

    # per-key additive bias from the key spans: (B, H, Nk), linear memory
    kbias = None
    if edits.key_spans is not None:
        kbias = torch.einsum("bhs,bsn->bhn", edits.key_bias.to(f32), _inspan(edits.key_spans, 0, Nk))
    pin = _inspan(probes.spans, 0, Nk) if probes.spans is not None else None  # (B, P, Nk)
    qmul = torch.full((B, H), scale, dtype=f32, device=dev)
    if edits.q_scale is not None:
        qmul = qmul * edits.q_scale

    out = torch.empty(B, H, Nq, Dv, dtype=q.dtype, device=dev)
    stats = AttentionStats()
    if probes.argmax:
        stats.argmax = torch.empty(B, H, Nq, dtype=torch.long, device=dev)
        stats.argmax_prob = torch.empty(B, H, Nq, dtype=f32, device=dev)
    if probes.entropy:
        stats.entropy = torch.empty(B, H, Nq, dtype=f32, device=dev)
    if pin is not None:
        stats.span_mass = torch.empty(B, H, Nq, pin.shape[1], dtype=f32, device=dev)
    if probes.offsets is not None:
        stats.offset_mass = torch.zeros(B, H, Nq, probes.offsets.shape[1], dtype=f32, device=dev)
    if probes.pattern:
        stats.pattern = torch.zeros(B, H, Nq, Nk, dtype=f32, device=dev)

    for q0 in range(0, Nq, bq):
        q1 = min(Nq, q0 + bq)
        n = q1 - q0
        k1 = min(Nk, off + q1) if causal else (Nk if window is None else min(Nk, off + q1 - 1 + window))
        k0 = 0 if window is None else max(0, off + q0 - window + 1)
        if k1 <= k0:  # nothing visible for the whole block
            out[:, :, q0:q1] = 0
            if probes.argmax:
                stats.argmax[:, :, q0:q1] = -1
                stats.argmax_prob[:, :, q0:q1] = 0
            if probes.entropy:
                stats.entropy[:, :, q0:q1] = 0
            if pin is not None:
                stats.span_mass[:, :, q0:q1] = 0
            continue  # offset_mass is already zero
        qb = q[:, :, q0:q1].to(f32) * qmul[:, :, None, None]
        # the G query heads of a kv head as G*n rows against the shared K/V: a plain batched matmul
        # (a broadcast (B, Hkv, 1, ...) operand would make matmul copy K and V G times)
        s = torch.matmul(qb.reshape(B, Hkv, G * n, D), kf[:, :, k0:k1].transpose(-1, -2))
        s = s.view(B, H, n, k1 - k0)
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        if edits.score_zero is not None:
            s = s.masked_fill(edits.score_zero[:, :, None, None], 0.0)
        if kbias is not None:
            s = s + kbias[:, :, None, k0:k1]
        valid = None
        vis = visibility(Nq, Nk, q0, q1, k0, k1, causal, window, dev)
        if vis is not None:
            valid = vis[None, None]
        if key_padding_mask is not None:
            kp = key_padding_mask[:, None, None, k0:k1]
            valid = kp if valid is None else valid & kp
        if attn_mask is not None:
            am = attn_mask[..., q0:q1, k0:k1]
            valid = am if valid is None else valid & am
        if valid is not None:
            s = s.masked_fill(~valid, -math.inf)
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=f32, device=dev))
        p = torch.exp(s - m)
        lsum = p.sum(-1, keepdim=True)
        empty = lsum == 0
        lsafe = torch.where(empty, torch.ones((), dtype=f32, device=dev), lsum)
        a = p / lsafe
        o = torch.matmul(a.reshape(B, Hkv, G * n, k1 - k0), vf[:, :, k0:k1]).view(B, H, n, Dv)
        if edits.out_scale is not None:
            o = o * edits.out_scale[:, :, None, None]
        out[:, :, q0:q1] = o.to(q.dtype)
        if probes.argmax:
            idx = s.argmax(-1)
            e = empty.squeeze(-1)
            stats.argmax[:, :, q0:q1] = torch.where(e, torch.full_like(idx, -1), idx + k0)
            stats.argmax_prob[:, :, q0:q1] = a.gather(-1, idx[..., None]).squeeze(-1)
        if probes.entropy:
            loga = s - m - torch.log(lsafe)
            stats.entropy[:, :, q0:q1] = -torch.where(a > 0, a * loga, torch.zeros((), dtype=f32, device=dev)).sum(-1)
        if pin is not None:
            stats.span_mass[:, :, q0:q1] = torch.einsum("bhqn,bpn->bhqp", a, pin[:, :, k0:k1])
        if probes.offsets is not None and probes.offsets.shape[1]:
            stats.offset_mass[:, :, q0:q1] = _offset_gather(a, probes.offsets, off + q0, k0)
        if probes.pattern:
            stats.pattern[:, :, q0:q1, k0:k1] = a
    return out, stats


def _offset_gather(a: Tensor, offsets: Tensor, pos0: int, k0: int) -> Tensor:
    """(B, H, n, O) ``a[..., r, pos0 + r - delta_o - k0]`` from a normalised block ``a`` (B, H, n, k)
    covering keys ``[k0, k0 + k)`` of queries at key positions ``pos0 + r``; 0 outside the block (such keys
    are invisible to these queries) and for unused slots (delta < 0)."""
    B, H, n, nk = a.shape
    r = torch.arange(n, device=a.device)
    idx = pos0 - k0 + r[None, :, None] - offsets[:, None, :]  # (B, n, O) local key index
    ok = (offsets[:, None, :] >= 0) & (idx >= 0) & (idx < nk)
    idx = idx.clamp(0, max(nk - 1, 0))
    got = a.gather(-1, idx[:, None].expand(B, H, n, idx.shape[-1]))
    return torch.where(ok[:, None], got, torch.zeros((), dtype=a.dtype, device=a.device))
