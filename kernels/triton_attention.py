"""FlashAttention-2-style Triton kernel with head edits and streaming probes.

Laid out like Triton's fused-attention tutorial: :func:`_attn_fwd` is one program per (``BLOCK_M`` queries,
batch row, query head); it loads its query tile and per-head edits, then :func:`_attn_fwd_inner` walks the
visible key tiles with an online softmax, and an epilogue writes the results. In the same pass the kernel
applies the edits (query scale, score zeroing, additive key-span biases, softcap, causal / window / padding /
general masks; :func:`_scores`) and accumulates the probes:

- argmax: running maximum score and its key index (strictly greater wins, so the first key on ties);
- entropy: ``F = sum_j p_j (s_j - m)`` rescaled when the running max ``m`` moves, ``H = log l - F / l``;
- span masses: ``sum_j p_j [j in span]`` as a (BLOCK_M, BLOCK_P) accumulator, rescaled like the output;
- offset masses: ``p_j`` at the key ``j = q_pos - delta`` for each probe offset ``delta``, a
  (BLOCK_M, BLOCK_O) accumulator rescaled like the span masses (an offset touches at most two key tiles of
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
Hopper. Strides travel as ``(batch, head, position, dim)`` tuples (triton >= 3.3).

Runs on CUDA, and on CPU under ``TRITON_INTERPRET=1`` (set before triton is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .attention import AttentionStats, HeadEdits, ProbeRequest, _requests, flat_pairs


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
def _key_range(pid_m, pid_s, Nq, Nk, window, split_len,
               CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr):
    """Key range ``[lo, hi)`` a query block can see (and, split, the part of it this split owns), and the
    key coordinates of the block's first and last query."""
    m_first = pid_m * BLOCK_M + (Nk - Nq)
    m_last = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, Nq - 1) + (Nk - Nq)
    lo = 0
    hi = Nk
    if CAUSAL:
        hi = tl.minimum(Nk, m_last + 1)
    if HAS_WINDOW:
        lo = tl.maximum(0, m_first - window + 1)
        if not CAUSAL:
            hi = tl.minimum(Nk, m_last + window)
    if SPLIT:
        lo = tl.maximum(lo, pid_s * split_len)
        hi = tl.minimum(hi, pid_s * split_len + split_len)
    return lo, hi, m_first, m_last


@triton.jit
def _scores(
    q, qmul, sz, ks_start, ks_end, kb_vals,     # query tile and this head's edits
    K_head, k_str, KPM_row, AM_head, am_str,    # keys and masks of this (row, head)
    offs_m, offs_n, offs_d, q_abs, n_end, Nq, D, softcap, window,
    HAS_SZ: tl.constexpr, HAS_KB: tl.constexpr, HAS_KPM: tl.constexpr, HAS_AM: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
):
    """Edited scores ``s`` (BLOCK_M, BLOCK_N) of the key tile ``offs_n`` (keys ``>= n_end`` are outside)
    and the visibility mask; invisible scores are ``-inf``."""
    kt_ptrs, kt_mask = _tile(K_head, offs_d, offs_n, k_str[3], k_str[2], D, n_end)
    kt = tl.load(kt_ptrs, mask=kt_mask, other=0.0)  # K^T: (BLOCK_D, BLOCK_N)
    if IEEE:
        s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    s = s * qmul
    if HAS_SOFTCAP:
        x = s / softcap
        ax = tl.abs(x)
        t = tl.exp(-2.0 * ax)
        th = (1.0 - t) / (1.0 + t)
        s = softcap * tl.where(x < 0, -th, th)
    if HAS_SZ:
        s = tl.where(sz != 0, 0.0, s)
    if HAS_KB:
        ins = (offs_n[:, None] >= ks_start[None, :]) & (offs_n[:, None] < ks_end[None, :])
        kbv = tl.sum(tl.where(ins, kb_vals[None, :], 0.0), axis=1)
        s = s + kbv[None, :]
    kmask = offs_n < n_end
    valid = kmask[None, :] & (offs_m[:, None] >= 0)
    if CAUSAL:
        valid = valid & (offs_n[None, :] <= q_abs[:, None])
    if HAS_WINDOW:
        valid = valid & ((q_abs[:, None] - offs_n[None, :]) < window)
        if not CAUSAL:
            valid = valid & ((offs_n[None, :] - q_abs[:, None]) < window)
    if HAS_KPM:
        kp = tl.load(KPM_row + offs_n, mask=kmask, other=0)
        valid = valid & (kp != 0)[None, :]
    if HAS_AM:
        # rows past the last query read as masked (they are never stored)
        am_ptrs, am_mask = _tile(AM_head, offs_m, offs_n, am_str[2], am_str[3], Nq, n_end)
        am = tl.load(am_ptrs, mask=am_mask, other=0)
        valid = valid & (am != 0)
    s = tl.where(valid, s, float("-inf"))
    return s, valid


@triton.jit
def _attn_fwd_inner(
    m_i, l_i, f_i, acc, best_s, best_i, sacc, oacc,          # running state, rescaled as m_i moves
    q, qmul, sz, ks_start, ks_end, kb_vals, ps_start, ps_end,
    K_head, V_head, k_str, v_str, KPM_row, AM_head, am_str, POFF_row,
    offs_m, offs_d, q_abs, m_first, m_last, lo, hi, Nq, Nk, D, Dv, NOS, softcap, window,
    HAS_SZ: tl.constexpr, HAS_KB: tl.constexpr, HAS_KPM: tl.constexpr, HAS_AM: tl.constexpr,
    HAS_PS: tl.constexpr, HAS_PO: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, PROBE_ARGMAX: tl.constexpr, PROBE_ENT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_O: tl.constexpr,
):
    """Online softmax over the key tiles ``[lo, hi)``: returns the updated state."""
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_o = tl.arange(0, BLOCK_O)
    n_end = tl.minimum(Nk, hi)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        s, valid = _scores(
            q, qmul, sz, ks_start, ks_end, kb_vals, K_head, k_str, KPM_row, AM_head, am_str,
            offs_m, offs_n, offs_d, q_abs, n_end, Nq, D, softcap, window,
            HAS_SZ, HAS_KB, HAS_KPM, HAS_AM, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, IEEE,
        )
        tile_max = tl.max(s, axis=1)
        m_new = tl.maximum(m_i, tile_max)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        if PROBE_ENT:
            m_old = tl.where(m_i == float("-inf"), m_safe, m_i)
            d = tl.where(valid, s - m_safe[:, None], 0.0)
            f_i = alpha * (f_i + l_i * (m_old - m_safe)) + tl.sum(p * d, axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_ptrs, v_mask = _tile(V_head, offs_n, offs_dv, v_str[2], v_str[3], Nk, Dv)
        vt = tl.load(v_ptrs, mask=v_mask, other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, vt.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        if PROBE_ARGMAX:
            tidx = tl.argmax(s, axis=1).to(tl.int32) + start
            upd = tile_max > best_s
            best_s = tl.where(upd, tile_max, best_s)
            best_i = tl.where(upd, tidx, best_i)
        if HAS_PS:
            pin = ((offs_n[:, None] >= ps_start[None, :]) & (offs_n[:, None] < ps_end[None, :])).to(tl.float32)
            sacc = sacc * alpha[:, None] + tl.dot(p, pin, input_precision="ieee")
        if HAS_PO:
            oacc = oacc * alpha[:, None]
            rel = q_abs[:, None] - offs_n[None, :]  # query position - key position
            for o in range(0, NOS):
                dlt = tl.load(POFF_row + o)
                # the keys q_pos - dlt of this query block lie in [m_first - dlt, m_last - dlt]
                if (dlt >= 0) & (start <= m_last - dlt) & (start + BLOCK_N > m_first - dlt):
                    hit = tl.sum(tl.where(rel == dlt, p, 0.0), axis=1)
                    oacc = oacc + tl.where(offs_o[None, :] == o, hit[:, None], 0.0)
        m_i = m_new
    return m_i, l_i, f_i, acc, best_s, best_i, sacc, oacc


@triton.jit
def _write_pattern(
    PAT_rows, m_i, l_safe, empty,
    q, qmul, sz, ks_start, ks_end, kb_vals, K_head, k_str, KPM_row, AM_head, am_str,
    offs_m, offs_d, q_abs, lo, hi, Nq, Nk, D, softcap, window,
    HAS_SZ: tl.constexpr, HAS_KB: tl.constexpr, HAS_KPM: tl.constexpr, HAS_AM: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Second sweep over the key tiles: the normalised attention ``exp(s - m) / l`` into the (Nq, Nk)
    pattern rows ``PAT_rows`` of this (row, head)."""
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    inv = tl.where(empty, 0.0, 1.0 / l_safe)
    n_end = tl.minimum(Nk, hi)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        s, valid = _scores(
            q, qmul, sz, ks_start, ks_end, kb_vals, K_head, k_str, KPM_row, AM_head, am_str,
            offs_m, offs_n, offs_d, q_abs, n_end, Nq, D, softcap, window,
            HAS_SZ, HAS_KB, HAS_KPM, HAS_AM, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, IEEE,
        )
        a = tl.exp(s - m_safe[:, None]) * inv[:, None]
        ptrs, mask = _tile(PAT_rows, offs_m, offs_n, Nk, 1, Nq, n_end)
        tl.store(ptrs, a, mask=mask)


@triton.jit
def _store_partials(
    row0, offs_m, Nq, m_i, l_i, f_i, acc, best_s, best_i, sacc, oacc,
    ML, FENT, ACC, ARGS, ARGI, SPM, OFM, Dv, NPS, NOS,
    PROBE_ARGMAX: tl.constexpr, HAS_PS: tl.constexpr, HAS_PO: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_O: tl.constexpr,
):
    """A key split's unnormalised state, rows ``row0 + offs_m`` of the (n_split * B * H * Nq, ...) buffers."""
    mrow = offs_m < Nq
    prow = row0 + offs_m
    tl.store(ML + prow * 2, m_i, mask=mrow)
    tl.store(ML + prow * 2 + 1, l_i, mask=mrow)
    tl.store(FENT + prow, f_i, mask=mrow)
    ptrs, mask = _tile(ACC + row0 * Dv, offs_m, tl.arange(0, BLOCK_DV), Dv, 1, Nq, Dv)
    tl.store(ptrs, acc, mask=mask)
    if PROBE_ARGMAX:
        tl.store(ARGS + prow, best_s, mask=mrow)
        tl.store(ARGI + prow, best_i, mask=mrow)
    if HAS_PS:
        ptrs, mask = _tile(SPM + row0 * NPS, offs_m, tl.arange(0, BLOCK_P), NPS, 1, Nq, NPS)
        tl.store(ptrs, sacc, mask=mask)
    if HAS_PO:
        ptrs, mask = _tile(OFM + row0 * NOS, offs_m, tl.arange(0, BLOCK_O), NOS, 1, Nq, NOS)
        tl.store(ptrs, oacc, mask=mask)


@triton.jit
def _store_results(
    row0, offs_m, Nq, l_safe, empty, m_i, f_i, acc, best_s, best_i, sacc, oacc, osc,
    Out_head, o_str, ARGI, ARGS, FENT, SPM, OFM, Dv, NPS, NOS,
    HAS_OS: tl.constexpr, PROBE_ARGMAX: tl.constexpr, PROBE_ENT: tl.constexpr, HAS_PS: tl.constexpr,
    HAS_PO: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_O: tl.constexpr,
):
    """Normalised output ``z`` (times the output scale) and probes, rows ``row0 + offs_m`` of the
    (B * H * Nq, ...) probe buffers."""
    mrow = offs_m < Nq
    row = row0 + offs_m
    o = acc / l_safe[:, None]
    if HAS_OS:
        o = o * osc
    ptrs, mask = _tile(Out_head, offs_m, tl.arange(0, BLOCK_DV), o_str[2], o_str[3], Nq, Dv)
    tl.store(ptrs, o.to(Out_head.dtype.element_ty), mask=mask)
    if PROBE_ARGMAX:
        tl.store(ARGI + row, tl.where(empty, -1, best_i), mask=mrow)
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        tl.store(ARGS + row, tl.where(empty, 0.0, tl.exp(best_s - m_safe) / l_safe), mask=mrow)
    if PROBE_ENT:
        ent = tl.where(empty, 0.0, tl.log(l_safe) - f_i / l_safe)
        tl.store(FENT + row, ent, mask=mrow)
    if HAS_PS:
        ptrs, mask = _tile(SPM + row0 * NPS, offs_m, tl.arange(0, BLOCK_P), NPS, 1, Nq, NPS)
        tl.store(ptrs, sacc / l_safe[:, None], mask=mask)
    if HAS_PO:
        ptrs, mask = _tile(OFM + row0 * NOS, offs_m, tl.arange(0, BLOCK_O), NOS, 1, Nq, NOS)
        tl.store(ptrs, oacc / l_safe[:, None], mask=mask)


@triton.jit
def _attn_fwd(
    # q (B, H, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv), out (B, H, Nq, Dv); (batch, head, pos, dim) strides
    Q, K, V, Out, q_str, k_str, v_str, o_str,
    # head edits: (B, H) query multiplier (scale * q_scale), score-zero flags, output scales;
    # (B, S, 2) key spans with their (B, H, S) biases
    QMUL, SZ, OSC, KSPAN, KBIAS,
    # masks: (B, Nk) key padding and its batch stride; general (B, H|1, Nq, Nk) mask and its strides
    KPM, kpm_str, AM, am_str,
    # probes: (B, P, 2) spans and (B, O) offsets in; per query row out; a key split's partial state
    PSPAN, POFF, ARGI, ARGS, FENT, SPM, OFM, PAT, ML, ACC,
    # sizes and scalars
    H, G, Nq, Nk, D, Dv, NKS, NPS, NOS, softcap, window, split_len,
    # what to compute: each flag compiles its code in or out
    HAS_SZ: tl.constexpr, HAS_OS: tl.constexpr, HAS_KPM: tl.constexpr, HAS_AM: tl.constexpr,
    HAS_KB: tl.constexpr, HAS_PS: tl.constexpr, HAS_PO: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PROBE_ARGMAX: tl.constexpr, PROBE_ENT: tl.constexpr,
    RETURN_PATTERN: tl.constexpr, SPLIT: tl.constexpr, STORE_ML: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_O: tl.constexpr,
):
    """One program: ``BLOCK_M`` queries of one (batch row, query head), one key split (axis 2)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // G  # the kv head this query head reads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_abs = offs_m + (Nk - Nq)  # the queries' own key coordinates

    # this program's query tile and the edits of its (row, head)
    q_ptrs, q_mask = _tile(Q + b * q_str[0] + h * q_str[1], offs_m, offs_d, q_str[2], q_str[3], Nq, D)
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    if IEEE:
        q = q.to(tl.float32)
    qmul = tl.load(QMUL + b * H + h)
    sz = 0
    if HAS_SZ:
        sz = tl.load(SZ + b * H + h)
    ks_start = tl.arange(0, BLOCK_S)
    ks_end = ks_start
    kb_vals = tl.zeros([BLOCK_S], dtype=tl.float32)
    if HAS_KB:
        ks_start, ks_end = _load_spans(KSPAN, b, NKS, BLOCK_S)
        offs_s = tl.arange(0, BLOCK_S)
        kb_vals = tl.load(KBIAS + (b * H + h) * NKS + offs_s, mask=offs_s < NKS, other=0.0)
    ps_start = tl.arange(0, BLOCK_P)
    ps_end = ps_start
    if HAS_PS:
        ps_start, ps_end = _load_spans(PSPAN, b, NPS, BLOCK_P)

    # the keys, values and masks of this (row, head)
    K_head = K + b * k_str[0] + hk * k_str[1]
    V_head = V + b * v_str[0] + hk * v_str[1]
    KPM_row = KPM + b * kpm_str
    AM_head = AM + b * am_str[0] + h * am_str[1]
    lo, hi, m_first, m_last = _key_range(pid_m, pid_s, Nq, Nk, window, split_len,
                                         CAUSAL, HAS_WINDOW, SPLIT, BLOCK_M)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    f_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    best_s = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    best_i = tl.full([BLOCK_M], -1, dtype=tl.int32)
    sacc = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
    oacc = tl.zeros([BLOCK_M, BLOCK_O], dtype=tl.float32)
    m_i, l_i, f_i, acc, best_s, best_i, sacc, oacc = _attn_fwd_inner(
        m_i, l_i, f_i, acc, best_s, best_i, sacc, oacc,
        q, qmul, sz, ks_start, ks_end, kb_vals, ps_start, ps_end,
        K_head, V_head, k_str, v_str, KPM_row, AM_head, am_str, POFF + b * NOS,
        offs_m, offs_d, q_abs, m_first, m_last, lo, hi, Nq, Nk, D, Dv, NOS, softcap, window,
        HAS_SZ, HAS_KB, HAS_KPM, HAS_AM, HAS_PS, HAS_PO, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, PROBE_ARGMAX,
        PROBE_ENT, IEEE, BLOCK_N, BLOCK_DV, BLOCK_O,
    )

    row0 = (b * H + h) * Nq  # first row of this (row, head) in the (B * H * Nq, ...) probe buffers
    if SPLIT:
        _store_partials(
            pid_s * (tl.num_programs(1) * Nq) + row0, offs_m, Nq, m_i, l_i, f_i, acc, best_s, best_i, sacc,
            oacc, ML, FENT, ACC, ARGS, ARGI, SPM, OFM, Dv, NPS, NOS,
            PROBE_ARGMAX, HAS_PS, HAS_PO, BLOCK_DV, BLOCK_P, BLOCK_O,
        )
    else:
        if STORE_ML:  # the rows' final max and normaliser, for the pair kernel
            mrow = offs_m < Nq
            tl.store(ML + (row0 + offs_m) * 2, m_i, mask=mrow)
            tl.store(ML + (row0 + offs_m) * 2 + 1, l_i, mask=mrow)
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        osc = 1.0
        if HAS_OS:
            osc = tl.load(OSC + b * H + h)
        _store_results(
            row0, offs_m, Nq, l_safe, empty, m_i, f_i, acc, best_s, best_i, sacc, oacc, osc,
            Out + b * o_str[0] + h * o_str[1], o_str, ARGI, ARGS, FENT, SPM, OFM, Dv, NPS, NOS,
            HAS_OS, PROBE_ARGMAX, PROBE_ENT, HAS_PS, HAS_PO, BLOCK_DV, BLOCK_P, BLOCK_O,
        )
        if RETURN_PATTERN:
            _write_pattern(
                PAT + row0 * Nk, m_i, l_safe, empty,
                q, qmul, sz, ks_start, ks_end, kb_vals, K_head, k_str, KPM_row, AM_head, am_str,
                offs_m, offs_d, q_abs, lo, hi, Nq, Nk, D, softcap, window,
                HAS_SZ, HAS_KB, HAS_KPM, HAS_AM, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, IEEE, BLOCK_N,
            )


@triton.jit
def _pair_fwd(
    # q (B, H, Nq, D), k (B, Hkv, Nk, D) and their (batch, head, pos, dim) strides
    Q, K, q_str, k_str,
    # the flat pairs: row b, query i, key j, output slot p (each (n_pairs,) int64)
    FB, FQ, FK, FP, n_pairs,
    # the edits and masks of the attention call (as in _attn_fwd)
    QMUL, SZ, KSPAN, KBIAS, KPM, kpm_str, AM, am_str,
    # (B * H * Nq, 2) final row max and normaliser; (B, H, P) output
    ML, OUT,
    H, G, Nq, Nk, D, NKS, P, softcap, window,
    HAS_SZ: tl.constexpr, HAS_KB: tl.constexpr, HAS_KPM: tl.constexpr, HAS_AM: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``BLOCK`` pairs of one query head: the edited, masked score ``s`` of each pair, then
    ``A = exp(s - m) / l`` with the row's final ``m``, ``l`` (so exactly the softmax of the forward pass)."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    live = offs < n_pairs
    b = tl.load(FB + offs, mask=live, other=0)
    i = tl.load(FQ + offs, mask=live, other=0)
    j = tl.load(FK + offs, mask=live, other=0)
    slot = tl.load(FP + offs, mask=live, other=0)
    hk = h // G
    offs_d = tl.arange(0, BLOCK_D)
    dmask = live[:, None] & (offs_d[None, :] < D)
    qv = tl.load(Q + b[:, None] * q_str[0] + h * q_str[1] + i[:, None] * q_str[2] + offs_d[None, :] * q_str[3],
                 mask=dmask, other=0.0).to(tl.float32)
    kv = tl.load(K + b[:, None] * k_str[0] + hk * k_str[1] + j[:, None] * k_str[2] + offs_d[None, :] * k_str[3],
                 mask=dmask, other=0.0).to(tl.float32)
    s = tl.sum(qv * kv, axis=1) * tl.load(QMUL + b * H + h, mask=live, other=0.0)
    if HAS_SOFTCAP:
        x = s / softcap
        t = tl.exp(-2.0 * tl.abs(x))
        th = (1.0 - t) / (1.0 + t)
        s = softcap * tl.where(x < 0, -th, th)
    if HAS_SZ:
        sz = tl.load(SZ + b * H + h, mask=live, other=0)
        s = tl.where(sz != 0, 0.0, s)
    if HAS_KB:
        for t_ in range(0, NKS):
            start = tl.load(KSPAN + b * NKS * 2 + t_ * 2, mask=live, other=0)
            end = tl.load(KSPAN + b * NKS * 2 + t_ * 2 + 1, mask=live, other=0)
            bias = tl.load(KBIAS + (b * H + h) * NKS + t_, mask=live, other=0.0)
            s = s + tl.where((j >= start) & (j < end), bias, 0.0)
    q_abs = i + (Nk - Nq)
    valid = live
    if CAUSAL:
        valid = valid & (j <= q_abs)
    if HAS_WINDOW:
        valid = valid & ((q_abs - j) < window)
        if not CAUSAL:
            valid = valid & ((j - q_abs) < window)
    if HAS_KPM:
        valid = valid & (tl.load(KPM + b * kpm_str + j, mask=live, other=0) != 0)
    if HAS_AM:
        am = tl.load(AM + b * am_str[0] + h * am_str[1] + i * am_str[2] + j * am_str[3], mask=live, other=0)
        valid = valid & (am != 0)
    row = (b * H + h) * Nq + i
    m = tl.load(ML + row * 2, mask=live, other=0.0)
    lsum = tl.load(ML + row * 2 + 1, mask=live, other=0.0)
    m = tl.where(m == float("-inf"), 0.0, m)
    ok = valid & (lsum > 0.0)
    p = tl.exp(tl.where(ok, s - m, 0.0)) / tl.where(ok, lsum, 1.0)
    tl.store(OUT + (b * H + h) * P + slot, tl.where(ok, p, 0.0), mask=live)


# --------------------------------------------------------------------------- host side
def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(max(1, int(x))))


def _combine(B: int, H: int, Nq: int, Dv: int, n_split: int, ml: Tensor, fent: Tensor, acc: Tensor,
             args: Tensor, argi: Tensor, spm: Tensor | None, ofm: Tensor | None, probes: ProbeRequest):
    """Merge per-split partial softmax statistics (flash-decoding): the output and the probes."""
    m = ml[..., 0].view(n_split, B, H, Nq)
    lp = ml[..., 1].view(n_split, B, H, Nq)
    mx = m.amax(0)
    mxs = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    w = torch.exp(m - mxs)  # 0 for empty splits
    lt = (w * lp).sum(0)
    empty = lt == 0
    lsafe = torch.where(empty, torch.ones_like(lt), lt)
    o = (w[..., None] * acc.view(n_split, B, H, Nq, Dv)).sum(0) / lsafe[..., None]
    stats = AttentionStats()
    if probes.argmax:
        bs = args.view(n_split, B, H, Nq)
        bi = argi.view(n_split, B, H, Nq)
        sel = bs.argmax(0, keepdim=True)  # first split on ties: earliest keys
        best = bs.gather(0, sel)[0]
        stats.argmax = torch.where(empty, torch.full_like(lt, -1, dtype=torch.long), bi.gather(0, sel)[0].long())
        stats.argmax_prob = torch.where(empty, torch.zeros_like(lt), torch.exp(best - mxs) / lsafe)
    if probes.entropy:
        ms = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        f = fent.view(n_split, B, H, Nq)
        ftot = (w * (f + lp * (ms - mxs))).sum(0)
        stats.entropy = torch.where(empty, torch.zeros_like(lt), torch.log(lsafe) - ftot / lsafe)
    if spm is not None:
        P = spm.shape[-1]
        stats.span_mass = (w[..., None] * spm.view(n_split, B, H, Nq, P)).sum(0) / lsafe[..., None]
    if ofm is not None:
        n_off = ofm.shape[-1]
        stats.offset_mass = (w[..., None] * ofm.view(n_split, B, H, Nq, n_off)).sum(0) / lsafe[..., None]
    return o, stats, torch.stack([mxs, lt], -1).reshape(B * H * Nq, 2)


def _num_splits(q: Tensor, B: int, H: int, Nk: int, n_mblocks: int, pattern: bool) -> int:
    """Key splits of a flash-decoding launch: one, unless a single query block meets >= 1024 keys."""
    if n_mblocks > 1 or pattern or Nk < 1024:
        return 1
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
    return max(1, min(triton.cdiv(Nk, 512), triton.cdiv(2 * sms, B * H)))


def triton_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    edits: HeadEdits | None = None,
    probes: ProbeRequest | None = None,
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
    **keywords,
) -> tuple[Tensor, AttentionStats]:
    """The Triton path of :func:`~headlab.kernels.attention` (``edits``/``probes`` as checked there, or the
    same keyword convenience). ``block_m``, ``block_n``: tile sizes; ``num_splits``: key splits of the
    flash-decoding path (default: chosen from the shape)."""
    edits, probes = _requests(edits, probes, **keywords)
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    dev = q.device
    f32 = torch.float32
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError("triton path: q, k, v must share a dtype")
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

    # kernel inputs; a feature that is off gets a one-element placeholder its flag never reads
    none_f = torch.zeros(1, dtype=f32, device=dev)
    none_i = torch.zeros(1, dtype=torch.int32, device=dev)

    def given(t: Tensor | None, dtype) -> Tensor:
        return none_i if t is None else t.to(dtype).contiguous()

    qmul = torch.full((B, H), scale, dtype=f32, device=dev)
    if edits.q_scale is not None:
        qmul = (qmul * edits.q_scale).contiguous()
    sz = given(edits.score_zero, torch.int8)
    osc = none_f if edits.out_scale is None else edits.out_scale.contiguous()
    NKS = 0 if edits.key_spans is None else edits.key_spans.shape[1]
    ksp = given(edits.key_spans, torch.int32)
    kb = none_f if edits.key_spans is None else edits.key_bias.to(f32).contiguous()
    kpm = given(key_padding_mask, torch.int8)
    kpm_str = 0 if key_padding_mask is None else kpm.stride(0)
    if attn_mask is not None:
        am = attn_mask.to(torch.int8)
        am = am.expand(B, am.shape[1], Nq, Nk)
        am_str = (am.stride(0), 0 if am.shape[1] == 1 else am.stride(1), am.stride(2), am.stride(3))
    else:
        am, am_str = none_i, (0, 0, 0, 0)
    NPS = 0 if probes.spans is None else probes.spans.shape[1]
    psp = given(probes.spans, torch.int32)
    NOS = 0 if probes.offsets is None else probes.offsets.shape[1]
    pof = given(probes.offsets, torch.int32)
    has_ps, has_po = NPS > 0, NOS > 0
    flat = flat_pairs(probes.pairs, Nq, Nk) if probes.pairs is not None else None
    has_pairs = flat is not None and flat[0].numel() > 0

    # outputs: z, one row per (row, head, query) for the probes (per split: partial state), the pattern
    out = torch.empty(B, H, Nq, Dv, dtype=q.dtype, device=dev)
    rows = B * H * Nq
    nrow = num_splits * rows if split else rows

    def rows_of(on: bool, *cols: int, dtype=f32) -> Tensor:
        return torch.empty(nrow, *cols, dtype=dtype, device=dev) if on else (none_f if dtype == f32 else none_i)

    argi = rows_of(probes.argmax, dtype=torch.int32)
    args = rows_of(probes.argmax)
    fent = rows_of(probes.entropy or split)
    spm = rows_of(has_ps, NPS)
    ofm = rows_of(has_po, NOS)
    ml = rows_of(split or has_pairs, 2)
    acc = rows_of(split, Dv)
    pat = torch.zeros(B, H, Nq, Nk, dtype=f32, device=dev) if probes.pattern else none_f

    _attn_fwd[(n_mblocks, B * H, num_splits)](
        q, k, v, out, q.stride(), k.stride(), v.stride(), out.stride(),
        qmul, sz, osc, ksp, kb,
        kpm, kpm_str, am, am_str,
        psp, pof, argi, args, fent, spm, ofm, pat, ml, acc,
        H, H // Hkv, Nq, Nk, D, Dv, NKS, NPS, NOS,
        float(softcap) if softcap is not None else 1.0, int(window) if window is not None else 0, split_len,
        HAS_SZ=edits.score_zero is not None, HAS_OS=edits.out_scale is not None,
        HAS_KPM=key_padding_mask is not None, HAS_AM=attn_mask is not None, HAS_KB=NKS > 0, HAS_PS=has_ps,
        HAS_PO=has_po, CAUSAL=bool(causal), HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
        PROBE_ARGMAX=bool(probes.argmax), PROBE_ENT=bool(probes.entropy), RETURN_PATTERN=bool(probes.pattern),
        SPLIT=split, STORE_ML=has_pairs and not split, IEEE=ieee,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV,
        BLOCK_S=_pow2(NKS), BLOCK_P=_pow2(NPS), BLOCK_O=_pow2(NOS),
    )
    if split:
        o, stats, ml = _combine(
            B, H, Nq, Dv, num_splits, ml.view(num_splits, rows, 2), fent, acc, args, argi,
            spm.view(num_splits, rows, NPS) if has_ps else None, ofm.view(num_splits, rows, NOS) if has_po else None,
            probes,
        )
        if edits.out_scale is not None:
            o = o * edits.out_scale[:, :, None, None]
        out = o.to(q.dtype)
    else:
        stats = AttentionStats()
        if probes.argmax:
            stats.argmax = argi.view(B, H, Nq).long()
            stats.argmax_prob = args.view(B, H, Nq)
        if probes.entropy:
            stats.entropy = fent.view(B, H, Nq)
        if has_ps:
            stats.span_mass = spm.view(B, H, Nq, NPS)
        if has_po:
            stats.offset_mass = ofm.view(B, H, Nq, NOS)
    if probes.spans is not None and not has_ps:
        stats.span_mass = torch.zeros(B, H, Nq, 0, dtype=f32, device=dev)
    if probes.offsets is not None and not has_po:
        stats.offset_mass = torch.zeros(B, H, Nq, 0, dtype=f32, device=dev)
    if probes.pattern:
        stats.pattern = pat
    if probes.pairs is not None:
        n_slots = probes.pairs.shape[1]
        stats.pair_mass = torch.zeros(B, H, n_slots, dtype=f32, device=dev)
        if has_pairs:
            fb, fp, fq, fk = flat
            BLOCK_PAIRS = 64
            _pair_fwd[(triton.cdiv(fb.numel(), BLOCK_PAIRS), H)](
                q, k, q.stride(), k.stride(), fb, fq, fk, fp, fb.numel(),
                qmul, sz, ksp, kb, kpm, kpm_str, am, am_str, ml, stats.pair_mass,
                H, H // Hkv, Nq, Nk, D, NKS, n_slots,
                float(softcap) if softcap is not None else 1.0, int(window) if window is not None else 0,
                HAS_SZ=edits.score_zero is not None, HAS_KB=NKS > 0, HAS_KPM=key_padding_mask is not None,
                HAS_AM=attn_mask is not None, CAUSAL=bool(causal), HAS_WINDOW=window is not None,
                HAS_SOFTCAP=softcap is not None, BLOCK=BLOCK_PAIRS, BLOCK_D=BLOCK_D,
            )
    return out, stats


__all__ = ["triton_attention"]
