"""Attention over a headwise KV cache (:class:`headlab.kv.HeadwiseCache`): each group over its own keys.

When a layer's cache update left a :class:`headlab.kv.SplitCall` (the layer has compressed KV heads),
:func:`split_attention` computes the call instead of the plain path:

- the query heads of the *full* KV heads attend the full group (every position) under transformers' mask,
  as the plain path does, or, when the forward left the mask implicit (:attr:`headlab.kv.HeadwiseLayer.
  implicit_mask`: no dense mask built), causally with the layer's left padding; on SDPA, where it would need a
  dense mask (a chunk after earlier tokens, padding, a window), by blocks of queries, each over the keys it
  sees, so that no mask holds more than ``_BLOCK_ELEMS`` entries;
- the query heads of each *compressed* KV head ``j`` (query heads ``j*g .. (j+1)*g - 1``) attend only the
  keys the policy keeps: key ``k`` is visible to the query at ``q`` iff ``k < sink`` or ``q - k < window``
  (and ``k <= q``), positions counted in the row's own tokens. A decode step reads the bounded group (its
  sinks and ring buffer); a chunk of several tokens (a prefill) runs by blocks of queries, each against the
  bounded group stored before the chunk, the chunk's own sink tokens and the chunk's keys inside the block's
  window (never the chunk's other keys), in one exact softmax with a boolean mask.

Both groups run through :func:`headlab.kernels.attention`; :func:`headlab.kernels.choose_backend` picks the
path of each group (SDPA when no edit needs the kernels, else the torch path, or Triton on CUDA, which takes
the same boolean mask), and the path is recorded on the cache layer (``attention_paths``) and in the
session's backends. Edits that act per head (query scales, output scales, score zeroing) and head output
replacements apply; key-span biases, probes, layer callbacks and key/value replacements speak key positions
of a full cache and are refused on such a layer.

A map with ``compensate`` (the ``razor`` policy) adds one compensation token per compressed head: the mean
key and value of the tokens the query no longer sees (own positions ``sink <= k <= q - window``). A decode
step appends the layer's running mean (:meth:`headlab.kv.HeadwiseLayer.compensation`) to the bounded
group; a chunk of several tokens computes each query's own token exactly from prefix sums over the chunk,
plus, for a chunk after earlier tokens (a prompt fed in several forwards, ``prefill_chunk``), the layer's
sums before the chunk and the ring tokens before it that leave the query's window; it attends in plain torch
(one float32 softmax over the block's keys and that token; the path says ``torch`` and where the token came
from).

Under a map with ``prefill="full"`` (the ``streaming`` and ``random`` policies' ``prefill: full``) a row's
first call attends every head causally over the chunk's keys (the layer's update returned all of them and
stored only what the policy keeps); later calls are decode steps over the groups as above.

Under ``headkv`` (a :class:`headlab.kv.HeadBudgetLayer`) the prefill attends every head causally over the
whole prompt, as SnapKV and HeadKV do, and hands the call's queries (after the rotary embedding) to the
layer, which keeps each compressed KV head's selection (only the last ``observation_window`` queries are
scored, never the full attention matrix); later calls attend each compressed KV head's query heads over its
kept keys and the tokens stored since, one head at a time (each head holds a different number of keys). A
prompt fed in several chunks (``prefill_chunk``) is attended the same way chunk by chunk, every head over
every earlier prompt key (the layer holds them all until the prompt's last chunk); a chunk before the last
hands the layer its queries to keep the last ``observation_window`` of them, and the last chunk's call
compresses.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from headlab.kernels import HeadEdits, choose_backend
from headlab.kernels import attention as kernel_attention
from headlab.kv.errors import KvPolicyError
from headlab.kv.layers import HeadBudgetLayer
from headlab.kv.split import SplitCall

from .layers import REFUSED_KWARGS, UnsupportedModelError
from .masks import kernel_mask_args
from .plan import ReplaceKV
from .session import Session

__all__ = ["split_attention"]

#: elements of one query block's boolean mask and scores (B x query heads x queries x keys), at most
_BLOCK_ELEMS = 1 << 22


def _query_heads(kv_heads: Tensor, group: int) -> Tensor:
    """The query heads of ``kv_heads`` under GQA (``j -> j*g .. (j+1)*g - 1``)."""
    return (kv_heads[:, None] * group + torch.arange(group, device=kv_heads.device)[None, :]).reshape(-1)


def _heads_of(edits: HeadEdits | None, heads: Tensor) -> HeadEdits | None:
    """``edits`` (checked, per (row, query head)) restricted to the query heads ``heads``."""
    if edits is None or edits.is_empty():
        return None

    def pick(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.index_select(1, heads)

    return HeadEdits(pick(edits.q_scale), pick(edits.score_zero), pick(edits.out_scale))


def split_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                    attention_mask: Tensor | None, scaling: float | None, kwargs: dict[str, Any], split: SplitCall,
                    session: Session | None, layer: int | None) -> Tensor:
    """One attention call over a split cache: query (B, H, Nq, D), the full group's key/value (B, n_full,
    Nk, D) as the cache update returned them -> (B, H, Nq, D) head outputs."""
    for name in REFUSED_KWARGS:
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(f"headlab: attention with `{name}` ({type(module).__name__}) is not supported")
    cache = split.layer
    B, H, Nq, D = query.shape
    group = H // cache.n_kv_heads
    scale = D**-0.5 if scaling is None else scaling
    softcap = kwargs.get("softcap")
    if softcap is None:
        softcap = getattr(getattr(module, "config", None), "attn_logit_softcapping", None)
    model_window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    model_window = model_window if model_window is not None and model_window > 0 else None
    plan = session.plan if session is not None and layer is not None and session.plan.touches(layer) else None
    edits, requested = None, "auto"
    if plan is not None:
        requested = plan.backend
        pos = session.positions(layer, Nq, key.shape[2])
        _refuse(plan, session, layer)
        edits = HeadEdits(**session.edits_for(layer, B, H, pos, query.device)).checked(B, H, query.device)
        if edits.key_spans is not None:
            raise KvPolicyError(f"layer {layer}: key-span biases (PASTA) cannot run with a KV policy that compresses "
                                "heads (they name key positions a compressed head no longer holds)")
    if split.prefill:  # every head attends causally over the prompt (headkv, or prefill: full)
        backend, reason = choose_backend(requested, edits=edits, softcap=softcap, device=query.device)
        margs = _mask_args(attention_mask, cache, Nq, key.shape[2], model_window)
        out = _causal_group(query, key, value, margs, edits, scale, softcap, backend)
        if isinstance(cache, HeadBudgetLayer) and cache.prompt_complete:
            cache.compress(query, scale)
            how = "headkv prefill, then SnapKV selection per KV head"
        elif isinstance(cache, HeadBudgetLayer):  # a chunk before the prompt's last: no selection yet
            cache.observe(query)
            how = "headkv prefill chunk, every KV head's prompt keys kept until the prompt's last chunk"
        else:  # the update stored the compressed heads' sinks and window already
            how = "full prefill, then the compressed heads keep sinks + window"
        paths = [f"every head: {backend} ({reason}; {how})"]
        return _recorded(out, paths, cache, session, layer, plan, Nq, key.shape[2], backend)
    out = query.new_empty(B, H, Nq, value.shape[-1])
    paths = []
    if len(cache.full_heads):
        fq = _query_heads(cache.full_heads, group)
        sub = _heads_of(edits, fq)
        backend, reason = choose_backend(requested, edits=sub, softcap=softcap, device=query.device)
        margs = _mask_args(attention_mask, cache, Nq, key.shape[2], model_window)
        out[:, fq] = _causal_group(query.index_select(1, fq), key, value, margs, sub, scale, softcap, backend)
        paths.append(f"full group: {backend} ({reason})")
    cq = _query_heads(cache.compressed_heads, group)
    sub = _heads_of(edits, cq)
    backend, reason = choose_backend(requested, edits=sub, softcap=softcap, device=query.device)
    if isinstance(cache, HeadBudgetLayer):
        out[:, cq] = _budgeted(query.index_select(1, cq), split, scale, softcap, sub, backend, model_window)
        how = "each KV head's kept keys + new tokens"
    else:
        out[:, cq] = _bounded(query.index_select(1, cq), split, scale, softcap, sub, backend, model_window)
        how = "sinks + ring buffer" if Nq == 1 else "sinks + window by query blocks"
    if cache.compensate and Nq == 1:
        how += ", compensation token"
    elif cache.compensate:  # _attend_compensated: plain torch, whatever the kernels' choice
        backend, reason = "torch", "a compensation token per query: one float32 softmax per query block"
        how += ", compensation token" + (" from the chunk's prefix sums" if split.prior_comp is None else
                                         " from the cache's sums and ring and the chunk's prefix sums")
    paths.append(f"compressed group: {backend} ({reason}; {how})")
    return _recorded(out, paths, cache, session, layer, plan, Nq, key.shape[2], backend)


def _mask_args(attention_mask: Tensor | None, layer: Any, Nq: int, Nk: int, model_window: int | None) -> dict:
    """The kernel mask arguments of the full group's (causal) attention: from transformers' mask, or, when the
    forward left it implicit (:attr:`headlab.kv.HeadwiseLayer.implicit_mask`), causal with the layer's left
    padding as key padding."""
    if attention_mask is not None or not layer.implicit_mask:
        return kernel_mask_args(attention_mask, Nq, Nk, True, model_window)
    kpm = None
    if layer.max_pad:
        kpm = torch.arange(Nk, device=layer.pad.device)[None, :] >= layer.pad[:, None]
    return dict(key_padding_mask=kpm, attn_mask=None, causal=True, window=model_window)


def _causal_group(q: Tensor, k: Tensor, v: Tensor, margs: dict, edits: HeadEdits | None, scale: float,
                  softcap: float | None, backend: str) -> Tensor:
    """Attention of ``q`` (B, h, Nq, D), the last ``Nq`` positions, over ``k``/``v`` (B, hkv, Nk, D) under the
    kernel mask arguments ``margs``. Where SDPA would be handed a dense (Nq, Nk) mask (a chunk after earlier
    tokens, key padding, a window), it runs by blocks of queries, each over only the keys it can see, so that
    no mask holds more than ``_BLOCK_ELEMS`` entries."""
    B, _, Nq, _ = q.shape
    Nk = k.shape[2]
    kpm, causal, window = margs["key_padding_mask"], margs["causal"], margs["window"]
    dense = kpm is not None or window is not None or Nq != Nk  # else SDPA runs is_causal, without a mask
    if backend != "sdpa" or not causal or margs["attn_mask"] is not None or not dense or B * Nq * Nk <= _BLOCK_ELEMS:
        return kernel_attention(q, k, v, edits=edits, scale=scale, softcap=softcap, **margs, backend=backend)[0]
    bq = max(1, _BLOCK_ELEMS // (B * Nk))
    out = q.new_empty(*q.shape[:3], v.shape[-1])
    for q0 in range(0, Nq, bq):
        q1 = min(Nq, q0 + bq)
        k1 = Nk - Nq + q1  # the block's last query sees keys < k1 (the block keeps the bottom-right alignment)
        k0 = 0 if window is None else max(0, Nk - Nq + q0 - window + 1)
        out[:, :, q0:q1] = kernel_attention(
            q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], edits=edits, scale=scale, softcap=softcap,
            key_padding_mask=None if kpm is None else kpm[:, k0:k1], attn_mask=None, causal=True, window=window,
            backend=backend)[0]
    return out


def _recorded(out: Tensor, paths: list[str], cache: Any, session: Session | None, layer: int | None, plan: Any,
              Nq: int, Nk: int, backend: str) -> Tensor:
    """``out`` after the session's output replacements, the paths recorded on the cache layer and session."""
    cache.attention_paths.add("; ".join(paths))
    if session is not None and layer is not None:
        session.rec.backends[layer] = (backend, "kv split cache: " + "; ".join(paths))
        if plan is not None:
            out = session.replace_z(layer, out, session.positions(layer, Nq, Nk))
        session.advance(layer, Nq)
    return out


def _budgeted(q: Tensor, split: SplitCall, scale: float, softcap: float | None, edits: HeadEdits | None,
              backend: str, model_window: int | None) -> Tensor:
    """headkv after the prefill: the compressed query heads' outputs (B, Hc*g, Nq, Dv), each KV head's query
    heads over its kept prompt keys and the tokens stored since (causally among those)."""
    layer = split.layer
    B, Hq, Nq, _ = q.shape
    g = Hq // layer.n_compressed
    at = split.start + torch.arange(Nq, device=q.device)  # padded indices of the queries
    out = q.new_empty(B, Hq, Nq, split.chunk_values.shape[-1])
    for i in range(layer.n_compressed):
        k, v, pos = layer.head_cache(i)
        d = at[None, :, None] - pos[:, None, :]
        vis = (pos[:, None, :] >= 0) & (d >= 0)
        if model_window is not None:
            vis &= d < model_window
        heads = torch.arange(i * g, (i + 1) * g, device=q.device)
        out[:, i * g:(i + 1) * g] = _attend(q[:, i * g:(i + 1) * g], k, v, vis, scale, softcap,
                                            _heads_of(edits, heads), backend)
    return out


def _refuse(plan: Any, session: Session, layer: int) -> None:
    """What a layer with compressed KV heads cannot run: probes, callbacks, key/value replacements."""
    if plan.probes.covers(layer) and plan.probes.any():
        raise KvPolicyError(f"layer {layer}: attention probes cannot run with a KV policy that compresses heads")
    if plan.callbacks:
        raise KvPolicyError(f"layer {layer}: layer callbacks cannot run with a KV policy that compresses heads")
    if any(isinstance(e, ReplaceKV) and any(ly == layer for ly, _ in e.heads) for e in plan.edits):
        raise KvPolicyError(f"layer {layer}: key/value replacements cannot run with a KV policy that compresses "
                            "heads")


def _visible(own_q: Tensor, pos: Tensor, sink: int, window: int, model_window: int | None) -> Tensor:
    """(B, n, L) whether key positions ``pos`` (B, L; -1: none) are visible to queries at ``own_q`` (B, n)."""
    d = own_q[:, :, None] - pos[:, None, :]
    p = pos[:, None, :]
    vis = (p >= 0) & (d >= 0) & ((p < sink) | (d < window))
    if model_window is not None:
        vis &= d < model_window
    return vis


def _bounded(q: Tensor, split: SplitCall, scale: float, softcap: float | None, edits: HeadEdits | None,
             backend: str, model_window: int | None) -> Tensor:
    """The compressed query heads' outputs (B, Hc*g, Nq, Dv) over the keys the policy keeps."""
    layer = split.layer
    sink, window, pad = layer.sink, layer.window, layer.pad
    B, Hq, Nq, _ = q.shape
    own_q = split.start + torch.arange(Nq, device=q.device)[None, :] - pad[:, None]  # (B, Nq)
    if Nq == 1:  # the bounded group after the update holds exactly the keys this query sees
        k, v, pos = layer.compressed()
        vis = _visible(own_q, pos, sink, window, model_window)
        if layer.compensate:  # plus the compensation token, once a token was dropped
            mk, mv, count = layer.compensation()
            k, v = torch.cat([k, mk], 2), torch.cat([v, mv], 2)
            vis = torch.cat([vis, (count > 0)[:, None, None]], -1)
        return _attend(q, k, v, vis, scale, softcap, edits, backend)
    ck, cv = split.chunk_keys, split.chunk_values
    sinks = torch.arange(sink, device=q.device)
    s_idx = sinks[None, :] + pad[:, None] - split.start  # chunk index of each own sink position (B, sink)
    s_ok = (s_idx >= 0) & (s_idx < Nq)
    gather = s_idx.clamp(0, max(Nq - 1, 0))[:, None, :, None]
    sk = ck.gather(2, gather.expand(-1, ck.shape[1], -1, ck.shape[3]))
    sv = cv.gather(2, gather.expand(-1, cv.shape[1], -1, cv.shape[3]))
    spos = torch.where(s_ok, sinks[None, :], torch.full_like(s_idx, -1))
    fixed_k, fixed_v, fixed_pos = [sk], [sv], [spos]
    if split.prior is not None:
        fixed_k.insert(0, split.prior[0])
        fixed_v.insert(0, split.prior[1])
        fixed_pos.insert(0, split.prior[2])
    fixed = sum(t.shape[1] for t in fixed_pos)
    bq = Nq
    while bq > 1 and B * Hq * bq * (fixed + bq + window) > _BLOCK_ELEMS:
        bq = (bq + 1) // 2
    out = q.new_empty(B, Hq, Nq, cv.shape[-1])
    comp = _prefix_sums(split, own_q, sink) if layer.compensate else None
    for q0 in range(0, Nq, bq):
        q1 = min(Nq, q0 + bq)
        w0 = max(0, q0 - window + 1)
        wpos = split.start + torch.arange(w0, q1, device=q.device)[None, :] - pad[:, None]
        wpos = torch.where(wpos >= sink, wpos, torch.full_like(wpos, -1))  # sinks come from the sink gather
        k = torch.cat([*fixed_k, ck[:, :, w0:q1]], dim=2)
        v = torch.cat([*fixed_v, cv[:, :, w0:q1]], dim=2)
        pos = torch.cat([*fixed_pos, wpos], dim=1)
        vis = _visible(own_q[:, q0:q1], pos, sink, window, model_window)
        if comp is None:
            out[:, :, q0:q1] = _attend(q[:, :, q0:q1], k, v, vis, scale, softcap, edits, backend)
        else:
            mk, mv, count = _compensation(comp, split, own_q[:, q0:q1], q0, q1, sink, window)
            out[:, :, q0:q1] = _attend_compensated(q[:, :, q0:q1], k, v, vis, mk, mv, count > 0, scale, softcap,
                                                   edits)
    return out


def _prefix_sums(split: SplitCall, own_q: Tensor, sink: int) -> tuple[Tensor, Tensor]:
    """Prefix sums over the chunk of the keys and values a compensation token may fold (own positions
    ``>= sink``; padding excluded): ``[B, Hc, Nq + 1, D]`` float32, entry ``i`` the sum over chunk indices
    ``< i`` (what earlier chunks dropped comes from the cache, :func:`_compensation`)."""
    keep = (own_q >= sink)[:, None, :, None]
    out = []
    for t in (split.chunk_keys, split.chunk_values):
        summed = torch.cumsum(t.float() * keep, dim=2)
        out.append(torch.cat([summed.new_zeros(*summed.shape[:2], 1, summed.shape[3]), summed], dim=2))
    return out[0], out[1]


def _compensation(comp: tuple[Tensor, Tensor], split: SplitCall, own_q: Tensor, q0: int, q1: int, sink: int,
                  window: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per query of the block ``[q0, q1)``: the mean key and value (B, Hc, n, D) of the keys it no longer sees
    (own positions ``sink <= k <= q - window``) and their number (B, n). For a chunk after earlier tokens
    those are the cache's sums before the chunk (every position ``< n0 - window``, ``n0`` the row's tokens
    before the chunk), the ring tokens before the chunk that leave the query's window, and the chunk's own
    prefix."""
    end = (torch.arange(q0, q1, device=own_q.device) - window + 1).clamp(min=0)  # chunk indices < end dropped
    count = (own_q - window + 1 - sink).clamp(min=0)
    scale = 1.0 / count.clamp(min=1).to(torch.float32)[:, None, :, None]
    pk, pv = comp
    mk, mv = pk.index_select(2, end), pv.index_select(2, end)
    if split.prior_comp is not None:
        _, _, pos = split.prior
        left = ((pos[:, None, :] >= sink) & (pos[:, None, :] <= (own_q - window)[:, :, None])).float()  # (B, n, L)
        mk = mk + split.prior_comp[0] + torch.einsum("bnl,bhld->bhnd", left, split.prior[0].float())
        mv = mv + split.prior_comp[1] + torch.einsum("bnl,bhld->bhnd", left, split.prior[1].float())
    return mk * scale, mv * scale, count


def _attend_compensated(q: Tensor, k: Tensor, v: Tensor, vis: Tensor, mk: Tensor, mv: Tensor, has: Tensor,
                        scale: float, softcap: float | None, edits: HeadEdits | None) -> Tensor:
    """Attention of ``q`` (B, Hc*g, n, D) over the shared keys ``k`` (B, Hc, L, D) under ``vis`` (B, n, L) plus one
    compensation key per query (``mk``/``mv`` (B, Hc, n, D), present where ``has`` (B, n)), in one softmax
    (float32; the block is bounded by the caller)."""
    B, Hq, n, D = q.shape
    Hc = k.shape[1]
    g = Hq // Hc
    qf = q.float()
    if edits is not None and edits.q_scale is not None:
        qf = qf * edits.q_scale[:, :, None, None]
    qg = qf.view(B, Hc, g, n, D)
    s = torch.einsum("bhgnd,bhld->bhgnl", qg, k.float()) * scale
    sc = torch.einsum("bhgnd,bhnd->bhgn", qg, mk)[..., None] * scale
    s = torch.cat([s, sc], -1)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if edits is not None and edits.score_zero is not None:
        s = s.masked_fill(edits.score_zero.view(B, Hc, g, 1, 1), 0.0)
    seen = torch.cat([vis, has[:, :, None]], -1)[:, None, None]
    s = s.masked_fill(~seen, -torch.inf)
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros((), device=m.device)))
    total = p.sum(-1, keepdim=True)
    p = p / torch.where(total > 0, total, torch.ones((), device=total.device))
    L = k.shape[2]
    z = torch.einsum("bhgnl,bhld->bhgnd", p[..., :L], v.float()) + p[..., L:] * mv[:, :, None]
    z = z.reshape(B, Hq, n, -1)
    if edits is not None and edits.out_scale is not None:
        z = z * edits.out_scale[:, :, None, None]
    return z.to(q.dtype)


def _attend(q: Tensor, k: Tensor, v: Tensor, vis: Tensor, scale: float, softcap: float | None,
            edits: HeadEdits | None, backend: str) -> Tensor:
    """Attention of queries ``q`` over keys ``k`` under the boolean visibility ``vis`` (B, n, L)."""
    return kernel_attention(q, k, v, edits=edits, scale=scale, softcap=softcap, causal=False,
                            attn_mask=vis[:, None], backend=backend)[0]
