"""The attention function headlab registers with transformers (:func:`attention_forward`).

One call goes through named steps, each owning one translation:

- :func:`_call_of`: the module and transformers' arguments -> the layer (``Session.layer_of``), the call's
  mask semantics (causal, window, softcap) and its :class:`~headlab.instrument.positions.CallPositions`
  (absolute positions <-> query rows and key slots; the only place positions are converted);
- :func:`_request`: the plan -> :class:`headlab.kernels.HeadEdits` and :class:`headlab.kernels.ProbeRequest`
  in kernel coordinates (the plan's batch rows -> the call's rows is the session's, under a shared trunk);
- :func:`_native` (transformers' SDPA) or :func:`headlab.kernels.attention`: the computation;
- ``Session.replace_kv``: the key/value replacements, before any path reads the keys and values;
- :func:`_apply_callbacks`, ``Session.replace_z`` and :func:`_record`: the layer callbacks, the head output
  replacements (after the kernel or the native SDPA call, so the same on every path) and the recording, back
  in absolute positions;
- :func:`_to_model_layout`: the kernel's (B, H, Nq, D) head outputs -> transformers' (B, Nq, H, D).

A call over a :class:`headlab.kv.HeadwiseCache` with compressed heads (:func:`headlab.kv.split_call`) is
computed by :func:`.kv_split.split_attention` instead (each group over its own keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from headlab.kernels import HeadEdits, ProbeRequest, choose_backend, needs_grad
from headlab.kernels import attention as kernel_attention
from headlab.kv.split import split_call

from .kv_split import split_attention
from .layers import REFUSED_KWARGS, UnsupportedModelError
from .masks import kernel_mask_args
from .plan import LayerContext, Plan
from .positions import CallPositions
from .session import Session, active_session

__all__ = ["attention_forward"]


@dataclass
class _Call:
    """One call of an attention module, as the kernels see it.

    ``key``/``value`` are what the kernels attend over (empty static-cache slots after a prefill cropped);
    ``layer`` is ``None`` outside an instrument context or for a module it does not know; ``plan`` is the
    session's plan when it touches the layer, else ``None``."""

    module: torch.nn.Module
    session: Session | None
    layer: int | None
    plan: Plan | None
    query: Tensor
    key: Tensor
    value: Tensor
    causal: bool
    window: int | None
    softcap: float | None
    pos: CallPositions

    @property
    def batch(self) -> int:
        return int(self.query.shape[0])

    @property
    def heads(self) -> int:
        return int(self.query.shape[1])


@dataclass
class _Request:
    """What the plan asks of the kernels on one call: ``edits``/``probes`` in kernel coordinates,
    ``pair_pos`` the probed pairs in absolute positions, ``reads_z`` whether the head outputs are read
    (recorded or handed to callbacks)."""

    edits: HeadEdits | None = None
    probes: ProbeRequest | None = None
    pair_pos: Tensor | None = None
    reads_z: bool = False


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """headlab's attention implementation (``AttentionInterface`` signature).

    query (B, H, Nq, D), key/value (B, Hkv, Nk, D) -> (attn_output (B, Nq, H, D), None). Keys a
    :class:`headlab.kv.HeadwiseCache` with compressed heads returned go to :func:`.kv_split.split_attention`.
    """
    split = split_call(key)
    if split is not None:
        sess = active_session()
        layer = None if sess is None else sess.layer_of.get(id(module))
        z = split_attention(module, query, key, value, attention_mask, scaling, kwargs, split, sess, layer)
        return _to_model_layout(z), None
    call = _call_of(module, query, key, value, attention_mask, dropout, kwargs)
    if call.plan is not None:  # key/value replacements, before any path reads them
        key, value = call.session.replace_kv(call.layer, key, value, call.pos)
        call.key, call.value = key[:, :, :call.key.shape[2]], value[:, :, :call.value.shape[2]]
        query = call.query = call.session.replace_q(call.layer, query, call.pos)
    request = _request(call)
    backend, reason = choose_backend("auto" if call.plan is None else call.plan.backend, edits=request.edits,
                                     probes=request.probes, softcap=call.softcap, device=query.device,
                                     native=True, reads_outputs=request.reads_z,
                                     grad=needs_grad(query, key, value))
    if call.layer is not None:
        call.session.rec.backends[call.layer] = (backend, reason)
    if backend == "native":
        out = _native(module, query, key, value, attention_mask, dropout, scaling, kwargs, request.edits)
        if call.plan is not None:
            z = out.transpose(1, 2)
            replaced = call.session.replace_z(call.layer, z, call.pos)
            out = out if replaced is z else replaced.transpose(1, 2).contiguous()
        _advance(call)
        return out, None

    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    margs = _mask_args(call, attention_mask)
    z, stats = kernel_attention(call.query, call.key, call.value, edits=request.edits, probes=request.probes,
                                scale=scale, softcap=call.softcap, **margs, backend=backend)
    if call.plan is not None:
        z = _apply_callbacks(call, request, z, scale, margs)
        z = call.session.replace_z(call.layer, z, call.pos)
        if request.probes is not None:
            _record(call, request, stats, z)
    _advance(call)
    return _to_model_layout(z), None


def _call_of(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
             attention_mask: Tensor | None, dropout: float, kwargs: dict[str, Any]) -> _Call:
    """The call's layer, plan, mask semantics and positions; refuses what the kernels cannot honour."""
    sess = active_session()
    layer = None if sess is None else sess.layer_of.get(id(module))
    softcap = kwargs.get("softcap")
    if softcap is None and getattr(module, "config", None) is not None and layer is not None:
        softcap = getattr(module.config, "attn_logit_softcapping", None)
    for name in REFUSED_KWARGS:
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(
                f"headlab: attention with `{name}` ({type(module).__name__}) is not supported; load the model "
                "with another attn_implementation")
    plan = sess.plan if layer is not None and sess.plan.touches(layer) else None
    if dropout and module.training and plan is not None:
        raise UnsupportedModelError("headlab: attention dropout is not supported inside instrument()")
    Nq, Nk = query.shape[2], key.shape[2]
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    if window is not None and window <= 0:
        window = None
    if attention_mask is None and causal and 1 < Nq < Nk:
        # empty static-cache slots after a prefill (sdpa crops them the same way)
        key, value, Nk = key[:, :, :Nq], value[:, :, :Nq], Nq
    pos = CallPositions.of(0, Nq, Nk) if layer is None else sess.positions(layer, Nq, Nk)
    return _Call(module, sess, layer, plan, query, key, value, causal, window, softcap, pos)


def _request(call: _Call) -> _Request:
    """The plan's edits and probes on the call's layer, in kernel coordinates."""
    plan, sess, layer = call.plan, call.session, call.layer
    if plan is None:
        return _Request()
    B, H, device, pos = call.batch, call.heads, call.query.device, call.pos
    request = _Request(edits=HeadEdits(**sess.edits_for(layer, B, H, pos, device)), reads_z=bool(plan.callbacks))
    p = plan.probes
    if p.covers(layer):
        request.pair_pos = sess.probe_pairs(B, pos, device)
        request.probes = ProbeRequest(p.argmax, p.entropy, sess.probe_spans(B, pos, device),
                                      sess.probe_offsets(B, pos, device), p.pattern,
                                      None if request.pair_pos is None else pos.pairs(request.pair_pos))
        request.reads_z = (request.reads_z or p.z_positions is not None or p.kv_positions is not None
                           or p.q_positions is not None)
    return request


def _native(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
            dropout: float, scaling: float | None, kwargs: dict[str, Any], edits: HeadEdits | None) -> Tensor:
    """Exactly the SDPA call of ``attn_implementation="sdpa"`` (the model's own arguments, uncropped), with
    the query / output scales of ``edits`` around it; (B, Nq, H, D)."""
    if edits is not None and edits.q_scale is not None:
        query = query * edits.q_scale[:, :, None, None].to(query.dtype)
    out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                    scaling=scaling, **kwargs)
    if edits is not None and edits.out_scale is not None:
        out = out * edits.out_scale[:, None, :, None].to(out.dtype)
    return out


def _mask_args(call: _Call, attention_mask: Tensor | None) -> dict:
    """The kernel's mask arguments for the call (cached by the session on an instrumented layer)."""
    Nq, Nk = call.pos.n_queries, call.pos.n_keys
    if call.layer is None:
        return kernel_mask_args(attention_mask, Nq, Nk, call.causal, call.window)
    return call.session.mask_args(attention_mask, Nq, Nk, call.causal, call.window)


def _apply_callbacks(call: _Call, request: _Request, z: Tensor, scale: float, margs: dict) -> Tensor:
    """Run the plan's layer callbacks on the head outputs ``z`` (B, H, Nq, D); a scale one returns multiplies
    ``z`` and is kept for the layer's later calls."""
    callbacks = call.plan.callbacks
    if not callbacks:
        return z
    sess, layer, pos, B, H = call.session, call.layer, call.pos, call.batch, call.heads
    device = call.query.device

    def attend(key_spans: Tensor, key_bias: Tensor) -> Tensor:
        ks = pos.key_spans(torch.as_tensor(key_spans, device=device).long())
        kb = torch.broadcast_to(torch.as_tensor(key_bias, device=device, dtype=torch.float32), (B, H, ks.shape[1]))
        return kernel_attention(call.query, call.key, call.value, edits=request.edits.plus_key_bias(ks, kb),
                                scale=scale, softcap=call.softcap, **margs, backend=call.plan.backend)[0]

    ctx = LayerContext(layer=layer, call=sess.calls.get(layer, 0), q_start=pos.q_start, n_queries=pos.n_queries,
                       store=sess.store, attend=attend)
    for fn in callbacks:
        factor = fn(layer, z, ctx)
        if factor is not None:
            factor = torch.broadcast_to(torch.as_tensor(factor, device=z.device, dtype=torch.float32), (B, H))
            sess.cb_scale[layer] = factor.clone()
            z = (z.float() * factor[:, :, None, None]).to(z.dtype)
    return z


def _record(call: _Call, request: _Request, stats: Any, z: Tensor) -> None:
    """Add the call's probe results to the recording, in absolute positions."""
    sess, layer, pos, probes = call.session, call.layer, call.pos, request.probes
    rec = sess.rec
    if probes.argmax:
        rec._add("argmax", layer, pos.absolute_keys(stats.argmax))
        rec._add("argmax_prob", layer, stats.argmax_prob)
    if probes.entropy:
        rec._add("entropy", layer, stats.entropy)
    if probes.spans is not None:
        rec._add("span_mass", layer, stats.span_mass)
    if probes.offsets is not None:
        rec._add("offset_mass", layer, stats.offset_mass)
    if probes.pairs is not None:
        rec._add("pair_mass", layer, stats.pair_mass)
        rec._add_pair_positions(layer, request.pair_pos.cpu())
    if probes.pattern:
        rec._add("pattern", layer, pos.absolute_pattern(stats.pattern))
    zp = call.plan.probes.z_positions
    if zp is not None:
        qpos = pos.query_positions(z.device)
        if zp == "last":
            keep = qpos == pos.q_start + pos.n_queries - 1
        elif zp == "all":
            keep = torch.ones_like(qpos, dtype=torch.bool)
        else:
            keep = torch.isin(qpos, torch.as_tensor(list(zp), device=z.device))
        rec._add("z", layer, z[:, :, keep])
        rec._add_z_positions(layer, qpos[keep].cpu())
    qp = call.plan.probes.q_positions
    if qp is not None:  # the queries as attention read them
        qpos = pos.query_positions(call.query.device)
        keep = torch.ones_like(qpos, dtype=torch.bool) if qp == "all" else \
            torch.isin(qpos, torch.as_tensor(list(qp), device=qpos.device))
        rec._add("q", layer, call.query[:, :, keep])
        rec._add_q_positions(layer, qpos[keep].cpu())
    kvp = call.plan.probes.kv_positions
    if kvp is not None:  # the keys and values of the call's own queries
        qpos = pos.query_positions(call.key.device)
        keep = torch.ones_like(qpos, dtype=torch.bool) if kvp == "all" else \
            torch.isin(qpos, torch.as_tensor(list(kvp), device=qpos.device))
        slots = qpos[keep] - pos.key_offset
        rec._add("k", layer, call.key[:, :, slots])
        rec._add("v", layer, call.value[:, :, slots])
        rec._add_kv_positions(layer, qpos[keep].cpu())
    if layer == sess.probe_layers[0]:
        rec.calls += 1


def _advance(call: _Call) -> None:
    if call.layer is not None:
        call.session.advance(call.layer, call.pos.n_queries)


def _to_model_layout(z: Tensor) -> Tensor:
    """Kernel head outputs (B, H, Nq, D) as transformers' attention output (B, Nq, H, D)."""
    return z.transpose(1, 2).contiguous()
