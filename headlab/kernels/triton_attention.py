"""FlashAttention-2-style Triton kernel with head edits and streaming probes.

Laid out like Triton's fused-attention tutorial: :func:`_attn_fwd` is one program per (``BLK.M`` queries,
batch row, query head); it loads its query tile and per-head edits, then :func:`_attn_fwd_inner` walks the
visible key tiles with an online softmax, and an epilogue writes the results. In the same pass the kernel
applies the edits (query scale, score zeroing, additive key-span biases, softcap, causal / window / padding /
general masks; :func:`_scores`, with the device functions :func:`_softcap` and :func:`_visible` that the pair
kernel :func:`_pair_fwd` shares) and accumulates the probes:

- argmax: running maximum score and its key index (strictly greater wins, so the first key on ties);
- entropy: ``F = sum_j p_j (s_j - m)`` rescaled when the running max ``m`` moves, ``H = log l - F / l``;
- span masses: ``sum_j p_j [j in span]`` as a (BLK.M, BLK.P) accumulator, rescaled like the output;
- offset masses: ``p_j`` at the key ``j = q_pos - delta`` for each probe offset ``delta``, a
  (BLK.M, BLK.O) accumulator rescaled like the span masses (an offset touches at most two key tiles of
  a query block; the others are skipped).

The full pattern, when asked, is written by a second sweep over the key tiles (:func:`_write_pattern`) once
``m`` and ``l`` are final.

Decoding (few queries, long key cache) splits the key axis over extra programs (flash-decoding); each split
writes its partial statistics (:func:`_store_partials`) and :func:`_combine` merges them in torch.

Tiles are addressed with pointer arithmetic (:func:`_tile`: the pointers of a 2-D block and its
in-bounds mask), not block pointers: ``tl.make_block_ptr`` raises ``NotImplementedError`` in triton 3.9
("removed in favor of the tensor descriptor API"), compiled and under the interpreter alike, and tensor
descriptors need 16-byte-aligned strides (asserted by the interpreter too), which these inputs do not
guarantee (int8 masks with ``Nk``-byte rows, stride-0 broadcast masks, ``P``-column probe buffers, head
dims whose rows are not a multiple of 16 bytes), and their device-side form needs a global allocator on
Hopper.

Arguments travel bundled in the named tuples of :mod:`.triton_args`:
:class:`Strides`, :class:`Edits`, :class:`Masks`, :class:`Probes`, :class:`Dims`, :class:`Pairs`, and the
``tl.constexpr`` ones :class:`ScoreFlags`, :class:`OutputFlags` and :class:`Blocks`, whose fields compile
code in or out. The host side is :func:`triton_attention`: :func:`_launch_plan` (tiles, key splits),
:func:`_inputs`, :func:`_buffers`, :func:`_launch_forward`, :func:`_stats` and :func:`_pair_masses`.

Runs on CUDA, and on CPU under ``TRITON_INTERPRET=1`` (set before triton is imported).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .contract import AttentionStats, HeadEdits, ProbeRequest, flat_pairs
from .triton_args import Blocks, Dims, Edits, Masks, OutputFlags, Pairs, Probes, ScoreFlags, Strides

__all__ = ["triton_attention"]


# --------------------------------------------------------------------------- device functions
@triton.jit
def _tile(base, rows, cols, stride_r, stride_c, n_rows, n_cols):
    """Pointers to the block ``base[rows, cols]`` of an (n_rows, n_cols) strided matrix and the mask of its
    in-bounds elements (what a block pointer with a boundary check describes)."""
    ptrs = base + rows[:, None] * stride_r + cols[None, :] * stride_c
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return ptrs, mask


@triton.jit
def _load_spans(SPAN, b, n_spans, BLOCK: tl.constexpr):
    """``[start, end)`` of the (B, n_spans, 2) spans of row ``b`` as two (BLOCK,) vectors; unused slots are
    the empty span ``[0, 0)``."""
    offs = tl.arange(0, BLOCK)
    used = offs < n_spans
    start = tl.load(SPAN + b * n_spans * 2 + offs * 2, mask=used, other=0)
    end = tl.load(SPAN + b * n_spans * 2 + offs * 2 + 1, mask=used, other=0)
    return start, end


@triton.jit
def _softcap(s, softcap):
    """``softcap * tanh(s / softcap)`` (Gemma 2), with one ``exp`` of a non-positive argument (no overflow)."""
    x = s / softcap
    t = tl.exp(-2.0 * tl.abs(x))
    th = (1.0 - t) / (1.0 + t)
    return softcap * tl.where(x < 0, -th, th)


@triton.jit
def _visible(valid, q_pos, k_pos, window, SF: tl.constexpr):
    """``valid`` and the causal / window visibility of the key at ``k_pos`` to the query at ``q_pos`` (key
    coordinates, broadcast against each other)."""
    if SF.CAUSAL:
        valid = valid & (k_pos <= q_pos)
    if SF.HAS_WINDOW:
        valid = valid & ((q_pos - k_pos) < window)
        if not SF.CAUSAL:
            valid = valid & ((k_pos - q_pos) < window)
    return valid


@triton.jit
def _key_range(pid_m, pid_s, dims, window, split_len, SF: tl.constexpr, OF: tl.constexpr, BLK: tl.constexpr):
    """Key range ``[lo, hi)`` a query block can see (and, split, the part of it this split owns), and the
    key coordinates of the block's first and last query."""
    Nq, Nk = dims.Nq, dims.Nk
    m_first = pid_m * BLK.M + (Nk - Nq)
    m_last = tl.minimum(pid_m * BLK.M + BLK.M - 1, Nq - 1) + (Nk - Nq)
    lo = 0
    hi = Nk
    if SF.CAUSAL:
        hi = tl.minimum(Nk, m_last + 1)
    if SF.HAS_WINDOW:
        lo = tl.maximum(0, m_first - window + 1)
        if not SF.CAUSAL:
            hi = tl.minimum(Nk, m_last + window)
    if OF.SPLIT:
        lo = tl.maximum(lo, pid_s * split_len)
        hi = tl.minimum(hi, pid_s * split_len + split_len)
    return lo, hi, m_first, m_last


@triton.jit
def _head_edits(edits, b, h, dims, SF: tl.constexpr, BLK: tl.constexpr):
    """The edits of one (row ``b``, head ``h``): query multiplier, score-zero flag, and the ``[start, end)``
    key spans with their biases as (BLK.S,) vectors."""
    qmul = tl.load(edits.QMUL + b * dims.H + h)
    sz = 0
    if SF.HAS_SZ:
        sz = tl.load(edits.SZ + b * dims.H + h)
    ks_start = tl.arange(0, BLK.S)
    ks_end = ks_start
    kb_vals = tl.zeros([BLK.S], dtype=tl.float32)
    if SF.HAS_KB:
        ks_start, ks_end = _load_spans(edits.KSPAN, b, dims.NKS, BLK.S)
        offs_s = tl.arange(0, BLK.S)
        kb_vals = tl.load(edits.KBIAS + (b * dims.H + h) * dims.NKS + offs_s, mask=offs_s < dims.NKS, other=0.0)
    return qmul, sz, ks_start, ks_end, kb_vals


@triton.jit
def _scores(head, kv, strides, offs_m, offs_n, offs_d, q_abs, n_end, dims, softcap, window, SF: tl.constexpr):
    """Edited scores ``s`` (BLK.M, BLK.N) of the key tile ``offs_n`` (keys ``>= n_end`` are outside) and the
    visibility mask; invisible scores are ``-inf``. ``head``: the query tile and its head's edits; ``kv``:
    this (row, head)'s keys, values and masks."""
    q, qmul, sz, ks_start, ks_end, kb_vals = head
    K_head, V_head, KPM_row, AM_head = kv
    kt_ptrs, kt_mask = _tile(K_head, offs_d, offs_n, strides.k[3], strides.k[2], dims.D, n_end)
    kt = tl.load(kt_ptrs, mask=kt_mask, other=0.0)  # K^T: (BLOCK_D, BLOCK_N)
    if SF.IEEE:
        s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    s = s * qmul
    if SF.HAS_SOFTCAP:
        s = _softcap(s, softcap)
    if SF.HAS_SZ:
        s = tl.where(sz != 0, 0.0, s)
    if SF.HAS_KB:
        ins = (offs_n[:, None] >= ks_start[None, :]) & (offs_n[:, None] < ks_end[None, :])
        kbv = tl.sum(tl.where(ins, kb_vals[None, :], 0.0), axis=1)
        s = s + kbv[None, :]
    kmask = offs_n < n_end
    valid = _visible(kmask[None, :] & (offs_m[:, None] >= 0), q_abs[:, None], offs_n[None, :], window, SF)
    if SF.HAS_KPM:
        kp = tl.load(KPM_row + offs_n, mask=kmask, other=0)
        valid = valid & (kp != 0)[None, :]
    if SF.HAS_AM:
        # rows past the last query read as masked (they are never stored)
        am_ptrs, am_mask = _tile(AM_head, offs_m, offs_n, strides.am[2], strides.am[3], dims.Nq, n_end)
        am = tl.load(am_ptrs, mask=am_mask, other=0)
        valid = valid & (am != 0)
    s = tl.where(valid, s, float("-inf"))
    return s, valid


@triton.jit
def _attn_fwd_inner(
    state, head, kv, pspan, POFF_row, strides, offs_m, offs_d, q_abs, m_first, m_last, lo, hi, dims, softcap,
    window, SF: tl.constexpr, OF: tl.constexpr, BLK: tl.constexpr,
):
    """Online softmax over the key tiles ``[lo, hi)``: the running state ``(m_i, l_i, f_i, acc, best_s, best_i,
    sacc, oacc)``, rescaled as the running max ``m_i`` moves, updated. ``pspan``: the probe spans' ``[start,
    end)``; ``POFF_row``: this row's probe offsets."""
    m_i, l_i, f_i, acc, best_s, best_i, sacc, oacc = state
    ps_start, ps_end = pspan
    V_head = kv[1]
    offs_dv = tl.arange(0, BLK.DV)
    offs_o = tl.arange(0, BLK.O)
    n_end = tl.minimum(dims.Nk, hi)
    for start in range(lo, hi, BLK.N):
        offs_n = start + tl.arange(0, BLK.N)
        s, valid = _scores(head, kv, strides, offs_m, offs_n, offs_d, q_abs, n_end, dims, softcap, window, SF)
        tile_max = tl.max(s, axis=1)
        m_new = tl.maximum(m_i, tile_max)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        if OF.PROBE_ENT:
            m_old = tl.where(m_i == float("-inf"), m_safe, m_i)
            d = tl.where(valid, s - m_safe[:, None], 0.0)
            f_i = alpha * (f_i + l_i * (m_old - m_safe)) + tl.sum(p * d, axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_ptrs, v_mask = _tile(V_head, offs_n, offs_dv, strides.v[2], strides.v[3], dims.Nk, dims.Dv)
        vt = tl.load(v_ptrs, mask=v_mask, other=0.0)
        if SF.IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, vt.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        if OF.PROBE_ARGMAX:
            tidx = tl.argmax(s, axis=1).to(tl.int32) + start
            upd = tile_max > best_s
            best_s = tl.where(upd, tile_max, best_s)
            best_i = tl.where(upd, tidx, best_i)
        if OF.HAS_PS:
            pin = ((offs_n[:, None] >= ps_start[None, :]) & (offs_n[:, None] < ps_end[None, :])).to(tl.float32)
            sacc = sacc * alpha[:, None] + tl.dot(p, pin, input_precision="ieee")
        if OF.HAS_PO:
            oacc = oacc * alpha[:, None]
            rel = q_abs[:, None] - offs_n[None, :]  # query position - key position
            for o in range(0, dims.NOS):
                dlt = tl.load(POFF_row + o)
                # the keys q_pos - dlt of this query block lie in [m_first - dlt, m_last - dlt]
                if (dlt >= 0) & (start <= m_last - dlt) & (start + BLK.N > m_first - dlt):
                    hit = tl.sum(tl.where(rel == dlt, p, 0.0), axis=1)
                    oacc = oacc + tl.where(offs_o[None, :] == o, hit[:, None], 0.0)
        m_i = m_new
    return m_i, l_i, f_i, acc, best_s, best_i, sacc, oacc


@triton.jit
def _write_pattern(
    PAT_rows, m_i, l_safe, empty, head, kv, strides, offs_m, offs_d, q_abs, lo, hi, dims, softcap, window,
    SF: tl.constexpr, BLK: tl.constexpr,
):
    """Second sweep over the key tiles: the normalised attention ``exp(s - m) / l`` into the (Nq, Nk)
    pattern rows ``PAT_rows`` of this (row, head)."""
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    inv = tl.where(empty, 0.0, 1.0 / l_safe)
    n_end = tl.minimum(dims.Nk, hi)
    for start in range(lo, hi, BLK.N):
        offs_n = start + tl.arange(0, BLK.N)
        s, valid = _scores(head, kv, strides, offs_m, offs_n, offs_d, q_abs, n_end, dims, softcap, window, SF)
        a = tl.exp(s - m_safe[:, None]) * inv[:, None]
        ptrs, mask = _tile(PAT_rows, offs_m, offs_n, dims.Nk, 1, dims.Nq, n_end)
        tl.store(ptrs, a, mask=mask)


@triton.jit
def _store_partials(row0, offs_m, state, probes, dims, OF: tl.constexpr, BLK: tl.constexpr):
    """A key split's unnormalised state, rows ``row0 + offs_m`` of the (n_split * B * H * Nq, ...) buffers."""
    m_i, l_i, f_i, acc, best_s, best_i, sacc, oacc = state
    Nq, Dv, NPS, NOS = dims.Nq, dims.Dv, dims.NPS, dims.NOS
    mrow = offs_m < Nq
    prow = row0 + offs_m
    tl.store(probes.ML + prow * 2, m_i, mask=mrow)
    tl.store(probes.ML + prow * 2 + 1, l_i, mask=mrow)
    tl.store(probes.FENT + prow, f_i, mask=mrow)
    ptrs, mask = _tile(probes.ACC + row0 * Dv, offs_m, tl.arange(0, BLK.DV), Dv, 1, Nq, Dv)
    tl.store(ptrs, acc, mask=mask)
    if OF.PROBE_ARGMAX:
        tl.store(probes.ARGS + prow, best_s, mask=mrow)
        tl.store(probes.ARGI + prow, best_i, mask=mrow)
    if OF.HAS_PS:
        ptrs, mask = _tile(probes.SPM + row0 * NPS, offs_m, tl.arange(0, BLK.P), NPS, 1, Nq, NPS)
        tl.store(ptrs, sacc, mask=mask)
    if OF.HAS_PO:
        ptrs, mask = _tile(probes.OFM + row0 * NOS, offs_m, tl.arange(0, BLK.O), NOS, 1, Nq, NOS)
        tl.store(ptrs, oacc, mask=mask)


@triton.jit
def _store_results(
    row0, offs_m, state, l_safe, empty, osc, Out_head, strides, probes, dims, OF: tl.constexpr, BLK: tl.constexpr,
):
    """Normalised output ``z`` (times the output scale ``osc``) and probes, rows ``row0 + offs_m`` of the
    (B * H * Nq, ...) probe buffers."""
    m_i, l_i, f_i, acc, best_s, best_i, sacc, oacc = state
    Nq, Dv, NPS, NOS = dims.Nq, dims.Dv, dims.NPS, dims.NOS
    mrow = offs_m < Nq
    row = row0 + offs_m
    o = acc / l_safe[:, None]
    if OF.HAS_OS:
        o = o * osc
    ptrs, mask = _tile(Out_head, offs_m, tl.arange(0, BLK.DV), strides.o[2], strides.o[3], Nq, Dv)
    tl.store(ptrs, o.to(Out_head.dtype.element_ty), mask=mask)
    if OF.PROBE_ARGMAX:
        tl.store(probes.ARGI + row, tl.where(empty, -1, best_i), mask=mrow)
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        tl.store(probes.ARGS + row, tl.where(empty, 0.0, tl.exp(best_s - m_safe) / l_safe), mask=mrow)
    if OF.PROBE_ENT:
        ent = tl.where(empty, 0.0, tl.log(l_safe) - f_i / l_safe)
        tl.store(probes.FENT + row, ent, mask=mrow)
    if OF.HAS_PS:
        ptrs, mask = _tile(probes.SPM + row0 * NPS, offs_m, tl.arange(0, BLK.P), NPS, 1, Nq, NPS)
        tl.store(ptrs, sacc / l_safe[:, None], mask=mask)
    if OF.HAS_PO:
        ptrs, mask = _tile(probes.OFM + row0 * NOS, offs_m, tl.arange(0, BLK.O), NOS, 1, Nq, NOS)
        tl.store(ptrs, oacc / l_safe[:, None], mask=mask)


@triton.jit
def _attn_fwd(
    Q, K, V, Out,  # q (B, H, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv), out (B, H, Nq, Dv)
    strides,       # Strides
    edits,         # Edits
    masks,         # Masks
    probes,        # Probes: inputs and per-row buffers
    dims,          # Dims
    softcap, window, split_len,
    SF: tl.constexpr,   # ScoreFlags
    OF: tl.constexpr,   # OutputFlags
    BLK: tl.constexpr,  # Blocks
):
    """One program: ``BLK.M`` queries of one (batch row, query head), one key split (axis 2)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    H, Nq, Nk = dims.H, dims.Nq, dims.Nk
    b = pid_bh // H
    h = pid_bh % H
    hk = h // dims.G  # the kv head this query head reads
    offs_m = pid_m * BLK.M + tl.arange(0, BLK.M)
    offs_d = tl.arange(0, BLK.D)
    q_abs = offs_m + (Nk - Nq)  # the queries' own key coordinates

    # this program's query tile and the edits of its (row, head)
    q_str = strides.q
    q_ptrs, q_mask = _tile(Q + b * q_str[0] + h * q_str[1], offs_m, offs_d, q_str[2], q_str[3], Nq, dims.D)
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    if SF.IEEE:
        q = q.to(tl.float32)
    qmul, sz, ks_start, ks_end, kb_vals = _head_edits(edits, b, h, dims, SF, BLK)
    head = (q, qmul, sz, ks_start, ks_end, kb_vals)
    ps_start = tl.arange(0, BLK.P)
    ps_end = ps_start
    if OF.HAS_PS:
        ps_start, ps_end = _load_spans(probes.PSPAN, b, dims.NPS, BLK.P)

    # the keys, values and masks of this (row, head)
    kv = (K + b * strides.k[0] + hk * strides.k[1], V + b * strides.v[0] + hk * strides.v[1],
          masks.KPM + b * strides.kpm, masks.AM + b * strides.am[0] + h * strides.am[1])
    lo, hi, m_first, m_last = _key_range(pid_m, pid_s, dims, window, split_len, SF, OF, BLK)

    m_i = tl.full([BLK.M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLK.M], dtype=tl.float32)
    f_i = tl.zeros([BLK.M], dtype=tl.float32)
    acc = tl.zeros([BLK.M, BLK.DV], dtype=tl.float32)
    best_s = tl.full([BLK.M], float("-inf"), dtype=tl.float32)
    best_i = tl.full([BLK.M], -1, dtype=tl.int32)
    sacc = tl.zeros([BLK.M, BLK.P], dtype=tl.float32)
    oacc = tl.zeros([BLK.M, BLK.O], dtype=tl.float32)
    state = _attn_fwd_inner(
        (m_i, l_i, f_i, acc, best_s, best_i, sacc, oacc), head, kv, (ps_start, ps_end),
        probes.POFF + b * dims.NOS, strides, offs_m, offs_d, q_abs, m_first, m_last, lo, hi, dims, softcap, window,
        SF, OF, BLK,
    )

    row0 = (b * H + h) * Nq  # first row of this (row, head) in the (B * H * Nq, ...) probe buffers
    if OF.SPLIT:
        _store_partials(pid_s * (tl.num_programs(1) * Nq) + row0, offs_m, state, probes, dims, OF, BLK)
    else:
        m_i, l_i = state[0], state[1]
        if OF.STORE_ML:  # the rows' final max and normaliser, for the pair kernel
            mrow = offs_m < Nq
            tl.store(probes.ML + (row0 + offs_m) * 2, m_i, mask=mrow)
            tl.store(probes.ML + (row0 + offs_m) * 2 + 1, l_i, mask=mrow)
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        osc = 1.0
        if OF.HAS_OS:
            osc = tl.load(edits.OSC + b * H + h)
        _store_results(row0, offs_m, state, l_safe, empty, osc, Out + b * strides.o[0] + h * strides.o[1], strides,
                       probes, dims, OF, BLK)
        if OF.RETURN_PATTERN:
            _write_pattern(probes.PAT + row0 * Nk, m_i, l_safe, empty, head, kv, strides, offs_m, offs_d, q_abs,
                           lo, hi, dims, softcap, window, SF, BLK)


@triton.jit
def _pair_fwd(
    Q, K,          # q (B, H, Nq, D), k (B, Hkv, Nk, D)
    strides,       # Strides
    pairs,         # Pairs
    edits,         # Edits (the output scales are not read)
    masks,         # Masks
    ML,            # (B * H * Nq, 2) the rows' final max and normaliser
    OUT,           # (B, H, slots) pair masses
    dims,          # Dims
    softcap, window,
    SF: tl.constexpr,  # ScoreFlags
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``BLOCK`` pairs of one query head: the edited, masked score ``s`` of each pair, then
    ``A = exp(s - m) / l`` with the row's final ``m``, ``l`` (so exactly the softmax of the forward pass)."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    H, Nq, Nk, NKS = dims.H, dims.Nq, dims.Nk, dims.NKS
    q_str, k_str, am_str = strides.q, strides.k, strides.am
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    live = offs < pairs.n
    b = tl.load(pairs.FB + offs, mask=live, other=0)
    i = tl.load(pairs.FQ + offs, mask=live, other=0)
    j = tl.load(pairs.FK + offs, mask=live, other=0)
    slot = tl.load(pairs.FP + offs, mask=live, other=0)
    hk = h // dims.G
    offs_d = tl.arange(0, BLOCK_D)
    dmask = live[:, None] & (offs_d[None, :] < dims.D)
    qv = tl.load(Q + b[:, None] * q_str[0] + h * q_str[1] + i[:, None] * q_str[2] + offs_d[None, :] * q_str[3],
                 mask=dmask, other=0.0).to(tl.float32)
    kvec = tl.load(K + b[:, None] * k_str[0] + hk * k_str[1] + j[:, None] * k_str[2] + offs_d[None, :] * k_str[3],
                   mask=dmask, other=0.0).to(tl.float32)
    s = tl.sum(qv * kvec, axis=1) * tl.load(edits.QMUL + b * H + h, mask=live, other=0.0)
    if SF.HAS_SOFTCAP:
        s = _softcap(s, softcap)
    if SF.HAS_SZ:
        sz = tl.load(edits.SZ + b * H + h, mask=live, other=0)
        s = tl.where(sz != 0, 0.0, s)
    if SF.HAS_KB:
        for t_ in range(0, NKS):
            start = tl.load(edits.KSPAN + b * NKS * 2 + t_ * 2, mask=live, other=0)
            end = tl.load(edits.KSPAN + b * NKS * 2 + t_ * 2 + 1, mask=live, other=0)
            bias = tl.load(edits.KBIAS + (b * H + h) * NKS + t_, mask=live, other=0.0)
            s = s + tl.where((j >= start) & (j < end), bias, 0.0)
    valid = _visible(live, i + (Nk - Nq), j, window, SF)
    if SF.HAS_KPM:
        valid = valid & (tl.load(masks.KPM + b * strides.kpm + j, mask=live, other=0) != 0)
    if SF.HAS_AM:
        am = tl.load(masks.AM + b * am_str[0] + h * am_str[1] + i * am_str[2] + j * am_str[3], mask=live, other=0)
        valid = valid & (am != 0)
    row = (b * H + h) * Nq + i
    m = tl.load(ML + row * 2, mask=live, other=0.0)
    lsum = tl.load(ML + row * 2 + 1, mask=live, other=0.0)
    m = tl.where(m == float("-inf"), 0.0, m)
    ok = valid & (lsum > 0.0)
    p = tl.exp(tl.where(ok, s - m, 0.0)) / tl.where(ok, lsum, 1.0)
    tl.store(OUT + (b * H + h) * pairs.slots + slot, tl.where(ok, p, 0.0), mask=live)


# --------------------------------------------------------------------------- host side
class _Launch(NamedTuple):
    """How one call runs: tiles, query blocks, key splits (flash-decoding) and the dot precision."""

    blocks: Blocks
    n_mblocks: int
    num_splits: int
    split_len: int
    ieee: bool

    @property
    def split(self) -> bool:
        return self.num_splits > 1


class _Inputs(NamedTuple):
    """The kernel inputs of one call; a feature that is off gets a one-element placeholder its flag never
    reads."""

    edits: Edits
    masks: Masks
    strides: Strides
    dims: Dims
    flags: ScoreFlags
    softcap: float  # 1.0 when off
    window: int  # 0 when off
    pairs: tuple[Tensor, Tensor, Tensor, Tensor] | None  # flat pairs (b, slot, i, j), when any is in range


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(max(1, int(x))))


def _width(t: Tensor | None) -> int:
    """Columns (spans, offsets) of an optional (B, n, ...) request."""
    return 0 if t is None else t.shape[1]


def _num_splits(q: Tensor, B: int, H: int, Nk: int, n_mblocks: int, pattern: bool) -> int:
    """Key splits of a flash-decoding launch: one, unless a single query block meets >= 1024 keys."""
    if n_mblocks > 1 or pattern or Nk < 1024:
        return 1
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
    return max(1, min(triton.cdiv(Nk, 512), triton.cdiv(2 * sms, B * H)))


def _launch_plan(q: Tensor, k: Tensor, v: Tensor, edits: HeadEdits, probes: ProbeRequest, block_m: int | None,
                 block_n: int | None, num_splits: int | None) -> _Launch:
    """Tile sizes, key splits and dot precision of one call."""
    B, H, Nq, D = q.shape
    Nk, Dv = k.shape[2], v.shape[3]
    # float32 dots in IEEE precision for float32 inputs (no TF32), and for every dtype under the CPU
    # interpreter, whose bfloat16 tl.dot is wrong (triton 3.x); half inputs on CUDA use native dots
    ieee = q.dtype == torch.float32 or not q.is_cuda
    BLOCK_M = block_m or (16 if Nq <= 16 else 64)
    BLOCK_N = block_n or (32 if not q.is_cuda else 64)
    BLOCK_D, BLOCK_DV = _pow2(D), _pow2(Dv)
    if q.is_cuda and BLOCK_D >= 128 and ieee:
        BLOCK_M = min(BLOCK_M, 32)
    n_mblocks = triton.cdiv(Nq, BLOCK_M)
    if num_splits is None:
        num_splits = _num_splits(q, B, H, Nk, n_mblocks, probes.pattern)
    split = num_splits > 1
    split_len = triton.cdiv(triton.cdiv(Nk, num_splits), BLOCK_N) * BLOCK_N if split else Nk
    num_splits = triton.cdiv(Nk, split_len) if split else 1
    blocks = Blocks(BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, _pow2(_width(edits.key_spans)), _pow2(_width(probes.spans)),
                    _pow2(_width(probes.offsets)))
    return _Launch(blocks, n_mblocks, num_splits, split_len, ieee)


def _placeholder(dtype, device) -> Tensor:
    return torch.zeros(1, dtype=dtype, device=device)


def _inputs(q: Tensor, k: Tensor, v: Tensor, out: Tensor, edits: HeadEdits, probes: ProbeRequest, *, scale: float,
            causal: bool, key_padding_mask: Tensor | None, attn_mask: Tensor | None, softcap: float | None,
            window: int | None, ieee: bool) -> _Inputs:
    """Edits, masks, strides, sizes, score flags and flat pairs of one call, as the kernels take them."""
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    dev = q.device
    f32 = torch.float32
    none_f, none_i = _placeholder(f32, dev), _placeholder(torch.int32, dev)

    def given(t: Tensor | None, dtype) -> Tensor:
        return none_i if t is None else t.to(dtype).contiguous()

    qmul = torch.full((B, H), scale, dtype=f32, device=dev)
    if edits.q_scale is not None:
        qmul = (qmul * edits.q_scale).contiguous()
    kernel_edits = Edits(
        QMUL=qmul,
        SZ=given(edits.score_zero, torch.int8),
        OSC=none_f if edits.out_scale is None else edits.out_scale.contiguous(),
        KSPAN=given(edits.key_spans, torch.int32),
        KBIAS=none_f if edits.key_spans is None else edits.key_bias.to(f32).contiguous(),
    )
    kpm = given(key_padding_mask, torch.int8)
    if attn_mask is not None:
        am = attn_mask.to(torch.int8)
        am = am.expand(B, am.shape[1], Nq, Nk)
        am_str = (am.stride(0), 0 if am.shape[1] == 1 else am.stride(1), am.stride(2), am.stride(3))
    else:
        am, am_str = none_i, (0, 0, 0, 0)
    strides = Strides(q.stride(), k.stride(), v.stride(), out.stride(), am_str,
                      0 if key_padding_mask is None else kpm.stride(0))
    NKS = _width(edits.key_spans)
    dims = Dims(H, H // Hkv, Nq, Nk, D, Dv, NKS, _width(probes.spans), _width(probes.offsets))
    flags = ScoreFlags(
        HAS_SZ=edits.score_zero is not None, HAS_KB=NKS > 0, HAS_KPM=key_padding_mask is not None,
        HAS_AM=attn_mask is not None, CAUSAL=bool(causal), HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None, IEEE=ieee,
    )
    flat = flat_pairs(probes.pairs, Nq, Nk) if probes.pairs is not None else None
    return _Inputs(kernel_edits, Masks(kpm, am), strides, dims, flags,
                   float(softcap) if softcap is not None else 1.0, int(window) if window is not None else 0,
                   flat if flat is not None and flat[0].numel() > 0 else None)


def _buffers(q: Tensor, probes: ProbeRequest, inputs: _Inputs, launch: _Launch) -> Probes:
    """The probe inputs and the buffers the forward kernel writes: one row per (batch row, head, query), per
    key split when split, and the pattern."""
    d = inputs.dims
    dev = q.device
    f32 = torch.float32
    none_f, none_i = _placeholder(f32, dev), _placeholder(torch.int32, dev)
    rows = q.shape[0] * d.H * d.Nq
    nrow = launch.num_splits * rows if launch.split else rows

    def rows_of(on: bool, *cols: int, dtype=f32) -> Tensor:
        return torch.empty(nrow, *cols, dtype=dtype, device=dev) if on else (none_f if dtype == f32 else none_i)

    return Probes(
        PSPAN=none_i if probes.spans is None else probes.spans.to(torch.int32).contiguous(),
        POFF=none_i if probes.offsets is None else probes.offsets.to(torch.int32).contiguous(),
        ARGI=rows_of(probes.argmax, dtype=torch.int32),
        ARGS=rows_of(probes.argmax),
        FENT=rows_of(probes.entropy or launch.split),
        SPM=rows_of(d.NPS > 0, d.NPS),
        OFM=rows_of(d.NOS > 0, d.NOS),
        PAT=torch.zeros(q.shape[0], d.H, d.Nq, d.Nk, dtype=f32, device=dev) if probes.pattern else none_f,
        ML=rows_of(launch.split or inputs.pairs is not None, 2),
        ACC=rows_of(launch.split, d.Dv),
    )


def _launch_forward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, edits: HeadEdits, probes: ProbeRequest,
                    inputs: _Inputs, bufs: Probes, launch: _Launch) -> None:
    """Run the forward kernel: one program per (query block, batch row * head, key split)."""
    d = inputs.dims
    flags = OutputFlags(
        HAS_OS=edits.out_scale is not None, PROBE_ARGMAX=bool(probes.argmax), PROBE_ENT=bool(probes.entropy),
        HAS_PS=d.NPS > 0, HAS_PO=d.NOS > 0, RETURN_PATTERN=bool(probes.pattern), SPLIT=launch.split,
        STORE_ML=inputs.pairs is not None and not launch.split,
    )
    _attn_fwd[(launch.n_mblocks, q.shape[0] * d.H, launch.num_splits)](
        q, k, v, out, inputs.strides, inputs.edits, inputs.masks, bufs, d, inputs.softcap, inputs.window,
        launch.split_len, SF=inputs.flags, OF=flags, BLK=launch.blocks,
    )


def _combine(bufs: Probes, B: int, d: Dims, n_split: int, probes: ProbeRequest):
    """Merge per-split partial softmax statistics (flash-decoding): the output, the probes, and the rows'
    merged (max, normaliser) (B * H * Nq, 2)."""
    H, Nq, Dv = d.H, d.Nq, d.Dv
    rows = B * H * Nq
    ml = bufs.ML.view(n_split, rows, 2)
    m = ml[..., 0].view(n_split, B, H, Nq)
    lp = ml[..., 1].view(n_split, B, H, Nq)
    mx = m.amax(0)
    mxs = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    w = torch.exp(m - mxs)  # 0 for empty splits
    lt = (w * lp).sum(0)
    empty = lt == 0
    lsafe = torch.where(empty, torch.ones_like(lt), lt)
    o = (w[..., None] * bufs.ACC.view(n_split, B, H, Nq, Dv)).sum(0) / lsafe[..., None]
    stats = AttentionStats()
    if probes.argmax:
        bs = bufs.ARGS.view(n_split, B, H, Nq)
        bi = bufs.ARGI.view(n_split, B, H, Nq)
        sel = bs.argmax(0, keepdim=True)  # first split on ties: earliest keys
        best = bs.gather(0, sel)[0]
        stats.argmax = torch.where(empty, torch.full_like(lt, -1, dtype=torch.long), bi.gather(0, sel)[0].long())
        stats.argmax_prob = torch.where(empty, torch.zeros_like(lt), torch.exp(best - mxs) / lsafe)
    if probes.entropy:
        ms = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        f = bufs.FENT.view(n_split, B, H, Nq)
        ftot = (w * (f + lp * (ms - mxs))).sum(0)
        stats.entropy = torch.where(empty, torch.zeros_like(lt), torch.log(lsafe) - ftot / lsafe)
    if d.NPS > 0:
        spm = bufs.SPM.view(n_split, rows, d.NPS)
        stats.span_mass = (w[..., None] * spm.view(n_split, B, H, Nq, d.NPS)).sum(0) / lsafe[..., None]
    if d.NOS > 0:
        ofm = bufs.OFM.view(n_split, rows, d.NOS)
        stats.offset_mass = (w[..., None] * ofm.view(n_split, B, H, Nq, d.NOS)).sum(0) / lsafe[..., None]
    return o, stats, torch.stack([mxs, lt], -1).reshape(rows, 2)


def _stats(out: Tensor, edits: HeadEdits, probes: ProbeRequest, inputs: _Inputs, bufs: Probes,
           launch: _Launch) -> tuple[Tensor, AttentionStats, Tensor]:
    """The output and the probes from the kernel's buffers (merging the key splits), and the rows' final
    (max, normaliser) (B * H * Nq, 2) for the pair kernel."""
    d = inputs.dims
    B = out.shape[0]
    f32 = torch.float32
    ml = bufs.ML
    if launch.split:
        o, stats, ml = _combine(bufs, B, d, launch.num_splits, probes)
        if edits.out_scale is not None:
            o = o * edits.out_scale[:, :, None, None]
        out = o.to(out.dtype)
    else:
        stats = AttentionStats()
        if probes.argmax:
            stats.argmax = bufs.ARGI.view(B, d.H, d.Nq).long()
            stats.argmax_prob = bufs.ARGS.view(B, d.H, d.Nq)
        if probes.entropy:
            stats.entropy = bufs.FENT.view(B, d.H, d.Nq)
        if d.NPS > 0:
            stats.span_mass = bufs.SPM.view(B, d.H, d.Nq, d.NPS)
        if d.NOS > 0:
            stats.offset_mass = bufs.OFM.view(B, d.H, d.Nq, d.NOS)
    if probes.spans is not None and d.NPS == 0:
        stats.span_mass = torch.zeros(B, d.H, d.Nq, 0, dtype=f32, device=out.device)
    if probes.offsets is not None and d.NOS == 0:
        stats.offset_mass = torch.zeros(B, d.H, d.Nq, 0, dtype=f32, device=out.device)
    if probes.pattern:
        stats.pattern = bufs.PAT
    return out, stats, ml


def _pair_masses(q: Tensor, k: Tensor, probes: ProbeRequest, inputs: _Inputs, ml: Tensor,
                 launch: _Launch) -> Tensor:
    """(B, H, P) attention at the requested pairs from the rows' final (max, normaliser) ``ml``."""
    d = inputs.dims
    n_slots = probes.pairs.shape[1]
    pair_mass = torch.zeros(q.shape[0], d.H, n_slots, dtype=torch.float32, device=q.device)
    if inputs.pairs is not None:
        fb, fp, fq, fk = inputs.pairs
        BLOCK_PAIRS = 64
        _pair_fwd[(triton.cdiv(fb.numel(), BLOCK_PAIRS), d.H)](
            q, k, inputs.strides, Pairs(fb, fq, fk, fp, fb.numel(), n_slots), inputs.edits, inputs.masks, ml,
            pair_mass, d, inputs.softcap, inputs.window, SF=inputs.flags, BLOCK=BLOCK_PAIRS, BLOCK_D=launch.blocks.D,
        )
    return pair_mass


def triton_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    edits: HeadEdits,
    probes: ProbeRequest,
    *,
    scale: float,
    causal: bool = True,
    key_padding_mask: Tensor | None = None,
    attn_mask: Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
) -> tuple[Tensor, AttentionStats]:
    """The Triton path of :func:`~headlab.kernels.attention` (checked ``edits`` and ``probes``:
    :func:`~headlab.kernels.contract.requests`). ``block_m``, ``block_n``: tile sizes; ``num_splits``: key
    splits of the flash-decoding path (default: chosen from the shape)."""
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError("triton path: q, k, v must share a dtype")
    launch = _launch_plan(q, k, v, edits, probes, block_m, block_n, num_splits)
    out = torch.empty(*q.shape[:3], v.shape[3], dtype=q.dtype, device=q.device)
    inputs = _inputs(q, k, v, out, edits, probes, scale=scale, causal=causal, key_padding_mask=key_padding_mask,
                     attn_mask=attn_mask, softcap=softcap, window=window, ieee=launch.ieee)
    bufs = _buffers(q, probes, inputs, launch)
    _launch_forward(q, k, v, out, edits, probes, inputs, bufs, launch)
    out, stats, ml = _stats(out, edits, probes, inputs, bufs, launch)
    if probes.pairs is not None:
        stats.pair_mass = _pair_masses(q, k, probes, inputs, ml, launch)
    return out, stats
