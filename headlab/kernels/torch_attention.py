"""Query-blocked exact attention with edits and probes in plain torch (the CPU path).

Memory: one block of ``block_q`` query rows of a group of heads against the visible keys at a time, at most
``_MAX_BLOCK_ELEMS`` float32 scratch (the block's scores, edited, masked, exponentiated and normalised in
place while they are in cache, normalised only where read: outputs, probes; a second buffer for the
entropy), never (B, H, Nq, Nk) unless the full
pattern is requested. Pair probes are read
off each block's normalised attention: the pairs are sorted by query once, so a block's pairs are one
contiguous run (memory O(pairs)). GQA is computed by viewing the
query heads as (Hkv, G) groups against the shared kv head (no repeat of K/V).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .contract import (
    AttentionStats,
    HeadEdits,
    ProbeRequest,
    flat_pairs,
    span_bias,
    span_indicator,
    visibility,
)

__all__ = ["torch_attention"]

# float32 elements of one score block (16 MiB, about what a last-level cache holds): a block is a group of
# kv heads (with their query heads) times ``block_q`` queries times the keys; the group shrinks first (down
# to one kv head), then the query block. A block edited in place while it is still in cache costs about half
# of one streamed through memory on every pass (measured: 8K tokens, 8 heads, 1 thread: 3.3 s -> 2.3 s).
_MAX_BLOCK_ELEMS = 1 << 22


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
    hk_step = max(1, min(Hkv, _MAX_BLOCK_ELEMS // max(1, B * G * block_q * Nk)))  # kv heads per block
    bq = max(1, min(block_q, _MAX_BLOCK_ELEMS // max(1, B * G * hk_step * Nk)))

    # per-key additive bias from the key spans: (B, H, Nk), linear memory
    kbias = None if edits.key_spans is None else span_bias(edits.key_spans, edits.key_bias, Nk)
    pin = span_indicator(probes.spans, 0, Nk) if probes.spans is not None else None  # (B, P, Nk)
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

    pairs = None
    if probes.pairs is not None:
        stats.pair_mass = torch.zeros(B, H, probes.pairs.shape[1], dtype=f32, device=dev)
        fb, fp, fq, fk = flat_pairs(probes.pairs, Nq, Nk)
        # the flat pairs of each query block are one contiguous run of the query-sorted list
        edges = torch.arange(0, Nq + bq, bq, device=dev).clamp(max=Nq)
        bounds = torch.searchsorted(fq, edges).tolist()
        pairs = (fb, fp, fq, fk, bounds)

    for blk, q0 in enumerate(range(0, Nq, bq)):
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
            continue  # offset and pair masses are already zero
        hidden = [(a0, a1, ~visibility(Nq, Nk, q0, q1, a0, a1, causal, window, dev))
                  for a0, a1 in _partly_visible(Nq, Nk, q0, q1, k0, k1, causal, window)]
        am = None if attn_mask is None else ~attn_mask[..., q0:q1, k0:k1]
        for g0 in range(0, Hkv, hk_step):
            g1 = min(Hkv, g0 + hk_step)
            hs = slice(g0 * G, g1 * G)  # the query heads of kv heads g0..g1-1
            nh = (g1 - g0) * G
            qb = q[:, hs, q0:q1].to(f32) * qmul[:, hs, None, None]
            # the G query heads of a kv head as G*n rows against the shared K/V: a plain batched matmul
            # (a broadcast (B, Hkv, 1, ...) operand would make matmul copy K and V G times)
            s = torch.matmul(qb.reshape(B, g1 - g0, G * n, D), kf[:, g0:g1, k0:k1].transpose(-1, -2))
            s = s.view(B, nh, n, k1 - k0)
            # from here on the block is edited in place: one (B, heads, n, keys) buffer (two with entropy)
            if softcap is not None:  # tanh's backward reads its output, which an in-place mul_ would overwrite
                s = torch.tanh(s / softcap) * softcap if s.requires_grad else s.div_(softcap).tanh_().mul_(softcap)
            if edits.score_zero is not None:
                s.masked_fill_(edits.score_zero[:, hs, None, None], 0.0)
            if kbias is not None:
                s.add_(kbias[:, hs, None, k0:k1])
            for a0, a1, unseen in hidden:
                s[..., a0 - k0:a1 - k0].masked_fill_(unseen, -math.inf)
            if key_padding_mask is not None:
                s.masked_fill_(~key_padding_mask[:, None, None, k0:k1], -math.inf)
            if am is not None:
                s.masked_fill_(am if am.shape[1] == 1 else am[:, hs], -math.inf)
            m = s.detach().amax(-1, keepdim=True)  # a constant shift: softmax does not depend on it
            m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=f32, device=dev))
            if probes.argmax:
                idx = s.argmax(-1)
            p = s.sub_(m).exp_()  # unnormalised attention; masked keys are exactly 0
            ent = torch.special.xlogy(p, p).sum(-1) if probes.entropy else None  # sum_j p_j log p_j
            lsum = p.sum(-1, keepdim=True)
            empty = lsum == 0
            lsafe = torch.where(empty, torch.ones((), dtype=f32, device=dev), lsum)
            inv = 1.0 / lsafe  # the attention is p * inv; everything read off p is scaled after (no pass)
            o = torch.matmul(p.view(B, g1 - g0, G * n, k1 - k0), vf[:, g0:g1, k0:k1]).view(B, nh, n, Dv) * inv
            if edits.out_scale is not None:
                o = o * edits.out_scale[:, hs, None, None]
            out[:, hs, q0:q1] = o.to(q.dtype)
            if probes.argmax:
                e = empty.squeeze(-1)
                stats.argmax[:, hs, q0:q1] = torch.where(e, torch.full_like(idx, -1), idx + k0)
                stats.argmax_prob[:, hs, q0:q1] = (p.gather(-1, idx[..., None]) * inv).squeeze(-1)
            if probes.entropy:
                # H = -sum_j a_j log a_j = log l - (sum_j p_j log p_j) / l; 0 for a row with no visible key
                ls = lsafe.squeeze(-1)
                stats.entropy[:, hs, q0:q1] = torch.log(ls) - ent / ls
            if pin is not None:  # (B, heads * n, keys) @ (B, keys, P): no copy of the block
                sm = torch.bmm(p.view(B, nh * n, k1 - k0), pin[:, :, k0:k1].transpose(1, 2))
                stats.span_mass[:, hs, q0:q1] = sm.view(B, nh, n, -1) * inv
            if probes.offsets is not None and probes.offsets.shape[1]:
                stats.offset_mass[:, hs, q0:q1] = _offset_gather(p, probes.offsets, off + q0, k0) * inv
            if pairs is not None:
                _pair_gather(stats.pair_mass, p, inv, pairs, blk, q0, k0, hs)
            if probes.pattern:
                stats.pattern[:, hs, q0:q1, k0:k1] = p * inv
            del s, p  # free this block before the next block's scores are allocated
    return out, stats


def _partly_visible(Nq: int, Nk: int, q0: int, q1: int, k0: int, k1: int, causal: bool,
                    window: int | None) -> list[tuple[int, int]]:
    """The key ranges within ``[k0, k1)`` that some query of ``[q0, q1)`` does not see (causal / window):
    only there does the block need a visibility mask."""
    if not causal and window is None:
        return []
    off = Nk - Nq
    lo = k0 if window is None else off + q1 - window  # keys >= lo: inside every query's window
    hi = off + q0 + 1 if causal else (k1 if window is None else off + q0 + window)  # keys < hi: not after any
    lo, hi = max(k0, min(lo, k1)), max(k0, min(hi, k1))
    if lo >= hi:
        return [(k0, k1)]
    return [(a, b) for a, b in ((k0, lo), (hi, k1)) if b > a]


def _pair_gather(pair_mass: Tensor, p: Tensor, inv: Tensor, pairs, blk: int, q0: int, k0: int, hs: slice) -> None:
    """Write ``p[b, :, i - q0, j - k0] * inv[b, :, i - q0]`` (the attention) into ``pair_mass[b, hs, slot]``
    for the flat pairs ``(b, slot, i, j)`` of query block ``blk`` (``p`` (B, heads hs, n, keys) over keys
    ``[k0, k0 + keys)`` and its (B, heads, n, 1) row scale ``inv``); keys outside the block are invisible to
    these queries and keep 0."""
    fb, fp, fq, fk, bounds = pairs
    lo, hi = bounds[blk], bounds[blk + 1]
    if hi <= lo:
        return
    b, slot, i, j = fb[lo:hi], fp[lo:hi], fq[lo:hi] - q0, fk[lo:hi] - k0
    inside = (j >= 0) & (j < p.shape[-1])
    got = p[b, :, i, j.clamp(0, p.shape[-1] - 1)] * inv[b, :, i, 0]  # (n, heads)
    pair_mass[b, hs, slot] = torch.where(inside[:, None], got, torch.zeros((), dtype=p.dtype, device=p.device))


def _offset_gather(a: Tensor, offsets: Tensor, pos0: int, k0: int) -> Tensor:
    """(B, H, n, O) ``a[..., r, pos0 + r - delta_o - k0]`` from a block ``a`` (B, H, n, k)
    covering keys ``[k0, k0 + k)`` of queries at key positions ``pos0 + r``; 0 outside the block (such keys
    are invisible to these queries) and for unused slots (delta < 0)."""
    B, H, n, nk = a.shape
    r = torch.arange(n, device=a.device)
    idx = pos0 - k0 + r[None, :, None] - offsets[:, None, :]  # (B, n, O) local key index
    ok = (offsets[:, None, :] >= 0) & (idx >= 0) & (idx < nk)
    idx = idx.clamp(0, max(nk - 1, 0))
    got = a.gather(-1, idx[:, None].expand(B, H, n, idx.shape[-1]))
    return torch.where(ok[:, None], got, torch.zeros((), dtype=a.dtype, device=a.device))
